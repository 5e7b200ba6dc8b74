"""Run a worker script as the ranks of a real gloo process group on 127.0.0.1, in processes of their own.

Each rank runs the scenarios of one spec (sharing one process group) and writes its outcomes to
``rank<N>.json``; a hang becomes a test failure after ``timeout`` seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fork_server
import pytest

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(
    script: str,
    world_size: int,
    spec: dict[str, Any],
    workdir: Path,
    *,
    timeout: float = 120,
    warm: Sequence[str] = fork_server.BASE,
) -> dict[str, list[dict[str, Any]]]:
    """Launch ``world_size`` ranks of ``tests/<script>``, each as ``python tests/<script> SPEC RANK``
    forked from a warm interpreter (tests/fork_server.py) that has imported ``warm``; returns
    scenario id -> outcomes in rank order."""
    out = workdir / f"out-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "init_method": f"tcp://127.0.0.1:{free_port()}", "world_size": world_size, "out": str(out)}
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        fork_server.start(
            [TESTS / script, spec_file, str(rank)], cwd=os.getcwd(), env=env, log=out / f"rank{rank}.log", warm=warm
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"ranks did not finish within {timeout} s (a hang?):\n{_logs(out, world_size)}")
    if any(proc.returncode for proc in procs):
        pytest.fail(f"a rank failed: {[p.returncode for p in procs]}\n{_logs(out, world_size)}")
    by_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return {key: [outcomes[key] for outcomes in by_rank] for key in by_rank[0]}


def _logs(out: Path, world_size: int) -> str:
    return "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(world_size))
