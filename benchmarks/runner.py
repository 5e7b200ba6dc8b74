"""Child process: run one contender, print its timings and memory as JSON on stdout.

The spec comes as JSON on stdin: ``{"contender": name, "params": {...}, "repeats": n,
"contention_cores": x, "server_pid": pid, "import_path": dir}``. The contender's setup runs
untimed, then one warm-up call, then timed calls. Timing excludes the interpreter's start.
``import_path`` goes first on ``sys.path``, to benchmark another copy of integrity_fs.

The machine may be shared: each timed call also records the CPU time every other process spent
meanwhile (from ``/proc/stat``), apart from ``server_pid`` (the process running the local S3
server), whose CPU time is recorded on its own. A call during which other processes kept more
than ``contention_cores`` cores busy is counted but not used, and calls continue (within a time
budget) until ``repeats`` clean ones are in; if fewer than 3 are clean, all calls are used and
the result says so.

Peak memory is ``VmHWM`` of ``/proc/self/status``, not ``ru_maxrss``: the latter keeps the
high-water mark of the image before ``exec``, i.e. of the parent that spawned this child. For
contenders that run a subprocess, their ``run()`` returns that subprocess's ``VmHWM`` in KiB.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time
from typing import Any

from benchmarks.contenders import CONTENDERS, vm_hwm_kib


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def system_busy_s() -> float:
    """CPU seconds all processes have spent busy since boot (``/proc/stat``), 0 where unknown."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds process ``pid`` has used (``/proc/<pid>/stat``), 0 if unknown or None."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _contended(other_cpu_s: float, wall_s: float, cores: float | None) -> bool:
    # /proc/stat counts in 10 ms ticks: allow two ticks of slack on short calls.
    return cores is not None and other_cpu_s > cores * wall_s + 0.02


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("import_path"):
        sys.path.insert(0, spec["import_path"])
    module, _, _ = spec["contender"].rpartition(":")
    if module:  # "benchmarks.attested:seal": a contender that module registers when imported
        importlib.import_module(module)
    contender = CONTENDERS[spec["contender"]]
    server = spec.get("server_pid")
    who = resource.RUSAGE_CHILDREN if contender.external else resource.RUSAGE_SELF
    repeats = max(3, int(spec.get("repeats", 5)))
    cores = spec.get("contention_cores")
    rss_start = vm_hwm_kib(os.getpid())
    run = contender.factory(**spec.get("params", {}))
    rss_ready = 0 if contender.external else vm_hwm_kib(os.getpid())

    started = time.perf_counter()
    peak = run()
    warmup_s = time.perf_counter() - started
    budget_s = max(5.0, min(40.0, (repeats + 3) * warmup_s))
    deadline = time.perf_counter() + budget_s

    calls: list[tuple[float, float, float, float]] = []  # (wall, own cpu, others' cpu, server cpu)
    external_peak = int(peak) if contender.external else 0  # type: ignore[call-overload]
    while True:
        # The last call's result must not live through the next one: a seal returns its Manifest,
        # ~40 MB for 100,000 files, which would count in the next call's peak RSS.
        peak = None
        cpu_before, busy_before, server_before = _cpu_s(who), system_busy_s(), process_cpu_s(server)
        started = time.perf_counter()
        peak = run()
        wall = time.perf_counter() - started
        cpu = _cpu_s(who) - cpu_before
        server_cpu = process_cpu_s(server) - server_before
        calls.append((wall, cpu, max(0.0, system_busy_s() - busy_before - cpu - server_cpu), server_cpu))
        if contender.external:
            external_peak = max(external_peak, int(peak))  # type: ignore[call-overload]
        clean = [c for c in calls if not _contended(c[2], c[0], cores)]
        if len(clean) >= repeats or (len(calls) >= 3 and time.perf_counter() > deadline):
            break
    used = clean if len(clean) >= 3 else calls
    return {
        "times_s": [c[0] for c in used],
        "cpu_s": [c[1] for c in used],
        "other_cpu_s": [c[2] for c in used],
        "server_cpu_s": [c[3] for c in used],
        "calls": len(calls),
        "dropped": len(calls) - len(used),
        "contended": len(used) > len(clean),
        "warmup_s": warmup_s,
        "rss_start_kib": rss_start,
        "rss_ready_kib": rss_ready,
        "rss_peak_kib": external_peak if contender.external else vm_hwm_kib(os.getpid()),
    }


def main() -> None:
    result = measure(json.load(sys.stdin))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
