"""The one guarded reader: every byte of file content that integrity_fs hashes, copies or hands
to a caller is read here, through :func:`open_range`.

Each read is pinned to the version of the file that the operation's listing saw: on S3 every
request carries ``IfMatch`` with the listed ETag, on GCS ``ifGenerationMatch`` with the listed
generation, on local disks the file's identity is checked on the open descriptor before its
first byte is used and after its last; elsewhere the listed modification stamp is compared after
the read (a backend that lists none gets a WARNING: its reads cannot be pinned). A file whose
version changed raises ``FileChangedError``. A range that ends at the
end of its file confirms that the file ends there (``FileGrewError`` otherwise). Transient
failures are retried, a stop (Ctrl-C, another worker's failure) ends a read within a block or
a poll of the event loop, and backend exceptions become ``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from ..errors import FileChangedError
from ..hashing import ALGORITHMS, MAPPED_READS, READ_SIZES, new_hasher
from . import gcs, s3
from .calls import READ_ATTEMPTS, check_stop, close_stream, on_loop, read_attempts, read_block, retried
from .errors import FileGrewError, ShortReadError, SizeChangedError, storage_errors
from .listing import UNKNOWN_VERSION, Version, forget_cached, stamp_of
from .local import LocalRange, digest_small_file, open_file, read_small
from .urls import describe, is_local

__all__ = [
    "BLOCK_SIZE",
    "REMOTE_BLOCK_SIZE",
    "ProgressFn",
    "Range",
    "Sink",
    "Span",
    "Vanished",
    "fresh_size",
    "hash_range",
    "open_range",
    "read_file",
]

log = logging.getLogger("integrity_fs")

#: Read size for hashing: big enough to amortise calls, small enough to stay in CPU cache.
BLOCK_SIZE = 1024 * 1024
#: Reads into a caller's unit buffer take this many blocks at a time: fewer calls (each one takes
#: the GIL back) while a loader thread shares the process with the caller's own work.
INTO_PIECES = 4
#: Local reads of at least this many bytes hashed by an algorithm of ``MAPPED_READS`` map the file
#: instead of reading it into a buffer, and hash this many bytes of the mapping per call (the
#: file's identity is checked before each).
MAPPED_MIN = 1024 * 1024
MAPPED_PIECE = 16 * 1024 * 1024
#: Request size on object stores that are read in pieces (GCS, generic backends).
REMOTE_BLOCK_SIZE = 8 * 1024 * 1024

ProgressFn = Callable[[int], None]
T = TypeVar("T")


class Sink(Protocol):
    """What else the bytes of a read go to, in order (a store checksum being computed)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...


class Vanished(Exception):
    """The file is gone, or is no longer a regular file: not a storage failure, not retried."""


class Range(Protocol):
    """Bytes ``[offset, offset + length)`` of one file, pinned to one version."""

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` from the next bytes of the range; fewer only at its end (0: done)."""

    def check_version(self) -> None:
        """``FileChangedError`` if the file is known to be another version than the one read."""

    def finish(self) -> None:
        """After the last byte: the file ends where planned and is still the version read."""

    def close(self) -> None: ...


def open_range(
    fs: fsspec.AbstractFileSystem,
    path: str,
    offset: int,
    length: int,
    *,
    file_size: int | None = None,
    version: Version | None = None,
    stop: threading.Event | None = None,
) -> Range:
    """A pinned reader of ``length`` bytes of ``path`` from ``offset`` (see the module docstring).

    ``version`` is what the listing saw (``None``: nothing to pin to, e.g. reads through a cache,
    whose bytes are hashed as served). ``file_size``: the size the file was planned with; a range
    that ends there confirms the file ends there.
    """
    if is_local(fs):
        return LocalRange(path, offset, length, file_size=file_size, version=version)
    pin = str(version) if version and version != UNKNOWN_VERSION else None
    if s3.is_s3(fs):
        stream: Any = s3.RangeStream(fs, path, offset, offset + length, pin)
    elif gcs.is_gcs(fs):
        stream = gcs.GcsRange(fs, path, offset, offset + length, pin, REMOTE_BLOCK_SIZE)
    elif isinstance(fs, AsyncFileSystem) and getattr(fs, "async_impl", False):
        stream = _AsyncRange(fs, path, offset, offset + length, REMOTE_BLOCK_SIZE)
        return _StreamRange(fs, path, stream, offset, length, file_size, stop, version)
    else:
        return _FileRange(fs, path, offset, length, file_size, version)
    assert isinstance(fs, AsyncFileSystem)
    return _StreamRange(fs, path, stream, offset, length, file_size, stop)


class _StreamRange:
    """A range read from a request stream on the filesystem's event loop, each wait cancellable
    on the loop once ``stop`` is set. S3 and GCS enforce the pin on every request; elsewhere
    ``version`` (the listed stamp) is compared with a fresh one once the range is read."""

    def __init__(
        self,
        fs: AsyncFileSystem,
        path: str,
        stream: Any,
        offset: int,
        length: int,
        file_size: int | None,
        stop: threading.Event | None,
        version: Version | None = None,
    ) -> None:
        self._fs, self.path, self._stop = fs, path, stop
        self._version = version
        self._end = offset + length
        self._check_end = file_size is not None and file_size == self._end
        self._left = length
        self._stream = on_loop(fs, stream.open(), stop)

    def readinto(self, view: memoryview) -> int:
        want = min(len(view), self._left)
        if not want:
            return 0
        data = on_loop(self._fs, read_block(self._stream, want), self._stop)
        view[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def check_version(self) -> None:
        if self._version is None:
            return  # pinned on every request by the store itself (S3, GCS), or nothing to pin to
        if self._version == UNKNOWN_VERSION:
            return _unpinned(self._fs)
        info = on_loop(self._fs, self._fs._info(self.path), self._stop)
        if stamp_of(info) != self._version:
            raise _changed(self._fs, self.path, self._version, stamp_of(info))

    def finish(self) -> None:
        if self._left:
            raise ShortReadError(f"short read from {self.path}: {self._left} bytes of the range missing")
        self.check_version()  # a new version explains any size: reported as the change it is
        if self._check_end:
            total = getattr(self._stream, "total_size", None)  # the size the store answered with
            if isinstance(total, int):
                if total > self._end:
                    raise FileGrewError(self.path, self._end, total)
            elif on_loop(self._fs, read_block(self._stream, 1), self._stop):
                raise FileGrewError(self.path, self._end, None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            on_loop(self._fs, close_stream(self._stream), None)


class _FileRange:
    """A range read through ``fs.open`` (any other backend, or a caching layer). With a version,
    the file's listed stamp is compared with a fresh one once the range is read."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        offset: int,
        length: int,
        file_size: int | None,
        version: Version | None,
    ) -> None:
        self._fs, self.path, self._version = fs, path, version
        self._end = offset + length
        self._check_end = file_size is not None and file_size == self._end
        self._left = length
        self._file = _open_buffered(fs, path)
        if offset:
            self._file.seek(offset)
        self._readinto = getattr(self._file, "readinto", None)

    def readinto(self, view: memoryview) -> int:
        want = view[: min(len(view), self._left)]
        if not want:
            return 0
        if self._readinto is not None:
            n = int(self._readinto(want) or 0)
        else:
            data = self._file.read(len(want))
            n = len(data)
            want[:n] = data
        self._left -= n
        return n

    def check_version(self) -> None:
        if self._version is None:
            return
        if self._version == UNKNOWN_VERSION:
            return _unpinned(self._fs)
        forget_cached(self._fs, self.path)
        now = stamp_of(self._fs.info(self.path))
        if now != self._version:
            raise _changed(self._fs, self.path, self._version, now)

    def finish(self) -> None:
        if self._left:
            raise ShortReadError(f"short read from {self.path}: {self._left} bytes of the range missing")
        self.check_version()  # a new version explains any size: reported as the change it is
        if self._check_end:
            _confirm_end(self._fs, self.path, self._file, self._end)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()


class _AsyncRange:
    """Bytes ``[start, end)`` of a file on any other async store: one ``open_async`` stream from
    the start of the file where the backend has one (a single request), else ranged ``_cat_file``
    requests of ``block_size`` bytes. The async-file shape of :class:`_StreamRange`."""

    def __init__(self, fs: AsyncFileSystem, path: str, start: int, end: int, block_size: int) -> None:
        self._fs, self._path = fs, path
        self._pos, self._end, self._block_size = start, end, block_size
        self._stream: Any = None
        self._data = memoryview(b"")
        self.total_size: int | None = None

    async def open(self) -> _AsyncRange:
        if self._pos == 0 and hasattr(self._fs, "open_async"):
            with contextlib.suppress(NotImplementedError):
                self._stream = await self._fs.open_async(self._path, "rb")
        return self

    async def read(self, n: int = -1) -> bytes:
        if self._stream is not None:
            data: bytes = await self._stream.read(n)
            return data
        if not self._data and self._pos < self._end:
            stop = min(self._end, self._pos + self._block_size)
            self._data = memoryview(await self._fs._cat_file(self._path, start=self._pos, end=stop))
            self._pos += len(self._data)
            if not self._data:
                self._end = self._pos
        take = len(self._data) if n < 0 else min(n, len(self._data))
        out, self._data = self._data[:take], self._data[take:]
        return bytes(out)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()


_UNPINNED: weakref.WeakSet[fsspec.AbstractFileSystem] = weakref.WeakSet()


def _unpinned(fs: fsspec.AbstractFileSystem) -> None:
    """A read of a file whose backend lists no version cannot be pinned: said once per filesystem
    (a WARNING), never passed over in silence. Its bytes are still hashed as they are read."""
    if fs not in _UNPINNED:
        _UNPINNED.add(fs)
        log.warning(
            "%s lists no version of its files (no ETag, generation or modification time): reads cannot be "
            "pinned to the version listed, so a file rewritten while it is read shows as damaged, not as changed",
            type(fs).__name__,
        )


def _changed(fs: fsspec.AbstractFileSystem, path: str, listed: Version, now: str) -> FileChangedError:
    return FileChangedError(f"{describe(fs, path)} changed while it was read (listed as {listed}, now {now})", (path,))


def _open_buffered(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A binary reader of its own for ``path``, tuned for sequential streaming (readahead where it
    applies). fsspec's memory file system hands every opener the very ``BytesIO`` it stores: its
    bytes get a reader of their own here (no copy), so that reads on other threads never move it."""
    try:
        f = fs.open(path, "rb", block_size=REMOTE_BLOCK_SIZE, cache_type="readahead")
    except TypeError:  # a backend whose open() takes no cache options
        f = fs.open(path, "rb")
    if isinstance(fs, MemoryFileSystem) and fs.store.get(fs._strip_protocol(path)) is f:
        return io.BytesIO(f.getvalue())
    return f


def _confirm_end(fs: fsspec.AbstractFileSystem, path: str, f: Any, end: int) -> None:
    """Raise ``FileGrewError`` when the open file ``f`` holds more than ``end`` bytes.

    One more byte is asked for; a buffered object-store file stops at the size it was opened
    with, so there the store is asked for the size now.
    """
    if f.read(1):
        size: int | None
        try:
            size = fresh_size(fs, path)
        except Exception:
            size = None
        raise FileGrewError(path, end, size)
    if isinstance(f, AbstractBufferedFile):
        size = fresh_size(fs, path)
        if size > end:
            raise FileGrewError(path, end, size)


# --------------------------------------------------------------------------- hashing a range


class Span(NamedTuple):
    """``length`` bytes of ``path`` on ``fs`` from ``offset``, pinned to the file as listed:
    ``file_size`` bytes (``None``: not known) at ``version``."""

    fs: fsspec.AbstractFileSystem
    path: str
    offset: int
    length: int
    file_size: int | None = None
    version: Version | None = None


def hash_range(
    span: Span,
    algorithm: str,
    progress: ProgressFn | None = None,
    *,
    stop: threading.Event | None = None,
    buffer: memoryview | None = None,
    into: memoryview | None = None,
    extra: Callable[[], Sequence[Sink]] | None = None,
) -> str:
    """Digest of the bytes of ``span``, read once through :func:`open_range` (pinned to its
    version), in bounded memory.

    Fewer bytes than asked for is a ``ShortReadError`` (a ``SizeChangedError`` when the store says
    the file is shorter now). Transient failures are retried (``READ_ATTEMPTS`` times, or
    ``SELF_RETRYING_READ_ATTEMPTS`` on backends that retry each request themselves); a missing
    file, a refused permission and a changed version are raised at once. Once ``stop`` is set,
    the read ends at the next block with ``Cancelled``.

    ``into`` (writable, exactly ``length`` bytes): the bytes are kept there, each piece hashed as
    it lands (the verified reads' unit buffers). ``buffer`` (writable, reused by the caller's
    thread): a whole local file shorter than it is read into it in one call, first by
    ``digest_small_file`` (no retry machinery: for small files the per-file Python is the cost),
    and the guarded way only when that does not settle it. ``extra``: makes the hashers that each
    attempt also feeds the same bytes to, in order (a store's own checksums, while they are
    recorded); the caller keeps the last ones made.
    """
    fs, path, offset, length, file_size, version = span
    check_end = file_size is not None and offset + length == file_size
    fast = into is None and buffer is not None and offset == 0 and check_end and length < len(buffer)
    fast = fast and is_local(fs)
    if fast and extra is None and algorithm in ALGORITHMS and (stop is None or not stop.is_set()):
        assert buffer is not None
        digest = digest_small_file(path, length, version, ALGORITHMS[algorithm], buffer)
        if digest is not None:  # else the guarded read below says what is wrong
            if progress is not None:
                progress(length)
            return digest
    counted = [0]  # bytes reported to ``progress`` by the attempt under way

    def once(attempt: int) -> str:
        counted[0] = 0
        if fast and attempt == 1:
            assert buffer is not None
            hasher = new_hasher(algorithm)
            data = read_small(path, length, buffer, version)
            hasher.update(data)
            for other in extra() if extra is not None else ():
                other.update(data)
            if progress is not None:
                progress(length)
            return hasher.hexdigest()
        others = extra() if extra is not None else ()
        return _hash_once(span, algorithm, progress, counted, stop, into, others)

    def undo() -> None:
        if progress is not None and counted[0]:
            progress(-counted[0])

    def shorter_now(exc: OSError) -> None:
        if isinstance(exc, ShortReadError) or exc.errno == errno.EINVAL:  # short, or a range past the end
            now = _shorter_now(fs, path, offset + length)
            if now is not None:  # the store says the file is shorter now: content, not storage
                raise SizeChangedError(path, offset + length, now) from exc

    attempts = READ_ATTEMPTS if fast else read_attempts(fs)
    return retried(fs, path, f"reading {describe(fs, path)}", attempts, once, undo=undo, stop=stop, check=shorter_now)


def _hash_once(
    span: Span,
    algorithm: str,
    progress: ProgressFn | None,
    counter: list[int],
    stop: threading.Event | None,
    into: memoryview | None,
    others: Sequence[Sink] = (),
) -> str:
    fs, path, offset, length, file_size, version = span
    hasher = new_hasher(algorithm)
    reader = open_range(fs, path, offset, length, file_size=file_size, version=version, stop=stop)
    try:
        mapped = into is None and not others and algorithm in MAPPED_READS and length >= MAPPED_MIN
        pieces = reader.mapped(MAPPED_PIECE) if mapped and isinstance(reader, LocalRange) else None
        if pieces is not None:
            for view in pieces:
                check_stop(stop)
                hasher.update(view)
                counter[0] += len(view)
                if progress is not None:
                    progress(len(view))
            reader.finish()
            return hasher.hexdigest()
        piece = READ_SIZES.get(algorithm, BLOCK_SIZE) * (INTO_PIECES if into is not None else 1)
        own = memoryview(bytearray(max(1, min(piece, length)))) if into is None else None
        done = 0
        while done < length:
            check_stop(stop)
            view = into[done : done + piece] if into is not None else own[: min(piece, length - done)]  # type: ignore[index]
            n = reader.readinto(view)
            if not n:
                reader.check_version()  # a file cut short by a writer has changed, not shrunk
                raise ShortReadError(
                    f"short read from {path}: expected {length} bytes from offset {offset}, got {done}"
                )
            hasher.update(view[:n])
            if others:
                for other in others:
                    other.update(view[:n])
            done += n
            counter[0] += n
            if progress is not None:
                progress(n)
        reader.finish()
    finally:
        reader.close()
    return hasher.hexdigest()


def _shorter_now(fs: fsspec.AbstractFileSystem, path: str, end: int) -> int | None:
    """The size of ``path`` now when the store says it ends before ``end``; ``None`` when it does
    not, or cannot say (then a short read stays a storage failure, and is retried)."""
    try:
        size = os.stat(path).st_size if is_local(fs) else fresh_size(fs, path)
    except Exception:
        return None
    return size if size < end else None


def fresh_size(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """The size of ``path`` as the store says now, not as a listing cached it."""
    if s3.is_s3(fs):
        return int(sync(fs.loop, s3.head_size, fs, path))  # a HEAD; the listing cache stays for the others
    if is_local(fs):
        return os.stat(path).st_size
    forget_cached(fs, path)
    return int(fs.size(path))


# --------------------------------------------------------------------------- whole small files


def read_file(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """Whole small file (the manifest, a signature). ``FileNotFoundError`` passes through as is;
    a local FIFO, socket or device raises ``NotARegularFileError`` without blocking."""
    if is_local(fs):
        with open_file(path) as f:
            return bytes(f.read())
    with storage_errors(f"reading {describe(fs, path)}"):
        return bytes(fs.cat_file(path))
