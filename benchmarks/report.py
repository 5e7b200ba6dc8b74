"""The markdown report: the machine, one table per section, and the targets as PASS/MISS lines."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from benchmarks.datasets import Dataset, GiB, MiB, human_size, shape
from benchmarks.harness import CORES, Bench, Row

if TYPE_CHECKING:
    from benchmarks import dcp


def machine_line() -> str:
    """CPU model, cores, whether the CPU has SHA extensions, memory, kernel, Python."""
    model, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    sha = "sha_ni in the CPU flags" if " sha_ni" in flags else "no sha_ni in the CPU flags"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return (
        f"{model}, {CORES} cores, {sha}, {memory:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def rows_table(
    rows: list[Row],
    reference: Callable[[Row], Row | None],
    *,
    server: bool = False,
    baselines: Callable[[Row], tuple[Row | None, Row | None]] | None = None,
) -> str:
    """A row per contender; ``server`` adds the moto server's CPU column, ``baselines`` (the
    ``hashlib.file_digest`` rows, one thread and every core, of a row's dataset) a column each."""
    headers = ["dataset", "contender", "median s", "GB/s", "cores busy"]
    headers += ["moto server, cores"] if server else []
    headers += ["other procs, cores", "peak RSS MiB", "RSS before work MiB", "time ÷ integrity_fs"]
    headers += ["time ÷ file_digest, 1 thread", f"time ÷ file_digest, {CORES} threads"] if baselines else []
    headers += ["timed calls"]
    body = []
    for row in rows:
        ref = reference(row)
        cells = [
            row.dataset,
            row.label,
            f"{row.median_s:.4f}",
            f"{row.gbps:.2f}" if row.reads_content else "n/a",
            f"{row.cores:.2f}",
        ]
        cells += [f"{row.server_cores:.2f}"] if server else []
        cells += [
            f"{row.other_cores:.2f}",
            f"{row.peak_mib:.0f}",
            f"{row.ready_mib:.0f}" if row.result["rss_ready_kib"] else "(subprocess)",
            f"{row.median_s / ref.median_s:.2f}x" if ref is not None else "",
        ]
        if baselines is not None:
            cells += [f"{row.median_s / b.median_s:.2f}x" if b is not None else "" for b in baselines(row)]
        cells.append(row.calls)
        body.append(cells)
    return table(headers, body)


def file_digest_rows(bench: Bench) -> Callable[[Row], tuple[Row | None, Row | None]]:
    """The ``hashlib.file_digest`` rows (one thread, every core) of a row's dataset."""

    def of(row: Row) -> tuple[Row | None, Row | None]:
        key = row.key.split(":")[0]
        return bench.find(f"{key}:fd1"), bench.find(f"{key}:fdN")

    return of


def vs_file_digest(bench: Bench, row: Row) -> str:
    """`` (vs hashlib.file_digest: 1.52x the speed of 1 thread, 0.98x the speed of 2 threads)``: a
    row's speed against the baselines a user would write, for the target lines; empty without them."""
    one, every = file_digest_rows(bench)(row)
    parts = [
        f"{b.median_s / row.median_s:.2f}x the speed of {what}"
        for b, what in ((one, "1 thread"), (every, f"{CORES} threads"))
        if b
    ]
    return f" (vs hashlib.file_digest: {', '.join(parts)})" if parts else ""


def reference_by(bench: Bench, suffix: str) -> Callable[[Row], Row | None]:
    """The row keyed ``<the row's dataset key>:<suffix>``."""
    return lambda row: bench.find(f"{row.key.split(':')[0]}:{suffix}")


def verdict(ok: bool, text: str, *rows: Row) -> str:
    """A PASS/MISS line; flagged when a row it rests on was measured under contention."""
    line = f"- **{'PASS' if ok else 'MISS'}** {text}"
    if any(r.result["contended"] for r in rows):
        line += " (measured while other processes held a core: rerun on an idle machine)"
    return line


def _overlap(a: Row, b: Row) -> bool:
    """Whether the two rows' fastest-to-slowest ranges of timed calls overlap."""
    return a.spread[0] <= b.spread[1] and b.spread[0] <= a.spread[1]


def local_targets(bench: Bench, several: Dataset, one: Dataset, memory: Dataset | None) -> list[str]:
    """The local targets and the chunk-granularity targets."""
    out: list[str] = []
    f = bench.find
    verify, threads = f("several:verify"), f("several:fdN")
    if verify and threads:
        ratio = verify.gbps / threads.gbps
        text = (
            f"local verify of {several.label} ({shape(several)}): {verify.gbps:.2f} GB/s = {ratio:.2f}x "
            f"hashlib.file_digest on {CORES} threads, one file per task ({threads.gbps:.2f} GB/s); target ≥ 0.9x"
        )
        out.append(verdict(ratio >= 0.9, text, verify, threads))

    signing = [r for r in (f("several:ms-file"), f("several:ms-shard")) if r is not None]
    if verify and signing:
        best = min(signing, key=lambda r: r.median_s)
        text = (
            f"local verify faster than model_signing on {several.label}: {verify.median_s:.3f} s vs "
            f"{best.median_s:.3f} s ({best.label}, its faster mode)"
        )
        if verify.median_s >= best.median_s and _overlap(verify, best):
            text += (
                f"; the gap ({verify.median_s / best.median_s - 1:.1%}) is within the run-to-run spread "
                f"(integrity_fs {verify.spread[0]:.3f}-{verify.spread[1]:.3f} s, model_signing "
                f"{best.spread[0]:.3f}-{best.spread[1]:.3f} s): both run at the all-cores SHA-256 limit"
            )
        out.append(verdict(verify.median_s < best.median_s, text, verify, best))
    for ours, theirs in ((f("small:verify"), f("small:ms-file")), (f("one:chunk"), f("one:ms-file"))):
        if ours and theirs:
            out.append(
                f"- NOTE {ours.dataset}: {ours.label} {ours.median_s:.3f} s, {theirs.label} "
                f"{theirs.median_s:.3f} s ({theirs.median_s / ours.median_s:.2f}x the time)"
            )

    full, quick = f("one:verify"), f("one:quick")
    if full and quick:
        speedup = full.median_s / quick.median_s
        text = (
            f"quick verify on {one.label} ({shape(one)}): {quick.median_s * 1000:.2f} ms vs {full.median_s:.3f} s "
            f"full = {speedup:.0f}x faster; target ≥ 100x{vs_file_digest(bench, full)}"
        )
        out.append(verdict(speedup >= 100, text, full, quick))

    mem = f("memory:verify") if memory is not None else f("several:verify")
    if mem:
        where = mem.dataset if memory is not None else f"{mem.dataset} (quick run; the target is for 4 GiB)"
        text = (
            f"peak RSS while verifying {where}: {mem.peak_mib:.0f} MiB, of which {mem.ready_mib:.0f} MiB before "
            f"any work (interpreter + imports); target < 150 MiB"
        )
        out.append(verdict(mem.peak_mib < 150, text))

    whole, chunk, raw = f("one:verify"), f("one:chunk"), f("one:ranges")
    if whole and chunk and raw:
        speedup = whole.median_s / chunk.median_s
        text = (
            f"{one.label} ({shape(one)}): chunk granularity verifies {speedup:.2f}x faster than file "
            f"granularity; target ≥ 1.8x{vs_file_digest(bench, chunk)}"
        )
        out.append(verdict(speedup >= 1.8, text, whole, chunk))
        ratio = chunk.gbps / raw.gbps
        text = (
            f"{one.label}: chunk verify {chunk.gbps:.2f} GB/s = {ratio:.2f}x {CORES} cores' raw SHA-256 rate "
            f"over 64 MiB ranges ({raw.gbps:.2f} GB/s); target ≥ 0.9x"
        )
        out.append(verdict(ratio >= 0.9, text, chunk, raw))
    return out


def small_file_lines(bench: Bench, small: Dataset, many: Dataset) -> list[str]:
    """Small files on every core, very many files in bounded memory, and the
    quick path near the cost of a bare listing. CPU seconds are printed beside the times: on a
    busy machine they show what the work costs where the wall clock cannot."""
    out: list[str] = []
    f = bench.find

    def cpu(row: Row) -> str:
        return f"{row.median_s * row.cores:.3f} CPU s"

    default, single, fd1 = f(f"{small.key}:verify"), f(f"{small.key}:verify-w1"), f(f"{small.key}:fd1")
    fdn, serial, floor = f(f"{small.key}:fdN"), f(f"{small.key}:serial"), f(f"{small.key}:floor")
    if default and fd1:
        speedup = fd1.median_s / default.median_s
        text = (
            f"verify of {small.label} ({shape(small)}), default workers: {default.median_s:.3f} s ({cpu(default)}, "
            f"{default.cores:.2f} cores busy) = {speedup:.2f}x the speed of hashlib.file_digest on 1 thread "
            f"({fd1.median_s:.3f} s, {cpu(fd1)}); target ≥ 1.3x"
        )
        if fdn:
            text += f"; file_digest on {CORES} threads, one file per task: {fdn.median_s:.3f} s"
        if floor:
            reach = fd1.median_s / floor.median_s
            text += (
                f"; the floor here, the pinned read's five system calls and SHA-256 by hand on {CORES} threads: "
                f"{floor.median_s:.3f} s = {reach:.2f}x"
                + (" (the target is beyond this machine)" if reach < 1.3 else "")
            )
        out.append(verdict(speedup >= 1.3, text, default, fd1))
    if default and serial:
        out.append(
            f"- NOTE {small.label}: the default verify is {serial.median_s / default.median_s:.2f}x the speed of "
            f"the earlier baseline ({serial.median_s:.3f} s), a readinto loop that allocates a 1 MiB buffer per "
            "64 KiB file, which file_digest does not"
        )
    if default and single:
        text = (
            f"verify of {small.label}: default workers {default.median_s:.3f} s, max_workers=1 "
            f"{single.median_s:.3f} s ({cpu(single)}); target: the default never slower{vs_file_digest(bench, single)}"
        )
        out.append(verdict(default.median_s <= single.median_s, text, default, single))
    for name, what in (("seal", "seal"), ("verify", "verify")):
        row = f(f"{many.key}:{name}")
        if row:
            text = (
                f"peak RSS of {what} of {many.label} ({shape(many)}): {row.peak_mib:.0f} MiB, of which "
                f"{row.ready_mib:.0f} MiB before any work; {row.median_s:.3f} s ({cpu(row)}); target ≤ 150 MiB"
            )
            out.append(verdict(row.peak_mib <= 150, text))
    quick, walk = f(f"{many.key}:quick"), f(f"{many.key}:walk")
    if quick and walk:
        ratio = quick.median_s / walk.median_s
        text = (
            f"quick verify of {many.label} ({shape(many)}): {quick.median_s:.3f} s ({cpu(quick)}) = {ratio:.2f}x "
            f"a bare os.walk + stat of the tree ({walk.median_s:.3f} s, {cpu(walk)}); target ≤ 1.5x"
        )
        parse, loads = f(f"{many.key}:manifest"), f(f"{many.key}:json")
        if parse and loads:
            text += (
                f"; of which the manifest read, strict parse and checks {parse.median_s:.3f} s (a bare json.loads "
                f"of it: {loads.median_s:.3f} s; the floor, walk + json.loads, is "
                f"{(walk.median_s + loads.median_s) / walk.median_s:.2f}x the walk)"
            )
        out.append(verdict(ratio <= 1.5, text, quick, walk))
    for name in ("verify", "seal"):
        row, fd1 = f(f"{many.key}:{name}"), f(f"{many.key}:fd1")
        if row and fd1:
            out.append(f"- NOTE {many.label}: integrity_fs.{name} {row.median_s:.3f} s{vs_file_digest(bench, row)}")
    return out


def chunk_size_lines(bench: Bench, datasets: Sequence[Dataset], chunk_sizes: Sequence[int]) -> list[str]:
    """Which chunk size of the sweep verifies fastest, per dataset, with all workers."""
    if len(chunk_sizes) < 2:
        return []
    out = []
    for ds in datasets:
        found = [(size, bench.find(f"{ds.key}:chunk{size // MiB}-w{CORES}")) for size in chunk_sizes]
        timed = [(size, row) for size, row in found if row is not None]
        if not timed:
            continue
        fastest = min(row.median_s for _, row in timed)
        slowest = max(row.median_s for _, row in timed)
        cells = ", ".join(
            f"{human_size(size)} {row.median_s:.3f} s" + (" (fastest)" if row.median_s == fastest else "")
            for size, row in timed
        )
        out.append(
            f"- CHUNK SIZE {ds.label} ({shape(ds)}), workers={CORES}: {cells}; slowest/fastest = "
            f"{slowest / fastest:.3f}"
        )
    return out


def s3_lines(bench: Bench, s3_sets: Sequence[Dataset], local_rate: Row | None) -> list[str]:
    """S3 verify vs the bare streaming read, what limits the local S3, and S3 memory."""
    out = []
    for ds in s3_sets:
        verify, stream = bench.find(f"{ds.key}:verify"), bench.find(f"{ds.key}:stream")
        if not (verify and stream):
            continue
        ratio = verify.gbps / stream.gbps
        text = (
            f"S3 verify, {ds.label} ({shape(ds)}): {verify.gbps:.3f} GB/s = {ratio:.2f}x the bare s3fs streaming "
            f"read ({stream.gbps:.3f} GB/s); target ≥ 0.9x"
        )
        out.append(verdict(ratio >= 0.9, text, verify, stream))
        if local_rate is not None:
            out.append(
                f"- NOTE the local S3 stack, not hashing, bounds S3: the bare read of {ds.label} moves "
                f"{stream.gbps:.3f} GB/s with the client busy {stream.cores:.2f} cores and the moto server "
                f"{stream.server_cores:.2f} cores of {CORES}, where local hashing reaches {local_rate.gbps:.2f} GB/s"
            )
        out.append(
            f"- NOTE S3 memory, {ds.label} ({shape(ds)}): verify peaks at {verify.peak_mib:.0f} MiB "
            f"({verify.ready_mib:.0f} MiB before work), the bare streaming read at {stream.peak_mib:.0f} MiB"
        )
    return out


def blake3_lines(bench: Bench, ds: Dataset) -> list[str]:
    """Verify with BLAKE3 against verify with SHA-256 and against b3sum."""
    out = []
    sha, b3, tool = bench.find(f"{ds.key}:verify"), bench.find(f"{ds.key}:verify-blake3"), bench.find(f"{ds.key}:b3sum")
    if sha and b3:
        speedup = sha.median_s / b3.median_s
        text = (
            f"BLAKE3 verify of {ds.label} ({shape(ds)}): {b3.median_s:.3f} s vs SHA-256 {sha.median_s:.3f} s = "
            f"{speedup:.2f}x faster; target ≥ 1.8x"
        )
        out.append(verdict(speedup >= 1.8, text, sha, b3))
    if b3 and tool:
        ratio = tool.median_s / b3.median_s
        text = (
            f"BLAKE3 verify of {ds.label}: {b3.gbps:.2f} GB/s = {ratio:.2f}x the speed of b3sum "
            f"({tool.gbps:.2f} GB/s); target ≥ 0.9x"
        )
        out.append(verdict(ratio >= 0.9, text, b3, tool))
    return out


DCP_DEFAULT = "integrity_fs.dcp.save"  # chunk granularity, dcp.save's default
DCP_FILE = "integrity_fs.dcp.save, file granularity"
DCP_COPIED = "integrity_fs.dcp.save, every write copied"


def dcp_costs_table(rows: Sequence[dcp.Row], hash_cpu_s: float, copy_cpu_s: float, nbytes: int) -> str:
    """Where the time of a sealed save goes: the parts measured on their own."""
    by = {(r.contender, r.sync_files): r for r in rows}
    body = [
        [f"SHA-256 of the {nbytes / MiB:.0f} MiB in memory, one core", f"{hash_cpu_s:.3f} CPU s", "hashing"],
        [
            "copying them into reused 8 MiB buffers, one core",
            f"{copy_cpu_s:.3f} CPU s",
            "what a write costs when nobody holds its memory; tensors are hashed in place instead",
        ],
    ]
    plain, synced = by.get(("dcp.save", False)), by.get(("dcp.save", True))
    if plain and synced:
        body.append(["fsync (plain dcp.save, sync_files on less off)", f"{synced.median_s - plain.median_s:.3f} s", ""])
        body.append(["plain dcp.save itself, sync_files off", f"{plain.cpu_s:.3f} CPU s", "DCP's own work"])
    for contender in (DCP_DEFAULT, DCP_COPIED):
        row, base = by.get((contender, False)), plain
        if row and base:
            body.append(
                [
                    f"`{contender}` less plain, sync_files off",
                    f"{row.cpu_s - base.cpu_s:.3f} CPU s",
                    "what sealing adds",
                ]
            )
    return table(["part", "cost", "note"], body)


def dcp_lines(
    rows: Sequence[dcp.Row], hash_cpu_s: float, copy_cpu_s: float | None = None, cores: int = CORES
) -> list[str]:
    """The ``integrity_fs.dcp.save`` targets: against plain ``dcp.save`` (fsynced) and the CPU
    floor; a MISS says what the floor is here."""
    by = {(r.contender, r.sync_files): r for r in rows}
    out: list[str] = []

    def line(ok: bool, text: str, *used: dcp.Row) -> str:
        busy = [r for r in used if r.others_cpu_s >= 0.1 * r.median_s]
        suffix = " (measured while other processes held a core: rerun on an idle machine)" if busy else ""
        return f"- **{'PASS' if ok else 'MISS'}** {text}{suffix}"

    plain = by.get(("dcp.save", True))
    for contender, target, what in ((DCP_DEFAULT, 1.12, "default (chunk granularity)"), (DCP_FILE, 1.25, "")):
        row = by.get((contender, True))
        if row is not None and plain is not None:
            ratio = row.median_s / plain.median_s
            # Hashing can use what the plain save leaves idle: the other cores, and the fsync's wait.
            floor = max(plain.median_s, (plain.cpu_s + hash_cpu_s) / cores)
            text = (
                f"`{contender}`{' ' + what if what else ''}, sync_files=True: {row.median_s:.3f} s = {ratio:.2f}x "
                f"plain `dcp.save` ({plain.median_s:.3f} s); target ≤ {target}x"
            )
            if ratio > target:
                text += (
                    f"; the floor here, max(plain save, (its CPU {plain.cpu_s:.2f} s + SHA-256 CPU {hash_cpu_s:.2f} s)"
                    f" / {cores} cores), is {floor / plain.median_s:.2f}x"
                )
            out.append(line(ratio <= target, text, row, plain))
    plain = by.get(("dcp.save", False))
    row = by.get((DCP_DEFAULT, False))
    if row is not None and plain is not None:
        # DCP's writer is one thread: a sealed save is never faster than the plain one either.
        cpu_floor = (plain.cpu_s + hash_cpu_s) / cores
        floor = max(cpu_floor, plain.median_s)
        ratio = row.median_s / floor
        what = (
            f"the CPU floor ((plain save CPU {plain.cpu_s:.2f} s + SHA-256 CPU {hash_cpu_s:.2f} s) / {cores} cores)"
            if floor == cpu_floor
            else f"plain `dcp.save` itself, longer here than the CPU floor {cpu_floor:.3f} s (DCP writes on one thread)"
        )
        text = (
            f"`{DCP_DEFAULT}` default, sync_files=False: {row.median_s:.3f} s = {ratio:.2f}x the floor {floor:.3f} s, "
            f"{what}; {row.median_s / plain.median_s:.2f}x plain `dcp.save`; target ≤ 1.1x the floor"
        )
        copied = by.get((DCP_COPIED, False))
        if copied is not None and copy_cpu_s is not None:
            text += (
                f" (every write copied instead of hashed in place: {copied.median_s:.3f} s; the copy alone costs "
                f"{copy_cpu_s:.2f} CPU s)"
            )
        out.append(line(ratio <= 1.1, text, row, plain))
    return out
