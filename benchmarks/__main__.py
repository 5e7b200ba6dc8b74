"""``python -m benchmarks [--quick] [--write] [--only SECTION] [--dir DIR] [--max-wait S] [--clean]
[--integrity-fs DIR]``

Every verified path of integrity_fs beside the plain peer a user would write, on the same bytes,
with SHA-256 and with CRC-64/NVME manifests side by side, each divided by the floor it is held to;
markdown on stdout, each row printed as soon as its group is measured, the targets as PASS/MISS
lines after each section, every MISS and SKIP again at the end. See README.md in this folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import datasets
from benchmarks.datasets import Dataset, MiB, human
from benchmarks.harness import CORES, REPO, Bench, Contender, Row, log, ratio
from benchmarks.runner import HINTS

RESULTS = os.path.join(REPO, "benchmarks", "results.md")
SECTIONS = ("verify", "many", "open", "dcp", "safetensors", "s3", "seal", "prune")
NAMES = {"sha256": "SHA-256", "crc64nvme": "CRC-64/NVME", "crc32c": "CRC32C", "blake3": "BLAKE3"}
FDN = f"file_digest on {CORES} threads"
#: The SHA-256 figures of the last full run (2-core AMD EPYC, benchmarks/results.md before this
#: harness): time over the same floor. A SHA-256 path may be at most 5% slower.
LAST = {
    "several": 1.00,  # verify, 4 x 512 MiB ÷ hashlib.file_digest on 2 threads
    "one": 1.02,  # verify, chunk granularity, 1 x 1 GiB ÷ SHA-256 of 64 MiB ranges on 2 threads
    "small": 0.78,  # verify, 5000 x 64 KiB ÷ hashlib.file_digest on 1 thread
    "blake3": 0.93,  # BLAKE3 verify ÷ b3sum
    "open": 0.56,  # integrity_fs.open whole read ÷ read + hashlib.sha256
    16: 1.42,  # dcp.load, 16 x 32 MiB ÷ plain dcp.load with FsspecReader
    32: 1.44,  # 32 x 16 MiB
    512: 1.09,  # 512 x 1 MiB
    "save": 1.13,  # integrity_fs.dcp.save ÷ plain dcp.save, sync_files=True
    "safetensors": 1.91,  # load_state_dict ÷ load_file + every tensor copied
    "s3": 0.82,  # verify on moto, 4 x 64 MiB ÷ a bare s3fs streaming read, 4 at a time
}


@dataclass(frozen=True)
class Config:
    name: str
    several: Dataset
    one: Dataset
    small: Dataset
    many: Dataset
    dcp_mib: int  # each state dict of the dcp section; the shapes are tensor counts
    safetensors_mib: int
    s3: Dataset
    prune_mib: int  # one checkpoint of the keep_last loop
    repeats: int  # timed calls per contender, after one warm-up call


QUICK = Config(
    "quick",
    Dataset("several large files", 4, 64 * MiB),
    Dataset("one large file", 1, 256 * MiB),
    Dataset("small files", 1000, 64 * 1024),
    Dataset("very many tiny files", 20000, 4096),
    128,
    128,
    Dataset("S3 (moto)", 4, 16 * MiB),
    32,
    3,
)
FULL = Config(
    "full",
    Dataset("several large files", 4, 512 * MiB),
    Dataset("one large file", 1, 1024 * MiB),
    Dataset("small files", 5000, 64 * 1024),
    Dataset("very many tiny files", 100000, 4096),
    512,
    512,
    Dataset("S3 (moto)", 4, 64 * MiB),
    128,
    7,
)


def versus(bench: Bench, what: str, row: Row | None, floor: Row | None, limit: float, tail: str = "") -> None:
    """``what``: ``row``'s time ÷ ``floor``'s, PASS when at most ``limit``."""
    r = ratio(row, floor)
    if r is None or row is None or floor is None:
        return bench.target(None, what, [row, floor])
    times = f"{row.median():.3f} s vs {floor.median():.3f} s"
    bench.target(r <= limit, f"{what}: {r:.2f}x {floor.label} ({times}); target ≤ {limit:.2f}x{tail}", [row, floor])


def no_regression(bench: Bench, what: str, row: Row | None, floor: Row | None, last: float) -> None:
    tail = f" (last figure {last:.2f}x, 2 cores; no regression over 5%)"
    versus(bench, what if "BLAKE3" in what else f"{what}, SHA-256", row, floor, last * 1.05, tail)


def peak_rss(bench: Bench, what: str, row: Row | None, limit_mib: int) -> None:
    mib = row.rss_peak_kib / 1024 if row is not None and row.ok else 0
    bench.target(mib <= limit_mib, f"peak RSS of {what}: {mib:.0f} MiB; target ≤ {limit_mib} MiB", [row])


def c(key: str, label: str, name: str, floor: str | None = None, /, *, reads: bool = True, **params: Any) -> Contender:
    """A row; ``params`` go to the contender ``name``. A ``url`` that is an exception (its sealed
    copy needs a package that is missing) makes a skipped row."""
    if isinstance(params.get("url"), Exception):
        return Contender(key, label, "skip", {"reason": str(params["url"])}, floor)
    return Contender(key, label, name, params, floor, reads)


def made(make: Callable[..., str], *args: Any) -> str | Exception:
    """``make(*args)``, or the ``NotImplementedError`` saying which package it needs."""
    try:
        return make(*args)
    except NotImplementedError as error:
        return error


def run_verify(bench: Bench, cfg: Config, root: str) -> None:
    bench.section("Local verify, hot page cache", "In file granularity; the one large file in 64 MiB chunks.\n")
    for name, ds in (("several", cfg.several), ("one", cfg.one), ("small", cfg.small)):
        data, chunk = datasets.data_dir(root, ds), 64 * MiB if name == "one" else None
        sha_floor = "ranges" if name == "one" else FDN if name == "several" and CORES > 1 else "file_digest"
        rows = [
            c("readinto", "bare readinto loop, 1 thread, 4 MiB buffer", "readinto", directory=data),
            c("file_digest", "hashlib.file_digest, 1 thread", "file_digest", directory=data),
        ]
        if CORES > 1:
            label = f"hashlib.file_digest, {CORES} threads, a file per task"
            rows.append(c(FDN, label, "file_digest", directory=data, threads=CORES))
        if name == "one":
            label = f"hashlib.sha256 of 64 MiB ranges, {CORES} threads"
            rows.append(c("ranges", label, "ranges", directory=data, threads=CORES))
            label = "integrity_fs.verify, SHA-256, file granularity"
            rows.append(c("sha256-file", label, "verify", "file_digest", url=made(datasets.sealed, root, ds)))
        for a in ("sha256", "crc64nvme", "crc32c") if name == "several" else ("sha256", "crc64nvme"):
            label = f"integrity_fs.verify, {NAMES[a]}" + (", 64 MiB chunks" if chunk else "")
            floor = sha_floor if a == "sha256" else "readinto"
            rows.append(c(a, label, "verify", floor, url=made(datasets.sealed, root, ds, a, chunk)))
        if name == "several":
            url = made(datasets.sealed, root, ds, "blake3")
            rows.append(c("blake3", "integrity_fs.verify, BLAKE3", "verify", "b3sum", url=url))
            rows.append(c("b3sum", "b3sum (maps each file, every core)", "b3sum", directory=data))
        if name != "one":
            label = "model_signing, file serialization"
            rows.append(c("model_signing", label, "model_signing", FDN if CORES > 1 else "file_digest", directory=data))
        datasets.warm(data)
        got = bench.group(ds.title, ds.nbytes, rows)
        versus(bench, f"verify, {ds.title}, CRC-64/NVME", got["crc64nvme"], got["readinto"], 1.1)
        no_regression(bench, f"verify, {ds.title}", got["sha256"], got[sha_floor], LAST[name])
        if name == "one" and CORES > 1:
            what = f"{ds.title}: 64 MiB chunks ≥ 1.8x faster than file granularity"
            versus(bench, what, got["sha256"], got["sha256-file"], 1 / 1.8)
        if name == "several":
            versus(bench, f"verify, {ds.title}, CRC32C", got["crc32c"], got["readinto"], 1.1)
            what = f"BLAKE3 verify ≥ 1.8x faster than SHA-256 verify, {ds.title}"
            versus(bench, what, got["blake3"], got["sha256"], 1 / 1.8)
            no_regression(bench, f"BLAKE3 verify, {ds.title}", got["blake3"], got["b3sum"], LAST["blake3"])
            peak_rss(bench, f"verify, {ds.title}, SHA-256", got["sha256"], 150)
            peak_rss(bench, f"verify, {ds.title}, CRC-64/NVME", got["crc64nvme"], 150)
    bench.end_section()


def run_many(bench: Bench, cfg: Config, root: str) -> None:
    ds = cfg.many
    bench.section(f"{ds.title}: memory and the quick path")
    url = datasets.sealed(root, ds)
    datasets.warm(datasets.data_dir(root, ds))
    rows = [
        c("walk", "os.walk + os.stat of every file", "walk", reads=False, directory=url),
        c("quick", "integrity_fs.verify(quick=True)", "verify", "walk", reads=False, url=url, quick=True),
        c("verify", "integrity_fs.verify, SHA-256", "verify", url=url),
        c("seal", "integrity_fs.seal, SHA-256", "seal", url=datasets.links(root, ds, "seal")),
    ]
    got = bench.group(ds.title, ds.nbytes, rows)
    versus(bench, "verify(quick=True) of very many tiny files", got["quick"], got["walk"], 1.5)
    peak_rss(bench, f"verify of {ds.title}", got["verify"], 150)
    peak_rss(bench, f"seal of {ds.title}", got["seal"], 150)
    bench.end_section()


def run_open(bench: Bench, cfg: Config, root: str) -> None:
    ds = cfg.one
    bench.section(f"integrity_fs.open: one file of {human(ds.size)} read whole into the caller's buffer, 64 MiB chunks")
    path = os.path.join(datasets.data_dir(root, ds), "f00000.bin")
    rows = [
        c("readinto", "open + readinto the caller's buffer", "buffer_readinto", path=path),
        c("readinto+sha256", "open + readinto + hashlib.sha256", "buffer_readinto", path=path, sha256=True),
    ]
    for a in ("sha256", "crc64nvme"):
        label = f"integrity_fs.open + readinto the caller's buffer, {NAMES[a]}"
        url = made(datasets.sealed, root, ds, a, 64 * MiB)
        floor = "readinto+sha256" if a == "sha256" else "readinto"
        rows.append(c(a, label, "open_readinto", floor, url=url, name="f00000.bin"))
    datasets.warm(os.path.dirname(path))
    got = bench.group(human(ds.size), ds.size, rows)
    versus(bench, "integrity_fs.open whole read, CRC-64/NVME", got["crc64nvme"], got["readinto"], 1.1)
    no_regression(bench, "integrity_fs.open whole read", got["sha256"], got["readinto+sha256"], LAST["open"])
    bench.end_section()


def missing(bench: Bench, *modules: str) -> bool:
    """True (and the section says why) when one of ``modules`` cannot be imported here."""
    for module in modules:
        try:
            __import__(module)
        except ImportError:
            bench.out(f"skipped: {module} is not installed: {HINTS.get(module, f'pip install {module}')}\n")
            bench.end_section()
            return True
    return False


def run_dcp(bench: Bench, cfg: Config, root: str) -> None:
    mib = cfg.dcp_mib
    bench.section(f"torch.distributed.checkpoint: {mib} MiB state dicts, one process, hot page cache, 64 MiB chunks")
    if missing(bench, "torch"):
        return
    for tensors in (16, 32, 512):
        shape, shaped = f"{tensors} x {human(mib * MiB // tensors)}", {"tensors": tensors, "mib": mib}
        urls = {a: made(datasets.dcp_checkpoint, root, tensors, mib, a) for a in ("sha256", "crc64nvme")}
        plain = urls["sha256"]
        rows = [
            c("plain", "dcp.load(checkpoint_id=path)", "dcp_load", url=plain, reader="plain", **shaped),
            c(
                "FsspecReader",
                "dcp.load, DCP's FsspecReader",
                "dcp_load",
                "plain",
                url=plain,
                reader="fsspec",
                **shaped,
            ),
        ]
        rows += [c(a, f"integrity_fs.dcp.load, {NAMES[a]}", "dcp_load", "plain", url=urls[a], **shaped) for a in urls]
        for url in urls.values():
            if isinstance(url, str):
                datasets.warm(url)
        got = bench.group(shape, mib * MiB, rows)
        versus(bench, f"dcp.load, {shape}, CRC-64/NVME", got["crc64nvme"], got["plain"], 1.15)
        no_regression(bench, f"dcp.load, {shape}", got["sha256"], got["FsspecReader"], LAST[tensors])
        for a in urls:  # two 64 MiB units held: the one DCP copies from and the next
            over = (got[a].rss_peak_kib - got["plain"].rss_peak_kib) / 1024
            what = f"dcp.load, {shape}, {NAMES[a]}: peak RSS {over:+.0f} MiB over plain's; target ≤ +128 MiB"
            bench.target(over <= 128, what, [got[a], got["plain"]])
    saves, shaped = os.path.join(root, "saves"), {"tensors": 32, "mib": mib}
    rows = [c("plain", "dcp.save(checkpoint_id=path)", "dcp_save", url=f"{saves}/plain", plain=True, **shaped)]
    for a in ("sha256", "crc64nvme"):
        label = f"integrity_fs.dcp.save, {NAMES[a]}"
        rows.append(c(a, label, "dcp_save", "plain", url=f"{saves}/{a}", algorithm=a, **shaped))
    got = bench.group(f"save, 32 x {human(mib * MiB // 32)}", mib * MiB, rows)
    no_regression(bench, "dcp.save, sync_files=True", got["sha256"], got["plain"], LAST["save"])
    bench.end_section()


def run_safetensors(bench: Bench, cfg: Config, root: str) -> None:
    mib = cfg.safetensors_mib
    bench.section(f"safetensors: one model.safetensors of {mib} MiB in 64 tensors, hot page cache, 64 MiB chunks")
    if missing(bench, "torch", "safetensors"):
        return
    urls = {a: made(datasets.safetensors_file, root, mib, 64, a) for a in ("sha256", "crc64nvme")}
    path = [os.path.join(root, f"safetensors-{mib}MiB-64", "data", "model.safetensors")]
    rows = [
        c("load_file+copy", "safetensors.torch.load_file, every tensor cloned", "load_file", paths=path, copy=True),
        c("load_file", "safetensors.torch.load_file (mapped: reads nothing yet)", "load_file", paths=path, copy=False),
    ]
    for a, url in urls.items():
        label = f"integrity_fs.integrations.safetensors.load_state_dict, {NAMES[a]}"
        rows.append(c(a, label, "load_state_dict", "load_file+copy", url=url))
    datasets.warm(os.path.dirname(path[0]))
    got = bench.group(f"{mib} MiB", mib * MiB, rows)
    versus(bench, "load_state_dict, CRC-64/NVME", got["crc64nvme"], got["load_file+copy"], 1.2)
    no_regression(bench, "load_state_dict", got["sha256"], got["load_file+copy"], LAST["safetensors"])
    bench.end_section()


def run_s3(bench: Bench, cfg: Config, root: str) -> None:
    ds = cfg.s3
    shape = f"{ds.count} x {human(ds.size)}"
    bench.section(f"S3: moto's server in this process on 127.0.0.1, {shape} (clients compared, not storage)")
    if missing(bench, "s3fs", "moto"):
        return
    from benchmarks.s3 import BUCKET, moto_server, upload

    with moto_server() as (options, served):
        data = datasets.data_dir(root, ds)
        log(f"  uploading {ds.title} with integrity_fs.upload ...")
        urls = {a: made(upload, options, data, a) for a in ("sha256", "crc64nvme")}
        datasets.warm(data)
        on = {"options": options}
        rows = [
            c(
                "fs.get",
                "s3fs fs.get(url, dest, recursive=True)",
                "fs_get",
                url=urls["sha256"],
                dest=f"{root}/get",
                **on,
            )
        ]
        rows += [
            c(a, f"integrity_fs.download, {NAMES[a]}", "download", "fs.get", url=u, dest=f"{root}/{a}", **on)
            for a, u in urls.items()
        ]
        got = bench.group(f"download, {shape}", ds.nbytes, rows, served=lambda: served.total)
        versus(bench, "download from moto, CRC-64/NVME: fs.get's time ±10%", got["crc64nvme"], got["fs.get"], 1.1)
        what = "download from moto, SHA-256: fs.get's time ±10% (no earlier figure)"
        versus(bench, what, got["sha256"], got["fs.get"], 1.1)
        for a in urls:
            sent = got[a].median("served") / ds.nbytes if got[a].ok else 0
            what = f"download, {NAMES[a]}, reads each byte once: the server sent {sent:.3f}x the checkpoint"
            bench.target(sent <= 1.02, f"{what}; target ≤ 1.02x", [got[a]])
        threads, so = min(16, ds.count), {"storage_options": options}
        label = f"s3fs open + read(1 MiB), {threads} at a time"
        rows = [c("s3fs read", label, "s3_read", url=urls["sha256"], threads=threads, **on)]
        rows += [c(a, f"integrity_fs.verify, {NAMES[a]}", "verify", "s3fs read", url=u, **so) for a, u in urls.items()]
        label = "integrity_fs.verify(attested=True), CRC-64/NVME"
        rows.append(
            c("attested", label, "verify", "crc64nvme", reads=False, url=urls["crc64nvme"], attested=True, **so)
        )
        got = bench.group(f"verify, {shape}", ds.nbytes, rows, served=lambda: served.total)
        no_regression(bench, "verify on moto", got["sha256"], got["s3fs read"], LAST["s3"])
        r = ratio(got["attested"], got["crc64nvme"])
        bench.note(f"- NOTE attested verify: {r or 0:.3f}x the time of a full verify (CRC-64/NVME, {shape}).")
        sent = got["attested"].median("served") if got["attested"].ok else -1
        bench.target(
            sent == 0, f"attested verify reads no content: the server sent {sent:.0f} bytes", [got["attested"]]
        )
        rows = [
            c("fs.put", "s3fs fs.put(src, url, recursive=True)", "fs_put", src=data, url=f"s3://{BUCKET}/put", **on)
        ]
        for a in urls:
            url = f"s3://{BUCKET}/up-{a}"
            rows.append(
                c(a, f"integrity_fs.upload, {NAMES[a]}", "upload", "fs.put", src=data, url=url, algorithm=a, **on)
            )
        got = bench.group(f"upload, {shape}", ds.nbytes, rows)
        for a in urls:
            versus(bench, f"upload with checksums, {NAMES[a]}", got[a], got["fs.put"], 1.05)
    bench.end_section()


def run_seal(bench: Bench, cfg: Config, root: str) -> None:
    ds = cfg.several
    bench.section(f"Sealing a local directory, {ds.title}")
    datasets.warm(datasets.data_dir(root, ds))
    rows = [
        c("seal()", "integrity_fs.seal(), SHA-256", "seal", url=datasets.links(root, ds, "seal")),
        c(
            "signed",
            "integrity_fs.seal(private_key=EC P-256 PEM)",
            "seal",
            "seal()",
            url=datasets.links(root, ds, "signed"),
            signed=True,
        ),
        c(
            "crc64nvme",
            "integrity_fs.seal(algorithm='crc64nvme')",
            "seal",
            "seal()",
            url=datasets.links(root, ds, "crc"),
            algorithm="crc64nvme",
        ),
    ]
    got = bench.group(ds.title, ds.nbytes, rows)
    versus(bench, "seal(private_key=…) vs seal()", got["signed"], got["seal()"], 1.02)
    bench.end_section()


def run_prune(bench: Bench, cfg: Config, root: str) -> None:
    mib, keep = cfg.prune_mib, 3
    note = "Each timed call saves the next step; MiB read per call: `rchar` of the child's `/proc/<pid>/io`.\n"
    bench.section(f"Retention: a loop of dcp.save(..., keep_last={keep}), {mib} MiB in 8 tensors, local disk", note)
    if missing(bench, "torch"):
        return
    shaped = {"tensors": 8, "mib": mib}
    rows = [
        c(
            "plain",
            "dcp.save(checkpoint_id=path), no retention",
            "dcp_save",
            url=f"{root}/prune-plain",
            plain=True,
            **shaped,
        )
    ]
    for a in ("sha256", "crc64nvme"):
        label = f"integrity_fs.dcp.save(keep_last={keep}), {NAMES[a]}"
        rows.append(
            c(a, label, "dcp_keep_last", "plain", root=f"{root}/prune-{a}", keep_last=keep, algorithm=a, **shaped)
        )
    got = bench.group(f"{mib} MiB per checkpoint", mib * MiB, rows, repeats=keep + 5)
    for a in ("sha256", "crc64nvme"):
        steady = [call for call in got[a].calls if call.get("step", 0) >= keep]  # the run already held keep_last
        reads = [call["read"] / MiB for call in steady]
        wrote = sum(call["written"] for call in steady) / max(1, len(steady)) / MiB
        most = max(reads, default=0)
        what = f"dcp.save(keep_last={keep}), {NAMES[a]}, steady state: at most {most:.1f} MiB read per save"
        detail = f" beyond the {wrote:.0f} MiB it wrote (per save: {', '.join(f'{r:.1f}' for r in reads)})"
        bench.target(
            bool(steady) and max(reads) <= mib, f"{what}{detail}; target ≤ one checkpoint ({mib} MiB)", [got[a]]
        )
    bench.end_section()


RUNNERS: dict[str, Callable[[Bench, Config, str], None]] = {
    "verify": run_verify,
    "many": run_many,
    "open": run_open,
    "dcp": run_dcp,
    "safetensors": run_safetensors,
    "s3": run_s3,
    "seal": run_seal,
    "prune": run_prune,
}


def machine() -> str:
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        flags = ", sha_ni" if " sha_ni" in info else ""
        with open("/proc/meminfo") as f:
            memory = f"{int(f.readline().split()[1]) / 1024**2:.0f} GiB RAM"
    except OSError:
        memory = "memory unknown"
    system = f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    return f"{cpu}, {CORES} cores{flags}, {memory}, {system}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Benchmarks of integrity_fs.")
    parser.add_argument("--quick", action="store_true", help="small datasets, a few minutes")
    parser.add_argument(
        "--write", action="store_true", help="also write the report to benchmarks/results.md as it goes"
    )
    parser.add_argument("--only", action="append", help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    parser.add_argument("--dir", default=datasets.DEFAULT_ROOT, help="where datasets are cached (default: %(default)s)")
    parser.add_argument("--clean", action="store_true", help="delete the cached datasets and exit")
    parser.add_argument(
        "--max-wait", type=float, default=3.0, help="seconds to wait for idle cores before each group (default: 3)"
    )
    parser.add_argument("--integrity-fs", metavar="DIR", help="benchmark the integrity_fs package found in DIR instead")
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--only", action="append")
    if "chaos" in (first.parse_known_args(argv)[0].only or ()):  # its own harness and options (benchmarks/chaos.py)
        from benchmarks import chaos

        return chaos.main(argv)
    args = parser.parse_args(argv)
    if args.clean:
        datasets.clean(args.dir)
        return 0
    if set(args.only or ()) - set(SECTIONS):
        parser.error(f"--only takes {', '.join(SECTIONS)} (or chaos, alone)")
    cfg, root = QUICK if args.quick else FULL, os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    if args.integrity_fs:
        sys.path.insert(0, os.path.abspath(args.integrity_fs))
    import integrity_fs

    results = open(RESULTS, "w", encoding="utf-8") if args.write else None  # noqa: SIM115 (written as the run goes)

    def out(line: str) -> None:
        print(line, flush=True)
        if results is not None:
            results.write(line + "\n")
            results.flush()

    import_path = os.path.abspath(args.integrity_fs) if args.integrity_fs else None
    bench = Bench(out, cfg.repeats, args.max_wait, wait_budget_s=20 * args.max_wait, import_path=import_path)
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    out(f"# integrity_fs benchmarks ({cfg.name} run)\n")
    out(f"Machine: {machine()}.  ")
    out(f"Command: `{command}`, integrity_fs from {os.path.dirname(integrity_fs.__file__)}.  ")
    out(
        "Hot page cache. Each contender runs in a child process of its own (peak RSS: its VmHWM); after one warm-up "
        f'call each, the {cfg.repeats} timed calls of a group\'s contenders alternate. Medians; "÷ floor": the median '
        'of the ratios of calls made in the same turn to the row named. "cores busy": the child\'s CPU seconds per '
        'second (with the moto server\'s, in this process). "(n busy)": calls during which other processes kept more '
        "than 0.25 cores busy; ⚠: the group began on a busy machine. Targets rest on the rows they name.\n"
    )
    started = time.perf_counter()
    try:
        for section in args.only or SECTIONS:
            log(f"{section}:")
            try:
                RUNNERS[section](bench, cfg, root)
            except Exception as error:  # the other sections still run; the exit status says so
                traceback.print_exc()
                bench.failures += 1
                out(f"\nThe {section} section failed: {type(error).__name__}: {error}\n")
        n = {w: sum(line.startswith(f"- {w}") for line in bench.targets) for w in ("**PASS", "**MISS", "SKIP")}
        busy = f"; {sum(bench.groups)} of {len(bench.groups)} groups began on a busy machine (⚠)" * any(bench.groups)
        out(f"## Summary\n\n{n['**PASS']} targets PASS, {n['**MISS']} MISS, {n['SKIP']} skipped{busy}.\n")
        out("\n".join(line for line in bench.targets if line.startswith(("- **MISS", "- SKIP"))) + "\n")
        out(f"The run took {time.perf_counter() - started:.0f} s.")
    finally:
        if results is not None:
            results.close()
            log(f"wrote {RESULTS}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
