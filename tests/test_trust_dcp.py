"""Issue 36, the findings on dcp, the collectives and the transformers callback (6, 17, 18, 20, 22
for dcp's flags, 24, 25, 27): each behaviour SPEC requires, through the public API on the backend
where it lives (local disk, an fsspec filesystem registered for the test, gloo ranks, a real
Trainer).

- 6: ``IntegrityCallback(keep_last=)`` with ``save_on_each_node=True``: each node's local rank 0
  seals and prunes its own disk; training does not die on "ranks see different files".
- 17: damage in any file DCP reads raises, whatever DCP does with the exception (its fallback from
  ``.metadata`` to ``__0.metadata``), and a damaged file is never counted as checked.
- 18: ``dcp.load`` through ``simplecache::``, ``filecache::``, ``blockcache::`` loads, verified.
- 20: ``dcp.load_latest`` raises ``PartialLoadError`` (chained to the storage error) whenever the
  state dict holds bytes that nothing verified loaded over.
- 22: dcp's flags are ``bool`` and its counts ``int``, or ``TypeError`` before anything happens.
- 24: ``latest_verified``, ``dcp.load_latest`` and ``latest_verified_checkpoint`` are local calls
  whatever process group exists (rank 0 alone calls them and never waits for rank 1).
- 25: ``IntegrityCallback`` seals only bytes the save wrote (a leftover leaves the folder unsealed).
- 27: ``IntegrityCallback(keep_last=)`` takes rotation over from ``save_total_limit``.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fork_server
import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, PartialLoadError

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRAINER = HAS_TORCH and all(importlib.util.find_spec(m) for m in ("transformers", "accelerate"))
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is an optional dependency")
needs_trainer = pytest.mark.skipif(not HAS_TRAINER, reason="torch, transformers and accelerate are optional")
CHUNK = 64 * 1024


def _flip(path: Path, offset: int = 3) -> None:
    """One bit of ``path`` flipped in place, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(offset, 2 if offset < 0 else 0)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (folders as None, files as their bytes)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _state(seed: int = 0, n: int = 4) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(20_000, generator=gen) for i in range(n)} | {"step": seed}


def _empty(n: int = 4) -> dict[str, Any]:
    import torch

    return {f"t{i}": torch.zeros(20_000) for i in range(n)} | {"step": -1}


# --- 17: damage in any file DCP reads raises, whatever DCP does with the exception ----------------


@needs_torch
def test_dcp_load_raises_on_a_damaged_metadata_file_that_dcp_would_fall_back_from(tmp_path: Path) -> None:
    """DCP reads ``.metadata`` and, when that raises, falls back to rank 0's own ``__0.metadata``
    (what a save with ``use_collectives=False`` writes) and carries on. A checkpoint that holds
    both, sealed, with ``.metadata`` damaged: the load raises, and its report counts no damaged
    file as checked."""
    from integrity_fs import dcp

    url = tmp_path / "step_1"
    dcp.save(_state(1), url)
    shutil.copyfile(url / ".metadata", url / "__0.metadata")  # rank 0's metadata: the same plan
    ifs.seal(url, overwrite=True, granularity="chunk")
    dcp.load(_empty(), url)  # sound, it loads
    data = bytearray((url / ".metadata").read_bytes())
    data[len(data) // 2] ^= 1
    (url / ".metadata").write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as err:
        dcp.load(_empty(), url)
    report = err.value.report
    assert [(p.path, p.kind) for p in report.problems] == [(".metadata", "mismatch")]
    files = len(ifs.read_manifest(url).files)
    assert report.files_checked <= files - 1  # .metadata is not among the files checked


# --- 18: loads through fsspec's caches --------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("layer", ["simplecache", "filecache", "blockcache"])
def test_dcp_load_through_a_cache_over_a_local_folder_loads_verified(tmp_path: Path, layer: str) -> None:
    import torch

    from integrity_fs import dcp

    url = tmp_path / "step_1"
    dcp.save(_state(1), url, chunk_size=CHUNK)
    cached = f"{layer}::file://{url.as_posix()}"
    options = {layer: {"cache_storage": str(tmp_path / "cache")}}
    target = _empty()
    report = dcp.load(target, cached, storage_options=options)
    assert report is not None and report.files_checked == 2
    assert all(torch.equal(target[k], v) for k, v in _state(1).items() if k != "step")
    # Through the cache still means verified: damage in the folder beneath is found.
    shard = url / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1
    shard.write_bytes(bytes(data))
    options = {layer: {"cache_storage": str(tmp_path / "cache2")}}
    with pytest.raises(IntegrityError, match="__0_0.distcp"):
        dcp.load(_empty(), cached, storage_options=options)


# --- 20: PartialLoadError whatever ended the search ------------------------------------------------


class _OutageFileSystem(MemoryFileSystem):
    """fsspec's memory store under a protocol of its own, where every read of a file under one of
    ``unreachable`` fails as a dropped connection does."""

    protocol = "outage-test"
    unreachable: tuple[str, ...] = ()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("outage-test://"):
            path = "memory://" + path[len("outage-test://") :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        stripped = self._strip_protocol(path)
        if "r" in mode and any(stripped.startswith(prefix + "/") for prefix in self.unreachable):
            raise ConnectionError(f"connection reset by peer while reading {stripped}")
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        stripped = self._strip_protocol(path)
        if any(stripped.startswith(prefix + "/") for prefix in self.unreachable):
            raise ConnectionError(f"connection reset by peer while reading {stripped}")
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture
def outage() -> Iterator[type[_OutageFileSystem]]:
    fsspec.register_implementation("outage-test", _OutageFileSystem, clobber=True)  # this module's own protocol
    try:
        yield _OutageFileSystem
    finally:
        _OutageFileSystem.unreachable = ()


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


@needs_torch
def test_load_latest_after_a_partial_load_raises_partial_load_error_chained_to_a_storage_error(
    outage: type[_OutageFileSystem],
) -> None:
    import torch

    from integrity_fs import dcp

    run = f"/trust-dcp-{uuid.uuid4().hex}"
    memory = fsspec.filesystem("memory")
    try:
        for step in (1, 2):
            # One file per tensor: the damage below is in a file read after others loaded.
            dcp.save(_state(step), f"memory://{run}/step_{step}", single_file_per_rank=False)
        newest = ifs.read_manifest(f"memory://{run}/step_2")
        last = sorted(name for name in newest.files if name.endswith(".distcp"))[-1]
        data = bytearray(memory.cat_file(f"{run}/step_2/{last}"))
        data[-10] ^= 1
        memory.pipe_file(f"{run}/step_2/{last}", bytes(data))
        outage.unreachable = (f"{run}/step_1",)
        target = _empty()
        with pytest.raises(PartialLoadError) as err:
            dcp.load_latest(target, f"outage-test://{run}")
        assert isinstance(err.value, IntegrityError)
        assert any(isinstance(e, ConnectionError) for e in _chain(err.value)), _chain(err.value)
        written = [k for k, v in target.items() if isinstance(v, torch.Tensor) and v.any()]
        assert written  # the damaged checkpoint's verified keys are there: partial data indeed
    finally:
        memory.rm(run, recursive=True)


@needs_torch
def test_load_latest_raises_when_the_checkpoint_it_loads_does_not_cover_what_a_damaged_one_left(
    tmp_path: Path,
) -> None:
    """With a planner that allows partial loads, the checkpoint that loads may lack a key that a
    damaged newer one wrote into: that key still holds the damaged checkpoint's bytes."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from integrity_fs import dcp

    root = tmp_path / "run"
    older = {k: v for k, v in _state(1).items() if k != "t0"}
    dcp.save(older, root / "step_1", single_file_per_rank=False)
    dcp.save(_state(2), root / "step_2", single_file_per_rank=False)
    manifest = ifs.read_manifest(root / "step_2")
    _flip(root / "step_2" / sorted(n for n in manifest.files if n.endswith(".distcp"))[-1], -10)
    target = _empty()
    with pytest.raises(PartialLoadError) as err:
        dcp.load_latest(target, root, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert f"{root / 'step_1'}, loaded after it, did not write every key" in str(err.value)
    assert torch.equal(target["t0"], _state(2)["t0"])  # step_2's verified bytes, never loaded over
    assert torch.equal(target["t1"], _state(1)["t1"])  # step_1 loaded all it holds


# --- 22: dcp's flags are bools and its counts ints -----------------------------------------------


@needs_torch
def test_dcp_refuses_a_flag_that_is_not_a_bool_before_touching_the_state_dict(tmp_path: Path) -> None:
    import torch

    from integrity_fs import dcp as typed_dcp

    dcp: Any = typed_dcp  # wrong types on purpose
    url = str(tmp_path / "step_1")
    dcp.save({"w": torch.full((1024,), 1.0)}, url)
    before = _tree(tmp_path)
    state = {"w": torch.zeros(1024)}
    with pytest.raises(TypeError):
        dcp.load(state, url, strict="false")
    with pytest.raises(TypeError):
        dcp.load(state, url, verify="no")
    with pytest.raises(TypeError):
        dcp.load_latest(state, str(tmp_path), quick="false")
    assert torch.equal(state["w"], torch.zeros(1024))  # nothing loaded
    assert _tree(tmp_path) == before
    with pytest.raises(TypeError):
        dcp.save({"w": torch.zeros(4)}, str(tmp_path / "step_2"), keep_last="2")
    assert not (tmp_path / "step_2").exists()  # refused before anything was written


# --- 24: the resume helpers are local calls, whatever process group exists ---------------------------


@needs_trainer
def test_resume_helpers_called_on_rank_0_alone_return_without_waiting_for_rank_1(tmp_path: Path) -> None:
    """The Trainer idiom (``if trainer.is_world_process_zero(): latest_verified_checkpoint(...)``)
    in an initialised 2-rank gloo group: rank 0 gets its answers while rank 1 is busy elsewhere
    (tests/dist_rank0_latest_worker.py); a call that waits for rank 1 is cut short by the group's
    8 s timeout, and fails here (a local call needs no timeout at all)."""
    from dist_launch import run_ranks

    spec = {"root": str(tmp_path), "rank1_waits_s": 20, "pg_timeout_s": 8}
    warm = [*fork_server.BASE, *fork_server.TRANSFORMERS]
    results = run_ranks("dist_rank0_latest_worker.py", 2, spec, tmp_path, timeout=120, warm=warm)
    calls = results["calls"][0]
    answers = {name: call.get("returned", call.get("raised")) for name, call in calls.items()}
    assert answers == {
        "latest_verified": str(tmp_path / "dcp" / "step_1"),  # step_2 is damaged
        "load_latest": {"url": str(tmp_path / "dcp" / "step_1"), "w": [1.0]},  # step_1's values, on rank 0 alone
        "latest_verified_checkpoint": str(tmp_path / "hf" / "checkpoint-2"),  # checkpoint-4 is damaged
    }, {name: call["seconds"] for name, call in calls.items()}
    assert all(results["saw_rank0_finish"][1].values())  # rank 0 finished while rank 1 was still elsewhere


# --- 6, 25 and 27: IntegrityCallback with a real Trainer -----------------------------------------------


@pytest.fixture
def hf() -> Any:
    """tests/hf_trainer.py's ``trainer`` (a real Trainer, a tiny GPT-2 from a config, CPU, saves
    every 2 steps) and the integration, imported only by the tests that train."""
    if not HAS_TRAINER:
        pytest.skip("torch, transformers and accelerate are optional")
    import hf_trainer
    from transformers import TrainerCallback

    from integrity_fs.integrations import transformers as integration

    class DamageOnSave(TrainerCallback):  # type: ignore[misc]
        """Flips a bit of checkpoint-<step>'s weights once the callbacks before it have sealed (and
        pruned): a checkpoint damaged on disk right after it was sealed."""

        def __init__(self, out: Path, step: int) -> None:
            self.out, self.step = out, step

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == self.step:
                _flip(self.out / f"checkpoint-{self.step}" / "model.safetensors", -100)

    return hf_trainer.trainer, integration.IntegrityCallback, integration.latest_verified_checkpoint, DamageOnSave


def test_the_callbacks_keep_last_must_be_an_int(hf: Any) -> None:
    _, IntegrityCallback, _, _ = hf
    for wrong in ("2", 2.0, True):
        with pytest.raises(TypeError):
            IntegrityCallback(keep_last=wrong)
    with pytest.raises(ValueError):
        IntegrityCallback(keep_last=0)


def test_the_callback_leaves_a_checkpoint_holding_files_from_before_the_save_unsealed_and_names_them(
    hf: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real Trainer run (saves 2, 4, 6, each sealed). checkpoint-6 is then as a 2-rank run left it
    (an ``rng_state_1.pth`` too, sealed with it) and gets damaged there; the run resumes from
    checkpoint-4, the newest that verifies, on one process, and re-saves checkpoint-6 over the
    folder: every file but ``rng_state_1.pth``, which this save did not write. Sealing the folder
    would vouch for the damaged leftover (and the next resume would load it): it is left
    unsealed, with a WARNING naming the leftover."""
    trainer, IntegrityCallback, latest_verified_checkpoint, _ = hf
    out = tmp_path / "out"
    trainer(out, [IntegrityCallback()]).train()
    six = out / "checkpoint-6"
    shutil.copy(six / "rng_state.pth", six / "rng_state_1.pth")
    ifs.seal(six, overwrite=True)
    _flip(six / "rng_state_1.pth", -100)
    resume = latest_verified_checkpoint(out)
    assert resume == str(out / "checkpoint-4")

    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        trainer(out, [IntegrityCallback()]).train(resume_from_checkpoint=resume)
    with pytest.raises(ifs.ManifestNotFoundError):  # left unsealed: not sealed as good, no stale manifest
        ifs.verify(six)
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-4")
    named = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("integrity_fs") and r.levelno >= logging.WARNING and "rng_state_1.pth" in r.getMessage()
    ]
    assert named, [r.getMessage() for r in caplog.records]
    assert ifs.verify(out / "checkpoint-4").ok  # and the good one is untouched


@pytest.mark.filterwarnings("ignore:.*save_total_limit:UserWarning")  # judged by what happens, not by a warning
def test_keep_last_turns_the_trainers_rotation_off_and_the_last_good_checkpoint_survives(
    hf: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real Trainer run with ``IntegrityCallback(keep_last=2)`` and ``save_total_limit=2``: saves
    2, 4, 6 (damaged right after sealing), 8. The Trainer's rotation (by name, before on_save)
    would keep 6 and 8 and delete 4, the last good one before 8; the callback turns it off (an
    INFO line says so) and keeps 8 and 4. Then 8 is damaged too: checkpoint-4 is still there to
    resume from."""
    trainer, IntegrityCallback, latest_verified_checkpoint, DamageOnSave = hf
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="integrity_fs"):
        run = trainer(out, [IntegrityCallback(keep_last=2), DamageOnSave(out, 6)], max_steps=8, save_total_limit=2)
        run.train()
    _flip(out / "checkpoint-8" / "model.safetensors", -100)
    on_disk = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-4"), on_disk
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("integrity_fs") and r.levelno == logging.INFO and "save_total_limit" in r.getMessage()
    ]
    assert said, [r.getMessage() for r in caplog.records]


@needs_trainer
def test_keep_last_with_save_on_each_node_prunes_each_nodes_own_disk(tmp_path: Path) -> None:
    """Two gloo processes as two nodes (each its own local rank 0) whose ``output_dir`` is each on
    a disk of its own, a real Trainer with ``save_on_each_node=True`` and
    ``IntegrityCallback(keep_last=2)``: training finishes, and on each node's disk the two newest
    checkpoints are left, sealed (with that node's own RNG state), the older ones pruned."""
    from dist_launch import run_ranks

    results: dict[str, list[Any]] = run_ranks(
        "dist_retention_worker.py",
        2,
        {"root": str(tmp_path), "pg_timeout_s": 30},
        tmp_path,
        timeout=240,
        warm=[*fork_server.BASE, *fork_server.TRANSFORMERS],
    )
    assert results["trained"] == ["trained", "trained"]
    assert results["checkpoints"] == [["checkpoint-6", "checkpoint-8"]] * 2
    assert results["verdicts"] == [{"checkpoint-6": "ok", "checkpoint-8": "ok"}] * 2
    for node, files in enumerate(results["files"]):
        for names in files.values():
            assert MANIFEST_FILENAME in names and f"rng_state_{node}.pth" in names
