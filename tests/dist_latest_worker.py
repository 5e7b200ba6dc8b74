"""One rank of a distributed resume test: ``python dist_latest_worker.py SPEC.json RANK``.

For each target (a local directory and an S3 prefix): saves step_100, step_200 and step_300, rank 0
corrupts a file of step_300 that rank 1 wrote and strips the manifest of a later step_400, then
every rank resumes with dcp.load_latest and distributed.latest_verified. Also: no checkpoint that
verifies (step_300's load fails after some of it loaded: partial data, raised), a root that is a
file, a rank that sees no checkpoint where the others see some, and ranks passing different
modes. Then retention under ``<target>-prune``: five dcp.save(keep_last=2), a sixth after the
newest was damaged, distributed.prune (dry run, real, arguments that differ, a storage error on
one rank). Writes this rank's outcomes to ``rank<RANK>.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from dist_rank import run_rank
from fsspec.callbacks import Callback
from fsspec.spec import AbstractFileSystem

from integrity_fs import MANIFEST_FILENAME, dcp, distributed


def state(rank: int, value: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((50_000,), float(value))},
        f"rank{rank}": torch.full((100,), float(value * 10 + rank)),
        "step": value,
    }


def each_from(a: dict[str, Any], *sources: dict[str, Any]) -> bool:
    """Every value of ``a`` is that of one of ``sources`` (what the load started from, or bytes
    that verified from a checkpoint it tried): never anything else."""
    if not any(torch.equal(a["model"]["w"], s["model"]["w"]) for s in sources):
        return False
    keys = [k for k in a if k.startswith("rank")]
    return all(any(torch.equal(a[k], s[k]) for s in sources) for k in keys) and a["step"] in [
        s["step"] for s in sources
    ]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and all(torch.equal(a[k], b[k]) for k in a if k.startswith("rank"))
        and a["step"] == b["step"]
    )


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Hashed(Callback):  # type: ignore[misc]  # fsspec is untyped
    """Counts the bytes this rank hashes (a progress callback); ``interrupt``: a Ctrl-C at the first."""

    def __init__(self, interrupt: bool = False) -> None:
        super().__init__()
        self.total = 0
        self.interrupt = interrupt

    def relative_update(self, inc: int = 1) -> None:
        if self.interrupt and inc:
            raise KeyboardInterrupt("injected")
        self.total += inc


class Faulty(AbstractFileSystem):
    """The target's files through a filesystem of their own whose listing (``fault="list"``) or
    reads of content (``fault="read"``) fail; every rank uses one, the fault is one rank's."""

    protocol = "faulty-latest"
    root_marker = ""

    def __init__(self, inner: Any, fault: str | None) -> None:
        super().__init__(skip_instance_cache=True)
        self.inner, self.fault = inner, fault

    def _denied(self, path: str) -> PermissionError:
        return PermissionError(13, "Permission denied (injected)", path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        if self.fault == "list":
            raise self._denied(path)
        return self.inner.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.inner.info(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if self.fault == "read" and "r" in mode and not path.endswith(MANIFEST_FILENAME):
            raise self._denied(path)
        return self.inner._open(path, mode, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        if self.fault == "read" and not path.endswith(MANIFEST_FILENAME):
            raise self._denied(path)
        return self.inner.cat_file(path, start=start, end=end, **kwargs)


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = fn()
    except (Exception, KeyboardInterrupt) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(value, tuple):
        return {"type": "tuple", "url": value[0], "report": value[1].to_dict()}
    return {"type": type(value).__name__, "value": value}


def on_one_rank(rank: int, faulty: int, fault: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """distributed.latest_verified while the listing or the reads of rank ``faulty`` fail."""
    inner, root = fsspec.core.url_to_fs(url, **options)
    fs = Faulty(inner, fault if rank == faulty else None)
    return attempt(lambda: distributed.latest_verified(root, fs=fs))


def on_rank0(rank: int, fn: Callable[[], None]) -> None:
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


def run_target(url: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(url, **options)
    for value in (100, 200, 300, 400):
        dcp.save(state(rank, value), f"{url}/step_{value}", storage_options=options)

    def damage() -> None:
        path = f"{root}/step_300/__1_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 1
        fs.pipe_file(path, bytes(data))
        fs.rm_file(f"{root}/step_400/{MANIFEST_FILENAME}")
        fs.makedirs(f"{root}/_staging_step_900", exist_ok=True)
        fs.pipe_file(f"{root}/_staging_step_900/x", b"x")
        fs.pipe_file(f"{root}-file", b"not a directory")
        fs.invalidate_cache()

    on_rank0(rank, damage)
    out: dict[str, Any] = {}
    warnings = Warnings()
    logging.getLogger("integrity_fs").addHandler(warnings)
    target = state(rank, 0)
    world = dist.group.WORLD
    counter = Hashed()
    out["load_latest"] = {
        **attempt(lambda: dcp.load_latest(target, url, storage_options=options, group=world, callback=counter)),
        "loaded_200": same(target, state(rank, 200)),
        "warnings": warnings.messages,
        "hashed": counter.total,
    }
    warnings.messages = []
    counter = Hashed()
    out["rank0_mode"] = {
        **attempt(lambda: distributed.latest_verified(url, mode="rank0", storage_options=options, callback=counter)),
        "hashed": counter.total,
    }
    out["quick"] = attempt(lambda: distributed.latest_verified(url, quick=True, storage_options=options))
    out["listing_denied"] = on_one_rank(rank, 0, "list", url, options)
    interrupt = Hashed(interrupt=rank == 0)
    out["interrupted"] = attempt(lambda: distributed.latest_verified(url, storage_options=options, callback=interrupt))
    out["read_denied"] = on_one_rank(rank, 1, "read", url, options)
    logging.getLogger("integrity_fs").removeHandler(warnings)

    def remove_good() -> None:
        fs.invalidate_cache()
        fs.rm([f"{root}/step_100", f"{root}/step_200"], recursive=True)

    on_rank0(rank, remove_good)
    target = state(rank, 0)
    out["none"] = {
        **attempt(lambda: dcp.load_latest(target, url, storage_options=options, group=world)),
        # One pass: the damaged step_300 may have left its verified bytes; nothing else.
        "verified_only": each_from(target, state(rank, 0), state(rank, 300)),
    }
    out["file_root"] = attempt(lambda: distributed.latest_verified(f"{url}-file", storage_options=options))
    out["missing_root"] = attempt(lambda: distributed.latest_verified(f"{url}-never", storage_options=options))
    modes = ["sharded", "rank0"]
    out["modes_differ"] = attempt(lambda: distributed.latest_verified(url, mode=modes[rank], storage_options=options))  # type: ignore[arg-type]
    # A node without the run's storage (rank 1 sees no checkpoint there): never a fresh start alone.
    unseen = [url, f"{url}-never"]
    target = state(rank, 0)
    out["unseen_root"] = {
        **attempt(lambda: dcp.load_latest(target, unseen[rank], storage_options=options, group=world)),
        "untouched": same(target, state(rank, 0)),
    }
    bad = ["sharded", "bogus"]
    out["bad_mode"] = attempt(lambda: distributed.latest_verified(url, mode=bad[rank], storage_options=options))  # type: ignore[arg-type]
    return out


def listing(fs: Any, root: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def run_prune(url: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    """Retention on 2 ranks: dcp.save(keep_last=2) and distributed.prune."""
    url = f"{url}-prune"
    fs, root = fsspec.core.url_to_fs(url, **options)
    out: dict[str, Any] = {"after_each_save": []}
    for value in (1, 2, 3, 4, 5):
        dcp.save(state(rank, value), f"{url}/step_{value}", storage_options=options, keep_last=2)
        dist.barrier()
        out["after_each_save"].append(listing(fs, root))
    out["verified"] = [
        attempt(lambda n=n: distributed.verify(f"{url}/step_{n}", storage_options=options).ok) for n in (4, 5)
    ]

    def damage_newest() -> None:
        path = f"{root}/step_5/__0_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 1
        fs.pipe_file(path, bytes(data))
        fs.invalidate_cache()

    on_rank0(rank, damage_newest)
    dcp.save(state(rank, 6), f"{url}/step_6", storage_options=options, keep_last=2)
    dist.barrier()
    out["after_damage"] = listing(fs, root)

    def pruned(**kw: Any) -> dict[str, Any]:
        try:
            result = distributed.prune(url, storage_options=options, **kw)
        except (Exception, KeyboardInterrupt) as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
        return {"type": "PruneResult", **result.to_dict()}

    counter = Hashed()
    out["dry_run"] = {**pruned(keep_last=1, dry_run=True, callback=counter), "hashed": counter.total}
    out["differ"] = pruned(keep_last=[1, 2][rank])
    out["bad_on_one"] = pruned(keep_last=[1, 0][rank])
    inner, inner_root = fsspec.core.url_to_fs(url, **options)
    faulty = Faulty(inner, "read" if rank == 1 else None)
    try:
        result = distributed.prune(inner_root, fs=faulty, keep_last=1)
        denied: dict[str, Any] = {"type": "PruneResult", **result.to_dict()}
    except (Exception, KeyboardInterrupt) as exc:
        denied = {"type": type(exc).__name__, "message": str(exc)}
    out["denied_on_one"] = {**denied, "left": listing(fs, root)}
    dist.barrier()
    out["save_differ"] = attempt(
        lambda: dcp.save(state(rank, 7), f"{url}/step_7", storage_options=options, keep_last=[2, 3][rank])
    )
    out["real"] = pruned(keep_last=1)
    dist.barrier()
    out["after_real"] = listing(fs, root)
    return out


def main() -> None:
    def targets(spec: dict[str, Any], rank: int) -> dict[str, Any]:
        out = {name: run_target(t["url"], t["options"], rank) for name, t in spec["targets"].items()}
        out.update({f"{name}-prune": run_prune(t["url"], t["options"], rank) for name, t in spec["targets"].items()})
        return out

    run_rank(targets)


if __name__ == "__main__":
    main()
