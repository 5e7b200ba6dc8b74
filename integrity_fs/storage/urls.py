"""Where a checkpoint is: a URL or path resolved to an fsspec filesystem and a root inside it.

Local paths are paths (``/data/run::1`` is never a chained URL). ``DirFileSystem`` layers are
resolved to the filesystem and path beneath them, so that every rule for local files (special
files, identities, symlinks) holds however a local directory is reached. fsspec's caching layers
(``simplecache::``, ``filecache::``, ``blockcache::``, ``cached::``) are kept only when asked for:
reads that decide a verdict go to the store beneath them, never to cached bytes.
"""

from __future__ import annotations

import os
import re
from typing import Any

import fsspec
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from .errors import storage_errors

__all__ = ["beneath_caches", "describe", "is_local", "join", "local_filesystem", "resolve"]


def resolve(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    *,
    through_caches: bool = False,
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path for ``url`` (a path inside ``fs`` when ``fs`` is given).

    ``DirFileSystem`` layers are resolved to what lies beneath them. Caching layers are dropped
    (the store beneath them is returned) unless ``through_caches``: reading what a cache serves
    is for loaders that hash the bytes as served.
    """
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
    fs, root = _unwrap(fs, root, through_caches)
    if is_local(fs):
        root = os.path.abspath(root)
    elif root not in ("/", ""):
        root = root.rstrip("/")
    return fs, root


def _unwrap(fs: fsspec.AbstractFileSystem, path: str, through_caches: bool) -> tuple[fsspec.AbstractFileSystem, str]:
    """``fs`` and ``path`` with every ``DirFileSystem`` (and, unless ``through_caches``, every caching
    layer) replaced by the filesystem beneath it and the path there."""
    while True:
        if isinstance(fs, DirFileSystem):
            path = fs._join(path)
            fs = fs.fs
        elif isinstance(fs, CachingFileSystem) and not through_caches:
            fs = fs.fs
        else:
            return fs, path


def beneath_caches(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """The store beneath any caching layers of ``fs`` (the same path names a file in both)."""
    while isinstance(fs, CachingFileSystem):
        fs = fs.fs
    return fs


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


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def describe(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A URL for messages: ``s3://bucket/run`` or a plain local path."""
    return root if is_local(fs) else str(fs.unstrip_protocol(root))


def local_filesystem() -> fsspec.AbstractFileSystem:
    """The local filesystem, for modules that must not import fsspec."""
    return fsspec.filesystem("file")
