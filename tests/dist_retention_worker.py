"""One node of a two-node Trainer run (DDP over gloo, on the CPU): ``python dist_retention_worker.py SPEC RANK``.

Each rank plays a node of its own (``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``) with a disk of its
own: ``<root>/node<RANK>/out``, which the other node never looks at (nodes that do not share a
filesystem see only their own copy of ``output_dir``). The Trainer runs with
``save_on_each_node=True``, so each node's local rank 0 writes every checkpoint to its own disk, and
``IntegrityCallback(keep_last=2)`` must seal and prune there. Writes this node's outcomes to
``rank<RANK>.json``: how training ended, the ``checkpoint-N`` folders left on its disk, and
whether each verifies (strict) and what it holds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from dist_rank import run_rank
from hf_trainer import trainer

import integrity_fs as ifs
from integrity_fs.integrations.transformers import IntegrityCallback


def as_a_node_of_its_own(spec: dict[str, Any], rank: int) -> None:
    """What torchrun sets on node ``rank`` of ``world_size`` nodes of one process each."""
    host, port = spec["init_method"].removeprefix("tcp://").rsplit(":", 1)
    world = str(spec["world_size"])
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=world, LOCAL_WORLD_SIZE="1")
    os.environ.update(GROUP_RANK=str(rank), NODE_RANK=str(rank), MASTER_ADDR=host, MASTER_PORT=port)


def run_all(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    as_a_node_of_its_own(spec, rank)
    out = Path(spec["root"]) / f"node{rank}" / "out"
    try:
        run = trainer(
            out,
            [IntegrityCallback(keep_last=2)],
            max_steps=8,  # saves 2, 4, 6, 8
            ddp_backend="gloo",
            save_on_each_node=True,
        )
        run.train()
        trained = "trained"
    except Exception as exc:  # the outcome is the test's to judge, on every rank
        trained = f"{type(exc).__name__}: {exc}"
    folders = sorted((p for p in out.glob("checkpoint-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))
    verdicts = {}
    for folder in folders:
        try:
            verdicts[folder.name] = "ok" if ifs.verify(folder, strict=True).ok else "not ok"
        except Exception as exc:
            verdicts[folder.name] = f"{type(exc).__name__}: {exc}"
    return {
        "trained": trained,
        "checkpoints": [p.name for p in folders],
        "verdicts": verdicts,
        "files": {p.name: sorted(f.name for f in p.iterdir()) for p in folders},
    }


if __name__ == "__main__":
    run_rank(run_all)
    # As tests/dist_trainer_worker.py: leave without the interpreter's teardown, which torch 2.13
    # with gloo now and then aborts.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
