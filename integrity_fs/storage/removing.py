"""Deleting whole checkpoints (retention): what a checkpoint folder holds, and its deletion in the
order that never leaves a sealed folder with files missing.

:func:`folder_of` lists everything under a checkpoint (its manifest, signature and sidecar
included) without reading any of it; :func:`remove_folders` deletes several such folders: first
every signature, manifest and sidecar of them all (so each folder is unsealed before any of its
files goes), then their files, then the folders. A deletion that is interrupted or fails leaves
unsealed folders behind, never a sealed one with files missing.

- Local disks: links are removed, never followed. A checkpoint folder that is a symlink is
  unlinked (what it points to is not touched), also when it became one after it was listed: the
  manifests are deleted relative to the folder opened with ``O_NOFOLLOW``, and that descriptor is
  fsynced after; inside a folder, the tree is removed with ``shutil.rmtree``, which never
  descends a link (it unlinks it).
- S3: DeleteObjects, up to 1,000 keys a request, folder markers included.
- GCS: gcsfs's batch deletion on Google Cloud Storage (100 objects a request), whose outcomes are
  paired with the paths by the names they give, not by position; one request per object
  elsewhere (emulators).
- Other filesystems (memory, ...): one file at a time, then the directories, deepest first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.asyn import sync

from ..manifest import MANIFEST_FILENAME
from ..recorded import CHECKSUMS_FILENAME
from ..report import SIGNATURE_FILENAME, printable, shortened
from . import s3
from .errors import storage_errors
from .gcs import is_gcs
from .listing import forget_cached
from .urls import describe, is_local
from .write import sync_dirs

__all__ = ["METADATA_ORDER", "Folder", "folder_of", "remove_folders"]

#: The root files that make a checkpoint sealed, in the order they are deleted: the signature
#: first (with a key and no manifest, the signed digests stand in for one), then the manifest,
#: then the sidecar of recorded store checksums.
METADATA_ORDER = (SIGNATURE_FILENAME, MANIFEST_FILENAME, CHECKSUMS_FILENAME)

log = logging.getLogger("integrity_fs")

#: Whether local folders can be opened without following a link and files unlinked relative to them.
_FOLDER_FDS = hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY") and {os.open, os.unlink} <= os.supports_dir_fd

#: Deletions in flight at once where each object takes a request of its own.
_DELETERS = 16


@dataclass(frozen=True)
class Folder:
    """One checkpoint folder as it was listed for deletion.

    ``files``: every file (object) under it, full paths, its metadata (:data:`METADATA_ORDER`)
    first; ``bytes``: their sizes added up (what deleting it frees); ``link``: a local folder
    that is a symlink, of which only the link is removed (nothing is freed).
    """

    path: str
    files: tuple[str, ...] = ()
    bytes: int = 0
    metadata: int = 0  # how many of ``files`` (the first ones) are the root's metadata
    link: bool = False


def folder_of(fs: fsspec.AbstractFileSystem, path: str) -> Folder:
    """Everything under the checkpoint folder ``path``, listed from the store (no cache), nothing
    read. A folder that is gone has no files."""
    if is_local(fs):
        return _local_folder(path)
    with storage_errors(f"listing {describe(fs, path)}"):
        forget_cached(fs, path)
        try:
            found = fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            found = {}
    prefix = path.rstrip("/") + "/"
    sizes = {p: int(info.get("size") or 0) for p, info in found.items() if p.startswith(prefix) or p == path}
    return _ordered(path, sizes)


def _local_folder(path: str) -> Folder:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Folder(path)
    if stat.S_ISLNK(st.st_mode):
        return Folder(path, link=True)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    sizes: dict[str, int] = {}
    todo = [path]
    while todo:
        directory = todo.pop()
        try:
            with os.scandir(directory) as listed:
                entries = list(listed)
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                todo.append(entry.path)
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            sizes[entry.path] = info.st_size if stat.S_ISREG(info.st_mode) else 0
    return _ordered(path, sizes)


def _ordered(path: str, sizes: dict[str, int]) -> Folder:
    root = path.rstrip("/")
    metadata = [f"{root}/{name}" for name in METADATA_ORDER if f"{root}/{name}" in sizes]
    rest = sorted(p for p in sizes if p not in metadata)
    return Folder(path, (*metadata, *rest), sum(sizes.values()), len(metadata))


def remove_folders(fs: fsspec.AbstractFileSystem, folders: Sequence[Folder]) -> None:
    """Delete ``folders``: every one's metadata, then every one's files, then the folders.

    Raises ``OSError`` (naming what was left) at the first step that does not complete; the
    steps after it are not taken, so a folder whose manifest could not be deleted keeps its files.
    """
    if is_local(fs):
        for folder in folders:
            _unseal_local(folder)
    else:
        _delete(fs, [p for folder in folders for p in folder.files[: folder.metadata]], "the manifests and signatures")
    log.info("unsealed %d checkpoints (their manifests and signatures deleted); deleting their files", len(folders))
    if is_local(fs):
        for folder in folders:
            _remove_local_tree(folder)
        sync_dirs(sorted({os.path.dirname(folder.path.rstrip("/")) for folder in folders}))
        return
    _delete(fs, [p for folder in folders for p in folder.files[folder.metadata :]], "the files")
    if not (s3.is_s3(fs) or is_gcs(fs)):  # stores with directories of their own (memory, ...)
        for folder in folders:
            _remove_dirs(fs, folder.path)
    for folder in folders:
        forget_cached(fs, folder.path)


def _delete(fs: fsspec.AbstractFileSystem, paths: list[str], what: str) -> None:
    """Delete files (those already gone are fine); ``OSError`` when any is left."""
    if not paths:
        return
    errors: list[str] = []
    if s3.is_s3(fs):
        left = s3.delete_objects(fs, paths, errors=errors)
    elif is_gcs(fs):
        left = _delete_gcs(fs, paths, errors)
    else:
        left = _delete_each(fs, paths, errors)
    if left:
        shown = shortened([describe(fs, p) for p in left], 3)
        cause = f": {printable(errors[0])}" if errors else ""
        raise OSError(f"storage error while deleting {what} of checkpoints: could not delete {shown}{cause}")


def _delete_gcs(fs: fsspec.AbstractFileSystem, paths: list[str], errors: list[str]) -> list[str]:
    """gcsfs's batched deletion on Google Cloud Storage; one request per object elsewhere
    (emulators, where gcsfs sends one request per object too)."""
    fs_: Any = fs
    if not getattr(fs_, "on_google", False):
        return _delete_each(fs, paths, errors)
    with storage_errors(f"deleting {len(paths)} objects"):
        if hasattr(fs_, "_delete_files"):
            outcomes = sync(fs_.loop, fs_._delete_files, paths, 100)
        else:  # gcsfs 2024: one batch request of up to 100 paths at a time, by its own _rm_files
            outcomes = []
            for start in range(0, len(paths), 100):
                try:
                    outcomes += sync(fs_.loop, fs_._rm_files, paths[start : start + 100])
                except Exception as exc:  # a batch that failed as a whole: every path of it is left
                    outcomes.append(exc)
    return _batch_left(paths, outcomes, errors)


#: How Cloud Storage says that an object to delete is not there (already deleted: fine).
_NO_SUCH_OBJECT = re.compile(r"No such object: ([^\s\"\\]+)")


def _batch_left(paths: Sequence[str], outcomes: Sequence[object], errors: list[str]) -> list[str]:
    """The ``paths`` that gcsfs's batch deletion on Cloud Storage did not delete, from its
    ``outcomes``; the failures' messages are added to ``errors``.

    Outcomes are not one per path in order: a deleted object comes back as its path; an object
    that could not be deleted as an exception whose message may not name it; a batch request
    that failed as a whole as one exception for up to 100 paths; and retried paths come after
    the others. So a path is done only when it came back, or a "No such object" names it; every
    other path is left.
    """
    done = {o for o in outcomes if isinstance(o, str)}
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    gone = {urllib.parse.unquote(name) for o in failures for name in _NO_SUCH_OBJECT.findall(str(o))}
    left = [p for p in paths if p not in done and p not in gone]
    if left:
        errors.extend(f"{type(o).__name__}: {o}" for o in failures if not _NO_SUCH_OBJECT.search(str(o)))
        if not errors:
            errors.append(f"no outcome for {len(left)} of {len(paths)} objects in gcsfs's batch deletion")
    return left


def _delete_each(fs: fsspec.AbstractFileSystem, paths: list[str], errors: list[str]) -> list[str]:
    def gone(path: str) -> bool:
        try:
            with storage_errors(f"deleting {describe(fs, path)}"), contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return False
        return True

    if len(paths) < 2:
        return [p for p in paths if not gone(p)]
    with concurrent.futures.ThreadPoolExecutor(min(_DELETERS, len(paths)), thread_name_prefix="integrity_fs") as pool:
        return [p for p, ok in zip(paths, pool.map(gone, paths), strict=True) if not ok]


def _unseal_local(folder: Folder) -> None:
    """Delete a local folder's metadata (:data:`METADATA_ORDER`) and fsync it, through the folder
    opened without following a link: a folder swapped for a link since it was listed has none
    deleted (the link itself goes with :func:`_remove_local_tree`), nothing outside it is touched."""
    if folder.link or not folder.metadata:
        return
    if not _FOLDER_FDS:  # no descriptor-relative calls (Windows): by path, once the folder is no link
        if not os.path.islink(folder.path):
            for path in folder.files[: folder.metadata]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return
    parent, name = os.path.split(folder.path.rstrip("/"))
    try:
        parent_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # the run's directory went meanwhile, and the folder with it
        return
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):  # gone, or now a link or a file
                return
            raise
    finally:
        os.close(parent_fd)
    try:
        for path in folder.files[: folder.metadata]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.basename(path), dir_fd=fd)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem that cannot fsync a directory
                raise
    finally:
        os.close(fd)


def _remove_local_tree(folder: Folder) -> None:
    """Unlink a linked folder; remove a real one without following any link inside it."""
    path = folder.path
    if folder.link:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISLNK(st.st_mode):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # rmtree refuses a folder that became a link after its own check
            if not os.path.islink(path):
                raise
    os.unlink(path)  # swapped for a link since it was listed: the link alone goes


def _remove_dirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """The (now empty) directories of ``path`` on a filesystem that keeps directories, deepest first."""
    with storage_errors(f"deleting {describe(fs, path)}"):
        try:
            found = fs.find(path, detail=True, withdirs=True)
        except FileNotFoundError:
            return
        dirs = [p for p, info in found.items() if info.get("type") == "directory" and p != path]
        for directory in sorted(dirs, key=lambda p: (-p.count("/"), p)):
            with contextlib.suppress(FileNotFoundError):
                fs.rmdir(directory)
        with contextlib.suppress(FileNotFoundError):
            fs.rmdir(path)
