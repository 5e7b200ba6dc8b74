"""One rank of the "main process only" resume idiom: ``python dist_rank0_latest_worker.py SPEC RANK``
(launched by ``dist_launch.run_ranks``).

Rank 0, before any group exists, prepares a run of two DCP checkpoints (``dcp/step_1`` and
``dcp/step_2``, step_2 then damaged) and two sealed Trainer folders (``hf/checkpoint-2`` and
``hf/checkpoint-4``, checkpoint-4 then damaged). Then, for each of ``integrity_fs.latest_verified``,
``integrity_fs.dcp.load_latest`` (no ``group=``) and
``integrations.transformers.latest_verified_checkpoint``, both ranks join a fresh gloo group and
rank 0 ALONE calls it, as a Trainer script does under ``if trainer.is_world_process_zero():``,
then touches ``done-<i>``; rank 1 never calls any of them: it polls for ``done-<i>`` for
``rank1_waits_s`` at most. A call that waits for rank 1 (a collective) is cut short by the
group's ``pg_timeout_s`` and recorded as what it raised, never as a hang of the test; each call
has a group of its own, so that one cut short does not spoil the next.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import integrity_fs as ifs
from integrity_fs import dcp


def flip(path: Path, offset: int = 100) -> None:
    """One bit of ``path`` flipped, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def prepare(root: Path) -> None:
    for step in (1, 2):
        dcp.save({"w": torch.full((4096,), float(step))}, str(root / "dcp" / f"step_{step}"))
    [data] = [p for p in (root / "dcp" / "step_2").iterdir() if p.suffix == ".distcp"]
    flip(data)
    for step in (2, 4):
        folder = root / "hf" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * (16 * step))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        ifs.seal(folder)
    flip(root / "hf" / "checkpoint-4" / "model.safetensors")


def timed(call: Any) -> dict[str, Any]:
    started = time.monotonic()
    try:
        outcome: dict[str, Any] = {"returned": call()}
    except BaseException as error:  # recorded: a collective cut short raises here
        outcome = {"raised": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome


def calls(root: Path) -> dict[str, Any]:
    """What rank 0 calls, by name: each returns something JSON can hold."""
    from integrity_fs.integrations.transformers import latest_verified_checkpoint

    def latest() -> Any:
        found = ifs.latest_verified(root / "dcp")
        return None if found is None else found[0]

    def load_latest() -> Any:
        state = {"w": torch.zeros(4096)}
        url = dcp.load_latest(state, str(root / "dcp"))
        return {"url": url, "w": sorted(set(state["w"].tolist()))}

    return {
        "latest_verified": latest,
        "load_latest": load_latest,
        "latest_verified_checkpoint": lambda: latest_verified_checkpoint(str(root / "hf")),
    }


def rank1(done: Path, waits: float) -> bool:
    """Something else entirely: no integrity_fs call, no collective; waits for rank 0's word."""
    deadline = time.monotonic() + waits
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return done.exists()


def main() -> None:
    """Each call in a process group of its own (a file store per round), so that a call cut short
    by the group's timeout leaves the next one a working group: each is judged alone."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    root = Path(spec["root"])
    if rank == 0:
        prepare(root)
        todo = calls(root)
        (root / "prepared").touch()
    elif not rank1(root / "prepared", 120):
        raise SystemExit("rank 0 never prepared the checkpoints")
    results: dict[str, Any] = {"calls": {}, "saw_rank0_finish": {}}
    for i, name in enumerate(["latest_verified", "load_latest", "latest_verified_checkpoint"]):
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root}/store-{i}",
            rank=rank,
            world_size=spec["world_size"],
            timeout=timedelta(seconds=spec["pg_timeout_s"]),
        )
        done = root / f"done-{i}"
        if rank == 0:
            results["calls"][name] = timed(todo[name])
            done.touch()
        else:
            results["saw_rank0_finish"][name] = rank1(done, spec["rank1_waits_s"])
        dist.destroy_process_group()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
