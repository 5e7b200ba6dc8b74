"""Staging folders: where ``download`` (and a forced ``upload`` or ``copy``) lands the files until
every one of them verified, and how ``download``'s becomes ``dest`` (one rename, or its entries
moved into an empty ``dest``).

Internal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import uuid

from ..manifest import MANIFEST_FILENAME
from ..report import printable

__all__ = ["STAGING_MARK", "check_dest", "make_dirs", "move_up", "remove_stale", "staging_name", "staging_path"]

log = logging.getLogger("integrity_fs")

#: Staging folders are named ``.<DEST name><STAGING_MARK><pid>-<token>-<host>``.
STAGING_MARK = ".integrity-fs-partial-"


def staging_path(where: str, name: str) -> str:
    """A new staging directory's path in ``where`` for the ``dest`` called ``name``."""
    return os.path.join(where, staging_name(name))


def staging_name(name: str) -> str:
    """A new staging folder's name for the destination called ``name``."""
    return f".{name}{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}-{_host()}"


def check_dest(dest: str) -> None:
    """``FileExistsError`` unless ``dest`` is absent or an empty directory (a link to one is refused too)."""
    if os.path.islink(dest):  # its target would be checked, but the link itself replaced
        raise FileExistsError(f"{dest} is a symbolic link; download into the directory it points to, or a new path")
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
        raise FileExistsError(f"{dest} already exists and is not an empty directory")


def make_dirs(directory: str) -> list[str]:
    """Create ``directory`` and missing parents; returns the ones created, outermost first."""
    missing: list[str] = []
    while not os.path.isdir(directory) and directory not in missing:
        missing.append(directory)
        directory = os.path.dirname(directory)
    created: list[str] = []
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
            created.append(path)
    return created


def move_up(staging: str, target: str) -> list[str]:
    """Move every entry of ``staging`` into ``target`` (its parent), the manifest last, then remove
    ``staging``; the entries' new paths. On a failure the entries moved go back, so ``target`` is
    left as it was."""
    names = sorted(os.listdir(staging), key=lambda n: n == MANIFEST_FILENAME)
    moved: list[str] = []
    try:
        for entry in names:
            os.rename(os.path.join(staging, entry), os.path.join(target, entry))
            moved.append(entry)
        os.rmdir(staging)
    except BaseException:
        for entry in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(os.path.join(target, entry), os.path.join(staging, entry))
        raise
    return [os.path.join(target, entry) for entry in moved]


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def remove_stale(parent: str, name: str) -> None:
    """Delete staging directories for the same ``dest`` whose process (on this host) is gone."""
    prefix = f".{name}{STAGING_MARK}"
    with contextlib.suppress(OSError):
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix)]
        for entry in entries:
            pid_text, _, rest = entry.name[len(prefix) :].partition("-")
            host = rest.partition("-")[2]
            if not pid_text.isdigit() or host != _host() or _alive(int(pid_text)):
                continue
            if entry.is_dir(follow_symlinks=False):
                log.info("removing %s, left by an interrupted transfer", printable(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
