"""Where ``upload`` and ``copy`` write, what they check there before writing anything, and how a
forced transfer replaces a sealed checkpoint without putting it at risk.

A destination that holds no manifest is written in place. A forced transfer onto a sealed
checkpoint (``overwrite=True``) writes the new files to a staging folder beside it instead
(``.<name>.integrity-fs-partial-<pid>-<token>-<host>``: a name starting with ``.`` is never a
checkpoint), and swaps them in only once every one of them verified and the store lists them
all: the old checkpoint is unsealed (signature, manifest, sidecar deleted), its files that the
new one lacks are deleted, the new files moved in (renamed on a local disk; copied by the store
itself on object stores), the new manifest written last and the staging folder deleted. A
failure before the swap leaves the old checkpoint as it was; during it, the destination unsealed.

A local destination is refused (``ValueError``) when it is a symbolic link or holds one where the
transfer would write, before anything is written; the writes themselves never follow a link at
or under it (see ``storage.local``).

Internal: ``upload`` and ``copy`` call these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any

from .. import manifests, signing, storage
from ..errors import ManifestError
from ..manifest import MANIFEST_FILENAME, Manifest
from ..options import Hashing, VerifyOptions, Work
from ..report import printable, shortened
from ..verification import prepare
from ..work import default_workers, run_parallel
from . import staging
from .streaming import Side

__all__ = ["Destination", "check_no_links"]

log = logging.getLogger("integrity_fs")


class Destination:
    """Where one upload or copy writes: :attr:`side` (``dst`` itself, or the staging folder of a
    forced transfer onto a sealed checkpoint), with :attr:`written` and :attr:`recording` of what
    it wrote. :meth:`seal` ends a transfer whose files all verified, :meth:`abandon` one that
    failed, :meth:`finish` follows a seal.

    ``names``: the files the transfer will write, checked (on a local disk) before anything is.
    ``FileExistsError`` when ``dst`` holds a manifest, unless ``overwrite``.
    """

    def __init__(self, dst: Side, names: Iterable[str], *, overwrite: bool) -> None:
        self.dst = dst
        self._old = _old_files(dst, overwrite)  # None: no manifest there, written in place
        if storage.is_local(dst.fs):
            check_no_links(dst.root, [*names, *storage.NOT_CONTENT, *(self._old or ())])
        self.side = dst if self._old is None else _new_staging(dst)
        self.written = storage.Written(self.side.fs, self.side.root)
        self.recording = storage.WriteRecording(dst.fs)

    @property
    def staged(self) -> bool:
        return self.side is not self.dst

    def seal(
        self,
        manifest: Manifest,
        work: Work,
        *,
        raw: bytes | None = None,
        signature: bytes | None = None,
        key: Any = None,
    ) -> None:
        """Write the manifest (and signature) at ``dst`` over the files sent, last; a staged
        transfer first confirms the staging folder holds every file and swaps it in. On a
        local disk the files are made durable and checked to be in place first."""
        if self.staged:
            sizes = self._confirm_staged(manifest)
            self.written = storage.Written(self.dst.fs, self.dst.root)  # from here on, dst's
            self._swap(manifest, sizes, work)
        dst, written = self.dst, self.written
        path = dst.path(MANIFEST_FILENAME)
        if storage.is_local(dst.fs):
            written.make_parent(path)  # the root of a checkpoint of no files: no file write created it
            written.sync()
            written.check()
        written.started(path)
        if signature is not None or key is not None:
            written.started(dst.path(signing.SIGNATURE_FILENAME))
        manifests.write_sealed(dst.fs, dst.root, manifest, key=key, raw=raw, signature=signature)

    def abandon(self) -> None:
        """After a failure: delete what the transfer wrote (best effort, never raised). Staged,
        the staging folder goes whole; once the swap began, the manifest and signature written
        at ``dst``, which stays unsealed."""
        self.written.remove()
        if self.staged:
            self._remove_staging()

    def finish(self, manifest: Manifest, *, signed: bool = False) -> None:
        """Once sealed: delete the staging folder, and record the destination store's own
        checksums of what was written (S3 and GCS; never fails the transfer). ``signed``: it
        signed with its own key, whose signature ignores the sidecar."""
        if self.staged:
            self._remove_staging()
        if self.recording:
            storage.record_written(self.dst.fs, self.dst.root, manifest, self.recording.computed(), signed=signed)

    def _confirm_staged(self, manifest: Manifest) -> dict[str, int]:
        """The staged files' sizes, once every file the manifest lists is there at its size (and,
        on a local disk, fsynced and still the file written); ``OSError`` otherwise."""
        if storage.is_local(self.side.fs):
            self.written.sync()
            self.written.check()
        plan = prepare(self.side.fs, self.side.root, VerifyOptions(manifest=manifest)).plan
        if plan.problems:
            shown = ", ".join(f"{printable(p.path)}: {p.kind}" for p in plan.problems[:5])
            raise OSError(f"the files staged at {self.side.location} are not all there: {shown}")
        return dict(plan.sizes)

    def _swap(self, manifest: Manifest, sizes: dict[str, int], work: Work) -> None:
        """Replace the checkpoint at ``dst`` with the staged files (its manifest is written next)."""
        dst, fs = self.dst, self.dst.fs
        for name in storage.METADATA_ORDER:  # unsealed from here on
            storage.remove_file(fs, dst.path(name))
        stale = [dst.path(name) for name in sorted(set(self._old or ()) - set(manifest.files))]
        if storage.is_local(fs):
            storage.sync_dirs([dst.root])
            _remove_local(dst.root, stale)
            for name in sorted(sizes):
                self.written.move_in(self.side.root, self.side.path(name), dst.path(name))
            return
        left = storage.remove_files(fs, stale)
        if left:
            raise OSError(f"could not delete {', '.join(map(printable, left[:5]))}, of the checkpoint replaced")
        hashing = Hashing.of(manifest)

        def move(name: str) -> None:
            digests = manifest.chunks[name] if manifest.chunks is not None else (manifest.files[name],)
            storage.copy_within(
                fs,
                self.side.path(name),
                dst.path(name),
                sizes[name],
                hashing,
                digests,
            )

        run_parallel(move, sorted(sizes, key=lambda n: -sizes[n]), work.max_workers or default_workers(fs))

    def _remove_staging(self) -> None:
        try:
            storage.remove_folders(self.side.fs, [storage.folder_of(self.side.fs, self.side.root)])
        except Exception as exc:
            log.warning("could not delete %s, a transfer's staging folder: %s", printable(self.side.location), exc)


def check_no_links(root: str, names: Iterable[str]) -> None:
    """``ValueError`` naming them when the local destination ``root`` is a symbolic link, or holds
    one where a transfer would write a file of ``names`` (at the file's path, or a folder above
    it): a transfer never writes through a link. Nothing is written before this check."""
    if os.path.islink(root):
        raise ValueError(f"{printable(root)} is a symbolic link: a transfer never writes through one; name its target")
    links: list[str] = []
    seen: set[str] = set()
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts) + 1):
            path = os.path.join(root, *parts[:depth])
            if path in seen:
                if path in links:
                    break
                continue
            seen.add(path)
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break
            if stat.S_ISLNK(mode):
                links.append(path)
                break
    if links:
        raise ValueError(
            f"{printable(root)} holds symbolic links where the transfer would write: {shortened(sorted(links), 5)}; "
            "a transfer never "
            "writes through a link: remove them, or choose another destination"
        )


def _old_files(dst: Side, overwrite: bool) -> tuple[str, ...] | None:
    """The files of the checkpoint sealed at ``dst`` (none known when its manifest is not
    valid); ``None`` when ``dst`` holds no manifest. ``FileExistsError`` when it does, unless
    ``overwrite``."""
    path = dst.path(MANIFEST_FILENAME)
    if not storage.exists(dst.fs, path):
        return None
    if not overwrite:
        raise FileExistsError(f"{dst.location} already holds a sealed checkpoint ({MANIFEST_FILENAME})")
    try:
        return tuple(Manifest.from_json(storage.read_file(dst.fs, path)).files)
    except ManifestError as exc:
        log.warning("%s/%s is not a valid manifest (%s): its files are not known", dst.location, MANIFEST_FILENAME, exc)
        return ()


def _new_staging(dst: Side) -> Side:
    """A new staging folder beside ``dst``: inside it where there is no beside on its store (a
    bucket; a local mount point, whose parent is another filesystem, or one whose parent this
    process may not write)."""
    if storage.is_local(dst.fs):
        parent, name = os.path.split(dst.root)
        beside = os.stat(parent).st_dev == os.stat(dst.root).st_dev and os.access(parent, os.W_OK | os.X_OK)
        where = parent if beside else dst.root
        staging.remove_stale(where, name)  # left by a killed transfer
        path = staging.staging_path(where, name)
        os.mkdir(path)
        return Side(dst.fs, path)
    root = dst.root.rstrip("/")
    parent = storage.parent(root)
    where = root if parent == root else parent
    return Side(dst.fs, storage.join(where, staging.staging_name(root.rsplit("/", 1)[-1])))


def _remove_local(root: str, paths: Sequence[str]) -> None:
    """Delete local files below ``root`` (never through a link), then the folders they leave empty."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            storage.unlink_beneath(root, path)
    folders = {os.path.dirname(p) for p in paths}
    for folder in sorted(folders, key=lambda d: -d.count(os.sep)):
        while folder != root and folder.startswith(root + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)
