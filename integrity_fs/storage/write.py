"""Writing: the manifest atomically, and files while they are hashed (with S3's own checksums
where they make a file attestable).

Whatever fails, nothing half-written is committed: a stream is discarded, a multipart or
resumable upload aborted, a local (or memory) file removed. A transfer keeps a :class:`Written`
of what it wrote, to delete it all when it fails and, on a local disk, to make it durable (every
file and directory fsynced) and to check it is still in place before the manifest goes over it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import fsspec
from fsspec.spec import AbstractBufferedFile

from ..hashing import StreamDigest, new_hasher
from ..options import Hashing
from ..recorded import ObjectState
from ..report import shortened
from . import s3
from .errors import storage_errors
from .local import create_beneath, open_dir_beneath, rename_beneath, unlink_beneath
from .read import Sink
from .urls import describe, is_local

__all__ = [
    "SealingWriter",
    "Written",
    "make_local_parent",
    "makedirs",
    "object_checksums",
    "remove_file",
    "remove_files",
    "store_checksums",
    "sync_dirs",
    "write_atomic",
]

log = logging.getLogger("integrity_fs")

T = TypeVar("T")


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
        sync_dirs([directory])
        return
    with storage_errors(f"writing {describe(fs, path)}"):
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


def object_checksums(fs: fsspec.AbstractFileSystem, paths: list[str]) -> dict[str, ObjectState | None]:
    """What S3 keeps for each path (its ETag and every checksum), read without reading content;
    on any other filesystem every value is ``None``."""
    if not s3.is_s3(fs):
        return dict.fromkeys(paths)
    with storage_errors(f"reading the checksums of {len(paths)} objects"):
        return s3.object_checksums(fs, paths)


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

    ``written`` (a transfer's): the path is recorded there from the moment the destination may
    hold any of it (a local or memory file from its opening, an object from its commit), and a
    local file is fsynced when it is closed. ``sinks``: given whether the write carries S3
    checksums, what else the bytes go to, in order (the store's own checksums, to record).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        hashing: Hashing,
        *,
        size: int | None = None,
        growing: bool = False,
        written: Written | None = None,
        sinks: Callable[[bool], Sequence[Sink]] | None = None,
    ) -> None:
        self.path = path
        self._written = written
        self._root = written.root if written is not None else os.path.dirname(path)  # local: nothing below it followed
        algorithm, granularity, chunk_size = hashing.algorithm, hashing.granularity, hashing.chunk_size
        self._digest = StreamDigest(algorithm, chunk_size)
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
            self._open_stream()
        self._sinks = sinks(self._upload is not None) if sinks is not None else ()

    def _open_stream(self) -> None:
        if is_local(self._fs):  # a new file, never written through a link (see ``local``)
            if self._written is None:
                make_local_parent(self.path)
                fd = create_beneath(self._root, self.path)
            else:
                fd = self._written.create(self.path)
            self._stream = os.fdopen(fd, "wb")
            return
        self._stream = self._fs.open(self.path, "wb")
        if self._written is not None and not isinstance(self._stream, AbstractBufferedFile):
            self._written.started(self.path)  # written in place (memory): there from the opening on

    @staticmethod
    def carries_checksums(fs: fsspec.AbstractFileSystem, algorithm: str) -> bool:
        """True when writes to ``fs`` go up with the store's checksums (S3, SHA-256)."""
        return algorithm == "sha256" and s3.is_s3(fs)

    @property
    def size(self) -> int:
        return self._digest.size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._digest.update(data)
        for sink in self._sinks:
            sink.update(data)
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
        self._open_stream()
        self._stream.write(self._buffer)
        self._buffer = bytearray()

    def close(self) -> tuple[str, ...]:
        """Finish the object; the unit digests of what was written (see ``StreamDigest``)."""
        digests = self._digest.digests()
        if self._written is not None:
            self._written.started(self.path)  # an object is committed now (or may be, if this fails)
        if self._stream is not None:
            if self._written is not None and is_local(self._fs):
                self._stream.flush()
                self._written.closed(self.path, self._stream.fileno())
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
            _discard(self._fs, self.path, self._stream, self._root)
            self._stream = None


class Written:
    """What one transfer wrote at its destination ``root``, recorded by its writers (thread-safe).

    ``remove()`` deletes it all when the transfer fails: every file whose destination path may
    hold any of its bytes, and on a local disk the directories it created. On a local disk
    nothing below ``root`` is written, moved or deleted through a link (see ``local``), and the
    writes are made durable: each file is fsynced when it is closed, :meth:`sync` fsyncs every
    directory that gained an entry, and :meth:`check` confirms that every file closed is still
    the one written (device, inode, size, modification time), so a verified copy that something
    else removed or replaced while it ran is never declared done.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root
        self._lock = threading.Lock()
        self._paths: dict[str, None] = {}  # in the order written: an ordered set
        self._created: list[str] = []  # local directories created, outermost first
        self._closed: dict[str, tuple[int, int, int, int]] = {}

    @property
    def paths(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def started(self, path: str) -> None:
        """``path`` may hold bytes of this transfer from now on."""
        with self._lock:
            self._paths[path] = None

    def make_parent(self, path: str) -> None:
        """Create the local directories above ``path`` (recorded, to remove them on failure): the
        root and its parents as named, those below the root without following a link. One that
        is a file is a ``NotADirectoryError``, as for :func:`make_local_parent`."""
        os.close(self._beneath(lambda made: open_dir_beneath(self.root, os.path.dirname(path), made)))

    def create(self, path: str) -> int:
        """A new local file at ``path`` (below the root, see :func:`~.local.create_beneath`), open
        for writing; it holds bytes of this transfer from now on (an old file of its name is gone)."""
        self.started(path)
        return self._beneath(lambda made: create_beneath(self.root, path, made))

    def move_in(self, src_root: str, src: str, path: str) -> None:
        """Move the local file ``src`` (below ``src_root``, on this filesystem) to ``path``, as
        :func:`~.local.rename_beneath` does; :meth:`sync` and :meth:`check` then cover it."""
        self._beneath(lambda made: rename_beneath(src_root, src, self.root, path, made))
        st = os.stat(path, follow_symlinks=False)
        with self._lock:
            self._closed[path] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _beneath(self, action: Callable[[list[str]], T]) -> T:
        """``action(made)`` once the root exists, every directory it made recorded."""
        made: list[str] = []
        try:
            self._make_root(made)
            return action(made)
        finally:
            with self._lock:
                self._created.extend(made)

    def _make_root(self, made: list[str]) -> None:
        missing: list[str] = []
        directory = self.root
        while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
            missing.append(directory)
            directory = os.path.dirname(directory)
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError as exc:
                if not os.path.isdir(directory):
                    raise NotADirectoryError(
                        f"cannot write in {self.root}: {directory} is a file, not a directory"
                    ) from exc
                continue
            made.append(directory)

    def closed(self, path: str, fd: int) -> None:
        """The local file ``path``, open on ``fd``, is complete: fsync it and note its identity."""
        os.fsync(fd)
        st = os.fstat(fd)
        with self._lock:
            self._closed[path] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def sync(self) -> None:
        """Fsync every local directory that gained an entry: each file's, each created one's parent."""
        with self._lock:
            dirs = {os.path.dirname(p) for p in self._closed} | {os.path.dirname(d) for d in self._created}
        sync_dirs(sorted(dirs, key=lambda d: (-d.count(os.sep), d)))

    def check(self, where: Callable[[str], str] = lambda path: path) -> None:
        """``OSError`` unless every local file closed is still there, the very file written;
        ``where`` maps a path written to where it is now (a staging directory renamed)."""
        with self._lock:
            closed = dict(self._closed)
        gone: list[str] = []
        for path, identity in closed.items():
            now = where(path)
            try:
                st = os.stat(now, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                gone.append(now)
                continue
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != identity:
                gone.append(now)
        if gone:
            shown = shortened(sorted(gone), 5)
            raise OSError(f"files written by this transfer were removed or replaced before it finished: {shown}")

    def remove(self) -> None:
        """Delete what was written, best effort: what cannot be deleted is logged, never raised
        (the failure that called for this is the one to raise)."""
        if is_local(self.fs):
            left = [path for path in self.paths if not self._unlinked(path)]
        else:
            left = remove_files(self.fs, self.paths)
        with self._lock:
            created, self._created = self._created, []
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only when empty: anything another writer put there stays
        if left:
            log.warning("could not delete %d files this transfer wrote: %s", len(left), shortened(left, 5))

    def _unlinked(self, path: str) -> bool:
        try:
            unlink_beneath(self.root, path)
        except (FileNotFoundError, NotADirectoryError):
            return True  # already gone (or never made: a directory above it was not there)
        except (OSError, ValueError):
            return False
        return True


def remove_files(fs: fsspec.AbstractFileSystem, paths: Iterable[str]) -> list[str]:
    """Delete ``paths`` (those already gone are fine); the ones that could not be deleted.

    S3 deletes up to 1,000 objects per request; other object stores one per request, several at
    once; local disks one after the other.
    """
    todo = list(paths)
    if s3.is_s3(fs) and todo:
        return s3.delete_objects(fs, todo)

    def gone(path: str) -> bool:
        try:
            if is_local(fs):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                remove_file(fs, path)
        except Exception:
            return False
        return True

    if is_local(fs) or len(todo) < 2:
        return [path for path in todo if not gone(path)]
    with concurrent.futures.ThreadPoolExecutor(min(_DELETERS, len(todo)), thread_name_prefix="integrity_fs") as pool:
        return [path for path, ok in zip(todo, pool.map(gone, todo), strict=True) if not ok]


#: Deletions in flight at once on object stores that delete one object per request.
_DELETERS = 16


def sync_dirs(directories: Iterable[str]) -> None:
    """Fsync each local directory, so that the entries made in it survive a power loss. A
    filesystem that cannot fsync a directory (``EINVAL``) is left as it is."""
    for directory in directories:
        try:
            fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)


def make_local_parent(path: str) -> None:
    """Create the directories above ``path``; one that is a file is a ``NotADirectoryError`` (raised
    at once, an I/O error), never the ``FileExistsError`` of a refused destination."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a directory") from exc


def _discard(fs: fsspec.AbstractFileSystem, path: str, stream: Any, root: str) -> None:
    """Close a write stream without committing it (``close()`` would store what it holds); a file
    written in place (local, below ``root``; memory) is removed."""
    if isinstance(stream, AbstractBufferedFile):
        with contextlib.suppress(Exception):
            stream.discard()  # s3fs: abort the multipart upload; gcsfs: cancel the resumable upload
        stream.closed = True  # so that neither we nor its __del__ flush the buffer as a whole object
        return
    with contextlib.suppress(Exception):
        stream.close()
    with contextlib.suppress(Exception):
        if is_local(fs):
            unlink_beneath(root, path)
        else:
            fs.rm_file(path)


def _sha256(data: bytes | bytearray | memoryview) -> str:
    hasher = new_hasher("sha256")
    hasher.update(data)
    return hasher.hexdigest()


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete one file; one that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError), storage_errors(f"deleting {describe(fs, path)}"):
        fs.rm_file(path)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create the directory ``path`` and its parents where the filesystem has directories."""
    with storage_errors(f"creating {describe(fs, path)}"):
        fs.makedirs(path, exist_ok=True)
