"""download, upload and copy: move a checkpoint and check it in the same read.

Each file is read once and hashed while it streams to the destination; the manifest is written
there last, and only when every file matched (or, for an unsealed upload source, from exactly the
bytes sent). A reader who finds the manifest at the destination therefore finds a whole copy. A
transfer that fails deletes what it wrote; on a local disk, what it wrote is fsynced (files, then
directories) before the manifest goes over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

from .. import manifests, signing, storage
from ..errors import IntegrityError, ManifestError
from ..hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY
from ..manifest import MANIFEST_FILENAME, Manifest
from ..options import Algorithm, Granularity, SealOptions, VerifyOptions, Work
from ..report import Report, printable
from ..sealing import build_manifest, plan_seal
from ..storage import URL
from ..verification import prepare
from . import staging
from .destination import Destination
from .staging import STAGING_MARK
from .streaming import Side, sent_as_listed, stream, unit_digests, verified_copy

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback

__all__ = ["STAGING_MARK", "copy", "download", "upload"]


log = logging.getLogger("integrity_fs")


# --------------------------------------------------------------------------- public API


def download(
    url: URL,
    dest: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    strict: bool = False,
) -> Report:
    """Copy the sealed checkpoint at ``url`` into the local directory ``dest``, verifying as it streams.

    Files go to a staging directory beside a new ``dest`` (inside an empty one: a mount point stays
    one) that becomes ``dest`` (one rename; its entries moved up, the manifest last) only when
    every file matched, was fsynced and is still there, and the manifest is written; on any
    failure it is deleted, so ``dest`` holds the whole verified checkpoint or is as it was
    (absent, or the empty directory it was). Files the manifest does not list are not copied
    (``strict=True``: they fail it). Raises as :func:`~integrity_fs.verify`, and
    ``FileExistsError`` when ``dest`` exists and is not an empty directory (or is a symbolic
    link), ``ValueError`` when ``dest`` and ``url`` overlap or when the checkpoint holds a file
    and a folder of one name (``sub`` and ``sub/x``, which a local directory cannot hold).
    Staging directories that a killed download to the same ``dest`` left behind are removed first.
    """
    target = _local_path(dest, "dest")
    parent, name = os.path.split(target)
    # An empty directory (a mount point, perhaps, or in a parent we may not write) is kept: the
    # files are staged inside it, on its filesystem, and moved up. A new dest is one rename.
    into = os.path.isdir(target) and not os.path.islink(target)
    where = target if into else parent
    staging.remove_stale(where, name)  # left by a killed download (inside an empty dest: before its check)
    staging.check_dest(target)
    work = Work(max_workers, callback)
    src = Side(*storage.resolve(url, storage_options, fs))
    local = storage.local_filesystem()
    if storage.overlap(src.fs, src.root, local, target):
        raise ValueError(f"url {src.location} and dest {target} overlap; download to a location outside url")
    raw, manifest = _load_manifest(src)
    versions: dict[str, storage.Version] = {}
    plan = prepare(src.fs, src.root, VerifyOptions(strict=strict, manifest=manifest), versions=versions).plan
    if plan.problems:  # missing, resized or (strict) extra files: fail before transferring anything
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), src.location)
    storage.check_no_clashes(src.fs, src.root, plan.sizes, "download")
    signature = _signature_of(src)
    created = [] if into else staging.make_dirs(parent)
    stage = staging.staging_path(where, name)
    placed: list[str] = []  # what is in dest already, ours: removed if the last check fails
    try:
        os.mkdir(stage)  # not mkdtemp: dest gets the usual permissions once renamed
        dst = Side(local, stage)
        written = storage.Written(local, stage)
        report = verified_copy(src, dst, manifest, plan, versions, work, written)
        written.sync()
        written.check()  # before the manifest goes over them: the staged files are all there
        manifests.write_sealed(dst.fs, dst.root, manifest, raw=raw, signature=signature)
        if into:
            placed = staging.move_up(stage, target)
            storage.sync_dirs([target])
        else:
            os.rename(stage, target)
            placed = [target]
            storage.sync_dirs(sorted({parent} | {os.path.dirname(d) for d in created}))
        written.check(lambda path: target + path[len(stage) :])
    except BaseException:
        for path in placed:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _unlink(path)
        shutil.rmtree(stage, ignore_errors=True)
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return report


def upload(  # noqa: PLR0913  # SPEC's signature
    src: str | os.PathLike[str],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    granularity: Granularity = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """Copy the local directory ``src`` to ``url``, each byte read once; the manifest is written last.

    A sealed ``src`` is checked against its own manifest on the way, only the files it lists are
    sent, and that manifest is written unchanged (a damaged ``src`` raises ``IntegrityError``);
    the seal options must then agree with it or be left at their defaults. An unsealed ``src`` is
    sealed from exactly the bytes sent. ``FileExistsError`` when ``url`` holds a manifest, unless
    ``overwrite=True``: the new checkpoint is then staged beside the old one and swapped in once
    it verified, so a failed upload leaves the old one as it was (see ``destination``). A failed
    upload deletes every file it wrote (one of the same name that was there before included); a
    local ``url`` that is a link, or holds one where a file would go, is a ``ValueError`` before
    anything is written. With ``private_key``
    (a PEM path or a ``cryptography`` EC key, loaded before anything is read), ``model.sig`` is
    written right after the manifest, signing its digests (those just computed, or the checked
    source manifest's); a signature beside ``src`` is then not copied, else it is carried along.
    """
    options = SealOptions(
        algorithm=algorithm,
        granularity=granularity,
        chunk_size=chunk_size,
        overwrite=overwrite,
        private_key=private_key,
    )
    work = Work(max_workers, callback)
    source = Side(storage.local_filesystem(), _local_path(src, "src"))
    dst = Side(*storage.resolve(url, storage_options, fs))
    if storage.overlap(source.fs, source.root, dst.fs, dst.root):
        raise ValueError(f"src {source.root} and url {dst.location} overlap; upload to a location outside src")
    versions: dict[str, storage.Version] = {}
    listing = storage.list_files(source.fs, source.root, versions=versions)
    if os.path.lexists(source.path(MANIFEST_FILENAME)):
        raw, manifest = _load_manifest(source)
        _check_options_agree(manifest, algorithm, granularity, chunk_size, source.location)
        signature = None
        if options.private_key is not None:
            signing.check_signable(manifest.algorithm, manifest.granularity)
            signing.check_shard_names(manifest.granularity, dict(manifest.sizes or listing))
        else:
            signature = _signature_of(source)
        plan = prepare(source.fs, source.root, VerifyOptions(manifest=manifest), sizes=listing).plan
        if plan.problems:
            raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), source.location)
        if plan.extra:
            log.warning(
                "not uploading %d files that %s/%s does not list: %s",
                len(plan.extra),
                printable(source.location),
                MANIFEST_FILENAME,
                ", ".join(map(printable, plan.extra[:5])) + (" ..." if len(plan.extra) > 5 else ""),
            )
        target = Destination(dst, plan.sizes, overwrite=overwrite)
        try:
            verified_copy(source, target.side, manifest, plan, versions, work, target.written, target.recording)
            target.seal(manifest, work, raw=raw, signature=signature, key=options.private_key)
        except BaseException:
            target.abandon()
            raise
        target.finish(manifest, signed=options.private_key is not None)
        return manifest
    hashing = options.hashing
    # The seal's own checks (names, chunk count, signable names), on the source's listing; the
    # sealed destination was refused above.
    planned = plan_seal(source.fs, source.root, dataclasses.replace(options, overwrite=True), sizes=listing)
    target = Destination(dst, planned.sizes, overwrite=overwrite)
    try:
        streamed = stream(source, target.side, planned.sizes, hashing, versions, work, target.written, target.recording)
        copied = sent_as_listed(source, streamed)
        sizes = {name: c.size for name, c in sorted(copied.items())}
        manifest = build_manifest(hashing, sizes, unit_digests(hashing, copied))
        target.seal(manifest, work, key=options.private_key)
    except BaseException:
        target.abandon()
        raise
    target.finish(manifest, signed=options.private_key is not None)
    return manifest


def copy(
    src: URL,
    dst: URL,
    *,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
) -> Report:
    """Copy the sealed checkpoint at ``src`` to ``dst`` (any fsspec URLs), verifying each file as it streams.

    The same manifest bytes are written at ``dst`` last, and only when every file matched; files
    the manifest does not list are not copied. A failed copy deletes every file it wrote (one of
    the same name that was there before included). Raises as :func:`~integrity_fs.verify`
    (about ``src``), ``FileExistsError`` when ``dst`` holds a manifest, unless ``overwrite=True``
    (then staged beside it and swapped in once verified, as for :func:`upload`), and
    ``ValueError`` when ``src`` and ``dst`` overlap (judged by where their bytes live, not by
    their options) or a local ``dst`` cannot hold the checkpoint's names, is a link or holds one
    where a file would go.
    """
    work = Work(max_workers, callback)
    source = Side(*storage.resolve(src, src_options))
    target = Side(*storage.resolve(dst, dst_options))
    if storage.overlap(source.fs, source.root, target.fs, target.root):
        raise ValueError(f"src {source.location} and dst {target.location} overlap; copy to a location outside src")
    raw, manifest = _load_manifest(source)
    versions: dict[str, storage.Version] = {}
    plan = prepare(source.fs, source.root, VerifyOptions(manifest=manifest), versions=versions).plan
    if plan.problems:
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), source.location)
    if storage.is_local(target.fs):
        storage.check_no_clashes(source.fs, source.root, plan.sizes, "copy to a local disk")
    signature = _signature_of(source)
    into = Destination(target, plan.sizes, overwrite=overwrite)
    try:
        report = verified_copy(source, into.side, manifest, plan, versions, work, into.written, into.recording)
        into.seal(manifest, work, raw=raw, signature=signature)
    except BaseException:
        into.abandon()
        raise
    into.finish(manifest)
    return report


# --------------------------------------------------------------------------- checks and helpers


def _load_manifest(side: Side) -> tuple[bytes, Manifest]:
    """The manifest's exact bytes (copied unchanged) and its parsed form."""
    try:
        raw = storage.read_file(side.fs, storage.join(side.root, MANIFEST_FILENAME))
    except OSError:
        manifests.load_manifest(side.fs, side.root)  # raises the library's error for this case (not found, ...)
        raise
    try:
        return raw, Manifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"{side.location}/{MANIFEST_FILENAME}: {exc}") from exc


def _check_options_agree(
    manifest: Manifest, algorithm: str, granularity: str, chunk_size: int | None, location: str
) -> None:
    """A sealed source keeps its manifest: seal options that ask for another one are an error, not ignored."""
    wanted = {"algorithm": (algorithm, DEFAULT_ALGORITHM), "granularity": (granularity, DEFAULT_GRANULARITY)}
    for key, (value, default) in wanted.items():
        if value != default and value != getattr(manifest, key):
            raise ValueError(
                f"{location} is sealed with {key} {getattr(manifest, key)!r}, and upload sends its manifest "
                f"unchanged: leave {key} at its default or re-seal the source"
            )
    if chunk_size is not None and chunk_size != manifest.chunk_size:
        raise ValueError(
            f"{location} is sealed with chunk_size {manifest.chunk_size}, and upload sends its manifest "
            "unchanged: leave chunk_size unset or re-seal the source"
        )


def _signature_of(src: Side) -> bytes | None:
    """The source's ``model.sig``, to carry along unchanged (``verify(public_key=)`` checks it
    wherever it lands); ``None`` when it has none."""
    try:
        return storage.read_file(src.fs, src.path(signing.SIGNATURE_FILENAME))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _local_path(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as an absolute local path (``file://`` accepted); a remote URL is a ``ValueError``."""
    text = os.fspath(path)
    if "://" in text:
        if not text.startswith("file://"):
            raise ValueError(f"{what} must be a local path, not {text!r}")
        text = text[len("file://") :]
    if not text:
        raise ValueError(f"{what} is empty")
    return os.path.abspath(os.path.expanduser(text))


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
