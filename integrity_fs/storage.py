"""The only module that talks to fsspec: resolve a URL, list files, read exact byte ranges,
write the manifest atomically, and turn backend-specific failures into ``OSError``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from . import _s3
from .hashing import READ_SIZES, StreamDigest, new_hasher
from .manifest import MANIFEST_FILENAME
from .signing import SIGNATURE_FILENAME

#: Files at the root that describe the checkpoint and are not its content.
NOT_CONTENT = (MANIFEST_FILENAME, SIGNATURE_FILENAME)
#: What :func:`write_atomic` names its temporary file at a local root (``mkstemp``: 8 random
#: characters): one left by a killed seal is not content.
_LEFT_BY_WRITE = re.compile(rf"\.(?:{'|'.join(map(re.escape, NOT_CONTENT))})\.[A-Za-z0-9_]{{8}}\.tmp")

log = logging.getLogger("integrity_fs")

#: Read size for hashing: big enough to amortise calls, small enough to stay in CPU cache.
BLOCK_SIZE = 1024 * 1024
#: Ranged-read size on object stores: each request fetches this much ahead.
REMOTE_BLOCK_SIZE = 8 * 1024 * 1024
#: Attempts for a read that fails transiently (connection reset, timeout, short read).
READ_ATTEMPTS = 3
#: Attempts on backends that already retry each request themselves (s3fs, gcsfs): ours would multiply theirs.
SELF_RETRYING_READ_ATTEMPTS = 2
_SELF_RETRYING_MODULES = ("s3fs", "gcsfs")
_RETRY_DELAY_S = 0.2
#: How often a worker waiting on an object store checks whether the call was stopped.
_STOP_POLL_S = 0.1

# Exceptions from these packages are storage failures and are re-raised as OSError.
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "requests", "urllib3")

ProgressFn = Callable[[int], None]
T = TypeVar("T")


class ShortReadError(OSError):
    """Storage delivered fewer bytes than it said the file holds."""


class NotARegularFileError(OSError):
    """A FIFO, socket or device where a file was expected: never read (it could block forever)."""


class SizeChangedError(Exception):
    """The file does not hold the planned number of bytes: ``size`` (when known) instead of ``expected``.

    Not an ``OSError``: the store answered correctly, the content is not what was sealed.
    """

    def __init__(self, path: str, expected: int, size: int | None, message: str | None = None) -> None:
        super().__init__(message or f"{path} holds {size} bytes, not {expected}")
        self.path = path
        self.expected = expected
        self.size = size


class FileGrewError(SizeChangedError):
    """The file holds more bytes than planned."""

    def __init__(self, path: str, expected: int, size: int | None) -> None:
        shown = size if size is not None else "more"
        super().__init__(path, expected, size, f"{path} holds more than {expected} bytes ({shown})")


class Cancelled(Exception):
    """The call was stopped (Ctrl-C or another worker's failure) before this read finished."""


def _is_backend_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.split(".")[0] in _BACKEND_MODULES or isinstance(exc, (FSTimeoutError, asyncio.TimeoutError))


def _storage_cause(exc: BaseException) -> BaseException | None:
    """The first storage failure in ``exc``'s chain (``__cause__``/``__context__``), if any.

    Backends wrap badly: s3fs turns a ranged-read timeout into ``IndexError`` (``ex.args[0]`` on
    an ``FSTimeoutError`` with no args), so the failure is judged by the whole chain.
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) or _is_backend_error(link):
            return link
        link = link.__cause__ or link.__context__
    return None


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Re-raise backend exceptions (botocore, gcsfs, aiohttp, ...) as ``OSError`` naming ``what``."""
    try:
        yield
    except Exception as exc:
        if type(exc).__module__ == __name__ or (isinstance(exc, OSError) and type(exc).__module__ == "builtins"):
            raise
        cause = _storage_cause(exc)
        if cause is None:
            raise
        if isinstance(cause, OSError) and type(cause).__module__ == "builtins" and cause is not exc:
            error_type: type[OSError] = type(cause)
        else:
            error_type = _os_error_type(cause)
        raise error_type(f"storage error while {what}: {type(cause).__name__}: {cause}") from exc


def _os_error_type(exc: BaseException) -> type[OSError]:
    """The closest built-in OSError subclass for a backend exception, judged by its class names."""
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    if "Timeout" in names:
        return TimeoutError
    if "Connect" in names:
        return ConnectionError
    return OSError


def resolve(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path for ``url`` (a path inside ``fs`` when ``fs`` is given)."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(f"url must be a string or os.PathLike, not {type(url).__name__}")
    text = os.fspath(url)
    if not text:
        raise ValueError("url is empty")
    if fs is None and (not isinstance(url, str) or not _is_url(text)):
        fs = fsspec.filesystem("file", **(storage_options or {}))
        root = fs._strip_protocol(text)
    elif fs is None:
        with storage_errors(f"opening {text}"):
            fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    else:
        if storage_options:
            raise ValueError("pass either fs= or storage_options=, not both")
        root = fs._strip_protocol(text)
    if is_local(fs):
        root = os.path.abspath(root)
    elif root not in ("/", ""):
        root = root.rstrip("/")
    return fs, root


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


def _is_url(text: str) -> bool:
    """Whether ``text`` names a protocol: ``s3://b/k``, or a chain such as ``simplecache::s3://b/k``.

    Anything else, ``/data/run::1`` and ``file:///data/run::1`` included, is a local path: fsspec
    would split it on ``::`` and read another directory.
    """
    match = _SCHEME.match(text)
    if match is None:
        return False
    protocol, separator = match.groups()
    if separator == "::":
        return protocol in fsspec.available_protocols()
    return protocol not in ("file", "local")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def check_root(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Raise ``FileNotFoundError`` when nothing is at ``root`` (no directory, no object under the
    prefix) and ``NotADirectoryError`` when it is a file; return when it is a directory."""
    if is_local(fs):
        if os.path.isdir(root):
            return
        is_file = os.path.exists(root)
    else:
        with storage_errors(f"checking {describe(fs, root)}"):
            fs.invalidate_cache(root)
            if fs.isdir(root):
                return
            is_file = fs.exists(root)
    if is_file:
        raise NotADirectoryError(f"{describe(fs, root)} is a file, not a checkpoint directory")
    raise FileNotFoundError(f"no checkpoint at {describe(fs, root)}: nothing exists there")


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def describe(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A URL for messages: ``s3://bucket/run`` or a plain local path."""
    return root if is_local(fs) else str(fs.unstrip_protocol(root))


#: Keys of an fsspec info dict that change when a file is rewritten, in order of preference.
_STAMP_KEYS = ("ETag", "etag", "generation", "mtime", "LastModified", "updated", "last_modified", "created")


def _stamp(info: dict[str, Any]) -> str:
    return next((str(info[key]) for key in _STAMP_KEYS if info.get(key) is not None), "")


def list_files(
    fs: fsspec.AbstractFileSystem,
    root: str,
    *,
    stamps: dict[str, str] | None = None,
    identities: dict[str, LocalIdentity] | None = None,
) -> dict[str, int]:
    """Every file under ``root``: POSIX name relative to root -> size in bytes, sorted.

    The root's manifest and signature are left out. On local disks, symlinks are never followed out of the
    root: a link whose target lies outside is skipped (and logged), and linked directories
    are not descended. ``stamps``, when given, receives each file's version stamp from the same
    listing: its modification time, ETag or generation (whichever the backend lists; ``""``
    when none), which changes when the file is rewritten. ``identities`` (local disks only;
    left empty elsewhere) receives each file's :func:`local_identity`, for :func:`changed_local_files`.
    FIFOs, sockets and devices are skipped with a warning. On object stores the listing comes
    from the store, never from a cache, and folder markers (zero-byte keys ending in ``/``) are
    directories, not files.
    """
    if is_local(fs):
        return _list_local(root, stamps, identities)
    with storage_errors(f"listing {describe(fs, root)}"):
        forget_cached(fs, root)
        found = fs.find(root, detail=True, withdirs=False)
        if not found and not fs.isdir(root):
            if fs.exists(root):
                raise NotADirectoryError(f"{describe(fs, root)} is a file, not a checkpoint directory")
            raise FileNotFoundError(f"no checkpoint directory at {describe(fs, root)}")
    prefix = root.rstrip("/") + "/"
    out: dict[str, int] = {}
    for path, info in found.items():
        if info.get("type", "file") != "file" or not path.startswith(prefix):
            continue
        name = path[len(prefix) :]
        if name and name not in NOT_CONTENT and not _is_folder_marker(name, info):
            out[name] = int(info["size"])
            if stamps is not None:
                stamps[name] = _stamp(info)
    return dict(sorted(out.items()))


def _is_folder_marker(name: str, info: dict[str, Any]) -> bool:
    key = str(info.get("Key", info.get("name", name)))
    return int(info.get("size") or 0) == 0 and (name.endswith("/") or key.endswith("/"))


def forget_cached(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Drop every cached listing of ``root``, its parents and everything under it.

    ``invalidate_cache(root)`` alone clears the root and its parents (s3fs, gcsfs), so a
    subdirectory listed earlier in the process would still be served from memory.
    """
    if isinstance(fs, DirFileSystem):
        forget_cached(fs.fs, fs._join(root))
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache:
        below = root.rstrip("/") + "/"
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(below)]:
            cache.pop(key, None)


#: What tells a local file's content apart over time without reading it: the hash of its device,
#: inode, size, and modification and change times in nanoseconds (ctime moves even when a writer
#: puts mtime back). One int, not the tuple: 100,000 files hold ~10 MB less while they are sealed.
LocalIdentity = int


def local_identity(st: os.stat_result) -> LocalIdentity:
    return hash((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def changed_local_files(root: str, identities: dict[str, LocalIdentity]) -> list[str]:
    """The names of ``identities`` whose file under ``root`` is gone, replaced or written to
    since it was listed (one ``stat`` each), sorted.

    Timestamps move in clock ticks (a few ms on Linux): a write in the same tick as the
    listing's ``stat`` may go unseen; any later one is seen.
    """
    prefix = root.rstrip("/") + "/"
    changed = []
    for name, before in identities.items():
        try:
            now: LocalIdentity | None = local_identity(os.stat(prefix + name))
        except OSError:
            now = None
        if now != before:
            changed.append(name)
    return sorted(changed)


def _list_local(
    root: str, stamps: dict[str, str] | None = None, identities: dict[str, LocalIdentity] | None = None
) -> dict[str, int]:
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise NotADirectoryError(f"{root} is a file, not a checkpoint directory")
        raise FileNotFoundError(f"no checkpoint directory at {root}")
    real_root = os.path.realpath(root)
    out: dict[str, int] = {}
    # One scandir per directory and one lstat per file (what os.walk + stat costs, less a stat).
    todo = [(root, "")]
    is_regular = stat.S_ISREG
    while todo:
        directory, prefix = todo.pop()
        try:
            listed = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            if not prefix:
                raise
            continue  # a subdirectory removed (or replaced) since its parent was read: not there
        with listed as entries:
            for entry in entries:
                link = entry.is_symlink()
                if link:
                    try:
                        if entry.is_dir():  # linked directories are never descended
                            continue
                    except OSError:
                        pass
                elif entry.is_dir():  # not a link: nothing to follow
                    todo.append((entry.path, f"{prefix}{entry.name}/"))
                    continue
                name = prefix + entry.name
                if not prefix and (name in NOT_CONTENT or (name[0] == "." and _LEFT_BY_WRITE.fullmatch(name))):
                    if name not in NOT_CONTENT:
                        log.warning("skipping %s: left by an interrupted write of the manifest (delete it)", name)
                    continue
                try:
                    if link:
                        target = os.path.realpath(entry.path)
                        if os.path.commonpath([real_root, target]) != real_root:
                            log.warning("skipping %s: symlink to %s leaves the checkpoint root", name, target)
                            continue
                        if not os.path.isfile(target):
                            continue
                        st = os.stat(entry.path)
                    else:
                        st = entry.stat()  # not a link: its lstat, cached by scandir where the OS gives it
                except FileNotFoundError:
                    continue  # removed since the directory was read: not there (if listed, "missing")
                if not is_regular(st.st_mode):
                    log.warning("skipping %s: a %s, not a regular file (never opened)", name, _kind(st.st_mode))
                    continue
                out[name] = st.st_size
                if stamps is not None:
                    stamps[name] = str(st.st_mtime)  # as fsspec's LocalFileSystem lists it
                if identities is not None:
                    identities[name] = local_identity(st)
    names = sorted(out)
    return dict(zip(names, map(out.__getitem__, names), strict=True))


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def read_file(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """Whole small file (the manifest). ``FileNotFoundError`` passes through as is; a local
    FIFO, socket or device raises ``NotARegularFileError`` without blocking."""
    if is_local(fs):
        with _open_local(path) as f:
            return bytes(f.read())
    with storage_errors(f"reading {path}"):
        return bytes(fs.cat_file(path))


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether anything is at ``path`` (a dangling link too), asked of the store, not of a cache."""
    if is_local(fs):
        return os.path.lexists(path)
    with storage_errors(f"checking {path}"):
        fs.invalidate_cache(path)
        return bool(fs.exists(path))


def _open_local(path: str) -> Any:
    """``open(path, "rb")`` for regular files only, judged on the opened descriptor (race-free);
    ``O_NONBLOCK`` so that opening a FIFO cannot wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a unix socket
            raise NotARegularFileError(f"{path} is a socket, not a regular file (never read)") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(f"{path} is a {_kind(mode)}, not a regular file (never read)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old bytes or the new, never a part.

    Local: a temporary file in the same directory, fsynced, then ``os.replace``. Object stores:
    one PUT, which they apply atomically.
    """
    if is_local(fs):
        directory = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: readable by whoever can read the rest
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


def open_read(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A binary reader for ``path`` tuned for sequential streaming (readahead on object stores).

    Local: regular files only (``NotARegularFileError`` otherwise), never blocking on a FIFO.
    """
    if is_local(fs):
        return _open_local(path)
    try:
        return fs.open(path, "rb", block_size=REMOTE_BLOCK_SIZE, cache_type="readahead")
    except TypeError:  # a backend whose open() takes no cache options
        return fs.open(path, "rb")


def hash_range(
    fs: fsspec.AbstractFileSystem,
    path: str,
    algorithm: str,
    offset: int,
    length: int,
    progress: ProgressFn | None = None,
    *,
    file_size: int | None = None,
    stop: threading.Event | None = None,
    buffer: memoryview | None = None,
) -> str:
    """Digest of exactly ``length`` bytes of ``path`` from ``offset``, in bounded memory.

    Fewer bytes than asked for is a ``ShortReadError``. When the range ends at ``file_size``,
    the read confirms that the file ends there too: more bytes raise ``FileGrewError``.
    Transient failures are retried (``READ_ATTEMPTS`` times, or ``SELF_RETRYING_READ_ATTEMPTS``
    on backends that retry each request themselves); a missing file or a refused permission is
    raised at once. Once ``stop`` is set, the read ends at the next block with ``Cancelled``.
    ``buffer`` (writable, reused by the caller's thread): a whole local file shorter than it is
    read into it in one call, for files small enough that per-call work is what costs.
    """
    check_end = file_size is not None and offset + length == file_size
    # A whole local file that fits in ``buffer``: one open, one fstat, one read of a byte more
    # than planned, no file object (see ``_hash_whole_local``). Retries take the general path.
    fast = buffer is not None and offset == 0 and check_end and length < len(buffer) and is_local(fs)
    counted = [0]  # bytes reported to ``progress`` by the attempt under way

    def once(attempt: int) -> str:
        counted[0] = 0
        if fast and attempt == 1:
            assert buffer is not None
            digest = _hash_whole_local(path, algorithm, length, buffer)
            if progress is not None:
                progress(length)
            return digest
        return _hash_once(fs, path, algorithm, offset, length, progress, counted, check_end, stop)

    def undo() -> None:
        if progress is not None and counted[0]:
            progress(-counted[0])

    def shorter_now(exc: OSError) -> None:
        if isinstance(exc, ShortReadError) or exc.errno == errno.EINVAL:  # short, or a range past the end
            now = _shorter_now(fs, path, offset + length)
            if now is not None:  # the store says the file is shorter now: content, not storage
                raise SizeChangedError(path, offset + length, now) from exc

    attempts = READ_ATTEMPTS if fast else _read_attempts(fs)
    return _retried(fs, path, f"reading {path}", attempts, once, undo=undo, stop=stop, check=shorter_now)


def _retried(
    fs: fsspec.AbstractFileSystem,
    path: str,
    what: str,
    attempts: int,
    once: Callable[[int], T],
    *,
    undo: Callable[[], None],
    stop: threading.Event | None,
    check: Callable[[OSError], None] | None = None,
) -> T:
    """``once(attempt)`` until it returns, ``attempts`` times at most: the retry loop of reads and copies.

    A missing file, a refused permission and what is not a regular file are raised at once. Any
    other ``OSError`` (backend errors included, through :func:`storage_errors`) undoes the
    attempt's progress and goes through ``check``, which may raise something else instead (a file
    the store says is shorter now is content, not storage); then it is retried after a back-off
    that ``stop`` cuts short (``Cancelled``), with the cached listing of ``path`` dropped so that
    the retry asks the store again. The last failure is raised with the count.
    """
    for attempt in range(1, attempts + 1):
        _check_stop(stop)
        try:
            with storage_errors(what):
                return once(attempt)
        except _NOT_RETRIED:
            raise
        except OSError as exc:
            undo()
            if check is not None:
                check(exc)
            if attempt == attempts:
                raise type(exc)(f"{what} failed {attempts} times: {exc}") from exc
            log.info("retrying %s after %s (attempt %d of %d)", what, exc, attempt, attempts)
            if stop is None:
                time.sleep(_RETRY_DELAY_S * attempt)
            elif stop.wait(_RETRY_DELAY_S * attempt):
                raise Cancelled("stopped") from exc
            with contextlib.suppress(Exception):
                fs.invalidate_cache(path)
    raise AssertionError("unreachable")


def _hash_whole_local(path: str, algorithm: str, length: int, buffer: memoryview) -> str:
    """Digest of the local regular file ``path`` of ``length`` bytes (``length < len(buffer)``),
    read into ``buffer``; the same checks as ``_open_local`` and ``_confirm_end``, fewer calls."""
    try:
        fd = os.open(path, _FAST_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a unix socket
            raise NotARegularFileError(f"{path} is a socket, not a regular file (never read)") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            raise NotARegularFileError(f"{path} is a {_kind(st.st_mode)}, not a regular file (never read)")
        # Ask for a byte more than planned: a file that gives it grew. Fewer bytes than asked, as
        # many as the opened file's size, is its end; anything else reads on until the end.
        total = os.readv(fd, (buffer[: length + 1],))
        if total != length or st.st_size != length:
            while total <= length and (n := os.readv(fd, (buffer[total : length + 1],))):
                total += n
        if total > length:
            raise FileGrewError(path, length, os.fstat(fd).st_size)
        if total < length:
            raise ShortReadError(f"short read from {path}: expected {length} bytes, got {total}")
    finally:
        os.close(fd)
    hasher = new_hasher(algorithm)
    hasher.update(buffer[:length])
    return hasher.hexdigest()


_FAST_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _read_attempts(fs: fsspec.AbstractFileSystem) -> int:
    modules = {(cls.__module__ or "").split(".")[0] for cls in type(_innermost(fs)).__mro__}
    return SELF_RETRYING_READ_ATTEMPTS if modules & set(_SELF_RETRYING_MODULES) else READ_ATTEMPTS


def _innermost(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    while isinstance(fs, DirFileSystem):
        fs = fs.fs
    return fs


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Cancelled("stopped")


def _hash_once(
    fs: fsspec.AbstractFileSystem,
    path: str,
    algorithm: str,
    offset: int,
    length: int,
    progress: ProgressFn | None,
    counter: list[int],
    check_end: bool,
    stop: threading.Event | None,
) -> str:
    digest = _hash_streamed(fs, path, algorithm, offset, length, progress, counter, check_end, stop)
    if digest is not None:
        return digest
    hasher = new_hasher(algorithm)
    buf = memoryview(bytearray(max(1, min(READ_SIZES.get(algorithm, BLOCK_SIZE), length))))
    with open_read(fs, path) as f:
        if offset:
            f.seek(offset)
        readinto = getattr(f, "readinto", None)
        remaining = length
        while remaining:
            _check_stop(stop)
            want = buf[: min(remaining, len(buf))]
            if readinto is not None:
                n = readinto(want)
            else:
                data = f.read(len(want))
                n = len(data)
                want[:n] = data
            if not n:
                raise ShortReadError(
                    f"short read from {path}: expected {length} bytes from offset {offset}, got {length - remaining}"
                )
            hasher.update(want[:n])
            remaining -= n
            counter[0] += n
            if progress is not None:
                progress(n)
        if check_end:
            _confirm_end(fs, path, f, offset + length)
    return hasher.hexdigest()


def _confirm_end(fs: fsspec.AbstractFileSystem, path: str, f: Any, end: int) -> None:
    """Raise ``FileGrewError`` when the open file ``f`` holds more than ``end`` bytes.

    One more byte is asked for; a buffered object-store file stops at the size it was opened
    with, so there the store is asked for the size now.
    """
    if f.read(1):
        size: int | None
        try:
            size = os.fstat(f.fileno()).st_size if is_local(fs) else _fresh_size(fs, path)
        except Exception:
            size = None
        raise FileGrewError(path, end, size)
    if isinstance(f, AbstractBufferedFile):
        size = _fresh_size(fs, path)
        if size > end:
            raise FileGrewError(path, end, size)


def _shorter_now(fs: fsspec.AbstractFileSystem, path: str, end: int) -> int | None:
    """The size of ``path`` now when the store says it ends before ``end``; ``None`` when it does
    not, or cannot say (then a short read stays a storage failure, and is retried)."""
    try:
        size = os.stat(path).st_size if is_local(fs) else _fresh_size(fs, path)
    except Exception:
        return None
    return size if size < end else None


def _fresh_size(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """The size of ``path`` as the store says now, not as a listing cached it."""
    inner = _innermost(fs)
    if _s3.is_s3(inner):
        while isinstance(fs, DirFileSystem):
            path = fs._join(path)
            fs = fs.fs
        return int(sync(fs.loop, _s3.head_size, fs, path))  # a HEAD; the listing cache stays for the others
    forget_cached(fs, path)
    return int(fs.size(path))


def _stream_target(fs: fsspec.AbstractFileSystem, path: str) -> tuple[AsyncFileSystem, str] | None:
    """The async filesystem and path to stream ``path`` from (through any ``DirFileSystem``),
    or ``None`` for a filesystem that is not async."""
    while isinstance(fs, DirFileSystem):
        path = fs._join(path)
        fs = fs.fs
    if not getattr(fs, "async_impl", False) or not isinstance(fs, AsyncFileSystem):
        return None
    return fs, path


def _on_loop(fs: AsyncFileSystem, coro: Coroutine[Any, Any, T], stop: threading.Event | None) -> T:
    """Run ``coro`` on ``fs``'s event loop and wait for it; once ``stop`` is set, cancel it
    there (within ``_STOP_POLL_S``) and raise ``Cancelled``: a stalled request never holds a worker."""
    future = asyncio.run_coroutine_threadsafe(coro, fs.loop)
    while True:
        try:
            return future.result(timeout=_STOP_POLL_S)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise
            if stop is not None and stop.is_set():
                future.cancel()
                raise Cancelled("stopped") from None
        except BaseException:  # Ctrl-C in this thread: the request must not go on without it
            future.cancel()
            raise


async def _read_block(f: Any, n: int) -> bytes:
    """``n`` bytes from the async stream ``f``, fewer only at its end."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = await f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


async def _open_stream(fs: AsyncFileSystem, path: str, offset: int, length: int) -> Any:
    """A stream of ``length`` bytes of ``path`` from ``offset``: on S3 one ranged GET (reading
    no further than the range; a HEAD for an empty file), elsewhere ``open_async`` from the start of the file.
    ``NotImplementedError`` when the backend cannot stream that."""
    if _s3.is_s3(fs):
        return await _s3.RangeStream(fs, path, offset, offset + length).open()
    if offset:
        raise NotImplementedError("only S3 streams from an offset")
    return await fs.open_async(path, "rb")


async def _close_stream(f: Any) -> None:
    """Close on the loop that owns it: s3fs's ``close()`` leaves the response body open (a chunk
    stops early), and the body belongs to the event loop, not to the worker thread."""
    with contextlib.suppress(Exception):
        await f.close()
    body = getattr(f, "r", None)
    if body is not None:
        with contextlib.suppress(Exception):
            body.close()


def _hash_streamed(
    fs: fsspec.AbstractFileSystem,
    path: str,
    algorithm: str,
    offset: int,
    length: int,
    progress: ProgressFn | None,
    counter: list[int],
    check_end: bool,
    stop: threading.Event | None,
) -> str | None:
    """Digest of ``length`` bytes of ``path`` from ``offset``, from one streamed GET (a ranged
    GET on S3, ``open_async`` from the start elsewhere), hashed in this thread ``BLOCK_SIZE`` at
    a time; ``None`` when the backend cannot stream that.

    One request per unit, and no cache: ranged reads through ``fs.open`` cost a request per
    ``REMOTE_BLOCK_SIZE`` and hold a block or two per worker. With ``check_end`` the file must
    end right after those bytes (the size the store answered with, or one byte more read).
    """
    target = _stream_target(fs, path)
    if target is None:
        return None
    afs, apath = target
    try:
        f = _on_loop(afs, _open_stream(afs, apath, offset, length), stop)
    except NotImplementedError:
        return None
    hasher = new_hasher(algorithm)
    try:
        remaining = length
        while remaining:
            _check_stop(stop)
            data = _on_loop(afs, _read_block(f, min(BLOCK_SIZE, remaining)), stop)
            if not data:
                raise ShortReadError(f"short read from {path}: expected {length} bytes, got {length - remaining}")
            hasher.update(data)
            remaining -= len(data)
            counter[0] += len(data)
            if progress is not None:
                progress(len(data))
        total = getattr(f, "total_size", None)
        if check_end and isinstance(total, int):
            if total > offset + length:
                raise FileGrewError(path, offset + length, total)
        elif check_end and _on_loop(afs, _read_block(f, 1), stop):
            size = getattr(f, "size", None)
            raise FileGrewError(path, offset + length, int(size) if isinstance(size, int) else None)
    finally:
        with contextlib.suppress(Exception):
            _on_loop(afs, _close_stream(f), None)
    return hasher.hexdigest()


# --- store-kept checksums (S3) -------------------------------------------------------------------


def store_checksums(fs: fsspec.AbstractFileSystem, paths: list[str]) -> dict[str, _s3.StoreChecksum | None]:
    """The SHA-256 the store itself keeps for each path, read without reading content.

    Only S3 keeps SHA-256 checksums; on any other filesystem every value is ``None``.
    """
    if not _s3.is_s3(fs):
        return dict.fromkeys(paths)
    with storage_errors(f"reading the checksums of {len(paths)} objects"):
        return _s3.store_checksums(fs, paths)


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
                self._part_size = _s3.part_layout(granularity, chunk_size, size)
            elif growing:
                self._part_size = 0  # one PUT, until the file outgrows it
        self._buffer = bytearray()
        self._upload: _s3.ChecksummedUpload | None = None
        self._stream: Any = None
        self._fs = fs
        self._single_limit = chunk_size if granularity == "chunk" and chunk_size else _s3.SINGLE_PUT_LIMIT
        self._grow_into: int | None = None  # the part size a growing file goes on with past one PUT
        if growing and granularity == "chunk" and chunk_size:
            self._single_limit = min(chunk_size, _s3.MAX_PART)
            if _s3.MIN_PART <= chunk_size <= _s3.MAX_PART:
                self._grow_into = chunk_size
        if self._part_size is not None:
            self._upload = _s3.ChecksummedUpload(fs, path)
        else:
            if is_local(fs):
                make_local_parent(path)
            self._stream = fs.open(path, "wb")

    @staticmethod
    def carries_checksums(fs: fsspec.AbstractFileSystem, algorithm: str) -> bool:
        """True when writes to ``fs`` go up with the store's checksums (S3, SHA-256)."""
        return algorithm == "sha256" and _s3.is_s3(fs)

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
            while len(self._buffer) >= self._part_size and len(self._upload._parts) < _s3.MAX_PARTS - 1:
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


def list_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Names of the immediate subdirectories of ``root``, sorted: one fresh listing, nothing read.

    A root that does not exist (no directory; no object under the prefix) raises
    ``FileNotFoundError``, a root that is a file ``NotADirectoryError``. On object stores, zero-byte
    keys ending in ``/`` (folder markers) are directories.
    """
    if is_local(fs):
        if not os.path.isdir(root):
            if os.path.exists(root):
                raise NotADirectoryError(f"{root} is a file, not a directory")
            raise FileNotFoundError(f"no directory at {root}")
        with os.scandir(root) as entries:
            return sorted(entry.name for entry in entries if entry.is_dir())
    where = describe(fs, root)
    with storage_errors(f"listing {where}"):
        fs.invalidate_cache(root)
        try:
            entries = fs.ls(root, detail=True)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no directory at {where}") from exc
    names = set()
    for info in entries:
        path = str(info["name"])
        is_dir = info.get("type") == "directory" or (path.endswith("/") and not info.get("size"))
        path = path.rstrip("/")
        if path == root.rstrip("/"):
            if not is_dir:
                raise NotADirectoryError(f"{where} is a file, not a directory")
            continue
        if is_dir:
            names.add(path.rsplit("/", 1)[-1])
    return sorted(names)


# --------------------------------------------------------------------------- writing (transfer)


def local_filesystem() -> fsspec.AbstractFileSystem:
    """The local filesystem, for modules that must not import fsspec."""
    return fsspec.filesystem("file")


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete one file; one that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError), storage_errors(f"deleting {path}"):
        fs.rm_file(path)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create the directory ``path`` and its parents where the filesystem has directories."""
    with storage_errors(f"creating {path}"):
        fs.makedirs(path, exist_ok=True)


# --------------------------------------------------------------------------- copying (transfer)

#: Failures that another attempt cannot mend: raised at once.
_NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, NotARegularFileError)


class _Vanished(Exception):
    """The source is gone (or is no longer a regular file): not a storage failure, not retried."""


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
    stop: threading.Event | None = None,
) -> tuple[str, ...] | None:
    """Copy exactly ``length`` bytes of ``path`` to ``dst_path`` through a :class:`SealingWriter`;
    the unit digests of what was written, or ``None`` when ``path`` vanished (or is no longer a
    regular file).

    The read keeps the rules of :func:`hash_range`: the source must end right after ``length``
    bytes (``SizeChangedError`` with the size it has now, when longer or shorter: never more
    bytes read than one past ``length``); streamed object-store reads are cancelled on the loop
    once ``stop`` is set (``Cancelled``), and the stop flag is checked between blocks; transient
    failures are retried as reads are (the writer is aborted and the file sent again), a refused
    permission is raised at once. Whatever fails, nothing half-written is committed.
    """
    what = f"copying {describe(fs, path)} to {describe(dst_fs, dst_path)}"
    sent = [0]  # bytes sent (and reported to ``progress``) by the attempt under way

    def once(attempt: int) -> tuple[str, ...]:
        sent[0] = 0
        return _copy_once(fs, path, dst_fs, dst_path, length, algorithm, granularity, chunk_size, progress, sent, stop)

    def undo() -> None:
        progress(-sent[0])

    attempts = min(_read_attempts(fs), _read_attempts(dst_fs))
    try:
        return _retried(fs, path, what, attempts, once, undo=undo, stop=stop)
    except _Vanished:
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
    stop: threading.Event | None,
) -> tuple[str, ...]:
    with _SourceReader(fs, path, length, stop) as source:
        writer = SealingWriter(
            dst_fs, dst_path, algorithm=algorithm, granularity=granularity, chunk_size=chunk_size, size=length
        )
        try:
            while sent[0] < length:
                _check_stop(stop)
                block = source.read(min(BLOCK_SIZE, length - sent[0]))
                if not block:
                    source.short(length, sent[0])
                writer.write(block)
                sent[0] += len(block)
                progress(len(block))
            source.confirm_end(length)
            _check_stop(stop)
            return writer.close()
        except BaseException:
            writer.abort()
            raise


class _SourceReader:
    """Sequential reads of the first ``length`` bytes of one source file: one streamed GET on async
    object stores (ranged on S3; each read cancellable on the loop), ``open_read`` elsewhere. A
    source that is gone raises ``_Vanished``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, length: int, stop: threading.Event | None) -> None:
        self.fs, self.path, self.stop = fs, path, stop
        self._async: AsyncFileSystem | None = None
        self._file: Any = None
        target = _stream_target(fs, path)
        with self._gone_is_vanished():
            if target is not None:
                afs, apath = target
                with contextlib.suppress(NotImplementedError):
                    self._file = _on_loop(afs, _open_stream(afs, apath, 0, length), stop)
                    self._async = afs
            if self._file is None:
                self._file = open_read(fs, path)

    def __enter__(self) -> _SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._async is not None:
            with contextlib.suppress(Exception):
                _on_loop(self._async, _close_stream(self._file), None)
        else:
            with contextlib.suppress(Exception):
                self._file.close()

    @contextlib.contextmanager
    def _gone_is_vanished(self) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, NotARegularFileError) as exc:
            raise _Vanished(self.path) from exc

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only at the end of the file."""
        with self._gone_is_vanished():
            if self._async is not None:
                return _on_loop(self._async, _read_block(self._file, n), self.stop)
            return bytes(self._file.read(n))

    def size_now(self) -> int:
        """The size of the source as the store (or the open descriptor) says now."""
        with self._gone_is_vanished():
            if is_local(self.fs):
                return os.fstat(self._file.fileno()).st_size
            return _fresh_size(self.fs, self.path)

    def short(self, length: int, got: int) -> None:
        """The source ended after ``got`` of ``length`` bytes: ``SizeChangedError`` when it is
        shorter now, else a ``ShortReadError`` (transient: retried)."""
        size = self.size_now()
        if size != length:
            raise SizeChangedError(self.path, length, size)
        raise ShortReadError(f"short read from {self.path}: expected {length} bytes, got {got}")

    def confirm_end(self, end: int) -> None:
        """``FileGrewError`` when the source holds more than ``end`` bytes (one more byte is asked
        for; a buffered object-store file stops at the size it was opened with, so there the
        store is asked for the size now)."""
        if self._async is None:
            with self._gone_is_vanished():
                _confirm_end(self.fs, self.path, self._file, end)
            return
        total = getattr(self._file, "total_size", None)  # a ranged GET: the size the store answered with
        if isinstance(total, int):
            if total > end:
                raise FileGrewError(self.path, end, total)
        elif self.read(1):
            size = getattr(self._file, "size", None)
            raise FileGrewError(self.path, end, int(size) if isinstance(size, int) else None)
