"""The hashing engine: units (whole files, or chunks) read through the guarded reader on a pool
of threads, largest first, with one progress total, stopped at once by Ctrl-C or the first
failure. Every verb that hashes stored content (seal, verify, the distributed shares) runs here.

Internal.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from . import storage
from .hashing import Unit
from .options import Work
from .report import printable

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "REMOTE_WORKERS",
    "Grown",
    "UnitOutcome",
    "default_workers",
    "hash_units",
    "log_done",
    "run_parallel",
    "whole_files",
]

log = logging.getLogger("integrity_fs")

T = TypeVar("T")
#: Default workers, no progress.
DEFAULT_WORK = Work()
R = TypeVar("R")


@dataclass(frozen=True)
class Grown:
    """What reading a unit found when its file does not hold the planned bytes: more than
    sealed, or (the store confirms) fewer than listed; ``size`` is what it holds, if known."""

    size: int | None


#: What hashing a unit gives: its digest; ``None`` when the file vanished; ``Grown`` when the
#: file turned out longer than sealed or shorter than listed.
UnitOutcome = str | Grown | None


#: Concurrent reads on object stores, where latency, not the CPU, is the limit.
REMOTE_WORKERS = 16


def default_workers(fs: fsspec.AbstractFileSystem) -> int:
    return (os.cpu_count() or 1) if storage.is_local(fs) else REMOTE_WORKERS


#: Local whole files up to this size are hashed in batches (one task per batch, each file read
#: in one call into the task's buffer): their per-file Python work, not the hashing, would
#: otherwise hold the GIL and keep a second thread from helping.
SMALL_FILE = storage.BLOCK_SIZE


#: A batch ends at this many files or this many bytes, whichever comes first.
BATCH_FILES = 64


BATCH_BYTES = 4 * 1024 * 1024


def hash_units(
    fs: fsspec.AbstractFileSystem,
    root: str,
    algorithm: str,
    units: Iterable[Unit],
    *,
    versions: Mapping[str, storage.Version] | None = None,
    work: Work = DEFAULT_WORK,
    extra: Mapping[str, Callable[[], list[storage.Sink]]] | None = None,
) -> dict[Unit, UnitOutcome]:
    """Digest of every unit, hashed concurrently, largest first; ``None`` for a vanished file
    (or one that is no longer a regular file, or is a directory now), ``Grown`` for a file that
    does not hold the planned bytes (on a store without versions).

    Each read is pinned to the file's entry in ``versions`` (the listing's): a file whose version
    changed raises ``FileChangedError``. Small local files go in batches, one task each (see
    ``SMALL_FILE``); the stop flag is checked between the files of a batch. The first failure
    stops the rest (within a block or a file) and is raised. ``extra``: for files read whole (one
    unit), what makes the hashers their bytes also go to (``storage.Recording.extra``).
    """
    todo = sorted(units, key=_length, reverse=True)
    progress = storage.progress_fn(work.callback, sum(u.length for u in todo))
    stop = threading.Event()
    tasks = _tasks(todo) if storage.is_local(fs) else [[unit] for unit in todo]
    workers = min(work.max_workers or default_workers(fs), max(1, len(tasks)))
    prefix = root.rstrip("/") + "/"
    pins: Mapping[str, storage.Version] = versions or {}
    others: Mapping[str, Callable[[], list[storage.Sink]]] = extra or {}

    def one(unit: Unit, buffer: memoryview | None, report: storage.ProgressFn | None) -> UnitOutcome:
        try:
            span = storage.Span(fs, prefix + unit.name, unit.offset, unit.length, unit.file_size, pins.get(unit.name))
            return storage.hash_range(
                span,
                algorithm,
                report,
                stop=stop,
                buffer=buffer,
                extra=others.get(unit.name) if unit.offset == 0 and unit.length == unit.file_size else None,
            )
        except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError):
            return None
        except storage.SizeChangedError as exc:  # longer than sealed, or shorter now than listed
            return Grown(exc.size)

    def task(index: int) -> list[UnitOutcome]:
        batch = tasks[index]
        if len(batch) == 1 and batch[0].length > SMALL_FILE:
            return [one(batch[0], None, progress)]
        buffer = memoryview(bytearray(batch[0].length + 1))  # the largest first
        outcomes = [one(unit, buffer, None) for unit in batch]
        progress(sum(unit.length for unit in batch))
        return outcomes

    results = run_parallel(task, range(len(tasks)), workers, stop=stop)
    out: dict[Unit, UnitOutcome] = {}
    for index, batch in enumerate(tasks):
        out.update(zip(batch, results.pop(index), strict=True))
    return out


_length = operator.attrgetter("length")


def _tasks(units: Sequence[Unit]) -> list[list[Unit]]:
    """``units`` (largest first) as tasks: one per large unit, batches of small whole files."""
    tasks: list[list[Unit]] = []
    batch: list[Unit] = []
    batch_bytes = 0
    for unit in units:
        if unit.length > SMALL_FILE or unit.offset or unit.file_size != unit.length:
            tasks.append([unit])
            continue
        if len(batch) >= BATCH_FILES or batch_bytes + unit.length > BATCH_BYTES:
            tasks.append(batch)
            batch, batch_bytes = [], 0
        batch.append(unit)
        batch_bytes += unit.length
    if batch:
        tasks.append(batch)
    return tasks


def run_parallel(
    fn: Callable[[T], R], items: Sequence[T], workers: int, *, stop: threading.Event | None = None
) -> dict[T, R]:
    """``fn`` on every item on ``workers`` threads; the first exception is raised.

    On the first exception, or Ctrl-C in the calling thread, ``stop`` is set (``fn`` checks it
    between blocks and raises ``storage.Cancelled``), items not started are dropped, and the call
    returns only once every worker has stopped: no thread goes on reading after it.
    """
    if workers <= 1 or len(items) <= 1:
        return {item: fn(item) for item in items}
    stop = stop if stop is not None else threading.Event()
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="integrity_fs")
    try:
        futures = {pool.submit(fn, item): item for item in items}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # Ctrl-C: stop the running items, start nothing new
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    errors = [error for f in futures if f in done and (error := f.exception()) is not None]
    if errors:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise next((e for e in errors if not isinstance(e, storage.Cancelled)), errors[0])
    pool.shutdown(wait=True)
    return {item: future.result() for future, item in futures.items()}


def whole_files(units: Iterable[Unit]) -> dict[str, int]:
    """The files of ``units`` that one unit reads whole (file granularity, one-chunk files): their
    bytes pass in order through one reader, so the store's own checksums can be computed too."""
    return {u.name: u.length for u in units if u.offset == 0 and u.length == u.file_size}


def log_done(what: str, where: str, files: int, nbytes: int, started: float) -> None:
    """An INFO line: what was done where, how much, how fast (since ``started``, a ``perf_counter``)."""
    elapsed = time.perf_counter() - started
    rate = nbytes / elapsed / 1e9 if elapsed > 0 else 0.0
    log.info("%s %s: %d files, %d bytes in %.2f s (%.2f GB/s)", what, printable(where), files, nbytes, elapsed, rate)
