"""Staging folders of forced transfers, and telling a live one from a leftover of a killed one.

A forced transfer stages the new checkpoint in ``.<name>.integrity-fs-staging-<token>`` beside
its destination, holding ``_integrity_lease.json`` while it lives. On a local disk the live
transfer holds an exclusive ``flock`` on that file: the kernel releases it when the process dies,
whatever container or host name it had. On object stores the file says until when the transfer
lives (``{"expires": unix time}``), renewed every minute for ten: a leftover is dead once expired.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import threading
import time
from typing import Any

from . import storage

__all__ = ["LEASE", "MARK", "Lease", "leftovers", "remove_tree", "staging_name"]

MARK = ".integrity-fs-staging-"
LEASE = "_integrity_lease.json"
LEASE_S, RENEW_S = 600.0, 60.0


def staging_name(dest_name: str) -> str:
    return f".{dest_name}{MARK}{secrets.token_hex(4)}"


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
            self._fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        else:
            self._renew()
            self._thread = threading.Thread(target=self._renewing, daemon=True, name="integrity_fs-lease")
            self._thread.start()

    def _renew(self) -> None:
        storage.write_atomic(self._fs, storage.join(self._path, LEASE), json.dumps({"expires": time.time() + LEASE_S}).encode())

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
            fd = os.open(lease, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:  # killed before its lease was made, or a transfer just starting
            return time.time() - os.lstat(path).st_mtime > RENEW_S
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
    return {f: _dead(fs, storage.join(parent, f)) for f, link in folders.items() if not link and f.startswith(prefix) and MARK in f}


def remove_tree(fs: Any, path: str) -> None:
    """Delete the folder ``path`` and everything in it (links are removed, never followed)."""
    if storage.is_local(fs):
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)
        return
    with storage.storage_errors(f"deleting {storage.describe(fs, path)}"):
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
        storage.forget(fs, path)
