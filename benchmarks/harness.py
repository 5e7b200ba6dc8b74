"""The parent's side: run a group of contenders, each in a child of its own (``benchmarks.runner``),
their timed calls alternating, and print each row as soon as its group is measured.

Per call, the parent reads the child from outside: CPU seconds (``/proc/<pid>/stat``, its
subprocesses included), bytes read and written (``rchar``/``wchar`` of ``/proc/<pid>/io``), and
the CPU every other process used meanwhile (``/proc/stat``, less the child's and this process's,
which runs the moto server where there is one). A call during which the others kept more than
``BUSY_CORES`` cores busy is a busy call; a row whose calls were mostly busy is marked.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = os.cpu_count() or 1
#: Other processes' load, in cores, above which a call (or the machine before a group) is busy.
BUSY_CORES = 0.25
MiB = 1024 * 1024
#: "MiB read per call": ``rchar`` of the child; in groups on moto, the content bytes the server sent.
COLUMNS = (
    "data",
    "contender",
    "median s",
    "min-max s",
    "GB/s",
    "÷ floor",
    "cores busy",
    "peak RSS MiB",
    "MiB read per call",
    "calls",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def system_busy_s() -> float:
    """CPU seconds all processes have spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of its waited-for children (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def process_io(pid: int) -> tuple[int, int]:
    """Bytes ``pid`` has read and written through system calls (``rchar``, ``wchar``)."""
    with open(f"/proc/{pid}/io") as f:
        values = dict(line.split(": ") for line in f.read().splitlines())
    return int(values["rchar"]), int(values["wchar"])


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Contender:
    """One row of a group: ``name`` in ``contenders.CONTENDERS`` called with ``params``; divided
    by the row ``floor`` (a key of the same group); ``reads``: GB/s means something."""

    key: str
    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    floor: str | None = None
    reads: bool = True


@dataclass
class Row:
    data: str
    contender: Contender
    nbytes: int
    calls: list[dict[str, float]] = field(default_factory=list)
    rss_peak_kib: int = 0
    skipped: str | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return self.contender.label

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.error and bool(self.calls)

    def median(self, what: str = "wall") -> float:
        return float(statistics.median(c[what] for c in self.calls))

    @property
    def busy(self) -> bool:
        """Most calls ran while other processes kept more than ``BUSY_CORES`` busy."""
        return 2 * sum(_busy(c) for c in self.calls) > len(self.calls)

    @property
    def why_not(self) -> str:
        return self.skipped or self.error or "not measured"


def _busy(call: dict[str, float]) -> bool:
    # /proc/stat counts 10 ms ticks: two ticks of slack on short calls.
    return call["others"] > BUSY_CORES * call["wall"] + 0.02


def ratio(row: Row | None, floor: Row | None) -> float | None:
    """``row``'s time over ``floor``'s: the median of the ratios of calls made in the same turn
    (they alternate, so each pair saw the same machine), or of the medians."""
    if row is None or floor is None or not row.ok or not floor.ok:
        return None
    if len(row.calls) == len(floor.calls):
        return float(statistics.median(a["wall"] / b["wall"] for a, b in zip(row.calls, floor.calls, strict=True)))
    return row.median() / floor.median()


class _Child:
    """A ``benchmarks.runner`` child: started with its setup done, then one call at a time."""

    def __init__(self, spec: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.runner", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.first = self.receive()

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            stderr = self.process.stderr.read() if self.process.stderr else ""
            return {"error": (stderr.strip().splitlines() or [f"exit {self.process.returncode}"])[-1]}
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, command: str) -> None:
        stdin: IO[str] | None = self.process.stdin
        assert stdin is not None
        stdin.write(command + "\n")
        stdin.flush()

    def close(self) -> int:
        peak = 0
        try:
            if self.process.poll() is None:
                self.send("quit")
                peak = int(self.receive().get("rss_peak_kib", 0))
        except OSError:  # it had exited
            pass
        self.process.kill()
        self.process.wait()
        return peak


@dataclass
class Bench:
    """Runs groups of contenders and prints the report as it goes (``out`` takes each line)."""

    out: Callable[[str], None]
    repeats: int
    max_wait_s: float
    wait_budget_s: float
    import_path: str | None = None
    rows: list[Row] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    failures: int = 0
    groups: list[bool] = field(default_factory=list)  # per group: began on a busy machine
    _section_targets: list[str] = field(default_factory=list)

    def section(self, title: str, note: str = "") -> None:
        self.out(f"## {title}\n")
        if note:
            self.out(note.strip() + "\n")
        self.out("| " + " | ".join(COLUMNS) + " |")
        self.out("|" + " --- |" * len(COLUMNS))

    def end_section(self) -> None:
        self.out("")
        if self._section_targets:
            self.out("\n".join(self._section_targets) + "\n")
        self.targets += self._section_targets
        self._section_targets = []

    def note(self, text: str) -> None:
        """A line printed after the section's table."""
        self._section_targets.append(text)

    def target(self, passed: bool | None, text: str, rows: list[Row | None]) -> None:
        """A PASS/MISS line; ``passed`` None: a row it rests on was not measured (SKIP)."""
        missing = [r for r in rows if r is None or not r.ok]
        if passed is None or missing:
            why = "; ".join(sorted({r.why_not for r in missing if r is not None})) or "not measured"
            self._section_targets.append(f"- SKIP {text.split(':')[0]}: {why}")
            return
        tail = " (⚠ busy machine: noisy)" if any(r is not None and r.busy for r in rows) else ""
        self._section_targets.append(f"- **{'PASS' if passed else 'MISS'}** {text}{tail}")

    def group(
        self,
        data: str,
        nbytes: int,
        contenders: list[Contender],
        *,
        repeats: int | None = None,
        served: Callable[[], int] | None = None,
    ) -> dict[str, Row]:
        """Start a child per contender (its setup untimed), make one warm-up call in each, then
        ``repeats`` timed calls each, in turns; print the rows; return them by key."""
        busy_before = self._wait_for_idle()
        self.groups.append(busy_before)
        rows = {c.key: Row(data, c, nbytes) for c in contenders}
        children: dict[str, _Child] = {}
        try:
            for c in contenders:
                log(f"  {data}: {c.label} ...")
                spec = {"contender": c.name, "params": c.params, "import_path": self.import_path}
                child = _Child(spec)
                if "ready" in child.first:
                    children[c.key] = child
                else:
                    rows[c.key].skipped, rows[c.key].error = child.first.get("skipped"), child.first.get("error")
                    child.close()
            for turn in range(-1, repeats or self.repeats):  # turn -1: the warm-up call
                keys = list(children)
                keys = keys[turn % len(keys) :] + keys[: turn % len(keys)] if keys else keys
                for key in keys:
                    call = self._call(children[key], served)
                    if "error" in call or "skipped" in call:
                        rows[key].error, rows[key].skipped = call.get("error"), call.get("skipped")
                        rows[key].calls = []
                        children.pop(key).close()
                    elif turn >= 0:
                        rows[key].calls.append(call)
        finally:
            for key, child in children.items():
                rows[key].rss_peak_kib = child.close()
        for row in rows.values():
            if row.error:
                self.failures += 1
                log(f"  FAILED {row.label}: {row.error}")
            self.out(self._markdown(row, rows, busy_before, served is not None))
            self.rows.append(row)
        return rows

    def _call(self, child: _Child, served: Callable[[], int] | None) -> dict[str, Any]:
        pid = child.process.pid
        busy, own, me, io, sent = (
            system_busy_s(),
            process_cpu_s(pid),
            self_cpu_s(),
            process_io(pid),
            served() if served else 0,
        )
        child.send("call")
        message = child.receive()
        if "wall" not in message:
            return message
        own, me = process_cpu_s(pid) - own, self_cpu_s() - me
        read, written = (after - before for after, before in zip(process_io(pid), io, strict=True))
        return {
            "wall": message["wall"],
            "cpu": own,
            "server": me,
            "others": max(0.0, system_busy_s() - busy - own - me),
            "read": read,
            "written": written,
            "served": (served() - sent) if served else 0,
            **message["extra"],
        }

    def _wait_for_idle(self) -> bool:
        """Wait, at most ``max_wait_s`` and within the run's ``wait_budget_s``, for the others to
        leave the cores idle; True (and a line saying so) when the machine stays busy."""
        deadline = time.monotonic() + max(0.0, min(self.max_wait_s, self.wait_budget_s))
        started = time.monotonic()
        while True:
            before = system_busy_s()
            time.sleep(0.25)
            others = (system_busy_s() - before) / 0.25
            if others < BUSY_CORES:
                self.wait_budget_s -= time.monotonic() - started
                return False
            if time.monotonic() >= deadline:
                self.wait_budget_s -= time.monotonic() - started
                log(f"  the machine is busy: other processes keep {others:.1f} of {CORES} cores busy; measuring anyway")
                return True

    @staticmethod
    def _markdown(row: Row, rows: dict[str, Row], busy_before: bool, server: bool) -> str:
        head = [row.data, row.label]
        if not row.ok:
            return (
                "| " + " | ".join([*head, f"{'skipped' if row.skipped else 'failed'}: {row.why_not}", *[""] * 7]) + " |"
            )
        floor = rows.get(row.contender.floor or "")
        r = ratio(row, floor)
        wall = row.median()
        cores = statistics.median(c["cpu"] / c["wall"] for c in row.calls)
        moto = statistics.median(c["server"] / c["wall"] for c in row.calls)
        busy_calls = sum(_busy(c) for c in row.calls)
        calls = str(len(row.calls)) + (f" ({busy_calls} busy)" if busy_calls else "") + (" ⚠" if busy_before else "")
        cells = [
            f"{wall:.4f}",
            f"{min(c['wall'] for c in row.calls):.4f}-{max(c['wall'] for c in row.calls):.4f}",
            f"{row.nbytes / wall / 1e9:.2f}" if row.contender.reads and row.nbytes else "—",
            "" if r is None or floor is None else f"{r:.2f}x {floor.contender.key}",
            f"{cores:.2f}" + (f" + {moto:.2f} server" if server else ""),
            f"{row.rss_peak_kib / 1024:.0f}",
            f"{row.median('served' if server else 'read') / MiB:.1f}",
            calls,
        ]
        return "| " + " | ".join(head + cells) + " |"
