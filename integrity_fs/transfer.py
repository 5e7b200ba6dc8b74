"""download, upload and copy: move a checkpoint and check it in the same read.

Each file is read once and hashed while it streams to the destination; the manifest is written
there last, and only when every file matched (or, for an unsealed upload source, from exactly the
bytes sent). A reader who finds the manifest at the destination therefore finds a whole copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.callbacks import Callback

from . import manifests, signing, storage
from .errors import IntegrityError, ManifestError
from .hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY, Unit, plan_units
from .manifest import MANIFEST_FILENAME, Manifest
from .options import Hashing, VerifyOptions, Work
from .report import Problem, Report, printable
from .seal import build_manifest, plan_seal, seal_options
from .verify import VerificationPlan, finish_verification, prepare
from .work import default_workers, progress_fn, run_parallel

__all__ = ["STAGING_MARK", "copy", "download", "upload"]

URL = str | os.PathLike[str]

log = logging.getLogger("integrity_fs")

#: Staging directories of ``download`` are named ``.<DEST name><STAGING_MARK><pid>-<token>-<host>``.
STAGING_MARK = ".integrity-fs-partial-"


@dataclass(frozen=True)
class _Copied:
    """What went through one stream: its byte count and one digest per unit (chunk, or whole file)."""

    size: int
    unit_digests: tuple[str, ...]


@dataclass(frozen=True)
class _Resized:
    """The source file does not hold the planned bytes (it changed since the listing): ``size`` now, if known."""

    size: int | None


#: What copying one file gives: what was sent; ``_Resized``; ``None`` when the source vanished.
_Outcome = _Copied | _Resized | None


@dataclass(frozen=True)
class _Side:
    """One end of a transfer: a filesystem, a root inside it, and the root as a URL for messages."""

    fs: fsspec.AbstractFileSystem
    root: str

    @property
    def location(self) -> str:
        return storage.describe(self.fs, self.root)

    def path(self, name: str) -> str:
        if storage.is_local(self.fs):
            return os.path.join(self.root, *name.split("/"))
        return storage.join(self.root, name)


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
    every file matched and the manifest is written; on any failure it is deleted, so ``dest``
    holds the whole verified checkpoint or is as it was (absent, or the empty directory it was).
    Files the manifest does not list are not copied (``strict=True``: they fail it). Raises as
    :func:`~integrity_fs.verify`, and ``FileExistsError`` when ``dest`` exists and is not an empty
    directory (or is a symbolic link), ``ValueError`` when ``dest`` is inside a local ``url``.
    Staging directories that a killed download to the same ``dest`` left behind are removed first.
    """
    target = _local_path(dest, "dest")
    parent, name = os.path.split(target)
    # An empty directory (a mount point, perhaps, or in a parent we may not write) is kept: the
    # files are staged inside it, on its filesystem, and moved up. A new dest is one rename.
    into = os.path.isdir(target) and not os.path.islink(target)
    where = target if into else parent
    _remove_stale_staging(where, name)  # left by a killed download (inside an empty dest: before its check)
    _check_dest(target)
    work = Work(max_workers, callback)
    src = _Side(*storage.resolve(url, storage_options, fs))
    if storage.is_local(src.fs) and _overlaps(src.root, target):
        raise ValueError(f"url {src.location} and dest {target} overlap; download to a location outside url")
    raw, manifest = _load_manifest(src)
    versions: dict[str, storage.Version] = {}
    plan = prepare(src.fs, src.root, VerifyOptions(strict=strict, manifest=manifest), versions=versions).plan
    if plan.problems:  # missing, resized or (strict) extra files: fail before transferring anything
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), src.location)
    signature = _signature_of(src)
    created = [] if into else _makedirs(parent)
    staging = os.path.join(where, f".{name}{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}-{_host()}")
    try:
        os.mkdir(staging)  # not mkdtemp: dest gets the usual permissions once renamed
        dst = _Side(storage.local_filesystem(), staging)
        report = _verified_copy(src, dst, manifest, plan, versions, work)
        manifests.write_sealed(dst.fs, dst.root, manifest, raw=raw, signature=signature)
        if into:
            _move_up(staging, target)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return report


def upload(
    src: str | os.PathLike[str],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    granularity: str = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """Copy the local directory ``src`` to ``url``, each byte read once; the manifest is written last.

    A sealed ``src`` is checked against its own manifest on the way, only the files it lists are
    sent, and that manifest is written unchanged (a damaged ``src`` raises ``IntegrityError`` and
    no manifest is written at ``url``); the seal options must then agree with it or be left at
    their defaults. An unsealed ``src`` is sealed from exactly the bytes sent. ``FileExistsError``
    when ``url`` holds a manifest, unless ``overwrite=True`` (the old manifest is then deleted
    before any file is sent, so a failed upload leaves ``url`` unsealed, never mis-sealed).
    With ``private_key`` (a PEM path or a ``cryptography`` EC key, loaded before anything is
    read), ``model.sig`` is written right after the manifest, signing its digests (those just
    computed, or the checked source manifest's); a signature beside ``src`` is then not copied.
    """
    options = seal_options(algorithm, granularity, chunk_size, overwrite, private_key)
    work = Work(max_workers, callback)
    source = _Side(storage.local_filesystem(), _local_path(src, "src"))
    dst = _Side(*storage.resolve(url, storage_options, fs))
    if storage.is_local(dst.fs) and _overlaps(source.root, dst.root):
        raise ValueError(f"src {source.root} and url {dst.location} overlap; upload to a location outside src")
    versions: dict[str, storage.Version] = {}
    listing = storage.list_files(source.fs, source.root, versions=versions)
    signature = None
    if os.path.lexists(source.path(MANIFEST_FILENAME)):
        raw, manifest = _load_manifest(source)
        _check_options_agree(manifest, algorithm, granularity, chunk_size, source.location)
        if options.key is not None:
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
        _prepare_destination(dst, overwrite)
        _verified_copy(source, dst, manifest, plan, versions, work)
    else:
        hashing = options.hashing
        # The seal's own checks (names, chunk count, signable names), on the source's listing; the
        # sealed destination was refused above.
        planned = plan_seal(source.fs, source.root, dataclasses.replace(options, overwrite=True), sizes=listing)
        _prepare_destination(dst, overwrite)
        outcomes = _stream(source, dst, planned.sizes, hashing, versions, work)
        copied = _sent_as_listed(source, outcomes)
        sizes = {name: c.size for name, c in sorted(copied.items())}
        manifest = build_manifest(hashing, sizes, _unit_digests(hashing, copied))
        raw = None
    _make_local_root(dst)
    manifests.write_sealed(dst.fs, dst.root, manifest, key=options.key, raw=raw, signature=signature)
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
    the manifest does not list are not copied. Raises as :func:`~integrity_fs.verify` (about
    ``src``), and ``FileExistsError`` when ``dst`` holds a manifest, unless ``overwrite=True``.
    """
    work = Work(max_workers, callback)
    source = _Side(*storage.resolve(src, src_options))
    target = _Side(*storage.resolve(dst, dst_options))
    if _overlaps_on(source, target):
        raise ValueError(f"src {source.location} and dst {target.location} overlap; copy to a location outside src")
    raw, manifest = _load_manifest(source)
    versions: dict[str, storage.Version] = {}
    plan = prepare(source.fs, source.root, VerifyOptions(manifest=manifest), versions=versions).plan
    if plan.problems:
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), source.location)
    signature = _signature_of(source)
    _prepare_destination(target, overwrite)
    report = _verified_copy(source, target, manifest, plan, versions, work)
    _make_local_root(target)
    manifests.write_sealed(target.fs, target.root, manifest, raw=raw, signature=signature)
    return report


# --------------------------------------------------------------------------- streaming


def _verified_copy(
    src: _Side,
    dst: _Side,
    manifest: Manifest,
    plan: VerificationPlan,
    versions: Mapping[str, storage.Version],
    work: Work,
) -> Report:
    """Stream the files of ``plan`` from ``src`` to ``dst`` and compare them with ``manifest``;
    ``IntegrityError`` (about ``src``) if any differs, changed size or vanished since the listing."""
    hashing = Hashing.of(manifest)
    outcomes = _stream(src, dst, plan.sizes, hashing, versions, work)
    problems: list[Problem] = []
    for name, outcome in outcomes.items():
        if outcome is None:
            problems.append(Problem(name, "missing", expected=manifest.files[name]))
        elif isinstance(outcome, _Resized):
            problems.append(Problem(name, "size", expected=plan.sizes[name], actual=outcome.size))
    whole = {name: c for name, c in outcomes.items() if isinstance(c, _Copied)}
    digests = _unit_digests(hashing, whole)
    streamed = dataclasses.replace(
        plan,
        problems=plan.problems + tuple(problems),
        sizes={name: c.size for name, c in whole.items()},
        units=tuple(digests),
    )
    report = finish_verification(manifest, streamed, digests)
    if not report.ok:
        raise IntegrityError(report, src.location)
    return report


def _sent_as_listed(src: _Side, outcomes: Mapping[str, _Outcome]) -> dict[str, _Copied]:
    """The files of an unsealed upload, each sent exactly as listed; ``OSError`` otherwise (as ``seal``)."""
    gone = sorted(name for name, outcome in outcomes.items() if outcome is None)
    if gone:
        raise FileNotFoundError(f"files vanished while uploading {src.location}: {', '.join(gone)}")
    resized = sorted(name for name, outcome in outcomes.items() if isinstance(outcome, _Resized))
    if resized:
        raise OSError(f"files changed size while uploading {src.location}: {', '.join(resized)}")
    return {name: c for name, c in outcomes.items() if isinstance(c, _Copied)}


def _stream(
    src: _Side,
    dst: _Side,
    sizes: Mapping[str, int],
    hashing: Hashing,
    versions: Mapping[str, storage.Version],
    work: Work,
) -> dict[str, _Outcome]:
    """Copy exactly ``sizes[name]`` bytes of every file, hashing the same bytes as they pass; one
    progress total.

    Each copy keeps the rules of verify's reads (``storage.copy_file``): the source must end
    there, a stop (Ctrl-C, the first failure) ends every worker within a block or a poll of the
    event loop, transient failures are retried as storage retries reads. Writes go through
    ``storage.SealingWriter``: on S3 they carry the SHA-256 checksums that make the copy
    attestable (``verify(attested=True)``); a copy that fails is aborted, never committed short.
    """
    workers = work.max_workers or max(default_workers(src.fs), default_workers(dst.fs))
    progress = progress_fn(work.callback, sum(sizes.values()))
    stop = threading.Event()

    def one(name: str) -> _Outcome:
        try:
            digests = storage.copy_file(
                src.fs,
                src.path(name),
                dst.fs,
                dst.path(name),
                sizes[name],
                algorithm=hashing.algorithm,
                granularity=hashing.granularity,
                chunk_size=hashing.chunk_size,
                progress=progress,
                version=versions.get(name),
                stop=stop,
            )
        except storage.SizeChangedError as exc:
            return _Resized(exc.size)
        return None if digests is None else _Copied(sizes[name], digests)

    return run_parallel(one, sorted(sizes, key=lambda n: -sizes[n]), workers, stop=stop)


def _unit_digests(hashing: Hashing, copied: Mapping[str, _Copied]) -> dict[Unit, str | None]:
    """The digest of every hashing unit (as seal and verify plan them) of the copied files."""
    sizes = {name: c.size for name, c in sorted(copied.items())}
    return {u: copied[u.name].unit_digests[u.index] for u in plan_units(hashing.granularity, sizes, hashing.chunk_size)}


# --------------------------------------------------------------------------- checks and helpers


def _load_manifest(side: _Side) -> tuple[bytes, Manifest]:
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


def _prepare_destination(dst: _Side, overwrite: bool) -> None:
    """Refuse a sealed destination, or (``overwrite``) unseal it before any file is sent."""
    path = dst.path(MANIFEST_FILENAME)
    if not storage.exists(dst.fs, path):
        return
    if not overwrite:
        raise FileExistsError(f"{dst.location} already holds a sealed checkpoint ({MANIFEST_FILENAME})")
    storage.remove_file(dst.fs, path)
    storage.remove_file(dst.fs, dst.path(signing.SIGNATURE_FILENAME))  # it signed the old content


def _make_local_root(dst: _Side) -> None:
    """Create a local destination root that no file created (a checkpoint of no files), for the manifest."""
    if storage.is_local(dst.fs):
        storage.make_local_parent(dst.path(MANIFEST_FILENAME))


def _signature_of(src: _Side) -> bytes | None:
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


def _check_dest(dest: str) -> None:
    if os.path.islink(dest):  # its target would be checked, but the link itself replaced
        raise FileExistsError(f"{dest} is a symbolic link; download into the directory it points to, or a new path")
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
        raise FileExistsError(f"{dest} already exists and is not an empty directory")


def _makedirs(directory: str) -> list[str]:
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


def _move_up(staging: str, target: str) -> None:
    """Move every entry of ``staging`` into ``target`` (its parent), the manifest last, then remove
    ``staging``; on a failure the entries moved go back, so ``target`` is left as it was."""
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


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _remove_stale_staging(parent: str, name: str) -> None:
    """Delete staging directories for the same ``dest`` whose download process (on this host) is gone."""
    prefix = f".{name}{STAGING_MARK}"
    with contextlib.suppress(OSError):
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix)]
        for entry in entries:
            pid_text, _, rest = entry.name[len(prefix) :].partition("-")
            host = rest.partition("-")[2]
            if not pid_text.isdigit() or host != _host() or _alive(int(pid_text)):
                continue
            if entry.is_dir(follow_symlinks=False):
                log.info("removing %s, left by an interrupted download", printable(entry.path))
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _overlaps(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([a, b]) in (a, b)


def _overlaps_on(a: _Side, b: _Side) -> bool:
    if storage.is_local(a.fs) and storage.is_local(b.fs):
        return _overlaps(a.root, b.root)
    if a.fs is not b.fs:  # fsspec caches instances: another instance is another store or account
        return False
    ra, rb = a.root.rstrip("/") + "/", b.root.rstrip("/") + "/"
    return ra.startswith(rb) or rb.startswith(ra)
