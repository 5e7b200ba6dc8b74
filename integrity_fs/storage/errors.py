"""What storage failures become: built-in ``OSError`` subclasses, never corruption, never success.

Backends wrap badly (s3fs turns a ranged-read timeout into an ``IndexError``; gcsfs raises
``requests`` and ``google`` exceptions), so a failure is judged by its whole chain. The classes
here say what a read found when the store answered correctly but the file is not as planned.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from fsspec.exceptions import FSTimeoutError

__all__ = [
    "Cancelled",
    "FileGrewError",
    "NotARegularFileError",
    "ShortReadError",
    "SizeChangedError",
    "precondition_failed",
    "same_kind",
    "storage_errors",
]

# Exceptions from these packages are storage failures and are re-raised as OSError.
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "requests", "urllib3")


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


def precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's 412 Precondition Failed (a pinned read or a conditional write
    whose version no longer holds), however the backend raised it: s3fs an ``OSError`` with the
    ``ClientError`` as its cause; gcsfs ``FileExistsError`` since 2024.12, an ``HttpError`` of code
    412 before."""
    link: BaseException | None = exc
    for _ in range(4):
        if link is None:
            return False
        if isinstance(link, FileExistsError) or getattr(link, "code", None) == 412:
            return True
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return error.get("Code") in ("PreconditionFailed", "412") or status == 412
        link = link.__cause__ or link.__context__
    return False


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
    """Re-raise backend exceptions (botocore, gcsfs, aiohttp, ...) as ``OSError`` naming ``what``.

    A built-in ``OSError`` passes through as it is, unless a backend made it from its own error
    without naming the file (s3fs's ``PermissionError("Forbidden")``): then it is raised again, of
    the same type and errno, naming ``what``. ``FileNotFoundError`` and ``FileExistsError`` pass
    through in any case: their callers say what was not there, or already there."""
    try:
        yield
    except Exception as exc:
        if _is_ours(exc):
            raise
        if isinstance(exc, OSError) and type(exc).__module__ == "builtins":
            if isinstance(exc, (FileNotFoundError, FileExistsError)) or exc.filename or not _made_by_a_backend(exc):
                raise
            named = type(exc)(f"storage error while {what}: {exc}")
            named.errno = exc.errno
            raise named from exc
        cause = _storage_cause(exc)
        if cause is None:
            raise
        if isinstance(cause, OSError) and type(cause).__module__ == "builtins" and cause is not exc:
            error_type: type[OSError] = type(cause)
        else:
            error_type = _os_error_type(cause)
        error = error_type(f"storage error while {what}: {type(cause).__name__}: {cause}")
        if isinstance(cause, OSError):
            error.errno = cause.errno
        raise error from exc


def same_kind(exc: OSError, message: str) -> OSError:
    """An ``OSError`` of ``exc``'s class and ``errno`` that says ``message`` (a plain ``OSError``
    with that ``errno`` when the class cannot be built from a message alone)."""
    try:
        error = type(exc)(message)
    except Exception:
        error = OSError(message)
    if str(error) != message:
        error = OSError(message)
    error.errno = exc.errno
    return error


def _made_by_a_backend(exc: BaseException) -> bool:
    """Whether a backend error is in the chain of ``exc`` (which a backend raised in its place)."""
    seen: set[int] = {id(exc)}
    link = exc.__cause__ or exc.__context__
    while link is not None and id(link) not in seen:
        if _is_backend_error(link):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def _is_ours(exc: BaseException) -> bool:
    """Raised by integrity_fs itself (a storage class here, ``FileChangedError``): passed on as it is."""
    return (type(exc).__module__ or "").split(".")[0] == "integrity_fs"


def _os_error_type(exc: BaseException) -> type[OSError]:
    """The closest built-in OSError subclass for a backend exception, judged by its class names."""
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    if "Timeout" in names:
        return TimeoutError
    if "Connect" in names:
        return ConnectionError
    return OSError
