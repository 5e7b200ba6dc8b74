"""``python -m benchmarks.dcp [--mib 512] [--tensors 32] [--repeats 5] [--dir DIR] [--json]``

Times, on one state dict saved to a local directory (single process, no process group):

- ``dcp.save``: plain ``torch.distributed.checkpoint.save`` with DCP's ``FsspecWriter``;
- ``integrity_fs.dcp.save``: the same writer, hashing every file as it writes it, then the
  manifest; its default, chunk granularity (64 MiB chunks): the chunks of one file are hashed on
  several threads while it is written, each tensor's bytes where they lie (held, not copied);
- ``..., every write copied``: the same, with no write hashed in place: each is copied into
  reused buffers first (what a write of memory nobody holds costs);
- ``..., file granularity``: one digest per file, hashed on a helper thread;
- ``..., hashing inline``: chunk granularity with ``BACKGROUND_MIN_BYTES`` out of reach: every
  write is hashed in the writing thread (no copy, no overlap);
- ``dcp.save + seal``: the plain save, then ``integrity_fs.seal`` reading it all back (page cache).

with ``sync_files`` off (the page cache only: the worst case for the hashing overhead) and on
(DCP's default: fsync to disk). Medians after one warm-up; ``CPU s`` is this process's CPU time per
save, ``others`` the CPU time other user processes used during the median call. The machine may be
shared: only calls during which others used under a tenth of a core count (``timed calls`` says
how many it took to get ``--repeats`` of them).
Then where the time goes: SHA-256 of the same bytes in memory on one core (the floor of what
hashing adds), copying them into reused 8 MiB buffers (what hashing in place saves), and the fsync
(the plain save with ``sync_files`` on, less off); and the CPU floor of a sealed save: (plain
save CPU + SHA-256 CPU of the bytes) / cores. The targets follow as PASS/MISS lines
(``benchmarks.report.dcp_lines``). ``--json`` prints the rows as JSON instead (``python -m
benchmarks`` runs it that way, in a child process).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.distributed import others_cpu_s

MiB = 1024 * 1024
#: A timed call counts when other processes used less than this fraction of one core meanwhile.
QUIET = 0.1


@dataclass(frozen=True)
class Row:
    contender: str
    sync_files: bool
    median_s: float
    cpu_s: float
    others_cpu_s: float
    calls: int


def _state_dict(total_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    per = total_mib * MiB // tensors // 4
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}, "step": 1}


DEFAULT = "integrity_fs.dcp.save"
COPIED = "integrity_fs.dcp.save, every write copied"
FILE = "integrity_fs.dcp.save, file granularity"
INLINE = "integrity_fs.dcp.save, hashing inline"


def _contenders(sd: dict[str, Any], sync: bool) -> dict[str, Callable[[str], object]]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import integrity_fs
    from integrity_fs import dcp
    from integrity_fs.dcp import streams, writer

    def plain(path: str) -> object:
        return dcp_save(sd, storage_writer=FsspecWriter(path, sync_files=sync), no_dist=True)

    def then_seal(path: str) -> object:
        plain(path)
        return integrity_fs.seal(path)

    def hashing_inline(path: str) -> object:
        default, streams.BACKGROUND_MIN_BYTES = streams.BACKGROUND_MIN_BYTES, 1 << 62
        try:
            return dcp.save(sd, path, sync_files=sync)
        finally:
            streams.BACKGROUND_MIN_BYTES = default

    def copied(path: str) -> object:
        owner_of = writer.TensorOwners.owner_of
        writer.TensorOwners.owner_of = lambda self, view: None  # type: ignore[method-assign]
        try:
            return dcp.save(sd, path, sync_files=sync)
        finally:
            writer.TensorOwners.owner_of = owner_of  # type: ignore[method-assign]

    return {
        "dcp.save": plain,
        DEFAULT: lambda path: dcp.save(sd, path, sync_files=sync),
        COPIED: copied,
        FILE: lambda path: dcp.save(sd, path, sync_files=sync, granularity="file"),
        INLINE: hashing_inline,
        "dcp.save + seal": then_seal,
    }


def _time(save: Callable[[str], object], workdir: Path, repeats: int) -> tuple[float, float, float, int]:
    """Median (wall, CPU, others' CPU) of ``repeats`` clean calls, and how many calls it took.

    A call is clean when other processes used under ``QUIET`` of a core meanwhile; after
    ``4 * repeats`` calls the unclean ones count too (the table then shows their CPU use).
    """
    clean: list[tuple[float, float, float]] = []
    every: list[tuple[float, float, float]] = []
    me = {os.getpid()}
    path = workdir / "ckpt"
    shutil.rmtree(path, ignore_errors=True)
    save(str(path))  # warm-up
    while len(clean) < repeats and len(every) < 4 * repeats:
        shutil.rmtree(path, ignore_errors=True)
        others, cpu = others_cpu_s(me), time.process_time()
        start = time.perf_counter()
        save(str(path))
        run = (time.perf_counter() - start, time.process_time() - cpu, others_cpu_s(me) - others)
        every.append(run)
        if run[2] < QUIET * run[0]:
            clean.append(run)
    runs = clean if len(clean) >= repeats else every
    median = statistics.median(r[0] for r in runs)
    return (*min(runs, key=lambda r: abs(r[0] - median)), len(every))


@dataclass(frozen=True)
class Costs:
    """What the parts of a sealed save cost on their own, on one core (seconds)."""

    hash_s: float  # SHA-256 of the state dict's bytes in memory: wall
    hash_cpu_s: float  # and CPU
    copy_cpu_s: float  # copying the same bytes into reused 8 MiB buffers


def run(total_mib: int, tensors: int, repeats: int, workdir: Path) -> tuple[list[Row], Costs]:
    """The rows, and what hashing and copying the same bytes cost on one core."""
    sd = _state_dict(total_mib, tensors)
    rows = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for sync in (False, True):
            for name, save in _contenders(sd, sync).items():
                elapsed, cpu, others, calls = _time(save, workdir, repeats)
                rows.append(Row(name, sync, elapsed, cpu, others, calls))
    shutil.rmtree(workdir / "ckpt", ignore_errors=True)
    views = [memoryview(t.view(-1).numpy().data).cast("B") for t in sd["model"].values()]
    start, cpu = time.perf_counter(), time.process_time()
    for view in views:
        hashlib.sha256(view).hexdigest()
    hash_s, hash_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    buffers = [bytearray(8 * MiB) for _ in range(4)]
    cpu = time.process_time()
    for i, view in enumerate(views):
        for start in range(0, len(view), 8 * MiB):
            piece = view[start : start + 8 * MiB]
            buffers[i % 4][: len(piece)] = piece
    return rows, Costs(hash_s, hash_cpu_s, time.process_time() - cpu)


def table(rows: list[Row]) -> str:
    plain = {r.sync_files: r.median_s for r in rows if r.contender == "dcp.save"}
    lines = [
        "| save | sync_files | median s | vs dcp.save | CPU s | others' CPU s | timed calls |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.contender} | {r.sync_files} | {r.median_s:.3f} | {r.median_s / plain[r.sync_files]:.2f}x "
            f"| {r.cpu_s:.2f} | {r.others_cpu_s:.2f} | {r.calls} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="state dict size in MiB")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the rows and hashing times as JSON")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ifs-bench-dcp-", dir=args.dir) as tmp:
        rows, costs = run(args.mib, args.tensors, args.repeats, Path(tmp))
    if args.json:
        data = {"rows": [dataclasses.asdict(r) for r in rows], **dataclasses.asdict(costs)}
        print(json.dumps({**data, "mib": args.mib, "tensors": args.tensors, "repeats": args.repeats}))
        return
    from benchmarks.report import dcp_costs_table, dcp_lines

    print(f"state dict of {args.tensors} tensors, {args.mib} MiB in all; median of {args.repeats}\n")
    print(table(rows))
    print("\n" + dcp_costs_table(rows, costs.hash_cpu_s, costs.copy_cpu_s, args.mib * MiB))
    print("\n".join(["", *dcp_lines(rows, costs.hash_cpu_s, costs.copy_cpu_s)]))


if __name__ == "__main__":
    main()
