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
#: Other processes' load, in cores, above which a timed call counts as contended.
CONTENTION_CORES = 0.25


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
        return float(statistics.median(self.result["times_s"]))

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


@dataclass(frozen=True)
class Job:
    """A contender to run on a dataset, and where its row goes."""

    section: str
    dataset: str
    label: str
    key: str
    nbytes: int
    reads_content: bool
    spec: dict[str, Any]


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from a job's rounds: the timed calls of its clean rounds (of all if none is)."""
    used = [r for r in results if not r["contended"]] or results
    merged: dict[str, Any] = {
        name: [x for r in used for x in r[name]] for name in ("times_s", "cpu_s", "other_cpu_s", "server_cpu_s")
    }
    merged["calls"] = sum(r["calls"] for r in results)
    merged["dropped"] = merged["calls"] - len(merged["times_s"])
    merged["contended"] = all(r["contended"] for r in results)
    merged["rss_ready_kib"] = max(r["rss_ready_kib"] for r in results)
    merged["rss_peak_kib"] = max(r["rss_peak_kib"] for r in results)
    return merged


@dataclass
class Bench:
    """Runs contenders in child processes, round-robin, and keeps their rows."""

    root: str
    repeats: int
    rounds: int
    max_wait_s: float
    import_path: str | None = None  # another integrity_fs to benchmark instead of the installed one
    rows: list[Row] = field(default_factory=list)
    pending: list[Job] = field(default_factory=list)

    def add(
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
        server: bool = False,
    ) -> None:
        """Queue ``contender`` for the next :meth:`run`; ``server``: this process runs the S3
        server, whose CPU time the child reports apart from the other processes'."""
        spec = {
            "contender": contender,
            "params": params,
            "repeats": repeats or self.repeats,
            "contention_cores": CONTENTION_CORES,
            "server_pid": os.getpid() if server else None,
            "import_path": self.import_path,
        }
        self.pending.append(Job(section, dataset, label, key, nbytes, reads_content, spec))

    def run(self) -> None:
        """Run the queued jobs ``rounds`` times round-robin, so that slow drift of the machine
        weighs on every contender alike, and keep a row per job with its rounds merged.

        A call during which other processes kept more than ``CONTENTION_CORES`` busy is dropped,
        even for one-thread contenders: a neighbour on the other vCPU of a 2-core VM slowed
        them by 10-17% (shared caches and memory bandwidth, or SMT siblings). A round with too
        few clean calls is run once more after waiting for the machine to go idle."""
        results: dict[str, list[dict[str, Any]]] = {job.key: [] for job in self.pending}
        for round_ in range(1, self.rounds + 1):
            for job in self.pending:
                log(f"  [{round_}/{self.rounds}] {job.dataset}: {job.label} ...")
                self._wait_for_idle(self.max_wait_s)
                result = self._child(job.spec)
                if result["contended"]:
                    log("    contended: waiting for the machine to go idle, then once more")
                    self._wait_for_idle(4 * self.max_wait_s)
                    result = self._child(job.spec)
                results[job.key].append(result)
        for job in self.pending:
            result = merge(results[job.key])
            self.rows.append(Row(job.section, job.dataset, job.label, job.nbytes, result, job.key, job.reads_content))
        self.pending.clear()

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
