"""What is there: a checkpoint's files with their sizes and versions, a folder's subfolders.
Every answer comes from the store, never from a listing cached earlier in the process.

A file's *version* is what its reads are pinned to: the ETag on S3, the generation on GCS, on a
local disk the identity (device, inode, size, modification and change times in nanoseconds),
elsewhere a modification stamp, or ``"unknown"`` when the backend lists none.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import logging
import os
import stat
from typing import Any, NamedTuple

from ..manifest import MANIFEST_FILENAME
from ..report import printable
from .errors import storage_errors
from .urls import describe, is_gcs, is_local, join

__all__ = [
    "NOT_CONTENT",
    "TEMP_PREFIX",
    "UNKNOWN",
    "Stat",
    "check_root",
    "exists",
    "forget",
    "identity",
    "list_dirs",
    "list_files",
    "stat_file",
]

log = logging.getLogger("integrity_fs")

SIGNATURE_FILENAME = "model.sig"
#: Files at a root that describe the checkpoint and are not its content.
NOT_CONTENT = (MANIFEST_FILENAME, SIGNATURE_FILENAME)
#: What an atomic write names its temporary file at a local root: never content.
TEMP_PREFIX = ".integrity-fs-tmp-"
UNKNOWN = "unknown"


class Stat(NamedTuple):
    """A file as a listing saw it: its size, its version, when it was last written (seconds, the
    store's clock; ``None`` when unknown), and the CRC32C the listing shows (GCS; hex)."""

    size: int
    version: str | int
    mtime: float | None = None
    crc32c: str | None = None


def identity(st: os.stat_result) -> int:
    """A local file's version: device, inode, size, mtime_ns, ctime_ns (ctime moves even when a writer resets mtime)."""
    return hash((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def _seconds(value: Any) -> float | None:
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _remote_stat(fs: Any, info: dict[str, Any]) -> Stat:
    mtime = next(
        (
            t
            for k in ("LastModified", "mtime", "updated", "last_modified", "created")
            if (t := _seconds(info.get(k))) is not None
        ),
        None,
    )
    if is_gcs(fs) and info.get("generation") is not None:
        version: str | int = str(info["generation"])
    else:
        stamp = next((info[k] for k in ("ETag", "etag", "generation") if info.get(k)), mtime)
        if stamp is None:
            _unversioned(fs)
        version = f"{UNKNOWN} (size {int(info['size'])})" if stamp is None else str(stamp)
    crc = None
    if is_gcs(fs) and isinstance(info.get("crc32c"), str):
        try:
            crc = base64.b64decode(info["crc32c"], validate=True).hex()
        except (binascii.Error, ValueError):
            crc = None
    return Stat(int(info["size"]), version, mtime, crc)


_WARNED: set[str] = set()


def _unversioned(fs: Any) -> None:
    """Once per kind of filesystem: its listing gives no version, so a read is checked by size only."""
    kind = type(fs).__name__
    if kind not in _WARNED:
        _WARNED.add(kind)
        log.warning(
            "%s lists no version of its files (no ETag, generation or modification time): reads are not pinned, "
            "only their sizes are checked",
            kind,
        )


def forget(fs: Any, path: str) -> None:
    """Drop every cached listing of ``path``, its parents and everything under it."""
    if is_local(fs):
        return
    fs.invalidate_cache(path)
    below = path.rstrip("/") + "/"
    cache = getattr(fs, "dircache", None) or {}
    for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(below)]:
        cache.pop(key, None)


def list_files(fs: Any, root: str, meta: dict[str, Stat] | None = None) -> dict[str, Stat]:
    """Every file under ``root`` (POSIX name relative to it → :class:`Stat`), sorted, without the
    root's manifest, signature and the temporary files of interrupted local writes (``meta``
    receives those). Local: links are never followed out of the root nor into
    directories; FIFOs, sockets and devices are skipped with a WARNING. Object stores: zero-byte
    keys ending in ``/`` (folder markers) are folders. ``FileNotFoundError`` when nothing is at
    ``root``, ``NotADirectoryError`` when it is a file."""
    if is_local(fs):
        return _list_local(root, meta)
    with storage_errors(f"listing {describe(fs, root)}"):
        forget(fs, root)
        found = fs.find(root, detail=True, withdirs=False)
        if not found:
            check_root(fs, root)
    prefix = root.rstrip("/") + "/"
    out: dict[str, Stat] = {}
    if found and all(not p.startswith(prefix) for p in found):  # only the root itself (a file lists as itself)
        raise NotADirectoryError(f"{describe(fs, root)} is a file, not a checkpoint directory")
    for path, info in found.items():
        name = path[len(prefix) :] if path.startswith(prefix) else ""
        marker = int(info.get("size") or 0) == 0 and str(info.get("Key", info.get("name", path))).endswith("/")
        if info.get("type", "file") != "file" or not name or marker:
            continue
        if name in NOT_CONTENT:
            if meta is not None:
                meta[name] = _remote_stat(fs, info)
        else:
            out[name] = _remote_stat(fs, info)
    return {name: out[name] for name in sorted(out)}


def _list_local(root: str, meta: dict[str, Stat] | None) -> dict[str, Stat]:
    check_root_local(root)
    real_root = os.path.realpath(root)
    out: dict[str, Stat] = {}
    todo = [(root, "")]
    while todo:
        directory, prefix = todo.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            if not prefix:
                raise
            continue  # removed since its parent was read
        for entry in entries:
            name = prefix + entry.name
            if not prefix and name.startswith(TEMP_PREFIX):  # ours, left by an interrupted write: never content
                if meta is not None and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    meta[name] = Stat(st.st_size, identity(st), st.st_mtime)
                continue
            if not prefix and name in NOT_CONTENT:
                if meta is not None and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    meta[name] = Stat(st.st_size, identity(st), st.st_mtime)
                continue
            try:
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([real_root, target]) != real_root:
                        log.warning("skipping %s: a link out of the checkpoint root", printable(name))
                        continue
                    if os.path.isdir(target):
                        continue  # linked folders are never descended
                    st = os.stat(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    todo.append((entry.path, name + "/"))
                    continue
                else:
                    st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the folder was read
            if not stat.S_ISREG(st.st_mode):
                log.warning("skipping %s: not a regular file (never opened)", printable(name))
                continue
            out[name] = Stat(st.st_size, identity(st), st.st_mtime)
    return {name: out[name] for name in sorted(out)}


def check_root_local(root: str) -> None:
    if not os.path.isdir(root):
        if os.path.lexists(root):
            raise NotADirectoryError(f"{root} is a file, not a checkpoint directory")
        raise FileNotFoundError(f"no checkpoint at {root}: nothing exists there")


def check_root(fs: Any, root: str) -> None:
    """``FileNotFoundError`` when nothing is at ``root``, ``NotADirectoryError`` when it is a file."""
    if is_local(fs):
        return check_root_local(root)
    with storage_errors(f"checking {describe(fs, root)}"):
        forget(fs, root)
        if fs.isdir(root):
            return None
        is_file = fs.exists(root)
    if is_file:
        raise NotADirectoryError(f"{describe(fs, root)} is a file, not a checkpoint directory")
    raise FileNotFoundError(f"no checkpoint at {describe(fs, root)}: nothing exists there")


def stat_file(fs: Any, root: str, name: str) -> Stat | None:
    """The file ``name`` under ``root`` as the store shows it now; ``None`` when no regular file
    (inside the root) is there."""
    path = join(root, name)
    if is_local(fs):
        try:
            st = os.stat(path)
            inside = os.path.commonpath([os.path.realpath(root), os.path.realpath(path)]) == os.path.realpath(root)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return Stat(st.st_size, identity(st), st.st_mtime) if stat.S_ISREG(st.st_mode) and inside else None
    with storage_errors(f"checking {describe(fs, path)}"):
        forget(fs, path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
    return _remote_stat(fs, info) if info.get("type", "file") == "file" else None


def exists(fs: Any, path: str) -> bool:
    """Whether anything is at ``path`` (a dangling link too), asked of the store."""
    if is_local(fs):
        return os.path.lexists(path)
    with storage_errors(f"checking {describe(fs, path)}"):
        forget(fs, path)
        return bool(fs.exists(path))


def list_dirs(fs: Any, root: str) -> dict[str, bool]:
    """The immediate subfolders of ``root``: name → whether it is a symbolic link (local)."""
    if is_local(fs):
        check_root_local(root)
        with os.scandir(root) as entries:
            return {e.name: e.is_symlink() for e in entries if e.is_dir()}
    where = describe(fs, root)
    with storage_errors(f"listing {where}"):
        forget(fs, root)
        try:
            entries = fs.ls(root, detail=True)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no checkpoint at {where}: nothing exists there") from exc
    out: dict[str, bool] = {}
    for info in entries:
        path = str(info["name"])
        is_dir = info.get("type") == "directory" or (path.endswith("/") and not info.get("size"))
        if path.rstrip("/") == root.rstrip("/"):
            if not is_dir:
                raise NotADirectoryError(f"{where} is a file, not a directory")
        elif is_dir:
            out[path.rstrip("/").rsplit("/", 1)[-1]] = False
    return out
