"""Where a checkpoint is: a URL or path resolved to an fsspec filesystem and a root inside it.

Local paths are paths (``/data/run::1`` is never a chained URL). ``DirFileSystem`` layers are
resolved to the filesystem and path beneath them, so that every rule for local files (special
files, identities, symlinks) holds however a local directory is reached. fsspec's caching layers
(``simplecache::``, ``filecache::``, ``blockcache::``, ``cached::``) are kept only when asked for:
reads that decide a verdict go to the store beneath them, never to cached bytes. Whether two
roots overlap is judged from where their bytes live (:func:`place`), not from filesystem objects.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .errors import storage_errors
from .gcs import is_gcs
from .s3 import is_s3

__all__ = [
    "URL",
    "Place",
    "beneath_caches",
    "describe",
    "is_local",
    "join",
    "local_filesystem",
    "local_path",
    "overlap",
    "parent",
    "place",
    "resolve",
]

#: What every ``url`` argument takes: a local path or an fsspec URL, as a string or a path object.
URL = str | os.PathLike[str]


def resolve(
    url: URL,
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


def parent(path: str) -> str:
    """The folder that holds ``path`` (a path inside its filesystem, as :func:`resolve` returns)."""
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head or "/"


def describe(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A URL for messages: ``s3://bucket/run`` or a plain local path."""
    return root if is_local(fs) else str(fs.unstrip_protocol(root))


def local_path(fs: fsspec.AbstractFileSystem, path: str | os.PathLike[str]) -> str:
    """The path on disk of ``path`` of the local filesystem ``fs``, also when it is given as a URL
    (``file://…``, ``local://…``: DCP joins its file names to the URL it was given)."""
    return str(fs._strip_protocol(os.fspath(path)))


def local_filesystem() -> fsspec.AbstractFileSystem:
    """The local filesystem, for modules that must not import fsspec."""
    return fsspec.filesystem("file")


# --------------------------------------------------------------------------- where the bytes live


@dataclass(frozen=True)
class Place:
    """Where a root's bytes live: a store (its kind and endpoint) and the path inside it.

    Two filesystem objects with other options (one extra key) reach the same place; two roots
    overlap when they share a store and one path is the other or lies inside it.
    """

    store: str
    endpoint: str
    path: str

    def overlaps(self, other: Place) -> bool:
        if (self.store, self.endpoint) != (other.store, other.endpoint):
            return False
        a, b = self.path.rstrip("/") + "/", other.path.rstrip("/") + "/"
        return a.startswith(b) or b.startswith(a)


def place(fs: fsspec.AbstractFileSystem, root: str) -> Place:
    """Where the bytes under ``root`` live (a root as :func:`resolve` returns it).

    Local disks: the real path (links resolved). Memory: the one store of the process. S3: the
    endpoint (``endpoint_url``, in the options or ``client_kwargs``, else ``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL``, else AWS, whose bucket names are global) and ``bucket/key``. GCS: its
    endpoint (``endpoint_url``, else the emulator's or Google's) and ``bucket/object``. Any other
    backend: its protocol and the path, whatever its options say (it may be the same store).
    """
    if is_local(fs):
        return Place("file", "", os.path.realpath(root))
    if isinstance(fs, MemoryFileSystem):
        return Place("memory", "", "/" + root.strip("/"))
    if is_s3(fs):
        client = getattr(fs, "client_kwargs", None) or {}
        url = getattr(fs, "endpoint_url", None) or client.get("endpoint_url")
        url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return Place("s3", _endpoint(url), root.strip("/"))
    if is_gcs(fs):
        return Place(
            "gcs", _endpoint(getattr(fs, "_location", None) or getattr(fs, "_endpoint", None)), root.strip("/")
        )
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return Place(str(protocol), "", root.rstrip("/"))


def overlap(a_fs: fsspec.AbstractFileSystem, a_root: str, b_fs: fsspec.AbstractFileSystem, b_root: str) -> bool:
    """Whether the two roots share bytes: the same place, or one inside the other (see :func:`place`)."""
    return place(a_fs, a_root).overlaps(place(b_fs, b_root))


_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The clouds' own endpoints: any of them names the cloud's one namespace of buckets.
_CLOUD_HOSTS = ("amazonaws.com", "amazonaws.com.cn", "googleapis.com")


def _endpoint(url: str | None) -> str:
    """An endpoint URL as a comparable name: ``host:port/path``, loopback as ``localhost``, any
    endpoint of AWS or Google as that cloud; no URL is the cloud's default (``""``)."""
    if not url:
        return ""
    parts = urllib.parse.urlsplit(url if "://" in url else f"https://{url}")
    host = (parts.hostname or "").lower().rstrip(".")
    if any(host == cloud or host.endswith("." + cloud) for cloud in _CLOUD_HOSTS):
        return ""
    if host in _LOOPBACK:
        host = "localhost"
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 0)
    except ValueError:
        port = 0
    return f"{host}:{port}{parts.path.rstrip('/')}"
