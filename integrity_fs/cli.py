"""The ``integrity-fs`` command: seal, verify, show, download and upload checkpoints from a shell.

Every command maps failures to one exit code, so scripts can branch on them:
0 ok, 1 integrity failure, 2 usage error, 3 manifest missing or invalid, 4 storage or I/O error.
Errors are short lines on stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import fsspec
from fsspec.callbacks import Callback

from . import __version__, storage
from .core import (
    Problem,
    Report,
    VerificationPlan,
    build_manifest,
    check_seal_options,
    default_workers,
    finish_verification,
    load_manifest,
    plan_verification,
    progress_fn,
    read_manifest,
    run_parallel,
    seal,
    verify,
    write_manifest,
)
from .errors import IntegrityError, ManifestError, ManifestNotFoundError
from .hashing import DEFAULT_ALGORITHM, GRANULARITIES, StreamDigest, Unit, plan_units
from .manifest import MANIFEST_FILENAME, Manifest

PROG = "integrity-fs"

EXIT_OK = 0
EXIT_INTEGRITY = 1
EXIT_USAGE = 2
EXIT_MANIFEST = 3
EXIT_STORAGE = 4

#: Read size when copying: large enough to amortise calls, small enough to bound memory per thread.
COPY_BLOCK_SIZE = 1024 * 1024
#: How many of the largest files ``show`` lists.
LARGEST_SHOWN = 5

ProgressFn = Callable[[int], None]


class UsageError(Exception):
    """The command line asks for something impossible; exit code 2. ``hint`` is the second stderr line."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


# --------------------------------------------------------------------------- storage options


def parse_option(text: str) -> tuple[tuple[str, ...], Any]:
    """One ``-o key=value``: the dotted key split into parts, and the value parsed as JSON if it parses.

    ``anon=true`` gives ``(("anon",), True)``; ``x=abc`` keeps the string ``"abc"``.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no '=': write -o key=value, e.g. -o anon=true")
    parts = tuple(part.strip() for part in key.split("."))
    if not key or not all(parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} has an empty key or key part: write -o key=value or -o outer.inner=value"
        )
    try:
        value: Any = json.loads(raw)
    except (ValueError, RecursionError):
        value = raw
    return parts, value


def build_storage_options(pairs: Iterable[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """Nested fsspec storage options from parsed ``-o`` pairs (dotted keys make nested dicts)."""
    options: dict[str, Any] = {}
    for parts, value in pairs:
        node = options
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"-o {'.'.join(parts[: depth + 1])} is set to a value and also used as a group")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise UsageError(f"-o {'.'.join(parts)} is a group of options and cannot also be set to a value")
        node[parts[-1]] = value
    return options


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


_SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def byte_size(text: str) -> int:
    """argparse type: a positive byte count, ``67108864`` or with a binary suffix (``64M``, ``64MiB``)."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number, suffix = (cleaned[:-1], cleaned[-1]) if cleaned and cleaned[-1] in "KMGT" else (cleaned, "")
    try:
        value = int(number) * _SIZE_SUFFIXES[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 67108864, 64M or 64MiB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return value


# --------------------------------------------------------------------------- output


def format_bytes(n: int) -> str:
    """``12.6 MB``: decimal units, as storage consoles show them."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_rate(nbytes: int, seconds: float) -> str:
    """Throughput in MB/s, or GB/s once it passes 1 GB/s."""
    rate = nbytes / max(seconds, 1e-6)
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.1f} MB/s"


def format_work(files: int, nbytes: int, seconds: float) -> str:
    """``3 files, 12.6 MB in 0.05 s (250.1 MB/s)``."""
    noun = "file" if files == 1 else "files"
    return f"{files} {noun}, {format_bytes(nbytes)} in {seconds:.2f} s ({format_rate(nbytes, seconds)})"


def name_problems(problems: Sequence[Problem], limit: int = 5) -> str:
    """``a.bin (mismatch), b.bin (missing) and 3 more``: short enough for one error line."""
    named = ", ".join(f"{p.path} ({p.kind})" for p in problems[:limit])
    return named + (f" and {len(problems) - limit} more" if len(problems) > limit else "")


def print_problems(problems: Sequence[Problem], file: IO[str]) -> None:
    """Each problem on its own line: path, kind, expected and actual digest or size, byte ranges."""
    for problem in problems:
        print(f"  {problem}", file=file)


def print_extra_note(extra: Sequence[str], action: str, file: IO[str]) -> None:
    """Say which files the manifest does not cover, so nobody assumes they were checked."""
    if not extra:
        return
    more = len(extra) - LARGEST_SHOWN
    shown = ", ".join(extra[:LARGEST_SHOWN]) + (f" and {more} more" if more > 0 else "")
    noun = "file is" if len(extra) == 1 else "files are"
    print(f"note: {len(extra)} {noun} not in the manifest and {action}: {shown}", file=file)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --------------------------------------------------------------------------- progress


@contextlib.contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[Callback | None]:
    """A tqdm bar on stderr (bytes done, rate, ETA), or ``None`` when disabled or tqdm is missing."""
    if not enabled:
        yield None
        return
    try:
        from fsspec.callbacks import TqdmCallback

        callback = TqdmCallback(
            tqdm_kwargs={
                "desc": desc,
                "unit": "B",
                "unit_scale": True,
                "file": sys.stderr,
                "dynamic_ncols": True,
                "leave": False,
            }
        )
    except ImportError:
        yield None
        return
    try:
        yield callback
    finally:
        callback.close()


def wants_progress(args: argparse.Namespace) -> bool:
    """Bars only for a person watching: stderr is a terminal and ``--no-progress`` was not given."""
    return not args.no_progress and sys.stderr.isatty()


# --------------------------------------------------------------------------- streaming copy


@dataclass(frozen=True)
class Copied:
    """What went through one stream: its byte count and one digest per unit (chunk, or whole file)."""

    size: int
    unit_digests: tuple[str, ...]


def copy_and_hash(
    src: IO[bytes],
    dst: IO[bytes],
    *,
    algorithm: str,
    chunk_size: int | None,
    progress: ProgressFn | None = None,
) -> Copied:
    """Copy ``src`` to ``dst`` in 1 MiB blocks, hashing the same bytes as they pass.

    With ``chunk_size`` the hash restarts at every chunk boundary, giving the chunk digests of a
    chunk manifest; without it there is one digest for the whole stream. Each byte is read once.
    """
    digest = StreamDigest(algorithm, chunk_size)
    while block := src.read(COPY_BLOCK_SIZE):
        dst.write(block)
        digest.update(block)
        if progress is not None:
            progress(len(block))
    return Copied(digest.size, digest.digests())


def unit_digests(granularity: str, chunk_size: int | None, copied: dict[str, Copied]) -> dict[Unit, str | None]:
    """The digest of every hashing unit (as ``core`` plans them) of the copied files."""
    sizes = {name: c.size for name, c in sorted(copied.items())}
    return {u: copied[u.name].unit_digests[u.index] for u in plan_units(granularity, sizes, chunk_size)}


# --------------------------------------------------------------------------- download


@dataclass(frozen=True)
class TransferResult:
    """A finished download or upload."""

    manifest: Manifest
    files: int
    nbytes: int
    seconds: float
    extra: tuple[str, ...] = ()


def local_path(text: str, what: str) -> str:
    """``text`` as an absolute local path; a remote URL here is a usage error."""
    if "://" in text:
        if not text.startswith("file://"):
            raise UsageError(f"{what} must be a local path, not {text!r}")
        text = text[len("file://") :]
    return os.path.abspath(os.path.expanduser(text))


def download(
    url: str,
    dest: str,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    callback: Callback | None = None,
) -> TransferResult:
    """Copy the sealed checkpoint at ``url`` into the new local directory ``dest``, verifying as it streams.

    Every file is read once, hashed on the way and written into a staging directory beside
    ``dest``; the manifest is written last and the staging directory is renamed to ``dest`` only
    when every file matched. On any failure the staging directory is deleted, so ``dest`` gets
    either the whole verified checkpoint or nothing. Remote files absent from the manifest are
    not downloaded.
    """
    dest = local_path(dest, "DEST")
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
        raise UsageError(f"DEST {dest} already exists and is not an empty directory; choose a new directory")
    started = time.perf_counter()
    fs, root = storage.resolve(url, storage_options)
    manifest = load_manifest(fs, root)
    location = storage.describe(fs, root)
    plan = plan_verification(manifest, storage.list_files(fs, root))
    if plan.problems:  # missing or resized files: fail before transferring anything
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), location)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(dest)}.integrity-fs-partial-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)  # not mkdtemp: DEST should get the usual permissions once renamed
    try:
        chunk_size = manifest.chunk_size if manifest.granularity == "chunk" else None
        progress = progress_fn(callback, sum(plan.sizes.values()))

        def fetch(name: str) -> Copied:
            target = os.path.join(staging, *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with (
                storage.storage_errors(f"downloading {storage.join(location, name)}"),
                storage.open_read(fs, storage.join(root, name)) as src,
                open(target, "wb") as dst,
            ):
                return copy_and_hash(src, dst, algorithm=manifest.algorithm, chunk_size=chunk_size, progress=progress)

        copied = run_parallel(fetch, list(plan.sizes), workers or default_workers(fs))
        report = check_download(manifest, plan, copied)
        if not report.ok:
            raise IntegrityError(report, location)
        with open(os.path.join(staging, MANIFEST_FILENAME), "wb") as f:
            f.write(manifest.to_json())
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty, checked above
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    return TransferResult(manifest, report.files_checked, report.bytes_checked, elapsed, plan.extra)


def check_download(manifest: Manifest, plan: VerificationPlan, copied: dict[str, Copied]) -> Report:
    """Compare what was streamed with the manifest, as ``verify`` would (sizes, digests, byte ranges)."""
    resized = [
        Problem(name, "size", expected=expected, actual=copied[name].size)
        for name, expected in plan.sizes.items()
        if copied[name].size != expected
    ]
    whole = {name: c for name, c in copied.items() if name not in {p.path for p in resized}}
    chunk_size = manifest.chunk_size if manifest.granularity == "chunk" else None
    digests = unit_digests(manifest.granularity, chunk_size, whole)
    streamed = dataclasses.replace(
        plan,
        problems=tuple(plan.problems) + tuple(resized),
        sizes={name: c.size for name, c in whole.items()},
        units=tuple(digests),
    )
    return finish_verification(manifest, streamed, digests)


# --------------------------------------------------------------------------- upload


def upload(
    src: str,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    granularity: str = "file",
    chunk_size: int | None = None,
    workers: int | None = None,
    callback: Callback | None = None,
) -> TransferResult:
    """Copy the local directory ``src`` to ``url`` and seal it there, reading each file once.

    Each file is hashed while it streams to the remote; the manifest, built from exactly the
    bytes sent, is written last, so a reader who finds it knows the upload finished. A
    destination that already holds a manifest is refused rather than overwritten in place.
    """
    src = local_path(src, "SRC")
    chunk_size = check_seal_options(DEFAULT_ALGORITHM, granularity, chunk_size)
    started = time.perf_counter()
    fs, root = storage.resolve(url, storage_options)
    location = storage.describe(fs, root)
    if storage.is_local(fs) and _overlaps(src, root):
        raise UsageError(f"SRC {src} and URL {location} overlap; upload to a location outside SRC")
    sizes = storage.list_files(fsspec.filesystem("file"), src)
    with storage.storage_errors(f"checking {location}"):
        sealed = fs.exists(storage.join(root, MANIFEST_FILENAME))
    if sealed:
        raise UsageError(f"{location} already holds a sealed checkpoint; upload to a new URL or delete it first")
    progress = progress_fn(callback, sum(sizes.values()))

    def send(name: str) -> Copied:
        path = storage.join(root, name)
        if storage.is_local(fs):
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with (
            open(os.path.join(src, *name.split("/")), "rb") as source,
            storage.storage_errors(f"uploading {storage.join(location, name)}"),
            fs.open(path, "wb") as dst,
        ):
            return copy_and_hash(source, dst, algorithm=DEFAULT_ALGORITHM, chunk_size=chunk_size, progress=progress)

    copied = run_parallel(send, list(sizes), workers or default_workers(fs))
    digests = unit_digests(granularity, chunk_size, copied)
    actual_sizes = {name: c.size for name, c in sorted(copied.items())}
    manifest = build_manifest(DEFAULT_ALGORITHM, granularity, chunk_size, actual_sizes, digests)
    if storage.is_local(fs):
        fs.makedirs(root, exist_ok=True)
    write_manifest(fs, root, manifest)
    return TransferResult(manifest, len(copied), sum(actual_sizes.values()), time.perf_counter() - started)


def _overlaps(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([a, b]) in (a, b)


# --------------------------------------------------------------------------- commands


def storage_options_of(args: argparse.Namespace) -> dict[str, Any]:
    return build_storage_options([*args.global_options, *args.command_options])


def cmd_seal(args: argparse.Namespace) -> int:
    granularity = args.granularity or ("chunk" if args.chunk_size else "file")
    started = time.perf_counter()
    try:
        with progress_bar(wants_progress(args), "seal") as callback:
            manifest = seal(
                args.url,
                granularity=granularity,
                chunk_size=args.chunk_size,
                storage_options=storage_options_of(args),
                max_workers=args.workers,
                callback=callback,
                overwrite=args.force,
            )
    except FileExistsError as exc:  # already sealed: a refusal, not a storage failure
        raise UsageError(str(exc), "pass --force to replace the manifest (only for content you trust)") from exc
    elapsed = time.perf_counter() - started
    total = manifest.total_bytes or 0
    print(f"sealed {args.url}: {format_work(len(manifest.files), total, elapsed)}")
    print(f"wrote {MANIFEST_FILENAME} ({manifest.algorithm}, {granularity} granularity)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        with progress_bar(wants_progress(args), "verify") as callback:
            report = verify(
                args.url,
                storage_options=storage_options_of(args),
                max_workers=args.workers,
                callback=callback,
                strict=args.strict,
                quick=args.quick,
            )
    except IntegrityError as err:
        print_verify_report(args, err.report, time.perf_counter() - started)
        raise
    print_verify_report(args, report, time.perf_counter() - started)
    return EXIT_OK


def print_verify_report(args: argparse.Namespace, report: Report, elapsed: float) -> None:
    """The outcome of ``verify`` on stdout: JSON with ``--json``, else a summary and one line per problem."""
    if args.json:
        print_json({"url": args.url, **report.to_dict(), "elapsed_s": round(elapsed, 3), "quick": args.quick})
        return
    how = "names and sizes only (--quick), no content read" if args.quick else ""
    if report.ok:
        work = (
            f"{report.files_checked} files"
            if args.quick
            else format_work(report.files_checked, report.bytes_checked, elapsed)
        )
        print(f"verified {args.url}: {work}" + (f"; {how}" if how else ""))
    else:
        noun = "problem" if len(report.problems) == 1 else "problems"
        print(f"FAILED {args.url}: {len(report.problems)} {noun}" + (f" ({how})" if how else ""), flush=True)
        print_problems(report.problems, sys.stdout)
    if not args.strict:
        print_extra_note(report.extra, "were not checked (--strict rejects them)", sys.stdout)


def cmd_show(args: argparse.Namespace) -> int:
    manifest = read_manifest(args.url, storage_options=storage_options_of(args))
    sizes = dict(manifest.sizes) if manifest.sizes is not None else None
    largest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_SHOWN] if sizes else []
    if args.json:
        print_json(
            {
                "url": args.url,
                "version": manifest.version,
                "algorithm": manifest.algorithm,
                "granularity": manifest.granularity,
                "chunk_size": manifest.chunk_size,
                "file_count": len(manifest.files),
                "total_bytes": manifest.total_bytes,
                "largest": [{"path": name, "size": size} for name, size in largest],
                "files": {
                    name: {"digest": digest, "size": None if sizes is None else sizes[name]}
                    for name, digest in manifest.files.items()
                },
            }
        )
        return EXIT_OK
    granularity = manifest.granularity
    if manifest.chunk_size is not None:
        granularity += f" (chunks of {format_bytes(manifest.chunk_size)}, {manifest.chunk_size} bytes)"
    total = manifest.total_bytes
    print(f"manifest of {args.url}")
    print(f"  version      {manifest.version}")
    print(f"  algorithm    {manifest.algorithm}")
    print(f"  granularity  {granularity}")
    print(f"  files        {len(manifest.files)}")
    total_text = (
        "unknown (this manifest records no sizes)" if total is None else f"{format_bytes(total)} ({total} bytes)"
    )
    print(f"  total size   {total_text}")
    if largest:
        print("largest files:")
        for name, size in largest:
            print(f"  {format_bytes(size):>10}  {name}")
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    try:
        with progress_bar(wants_progress(args), "download") as callback:
            result = download(
                args.url, args.dest, storage_options=storage_options_of(args), workers=args.workers, callback=callback
            )
    except IntegrityError as err:
        noun = "problem" if len(err.report.problems) == 1 else "problems"
        print(f"FAILED {args.url}: {len(err.report.problems)} {noun}; nothing was written to {args.dest}", flush=True)
        print_problems(err.report.problems, sys.stdout)
        raise
    work = format_work(result.files, result.nbytes, result.seconds)
    print(f"downloaded and verified {args.url} -> {args.dest}: {work}")
    print_extra_note(result.extra, "were not downloaded", sys.stdout)
    return EXIT_OK


def cmd_upload(args: argparse.Namespace) -> int:
    granularity = args.granularity or ("chunk" if args.chunk_size else "file")
    with progress_bar(wants_progress(args), "upload") as callback:
        result = upload(
            args.src,
            args.url,
            storage_options=storage_options_of(args),
            granularity=granularity,
            chunk_size=args.chunk_size,
            workers=args.workers,
            callback=callback,
        )
    print(f"uploaded and sealed {args.src} -> {args.url}: {format_work(result.files, result.nbytes, result.seconds)}")
    print(f"wrote {MANIFEST_FILENAME} last ({result.manifest.algorithm}, {granularity} granularity)")
    return EXIT_OK


# --------------------------------------------------------------------------- demo

DEMO_URL = "s3://demo-bucket/run/step_1000"
DEMO_CHUNK_SIZE = 1024 * 1024


def cmd_demo(args: argparse.Namespace) -> int:
    """An end-to-end run against an S3 server inside this process: seal, verify, corrupt, reject, download."""
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise UsageError(
            f"the demo needs moto and s3fs ({exc.name} is missing): pip install 'integrity-fs[demo]'"
        ) from exc
    # The server accepts any credentials; these keep real ones out of the demo.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    port = _free_port()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with tempfile.TemporaryDirectory(prefix="integrity-fs-demo-") as workdir:
            return _run_demo(args, f"http://127.0.0.1:{port}", workdir)
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_demo(args: argparse.Namespace, endpoint: str, workdir: str) -> int:
    options: dict[str, Any] = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("demo-bucket")
    step = 0

    def say(text: str) -> None:
        nonlocal step
        step += 1
        print(f"{step}. {text}", flush=True)

    say(f"Started a private S3 server (moto) at {endpoint}; nothing leaves this machine.")
    src = os.path.join(workdir, "step_1000")
    what = _write_demo_checkpoint(src)
    say(f"Wrote a small checkpoint to {src}: {what}.")

    with progress_bar(wants_progress(args), "upload") as callback:
        up = upload(
            src,
            DEMO_URL,
            storage_options=options,
            granularity="chunk",
            chunk_size=DEMO_CHUNK_SIZE,
            workers=args.workers,
            callback=callback,
        )
    say(
        f"Uploaded it to {DEMO_URL}, hashing each 1 MiB chunk as it streamed, and wrote the manifest last "
        f"({format_work(up.files, up.nbytes, up.seconds)})."
    )

    started = time.perf_counter()
    report = verify(DEMO_URL, storage_options=options, max_workers=args.workers)
    say(
        f"Verified {DEMO_URL}: every byte matches the manifest "
        f"({format_work(report.files_checked, report.bytes_checked, time.perf_counter() - started)})."
    )

    victim, offset = _largest_file(up.manifest), DEMO_CHUNK_SIZE + 12345
    path = f"demo-bucket/run/step_1000/{victim}"
    original = bytes(fs.cat_file(path))
    offset %= len(original)
    flipped = bytearray(original)
    flipped[offset] ^= 0x01
    fs.pipe_file(path, bytes(flipped))
    say(
        f"Flipped one bit of byte {offset} of {victim} in the bucket, the kind of silent corruption "
        "a bad disk, a buggy copy or a flaky network leaves behind."
    )

    try:
        verify(DEMO_URL, storage_options=options, max_workers=args.workers)
    except IntegrityError as err:
        say(f"Verification now rejects the checkpoint and names the file ({len(err.report.problems)} problem):")
        print_problems(err.report.problems, sys.stdout)
        caught = any(p.path == victim for p in err.report.problems)
    else:
        caught = False
        say("Verification did NOT catch the flipped bit. This is a bug; please report it.")
    if not caught:
        return EXIT_INTEGRITY

    dest = os.path.join(workdir, "downloaded", "step_1000")
    try:
        download(DEMO_URL, dest, storage_options=options, workers=args.workers)
    except IntegrityError:
        refused = True
    else:
        refused = False
    if not refused or os.path.exists(dest):
        say(f"The download of the corrupt checkpoint was NOT refused cleanly ({dest}); please report this bug.")
        return EXIT_INTEGRITY
    say(f"A download of the corrupt checkpoint is refused as well: {dest} was not created.")

    fs.pipe_file(path, original)
    with progress_bar(wants_progress(args), "download") as callback:
        down = download(DEMO_URL, dest, storage_options=options, workers=args.workers, callback=callback)
    say(
        f"Restored the byte and downloaded the checkpoint to {dest}, verifying each file in the same read "
        f"({format_work(down.files, down.nbytes, down.seconds)})."
    )
    local = verify(dest)
    say(f"The local copy verifies on its own too: `{PROG} verify {dest}` checks {local.files_checked} files.")
    print("Demo complete: the corruption was caught before anything could load it.")
    return EXIT_OK


def _write_demo_checkpoint(directory: str) -> str:
    """A torch state dict in two files if torch is installed, else random shards; says which."""
    os.makedirs(directory)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"step": 1000, "note": "integrity-fs demo"}, f)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        for i in range(2):
            with open(os.path.join(directory, f"shard_{i:02d}.bin"), "wb") as f:
                f.write(os.urandom(3 * 1024 * 1024))
        return "two random 3 MiB shards and metadata.json (install torch for a real state dict)"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 512)).square().mean().backward()
    optimizer.step()
    torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
    return "a torch model state dict (model.pt), its Adam optimizer state (optimizer.pt) and metadata.json"


def _largest_file(manifest: Manifest) -> str:
    sizes = manifest.sizes or {}
    return max(sorted(manifest.files), key=lambda name: sizes.get(name, 0))


# --------------------------------------------------------------------------- errors and exit codes


def exit_code_for(error: BaseException) -> int:
    """The documented exit code for an exception (order matters: the manifest errors are also
    ``FileNotFoundError`` and ``ValueError``)."""
    if isinstance(error, IntegrityError):
        return EXIT_INTEGRITY
    if isinstance(error, (ManifestNotFoundError, ManifestError, NotImplementedError)):
        return EXIT_MANIFEST
    if isinstance(error, (UsageError, ValueError, TypeError, ImportError)):
        return EXIT_USAGE
    return EXIT_STORAGE


def describe_error(error: BaseException) -> tuple[str, str]:
    """What failed (naming the file or URL) and what to do about it, for the two stderr lines."""
    if isinstance(error, IntegrityError):
        where = error.location or "the checkpoint"
        return (
            f"{where} failed verification: {name_problems(error.report.problems)}",
            "do not load it; restore the named files from a good copy (re-seal only content you trust)",
        )
    if isinstance(error, ManifestNotFoundError):
        return str(error), f"seal it first with `{PROG} seal URL`, once you trust its content"
    if isinstance(error, ManifestError):
        return str(error), "the manifest is damaged or not an integrity-fs manifest; restore it, or re-seal a good copy"
    if isinstance(error, NotImplementedError):
        return str(error), "this manifest needs a newer integrity-fs: pip install -U integrity-fs"
    if isinstance(error, UsageError):
        return str(error), error.hint
    if isinstance(error, (ValueError, TypeError, ImportError)):
        return str(error), f"check the arguments and -o storage options; see `{PROG} COMMAND --help`"
    if isinstance(error, OSError):
        return (
            str(error) or type(error).__name__,
            "check the URL, your credentials and the -o storage options (e.g. -o client_kwargs.endpoint_url=...); "
            "--debug shows the full error",
        )
    return f"unexpected {type(error).__name__}: {error}", "run again with --debug and report the traceback"


def report_error(args: argparse.Namespace, error: BaseException, code: int) -> None:
    """Two lines on stderr (plus the traceback with ``--debug``); with ``--json``, an error object on stdout."""
    if args.debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if getattr(args, "json", False) and not isinstance(error, IntegrityError):
        print_json({"url": getattr(args, "url", None), "ok": False, "exit_code": code, "error": str(error)})
    what, hint = describe_error(error)
    print(f"{PROG}: error: {what}", file=sys.stderr)
    if hint:
        print(f"{PROG}: hint: {hint}", file=sys.stderr)


# --------------------------------------------------------------------------- argument parsing

MAIN_EPILOG = f"""\
examples:
  {PROG} seal ./checkpoints/step_1000
  {PROG} verify s3://bucket/run/step_1000
  {PROG} verify s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000
  {PROG} download gs://bucket/run/step_1000 ./step_1000
  {PROG} demo

exit codes:
  0  verified / ok
  1  integrity failure: content differs from the manifest
  2  usage error: bad arguments or -o options
  3  manifest missing or invalid (or an unsupported algorithm or granularity)
  4  storage or I/O error: network, credentials, permission, timeout
"""

EPILOGS = {
    "seal": f"""\
Hashes every file under URL and writes {MANIFEST_FILENAME} beside them, last.
A checkpoint that is already sealed is refused (exit 2) unless --force: sealing
again would accept whatever the files hold now, damage included.

examples:
  {PROG} seal ./checkpoints/step_1000
  {PROG} seal s3://bucket/run/step_1000 --granularity chunk --chunk-size 64MiB
""",
    "verify": f"""\
Rehashes every file listed in the manifest and exits 1 if any byte differs.

examples:
  {PROG} verify s3://bucket/run/step_1000
  {PROG} verify s3://bucket/run/step_1000 --quick        # names and sizes only
  {PROG} verify ./step_1000 --strict --json              # extra files fail too; JSON report
""",
    "show": f"""\
Prints what the manifest records, without reading the checkpoint's files.

examples:
  {PROG} show s3://bucket/run/step_1000
  {PROG} show ./step_1000 --json
""",
    "download": f"""\
Streams each file once, hashing it on the way, into a staging directory beside DEST that
becomes DEST only when every file matches: DEST gets the verified checkpoint or nothing.
Files not in the manifest are not downloaded. -o options apply to URL.

example:
  {PROG} download s3://bucket/run/step_1000 ./step_1000
""",
    "upload": f"""\
Streams each local file once to URL, hashing it on the way, and writes the manifest last,
so a reader who sees the manifest knows the upload finished. -o options apply to URL.

example:
  {PROG} upload ./step_1000 s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000
""",
    "demo": f"""\
Starts a local S3 server (moto) in this process, uploads and seals a small checkpoint,
flips one byte in the bucket and shows verification reject it, then a verified download.
Needs no cloud account: pip install 'integrity-fs[demo]'.

example:
  {PROG} demo
""",
}


def add_common_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """Options accepted before or after the command; after it they override (``-o`` adds up)."""

    def default(value: Any) -> Any:
        return value if top_level else argparse.SUPPRESS

    group = parser.add_argument_group("common options")
    group.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        default=default(None),
        help="files (or chunks) transferred or hashed at once (default: CPUs locally, 16 remote)",
    )
    group.add_argument(
        "--no-progress",
        action="store_true",
        default=default(False),
        help="no progress bar (there is none anyway when stderr is not a terminal)",
    )
    group.add_argument(
        "--debug", action="store_true", default=default(False), help="debug logging, and a traceback with any error"
    )
    group.add_argument(
        "-o",
        "--option",
        type=parse_option,
        action="append",
        metavar="KEY=VALUE",
        dest="global_options" if top_level else "command_options",
        default=[],
        help="fsspec storage option, repeatable; dotted keys nest, values are JSON if they parse "
        "(-o anon=true -o client_kwargs.endpoint_url=http://127.0.0.1:9000)",
    )


def add_granularity_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        default=None,
        help="hash whole files, or fixed-size chunks (default: file; chunk if --chunk-size is given)",
    )
    parser.add_argument(
        "--chunk-size",
        type=byte_size,
        metavar="SIZE",
        default=None,
        help="chunk length for --granularity chunk, e.g. 64MiB (default 64MiB)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Seal ML checkpoints with SHA-256 manifests and verify them, on local disks, S3, GCS "
        "and any fsspec filesystem.",
        epilog=MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_common_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, run: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EPILOGS[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=run)
        add_common_options(sub, top_level=False)
        return sub

    sub = command("seal", cmd_seal, "hash a checkpoint directory and write its manifest")
    sub.add_argument("url", metavar="URL", help="checkpoint directory: local path or fsspec URL")
    sub.add_argument("--force", action="store_true", help="replace an existing manifest (only for content you trust)")
    add_granularity_options(sub)

    sub = command("verify", cmd_verify, "check a checkpoint against its manifest")
    sub.add_argument("url", metavar="URL", help="checkpoint directory: local path or fsspec URL")
    sub.add_argument("--quick", action="store_true", help="compare names and sizes only; read no content")
    sub.add_argument("--strict", action="store_true", help="files not in the manifest are problems too")
    sub.add_argument("--json", action="store_true", help="print the report as JSON on stdout")

    sub = command("show", cmd_show, "summarise a checkpoint's manifest")
    sub.add_argument("url", metavar="URL", help="checkpoint directory: local path or fsspec URL")
    sub.add_argument("--json", action="store_true", help="print the summary (and every file) as JSON")

    sub = command("download", cmd_download, "copy a sealed checkpoint to a local directory, verifying it")
    sub.add_argument("url", metavar="URL", help="sealed checkpoint: fsspec URL or local path")
    sub.add_argument("dest", metavar="DEST", help="new local directory (must not exist, or be empty)")

    sub = command("upload", cmd_upload, "copy a local checkpoint to a URL and seal it there")
    sub.add_argument("src", metavar="SRC", help="local checkpoint directory")
    sub.add_argument("url", metavar="URL", help="destination: fsspec URL or local path")
    add_granularity_options(sub)

    command("demo", cmd_demo, "end-to-end run on a local S3 server: seal, corrupt, reject, download")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def configure_logging(*, debug: bool) -> None:
    """integrity_fs's own warnings (a skipped symlink, a retried read) on stderr; all of them with ``--debug``."""
    logger = logging.getLogger("integrity_fs")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    args = parse_args(argv)
    configure_logging(debug=args.debug)
    try:
        code: int = args.run(args)
        return code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_STORAGE
    except Exception as error:
        code = exit_code_for(error)
        report_error(args, error, code)
        return code
