"""``python -m benchmarks [--quick] [--write] [--dir DIR] [--clean] [--only SECTION ...]``

Runs every contender on the same bytes, each in its own child process, and prints markdown
tables of median time, throughput, CPU use and peak RSS, then the targets as PASS/MISS lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import attested, datasets, s3, torchrun, verified
from benchmarks import dcp as dcp_bench
from benchmarks import prune as prune_bench
from benchmarks import safetensors as safetensors_bench
from benchmarks.datasets import Dataset, GiB, MiB, human_size, shape
from benchmarks.harness import CORES, REPO, Bench, log
from benchmarks.report import (
    blake3_lines,
    chunk_size_lines,
    dcp_costs_table,
    dcp_lines,
    file_digest_rows,
    local_targets,
    machine_line,
    reference_by,
    rows_table,
    s3_lines,
    small_file_lines,
    table,
)
from integrity_fs import MANIFEST_FILENAME
from integrity_fs.manifest import json_parser

RESULTS = os.path.join(REPO, "benchmarks", "results.md")
SECTIONS = (
    "local",
    "memory",
    "chunks",
    "s3",
    "blake3",
    "attested",
    "recorded",
    "upload",
    "signing",
    "dcp",
    "verified",
    "safetensors",
    "torchrun",
    "prune",
)
#: The sections measured by a module of their own, run as ``python -m benchmarks.NAME --json`` in
#: a child process (torch is imported there only).
CHILD_SECTIONS = {
    "dcp": "benchmarks.dcp",
    "verified": "benchmarks.verified",
    "safetensors": "benchmarks.safetensors",
    "torchrun": "benchmarks.torchrun",
    "prune": "benchmarks.prune",
}


@dataclass(frozen=True)
class Config:
    """The sizes of one run (quick or full)."""

    name: str
    several: Dataset
    one: Dataset
    small: Dataset
    memory: Dataset | None  # the 4 GiB checkpoint of the memory target; None: judged on ``several``
    s3_sets: tuple[Dataset, ...]
    chunk_sizes: tuple[int, ...]
    blake3: Dataset  # verify with BLAKE3 against SHA-256 and b3sum
    many: Dataset  # very many tiny files, for memory and the quick path
    repeats: int  # timed calls per contender and round
    rounds: int  # round-robin passes over a dataset's contenders
    dcp_mib: int = 512  # the state dict of the DCP, verified-load and safetensors sections


QUICK = Config(
    name="quick",
    several=Dataset("several", "several large files", 4, 64 * MiB),
    one=Dataset("one", "one large file", 1, 256 * MiB),
    small=Dataset("small", "thousands of small files", 1000, 64 * 1024),
    memory=None,
    s3_sets=(
        Dataset("s3big", "S3 (moto), few large objects", 4, 16 * MiB),
        Dataset("s3many", "S3 (moto), many objects", 16, 4 * MiB),
    ),
    chunk_sizes=(64 * MiB,),
    blake3=Dataset("blake3", "BLAKE3 set", 4, 64 * MiB),
    many=Dataset("many", "very many tiny files", 20000, 4096),
    repeats=3,
    rounds=1,
    dcp_mib=128,
)
FULL = Config(
    name="full",
    several=Dataset("several", "several large files", 4, 512 * MiB),
    one=Dataset("one", "one large file", 1, GiB),
    small=Dataset("small", "thousands of small files", 5000, 64 * 1024),
    memory=Dataset("memory", "4 GiB checkpoint", 8, 512 * MiB),
    s3_sets=(
        Dataset("s3big", "S3 (moto), few large objects", 4, 64 * MiB),
        Dataset("s3many", "S3 (moto), many objects", 16, 16 * MiB),
    ),
    chunk_sizes=(16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB),
    blake3=Dataset("blake3", "BLAKE3 set", 4, 512 * MiB),
    many=Dataset("many", "very many tiny files", 100000, 4096),
    repeats=3,
    rounds=2,
)


def label_of(ds: Dataset) -> str:
    return f"{ds.label} ({shape(ds)})"


def run_baselines(bench: Bench) -> None:
    """Idle children: what the interpreter and each contender's imports cost in RSS."""
    for label, modules in (
        ("python, nothing imported", ()),
        ("python + integrity_fs", ("integrity_fs",)),
        ("python + integrity_fs + s3fs", ("integrity_fs", "s3fs")),
        ("python + model_signing", ("model_signing.hashing",)),
    ):
        bench.add("baseline", "idle", label, "idle", {"modules": modules}, 0, key=f"idle:{label}")
    bench.run()


def local_contenders(bench: Bench, ds: Dataset, *, ranges: bool = False, one_worker: bool = False) -> None:
    """Every local contender on ``ds``; ``ranges`` adds the threaded 64 MiB range hash,
    ``one_worker`` integrity_fs with ``max_workers=1``."""
    data = datasets.data_dir(bench.root, ds)
    sealed = datasets.sealed_dir(bench.root, ds)
    chunked = datasets.sealed_dir(bench.root, ds, 64 * MiB)
    datasets.warm(datasets.ensure_files(bench.root, ds))

    def m(name: str, title: str, contender: str, params: dict[str, Any], **kw: Any) -> None:
        bench.add("local", label_of(ds), title, contender, params, ds.total_bytes, key=f"{ds.key}:{name}", **kw)

    m("verify", "integrity_fs.verify (file granularity, default workers)", "integrity_fs", {"url": sealed})
    m("quick", "integrity_fs.verify(quick=True)", "integrity_fs", {"url": sealed, "quick": True}, reads_content=False)
    if one_worker:
        title = "integrity_fs.verify, max_workers=1"
        m("verify-w1", title, "integrity_fs", {"url": sealed, "max_workers": 1})
    m("chunk", "integrity_fs.verify, chunk granularity (64 MiB)", "integrity_fs", {"url": chunked})
    file_digests(m, data)
    m("serial", SERIAL, "hashlib-serial", {"directory": data})
    if one_worker:
        m("floor", FLOOR, "pinned-floor", {"directory": data})
    if ranges:
        m("ranges", f"hashlib, {CORES} threads, 64 MiB ranges", "hashlib-ranges", {"directory": data})
    if shutil.which("sha256sum"):
        m("sha256sum", "sha256sum (coreutils)", "sha256sum", {"directory": data})
    if shutil.which("openssl"):
        m("openssl", "openssl dgst -sha256", "openssl", {"directory": data})
    m("ms-file", "model_signing, file serialization", "model_signing-file", {"directory": data})
    m("ms-shard", "model_signing, shard serialization (1 GB shards)", "model_signing-shard", {"directory": data})
    bench.run()


FD1 = "hashlib.file_digest, 1 thread"
FDN = f"hashlib.file_digest, {CORES} threads, one file per task"
SERIAL = "hashlib.sha256, 1 thread, readinto a fresh 1 MiB buffer per file (the earlier baseline)"
FLOOR = f"floor: open, fstat, one read, fstat, close + sha256 by hand, batches of 64 files on {CORES} threads"


def file_digests(m: Callable[..., None], data: str) -> None:
    """The baselines a user would write: ``hashlib.file_digest`` on one thread and on every core."""
    m("fd1", FD1, "file-digest", {"directory": data})
    m("fdN", FDN, "file-digest-threads", {"directory": data})


def run_local(bench: Bench, cfg: Config) -> None:
    local_contenders(bench, cfg.several)
    local_contenders(bench, cfg.one, ranges=True)
    local_contenders(bench, cfg.small, one_worker=True)
    many_files(bench, cfg.many)


def many_files(bench: Bench, ds: Dataset) -> None:
    """Seal and verify of very many tiny files (peak RSS), and ``quick=True``
    against a bare ``os.walk`` + ``stat`` of the same tree."""
    sealed = datasets.sealed_dir(bench.root, ds)
    datasets.warm(datasets.ensure_files(bench.root, ds))

    def m(name: str, title: str, contender: str, params: dict[str, Any], **kw: Any) -> None:
        bench.add("local", label_of(ds), title, contender, params, ds.total_bytes, key=f"{ds.key}:{name}", **kw)

    m("verify", "integrity_fs.verify (file granularity, default workers)", "integrity_fs", {"url": sealed})
    m("seal", "integrity_fs.seal (overwrite=True)", "integrity_fs-seal", {"url": sealed})
    no_bytes = {"reads_content": False}
    m("quick", "integrity_fs.verify(quick=True)", "integrity_fs", {"url": sealed, "quick": True}, **no_bytes)
    m("walk", "os.walk + os.stat of every file", "walk-stat", {"directory": sealed}, reads_content=False)
    manifest = os.path.join(sealed, MANIFEST_FILENAME)
    m("manifest", "integrity_fs.read_manifest (strict parse and checks)", "read-manifest", {"url": sealed}, **no_bytes)
    m("json", "json.loads of the manifest file (no checks)", "json-loads", {"path": manifest}, **no_bytes)
    data = datasets.data_dir(bench.root, ds)
    file_digests(m, data)
    m("serial", SERIAL, "hashlib-serial", {"directory": data})
    bench.run()


def run_memory(bench: Bench, cfg: Config) -> None:
    """Peak RSS while verifying a 4 GiB checkpoint (full run only)."""
    ds = cfg.memory
    if ds is None:
        log("memory: skipped in the quick run (the target is judged on the several-files set)")
        return
    datasets.warm(datasets.ensure_files(bench.root, ds))
    for name, title, contender, params in (
        (
            "verify",
            "integrity_fs.verify (file granularity)",
            "integrity_fs",
            {"url": datasets.sealed_dir(bench.root, ds)},
        ),
        (
            "chunk",
            "integrity_fs.verify, chunk granularity (64 MiB)",
            "integrity_fs",
            {"url": datasets.sealed_dir(bench.root, ds, 64 * MiB)},
        ),
        ("fdN", FDN, "file-digest-threads", {"directory": datasets.data_dir(bench.root, ds)}),
    ):
        bench.add("memory", label_of(ds), title, contender, params, ds.total_bytes, key=f"memory:{name}")
    bench.run()


def run_chunks(bench: Bench, cfg: Config) -> None:
    """File vs chunk granularity at 1 and all workers, the chunk-size sweep at all
    workers, the raw threaded range hash, and model_signing's 64 MiB shards."""
    for ds in (cfg.one, cfg.several):
        datasets.warm(datasets.ensure_files(bench.root, ds))

        def m(name: str, title: str, contender: str, params: dict[str, Any], ds: Dataset = ds) -> None:
            bench.add("chunks", label_of(ds), title, contender, params, ds.total_bytes, key=f"{ds.key}:{name}")

        def verify(workers: int, chunk_size: int | None, ds: Dataset = ds) -> None:
            url = datasets.sealed_dir(bench.root, ds, chunk_size)
            what = "file" if chunk_size is None else f"chunk {human_size(chunk_size)}"
            name = "file" if chunk_size is None else f"chunk{chunk_size // MiB}"
            m(
                f"{name}-w{workers}",
                f"integrity_fs.verify, {what}, workers={workers}",
                "integrity_fs",
                {"url": url, "max_workers": workers},
            )

        verify(1, None)
        verify(1, 64 * MiB)
        if CORES > 1:
            verify(CORES, None)
            for size in cfg.chunk_sizes:
                verify(CORES, size)
        data = datasets.data_dir(bench.root, ds)
        if bench.find(f"{ds.key}:fd1") is None:  # the local section measures them when it runs
            file_digests(m, data)
        m("ranges-raw", f"hashlib, {CORES} threads, 64 MiB ranges (raw limit)", "hashlib-ranges", {"directory": data})
        m(
            "ms-shard64",
            "model_signing, shard serialization (64 MiB shards)",
            "model_signing-shard",
            {"directory": data, "shard_size": 64 * MiB},
        )
        bench.run()


def run_s3(bench: Bench, cfg: Config) -> None:
    """verify on a local moto S3 against bare s3fs reads of the same objects, same concurrency."""
    from integrity_fs.work import REMOTE_WORKERS

    with s3.moto_server() as options:
        for ds in cfg.s3_sets:
            log(f"  uploading {label_of(ds)} to moto ...")
            url, paths = s3.upload(options, datasets.sealed_dir(bench.root, ds), ds.name)
            workers = min(REMOTE_WORKERS, ds.count)
            bare = {"paths": paths, "storage_options": options, "workers": workers}

            def m(name: str, title: str, contender: str, params: dict[str, Any], ds: Dataset = ds, **kw: Any) -> None:
                key = f"{ds.key}:{name}"
                bench.add("s3", label_of(ds), title, contender, params, ds.total_bytes, key=key, server=True, **kw)

            m(
                "verify",
                "integrity_fs.verify (file granularity, default workers)",
                "integrity_fs",
                {"url": url, "storage_options": options},
            )
            m(
                "quick",
                "integrity_fs.verify(quick=True)",
                "integrity_fs",
                {"url": url, "storage_options": options, "quick": True},
                reads_content=False,
            )
            m("stream", f"s3fs open/read(1 MiB), s3fs defaults, {workers} at a time", "s3-stream", bare)
            hashed = {**bare, "sha256": True}
            m("stream-sha", f"s3fs open/read(1 MiB) + sha256, {workers} at a time", "s3-stream", hashed)
            m("cat", f"s3fs cat_file, {workers} at a time", "s3-cat", bare)
            bench.run()


def run_blake3(bench: Bench, cfg: Config) -> None:
    """verify of the same files sealed with SHA-256 and with BLAKE3, and b3sum over them."""
    ds = cfg.blake3
    sha256, blake3 = datasets.sealed_dir(bench.root, ds), datasets.sealed_dir(bench.root, ds, algorithm="blake3")
    datasets.warm(datasets.ensure_files(bench.root, ds))

    def m(name: str, title: str, contender: str, params: dict[str, Any]) -> None:
        bench.add("blake3", label_of(ds), title, contender, params, ds.total_bytes, key=f"{ds.key}:{name}")

    m("verify", "integrity_fs.verify, SHA-256", "integrity_fs", {"url": sha256})
    m("verify-blake3", "integrity_fs.verify, BLAKE3", "integrity_fs", {"url": blake3})
    if shutil.which("b3sum"):
        m("b3sum", "b3sum (mmap, all cores)", "b3sum", {"directory": datasets.data_dir(bench.root, ds)})
    else:
        log("blake3: b3sum not found (Debian: apt-get install b3sum); its row is left out")
    bench.run()


def child_args(section: str, cfg: Config) -> list[str]:
    """The arguments of a child section's module for this run."""
    if section == "torchrun":
        ds = cfg.several
        return ["--files", str(ds.count), "--size-mib", str(ds.size // MiB), "--repeats", str(cfg.repeats + 2)]
    if section == "prune":  # 50 checkpoints: what counts is the requests, not the bytes
        return ["--checkpoints", "50", "--files", "4", "--kib", "64" if cfg.name == "quick" else "1024"]
    common = ["--mib", str(cfg.dcp_mib), "--repeats", str(cfg.repeats + 2)]
    if section == "verified":  # the safetensors and blake3 sections measure those
        return [*common, "--no-safetensors", "--no-blake3"]
    return common


def run_child(section: str, bench: Bench, cfg: Config) -> dict[str, Any] | None:
    """``python -m MODULE --json`` of a child section; its JSON, or None when it failed."""
    env = dict(os.environ)
    if bench.import_path:
        env["PYTHONPATH"] = os.pathsep.join([bench.import_path, REPO, env.get("PYTHONPATH", "")])
    os.makedirs(bench.root, exist_ok=True)
    command = [sys.executable, "-m", CHILD_SECTIONS[section], "--json", *child_args(section, cfg)]
    command += ["--dir", bench.root]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        log(f"  {CHILD_SECTIONS[section]} failed (torch missing?): {done.stderr.strip().splitlines()[-1:]}")
        return None
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def full_verify_of(bench: Bench) -> Callable[[Any], Any]:
    """The full verify a row of the attested section compares with: ``<dataset>:full``, or for the
    rows of checkpoints another tool wrote, ``<dataset>:<writer>-full``."""

    def reference(row: Any) -> Any:
        dataset, _, name = row.key.partition(":")
        writer = name.rsplit("-", 1)[0] if name.endswith(("-full", "-attested")) else ""
        return bench.find(f"{dataset}:{writer}-full" if writer else f"{dataset}:full")

    return reference


def report(bench: Bench, cfg: Config, command: str, elapsed_s: float, children: dict[str, Any] | None = None) -> str:
    source = f"integrity_fs from {bench.import_path}" if bench.import_path else "the installed integrity_fs"
    parts = [
        f"# integrity_fs benchmarks ({cfg.name} run)",
        "",
        f"Machine: {machine_line()}.  ",
        f"Command: `{command}` ({source}); the run took {elapsed_s:.0f} s. Manifests parsed with "
        f"{json_parser} ({'the fast extra' if json_parser == 'msgspec' else 'msgspec not installed'}).  ",
        "**Hot cache**: every file was read once, untimed, before timing. Each contender ran in its own child "
        f"process, {cfg.rounds} time(s) round-robin with the other contenders of its dataset: each time one "
        f"warm-up call, then ≥{cfg.repeats} timed calls. Medians over all kept calls; GB/s = 10^9 bytes of the "
        'dataset per second. "cores busy": the contender\'s CPU seconds per wall second. "other procs": the '
        "rest of the machine; calls during which it kept more than 0.25 cores busy were dropped and rerun, and "
        '"timed calls" says how many were kept. "time ÷ integrity_fs": median time over integrity_fs.verify\'s '
        'on the same bytes (above 1: slower than integrity_fs); "time ÷ file_digest": over hashlib.file_digest\'s '
        "on one thread, and on every core one file per task (the baselines a user would write). Peak RSS: "
        "VmHWM of the child (for sha256sum and openssl, of their process).",
        "",
    ]
    fd = file_digest_rows(bench)
    sections = [
        (
            "Local files",
            [r for r in bench.rows if r.section in ("local", "memory")],
            reference_by(bench, "verify"),
            False,
            fd,
        ),
        (
            f"Chunk vs file granularity; ratios to file granularity with workers={CORES}",
            [r for r in bench.rows if r.section == "chunks"],
            reference_by(bench, f"file-w{CORES}"),
            False,
            fd,
        ),
        (
            "S3 (moto's ThreadedMotoServer in the parent process, on 127.0.0.1)",
            [r for r in bench.rows if r.section == "s3"],
            reference_by(bench, "verify"),
            True,
            None,
        ),
        (
            "BLAKE3; ratios to integrity_fs.verify with SHA-256",
            [r for r in bench.rows if r.section == "blake3"],
            reference_by(bench, "verify"),
            False,
            None,
        ),
        (
            "Attested verification on S3 (moto) and GCS (emulator); ratios to the full verify",
            [r for r in bench.rows if r.section == "attested"],
            full_verify_of(bench),
            True,
            None,
        ),
        (
            "Uploads with and without S3 checksums (moto); ratios to s3fs + hashlib",
            [r for r in bench.rows if r.section == "upload"],
            reference_by(bench, "plain"),
            True,
            None,
        ),
        (
            "Signing while sealing; ratios to seal() without a key",
            [r for r in bench.rows if r.section == "signing"],
            reference_by(bench, "plain"),
            False,
            None,
        ),
    ]
    for title, rows, reference, server, baselines in sections:
        if rows:
            parts += [f"## {title}", "", rows_table(rows, reference, server=server, baselines=baselines), ""]
    idle = [r for r in bench.rows if r.section == "baseline"]
    parts += [
        "## Baseline RSS of an idle child",
        "",
        table(["child", "peak RSS MiB"], [[r.label, f"{r.peak_mib:.0f}"] for r in idle]),
        "",
    ]
    lines = local_targets(bench, cfg.several, cfg.one, cfg.memory)
    lines += small_file_lines(bench, cfg.small, cfg.many)
    lines += chunk_size_lines(bench, (cfg.one, cfg.several), cfg.chunk_sizes)
    lines += s3_lines(bench, cfg.s3_sets, bench.find("several:fdN"))
    lines += blake3_lines(bench, cfg.blake3)
    children = children or {}
    dcp = children.get("dcp")
    if dcp is not None:
        dcp_rows = [dcp_bench.Row(**r) for r in dcp["rows"]]
        parts += [
            f"## DCP save: a {dcp['mib']} MiB state dict in {dcp['tensors']} tensors, one process, local page cache",
            "",
            dcp_bench.table(dcp_rows),
            "",
            "Where the time goes:",
            "",
            dcp_costs_table(dcp_rows, dcp["hash_cpu_s"], dcp["copy_cpu_s"], dcp["mib"] * MiB),
            "",
        ]
        lines += dcp_lines(dcp_rows, dcp["hash_cpu_s"], dcp["copy_cpu_s"])
    parts, lines = child_sections(children, parts, lines)
    lines += attested.lines(bench, cfg.name, cfg.several)
    if lines:
        parts += ["## Targets", "", *lines, ""]
    contended = [f"- {r.dataset}: {r.label}" for r in bench.rows if r.result["contended"]]
    if contended:
        parts += [
            "Other processes took cores during most timed calls of these rows; their numbers are pessimistic:",
            "",
            *contended,
            "",
        ]
    return "\n".join(parts)


def child_sections(children: dict[str, Any], parts: list[str], lines: list[str]) -> tuple[list[str], list[str]]:
    """The tables and target lines of the verified-load, safetensors and torchrun sections."""
    loads = children.get("verified")
    if loads is not None:
        rows = [verified.Row(**{**r, "spread_s": tuple(r["spread_s"])}) for r in loads["rows"]]
        shapes = [verified.Shape(**s) for s in loads["shapes"]]
        parts += [
            f"## Verified loads: state dicts of {loads['mib']} MiB, one process",
            "",
            verified.table(rows, shapes),
            "",
        ]
        lines += verified.target_lines(rows, shapes)
    tensors = children.get("safetensors")
    if tensors is not None:
        for result in tensors["results"]:
            parts += [
                f"## safetensors: {safetensors_bench.what(result)}, {tensors['mib']} MiB in {tensors['tensors']} "
                "tensors, hot page cache",
                "",
                safetensors_bench.table(result),
                "",
                safetensors_bench.floor_line(result) + ".",
                "",
            ]
            lines += safetensors_bench.target_lines(result)
    launched = children.get("torchrun")
    if launched is not None:
        rows_tr = [torchrun.Row(**r) for r in launched["rows"]]
        parts += [f"## The command line under torchrun: verify of {launched['shape']}", "", torchrun.table(rows_tr), ""]
        lines += torchrun.target_lines(rows_tr)
    pruned = children.get("prune")
    if pruned is not None:
        rows_p = [prune_bench.Row(**r) for r in pruned["rows"]]
        shape_p = f"{rows_p[0].checkpoints} checkpoints of {pruned['files']} x {pruned['kib']} KiB"
        parts += [
            f"## Retention on S3 (moto): prune over {shape_p}, every request counted at the server",
            "",
            prune_bench.table(rows_p),
            "",
        ]
        lines += prune_bench.target_lines(rows_p)
    return parts, lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Benchmarks of integrity_fs.")
    parser.add_argument("--quick", action="store_true", help="small datasets, about a minute")
    parser.add_argument("--write", action="store_true", help="also write the report to benchmarks/results.md")
    parser.add_argument("--dir", default=datasets.DEFAULT_ROOT, help="where datasets are cached (default: %(default)s)")
    parser.add_argument("--clean", action="store_true", help="delete the cached datasets and exit")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=3.0,
        help="seconds to wait before each contender for other processes to go idle (default: 3)",
    )
    parser.add_argument(
        "--integrity-fs",
        metavar="DIR",
        help="benchmark the integrity_fs package in DIR (e.g. a copy with a proposed change)",
    )
    args = parser.parse_args(argv)
    if args.clean:
        datasets.clean(args.dir)
        return

    cfg = QUICK if args.quick else FULL
    import_path = os.path.abspath(args.integrity_fs) if args.integrity_fs else None
    bench = Bench(os.path.abspath(args.dir), cfg.repeats, cfg.rounds, args.max_wait, import_path)
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    run_baselines(bench)
    runners: dict[str, Callable[[Bench, Config], None]] = {
        "local": run_local,
        "memory": run_memory,
        "chunks": run_chunks,
        "s3": run_s3,
        "blake3": run_blake3,
        "attested": lambda bench, cfg: attested.run_attested(bench, cfg.name),
        "recorded": lambda bench, cfg: attested.run_recorded(bench, cfg.name),
        "upload": lambda bench, cfg: attested.run_upload(bench, cfg.name),
        "signing": lambda bench, cfg: attested.run_signing(bench, cfg.several),
    }
    children: dict[str, Any] = {}
    for section in SECTIONS:
        if section in (args.only or SECTIONS):
            log(f"{section}:")
            if section in CHILD_SECTIONS:
                children[section] = run_child(section, bench, cfg)
            else:
                runners[section](bench, cfg)
    text = report(bench, cfg, command, time.perf_counter() - started, children)
    print(text)
    if args.write:
        with open(RESULTS, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        log(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
