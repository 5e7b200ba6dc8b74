"""The one pinned reader: every byte of content that integrity_fs hashes, copies or serves is read
by :func:`read_blocks`, pinned to the version its listing saw.

S3 requests carry ``IfMatch`` with the listed ETag, GCS requests ``ifGenerationMatch`` with the
listed generation; a local file's identity is checked on the open descriptor before its first
byte is used and after its last; other backends compare a fresh stamp after the range. Whatever a
read finds that differs from the listing (another version, a file gone, shorter, turned into a
folder) raises ``FileChangedError``: the file changed after it was listed. Requests are retried
by the stores' own libraries (botocore and s3fs, gcsfs); a stop (Ctrl-C, another worker's
failure) ends a read within one block.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import stat
import threading
from collections.abc import Coroutine, Generator, Iterator
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem

from ..errors import FileChangedError
from ..hashing import new_hasher
from .errors import Cancelled, NotARegularFileError, precondition_failed, storage_errors
from .listing import UNKNOWN, _remote_stat, forget, identity
from .s3 import split as s3_key
from .urls import describe, is_gcs, is_local, is_s3

__all__ = ["BLOCK", "hash_range", "on_loop", "open_regular", "read_blocks", "read_file"]

BLOCK = 1024 * 1024
#: Bytes per request on object stores.
REMOTE_BLOCK = 8 * 1024 * 1024
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
T = TypeVar("T")


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``path`` (opened without waiting for a FIFO's writer) and
    its ``fstat``; ``NotARegularFileError`` for anything else, which is never read."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _special(path, "socket") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
        raise _special(path, kind)
    os.set_blocking(fd, True)
    return fd, st


def _special(path: str, kind: str) -> NotARegularFileError:
    error = NotARegularFileError(f"{path} is a {kind}, not a regular file (never read)")
    error.kind = kind
    return error


def read_file(fs: Any, path: str) -> bytes:
    """A whole small file (a manifest, a signature); ``FileNotFoundError`` passes as it is."""
    if is_local(fs):
        fd, _ = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            return f.read()
    with storage_errors(f"reading {describe(fs, path)}"):
        forget(fs, path)
        return bytes(fs.cat_file(path))


def on_loop(fs: Any, coro: Coroutine[Any, Any, T], stop: threading.Event | None) -> T:
    """Run ``coro`` on ``fs``'s event loop; once ``stop`` is set, cancel it there and raise
    ``Cancelled`` when it has ended (a second at most): no request outlives the call."""
    ended = threading.Event()

    async def guarded() -> T:
        try:
            return await coro
        finally:
            ended.set()

    future = asyncio.run_coroutine_threadsafe(guarded(), fs.loop)
    while True:
        try:
            return future.result(timeout=0.1)
        except concurrent.futures.TimeoutError:
            if stop is not None and stop.is_set():
                future.cancel()
                ended.wait(1)
                raise Cancelled("stopped") from None
        except BaseException:
            future.cancel()
            ended.wait(1)
            raise


def _changed(fs: Any, path: str, why: str) -> FileChangedError:
    return FileChangedError(f"{describe(fs, path)} changed while it was read ({why})", (path,))


async def _s3_open(fs: Any, path: str, start: int, end: int, etag: str | None) -> Any:
    """The body of one ranged GET of ``[start, end)``, pinned to ``etag`` (the request retried by s3fs)."""
    bucket, key = s3_key(fs, path)
    pin = {"IfMatch": etag} if etag else {}
    out = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **pin)
    return out["Body"]


async def _take(body: Any, n: int) -> bytes:
    """``n`` bytes of a streamed body, fewer only where it ends."""
    parts, got = [], 0
    while got < n:
        part = await body.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _close(body: Any) -> None:
    body.close()


def _s3_blocks(
    fs: Any, path: str, offset: int, length: int, pin: str | None, stop: Any
) -> Generator[bytes, None, None]:
    """``[offset, offset + length)`` of an S3 object, from one ranged GET streamed in pieces."""
    if not length:
        return
    body = on_loop(fs, _s3_open(fs, path, offset, offset + length, pin), stop)
    try:
        done = 0
        while done < length:
            data = on_loop(fs, _take(body, min(4 * BLOCK, length - done)), stop)
            if not data:
                return
            yield data
            done += len(data)
    finally:
        with contextlib.suppress(Exception):
            on_loop(fs, _close(body), None)


async def _gcs_get(fs: Any, path: str, start: int, end: int, generation: str | None) -> bytes:
    pin = {"ifGenerationMatch": generation} if generation else {}
    _, data = await fs._call("GET", fs.url(path), headers={"Range": f"bytes={start}-{end - 1}"}, **pin)
    return bytes(data)


def read_blocks(
    fs: Any,
    path: str,
    offset: int,
    length: int,
    *,
    version: str | int | None,
    stop: threading.Event | None = None,
    into: memoryview | None = None,
) -> Generator[memoryview, None, None]:
    """The bytes ``[offset, offset + length)`` of ``path``, in pieces, pinned to ``version`` (``None``:
    nothing to pin to, a read through a cache; the bytes are hashed as served). ``into`` (writable,
    ``length`` bytes) receives them in place; otherwise a piece is valid until the next one."""
    if is_local(fs):
        yield from _local_blocks(path, offset, length, version, stop, into)
        return
    pin = str(version) if version is not None else None
    if pin is not None and pin.startswith(UNKNOWN) and (is_s3(fs) or is_gcs(fs)):
        pin = None  # nothing the store could match: checked by size after the read instead
    size = REMOTE_BLOCK
    done = 0
    streamed: Generator[bytes, None, None] | None = (
        _s3_blocks(fs, path, offset, length, pin, stop) if is_s3(fs) else None
    )
    try:
        with storage_errors(f"reading {describe(fs, path)}"):
            while done < length:
                if stop is not None and stop.is_set():
                    raise Cancelled("stopped")
                start, end = offset + done, offset + min(length, done + size)
                try:
                    if streamed is not None:
                        data = next(streamed, b"")
                        end = start + len(data) if data else end  # pieces as they arrive; none: cut short
                    elif is_gcs(fs):
                        data = on_loop(fs, _gcs_get(fs, path, start, end, pin), stop)
                    elif isinstance(fs, AsyncFileSystem) and fs.async_impl:  # not a cache (it passes attributes on)
                        data = bytes(
                            on_loop(fs, fs._cat_file(path, start=start, end=end), stop)
                        )  # a stall is cancelled
                    else:
                        data = bytes(fs.cat_file(path, start=start, end=end))
                except FileNotFoundError as exc:
                    raise _changed(fs, path, "it is gone") from exc
                except Exception as exc:  # gcsfs before 2024.12 raises its 412 as a plain HttpError
                    if pin and precondition_failed(exc):
                        raise _changed(fs, path, f"the store holds another version than {pin}") from exc
                    raise
                if len(data) != end - start:
                    raise _changed(fs, path, f"{len(data)} bytes at {start} where the listing promised {end - start}")
                if into is not None:
                    into[done : done + len(data)] = data
                    yield into[done : done + len(data)]
                else:
                    yield memoryview(data)
                done += len(data)
            if pin and not is_s3(fs) and not is_gcs(fs):  # pinned by the store itself on S3 and GCS
                forget(fs, path)
                now = _remote_stat(fs, fs.info(path)).version
                if now != version:
                    raise _changed(fs, path, f"listed as {version}, now {now}")
    finally:  # the store's stream let go at once, also when the reader stops part-way
        if streamed is not None:
            streamed.close()


def _local_blocks(
    path: str, offset: int, length: int, version: Any, stop: threading.Event | None, into: memoryview | None
) -> Iterator[memoryview]:
    try:
        fd, st = open_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, NotARegularFileError) as exc:
        raise FileChangedError(f"{path} changed while it was read (it is gone, or no longer a file)", (path,)) from exc
    try:
        pinned = identity(st)
        if version is not None and pinned != version:
            raise FileChangedError(
                f"{path} changed while it was read (written to or replaced since it was listed)", (path,)
            )
        buffer = into if into is not None else memoryview(bytearray(min(BLOCK, max(1, length))))
        done = 0
        while done < length:
            if stop is not None and stop.is_set():
                raise Cancelled("stopped")
            view = into[done : done + 4 * BLOCK] if into is not None else buffer[: min(BLOCK, length - done)]
            n = _pread_into(fd, view, offset + done)
            if n == 0:
                raise FileChangedError(f"{path} changed while it was read (it ends before {offset + length})", (path,))
            yield view[:n]
            done += n
        if identity(os.fstat(fd)) != pinned:
            raise FileChangedError(f"{path} changed while it was read (written to while it was read)", (path,))
    finally:
        os.close(fd)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes of ``fd`` at ``offset`` read into ``view``; their count (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, (view,), offset)
    data = os.pread(fd, len(view), offset) if hasattr(os, "pread") else _seek_read(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def _seek_read(fd: int, n: int, offset: int) -> bytes:  # Windows: no pread
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


def hash_range(  # noqa: PLR0913  # where, what, how: each read's own
    fs: Any,
    path: str,
    offset: int,
    length: int,
    algorithm: str,
    *,
    version: str | int | None,
    stop: threading.Event | None = None,
    into: memoryview | None = None,
    progress: Any = None,
) -> str:
    """The digest of ``[offset, offset + length)`` of ``path``, read once by :func:`read_blocks`."""
    hasher = new_hasher(algorithm)
    with contextlib.closing(read_blocks(fs, path, offset, length, version=version, stop=stop, into=into)) as pieces:
        for piece in pieces:
            hasher.update(piece)
            if progress is not None:
                progress(len(piece))
    return hasher.hexdigest()
