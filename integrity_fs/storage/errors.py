"""Storage failures as built-in ``OSError`` subclasses: never corruption, never success.

Backends wrap badly (s3fs turns a ranged-read timeout into ``IndexError``; gcsfs raises
``requests``/``google`` exceptions), so a failure is judged by its whole chain.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from fsspec.exceptions import FSTimeoutError

__all__ = ["Cancelled", "NotARegularFileError", "kind_of", "precondition_failed", "storage_errors"]

_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "requests", "urllib3")


class NotARegularFileError(OSError):
    """A FIFO, socket or device where a file was expected: never read (it could block forever).
    ``kind``: which (``"FIFO"``, ``"socket"``, ``"device"``)."""

    kind = "special file"


def kind_of(exc: BaseException) -> str:
    """What stood where a regular file was expected, as ``a FIFO``, ``a directory``, ..."""
    if isinstance(exc, IsADirectoryError):
        return "a directory"
    return f"a {getattr(exc, 'kind', 'special file')}"


class Cancelled(Exception):
    """The operation was stopped (Ctrl-C, or another worker's failure) before this read finished."""


def precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's 412 (a pinned read or conditional write whose version no
    longer holds), as s3fs (an ``OSError`` caused by the ``ClientError``) or gcsfs (``FileExistsError``
    since 2024.12, ``HttpError(code=412)`` before) raise it."""
    link: BaseException | None = exc
    for _ in range(4):
        if link is None:
            return False
        if isinstance(link, FileExistsError) or getattr(link, "code", None) == 412:
            return True
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            error, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
            return error.get("Code") in ("PreconditionFailed", "412") or meta.get("HTTPStatusCode") == 412
        link = link.__cause__ or link.__context__
    return False


def _is_backend_error(exc: BaseException) -> bool:
    module = (type(exc).__module__ or "").split(".")[0]
    return module in _BACKEND_MODULES or isinstance(exc, (asyncio.TimeoutError, FSTimeoutError))


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Re-raise a backend's failure as an ``OSError`` naming ``what`` (class and ``errno`` kept
    where the backend raised a built-in one). Our own exceptions pass through unchanged."""
    try:
        yield
    except Exception as exc:
        if (type(exc).__module__ or "").startswith("integrity_fs"):
            raise
        if isinstance(exc, OSError) and type(exc).__module__ == "builtins":
            if isinstance(exc, (FileNotFoundError, FileExistsError)) or exc.filename:
                raise
            named = type(exc)(f"storage error while {what}: {exc}")
            named.errno = exc.errno
            raise named from exc
        link: BaseException | None = exc
        seen: set[int] = set()
        while link is not None and id(link) not in seen and not (isinstance(link, OSError) or _is_backend_error(link)):
            seen.add(id(link))
            link = link.__cause__ or link.__context__
        if link is None or id(link) in seen:
            raise
        names = " ".join(cls.__name__ for cls in type(link).__mro__)
        kind: type[OSError] = (
            type(link)
            if isinstance(link, OSError) and type(link).__module__ == "builtins"
            else (TimeoutError if "Timeout" in names else ConnectionError if "Connect" in names else OSError)
        )
        error = kind(f"storage error while {what}: {type(link).__name__}: {link}")
        if isinstance(link, OSError):
            error.errno = link.errno
        raise error from exc
