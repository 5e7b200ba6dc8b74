"""Staging folders of forced transfers, and telling a live one from a leftover of a killed one.

A forced transfer stages the new checkpoint in ``.<name>.integrity-fs-staging-<token>`` beside
its destination, holding ``_integrity_lease.json`` while it lives. On a local disk the live
transfer holds an exclusive ``flock`` on that file: the kernel releases it when the process dies,
whatever container or host name it had. On object stores the file says until when the transfer
lives (``{"expires": unix time}``), renewed every minute for ten: a leftover is dead once expired.

A local staging folder without a lease (one a swap has begun to move into place, or the old
checkpoint a swap moved aside) is dead: only a folder being made (new, holding nothing but its
lease) is live without one. A dead leftover is removed (:func:`clear`) unless it is sealed while its
destination is not: then it may be the only complete copy, and it is kept until the destination
is sealed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import threading
import time
from typing import Any

from . import storage
from .report import printable

log = logging.getLogger("integrity_fs")

__all__ = ["LEASE", "MARK", "Lease", "clear", "destination_of", "leftovers", "remove_tree", "sealed_at", "staging_name"]

MARK = ".integrity-fs-staging-"
LEASE = "_integrity_lease.json"
LEASE_S, RENEW_S = 600.0, 60.0


def staging_name(dest_name: str) -> str:
    return f".{dest_name}{MARK}{secrets.token_hex(4)}"


def destination_of(staging: str) -> str:
    """The name of the destination whose staging folder is named ``staging``."""
    return staging[1 : staging.rindex(MARK)]


def sealed_at(fs: Any, root: str) -> bool:
    """Whether ``root`` holds a manifest or a signature (a checkpoint sealed either way)."""
    return any(storage.exists(fs, storage.join(root, n)) for n in storage.NOT_CONTENT)


class Lease:
    """Held by a live transfer over its staging folder ``path`` (made here)."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs, self._path = fs, path
        self._stop = threading.Event()
        self._fd: int | None = None
        self._thread: threading.Thread | None = None
        lease = storage.join(path, LEASE)
        if storage.is_local(fs):
            os.makedirs(path)
            try:  # a folder is live without a lease only while it is being made: then the file locked
                # must still be its lease (no cleanup took the folder meanwhile)
                self._fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                held, there = os.fstat(self._fd), os.lstat(lease)
                if (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
                    raise FileNotFoundError(lease)
            except FileNotFoundError as exc:
                self.release()
                raise OSError(f"the staging folder {path} was removed while it was made") from exc
        else:
            self._renew()
            self._thread = threading.Thread(target=self._renewing, daemon=True, name="integrity_fs-lease")
            self._thread.start()

    def _renew(self) -> None:
        storage.write_atomic(
            self._fs, storage.join(self._path, LEASE), json.dumps({"expires": time.time() + LEASE_S}).encode()
        )

    def _renewing(self) -> None:
        while not self._stop.wait(RENEW_S):
            with contextlib.suppress(Exception):
                self._renew()

    def release(self) -> None:
        self._stop.set()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _dead(fs: Any, path: str) -> bool:
    lease = storage.join(path, LEASE)
    if storage.is_local(fs):
        try:
            entries = os.listdir(path)
            young = time.time() - os.lstat(path).st_ctime < RENEW_S
        except FileNotFoundError:
            return False  # gone meanwhile: nothing to remove
        if young and set(entries) <= {LEASE}:
            return False  # being made: its lease is not (yet) locked
        try:
            fd = os.open(lease, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:  # a swap's folder, or the old checkpoint moved aside: no transfer holds it
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    try:
        expires = json.loads(storage.read_file(fs, lease))["expires"]
        return float(expires) < time.time()
    except FileNotFoundError:
        files = storage.list_files(fs, path)
        return all((s.mtime or 0) < time.time() - LEASE_S for s in files.values())
    except (ValueError, KeyError, TypeError):
        return True  # not a lease we wrote


def leftovers(fs: Any, parent: str, name: str | None = None) -> dict[str, bool]:
    """The staging folders in ``parent`` (of the destination ``name`` only, when given): name → dead."""
    try:
        folders = storage.list_dirs(fs, parent)
    except FileNotFoundError:
        return {}
    prefix = f".{name}{MARK}" if name is not None else "."
    return {
        f: _dead(fs, storage.join(parent, f))
        for f, link in folders.items()
        if not link and f.startswith(prefix) and MARK in f
    }


def clear(fs: Any, parent: str, name: str | None = None) -> bool:
    """Remove the dead staging folders in ``parent`` (of the destination ``name`` only, when
    given), except one sealed while its destination is not; whether any dead one was kept."""
    kept = False
    for folder, dead in leftovers(fs, parent, name).items():
        if not dead:
            continue
        path, dest = storage.join(parent, folder), storage.join(parent, destination_of(folder))
        if sealed_at(fs, path) and not sealed_at(fs, dest):
            kept = True
            log.warning(
                "%s holds a sealed checkpoint left by a killed transfer to %s, which is not sealed: "
                "kept (it may be the only copy)",
                printable(storage.describe(fs, path)),
                printable(storage.describe(fs, dest)),
            )
            continue
        remove_tree(fs, path)
        log.info("removed %s, left by a killed transfer", printable(storage.describe(fs, path)))
    return kept


def remove_tree(fs: Any, path: str) -> None:
    """Delete the folder ``path`` and everything in it (links are removed, never followed)."""
    if storage.is_local(fs):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)
        return
    with storage.storage_errors(f"deleting {storage.describe(fs, path)}"):
        if storage.is_s3(fs):
            storage.s3.remove_prefix(fs, path)
        else:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path, recursive=True)
        storage.forget(fs, path)
