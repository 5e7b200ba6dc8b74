"""One rank of a distributed DCP test where ranks disagree: ``python dist_dcp_hostile_worker.py SPEC.json RANK``.

Each scenario saves a checkpoint with dcp.save (every rank with the spec's ``kwargs``, updated by
its own ``rank_kwargs``), then every rank checks it with a local verify and lists what was
written; or saves one plainly, optionally strips its manifest, and loads it with per-rank
arguments. Writes this rank's outcomes to ``rank<RANK>.json``; a hang fails the test (short
collective timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_rank import run_rank
from torch.distributed.checkpoint import CheckpointException

import integrity_fs
from integrity_fs import MANIFEST_FILENAME, Manifest, Report, dcp


def state(rank: int, *, empty: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    own = torch.zeros(50_000) if empty else torch.randn(50_000, generator=gen)
    return {f"rank{rank}": own, "step": 0 if empty else 7}


def attempt(fn: Callable[[], object]) -> dict[str, Any]:
    try:
        value = fn()
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        return {"type": type(exc).__name__, "message": str(exc)[:2000]}
    if isinstance(value, Manifest):
        return {"type": "Manifest", "manifest": value.to_json().decode()}
    if isinstance(value, Report):
        return {"type": "Report"}
    return {"type": type(value).__name__}


def run(scenario: dict[str, Any], rank: int) -> dict[str, Any]:
    url = scenario["url"] + ("/" + scenario["ckpt"] if "ckpt" in scenario else "")
    kwargs = {**scenario.get("kwargs", {}), **scenario.get("rank_kwargs", {}).get(str(rank), {})}
    out: dict[str, Any] = {}
    if scenario["op"] == "save":
        out["save"] = attempt(lambda: dcp.save(state(rank), url, **kwargs))
        dist.barrier()
        out["verify"] = attempt(lambda: integrity_fs.verify(url))
        out["written"] = sorted(str(p.relative_to(scenario["url"])) for p in Path(scenario["url"]).rglob("*"))
        return out
    dcp.save(state(rank), url)
    dist.barrier()
    if scenario.get("unsealed") and rank == 0:
        Path(url, MANIFEST_FILENAME).unlink()
    dist.barrier()
    target = state(rank, empty=True)
    out["load"] = attempt(lambda: dcp.load(target, url, **kwargs))
    out["loaded"] = bool(torch.equal(target[f"rank{rank}"], state(rank)[f"rank{rank}"]))
    return out


if __name__ == "__main__":
    run_rank(lambda spec, rank: {scenario["id"]: run(scenario, rank) for scenario in spec["scenarios"]})
