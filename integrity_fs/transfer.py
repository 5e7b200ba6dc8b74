"""download, upload and copy: move a checkpoint and check it in the same read.

Each file is read once through the pinned reader and hashed as it streams to the destination;
the manifest goes there last, only when every file matched (an unsealed upload source is sealed
from exactly the bytes sent). A failed transfer deletes what it wrote (the folders it made too).

- ``download`` stages the copy beside ``dest`` and renames it into place once it is whole and
  fsynced; into an empty folder (a mount point, perhaps) it stages inside it and moves the
  entries in, the manifest last: ``dest`` holds the verified checkpoint, or is as it was.
- ``upload`` and ``copy`` write in place onto a destination that holds no checkpoint. Onto a
  sealed one (``overwrite=True``) they stage the new checkpoint beside it, seal it there, and
  only then swap it in: on a local disk the entries beside the old checkpoint are linked into
  the staged folder, then two renames (the old checkpoint aside, the new one in place); on an
  object store the old objects are deleted and the staged ones copied by the store itself,
  pinned to the versions staged (a staged object replaced meanwhile: ``FileChangedError``, and
  nothing sealed). The staging folder is deleted only after the new checkpoint is sealed at the
  destination. At every moment one complete, sealed copy exists, old or new, and an error names
  where it is.
- Every precondition is checked before the first change: a local destination whose entries and
  the new files are a file and a folder of one name is refused (``ValueError``); the entries of
  a sealed destination that are not its checkpoint's are kept.
- Staging folders left by killed transfers (see :mod:`.staging`) are removed by the next
  transfer to that destination (again once it has sealed the destination), or by ``prune``:
  never a live one, and never one that is sealed while its destination is not (it may be the
  only copy).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from . import staging, storage
from .errors import FileChangedError, IntegrityError
from .hashing import chunk_range, combine
from .manifest import MANIFEST_FILENAME, Manifest
from .options import SealOptions, VerifyOptions, count, flag
from .report import Problem, Report, printable
from .storage import URL, Stat
from .verify import build_manifest, check_sealable, load_manifest, prepare, write_sealed
from .work import Progress, run_parallel, workers_for

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import SealKeywords

__all__ = ["copy", "download", "upload"]

log = logging.getLogger("integrity_fs")


def _local(path: str | os.PathLike[str], what: str) -> str:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"{what} must be a local path, not {text!r}")
    text = text.removeprefix("file://")
    if not text:
        raise ValueError(f"{what} is empty")
    return os.path.abspath(os.path.expanduser(text))


def _sealed_source(fs: Any, root: str) -> tuple[bytes, Manifest, bytes | None]:
    """The source's manifest bytes (sent unchanged), the manifest, and its signature if any."""
    manifest = load_manifest(fs, root)
    raw = storage.read_file(fs, storage.join(root, MANIFEST_FILENAME))
    try:
        signature: bytes | None = storage.read_file(fs, storage.join(root, storage.SIGNATURE_FILENAME))
    except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError):
        signature = None
    return raw, manifest, signature


@contextlib.contextmanager
def _writing(fs: Any, path: str) -> Iterator[None]:
    """A ``FileNotFoundError`` while writing ``path`` (a bucket, or a folder, not there) names it."""
    try:
        yield
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, f"cannot write {printable(storage.describe(fs, path))}: {exc}") from exc


def _stream(  # noqa: PLR0913  # a copy's two sides, its hashing, and each call's own work
    src: tuple[Any, str],
    listing: Mapping[str, Stat],
    dst: tuple[Any, str],
    algorithm: str,
    chunk_size: int | None,
    *,
    tree: storage.LocalTree | None,
    written: list[str],
    max_workers: int | None,
    callback: Any,
) -> dict[str, tuple[str, ...]]:
    """Every file of ``listing`` from ``src`` to ``dst``, read once (pinned), hashed as it goes:
    name → its unit digests. ``written`` receives each destination path before it is written."""
    names = sorted(listing, key=lambda n: listing[n].size, reverse=True)
    progress = Progress(callback, sum(s.size for s in listing.values()))
    stop = threading.Event()
    lock = threading.Lock()

    def one(name: str) -> tuple[str, ...]:
        path = storage.join(dst[1], name)
        with lock:
            written.append(path)
        with _writing(dst[0], path):
            writer = storage.Writer(dst[0], path, algorithm, chunk_size, tree=tree, rel=name, size=listing[name].size)
        try:
            source = storage.join(src[1], name)
            pieces = storage.read_blocks(
                src[0], source, 0, listing[name].size, version=listing[name].version, stop=stop
            )
            with contextlib.closing(pieces):  # a stream of the store let go at once, whatever happens
                for piece in pieces:
                    with _writing(dst[0], path):
                        writer.write(piece)
                    progress(len(piece))
            with _writing(dst[0], path):
                return writer.close()
        except BaseException:
            writer.abort()
            raise

    results = run_parallel(one, names, workers_for(src[0], max_workers), stop)
    return dict(zip(names, results, strict=True))


def _mismatches(manifest: Manifest, sizes: Mapping[str, int], digests: Mapping[str, tuple[str, ...]]) -> list[Problem]:
    problems = []
    for name, got in sorted(digests.items()):
        chunk = manifest.chunk_size
        actual = got[0] if chunk is None else combine(manifest.algorithm, got, sizes[name], chunk)
        if actual != manifest.files[name]:
            ranges: tuple[tuple[int, int], ...] = ()
            if manifest.chunks is not None and chunk is not None:
                ranges = tuple(
                    chunk_range(sizes[name], chunk, i)
                    for i, (a, b) in enumerate(zip(manifest.chunks[name], got, strict=True))
                    if a != b
                )
            problems.append(Problem(name, "mismatch", manifest.files[name], actual, ranges))
    return problems


def _clear_leftovers(fs: Any, root: str) -> bool:
    """Remove dead staging folders of the destination ``root`` (see :func:`staging.clear`);
    whether a sealed one was kept because ``root`` is not sealed."""
    return staging.clear(fs, storage.parent(root), root.rstrip("/").rsplit("/", 1)[-1])


class _Destination:
    """Where an upload or copy writes: in place, or staged beside a sealed checkpoint (``overwrite``)."""

    def __init__(self, fs: Any, root: str, names: list[str], overwrite: bool) -> None:
        self.fs, self.final = fs, root
        where = storage.describe(fs, root)
        if storage.is_local(fs):
            check_sealable(fs, root, names, "copy to a local disk")
        self.leftovers = _clear_leftovers(fs, root)
        self.staged = staging.sealed_at(fs, root)
        if self.staged and not overwrite:
            raise FileExistsError(f"{where} is already sealed: pass overwrite=True (CLI --force) to replace it")
        self.lease: staging.Lease | None = None
        self.root = root
        self.old: list[str] = []  # the sealed checkpoint's files, replaced by the swap
        self.extra: list[str] = []  # files beside them that are not the checkpoint's: kept
        if self.staged:
            self.old, self.extra = _old_and_extra(fs, root)
            _refuse_clashes(fs, root, self.extra, names, "replace")
            self.extra = [e for e in self.extra if e not in set(names)]
            self.root = storage.join(storage.parent(root), staging.staging_name(root.rstrip("/").rsplit("/", 1)[-1]))
            self.lease = staging.Lease(fs, self.root)
        elif storage.is_local(fs) and os.path.isdir(root) and not os.path.islink(root):
            _refuse_clashes(fs, root, _local_entries(root), names, "copy into")  # a disk cannot hold both
        self.made = _missing(self.root) if storage.is_local(fs) else []  # folders made here: their entries are fsynced
        self.tree = storage.LocalTree(self.root, create=True) if storage.is_local(fs) else None
        self.written: list[str] = []

    def seal(
        self, manifest: Manifest, *, raw: bytes | None = None, signature: bytes | None = None, key: Any = None
    ) -> None:
        """Seal what was written (where it was written); then, staged, swap it in."""
        try:
            if self.tree is not None:
                self.tree.sync()
                for folder in self.made:  # the entry of each folder made, in the folder above it
                    storage.fsync_dir(os.path.dirname(folder))
                _still(self.tree, self.root)
            if not self.staged:  # in place: a failure from here on deletes them too
                self.written += [storage.join(self.root, n) for n in storage.NOT_CONTENT]
            write_sealed(self.fs, self.root, manifest, raw=raw, signature=signature, key=key)
        except BaseException:
            self.abandon()
            raise
        try:
            if self.staged:
                self._swap()
        finally:
            self._close()
        if self.leftovers:  # sealed copies of a killed transfer, kept while this destination was not sealed
            _clear_leftovers(self.fs, self.final)

    def _swap(self) -> None:
        """The sealed staged copy in place of the sealed destination. Locally: the files beside the
        old checkpoint move into the staged folder, the old checkpoint is renamed aside, the staged
        folder's lease is dropped and it is renamed into place, then the old one is deleted. At
        every step a complete sealed copy is at the destination or beside it (a killed swap's
        folders hold no lease, so they are dead; one that is sealed is kept while the destination
        is not). On object stores: the destination is unsealed, the old objects deleted, the staged
        ones copied by the store pinned to the versions staged, and the manifest written last."""
        fs, final, staged = self.fs, self.final, self.root
        try:
            if storage.is_local(fs):
                for extra in self.extra:  # the files that are not the old checkpoint's go with the new one
                    _carry(os.path.join(final, extra), os.path.join(staged, extra))
                old = storage.join(storage.parent(final), staging.staging_name(final.rsplit("/", 1)[-1]))
                os.rename(final, old)
                try:
                    os.unlink(os.path.join(staged, staging.LEASE))  # still locked through the open descriptor
                    os.rename(staged, final)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.rename(old, final)  # the old checkpoint back in its place
                    raise
                storage.fsync_dir(storage.parent(final))
                staging.remove_tree(fs, old)
            else:
                listing = storage.list_files(fs, staged)
                listing.pop(staging.LEASE, None)
                raw = storage.read_file(fs, storage.join(staged, MANIFEST_FILENAME))
                manifest = Manifest.from_json(raw)
                try:
                    signature: bytes | None = storage.read_file(fs, storage.join(staged, storage.SIGNATURE_FILENAME))
                except FileNotFoundError:
                    signature = None
                storage.remove(fs, [storage.join(final, n) for n in storage.NOT_CONTENT])
                storage.remove(fs, [storage.join(final, n) for n in self.old if n not in listing])
                try:
                    _copy_within(fs, staged, final, listing, manifest)
                except Exception as exc:
                    changed = _changed(fs, staged, listing)
                    if changed:
                        where, was = storage.describe(fs, final), "it was" if len(changed) == 1 else "they were"
                        raise FileChangedError(
                            f"replacing {where} failed: {printable(', '.join(changed))} in the staged copy at "
                            f"{storage.describe(fs, staged)} changed after {was} confirmed, so nothing was sealed "
                            f"at {where} (left unsealed)",
                            changed,
                        ) from exc
                    raise
                write_sealed(fs, final, manifest, raw=raw, signature=signature)
                self._close()
                staging.remove_tree(fs, staged)
        except FileChangedError:
            raise
        except BaseException as exc:
            raise OSError(
                f"replacing {storage.describe(fs, final)} failed part-way: the new checkpoint is whole and sealed "
                f"at {storage.describe(fs, staged)} ({type(exc).__name__}: {exc})"
            ) from exc

    def abandon(self) -> None:
        """After a failure before the swap: delete what this transfer wrote."""
        with contextlib.suppress(Exception):
            if self.staged:
                staging.remove_tree(self.fs, self.root)
            elif self.tree is not None:
                for path in self.written:
                    self.tree.unlink(path[len(self.root) + 1 :])
                for folder in reversed(self.tree.made):
                    with contextlib.suppress(OSError):
                        self.tree.rmdir(folder)
                for folder in reversed(self.made):  # the root and the folders above it, where this made them
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
            else:
                storage.remove(self.fs, self.written)
        self._close()

    def _close(self) -> None:
        if self.tree is not None:
            self.tree.close()
            self.tree = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _refuse_clashes(fs: Any, root: str, there: list[str], names: list[str], what: str) -> None:
    """``ValueError`` (before any change) when an entry already at ``root`` and a new file are a
    file (or link) and a folder of one name."""
    new = set(names)
    folders = {n.rsplit("/", 1)[0] for n in new if "/" in n}
    folders |= {f.rsplit("/", i)[0] for f in list(folders) for i in range(1, f.count("/") + 1)}
    for entry in there:
        clash = entry if entry in folders else next((n for n in new if entry.startswith(n + "/")), None)
        if clash is not None:
            raise ValueError(
                f"cannot {what} {storage.describe(fs, root)}: "
                f"{printable(storage.describe(fs, storage.join(root, entry)))} "
                f"(not part of the checkpoint there) and the new {printable(clash)!r} cannot both be there "
                "(a file or link, and a folder, of one name); nothing was changed"
            )


def _old_and_extra(fs: Any, root: str) -> tuple[list[str], list[str]]:
    """The files of the sealed checkpoint at ``root`` (its manifest's, or its signature's), and the others there."""
    try:
        names = set(load_manifest(fs, root).files)
    except FileNotFoundError:
        from . import formats

        names = set(
            formats.load(storage.read_file(fs, storage.join(root, storage.SIGNATURE_FILENAME)), "model_signing").files
        )
    listing = _local_entries(root) if storage.is_local(fs) else list(storage.list_files(fs, root))
    return sorted(n for n in listing if n in names), sorted(n for n in listing if n not in names)


def _carry(src: str, dst: str) -> None:
    """The entry at ``src`` also at ``dst`` (a hard link: a kill at any moment loses neither
    copy; where the disk cannot link, moved)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        os.rename(src, dst)


def _local_entries(root: str) -> list[str]:
    """Every entry under the local folder ``root`` that is not a folder (files, links of any kind,
    FIFOs: what a swap must carry over), links never followed; not the manifest, the signature
    or our temporary files."""
    out = []
    for folder, dirs, files in os.walk(root):  # a link to a folder is listed in dirs, never descended
        rel = os.path.relpath(folder, root)
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(folder, d)))]:
            out.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return [n for n in out if n not in storage.NOT_CONTENT and not n.startswith(storage.listing.TEMP_PREFIX)]


def _missing(folder: str) -> list[str]:
    """The folders that ``os.makedirs(folder)`` would make, outermost first."""
    out = []
    while folder and not os.path.lexists(folder):
        out.append(folder)
        folder = os.path.dirname(folder)
    return out[::-1]


def _replaced(tree: storage.LocalTree, path: str) -> bool:
    """Whether ``path`` is no longer the folder ``tree`` writes beneath (removed, moved, replaced)."""
    try:
        here, now = os.fstat(tree.fd), os.lstat(path)
    except (FileNotFoundError, OSError):
        return True
    return (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino)


def _still(tree: storage.LocalTree, path: str) -> None:
    """``OSError`` unless ``path`` is still the folder ``tree`` writes beneath: nothing is sealed
    in what is there now."""
    if _replaced(tree, path):
        raise OSError(
            f"{path} was removed or replaced while it was written: nothing is written through what is there now"
        )


def _changed(fs: Any, root: str, listing: Mapping[str, Stat]) -> list[str]:
    """The files of ``listing`` that are not at ``root`` now in the version listed (a failed
    listing: none known)."""
    try:
        now = storage.list_files(fs, root)
    except OSError:
        return []
    return [n for n, stat in listing.items() if n not in now or now[n].version != stat.version]


def _copy_within(fs: Any, src: str, dst: str, listing: Mapping[str, Stat], manifest: Manifest) -> None:
    """Each staged file copied to ``dst`` by the store itself, pinned to the version listed (S3,
    GCS); elsewhere streamed through the pinned reader and checked against ``manifest``."""

    def one(name: str) -> None:
        a, b, stat = storage.join(src, name), storage.join(dst, name), listing[name]
        if storage.is_s3(fs):
            parts: list[tuple[int, int, str | None]] = []
            chunks = manifest.chunks[name] if manifest.chunks is not None and manifest.algorithm == "sha256" else ()
            if len(chunks) > 1 and storage.s3.layout(fs, "sha256", manifest.chunk_size, stat.size):
                assert manifest.chunk_size is not None
                parts = [(*chunk_range(stat.size, manifest.chunk_size, i), d) for i, d in enumerate(chunks)]
            elif stat.size > storage.s3.MAX_PART:
                parts = [
                    (s, min(stat.size, s + storage.s3.CRC_PART * 16), None)
                    for s in range(0, stat.size, storage.s3.CRC_PART * 16)
                ]
            storage.s3.copy_object(fs, a, str(stat.version), b, manifest.algorithm, parts)
        elif storage.is_gcs(fs):
            storage.gcs.copy_object(fs, a, str(stat.version), b)
        else:
            digests = _stream(
                (fs, src),
                {name: stat},
                (fs, dst),
                manifest.algorithm,
                manifest.chunk_size,
                tree=None,
                written=[],
                max_workers=1,
                callback=None,
            )
            problems = _mismatches(manifest, {name: stat.size}, digests)
            if problems:
                raise IntegrityError(Report(problems=tuple(problems)), storage.describe(fs, src))

    run_parallel(one, sorted(listing), workers_for(fs, None), threading.Event())


def download(
    url: URL,
    dest: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    max_workers: int | None = None,
    callback: Any = None,
    strict: bool = False,
) -> Report:
    """A verified copy of the sealed checkpoint at ``url`` in the local folder ``dest``, each byte
    read once: afterwards ``dest`` holds every file of the manifest and the manifest, or is as it
    was (absent, or the empty folder it was). Files the manifest does not list are not copied
    (``strict=True``: they fail it). Raises as ``verify``; ``FileExistsError`` when ``dest``
    exists and is not an empty folder; ``ValueError`` when ``url`` and ``dest`` overlap."""
    flag("strict", strict)
    count("max_workers", max_workers)
    target = _local(dest, "dest")
    src_fs, root = storage.resolve(url, storage_options, fs)
    local = storage.resolve(target)[0]
    if storage.overlap(src_fs, root, local, target):
        raise ValueError(f"url {storage.describe(src_fs, root)} and dest {target} overlap: download outside url")
    parent, name = os.path.split(target)
    ours = f".{name}{staging.MARK}"  # a killed download into this empty folder left it
    if os.path.islink(target) or (
        os.path.lexists(target)
        and (not os.path.isdir(target) or any(not e.startswith(ours) for e in os.listdir(target)))
    ):
        raise FileExistsError(f"{target} exists and is not an empty folder: download into a new or empty one")
    raw, manifest, signature = _sealed_source(src_fs, root)
    plan = prepare(src_fs, root, VerifyOptions(strict=strict, manifest=manifest))
    if plan.problems:
        raise IntegrityError(Report(problems=tuple(plan.problems), extra=plan.extra), plan.location)
    listing = {n: plan.listing[n] for n in manifest.files}
    check_sealable(src_fs, root, list(listing), "download")
    # An empty folder (a mount point, perhaps, or in a parent we cannot write) is staged inside and
    # its entries moved in, the manifest last; otherwise the staged folder is renamed into place.
    inside = os.path.isdir(target)
    made = _missing(parent)
    os.makedirs(parent, exist_ok=True)
    for folder in made:  # the entry of each folder made, in the folder above it
        storage.fsync_dir(os.path.dirname(folder))
    if inside:
        for folder, dead in staging.leftovers(local, target, name).items():
            if not dead:
                raise FileExistsError(f"{target} is being filled by another download ({folder} is live)")
            staging.remove_tree(local, os.path.join(target, folder))
        leftovers = False
    else:
        leftovers = _clear_leftovers(local, target)
    stage = os.path.join(target if inside else parent, staging.staging_name(name))
    lease = staging.Lease(local, stage)
    tree = storage.LocalTree(stage)
    try:
        digests = _stream(
            (src_fs, root),
            listing,
            (local, stage),
            manifest.algorithm,
            manifest.chunk_size,
            tree=tree,
            written=[],
            max_workers=max_workers,
            callback=callback,
        )
        problems = _mismatches(manifest, {n: s.size for n, s in listing.items()}, digests)
        if problems:
            raise IntegrityError(
                Report(problems=tuple(problems), extra=plan.extra, files_checked=len(listing)), plan.location
            )
        tree.sync()
        _still(tree, stage)
        write_sealed(local, stage, manifest, raw=raw, signature=signature)
        if inside:
            for entry in sorted(os.listdir(stage), key=lambda e: e in storage.NOT_CONTENT):
                if entry != staging.LEASE:
                    os.rename(os.path.join(stage, entry), os.path.join(target, entry))
            staging.remove_tree(local, stage)
            storage.fsync_dir(target)
        else:
            os.unlink(os.path.join(stage, staging.LEASE))
            os.rename(stage, target)
            storage.fsync_dir(parent)
    except BaseException as exc:
        replaced = isinstance(exc, OSError) and _replaced(tree, stage)
        if not replaced:  # what is there now is not ours to delete
            staging.remove_tree(local, stage)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        if replaced and not isinstance(exc, FileChangedError):
            raise OSError(
                f"{stage} was removed or replaced while the download wrote it: nothing was sealed "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        raise
    finally:
        tree.close()
        lease.release()
    if leftovers:  # sealed copies of a killed download, kept while dest was not sealed
        _clear_leftovers(local, target)
    return Report(extra=plan.extra, files_checked=len(listing), bytes_checked=sum(s.size for s in listing.values()))


def upload(
    src: str | os.PathLike[str],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Unpack[SealKeywords],
) -> Manifest:
    """Copy the local folder ``src`` to ``url``, each byte read once, the manifest last.

    A sealed ``src`` is checked against its manifest on the way (only the files it lists are sent)
    and that manifest is written unchanged; an unsealed one is sealed from the bytes sent (the
    options are :class:`~integrity_fs.SealOptions`' fields). ``FileExistsError`` when ``url`` is
    sealed (a manifest, or a signature alone), unless ``overwrite=True`` (see the module docstring).
    """
    checked = SealOptions.of(**options)
    source = _local(src, "src")
    local = storage.resolve(source)[0]
    dst_fs, root = storage.resolve(url, storage_options, fs)
    if storage.overlap(local, source, dst_fs, root):
        raise ValueError(f"src {source} and url {storage.describe(dst_fs, root)} overlap: upload outside src")
    if os.path.lexists(os.path.join(source, MANIFEST_FILENAME)):
        raw, manifest, signature = _sealed_source(local, source)
        for key in ("algorithm", "granularity", "chunk_size"):
            if key in options and options[key] != getattr(manifest, key):
                raise ValueError(
                    f"{source} is sealed with {key} {getattr(manifest, key)!r} and upload sends its manifest "
                    f"unchanged: leave {key} out, or seal the source again"
                )
        plan = prepare(local, source, VerifyOptions(manifest=manifest))
        if plan.problems:
            raise IntegrityError(Report(problems=tuple(plan.problems), extra=plan.extra), source)
        if plan.extra:
            log.warning(
                "not uploading %d files that %s does not list",
                len(plan.extra),
                printable(os.path.join(source, MANIFEST_FILENAME)),
            )
        listing = {n: plan.listing[n] for n in manifest.files}
        if checked.private_key is not None:
            signature = None
    else:
        raw, manifest, signature = None, None, None
        listing = storage.list_files(local, source)
        check_sealable(local, source, list(listing))
    algorithm = manifest.algorithm if manifest is not None else checked.algorithm
    if checked.private_key is not None and algorithm != "sha256":
        raise ValueError(f"cannot sign a {algorithm} manifest: seal the source with algorithm='sha256' to sign")
    chunk = (
        manifest.chunk_size if manifest is not None else checked.chunk_size if checked.granularity == "chunk" else None
    )
    target = _Destination(dst_fs, root, list(listing), checked.overwrite)
    try:
        digests = _stream(
            (local, source),
            listing,
            (dst_fs, target.root),
            algorithm,
            chunk,
            tree=target.tree,
            written=target.written,
            max_workers=checked.max_workers,
            callback=checked.callback,
        )
        sizes = {n: s.size for n, s in listing.items()}
        if manifest is None:
            manifest = build_manifest(checked, sizes, digests)
        else:
            problems = _mismatches(manifest, sizes, digests)
            if problems:
                raise IntegrityError(Report(problems=tuple(problems)), source)
    except BaseException:
        target.abandon()
        raise
    target.seal(manifest, raw=raw, signature=signature, key=checked.private_key)
    return manifest


def copy(
    src: URL,
    dst: URL,
    *,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    max_workers: int | None = None,
    callback: Any = None,
    overwrite: bool = False,
) -> Report:
    """Copy the sealed checkpoint at ``src`` to ``dst`` (any fsspec URLs), each file verified as it
    streams; the same manifest bytes (and signature) are written at ``dst`` last, only when every
    file matched. ``FileExistsError`` when ``dst`` is sealed, unless ``overwrite=True``;
    ``ValueError`` when they overlap (judged by where the bytes live)."""
    flag("overwrite", overwrite)
    count("max_workers", max_workers)
    src_fs, src_root = storage.resolve(src, src_options)
    dst_fs, dst_root = storage.resolve(dst, dst_options)
    if storage.overlap(src_fs, src_root, dst_fs, dst_root):
        raise ValueError(
            f"src {storage.describe(src_fs, src_root)} and dst {storage.describe(dst_fs, dst_root)} "
            "overlap: copy outside src"
        )
    raw, manifest, signature = _sealed_source(src_fs, src_root)
    plan = prepare(src_fs, src_root, VerifyOptions(manifest=manifest))
    if plan.problems:
        raise IntegrityError(Report(problems=tuple(plan.problems), extra=plan.extra), plan.location)
    listing = {n: plan.listing[n] for n in manifest.files}
    target = _Destination(dst_fs, dst_root, list(listing), overwrite)
    try:
        digests = _stream(
            (src_fs, src_root),
            listing,
            (dst_fs, target.root),
            manifest.algorithm,
            manifest.chunk_size,
            tree=target.tree,
            written=target.written,
            max_workers=max_workers,
            callback=callback,
        )
        problems = _mismatches(manifest, {n: s.size for n, s in listing.items()}, digests)
        if problems:
            raise IntegrityError(
                Report(problems=tuple(problems), extra=plan.extra, files_checked=len(listing)), plan.location
            )
    except BaseException:
        target.abandon()
        raise
    target.seal(manifest, raw=raw, signature=signature)
    return Report(extra=plan.extra, files_checked=len(listing), bytes_checked=sum(s.size for s in listing.values()))
