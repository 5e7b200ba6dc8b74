"""``python -m benchmarks.verified [--mib 512] [--tensors 16] [--repeats 5] [--dir DIR] [--no-s3] [--json]``

Verified loads against their plain peers, on the same bytes, each call in a child process of its
own (so that peak RSS is that call's: VmHWM), the contenders in turns:

- local, hot page cache: plain ``torch.distributed.checkpoint.load`` (DCP's ``FsspecReader``) and
  ``integrity_fs.dcp.load`` (one pass: every byte hashed as it is read) of a state dict saved by
  ``integrity_fs.dcp.save`` (64 MiB chunks, its default);
- S3 (moto on 127.0.0.1, in this process): the same two loads, with the bytes of content the
  server sent counted per call;
- one file read whole: ``open`` + ``read`` + ``hashlib.sha256`` (what a user would write) and
  ``integrity_fs.open(...).read()``.

Medians of ``--repeats`` calls per contender (after one warm-up call each). The targets follow as
PASS/MISS lines. ``--json`` prints the rows as JSON (``python -m benchmarks`` runs it that way).
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


def _rows(
    where: str,
    contenders: dict[str, tuple[str, str, dict[str, Any]]],
    repeats: int,
    mib: int,
    tensors: int,
    served: _Served | None = None,
) -> list[Row]:
    calls: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for kind, url, options in contenders.values():
        _call(kind, url, options, mib, tensors)  # warm-up: page cache, imports
    for _ in range(repeats):
        for name, (kind, url, options) in contenders.items():
            before = served.total if served is not None else 0
            result = _call(kind, url, options, mib, tensors)
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


def run(mib: int, tensors: int, repeats: int, workdir: Path, *, s3: bool = True) -> tuple[list[Row], int, float]:
    """The rows, the checkpoint's size in bytes (its files, the manifest aside), and the seconds
    SHA-256 of those bytes takes in memory on one core (what any verified load adds in CPU)."""
    from integrity_fs import dcp, read_manifest

    sd = _state_dict(mib, tensors)
    local = str(workdir / "ckpt")
    dcp.save(sd, local)
    manifest = read_manifest(local)
    total = sum((manifest.sizes or {}).values())
    big = max(manifest.sizes or {}, key=lambda n: (manifest.sizes or {})[n])
    rows = _rows(
        "local",
        {
            "dcp.load (DCP's FsspecReader)": ("dcp-plain", local, {}),
            "integrity_fs.dcp.load": ("dcp-ours", local, {}),
        },
        repeats,
        mib,
        tensors,
    )
    rows += _rows(
        "local",
        {
            "read + hashlib.sha256": ("read-plain", f"{local}/{big}", {}),
            "integrity_fs.open(...).read()": ("read-ours", f"{local}/{big}", {}),
        },
        repeats,
        mib,
        tensors,
    )
    if s3:
        from benchmarks.s3 import BUCKET, moto_server

        served = _Served()
        with moto_server(served.wrap) as options:
            url = f"s3://{BUCKET}/verified-load"
            dcp.save(sd, url, storage_options=options)
            rows += _rows(
                "S3 (moto)",
                {
                    "dcp.load (DCP's FsspecReader)": ("dcp-plain", url, options),
                    "integrity_fs.dcp.load": ("dcp-ours", url, options),
                },
                max(1, repeats // 2),
                mib,
                tensors,
                served,
            )
    return rows, total, _hash_s(local, list(manifest.sizes or {}))


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


def table(rows: list[Row], total: int) -> str:
    plain = {r.where + ":" + ("read" if "read" in r.contender else "dcp"): r for r in rows if "plain" in _kind(r)}
    lines = [
        "| where | contender | median s | min-max s | ratio to plain | CPU s | peak RSS MiB | RSS before MiB | "
        "bytes served ÷ checkpoint | calls |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        base = plain[r.where + ":" + ("read" if "read" in r.contender else "dcp")]
        served = f"{r.served_bytes / total:.3f}" if r.served_bytes is not None else "—"
        lines.append(
            f"| {r.where} | {r.contender} | {r.median_s:.3f} | {r.spread_s[0]:.3f}-{r.spread_s[1]:.3f} "
            f"| {r.median_s / base.median_s:.2f}x | {r.cpu_s:.2f} | {r.peak_rss_mib:.0f} | {r.rss_before_mib:.0f} "
            f"| {served} | {r.calls} |"
        )
    return "\n".join(lines)


def _kind(row: Row) -> str:
    return "ours" if row.contender.startswith("integrity_fs") else "plain"


def target_lines(rows: list[Row], total: int, hash_s: float) -> list[str]:
    """PASS/MISS lines for the verified-load targets, with the floor of a verified load here."""
    by = {(r.where, r.contender): r for r in rows}
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'MISS'}: {text}")

    local_ours, local_plain = by[("local", "integrity_fs.dcp.load")], by[("local", "dcp.load (DCP's FsspecReader)")]
    ratio = local_ours.median_s / local_plain.median_s
    # Any load that hashes every byte does plain's work and SHA-256's, at best spread over every core.
    floor = max(local_plain.median_s, (local_plain.cpu_s + hash_s) / CORES) / local_plain.median_s
    line(
        ratio <= 1.25,
        f"local integrity_fs.dcp.load {ratio:.2f}x plain dcp.load (target ≤ 1.25x; the floor here, plain's CPU "
        f"time plus SHA-256 of every byte ({hash_s:.2f} s on one core) spread over {CORES} cores, is {floor:.2f}x)",
    )
    extra = local_ours.peak_rss_mib - local_plain.peak_rss_mib
    line(
        extra <= 2 * CHUNK / MiB,
        f"its peak RSS {extra:+.1f} MiB over plain's (target ≤ +{2 * CHUNK // MiB} MiB: three 64 MiB units are held, "
        "one being read and two hashed ahead)",
    )
    ours, plain = by[("local", "integrity_fs.open(...).read()")], by[("local", "read + hashlib.sha256")]
    ratio = ours.median_s / plain.median_s
    line(ratio <= 1.1, f"integrity_fs.open read whole {ratio:.2f}x a bare read + hashlib (target ≤ 1.1x)")
    if ("S3 (moto)", "integrity_fs.dcp.load") in by:
        s3_ours, s3_plain = (
            by[("S3 (moto)", "integrity_fs.dcp.load")],
            by[("S3 (moto)", "dcp.load (DCP's FsspecReader)")],
        )
        served = (s3_ours.served_bytes or 0) / total
        line(served <= 1.02, f"moto: integrity_fs.dcp.load GETs {served:.3f}x the checkpoint's bytes (target ≤ 1.02x)")
        ratio = s3_ours.median_s / s3_plain.median_s
        line(ratio <= 1.0, f"moto: integrity_fs.dcp.load {ratio:.2f}x plain dcp.load's time (target ≤ 1.0x)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="state dict size in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--no-s3", action="store_true", help="leave out the S3 (moto) rows")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="ifs-bench-verified-", dir=args.dir)
    try:
        rows, total, hash_s = run(args.mib, args.tensors, args.repeats, Path(tmp), s3=not args.no_s3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        result = {"rows": [asdict(r) for r in rows], "total": total, "hash_s": hash_s}
        print(json.dumps({**result, "mib": args.mib, "tensors": args.tensors}))
        return
    print(f"state dict of {args.tensors} tensors, {args.mib} MiB in all ({total} bytes of files)\n")
    print(table(rows, total))
    print("\n".join(["", *target_lines(rows, total, hash_s)]))


if __name__ == "__main__":
    main()
