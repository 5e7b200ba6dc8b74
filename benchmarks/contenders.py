"""The contenders: each a factory that does its setup (imports, listing) untimed and returns the
zero-argument callable that ``runner`` times.

Imports of third-party packages happen inside the factories, so that a child's RSS before the
work shows what its imports cost, and the idle baseline is the bare interpreter.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

Run = Callable[[], object]
MiB = 1024 * 1024


@dataclass(frozen=True)
class Contender:
    """``factory(**params)`` returns the timed callable; ``external``: the work runs in a
    subprocess, so its peak RSS is that of the children."""

    factory: Callable[..., Run]
    external: bool = False


CONTENDERS: dict[str, Contender] = {}


def contender(name: str, *, external: bool = False) -> Callable[[Callable[..., Run]], Callable[..., Run]]:
    def register(factory: Callable[..., Run]) -> Callable[..., Run]:
        CONTENDERS[name] = Contender(factory, external)
        return factory

    return register


def vm_hwm_kib(pid: int) -> int:
    """Peak resident set of process ``pid`` since its ``exec`` (``VmHWM``), in KiB; 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def list_data(directory: str) -> list[str]:
    """Every regular file directly in ``directory``, sorted, dot files left out."""
    return sorted(e.path for e in os.scandir(directory) if e.is_file() and not e.name.startswith("."))


def _sha256_range(path: str, offset: int, length: int, block_size: int) -> str:
    """SHA-256 of ``length`` bytes of ``path`` from ``offset``, read with ``readinto``."""
    hasher = hashlib.sha256()
    buf = memoryview(bytearray(block_size))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        remaining = length
        while remaining:
            n = f.readinto(buf[: min(remaining, block_size)])
            if not n:
                break
            hasher.update(buf[:n])
            remaining -= n
    return hasher.hexdigest()


@contender("idle")
def idle(modules: tuple[str, ...] = ()) -> Run:
    """An idle Python child (after importing ``modules``): the interpreter's own RSS."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    return lambda: None


@contender("integrity_fs")
def integrity_fs_verify(
    url: str,
    *,
    max_workers: int | None = None,
    quick: bool = False,
    storage_options: dict[str, Any] | None = None,
    storage_overrides: dict[str, int] | None = None,
) -> Run:
    """``integrity_fs.verify(url)``: list, compare with the manifest, rehash with its granularity.

    ``storage_overrides`` patches ``integrity_fs.storage.read`` constants (``BLOCK_SIZE``,
    ``REMOTE_BLOCK_SIZE``) for read-size experiments.
    """
    import integrity_fs
    from integrity_fs.storage import read

    for name, value in (storage_overrides or {}).items():
        if not hasattr(read, name):
            raise AttributeError(f"integrity_fs.storage.read has no {name}")
        setattr(read, name, value)

    def run() -> object:
        return integrity_fs.verify(url, max_workers=max_workers, quick=quick, storage_options=storage_options)

    return run


@contender("integrity_fs-seal")
def integrity_fs_seal(url: str, *, max_workers: int | None = None) -> Run:
    """``integrity_fs.seal(url, overwrite=True)``: list, hash, write the manifest (the same one each call)."""
    import integrity_fs

    def run() -> object:
        return integrity_fs.seal(url, overwrite=True, max_workers=max_workers)

    return run


@contender("walk-stat")
def walk_stat(directory: str) -> Run:
    """A bare ``os.walk`` + ``os.stat`` of every file: what a listing costs, the floor of ``quick=True``."""

    def run() -> object:
        sizes = {}
        for dirpath, _dirs, names in os.walk(directory):
            for name in names:
                path = os.path.join(dirpath, name)
                sizes[path] = os.stat(path).st_size
        return sizes

    return run


@contender("file-digest")
def file_digest(directory: str) -> Run:
    """One thread, ``hashlib.file_digest(f, "sha256")`` of each ``open(path, "rb")``: the two
    lines a user would write, and the baseline of every local row."""
    paths = list_data(directory)

    def one(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    return lambda: [one(p) for p in paths]


@contender("file-digest-threads")
def file_digest_threads(directory: str, *, workers: int | None = None) -> Run:
    """``hashlib.file_digest`` of one file per task in a ThreadPoolExecutor of ``workers``
    (default: one per core): what a user would write to use every core."""
    paths = list_data(directory)
    workers = workers or os.cpu_count() or 1

    def one(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, paths))

    return run


_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _pinned_digests(paths: list[str], sizes: list[int], buffer: memoryview) -> list[str]:
    """Per file what a pinned read needs and nothing more: open, fstat, one read of a byte more
    than the size, fstat, close, SHA-256."""
    out = []
    for path, size in zip(paths, sizes, strict=True):
        fd = os.open(path, _FLAGS)
        try:
            before = os.fstat(fd)
            n = os.readv(fd, (buffer[: size + 1],))
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if n != size or (before.st_ino, before.st_mtime_ns, before.st_ctime_ns) != (
            after.st_ino,
            after.st_mtime_ns,
            after.st_ctime_ns,
        ):
            raise RuntimeError(f"{path} changed")
        out.append(hashlib.sha256(buffer[:n]).hexdigest())
    return out


@contender("pinned-floor")
def pinned_floor(directory: str, *, workers: int | None = None, batch: int = 64) -> Run:
    """The floor of a pinned verify of small files: :func:`_pinned_digests` by hand on batches
    of ``batch`` files, one batch per task on ``workers`` threads (default: one per core).
    What the checks and the hashing cost here with no library around them."""
    paths = list_data(directory)
    sizes = [os.path.getsize(p) for p in paths]
    workers = workers or os.cpu_count() or 1
    batches = [(paths[i : i + batch], sizes[i : i + batch]) for i in range(0, len(paths), batch)]
    largest = max(sizes, default=0)

    def task(item: tuple[list[str], list[int]]) -> list[str]:
        return _pinned_digests(item[0], item[1], memoryview(bytearray(largest + 1)))

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(task, batches))

    return run


@contender("read-manifest")
def read_manifest(url: str) -> Run:
    """``integrity_fs.read_manifest(url)``: the manifest read, parsed strictly and validated."""
    import integrity_fs

    return lambda: integrity_fs.read_manifest(url)


@contender("json-loads")
def json_loads(path: str) -> Run:
    """A bare ``json.loads`` of the manifest file's bytes: the floor of parsing it (no checks)."""
    import json

    def run() -> object:
        with open(path, "rb") as f:
            return json.loads(f.read())

    return run


@contender("hashlib-serial")
def hashlib_serial(directory: str, *, block_size: int = MiB) -> Run:
    """One thread, ``hashlib.sha256`` over each file in ``block_size`` reads into a buffer
    allocated per file: one core's limit on large files; on small ones the allocation costs."""
    paths = list_data(directory)

    def run() -> object:
        return [_sha256_range(p, 0, os.path.getsize(p), block_size) for p in paths]

    return run


@contender("hashlib-threads")
def hashlib_threads(directory: str, *, workers: int | None = None, block_size: int = MiB) -> Run:
    """A ThreadPoolExecutor of ``workers`` (default: all cores), one whole file per task."""
    paths = list_data(directory)
    workers = workers or os.cpu_count() or 1

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda p: _sha256_range(p, 0, os.path.getsize(p), block_size), paths))

    return run


@contender("hashlib-ranges")
def hashlib_ranges(directory: str, *, range_size: int = 64 * MiB, workers: int | None = None) -> Run:
    """A ThreadPoolExecutor over ``range_size`` byte ranges of every file: all cores on one file."""
    ranges: list[tuple[str, int, int]] = []
    for path in list_data(directory):
        size = os.path.getsize(path)
        ranges.extend((path, offset, min(range_size, size - offset)) for offset in range(0, max(size, 1), range_size))
    workers = workers or os.cpu_count() or 1

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda r: _sha256_range(r[0], r[1], r[2], MiB), ranges))

    return run


@contender("sha256sum", external=True)
def sha256sum(directory: str) -> Run:
    """coreutils ``sha256sum FILE...`` in a subprocess (one thread; no SHA-NI in most builds)."""
    return _command(["sha256sum"], directory)


@contender("openssl", external=True)
def openssl(directory: str) -> Run:
    """``openssl dgst -sha256 FILE...`` in a subprocess (one thread, SHA-NI when the CPU has it)."""
    return _command(["openssl", "dgst", "-sha256"], directory)


@contender("b3sum", external=True)
def b3sum(directory: str) -> Run:
    """``b3sum FILE...`` in a subprocess (the BLAKE3 reference tool: memory-maps each file and
    hashes it on every core)."""
    return _command(["b3sum"], directory)


def _command(argv: list[str], directory: str) -> Run:
    """Run ``argv FILE...``; return its peak RSS in KiB, sampled every 2 ms while it runs."""
    command = [*argv, *list_data(directory)]

    def run() -> object:
        peak = 0
        with subprocess.Popen(command, stdout=subprocess.DEVNULL) as process:
            while process.poll() is None:
                peak = max(peak, vm_hwm_kib(process.pid))
                time.sleep(0.002)
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, argv)
        return peak

    return run


@contender("model_signing-file")
def model_signing_file(directory: str, *, max_workers: int | None = None) -> Run:
    """``model_signing.hashing.Config().use_file_serialization().hash(dir)``: a digest per file,
    files in a thread pool (its default size)."""
    from model_signing import hashing

    config = hashing.Config().use_file_serialization(max_workers=max_workers)  # type: ignore[no-untyped-call]
    return lambda: config.hash(directory)


@contender("model_signing-shard")
def model_signing_shard(directory: str, *, shard_size: int = 1_000_000_000, max_workers: int | None = None) -> Run:
    """``model_signing.hashing.Config().use_shard_serialization(shard_size=...).hash(dir)``: a
    digest per ``shard_size`` byte range (default 1 GB), shards in a thread pool."""
    from model_signing import hashing

    config = hashing.Config().use_shard_serialization(  # type: ignore[no-untyped-call]
        shard_size=shard_size, max_workers=max_workers
    )
    return lambda: config.hash(directory)


def _s3(storage_options: dict[str, Any]) -> Any:
    import fsspec

    return fsspec.filesystem("s3", **storage_options)


@contender("s3-stream")
def s3_stream(
    paths: list[str],
    storage_options: dict[str, Any],
    *,
    workers: int,
    sha256: bool = False,
    block_size: int | None = None,
    cache_type: str | None = None,
) -> Run:
    """Bare s3fs: ``with fs.open(p, "rb") as f: while f.read(1 MiB)`` per object, ``workers``
    objects at a time; s3fs's default block size and cache unless given; optionally hashed."""
    fs = _s3(storage_options)
    options: dict[str, Any] = {}
    if block_size is not None:
        options["block_size"] = block_size
    if cache_type is not None:
        options["cache_type"] = cache_type

    def one(path: str) -> str:
        hasher = hashlib.sha256()
        with fs.open(path, "rb", **options) as f:
            while data := f.read(MiB):
                if sha256:
                    hasher.update(data)
        return hasher.hexdigest()

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, paths))

    return run


@contender("s3-cat")
def s3_cat(paths: list[str], storage_options: dict[str, Any], *, workers: int) -> Run:
    """Bare s3fs: ``fs.cat_file(p)`` (one GET of the whole object into memory), ``workers`` at a time."""
    fs = _s3(storage_options)

    def run() -> object:
        with ThreadPoolExecutor(workers) as pool:
            return sum(len(b) for b in pool.map(fs.cat_file, paths))

    return run
