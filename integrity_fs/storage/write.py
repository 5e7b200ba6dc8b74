"""Writing: the manifest atomically, files while they are hashed (with S3's own checksums where
they make a file attestable), and copies that read through the one guarded reader.

Whatever fails, nothing half-written is committed: a stream is discarded, a multipart or
resumable upload aborted, a local file removed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from ..hashing import StreamDigest, new_hasher
from . import s3
from .errors import NotARegularFileError, ShortReadError, SizeChangedError, storage_errors
from .listing import Version
from .read import BLOCK_SIZE, ProgressFn, Vanished, check_stop, fresh_size, open_range, read_attempts, retried
from .urls import describe, is_local

__all__ = [
    "SealingWriter",
    "copy_file",
    "make_local_parent",
    "makedirs",
    "remove_file",
    "store_checksums",
    "write_atomic",
]


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old bytes or the new, never a part.

    Local: a temporary file in the same directory, fsynced, then ``os.replace``. Object stores:
    one PUT, which they apply atomically.
    """
    if is_local(fs):
        directory = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        try:
            mode = 0o666 & ~_umask()  # mkstemp makes 0600: readable by whoever can read the rest
            if hasattr(os, "fchmod"):  # not on Windows before Python 3.13
                os.fchmod(fd, mode)
            else:
                os.chmod(tmp, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return
    with storage_errors(f"writing {path}"):
        fs.pipe_file(path, data)


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (threads may be creating files)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def store_checksums(fs: fsspec.AbstractFileSystem, paths: list[str]) -> dict[str, s3.StoreChecksum | None]:
    """The SHA-256 the store itself keeps for each path, read without reading content.

    Only S3 keeps SHA-256 checksums; on any other filesystem every value is ``None``.
    """
    if not s3.is_s3(fs):
        return dict.fromkeys(paths)
    with storage_errors(f"reading the checksums of {len(paths)} objects"):
        return s3.store_checksums(fs, paths)


class SealingWriter:
    """Writes one file while hashing it (one digest, or one per chunk), for uploads and copies.

    On S3 with SHA-256, the bytes go up with the digests just computed as S3 checksums, laid out
    so that S3's own checksum of the object is comparable with the manifest (see ``_s3``): a
    file of one chunk, or of file granularity up to 64 MiB, in one PUT; a larger chunked file in
    parts of exactly ``chunk_size`` bytes. Anything else is written as a plain stream. Such
    writes hold up to one part (``chunk_size``, or 64 MiB) in memory.

    ``growing=True`` is for writers that do not know the size in advance (``dcp.save``): the file
    is held for one PUT until it outgrows it; then a chunked file goes on in parts of exactly
    ``chunk_size`` (when S3 allows that part size), anything else as a plain stream. Past 10,000
    parts the last part takes the rest, with its own SHA-256 (not attestable).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        *,
        algorithm: str,
        granularity: str,
        chunk_size: int | None,
        size: int | None = None,
        growing: bool = False,
    ) -> None:
        self.path = path
        self._digest = StreamDigest(algorithm, chunk_size if granularity == "chunk" else None)
        self._part_size: int | None = None
        if self.carries_checksums(fs, algorithm):
            if size is not None:
                self._part_size = s3.part_layout(granularity, chunk_size, size)
            elif growing:
                self._part_size = 0  # one PUT, until the file outgrows it
        self._buffer = bytearray()
        self._upload: s3.ChecksummedUpload | None = None
        self._stream: Any = None
        self._fs = fs
        self._single_limit = chunk_size if granularity == "chunk" and chunk_size else s3.SINGLE_PUT_LIMIT
        self._grow_into: int | None = None  # the part size a growing file goes on with past one PUT
        if growing and granularity == "chunk" and chunk_size:
            self._single_limit = min(chunk_size, s3.MAX_PART)
            if s3.MIN_PART <= chunk_size <= s3.MAX_PART:
                self._grow_into = chunk_size
        if self._part_size is not None:
            self._upload = s3.ChecksummedUpload(fs, path)
        else:
            if is_local(fs):
                make_local_parent(path)
            self._stream = fs.open(path, "wb")

    @staticmethod
    def carries_checksums(fs: fsspec.AbstractFileSystem, algorithm: str) -> bool:
        """True when writes to ``fs`` go up with the store's checksums (S3, SHA-256)."""
        return algorithm == "sha256" and s3.is_s3(fs)

    @property
    def size(self) -> int:
        return self._digest.size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._digest.update(data)
        if self._stream is not None:
            self._stream.write(data)
            return
        self._buffer += data
        assert self._upload is not None
        if self._part_size == 0 and len(self._buffer) > self._single_limit:
            if self._grow_into is None:
                self._fall_back_to_stream()  # the file grew past one PUT's layout since it was listed
                return
            self._part_size = self._grow_into
        if self._part_size:
            while len(self._buffer) >= self._part_size and len(self._upload._parts) < s3.MAX_PARTS - 1:
                index = len(self._upload._parts)  # the chunk this part is: its digest is done
                done = self._digest.completed()
                self._upload.part(bytes(memoryview(self._buffer)[: self._part_size]), done[index])
                del self._buffer[: self._part_size]

    def _fall_back_to_stream(self) -> None:
        self._upload = None
        self._stream = self._fs.open(self.path, "wb")
        self._stream.write(self._buffer)
        self._buffer = bytearray()

    def close(self) -> tuple[str, ...]:
        """Finish the object; the unit digests of what was written (see ``StreamDigest``)."""
        digests = self._digest.digests()
        if self._stream is not None:
            self._stream.close()
            return digests
        assert self._upload is not None
        if self._upload.started:
            if self._buffer:
                # The last chunk, unless S3's part limit made the last part take several.
                last = digests[-1] if len(self._buffer) <= (self._part_size or 0) else _sha256(self._buffer)
                self._upload.part(self._buffer, last)
            self._upload.complete()
        else:
            self._upload.put(self._buffer, digests[0])
        self._buffer = bytearray()
        return digests

    def abort(self) -> None:
        """Drop what was written, as far as the store allows: a started multipart or resumable
        upload is aborted, a local file removed; never committed as a shorter file."""
        if self._upload is not None:
            with contextlib.suppress(Exception):
                self._upload.abort()
        if self._stream is not None:
            _discard(self._fs, self.path, self._stream)
            self._stream = None


def make_local_parent(path: str) -> None:
    """Create the directories above ``path``; one that is a file is a ``NotADirectoryError`` (raised
    at once, an I/O error), never the ``FileExistsError`` of a refused destination."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a directory") from exc


def _discard(fs: fsspec.AbstractFileSystem, path: str, stream: Any) -> None:
    """Close a write stream without committing it (``close()`` would store what it holds)."""
    if isinstance(stream, AbstractBufferedFile):
        with contextlib.suppress(Exception):
            stream.discard()  # s3fs: abort the multipart upload; gcsfs: cancel the resumable upload
        stream.closed = True  # so that neither we nor its __del__ flush the buffer as a whole object
        return
    with contextlib.suppress(Exception):
        stream.close()
    if is_local(fs):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _sha256(data: bytes | bytearray | memoryview) -> str:
    hasher = new_hasher("sha256")
    hasher.update(data)
    return hasher.hexdigest()


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete one file; one that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError), storage_errors(f"deleting {path}"):
        fs.rm_file(path)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create the directory ``path`` and its parents where the filesystem has directories."""
    with storage_errors(f"creating {path}"):
        fs.makedirs(path, exist_ok=True)


# --------------------------------------------------------------------------- copying (transfer)


def copy_file(
    fs: fsspec.AbstractFileSystem,
    path: str,
    dst_fs: fsspec.AbstractFileSystem,
    dst_path: str,
    length: int,
    *,
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
    progress: ProgressFn,
    version: Version | None = None,
    stop: threading.Event | None = None,
) -> tuple[str, ...] | None:
    """Copy exactly ``length`` bytes of ``path`` to ``dst_path`` through a :class:`SealingWriter`;
    the unit digests of what was written, or ``None`` when ``path`` vanished (or is no longer a
    regular file).

    The source is read through :func:`~.read.open_range`, pinned to ``version``: it must end
    right after ``length`` bytes (``SizeChangedError`` with the size it has now, when longer or
    shorter), and a source whose version changed raises ``FileChangedError``. A stop is honoured
    between blocks and on the loop (``Cancelled``); transient failures are retried as reads are
    (the writer is aborted and the file sent again), a refused permission is raised at once.
    Whatever fails, nothing half-written is committed.
    """
    what = f"copying {describe(fs, path)} to {describe(dst_fs, dst_path)}"
    sent = [0]  # bytes sent (and reported to ``progress``) by the attempt under way

    def once(attempt: int) -> tuple[str, ...]:
        sent[0] = 0
        return _copy_once(
            fs, path, dst_fs, dst_path, length, algorithm, granularity, chunk_size, progress, sent, version, stop
        )

    def undo() -> None:
        progress(-sent[0])

    attempts = min(read_attempts(fs), read_attempts(dst_fs))
    try:
        return retried(fs, path, what, attempts, once, undo=undo, stop=stop)
    except Vanished:
        undo()
        return None


def _copy_once(
    fs: fsspec.AbstractFileSystem,
    path: str,
    dst_fs: fsspec.AbstractFileSystem,
    dst_path: str,
    length: int,
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
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
        writer = SealingWriter(
            dst_fs, dst_path, algorithm=algorithm, granularity=granularity, chunk_size=chunk_size, size=length
        )
        try:
            while sent[0] < length:
                check_stop(stop)
                n = source.readinto(block[: min(len(block), length - sent[0])])
                if not n:
                    source.check_version()
                    _short(fs, path, length, sent[0])
                writer.write(block[:n])
                sent[0] += n
                progress(n)
            source.finish()
            check_stop(stop)
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
