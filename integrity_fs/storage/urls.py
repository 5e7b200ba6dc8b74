"""Where a checkpoint is: a URL or path resolved to an fsspec filesystem and a root inside it.

Local paths are paths (``/data/run::1`` is never a chained URL). ``DirFileSystem`` layers are
resolved to what lies beneath them; caching layers (``simplecache::`` and the like) are dropped
unless a reader asks to read through them. Whether two roots overlap is judged from where their
bytes live (store, endpoint, path), never from filesystem objects.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any

import fsspec
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from .errors import storage_errors

__all__ = ["URL", "describe", "is_gcs", "is_local", "is_s3", "join", "overlap", "parent", "resolve", "under_cache"]

#: What every ``url`` argument takes: a local path or an fsspec URL, as a string or a path object.
URL = str | os.PathLike[str]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")


def _is_url(text: str) -> bool:
    """``s3://b/k`` or ``simplecache::s3://b/k`` name a protocol; ``file://`` and anything else are local paths."""
    match = _SCHEME.match(text)
    if match is None:
        return False
    protocol, separator = match.groups()
    return protocol in fsspec.available_protocols() if separator == "::" else protocol not in ("file", "local")


def resolve(
    url: URL, storage_options: dict[str, Any] | None = None, fs: Any = None, *, through_caches: bool = False
) -> tuple[Any, str]:
    """The filesystem and root for ``url`` (a path inside ``fs`` when given)."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(f"url must be a string or os.PathLike, not {type(url).__name__}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
    text = os.fspath(url)
    if not text:
        raise ValueError("url is empty")
    if fs is not None:
        if storage_options:
            raise ValueError("pass either fs= or storage_options=, not both")
        root = fs._strip_protocol(text)
    elif isinstance(url, str) and _is_url(text):
        with storage_errors(f"opening {text}"):
            fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    else:
        fs = fsspec.filesystem("file", **(storage_options or {}))
        root = fs._strip_protocol(text)
    while isinstance(fs, DirFileSystem) or (isinstance(fs, CachingFileSystem) and not through_caches):
        if isinstance(fs, DirFileSystem):
            root = fs._join(root)
        fs = fs.fs
    if is_local(fs):
        return fs, os.path.abspath(root)
    return fs, root.rstrip("/") if root not in ("/", "") else root


def under_cache(fs: Any) -> Any:
    """The store beneath any caching layers of ``fs``."""
    while isinstance(fs, CachingFileSystem):
        fs = fs.fs
    return fs


def _protocols(fs: Any) -> set[str]:
    protocol = type(fs).protocol  # the class: caching layers pass attribute lookups through
    return set(protocol) if isinstance(protocol, (tuple, list)) else {protocol}


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_s3(fs: Any) -> bool:
    return "s3" in _protocols(fs) and hasattr(type(fs), "_call_s3")


def is_gcs(fs: Any) -> bool:
    return bool({"gs", "gcs"} & _protocols(fs)) and hasattr(type(fs), "_call")


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] or "/"


def describe(fs: Any, path: str) -> str:
    """A URL for messages: ``s3://bucket/run``, or a plain local path."""
    return path if is_local(fs) else str(fs.unstrip_protocol(path))


def _endpoint(url: str | None) -> str:
    """An endpoint as a comparable name; AWS's and Google's own endpoints are their one namespace."""
    if not url:
        return ""
    parts = urllib.parse.urlsplit(url if "://" in url else f"https://{url}")
    host = (parts.hostname or "").lower().rstrip(".")
    if host.endswith(("amazonaws.com", "amazonaws.com.cn", "googleapis.com")):
        return ""
    host = "localhost" if host in ("localhost", "127.0.0.1", "::1") else host
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
    except ValueError:
        port = 0
    return f"{host}:{port}{parts.path.rstrip('/')}"


def _place(fs: Any, root: str) -> tuple[str, str, str]:
    if is_local(fs):
        return "file", "", os.path.realpath(root)
    if is_s3(fs):
        url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
        url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return "s3", _endpoint(url), root.strip("/")
    if is_gcs(fs):
        return "gcs", _endpoint(getattr(fs, "_location", None) or getattr(fs, "_endpoint", None)), root.strip("/")
    return min(_protocols(fs)), "", "/" + root.strip("/")


def overlap(a_fs: Any, a_root: str, b_fs: Any, b_root: str) -> bool:
    """Whether the two roots share bytes: the same store, and one path is or lies inside the other."""
    a, b = _place(a_fs, a_root), _place(b_fs, b_root)
    if a[:2] != b[:2]:
        return False
    x, y = a[2].rstrip("/") + "/", b[2].rstrip("/") + "/"
    return x.startswith(y) or y.startswith(x)
