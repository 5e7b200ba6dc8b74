"""One rank of a distributed Trainer (DDP over gloo, on the CPU): ``python dist_trainer_worker.py SPEC RANK``.

The ranks train a tiny GPT-2 with ``IntegrityCallback``; rank 1 writes its part of each
checkpoint (``rng_state_1.pth``) only once rank 0 is in ``on_save`` (rank 0 says so in a file
beside the runs), so a seal that did not wait for every rank would miss it.
Then rank 0 damages the newest checkpoint and every rank asks ``latest_verified_checkpoint``.
A second run in a fresh directory makes the seal fail (rank 1 leaves a file whose name a manifest
cannot hold): every rank must raise the same error, none left waiting. Writes this rank's
outcomes to ``rank<RANK>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_rank import run_rank
from hf_trainer import trainer
from transformers import Trainer, TrainerCallback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME
from integrity_fs.integrations.transformers import IntegrityCallback, latest_verified_checkpoint

BAD_NAME = "bad\\name.bin"


SAVE_RNG_STATE = Trainer._save_rng_state
#: Whether rank 1 also leaves a file whose name no manifest can hold.
BAD = {"name": False}
#: Where rank 0 says it has reached ``on_save`` for a checkpoint (outside every checkpoint).
REACHED: dict[str, Path] = {}


def _reached(output_dir: str | Path) -> Path:
    checkpoint = Path(output_dir)
    return REACHED["dir"] / f"{checkpoint.parent.name}-{checkpoint.name}"


class RankZeroReached(TrainerCallback):
    """Before ``IntegrityCallback``: rank 0 has written its part of the checkpoint and is in ``on_save``."""

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if args.process_index == 0:
            _reached(Path(args.output_dir, f"checkpoint-{state.global_step}")).touch()


def late_rng_state(self: Trainer, output_dir: str) -> None:
    """Rank 1 writes its RNG state once rank 0 is in ``on_save`` and either has sealed the
    checkpoint (which it must not have done) or 1.5 s have passed: ample for a seal that does
    not wait for rank 1 to be written first."""
    if self.args.process_index == 1:
        reached, manifest = _reached(output_dir), Path(output_dir, MANIFEST_FILENAME)
        for _ in range(2400):  # 120 s: rank 0 never getting there fails the launch
            if reached.exists():
                break
            time.sleep(0.05)
        else:
            raise TimeoutError(f"rank 0 never reached on_save for {output_dir}")
        for _ in range(30):
            if manifest.exists():
                break
            time.sleep(0.05)
        if BAD["name"]:
            Path(output_dir, BAD_NAME).write_bytes(b"x")
    SAVE_RNG_STATE(self, output_dir)


Trainer._save_rng_state = late_rng_state  # type: ignore[method-assign]


def torchrun_environment(spec: dict[str, Any], rank: int) -> None:
    """What torchrun sets, from which accelerate learns this rank's place (the group exists already)."""
    host, port = spec["init_method"].removeprefix("tcp://").rsplit(":", 1)
    world = str(spec["world_size"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)


def run_all(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    torchrun_environment(spec, rank)
    out: dict[str, Any] = {}
    root = Path(spec["root"])
    REACHED["dir"] = root / "reached"
    REACHED["dir"].mkdir(exist_ok=True)
    callback = IntegrityCallback()
    run = trainer(root / "run", [RankZeroReached(), callback], max_steps=4, ddp_backend="gloo")
    out["world_size"] = run.args.world_size
    run.train()
    out["sealed"] = callback.sealed
    names = ("checkpoint-2", "checkpoint-4")
    out["files"] = {name: sorted(ifs.read_manifest(root / "run" / name).files) for name in names}
    out["strict"] = [ifs.verify(root / "run" / name, strict=True).ok for name in names]
    dist.barrier()
    if rank == 0:
        with open(root / "run" / "checkpoint-4" / "rng_state_1.pth", "r+b") as f:
            byte = f.read(1)[0]
            f.seek(0)
            f.write(bytes([byte ^ 1]))
    dist.barrier()
    out["latest"] = latest_verified_checkpoint(root / "run")

    BAD["name"] = True
    try:
        trainer(root / "failing", [RankZeroReached(), IntegrityCallback()], max_steps=4, ddp_backend="gloo").train()
        out["failing"] = "trained"
    except Exception as exc:
        out["failing"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    run_rank(run_all)
    # The outcomes are written and the group destroyed. torch 2.13 with gloo now and then aborts a
    # process in the interpreter's teardown ("terminate called without an active exception", seen
    # on rank 0 after the failed run): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
