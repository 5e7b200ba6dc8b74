"""The rank side of ``dist_launch.run_ranks``: join the gloo group a spec names, run, report.

A worker script ends with ``run_rank(run_all)``; ``run_all(spec, rank)`` returns this rank's
outcomes (JSON-ready), written to ``<out>/rank<N>.json`` once the group is left.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist


def run_rank(run_all: Callable[[dict[str, Any], int], dict[str, Any]]) -> None:
    """``python tests/<worker>.py SPEC RANK``: a gloo group (collectives time out after the spec's
    ``pg_timeout_s``, 60 s by default), ``run_all(spec, rank)``, and its outcomes written."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=spec["init_method"],
        rank=rank,
        world_size=spec["world_size"],
        timeout=timedelta(seconds=spec.get("pg_timeout_s", 60)),
    )
    results = run_all(spec, rank)
    dist.destroy_process_group()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results, indent=1))
