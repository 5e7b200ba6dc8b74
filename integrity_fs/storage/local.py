"""Local files, read so that nothing blocks and every byte comes from the version listed.

A path is opened ``O_NONBLOCK`` (a FIFO cannot wait for a writer) and judged on the descriptor:
only regular files are read. A read pinned to a listed identity (device, inode, size,
modification and change times) checks it on the open descriptor before its first byte is used
and after its last; a file written to or replaced meanwhile raises ``FileChangedError``.
Timestamps move in clock ticks (a few ms on Linux): a write in the same tick as the listing's
``stat`` may go unseen; any later one is seen.

Writing beneath a root (a transfer's destination, a checkpoint being saved) never goes through a
link at or under it: each directory below the root is opened relative to the one above it with
``O_NOFOLLOW``, and a file is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``) in the directory so
opened, after whatever entry of its name was there is unlinked (a link is removed, never
followed; a file another name links to keeps its bytes). A link where a directory is needed is a
``ValueError`` naming it: nothing is written through it.

Where the platform lacks a call (``O_NONBLOCK`` and ``os.readv`` on Windows), the portable one
is used instead.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import FileChangedError
from ..hashing import Hasher
from .errors import FileGrewError, NotARegularFileError, ShortReadError
from .listing import kind_of, local_identity

__all__ = [
    "LocalRange",
    "create_beneath",
    "digest_small_file",
    "open_dir_beneath",
    "open_regular",
    "read_small",
    "rename_beneath",
    "unlink_beneath",
]

#: Opening never waits for a FIFO's writer, and the descriptor is not inherited by children.
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
#: A directory below a root: opened relative to the one above, never through a link.
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: A file written beneath a root: a new one, never an existing file nor a link's target.
_NEW_FILE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_HAS_READV = hasattr(os, "readv")
_HAS_PREADV = hasattr(os, "preadv")


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``path`` and its ``fstat``, judged on the
    descriptor (race-free): a FIFO, socket or device raises ``NotARegularFileError`` and is never
    read, a directory ``IsADirectoryError``."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a unix socket
            raise NotARegularFileError(f"{path} is a socket, not a regular file (never read)") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            raise NotARegularFileError(f"{path} is a {kind_of(st.st_mode)}, not a regular file (never read)")
        if OPEN_FLAGS & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def open_file(path: str) -> Any:
    """``open(path, "rb")`` for regular files only (see :func:`open_regular`)."""
    fd, _st = open_regular(path)
    return os.fdopen(fd, "rb")


def changed(path: str) -> FileChangedError:
    return FileChangedError(f"{path} changed while it was read (written to or replaced since it was listed)", (path,))


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Up to ``len(view)`` bytes at ``offset`` into ``view``; fewer only at the end of the file."""
    if _HAS_PREADV:
        return os.preadv(fd, (view,), offset)
    os.lseek(fd, offset, os.SEEK_SET)
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


class LocalRange:
    """Bytes ``[offset, offset + length)`` of a local file, pinned to ``version`` (its listed
    identity; ``None``: the identity it has when opened).

    :meth:`readinto` fills views in order; :meth:`finish`, after the last byte, confirms that the
    file ends there when the range ends at ``file_size`` (``FileGrewError`` otherwise) and that
    it is still the version read (``FileChangedError``).
    """

    def __init__(self, path: str, offset: int, length: int, *, file_size: int | None, version: object) -> None:
        self.path = path
        self._fd, st = open_regular(path)
        self._identity = local_identity(st)
        if version is not None and self._identity != version:
            os.close(self._fd)
            raise changed(path)
        self._pos = offset
        self._end = offset + length
        self._file_end = file_size if file_size is not None and file_size == self._end else None

    def readinto(self, view: memoryview) -> int:
        want = view[: max(0, self._end - self._pos)]
        if not want:
            return 0
        n = _read_into(self._fd, want, self._pos)
        self._pos += n
        return n

    def mapped(self, piece: int) -> Iterator[memoryview] | None:
        """The rest of the range, ``piece`` bytes at a time, as read-only views of a mapping of the
        file (no copy into a buffer); ``None`` where the file cannot be mapped (then read it).

        The identity is checked before each piece, so a file cut short or rewritten is seen before
        its next piece is touched, and :meth:`finish` checks it after the last. A file cut short
        while a piece is being hashed (a few milliseconds) ends the process with ``SIGBUS``, as it
        does ``b3sum``: the kernel gives a mapping no other way to say that its file shrank.
        """
        if self._pos >= self._end:
            return None
        base = self._pos - self._pos % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(self._fd, self._end - base, access=mmap.ACCESS_READ, offset=base)
        except (OSError, ValueError):  # a file system that cannot map, or a file shorter now
            return None
        return self._pieces(mapping, base, piece)

    def _pieces(self, mapping: mmap.mmap, base: int, piece: int) -> Iterator[memoryview]:
        whole = memoryview(mapping)
        try:
            while self._pos < self._end:
                self.check_version()
                n = min(piece, self._end - self._pos)
                yield whole[self._pos - base : self._pos - base + n]
                self._pos += n
        finally:
            whole.release()  # the mapping goes with the last piece still referred to

    def check_version(self) -> None:
        """``FileChangedError`` when the file is no longer the version this read is pinned to."""
        if local_identity(os.fstat(self._fd)) != self._identity:
            raise changed(self.path)

    def finish(self) -> None:
        if self._pos < self._end:
            raise ShortReadError(f"short read from {self.path}: expected {self._end} bytes, got {self._pos}")
        self.check_version()
        if self._file_end is not None:
            one = bytearray(1)
            if _read_into(self._fd, memoryview(one), self._file_end):
                raise FileGrewError(self.path, self._file_end, os.fstat(self._fd).st_size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_small(path: str, length: int, buffer: memoryview, version: object) -> memoryview:
    """The whole local file ``path`` of ``length`` bytes (``length < len(buffer)``), read into
    ``buffer`` in one call where the platform allows: one open, one ``fstat``, one read of a byte
    more than planned (a file that gives it grew), one ``fstat`` after. The same checks as
    :class:`LocalRange`, for files small enough that per-call work is what costs."""
    fd, st = open_regular(path)
    try:
        identity = local_identity(st)
        if version is not None and identity != version:
            raise changed(path)
        # Fewer bytes than asked, as many as the opened file's size, is its end; anything else
        # reads on until the end.
        want = buffer[: length + 1]
        total = os.readv(fd, (want,)) if _HAS_READV else _read_into(fd, want, 0)
        if total != length or st.st_size != length:
            while total <= length and (n := _read_into(fd, buffer[total : length + 1], total)):
                total += n
        after = os.fstat(fd)
        if local_identity(after) != identity:
            raise changed(path)
        if total > length:
            raise FileGrewError(path, length, after.st_size)
        if total < length:
            raise ShortReadError(f"short read from {path}: expected {length} bytes, got {total}")
    finally:
        os.close(fd)
    return buffer[:length]


def digest_small_file(
    path: str, length: int, version: object, hasher: Callable[[], Hasher], buffer: memoryview
) -> str | None:
    """The digest of the whole local file ``path`` of ``length`` bytes (``length < len(buffer)``),
    pinned to ``version`` (its listed identity; ``None``: as opened), or ``None`` when this quick
    read does not settle it: the caller then reads it the guarded way (:func:`read_small` through
    the retried reader), which says what is wrong.

    For a small file what costs is what holds the GIL, not the hashing (which releases it): so
    five system calls (open; ``fstat``: a regular file of the listed identity and size; one read
    of a byte more than planned; ``fstat``: still that identity; close), one hasher, and little
    other Python. The checks are :func:`read_small`'s: the identity before the first byte is used
    and after the last, and exactly the planned bytes (fewer, or the extra byte, is a file that
    changed). ``O_NONBLOCK`` is left on: regular files ignore it, and a read that does not falls back.
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError:
        return None
    data = None
    try:
        st = os.fstat(fd)
        identity = local_identity(st)
        if stat.S_ISREG(st.st_mode) and st.st_size == length and (version is None or identity == version):
            want = buffer[: length + 1]
            read = os.readv(fd, (want,)) if _HAS_READV else _read_into(fd, want, 0)
            if read == length and local_identity(os.fstat(fd)) == identity:
                data = want[:length]
    except OSError:
        pass
    finally:
        os.close(fd)
    if data is None:
        return None
    h = hasher()
    h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------- writing beneath a root


def open_dir_beneath(root: str, directory: str, made: list[str] | None = None) -> int:
    """A descriptor of ``directory`` (``root`` itself or a directory below it), each component
    below ``root`` opened relative to the one above without following a link. ``made``: missing
    directories are created, and appended to it (outermost first). A link on the way is a
    ``ValueError``, a file a ``NotADirectoryError``."""
    rel = os.path.relpath(directory, root)
    parts = [] if rel == os.curdir else rel.split(os.sep)
    if os.pardir in parts:
        raise ValueError(f"{directory} is not inside {root}")
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    path = root
    try:
        for part in parts:
            path = os.path.join(path, part)
            if made is not None:
                try:
                    os.mkdir(part, dir_fd=fd)
                    made.append(path)
                except FileExistsError:
                    pass
            if _kind(fd, part) == stat.S_IFLNK:
                raise ValueError(
                    f"{path} is a symbolic link: nothing is written through a link at or under a destination"
                )
            try:
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)  # a link swapped in meanwhile: ELOOP
            except NotADirectoryError as exc:
                raise NotADirectoryError(errno.ENOTDIR, f"{path} is a file, not a directory") from exc
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def create_beneath(root: str, path: str, made: list[str] | None = None) -> int:
    """A new, empty regular file at ``path`` below ``root``, open for writing: the directories
    above it as :func:`open_dir_beneath` (``made``), whatever entry was at ``path`` unlinked first
    (a link removed, never followed; a directory is an ``IsADirectoryError``)."""
    directory, name = os.path.split(path)
    dir_fd = open_dir_beneath(root, directory, made)
    try:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.EPERM) and _kind(dir_fd, name) == stat.S_IFDIR:
                raise IsADirectoryError(errno.EISDIR, f"{path} is a directory, not a file") from exc
            raise
        try:
            return os.open(name, _NEW_FILE_FLAGS, 0o666, dir_fd=dir_fd)
        except FileExistsError as exc:  # made again since it was unlinked: never written through
            raise OSError(errno.EEXIST, f"{path} was created by someone else while it was being written") from exc
    finally:
        os.close(dir_fd)


def unlink_beneath(root: str, path: str) -> None:
    """Remove the file (or link) ``path`` below ``root``, reached without following a link."""
    directory, name = os.path.split(path)
    dir_fd = open_dir_beneath(root, directory)
    try:
        os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def rename_beneath(src_root: str, src: str, dst_root: str, dst: str, made: list[str] | None = None) -> None:
    """Move the file ``src`` below ``src_root`` to ``dst`` below ``dst_root`` (one filesystem),
    replacing the entry there (a link is replaced, never followed); both reached without
    following a link, the directories above ``dst`` made as :func:`open_dir_beneath` does."""
    src_dir, src_name = os.path.split(src)
    dst_dir, dst_name = os.path.split(dst)
    src_fd = open_dir_beneath(src_root, src_dir)
    try:
        dst_fd = open_dir_beneath(dst_root, dst_dir, made)
        try:
            os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _kind(dir_fd: int, name: str) -> int | None:
    """The file type (``stat.S_IFMT``) of the entry ``name`` of a directory, ``None`` when absent."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None
