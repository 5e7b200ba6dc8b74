"""``python -m benchmarks.distributed [--files N] [--size-mib M] [--repeats R] [--worlds 1 2 4]``

Times ``integrity_fs.distributed.verify`` in ``rank0`` and ``sharded`` mode on one sealed local
checkpoint (in the page cache), with gloo process groups of each world size on this machine, and
prints a markdown table of medians.

Two worker settings per rank:
- ``max_workers=1``: one hashing thread per rank, the "one core per rank" model of a real job
  (where each rank has its own cores and often its own node);
- default ``max_workers`` (the CPU count): rank 0 alone already hashes on every core here, so on a
  small machine sharding has nothing left to win and oversubscribes the cores instead.

Each timed call runs between two barriers, after one warm-up call. The machine may be shared:
``others`` is the CPU time other user processes used during the median call (from ``/proc``), and
only calls during which others used under a tenth of a core count (``timed calls`` says how many
it took to get ``--repeats`` of them; after four times that many, every call counts).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
CORES = os.cpu_count() or 1
#: A timed call counts when other processes used less than this fraction of one core meanwhile.
QUIET = 0.1
PF_KTHREAD = 0x00200000


@dataclass(frozen=True)
class Row:
    world: int
    mode: str
    workers: str
    median_s: float
    others_cpu_s: float
    calls: int


def others_cpu_s(exclude: Collection[int]) -> float:
    """CPU seconds used so far by every user-space process but ``exclude``, ended children included.

    Kernel threads are left out: the page-cache writeback a benchmark itself causes runs there.
    """
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3 of proc(5), "state"
        if int(fields[6]) & PF_KTHREAD:
            continue
        ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _timed_verify(dist: Any, ranks: Collection[int], root: str, mode: str, workers: int | None) -> tuple[float, float]:
    """One verify between barriers: (wall s, CPU s other processes used meanwhile), rank 0's view on every rank."""
    from integrity_fs import distributed

    dist.barrier()
    others = others_cpu_s(ranks)
    start = time.perf_counter()
    distributed.verify(root, mode=mode, max_workers=workers)  # type: ignore[arg-type]
    dist.barrier()
    result = [(time.perf_counter() - start, others_cpu_s(ranks) - others)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _worker(rank: int, world: int, port: int, root: str, repeats: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, os.getpid())
    rows: list[Row] = []
    for workers in (1, None):
        for mode in ("rank0", "sharded"):
            _timed_verify(dist, ranks, root, mode, workers)  # warm-up
            clean: list[tuple[float, float]] = []
            every: list[tuple[float, float]] = []
            while len(clean) < repeats and len(every) < 4 * repeats:
                run = _timed_verify(dist, ranks, root, mode, workers)
                every.append(run)
                if run[1] < QUIET * run[0]:
                    clean.append(run)
            runs = clean if len(clean) >= repeats else every
            median = statistics.median(t for t, _ in runs)
            others = min(runs, key=lambda t: abs(t[0] - median))[1]
            label = "1" if workers else f"default ({CORES})"
            rows.append(Row(world, mode, label, median, others, len(every)))
    if rank == 0:
        Path(out).write_text(repr([r.__dict__ for r in rows]))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _make_checkpoint(root: Path, files: int, size: int) -> None:
    import integrity_fs

    root.mkdir()
    for i in range(files):
        with open(root / f"shard_{i}.bin", "wb") as f:
            for _ in range(size // MiB):
                f.write(os.urandom(MiB))
    integrity_fs.seal(root)
    integrity_fs.verify(root)  # and into the page cache


def run(files: int, size: int, repeats: int, worlds: list[int]) -> list[Row]:
    from torch.multiprocessing.spawn import spawn

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ifs-bench-dist-") as tmp:
        root = Path(tmp) / "ckpt"
        _make_checkpoint(root, files, size)
        for world in worlds:
            out = Path(tmp) / f"rows-{world}"
            args = (world, _free_port(), str(root), repeats, str(out))
            spawn(_worker, args=args, nprocs=world, join=True)  # type: ignore[no-untyped-call]
            rows += [Row(**r) for r in eval(out.read_text())]
    return rows


def table(rows: list[Row], total_bytes: int) -> str:
    rank0 = {(r.world, r.workers): r.median_s for r in rows if r.mode == "rank0"}
    lines = [
        "| ranks | mode | max_workers per rank | median s | GB/s | vs rank0 | others' CPU s | timed calls |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = r.median_s / rank0[(r.world, r.workers)]
        lines.append(
            f"| {r.world} | {r.mode} | {r.workers} | {r.median_s:.3f} | {total_bytes / r.median_s / 1e9:.2f} "
            f"| {ratio:.2f}x | {r.others_cpu_s:.2f} | {r.calls} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    size = args.size_mib * MiB
    rows = run(args.files, size, args.repeats, args.worlds)
    print(f"verify of {args.files} x {args.size_mib} MiB (page cache), {CORES} cores, median of {args.repeats}\n")
    print(table(rows, args.files * size))


if __name__ == "__main__":
    main()
