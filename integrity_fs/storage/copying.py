"""Copies that read through the one guarded reader and write through a :class:`~.write.SealingWriter`:
the source pinned and confirmed to end where planned, the destination never committed short; and
copies that the store makes itself (:func:`copy_within`).

Internal: the transfers (``download``, ``upload``, ``copy``) call these.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import fsspec

from ..options import Hashing
from . import s3
from .calls import check_stop, read_attempts, retried
from .errors import NotARegularFileError, ShortReadError, SizeChangedError, storage_errors
from .listing import Version
from .read import BLOCK_SIZE, ProgressFn, Sink, Span, Vanished, fresh_size, open_range
from .urls import describe
from .write import SealingWriter, Written

__all__ = ["copy_file", "copy_within", "rename_object"]


def copy_file(
    source: Span,
    dst_fs: fsspec.AbstractFileSystem,
    dst_path: str,
    hashing: Hashing,
    *,
    progress: ProgressFn,
    stop: threading.Event | None = None,
    written: Written | None = None,
    sinks: Callable[[bool], Sequence[Sink]] | None = None,
) -> tuple[str, ...] | None:
    """Copy ``source`` (a whole file: from 0, its listed ``length`` bytes at its listed ``version``)
    to ``dst_path`` through a :class:`SealingWriter`
    (recording the write in ``written``); the unit digests of what was written, or ``None`` when
    ``path`` vanished (or is no longer a regular file).

    The source is read through :func:`~.read.open_range`, pinned to ``version``: it must end
    right after ``length`` bytes (``SizeChangedError`` with the size it has now, when longer or
    shorter), and a source whose version changed raises ``FileChangedError``. A stop is honoured
    between blocks and on the loop (``Cancelled``); transient failures are retried as reads are
    (the writer is aborted and the file sent again), a refused permission is raised at once.
    Whatever fails, nothing half-written is committed. A destination that is not there (a
    directory removed, a bucket that does not exist) is an ``OSError`` about the destination,
    raised at once: never taken for a source that vanished. ``sinks``: as for the writer (each
    attempt makes its own).
    """
    fs, path, _offset, length, _size, version = source
    what = f"copying {describe(fs, path)} to {describe(dst_fs, dst_path)}"
    sent = [0]  # bytes sent (and reported to ``progress``) by the attempt under way

    def open_writer() -> SealingWriter:
        with _writing():
            return SealingWriter(
                dst_fs,
                dst_path,
                hashing,
                size=length,
                written=written,
                sinks=sinks,
            )

    def once(attempt: int) -> tuple[str, ...]:
        sent[0] = 0
        return _copy_once(fs, path, open_writer, length, progress, sent, version, stop)

    def undo() -> None:
        progress(-sent[0])

    attempts = min(read_attempts(fs), read_attempts(dst_fs))
    try:
        return retried(fs, path, what, attempts, once, undo=undo, stop=stop)
    except Vanished:
        undo()
        return None
    except _DestinationMissing as exc:
        undo()
        raise OSError(f"storage error while {what}: {exc}") from exc.__cause__


def copy_within(
    fs: fsspec.AbstractFileSystem,
    path: str,
    dst_path: str,
    size: int,
    hashing: Hashing,
    digests: Sequence[str],
) -> None:
    """Copy the object ``path`` to ``dst_path`` in the same object store, no byte through this
    process, laid out as a :class:`SealingWriter` writing it with these unit ``digests`` would
    lay it out: on S3 with SHA-256, one CopyObject or the same parts, each with its SHA-256 (an
    attestable object stays attestable, and S3 refuses bytes other than those digests); else the
    store's own copy (GCS keeps the object's MD5 and CRC32C)."""
    part_size = s3.part_layout(hashing.granularity, hashing.chunk_size, size)
    with storage_errors(f"copying {describe(fs, path)} to {describe(fs, dst_path)}"):
        if SealingWriter.carries_checksums(fs, hashing.algorithm) and part_size is not None:
            s3.copy_object(fs, path, dst_path, size, part_size, digests)
        else:
            fs.cp_file(path, dst_path)


def rename_object(fs: fsspec.AbstractFileSystem, path: str, new_path: str) -> None:
    """Move the object ``path`` to ``new_path`` on S3, which has no rename but a copy: the copy asks
    S3 for its SHA-256, so that a file written in one PUT stays attestable whatever the store's copy
    default; then ``path`` is deleted."""
    fs.copy(path, new_path, ChecksumAlgorithm="SHA256")
    fs.rm(path)


class _DestinationMissing(Exception):
    """A write found no such file, directory or bucket at the destination: a storage failure
    there, never a source that vanished, and not retried. Not an ``OSError``, so that the retry
    loop passes it on as it is."""


@contextlib.contextmanager
def _writing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise _DestinationMissing(f"the destination is not there: {exc}") from exc


def _copy_once(
    fs: fsspec.AbstractFileSystem,
    path: str,
    open_writer: Callable[[], SealingWriter],
    length: int,
    progress: ProgressFn,
    sent: list[int],
    version: Version | None,
    stop: threading.Event | None,
) -> tuple[str, ...]:
    try:
        source = open_range(fs, path, 0, length, file_size=length, version=version, stop=stop)
    except (FileNotFoundError, NotARegularFileError, IsADirectoryError) as exc:
        raise Vanished(path) from exc
    block = memoryview(bytearray(max(1, min(BLOCK_SIZE, length))))
    try:
        writer = open_writer()
        try:
            while sent[0] < length:
                check_stop(stop)
                n = source.readinto(block[: min(len(block), length - sent[0])])
                if not n:
                    source.check_version()
                    _short(fs, path, length, sent[0])
                with _writing():
                    writer.write(block[:n])
                sent[0] += n
                progress(n)
            source.finish()
            check_stop(stop)
            with _writing():
                return writer.close()
        except BaseException:
            writer.abort()
            raise
    except FileNotFoundError as exc:
        raise Vanished(path) from exc
    finally:
        source.close()


def _short(fs: fsspec.AbstractFileSystem, path: str, length: int, got: int) -> None:
    """The source ended after ``got`` of ``length`` bytes: ``SizeChangedError`` when it is
    shorter now, else a ``ShortReadError`` (transient: retried)."""
    try:
        size = fresh_size(fs, path)
    except FileNotFoundError as exc:
        raise Vanished(path) from exc
    if size != length:
        raise SizeChangedError(path, length, size)
    raise ShortReadError(f"short read from {path}: expected {length} bytes, got {got}")
