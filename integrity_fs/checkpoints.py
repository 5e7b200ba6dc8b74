"""The checkpoints of a run: which are there, newest first, and which is the newest one that verifies.

A run's root holds one directory per checkpoint (``step_1000``, ``global_step1000``,
``checkpoint-1000``, ``iter_0001000``, ...). :func:`find_checkpoints` orders them by the numbers in
their names (:mod:`integrity_fs.series`) from one listing; :func:`latest_verified` verifies them
newest first and returns the first that passes, skipping unsealed, invalid and damaged ones with a
WARNING each, and raising storage errors (an outage must not roll a run back). :func:`status` is
the state of every checkpoint at a glance, as data (what ``integrity-fs status`` prints).
Deleting old ones by the same verdicts is :mod:`integrity_fs.retention`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import manifests, signing, storage
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .manifest import Manifest
from .options import VerifyOptions, Work
from .report import Problem, Report, printable
from .runs import Verdict, candidates, checkpoint_names, named, names_or_none, newest_that
from .storage import URL, Callback
from .verification import check

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "BAD_SIGNATURE",
    "CheckpointStatus",
    "find_checkpoints",
    "latest_verified",
    "newest_verified",
    "status",
    "status_at",
    "statuses",
]

log = logging.getLogger("integrity_fs")


#: How :attr:`CheckpointStatus.detail` starts when the verdict is a signature's (``status`` with a key).
BAD_SIGNATURE = "bad signature: "


def find_checkpoints(
    root: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
) -> list[str]:
    """The checkpoint directories directly under ``root``, newest first; one listing, nothing read.

    Newest is the largest number in the name (``step_1000``, ``global_step1000``,
    ``checkpoint-1000``, ``iter_0001000``): of names alike but for their numbers, the last integer
    that differs between them (``ckpt-2000-bf16`` is newer than ``ckpt-1000-bf16``), of a name
    alone in its kind its last integer (:mod:`integrity_fs.series`); ties by name; then the names
    without an integer, in name order. Names starting with ``.`` or ``_`` (staging and hidden
    folders) are left out.
    Returns URLs (``s3://bucket/run/step_1000``), plain paths for local roots. A root that does not
    exist raises ``FileNotFoundError``, a file ``NotADirectoryError``.
    """
    fs_, root_ = storage.resolve(root, storage_options, fs)
    return [url for _path, url in candidates(fs_, root_, checkpoint_names(fs_, root_))]


def latest_verified(
    root: URL,
    *,
    quick: bool = False,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    public_key: signing.PublicKey | None = None,
    callback: Callback | None = None,
) -> tuple[str, Report] | None:
    """The newest checkpoint under ``root`` that verifies, with its report; ``None`` when none does.

    Candidates come from :func:`find_checkpoints` and are verified newest first (``quick`` and
    ``strict`` as for :func:`integrity_fs.verify`). Unsealed (no manifest: a save that died before
    sealing), invalid and damaged ones are skipped, each with a WARNING on the ``integrity_fs``
    logger naming the reason; with ``public_key``, so are checkpoints whose signature is missing, does
    not match, or names another checkpoint (``SignatureError``: ``step_1000``'s signature copied to
    ``step_9000`` is refused there), and those deleted since the listing (a rotation). A storage
    error (``OSError``) is raised, never skipped. A root that does not exist yet (a run that never
    saved) is logged and gives ``None``. ``callback`` goes to each verification in turn (each
    calls ``set_size`` with its own total).
    """
    options = VerifyOptions(strict=strict, quick=quick, public_key=public_key)
    work = Work(max_workers, callback)
    return newest_verified(*storage.resolve(root, storage_options, fs), options, work)


def newest_verified(
    fs: fsspec.AbstractFileSystem, root: str, options: VerifyOptions, work: Work
) -> tuple[str, Report] | None:
    """:func:`latest_verified` at ``root`` of ``fs``: each candidate checked with ``options``
    (with a key, its signature must name it)."""
    found = candidates(fs, root, names_or_none(fs, root))
    return newest_that(found, lambda path: check(fs, path, named(options, path), work))


@dataclass(frozen=True)
class CheckpointStatus:
    """One checkpoint as ``integrity-fs status`` shows it.

    ``files`` and ``bytes`` are what the manifest lists when it is valid (for a manifest without
    sizes, the bytes of its files that are there), otherwise what the directory holds.
    ``problems`` are those of a damaged checkpoint; ``detail`` says in words why the verdict is
    not ``"ok"`` (not part of :meth:`to_dict`, whose keys are the CLI's JSON).
    """

    name: str
    url: str
    sealed: bool
    files: int
    bytes: int
    verdict: Verdict
    problems: tuple[Problem, ...] = ()
    detail: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "sealed": self.sealed,
            "files": self.files,
            "bytes": self.bytes,
            "verdict": self.verdict,
            "problems": [p.to_dict() for p in self.problems],
        }


def status(
    root: URL,
    *,
    full: bool = False,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    public_key: signing.PublicKey | None = None,
) -> list[CheckpointStatus]:
    """Every checkpoint under ``root``, newest first, with its verdict.

    Quick by default (names and sizes against the manifest, no content read); ``full=True`` hashes
    every file. ``callback`` sees one total, the bytes of every valid manifest, and then the bytes
    as they are hashed (``full=True`` only). A checkpoint deleted since the listing (a rotation) is
    left out, with a WARNING. A manifest of an algorithm or granularity this installation cannot
    verify (``NotImplementedError``) makes its checkpoint ``"invalid"``. With ``public_key``, a
    sealed checkpoint whose signature is missing, does not match, or names another checkpoint
    (as :func:`latest_verified` skips them) is ``"damaged"``, its ``detail`` saying why. Raises
    what :func:`find_checkpoints` raises, and ``OSError`` on a storage error.
    """
    options = VerifyOptions(strict=strict, quick=not full, public_key=public_key)
    return status_at(*storage.resolve(root, storage_options, fs), options, Work(max_workers, callback))


def status_at(fs: fsspec.AbstractFileSystem, root: str, options: VerifyOptions, work: Work) -> list[CheckpointStatus]:
    """:func:`status` at ``root`` of ``fs``: each checkpoint judged with ``options`` (hashed
    unless ``options.quick``; with a key, its signature must name it)."""

    def judge_one(path: str, share: Callback | None) -> None:
        check(fs, path, named(options, path), dataclasses.replace(work, callback=share))

    names = checkpoint_names(fs, root)
    return statuses(fs, root, names, judge_one, full=not options.quick, callback=work.callback)


def statuses(
    fs: fsspec.AbstractFileSystem,
    root: str,
    names: Sequence[str],
    judge_one: Callable[[str, Callback | None], object],
    *,
    full: bool = False,
    callback: Callback | None = None,
) -> list[CheckpointStatus]:
    """:func:`status` of the checkpoints ``names`` under ``root``: each one whose manifest is
    valid is judged by ``judge_one(path, callback)``, which raises as :func:`integrity_fs.verify`
    does (``distributed.status`` passes a collective one; ``callback`` sees the bytes it hashes)."""
    paths = {name: storage.join(root, name) for name in names}
    manifests: dict[str, Manifest | Exception] = {}
    for name, path in paths.items():
        with _unless_vanished(fs, path):
            manifests[name] = _manifest_or_error(fs, path)
    share = None
    if full and callback is not None:
        callback.set_size(sum(m.total_bytes or 0 for m in manifests.values() if isinstance(m, Manifest)))
        share = _Share(callback)
    out = []
    for name, manifest in manifests.items():
        path = paths[name]
        with _unless_vanished(fs, path):
            out.append(_status_of(fs, path, name, manifest, judge_one, share))
    return out


@contextlib.contextmanager
def _unless_vanished(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[None]:
    """Swallow (and log) the ``FileNotFoundError`` of a checkpoint deleted since the listing."""
    try:
        yield
    except FileNotFoundError as exc:
        if isinstance(exc, ManifestNotFoundError):
            raise
        url = printable(storage.describe(fs, path))
        log.warning("leaving out %s (vanished since the listing): %s", url, printable(str(exc)))


class _Share(Callback):  # type: ignore[misc]  # fsspec is untyped
    """Passes bytes on to ``parent`` and keeps its total: one bar across several verifications."""

    def __init__(self, parent: Callback) -> None:
        super().__init__()
        self._parent = parent

    def set_size(self, size: int) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        self._parent.relative_update(inc)


def _manifest_or_error(fs: fsspec.AbstractFileSystem, path: str) -> Manifest | Exception:
    """The checkpoint's manifest; or why there is none to use: ``ManifestNotFoundError``, ``ManifestError``,
    or ``NotImplementedError`` (an algorithm or granularity this installation cannot verify, which
    makes that one checkpoint "invalid", not the whole listing fail)."""
    try:
        return manifests.load_manifest(fs, path)
    except (ManifestNotFoundError, ManifestError, NotImplementedError) as exc:
        return exc


def _status_of(
    fs: fsspec.AbstractFileSystem,
    path: str,
    name: str,
    manifest: Manifest | Exception,
    judge_one: Callable[[str, Callback | None], object],
    callback: Callback | None,
) -> CheckpointStatus:
    url = storage.describe(fs, path)
    if isinstance(manifest, ManifestNotFoundError):
        return _from_listing(fs, path, name, url, sealed=False, verdict="unsealed", detail=str(manifest))
    if not isinstance(manifest, Manifest):  # ManifestError, NotImplementedError
        return _from_listing(fs, path, name, url, sealed=True, verdict="invalid", detail=str(manifest))
    files, nbytes = len(manifest.files), manifest.total_bytes
    if nbytes is None:  # a seed manifest has no sizes: count what is there of its files
        listing = storage.list_files(fs, path)
        nbytes = sum(size for file, size in listing.items() if file in manifest.files)
    try:
        judge_one(path, callback)
    except FileChangedError as exc:
        return CheckpointStatus(name, url, True, files, nbytes, "changing", (), str(exc))
    except SignatureError as exc:
        problems = exc.report.problems
        return CheckpointStatus(name, url, True, files, nbytes, "damaged", problems, f"{BAD_SIGNATURE}{exc.detail}")
    except IntegrityError as exc:
        return CheckpointStatus(name, url, True, files, nbytes, "damaged", exc.report.problems, str(exc))
    except ManifestNotFoundError as exc:  # the manifest went away since it was read
        return _from_listing(fs, path, name, url, sealed=False, verdict="unsealed", detail=str(exc))
    except (ManifestError, NotImplementedError) as exc:
        return CheckpointStatus(name, url, True, files, nbytes, "invalid", (), str(exc))
    return CheckpointStatus(name, url, True, files, nbytes, "ok")


def _from_listing(
    fs: fsspec.AbstractFileSystem, path: str, name: str, url: str, *, sealed: bool, verdict: Verdict, detail: str
) -> CheckpointStatus:
    listing = storage.list_files(fs, path)
    return CheckpointStatus(name, url, sealed, len(listing), sum(listing.values()), verdict, (), detail)
