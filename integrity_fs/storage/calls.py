"""How a call to a store is made: retried when the failure is transient, stopped at once when
the operation is (Ctrl-C, another worker's failure), and run on the backend's event loop where it
is async, so that a stalled request never holds a worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem

from ..errors import FileChangedError
from ..report import printable
from .errors import Cancelled, NotARegularFileError, same_kind, storage_errors

__all__ = [
    "READ_ATTEMPTS",
    "SELF_RETRYING_READ_ATTEMPTS",
    "check_stop",
    "close_stream",
    "on_loop",
    "read_attempts",
    "read_block",
    "retried",
]

log = logging.getLogger("integrity_fs")
T = TypeVar("T")

#: Attempts for a read that fails transiently (connection reset, timeout, short read).
READ_ATTEMPTS = 3

#: Attempts on backends that already retry each request themselves (s3fs, gcsfs): ours would multiply theirs.
SELF_RETRYING_READ_ATTEMPTS = 2

_SELF_RETRYING_MODULES = ("s3fs", "gcsfs")

_RETRY_DELAY_S = 0.2

#: How often a worker waiting on an object store checks whether the call was stopped.
_STOP_POLL_S = 0.1

#: Failures that another attempt cannot mend: raised at once.
_NOT_RETRIED = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    NotARegularFileError,
    FileChangedError,
)

#: What another attempt cannot mend either, by ``errno``, whatever the class: a full disk, a quota,
#: a read-only filesystem, a file too large for it, a name too long.
_NOT_RETRIED_ERRNOS = frozenset(
    code
    for code in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EROFS,
        errno.EFBIG,
        errno.ENAMETOOLONG,
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
    )
    if code is not None
)


def retried(
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

    A missing file, a refused permission, what is not a regular file, a changed version and a
    failure no retry mends (a full disk, a quota, a read-only filesystem: by ``errno``) are
    raised at once, as they are. Any other ``OSError`` (backend errors included, through
    :func:`storage_errors`) undoes the attempt's progress and goes through ``check``, which may
    raise something else instead (a file the store says is shorter now is content, not storage);
    then it is retried after a back-off that ``stop`` cuts short (``Cancelled``), with the cached
    listing of ``path`` dropped so that the retry asks the store again. The last failure is
    raised with the count, its class and ``errno`` kept.
    """
    for attempt in range(1, attempts + 1):
        check_stop(stop)
        try:
            with storage_errors(what):
                return once(attempt)
        except _NOT_RETRIED:
            raise
        except OSError as exc:
            if exc.errno in _NOT_RETRIED_ERRNOS:
                raise same_kind(exc, f"{what}: {exc}") from exc
            undo()
            if check is not None:
                check(exc)
            if attempt == attempts:
                raise same_kind(exc, f"{what} failed {attempts} times: {exc}") from exc
            log.info("retrying %s after %s (attempt %d of %d)", printable(what), printable(str(exc)), attempt, attempts)
            if stop is None:
                time.sleep(_RETRY_DELAY_S * attempt)
            elif stop.wait(_RETRY_DELAY_S * attempt):
                raise Cancelled("stopped") from exc
            with contextlib.suppress(Exception):
                fs.invalidate_cache(path)
    raise AssertionError("unreachable")


def read_attempts(fs: fsspec.AbstractFileSystem) -> int:
    modules = {(cls.__module__ or "").split(".")[0] for cls in type(fs).__mro__}
    return SELF_RETRYING_READ_ATTEMPTS if modules & set(_SELF_RETRYING_MODULES) else READ_ATTEMPTS


def check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Cancelled("stopped")


def on_loop(fs: AsyncFileSystem, coro: Coroutine[Any, Any, T], stop: threading.Event | None) -> T:
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


async def read_block(f: Any, n: int) -> bytes:
    """``n`` bytes from the async stream ``f``, fewer only at its end."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = await f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def close_stream(f: Any) -> None:
    """Close on the loop that owns it: the response body belongs to the event loop, not to the
    worker thread (and a range that stops early leaves it open)."""
    with contextlib.suppress(Exception):
        await f.close()
    body = getattr(f, "r", None)
    if body is not None:
        with contextlib.suppress(Exception):
            body.close()
