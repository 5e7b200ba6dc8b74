"""What is there: the files of a checkpoint (names, sizes and versions), its subdirectories,
whether a path exists. Every answer comes from the store, never from a listing cached earlier.

A file's *version* is what its reads are pinned to (see :mod:`.read`): on S3 the ETag, on GCS
the generation, on local disks the identity of the file (device, inode, size and the
modification and change times in nanoseconds), elsewhere whatever the backend lists that
changes when a file is rewritten (a modification time), or :data:`UNKNOWN_VERSION` when it
lists nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import stat
from collections.abc import Iterable
from typing import Any

import fsspec

from ..manifest import MANIFEST_FILENAME
from ..recorded import CHECKSUMS_FILENAME, ObjectState
from ..report import SIGNATURE_FILENAME, printable, shortened
from .checksums import listed_state
from .errors import storage_errors
from .gcs import is_gcs
from .urls import describe, is_local

__all__ = [
    "LEFT_BY_WRITE",
    "NOT_CONTENT",
    "UNKNOWN_VERSION",
    "Version",
    "check_no_clashes",
    "check_root",
    "exists",
    "file_folder_clashes",
    "forget_cached",
    "is_leftover",
    "list_dirs",
    "list_files",
    "local_identity",
    "stamp_of",
    "stat_file",
    "version_of",
]

log = logging.getLogger("integrity_fs")

#: Files at the root that describe the checkpoint and are not its content: the manifest, the
#: signature and the sidecar of recorded store checksums.
NOT_CONTENT = (MANIFEST_FILENAME, SIGNATURE_FILENAME, CHECKSUMS_FILENAME)
#: What :func:`write_atomic` names its temporary file at a local root (``mkstemp``: 8 random
#: characters). One left by a killed seal or sign (see :func:`is_leftover`) is not content.
LEFT_BY_WRITE = re.compile(rf"\.(?:{'|'.join(map(re.escape, NOT_CONTENT))})\.[A-Za-z0-9_]{{8}}\.tmp")

#: A file's version as a listing saw it: an ETag or generation (str), a local identity (int).
Version = str | int

#: Keys of an fsspec info dict that change when a file is rewritten, in order of preference.
_STAMP_KEYS = ("ETag", "etag", "generation", "mtime", "LastModified", "updated", "last_modified", "created")


#: The version of a file whose backend lists nothing that changes when it is rewritten (an
#: archive, some HTTP servers): its reads cannot be pinned, and a check against it never passes
#: silently (see :mod:`.read`).
UNKNOWN_VERSION = "unknown"


def stamp_of(info: dict[str, Any]) -> str:
    """What in an fsspec info dict changes when the file is rewritten (:data:`UNKNOWN_VERSION`:
    nothing listed).

    Times are compared as POSIX timestamps: some backends list a float and answer ``info`` with
    a ``datetime`` for the same moment.
    """
    value = next((info[key] for key in _STAMP_KEYS if info.get(key) is not None), UNKNOWN_VERSION)
    if isinstance(value, datetime.datetime):
        value = value.timestamp()
    return str(value)


def version_of(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> Version:
    """The version of the file an object-store info dict describes (see the module docstring)."""
    if is_gcs(fs) and info.get("generation") is not None:
        return str(info["generation"])
    return stamp_of(info)


def local_identity(st: os.stat_result) -> int:
    """What tells a local file's content apart over time without reading it: the hash of its
    device, inode, size, and modification and change times in nanoseconds (ctime moves even when
    a writer puts mtime back). One int, not the tuple: 100,000 files hold ~10 MB less."""
    return hash((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def stat_file(fs: fsspec.AbstractFileSystem, root: str, name: str) -> tuple[int | None, Version | None]:
    """The size and version of the file ``name`` under ``root`` as the store says now (one
    request, no cache); ``(None, None)`` when there is no regular file there that a listing would
    show (gone, a directory, a special file, a symlink leaving the root)."""
    path = f"{root.rstrip('/')}/{name}"
    if is_local(fs):
        try:
            st = os.stat(path)
            inside = os.path.commonpath([os.path.realpath(root), os.path.realpath(path)]) == os.path.realpath(root)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None, None
        if not stat.S_ISREG(st.st_mode) or not inside:
            return None, None
        return st.st_size, local_identity(st)
    with storage_errors(f"checking {describe(fs, path)}"):
        forget_cached(fs, path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None, None
    if info.get("type", "file") != "file":
        return None, None
    return int(info["size"]), version_of(fs, info)


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


def list_files(
    fs: fsspec.AbstractFileSystem,
    root: str,
    *,
    stamps: dict[str, str] | None = None,
    versions: dict[str, Version] | None = None,
    leftovers: bool = False,
    states: dict[str, ObjectState] | None = None,
    ordered: bool = True,
) -> dict[str, int]:
    """Every file under ``root``: POSIX name relative to root -> size in bytes, sorted by name;
    with ``ordered=False`` in the order the store lists them (sorting 100,000 names costs about a
    sixth of listing them, and a comparison with a manifest needs no order).

    The root's manifest and signature are left out, and so are temporary files that an
    interrupted write of ours left at a local root (:func:`is_leftover`; with a WARNING), unless
    ``leftovers``: a verification lists them, so that ``strict`` and a signature account for
    them like any file. On local disks, symlinks are never followed
    out of the root: a link whose target lies outside is skipped (and logged), and linked
    directories are not descended. FIFOs, sockets and devices are skipped with a warning. On
    object stores the listing comes from the store, never from a cache, and folder markers
    (zero-byte keys ending in ``/``) are directories, not files.

    ``versions``, when given, receives each file's version (the module docstring says what that
    is), to pin its reads to. ``stamps`` receives what ranks on different machines can compare:
    the modification time on local disks, the version elsewhere.
    """
    if is_local(fs):
        return _list_local(root, stamps, versions, leftovers, ordered)
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
        if states is not None and name:
            state = listed_state(fs, info)
            if state is not None:
                states[name] = state
        if name and name not in NOT_CONTENT and not _is_folder_marker(name, info):
            out[name] = int(info["size"])
            if stamps is not None or versions is not None:
                version = version_of(fs, info)
                if stamps is not None:
                    stamps[name] = str(version)
                if versions is not None:
                    versions[name] = version
    return dict(sorted(out.items())) if ordered else out


def _is_folder_marker(name: str, info: dict[str, Any]) -> bool:
    key = str(info.get("Key", info.get("name", name)))
    return int(info.get("size") or 0) == 0 and (name.endswith("/") or key.endswith("/"))


def forget_cached(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Drop every cached listing of ``root``, its parents and everything under it.

    ``invalidate_cache(root)`` alone clears the root and its parents (s3fs, gcsfs), so a
    subdirectory listed earlier in the process would still be served from memory.
    """
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache:
        below = root.rstrip("/") + "/"
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(below)]:
            cache.pop(key, None)


def is_leftover(path: str, name: str) -> bool:
    """Whether the root's file ``name`` (at ``path``) is a temporary file of :func:`write_atomic`
    that an interrupted write left: named as it names them, and empty or starting as the JSON it
    writes. Anything else is a file like any other, whatever its name."""
    if name[:1] != "." or not LEFT_BY_WRITE.fullmatch(name):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 64).lstrip()
    except OSError:
        return False
    finally:
        os.close(fd)
    return head[:1] in (b"", b"{")


#: Directories are read through a descriptor where the platform allows it, so that each file's
#: ``lstat`` is relative to it (``fstatat``) instead of resolving the whole path again.
_SCANDIR_FD = os.scandir in os.supports_fd
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def _list_local(
    root: str,
    stamps: dict[str, str] | None = None,
    versions: dict[str, Version] | None = None,
    leftovers: bool = False,
    ordered: bool = True,
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
        fd = -1
        try:
            if _SCANDIR_FD:
                fd = os.open(directory, _DIR_FLAGS)
            listed = os.scandir(fd if fd >= 0 else directory)
        except (FileNotFoundError, NotADirectoryError):
            if fd >= 0:
                os.close(fd)
            if not prefix:
                raise
            continue  # a subdirectory removed (or replaced) since its parent was read: not there
        try:
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
                        todo.append((os.path.join(directory, entry.name), f"{prefix}{entry.name}/"))
                        continue
                    name = prefix + entry.name
                    if not prefix and name in NOT_CONTENT:
                        continue
                    if not prefix and not link and name[0] == "." and _left_by_write(directory, name, leftovers):
                        continue
                    try:
                        if link:
                            path = os.path.join(directory, entry.name)
                            target = os.path.realpath(path)
                            if os.path.commonpath([real_root, target]) != real_root:
                                log.warning(
                                    "skipping %s: symlink to %s leaves the checkpoint root",
                                    printable(name),
                                    printable(target),
                                )
                                continue
                            if not os.path.isfile(target):
                                continue
                            st = os.stat(path)
                        else:
                            st = entry.stat()  # not a link: its lstat (relative to the directory's descriptor)
                    except FileNotFoundError:
                        continue  # removed since the directory was read: not there (if listed, "missing")
                    if not is_regular(st.st_mode):
                        log.warning(
                            "skipping %s: a %s, not a regular file (never opened)", printable(name), kind_of(st.st_mode)
                        )
                        continue
                    out[name] = st.st_size
                    if stamps is not None:
                        stamps[name] = str(st.st_mtime)  # as fsspec's LocalFileSystem lists it
                    if versions is not None:
                        versions[name] = local_identity(st)
        finally:
            if fd >= 0:
                os.close(fd)
    if not ordered:
        return out
    names = sorted(out)
    return dict(zip(names, map(out.__getitem__, names), strict=True))


def _left_by_write(directory: str, name: str, leftovers: bool) -> bool:
    """Whether the root's file ``name`` is left out of the listing as a leftover of ours (with a
    WARNING either way; ``leftovers``: listed, so that a verification accounts for it)."""
    if not is_leftover(os.path.join(directory, name), name):
        return False
    log.warning(
        "%s %s: left by an interrupted write of the manifest or signature (delete it)",
        "listing" if leftovers else "skipping",
        printable(name),
    )
    return not leftovers


def file_folder_clashes(names: Iterable[str]) -> list[tuple[str, str]]:
    """Each name that is also a folder of another (an object store holds ``sub`` and ``sub/x``
    side by side; a local directory cannot): ``(file, a name under it)``, sorted."""
    files = set(names)
    found: dict[str, str] = {}
    for name in files:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in files:
                found[parent] = min(found.get(parent, name), name)
    return sorted(found.items())


def check_no_clashes(fs: fsspec.AbstractFileSystem, root: str, names: Iterable[str], what: str) -> None:
    """``ValueError`` naming a file that is also a folder in the listing of ``root`` (see
    :func:`file_folder_clashes`): such a tree cannot be copied to a local disk. ``what``: the
    refused operation, for the message (``"seal"``, ``"download"``)."""
    clashes = file_folder_clashes(names)
    if not clashes:
        return
    shown = shortened([f"{printable(f)!r} is a file and also a folder holding {printable(u)!r}" for f, u in clashes], 5)
    raise ValueError(f"cannot {what} {describe(fs, root)}: {shown} (a local directory cannot hold both: rename one)")


def kind_of(mode: int) -> str:
    """``FIFO``, ``socket``, ``device`` or ``special file``: what a non-regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether anything is at ``path`` (a dangling link too), asked of the store, not of a cache."""
    if is_local(fs):
        return os.path.lexists(path)
    with storage_errors(f"checking {describe(fs, path)}"):
        fs.invalidate_cache(path)
        return bool(fs.exists(path))


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
