"""Run a worker script as the ranks of a real gloo process group on 127.0.0.1, in subprocesses.

Each rank runs the scenarios of one spec (sharing one process group) and writes its outcomes to
``rank<N>.json``; a hang becomes a test failure after ``timeout`` seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(
    script: str, world_size: int, spec: dict[str, Any], workdir: Path, *, timeout: float = 120
) -> dict[str, list[dict[str, Any]]]:
    """Launch ``world_size`` ranks of ``tests/<script>``; returns scenario id -> outcomes in rank order."""
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
    logs = [(out / f"rank{rank}.log").open("w") for rank in range(world_size)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / script), str(spec_file), str(rank)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"ranks did not finish within {timeout} s (a hang?):\n{_logs(out, world_size)}")
    finally:
        for log in logs:
            log.close()
    if any(proc.returncode for proc in procs):
        pytest.fail(f"a rank failed: {[p.returncode for p in procs]}\n{_logs(out, world_size)}")
    by_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return {key: [outcomes[key] for outcomes in by_rank] for key in by_rank[0]}


def _logs(out: Path, world_size: int) -> str:
    return "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(world_size))
