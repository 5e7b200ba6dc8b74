"""One rank of a distributed DCP test: ``python dist_dcp_worker.py SPEC.json RANK``.

For each target (a local directory, and an S3 prefix when the spec has an endpoint): signed saves
(the key on rank 0 only; a bad key), save (reads counted by the kernel or the S3 server), load,
load through VerifyingFsspecReader, a load by rank 0 alone, corrupt and load, load without a
manifest. Writes this rank's outcomes to ``rank<RANK>.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from dist_rank import run_rank
from read_counting import reads_under
from torch.distributed.checkpoint import CheckpointException

import integrity_fs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, Manifest, Report, dcp


def state(rank: int, *, empty: bool = False) -> dict[str, Any]:
    """Tensors shared by every rank, one of this rank's own, and a non-tensor value."""
    gen = torch.Generator().manual_seed(0)
    shared = {f"w{i}": torch.randn(64 * 1024, generator=gen) for i in range(4)}
    own = torch.full((1000,), float(rank + 1))
    sd: dict[str, Any] = {"model": shared, f"rank{rank}": own, "step": 100}
    if empty:
        sd = {"model": {k: torch.zeros_like(v) for k, v in shared.items()}, f"rank{rank}": torch.zeros(1000), "step": 0}
    return sd


def only_verified(target: dict[str, Any], source: dict[str, Any], empty: dict[str, Any]) -> bool:
    """Every value of ``target`` is what the checkpoint holds (``source``: bytes that verified) or
    what it held before the load (``empty``): never anything else (unverified bytes)."""
    for key, value in target.items():
        if isinstance(value, dict):
            if not only_verified(value, source[key], empty[key]):
                return False
        elif isinstance(value, torch.Tensor):
            if not (torch.equal(value, source[key]) or torch.equal(value, empty[key])):
                return False
        elif value not in (source[key], empty[key]):
            return False
    return True


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        if isinstance(value, dict):
            if not same(value, b[key]):
                return False
        elif isinstance(value, torch.Tensor):
            if not torch.equal(value, b[key]):
                return False
        elif value != b[key]:
            return False
    return True


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def attempt(fn: Callable[[], object]) -> dict[str, Any]:
    try:
        value = fn()
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        report = exc.report.to_dict() if isinstance(exc, IntegrityError) else None
        return {"type": type(exc).__name__, "message": str(exc), "report": report}
    if isinstance(value, Manifest):
        return {"type": "Manifest", "manifest": value.to_json().decode()}
    if isinstance(value, Report):
        return {"type": "Report", "report": value.to_dict()}
    return {"type": type(value).__name__}


def on_rank0(rank: int, fn: Callable[[], None]) -> None:
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


def signed_saves(url: str, options: dict[str, Any], rank: int, keys: dict[str, str]) -> dict[str, Any]:
    """Signed saves with the key on rank 0 only: good; a bad key (refused before DCP writes)."""
    fs, root = fsspec.core.url_to_fs(url, **options)
    source = state(rank)
    out: dict[str, Any] = {}
    key = keys["private"] if rank == 0 else None
    out["signed"] = attempt(lambda: dcp.save(source, url + "-signed", storage_options=options, private_key=key))
    out["signed"]["verify"] = attempt(
        lambda: integrity_fs.verify(url + "-signed", storage_options=options, public_key=keys["public"])
    )["type"]
    bad = keys["bad"] if rank == 0 else None
    out["bad-key"] = attempt(lambda: dcp.save(source, url + "-bad-key", storage_options=options, private_key=bad))
    dist.barrier()
    out["bad-key"]["written"] = fs.exists(f"{root}-bad-key")
    return out


def run_target(
    url: str, options: dict[str, Any], rank: int, world: int, *, keys: dict[str, str] | None
) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(url, **options)
    out: dict[str, Any] = {}
    source = state(rank)
    if keys is not None:
        out.update(signed_saves(url, options, rank, keys))

    reads = reads_under(url, options)  # every rank's reads, seen by the kernel or the S3 server
    dist.barrier()
    out["save"] = attempt(lambda: dcp.save(source, url, storage_options=options))
    dist.barrier()
    out["save"]["reads"] = reads.take()
    out["files"] = sorted(p.rsplit("/", 1)[-1] for p in fs.find(root))

    target = state(rank, empty=True)
    dist.barrier()
    out["load"] = {**attempt(lambda: dcp.load(target, url, storage_options=options)), "equal": same(target, source)}
    dist.barrier()
    out["load"]["reads"] = reads.take()
    reads.close()

    target = state(rank, empty=True)
    reader = dcp.VerifyingFsspecReader(url, storage_options=options)
    loaded = attempt(lambda: torch_dcp.load(target, storage_reader=reader))
    out["reader"] = {**loaded, "equal": same(target, source), "report": reader.report().to_dict()}

    # A load by one rank alone inside an initialised group (conversion and evaluation jobs do
    # this): the verifying reader starts no collective of its own, so nothing waits for rank 1.
    dist.barrier()
    if rank == 0:
        target = state(rank, empty=True)
        alone = dcp.VerifyingFsspecReader(url, storage_options=options)
        out["subset"] = {
            **attempt(lambda: torch_dcp.load(target, storage_reader=alone, no_dist=True)),
            "equal": same(target, source),
        }
    dist.barrier()

    def corrupt() -> None:
        path = f"{root}/__{world - 1}_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 1
        fs.pipe_file(path, bytes(data))
        fs.invalidate_cache()

    on_rank0(rank, corrupt)
    target = state(rank, empty=True)
    out["corrupt"] = {
        **attempt(lambda: dcp.load(target, url, storage_options=options)),
        "verified-only": only_verified(target, source, state(rank, empty=True)),
    }
    target = state(rank, empty=True)
    reader = dcp.VerifyingFsspecReader(url, storage_options=options)
    out["reader-corrupt"] = {
        **attempt(lambda: torch_dcp.load(target, storage_reader=reader)),
        "verified-only": only_verified(target, source, state(rank, empty=True)),
    }

    # Each rank's own state alone (no tensor shared), damaged in every rank's file: each rank
    # finds damage no other rank reads, and every rank raises one verdict naming all of it.
    own_url = url + "-own"
    own = {f"rank{rank}": torch.full((50_000,), float(rank + 1))}
    dcp.save(own, own_url, storage_options=options)

    def corrupt_every_file() -> None:
        for r in range(world):
            path = f"{root}-own/__{r}_0.distcp"
            data = bytearray(fs.cat_file(path))
            data[len(data) // 2] ^= 1
            fs.pipe_file(path, bytes(data))
        fs.invalidate_cache()

    on_rank0(rank, corrupt_every_file)
    target = {f"rank{rank}": torch.zeros(50_000)}
    out["corrupt-every-file"] = {
        **attempt(lambda: dcp.load(target, own_url, storage_options=options)),
        "verified-only": not target[f"rank{rank}"].any(),
    }

    unsealed = url + "-unsealed"
    dcp.save(source, unsealed, storage_options=options)
    on_rank0(rank, lambda: fs.rm_file(f"{root}-unsealed/{MANIFEST_FILENAME}"))
    messages = Messages()
    logging.getLogger("integrity_fs").addHandler(messages)
    logging.getLogger("integrity_fs").setLevel(logging.INFO)
    target = state(rank, empty=True)
    out["unsealed"] = {
        **attempt(lambda: dcp.load(target, unsealed, storage_options=options)),
        "equal": same(target, source),
        "log": messages.messages,
    }
    logging.getLogger("integrity_fs").removeHandler(messages)
    target = state(rank, empty=True)
    out["require"] = {
        **attempt(lambda: dcp.load(target, unsealed, storage_options=options, require_manifest=True)),
        "untouched": same(target, state(rank, empty=True)),
    }
    return out


def run_all(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    world = spec["world_size"]
    return {
        name: run_target(target["url"], target["options"], rank, world, keys=spec.get("keys"))
        for name, target in spec["targets"].items()
    }


def main() -> None:
    run_rank(run_all)


if __name__ == "__main__":
    main()
