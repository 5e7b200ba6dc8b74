"""The parent's side: run a contender in a ``benchmarks.runner`` child, keep its measurement."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.runner import system_busy_s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = os.cpu_count() or 1


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _per_wall(cpu_s: list[float], times_s: list[float]) -> float:
    """Median CPU seconds per wall second: how many cores were busy."""
    return statistics.median(c / t for c, t in zip(cpu_s, times_s, strict=True))


@dataclass
class Row:
    """One contender's measurement on one dataset."""

    section: str
    dataset: str
    label: str
    nbytes: int
    result: dict[str, Any]
    key: str = ""  # "<dataset key>:<contender key>", for lookups by the report
    reads_content: bool = True

    @property
    def median_s(self) -> float:
        return statistics.median(self.result["times_s"])

    @property
    def spread(self) -> tuple[float, float]:
        """Fastest and slowest timed call."""
        return min(self.result["times_s"]), max(self.result["times_s"])

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9

    @property
    def cores(self) -> float:
        return _per_wall(self.result["cpu_s"], self.result["times_s"])

    @property
    def other_cores(self) -> float:
        return _per_wall(self.result["other_cpu_s"], self.result["times_s"])

    @property
    def server_cores(self) -> float:
        return _per_wall(self.result["server_cpu_s"], self.result["times_s"])

    @property
    def peak_mib(self) -> float:
        return float(self.result["rss_peak_kib"]) / 1024

    @property
    def ready_mib(self) -> float:
        return float(self.result["rss_ready_kib"]) / 1024

    @property
    def calls(self) -> str:
        """How many timed calls the median is over, and how many were dropped as contended."""
        used = len(self.result["times_s"])
        if self.result["contended"]:
            return f"{used} (contended)"
        if self.result["dropped"]:
            return f"{used} of {self.result['calls']}"
        return str(used)


@dataclass
class Bench:
    """Runs contenders in child processes and keeps their rows."""

    root: str
    repeats: int
    max_wait_s: float
    import_path: str | None = None  # another integrity_fs to benchmark instead of the installed one
    rows: list[Row] = field(default_factory=list)

    def measure(
        self,
        section: str,
        dataset: str,
        label: str,
        contender: str,
        params: dict[str, Any],
        nbytes: int,
        *,
        key: str,
        repeats: int | None = None,
        reads_content: bool = True,
        threads: int = CORES,
        server: bool = False,
    ) -> Row:
        """Run ``contender`` in a child. ``threads``: the most cores it can use (other processes
        may use the rest without counting as contention). ``server``: this process runs the S3
        server, whose CPU time the child reports apart."""
        self._wait_for_idle(self.max_wait_s)
        spec = {
            "contender": contender,
            "params": params,
            "repeats": repeats or self.repeats,
            "contention_cores": max(0.25, CORES - threads + 0.25),
            "server_pid": os.getpid() if server else None,
            "import_path": self.import_path,
        }
        log(f"  {dataset}: {label} ...")
        result = self._child(spec)
        if result["contended"]:
            log("    contended: waiting for the machine to go idle, then once more")
            self._wait_for_idle(4 * self.max_wait_s)
            result = self._child(spec)
        row = Row(section, dataset, label, nbytes, result, key, reads_content)
        self.rows.append(row)
        return row

    def _child(self, spec: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.runner"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            cwd=REPO,
            check=False,
        )
        if child.returncode != 0:
            raise SystemExit(f"{spec['contender']} failed:\n{child.stderr}")
        result: dict[str, Any] = json.loads(child.stdout)
        median = statistics.median(result["times_s"])
        log(
            f"    {median:.4f} s, {result['rss_peak_kib'] / 1024:.0f} MiB, {len(result['times_s'])} of "
            f"{result['calls']} calls kept ({time.perf_counter() - started:.1f} s)"
        )
        return result

    def _wait_for_idle(self, max_wait_s: float) -> None:
        """Wait (up to ``max_wait_s``) until other processes leave the cores nearly idle."""
        deadline = time.monotonic() + max_wait_s
        while True:
            before = system_busy_s()
            time.sleep(0.25)
            busy_cores = (system_busy_s() - before) / 0.25
            if busy_cores < 0.25 or time.monotonic() >= deadline:
                return
            log(f"    waiting: other processes keep {busy_cores:.1f} cores busy")

    def find(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)
