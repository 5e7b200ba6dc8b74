"""``python -m benchmarks.verified [--mib 512] [--shapes 16,32,512] [--repeats 5] [--dir DIR] [--no-s3]
[--no-safetensors] [--no-blake3] [--blake3-mib 512] [--json]``

Verified loads against their plain peers and their floors, side by side in one run, hot page cache:

- ``dcp.load``, for each state dict shape of ``--shapes`` (tensor counts; ``--mib`` in all: 16 x 32 MiB,
  32 x 16 MiB and 512 x 1 MiB by default): plain ``torch.distributed.checkpoint.load`` (DCP's
  ``FsspecReader``) and ``integrity_fs.dcp.load`` (one pass: every byte hashed as it is read) of a state
  dict saved by ``integrity_fs.dcp.save`` (64 MiB chunks, its default), each call in a child process
  of its own (so that its peak RSS is that call's: VmHWM), the two in turns. The floor of a verified
  load: plain's CPU time plus SHA-256 of every byte (on one core, in memory), spread over every core;
- one file read whole: ``open`` + ``read`` + ``hashlib.sha256`` and ``integrity_fs.open(...).read()``;
- S3 (moto on 127.0.0.1, in this process), the first shape: the two loads, with the bytes of content
  the server sent counted per call;
- safetensors (``benchmarks.safetensors``): ``load_state_dict`` against ``load_file`` + copy and its
  floor, for one ``model.safetensors`` and for 2 shards with their index;
- BLAKE3: ``integrity_fs.verify`` of ``4 x --blake3-mib`` MiB sealed with SHA-256 and with BLAKE3
  (each call in a child), and ``b3sum`` over the same files (its row is left out when it is not on
  ``PATH``; Debian: ``apt-get install b3sum``), in turns.

Medians of ``--repeats`` calls per contender (after one warm-up call each). The targets follow as
PASS/MISS lines. ``--json`` prints the results as JSON (``python -m benchmarks`` runs it that way,
with ``--no-safetensors --no-blake3``: its own sections measure those).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
CHUNK = 64 * MiB
CORES = os.cpu_count() or 1
#: Targets: a verified dcp.load within this factor of plain's time, and this much more peak RSS.
LOAD_TARGET = 1.35
RSS_TARGET_MIB = 2 * CHUNK // MiB
#: BLAKE3 verify: at least this fraction of b3sum's speed, and this many times SHA-256 verify's.
B3SUM_TARGET = 0.9
SHA256_TARGET = 1.8

#: What a child runs: ``{kind}`` ``{url}`` ``{options}`` ``{mib}`` ``{tensors}``; prints its measurement as JSON.
CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.filterwarnings("ignore")
kind, url, options, mib, tensors = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def rss_kib(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1])

if kind.startswith("dcp"):
    import torch
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from integrity_fs import dcp
    per = mib * 2**20 // tensors // 4
    target = {"model": {f"layer{i}.weight": torch.zeros(per) for i in range(tensors)}, "step": 0}
    before = rss_kib("VmRSS:")
    cpu, start = time.process_time(), time.perf_counter()
    if kind == "dcp-plain":
        dcp_load(target, storage_reader=FsspecReader(url, **options), no_dist=True)
    else:
        dcp.load(target, url, storage_options=options)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert target["step"] == 1 and float(target["model"]["layer0.weight"][0]) != 0.0
elif kind == "verify":
    import integrity_fs
    before = rss_kib("VmRSS:")
    cpu, start = time.process_time(), time.perf_counter()
    assert integrity_fs.verify(url).ok
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
else:
    import hashlib
    import integrity_fs
    root, name = url.rsplit("/", 1)
    before = rss_kib("VmRSS:")
    cpu, start = time.process_time(), time.perf_counter()
    if kind == "read-plain":
        with open(url, "rb") as f:
            data = f.read()
        hashlib.sha256(data).hexdigest()
    else:
        with integrity_fs.open(root, name) as f:
            data = f.read()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(data) > 0
print(json.dumps({"time_s": elapsed, "cpu_s": cpu, "hwm_kib": rss_kib("VmHWM:"), "before_kib": before}))
"""

PLAIN = "dcp.load (DCP's FsspecReader)"
OURS = "integrity_fs.dcp.load"


@dataclass(frozen=True)
class Row:
    """One contender's calls: medians, the peak RSS of its median call, and bytes served (S3)."""

    where: str
    contender: str
    median_s: float
    spread_s: tuple[float, float]
    cpu_s: float
    peak_rss_mib: float
    rss_before_mib: float
    served_bytes: int | None  # content bytes the S3 server sent in the median call
    calls: int


@dataclass(frozen=True)
class Shape:
    """A state dict of ``tensors`` tensors: the bytes of its checkpoint's files (the manifest aside)
    and the seconds SHA-256 of those bytes takes in memory on one core."""

    where: str
    tensors: int
    total: int
    hash_s: float


def where_of(mib: int, tensors: int) -> str:
    return f"{tensors} x {mib // tensors} MiB" if mib % tensors == 0 else f"{tensors} x {mib / tensors:.2f} MiB"


def _state_dict(total_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    per = total_mib * MiB // tensors // 4
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}
    return {"model": model, "step": 1}


class _Served:
    """A WSGI middleware counting the bytes of object GETs the server sends."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def wrap(self, app: Any) -> Any:
        def counted(environ: dict[str, Any], start_response: Any) -> Any:
            body = app(environ, start_response)
            if environ.get("REQUEST_METHOD") != "GET" or "list-type" in environ.get("QUERY_STRING", ""):
                return body
            return self._count(body)

        return counted

    def _count(self, body: Any) -> Any:
        try:
            for piece in body:
                with self._lock:
                    self.total += len(piece)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def _call(kind: str, url: str, options: dict[str, Any], mib: int, tensors: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, url, json.dumps(options), str(mib), str(tensors)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _b3sum(directory: str, _options: dict[str, Any], _mib: int, _tensors: int) -> dict[str, Any]:
    """``b3sum`` over the files of ``directory``, timed from here (its start included: a few ms)."""
    files = sorted(str(p) for p in Path(directory).iterdir() if p.name.endswith(".bin"))
    before = os.times()
    start = time.perf_counter()
    subprocess.run(["b3sum", *files], check=True, capture_output=True)
    elapsed = time.perf_counter() - start
    after = os.times()
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return {"time_s": elapsed, "cpu_s": cpu, "hwm_kib": 0, "before_kib": 0}


def _rows(
    where: str,
    contenders: dict[str, tuple[str, str, dict[str, Any]]],
    repeats: int,
    mib: int,
    tensors: int,
    served: _Served | None = None,
) -> list[Row]:
    calls: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}

    def call(kind: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
        return _b3sum(url, options, mib, tensors) if kind == "b3sum" else _call(kind, url, options, mib, tensors)

    for kind, url, options in contenders.values():
        call(kind, url, options)  # warm-up: page cache, imports
    for _ in range(repeats):
        for name, (kind, url, options) in contenders.items():
            before = served.total if served is not None else 0
            result = call(kind, url, options)
            result["served"] = (served.total - before) if served is not None else None
            calls[name].append(result)
    rows = []
    for name, results in calls.items():
        times = [r["time_s"] for r in results]
        median = statistics.median(times)
        middle = min(results, key=lambda r: abs(r["time_s"] - median))
        rows.append(
            Row(
                where,
                name,
                median,
                (min(times), max(times)),
                statistics.median(r["cpu_s"] for r in results),
                middle["hwm_kib"] / 1024,
                middle["before_kib"] / 1024,
                middle["served"],
                len(results),
            )
        )
    return rows


def run_loads(
    mib: int, shapes: list[int], repeats: int, workdir: Path, *, s3: bool = True
) -> tuple[list[Row], list[Shape]]:
    """The ``dcp.load`` rows of every shape (and S3's for the first), the ``open().read()`` rows,
    and each shape's bytes and SHA-256 time (what any verified load adds in CPU)."""
    from integrity_fs import dcp, read_manifest

    rows: list[Row] = []
    infos: list[Shape] = []
    for tensors in shapes:
        where = where_of(mib, tensors)
        local = str(workdir / f"ckpt-{tensors}")
        sd = _state_dict(mib, tensors)
        dcp.save(sd, local)
        manifest = read_manifest(local)
        sizes = manifest.sizes or {}
        infos.append(Shape(where, tensors, sum(sizes.values()), _hash_s(local, list(sizes))))
        contenders = {PLAIN: ("dcp-plain", local, {}), OURS: ("dcp-ours", local, {})}
        rows += _rows(where, contenders, repeats, mib, tensors)
        if tensors == shapes[0]:
            big = max(sizes, key=lambda n: sizes[n])
            reads = {
                "read + hashlib.sha256": ("read-plain", f"{local}/{big}", {}),
                "integrity_fs.open(...).read()": ("read-ours", f"{local}/{big}", {}),
            }
            rows += _rows("one file", reads, repeats, mib, tensors)
            if s3:
                from benchmarks.s3 import BUCKET, moto_server

                served = _Served()
                with moto_server(served.wrap) as options:
                    url = f"s3://{BUCKET}/verified-load"
                    dcp.save(sd, url, storage_options=options)
                    remote = {PLAIN: ("dcp-plain", url, options), OURS: ("dcp-ours", url, options)}
                    rows += _rows(f"S3 (moto), {where}", remote, max(1, repeats // 2), mib, tensors, served)
        del sd
        shutil.rmtree(local, ignore_errors=True)
    return rows, infos


def _hash_s(root: str, names: list[str]) -> float:
    """SHA-256 of the files' bytes, already in memory, on one core: the median of three passes."""
    data = [Path(root, name).read_bytes() for name in names]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for piece in data:
            hashlib.sha256(piece).digest()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floor_of(plain: Row, shape: Shape) -> float:
    """The least a load that checks every byte can take here, as a ratio to plain's time: plain's
    own work and SHA-256's, spread over every core."""
    return max(plain.median_s, (plain.cpu_s + shape.hash_s) / CORES) / plain.median_s


def table(rows: list[Row], shapes: list[Shape]) -> str:
    by = {(r.where, r.contender): r for r in rows}
    floors = {s.where: s for s in shapes}
    lines = [
        "| state dict | contender | median s | min-max s | ratio to plain | floor | CPU s | peak RSS MiB | "
        "over plain MiB | bytes served ÷ checkpoint | calls |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        plain_name = "read + hashlib.sha256" if r.where == "one file" else PLAIN
        plain = by[(r.where, plain_name)]
        shape = floors.get(r.where.removeprefix("S3 (moto), "))
        floor = f"{floor_of(plain, shape):.2f}x" if shape is not None and r.where in floors else "—"
        total = shape.total if shape is not None else 0
        served = f"{r.served_bytes / total:.3f}" if r.served_bytes is not None and total else "—"
        over = f"{r.peak_rss_mib - plain.peak_rss_mib:+.0f}" if r is not plain else "—"
        lines.append(
            f"| {r.where} | {r.contender} | {r.median_s:.3f} | {r.spread_s[0]:.3f}-{r.spread_s[1]:.3f} "
            f"| {r.median_s / plain.median_s:.2f}x | {floor} | {r.cpu_s:.2f} | {r.peak_rss_mib:.0f} | {over} "
            f"| {served} | {r.calls} |"
        )
    return "\n".join(lines)


def target_lines(rows: list[Row], shapes: list[Shape]) -> list[str]:
    """PASS/MISS lines for the verified-load targets, each with the floor of a verified load here."""
    by = {(r.where, r.contender): r for r in rows}
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    for shape in shapes:
        ours, plain = by[(shape.where, OURS)], by[(shape.where, PLAIN)]
        ratio = ours.median_s / plain.median_s
        line(
            ratio <= LOAD_TARGET,
            f"{shape.where}: integrity_fs.dcp.load {ratio:.2f}x plain dcp.load (target ≤ {LOAD_TARGET}x; the floor "
            f"here, plain's CPU time plus SHA-256 of every byte ({shape.hash_s:.2f} s on one core) spread over "
            f"{CORES} cores, is {floor_of(plain, shape):.2f}x)",
        )
        extra = ours.peak_rss_mib - plain.peak_rss_mib
        line(
            extra <= RSS_TARGET_MIB,
            f"{shape.where}: its peak RSS {extra:+.0f} MiB over plain's (target ≤ +{RSS_TARGET_MIB} MiB: two "
            "64 MiB units, the one DCP copies from and the next, read ahead)",
        )
    if ("one file", "integrity_fs.open(...).read()") in by:
        ours, plain = by[("one file", "integrity_fs.open(...).read()")], by[("one file", "read + hashlib.sha256")]
        ratio = ours.median_s / plain.median_s
        line(ratio <= 1.1, f"integrity_fs.open read whole {ratio:.2f}x a bare read + hashlib (target ≤ 1.1x)")
    remote = [s for s in shapes if (f"S3 (moto), {s.where}", OURS) in by]
    for shape in remote:
        where = f"S3 (moto), {shape.where}"
        ours, plain = by[(where, OURS)], by[(where, PLAIN)]
        served = (ours.served_bytes or 0) / shape.total
        line(served <= 1.02, f"moto: integrity_fs.dcp.load GETs {served:.3f}x the checkpoint's bytes (target ≤ 1.02x)")
        ratio = ours.median_s / plain.median_s
        line(ratio <= 1.0, f"moto: integrity_fs.dcp.load {ratio:.2f}x plain dcp.load's time (target ≤ 1.0x)")
    return out


# --------------------------------------------------------------------------- safetensors, BLAKE3


def run_safetensors(mib: int, repeats: int, workdir: Path) -> list[dict[str, Any]]:
    """``benchmarks.safetensors`` on one file and on 2 shards with their index."""
    from benchmarks import safetensors

    results = []
    for shards in (1, 2):
        folder = workdir / f"safetensors-{shards}"
        folder.mkdir()
        try:
            results.append(safetensors.run(mib, 64, repeats, folder, shards))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return results


def safetensors_text(results: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    from benchmarks import safetensors

    parts, lines = [], []
    for result in results:
        parts += [f"safetensors, {safetensors.what(result)}:", "", safetensors.table(result), ""]
        parts += [safetensors.floor_line(result) + ".", ""]
        lines += safetensors.target_lines(result)
    return parts, lines


def run_blake3(mib: int, repeats: int, root: str) -> list[Row]:
    """verify of 4 x ``mib`` MiB sealed with SHA-256 and with BLAKE3, and b3sum, in turns."""
    from benchmarks import datasets

    ds = datasets.Dataset("blake3", "BLAKE3 set", 4, mib * MiB)
    sha256, blake3 = datasets.sealed_dir(root, ds), datasets.sealed_dir(root, ds, algorithm="blake3")
    datasets.warm(datasets.ensure_files(root, ds))
    contenders = {
        "integrity_fs.verify, SHA-256": ("verify", sha256, {}),
        "integrity_fs.verify, BLAKE3": ("verify", blake3, {}),
    }
    if shutil.which("b3sum"):
        contenders["b3sum (mmap, all cores)"] = ("b3sum", datasets.data_dir(root, ds), {})
    return _rows(f"4 x {mib} MiB", contenders, repeats, mib, 1)


def blake3_lines(rows: list[Row]) -> list[str]:
    by = {r.contender: r for r in rows}
    sha, b3, tool = (
        by["integrity_fs.verify, SHA-256"],
        by["integrity_fs.verify, BLAKE3"],
        by.get("b3sum (mmap, all cores)"),
    )
    speedup = sha.median_s / b3.median_s
    out = [
        f"- {'PASS' if speedup >= SHA256_TARGET else 'MISS'}: BLAKE3 verify of {b3.where} {speedup:.2f}x faster "
        f"than SHA-256 verify ({b3.median_s:.3f} s vs {sha.median_s:.3f} s; target ≥ {SHA256_TARGET}x)"
    ]
    if tool is not None:
        ratio = tool.median_s / b3.median_s
        out.append(
            f"- {'PASS' if ratio >= B3SUM_TARGET else 'MISS'}: BLAKE3 verify {ratio:.2f}x the speed of b3sum on the "
            f"same files ({b3.median_s:.3f} s vs {tool.median_s:.3f} s; target ≥ {B3SUM_TARGET}x)"
        )
    else:
        out.append("- NOTE: b3sum is not on PATH (Debian: apt-get install b3sum): its comparison is left out")
    return out


def blake3_table(rows: list[Row]) -> str:
    sha = next(r for r in rows if r.contender == "integrity_fs.verify, SHA-256")
    lines = [
        "| files | contender | median s | min-max s | GB/s | CPU s | time ÷ SHA-256 verify | calls |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    size = 4 * int(sha.where.split(" x ")[1].split()[0]) * MiB
    for r in rows:
        lines.append(
            f"| {r.where} | {r.contender} | {r.median_s:.3f} | {r.spread_s[0]:.3f}-{r.spread_s[1]:.3f} | "
            f"{size / r.median_s / 1e9:.2f} | {r.cpu_s:.2f} | {r.median_s / sha.median_s:.2f}x | {r.calls} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="state dict size in MiB")
    parser.add_argument("--shapes", default="16,32,512", help="tensor counts of the state dicts, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--no-s3", action="store_true", help="leave out the S3 (moto) rows")
    parser.add_argument("--no-safetensors", action="store_true", help="leave out the safetensors rows")
    parser.add_argument("--no-blake3", action="store_true", help="leave out the BLAKE3 rows")
    parser.add_argument("--blake3-mib", type=int, default=512, help="size of each of the 4 BLAKE3 files")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    shapes = [int(n) for n in args.shapes.split(",")]
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ifs-bench-verified-", dir=args.dir))
    try:
        rows, infos = run_loads(args.mib, shapes, args.repeats, tmp, s3=not args.no_s3)
        tensors = None if args.no_safetensors else run_safetensors(args.mib, args.repeats, tmp)
        b3 = None
        if not args.no_blake3:
            from benchmarks import datasets

            b3 = run_blake3(args.blake3_mib, args.repeats, str(args.dir or datasets.DEFAULT_ROOT))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        result = {
            "rows": [asdict(r) for r in rows],
            "shapes": [asdict(s) for s in infos],
            "safetensors": tensors,
            "blake3": None if b3 is None else [asdict(r) for r in b3],
            "mib": args.mib,
        }
        print(json.dumps(result))
        return
    print(f"state dicts of {args.mib} MiB: {', '.join(s.where for s in infos)}; {CORES} cores\n")
    print(table(rows, infos))
    lines = target_lines(rows, infos)
    if tensors is not None:
        parts, more = safetensors_text(tensors)
        print("\n" + "\n".join(parts))
        lines += more
    if b3 is not None:
        print("\n" + blake3_table(b3))
        lines += blake3_lines(b3)
    print("\n".join(["", *lines]))


if __name__ == "__main__":
    main()
