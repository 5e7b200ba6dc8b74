"""``python -m benchmarks.torchrun [--files 4] [--size-mib 512] [--repeats 5] [--dir DIR] [--json]``

The command line's scaling under a launcher: ``integrity-fs verify DIR --workers 1 --json`` as one
process, and the same command as ``torchrun --nproc-per-node 2 -m integrity_fs verify ...`` (sharded
mode, the default: each rank hashes half of the files). One hashing thread per process is the "one
core per rank" model of a real job, where each rank has cores (and often a node) of its own; a
third row gives one process with a thread per core, the best one process does on this machine.

Two times per call: ``verify s``, the ``elapsed_s`` that rank 0's ``--json`` report gives (the
listing, the collectives and the hashing), and ``command s``, the wall time of the whole command
from the shell, which adds the interpreter's start and, under torchrun, the launcher's start, one
``import torch`` per rank and the process group's rendezvous. The contenders run in turns,
``--repeats`` rounds after one warm-up round, on a hot page cache; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks import datasets
from benchmarks.datasets import Dataset, MiB

CORES = os.cpu_count() or 1
ONE = "1 process, --workers 1"
TWO = "torchrun --nproc-per-node 2, --workers 1"
ALL = f"1 process, --workers {CORES}"


@dataclass(frozen=True)
class Row:
    contender: str
    verify_s: float  # median elapsed_s of rank 0's report
    command_s: float  # median wall time of the whole command
    calls: int


def _commands(url: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "integrity_fs", "verify", url, "--json"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return {
        ONE: [*cli, "--workers", "1"],
        TWO: [*torchrun, "-m", "integrity_fs", "verify", url, "--json", "--workers", "1"],
        ALL: [*cli, "--workers", str(CORES)],
    }


def _call(command: list[str]) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    report = json.loads(done.stdout)
    if not report["ok"]:
        raise RuntimeError(f"{' '.join(command)}: not verified: {report}")
    return float(report["elapsed_s"]), wall


def run(root: str, ds: Dataset, repeats: int) -> list[Row]:
    url = datasets.sealed_dir(root, ds)
    datasets.warm(datasets.ensure_files(root, ds))
    commands = _commands(url)
    for command in commands.values():
        _call(command)  # warm-up: imports in the page cache
    calls: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            calls[name].append(_call(command))
    return [
        Row(
            name,
            statistics.median(v for v, _ in results),
            statistics.median(w for _, w in results),
            len(results),
        )
        for name, results in calls.items()
    ]


def table(rows: list[Row]) -> str:
    one = next(r for r in rows if r.contender == ONE)
    lines = [
        "| command | verify s | ÷ 1 process | command s | ÷ 1 process | calls |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.contender} | {r.verify_s:.3f} | {r.verify_s / one.verify_s:.2f}x | {r.command_s:.3f} "
            f"| {r.command_s / one.command_s:.2f}x | {r.calls} |"
        )
    return "\n".join(lines)


def target_lines(rows: list[Row]) -> list[str]:
    by = {r.contender: r for r in rows}
    ratio = by[TWO].verify_s / by[ONE].verify_s
    whole = by[TWO].command_s / by[ONE].command_s
    verdict = "PASS" if ratio <= 0.6 else "MISS"
    return [
        f"- {verdict}: `torchrun --nproc-per-node 2 -m integrity_fs verify` {ratio:.2f}x one process's "
        f"verify time, one hashing thread per process (target ≤ 0.6x); the whole command, launcher "
        f"and `import torch` per rank included, {whole:.2f}x"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=datasets.DEFAULT_ROOT, help="where datasets are cached (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if not _has_torch():
        raise SystemExit("torch is not installed: pip install 'torch==2.13.0'")
    ds = Dataset("several", "several large files", args.files, args.size_mib * MiB)
    rows = run(os.path.abspath(args.dir), ds, args.repeats)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "shape": datasets.shape(ds)}))
        return
    print(f"integrity-fs verify of {datasets.shape(ds)}, hot page cache, {CORES} cores\n")
    print(table(rows))
    print("\n".join(["", *target_lines(rows)]))


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
