"""The checkpoints of a run: which are there, newest first, and which is the newest one that verifies.

A run's root holds one directory per checkpoint (``step_1000``, ``global_step1000``,
``checkpoint-1000``, ``iter_0001000``, ...). :func:`find_checkpoints` orders them by the numbers in
their names (:mod:`integrity_fs.series`) from one listing; :func:`latest_verified` verifies them
newest first and returns the first that passes, skipping unsealed, invalid and damaged ones with a
WARNING each, and raising storage errors (an outage must not roll a run back). :func:`status` is the state of every
checkpoint at a glance, as data (what ``integrity-fs status`` prints). :func:`prune` deletes old
checkpoints by the same verdicts: it keeps the ``keep_last`` newest ones that verify and deletes
only what is certainly older than each of them, so that damaged or half-written new checkpoints
never make it delete the last good one, and an uncertain order never makes it delete anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import fsspec
from fsspec.callbacks import Callback

from . import manifests, series, signing, storage
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .manifest import MANIFEST_FILENAME, Manifest
from .options import Attested, VerifyOptions, Work
from .report import Problem, Report, printable
from .verify import check, verify, verify_options

__all__ = [
    "BAD_SIGNATURE",
    "DELETABLE",
    "SKIPPED",
    "Action",
    "CheckpointStatus",
    "PruneResult",
    "PruneSettings",
    "Verdict",
    "carry_out",
    "check_keep_last",
    "find_checkpoints",
    "judge",
    "latest_verified",
    "named",
    "never_sealed",
    "newest_that",
    "plan_prune",
    "prune",
    "prune_candidates",
    "prune_settings",
    "same_series",
    "signed_name",
    "status",
    "statuses",
    "verdict_of",
]

log = logging.getLogger("integrity_fs")

URL = str | os.PathLike[str]
R = TypeVar("R")

Verdict = Literal["ok", "damaged", "unsealed", "invalid", "changing"]

#: How :attr:`CheckpointStatus.detail` starts when the verdict is a signature's (``status`` with a key).
BAD_SIGNATURE = "bad signature: "
#: The attribute of each "skipping" log record that holds the skip as data: ``{"url", "reason",
#: "error"}`` (what ``integrity-fs latest --json`` lists).
SKIPPED = "integrity_fs_skipped"


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
    return [checkpoint_url(fs_, storage.join(root_, name)) for name in checkpoint_names(fs_, root_)]


def checkpoint_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The names of the checkpoint directories directly under ``root``, newest first."""
    return series.newest_first(n for n in storage.list_dirs(fs, root) if not n.startswith((".", "_")))


def checkpoint_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` as a URL (``s3://bucket/run/step_1``); a plain path on local disks."""
    return path if storage.is_local(fs) else fs.unstrip_protocol(path)


def names_or_none(fs: fsspec.AbstractFileSystem, root: str, *, warn: bool = True) -> list[str]:
    """:func:`checkpoint_names` for a resume: a root that does not exist yet has no checkpoints.

    A run that has never saved has no directory (on object stores, no object under the prefix);
    that is logged at WARNING (a wrong path shows up there; at INFO unless ``warn``: the ranks
    other than 0 of a job) and answered with no candidates.
    """
    try:
        return checkpoint_names(fs, root)
    except FileNotFoundError as exc:
        where, why = printable(storage.describe(fs, root)), printable(str(exc))
        log.log(logging.WARNING if warn else logging.INFO, "no checkpoints under %s: %s", where, why)
        return []


def skip_reason(exc: Exception) -> str | None:
    """Why a candidate is skipped by :func:`latest_verified`, or ``None`` when ``exc`` must be raised."""
    if isinstance(exc, FileChangedError):  # being written: not an outage, not damage
        return "changed while it was read"
    if isinstance(exc, ManifestNotFoundError):
        return "unsealed"
    if isinstance(exc, ManifestError):
        return "invalid manifest"
    if isinstance(exc, SignatureError):
        return "unsealed" if never_sealed(exc) else "bad signature"
    if isinstance(exc, IntegrityError):
        return "damaged"
    if isinstance(exc, FileNotFoundError):  # listed, then deleted (a rotation): not an outage
        return "vanished"
    return None


def never_sealed(exc: SignatureError) -> bool:
    """Whether a signature check failed on a checkpoint that has neither a signature nor a manifest:
    one never sealed, not one whose signature is bad."""
    return any(p.path == MANIFEST_FILENAME and p.kind == "missing" for p in exc.report.problems)


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
    options = verify_options(strict=strict, quick=quick, public_key=public_key)
    work = Work(max_workers, callback)
    fs_, root_ = storage.resolve(root, storage_options, fs)
    candidates = [
        (storage.join(root_, name), checkpoint_url(fs_, storage.join(root_, name)))
        for name in names_or_none(fs_, root_)
    ]

    def attempt(path: str) -> Report:
        return check(fs_, path, named(options, path), work)

    return newest_that(candidates, attempt)


def named(options: VerifyOptions, path: str) -> VerifyOptions:
    """``options`` for the checkpoint at ``path``: with a key, its signature must name it."""
    if options.key is None:
        return options
    return dataclasses.replace(options, expected_name=manifests.model_name(path))


def signed_name(path: str, public_key: object) -> str | None:
    """The name a checkpoint's signature must give it, when a key is checked: its directory's
    name (what model_signing and :func:`integrity_fs.seal` record); ``None`` without a key."""
    return None if public_key is None else manifests.model_name(path)


def newest_that(
    candidates: Sequence[tuple[str, str]], attempt: Callable[[str], R], *, warn: bool = True
) -> tuple[str, R] | None:
    """The first of ``candidates`` (``(path, url)``, newest first) for which ``attempt(path)``
    returns, with what it returned; ``None`` when none does.

    The one loop of "the newest good checkpoint": ``latest_verified`` (a verification),
    ``distributed.latest_verified`` (a collective one) and ``dcp.load_latest`` (a verified load)
    pass their own ``attempt``. A candidate whose attempt raises what :func:`skip_reason` names is
    skipped, with a WARNING (``warn``) naming the reason (the record's :data:`SKIPPED` attribute
    holds it as data); anything else (a storage error) is raised.
    """
    for path, url in candidates:
        try:
            result = attempt(path)
        except Exception as exc:
            reason = skip_reason(exc)
            if reason is None:
                raise
            if warn:
                skipped = {"url": url, "reason": reason, "error": str(exc)}
                log.warning(
                    "skipping %s (%s): %s", printable(url), reason, printable(str(exc)), extra={SKIPPED: skipped}
                )
            continue
        return url, result
    return None


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
    key = None if public_key is None else signing.load_public_key(public_key)
    fs_, root_ = storage.resolve(root, storage_options, fs)

    def judge_one(path: str, share: Callback | None) -> None:
        verify(
            path,
            fs=fs_,
            max_workers=max_workers,
            callback=share,
            strict=strict,
            quick=not full,
            public_key=key,
            expected_name=signed_name(path, key),
        )

    return statuses(fs_, root_, checkpoint_names(fs_, root_), judge_one, full=full, callback=callback)


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
        url = printable(checkpoint_url(fs, path))
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
    url = checkpoint_url(fs, path)
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


# --- retention ------------------------------------------------------------------------------------

#: What :func:`prune` does with a checkpoint.
Action = Literal["kept", "deleted", "left"]

#: The verdicts of checkpoints older than the oldest kept one that :func:`prune` deletes
#: (``"unsealed"`` too, with ``unsealed=True``); ``"invalid"`` and ``"changing"`` are left.
DELETABLE: tuple[Verdict, ...] = ("ok", "damaged")


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune` kept, deleted and left, each a tuple of URLs, newest first.

    ``kept``: the ``keep_last`` newest checkpoints that verify (and those named in ``keep`` that
    verify); ``deleted``: what was deleted (with ``dry_run``: what a real run deletes); ``left``:
    the rest, neither kept nor deleted (newer than the oldest kept one and not verifying, or
    older and unsealed, invalid or changing, or not certainly older, or without a number in the
    name; all of them when fewer than ``keep_last`` verify).
    ``verdicts``: URL -> ``"ok"``, ``"damaged"``, ``"unsealed"``, ``"invalid"`` or ``"changing"``
    for every checkpoint; ``bytes_freed``: the bytes the deleted checkpoints held (or would free).
    """

    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    left: tuple[str, ...]
    verdicts: dict[str, Verdict]
    bytes_freed: int
    dry_run: bool

    def action(self, url: str) -> Action:
        """``"kept"``, ``"deleted"`` or ``"left"``: what became of the checkpoint at ``url``."""
        return "kept" if url in self.kept else "deleted" if url in self.deleted else "left"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept": list(self.kept),
            "deleted": list(self.deleted),
            "left": list(self.left),
            "verdicts": dict(self.verdicts),
            "bytes_freed": self.bytes_freed,
            "dry_run": self.dry_run,
        }


@dataclass(frozen=True)
class PruneSettings:
    """The checked arguments of a prune that decide the plan (the same on every rank of a collective one)."""

    keep_last: int
    quick: bool = False
    attested: Attested = False
    unsealed: bool = False
    dry_run: bool = False
    keep: tuple[str, ...] = ()  # names of checkpoints never deleted
    match: str | None = None  # the pattern candidate names must match, whole


def prune_settings(
    *,
    keep_last: object,
    quick: bool = False,
    attested: Attested = False,
    unsealed: bool = False,
    dry_run: bool = False,
    keep: Iterable[URL] = (),
    match: str | None = None,
) -> PruneSettings:
    """Check :func:`prune`'s arguments, before anything is listed: ``ValueError`` (``TypeError``) for
    a bad one."""
    check_keep_last(keep_last)
    assert isinstance(keep_last, int)
    if quick and attested:
        raise ValueError("quick and attested exclude each other: quick reads nothing, attested asks the store")
    if attested not in (True, False, "crc"):
        raise ValueError(f"attested must be True, False or 'crc', not {attested!r}")
    if isinstance(keep, (str, os.PathLike)):
        keep = [keep]
    if match is not None:
        try:
            re.compile(match)
        except re.error as exc:
            raise ValueError(f"match is not a regular expression: {match!r} ({exc})") from None
    names = tuple(sorted({_name_of(k) for k in keep}))
    return PruneSettings(keep_last, bool(quick), attested, bool(unsealed), bool(dry_run), names, match)


def check_keep_last(keep_last: object) -> None:
    """``keep_last`` must be an integer of at least 1 (``TypeError``, ``ValueError``)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"keep_last must be an integer, not {type(keep_last).__name__}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}: a prune never deletes every checkpoint")


def _name_of(checkpoint: URL) -> str:
    """The directory name of a checkpoint given by URL, path or name."""
    return os.fspath(checkpoint).replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1]


def prune_candidates(fs: fsspec.AbstractFileSystem, root: str, match: str | None = None) -> list[tuple[str, str]]:
    """The checkpoints a prune considers, ``(path, url)``, newest first: :func:`find_checkpoints`
    (a root that does not exist raises ``FileNotFoundError``), names that fullmatch ``match`` only."""
    pattern = None if match is None else re.compile(match)
    names = [n for n in checkpoint_names(fs, root) if pattern is None or pattern.fullmatch(n)]
    return [(storage.join(root, name), checkpoint_url(fs, storage.join(root, name))) for name in names]


def same_series(path: str) -> str:
    """The ``match`` of a prune after a save to ``path``: the names alike but for their numbers
    (``step_[0-9]+`` for ``run/step_100``), so that other folders beside the run's checkpoints (a
    base model, another run's checkpoints) are never candidates."""
    return series.pattern(manifests.model_name(path))


def verdict_of(exc: Exception) -> Verdict | None:
    """The verdict a judging that raised ``exc`` gives its checkpoint; ``None`` when ``exc`` is to
    be raised (a storage error). Damage includes a bad signature; a checkpoint deleted since the
    listing (``FileNotFoundError``) is ``"changing"``, as one that changed while it was read."""
    if isinstance(exc, FileChangedError):
        return "changing"
    if isinstance(exc, ManifestNotFoundError) or (isinstance(exc, SignatureError) and never_sealed(exc)):
        return "unsealed"
    if isinstance(exc, (ManifestError, NotImplementedError)):
        return "invalid"
    if isinstance(exc, IntegrityError):
        return "damaged"
    if isinstance(exc, FileNotFoundError):
        return "changing"
    return None


def judge(
    candidates: Sequence[tuple[str, str]],
    keep_last: int,
    attempt: Callable[[str, bool], object],
    *,
    warn: bool = True,
) -> list[tuple[str, str, Verdict]]:
    """Every candidate's verdict, newest first: ``attempt(path, full)`` verifies one (raising as
    :func:`integrity_fs.verify` does); ``full`` until ``keep_last`` with a number in their name
    have verified, then names and sizes only (what is older is deleted or left by whether it is
    sealed, not by its content; a name without a number is never kept nor deleted). A storage
    error is raised at once. Verdicts other than ``"ok"`` of fully judged ones are logged at
    WARNING (``warn``)."""
    out: list[tuple[str, str, Verdict]] = []
    verified = 0
    for path, url in candidates:
        full = verified < keep_last and series.has_number(manifests.model_name(path))
        try:
            attempt(path, full)
        except Exception as exc:
            verdict = verdict_of(exc)
            if verdict is None:
                raise
            level = logging.WARNING if full and warn else logging.INFO
            log.log(level, "prune: %s is %s: %s", printable(url), verdict, printable(str(exc)))
        else:
            verdict = "ok"
            verified += full
        out.append((path, url, verdict))
    return out


def plan_prune(
    verdicts: Sequence[tuple[str, Verdict]], *, keep_last: int, unsealed: bool = False, keep: Iterable[str] = ()
) -> dict[str, Action]:
    """What becomes of each checkpoint (``(url, verdict)``, newest first): the rule of :func:`prune`.

    The ``keep_last`` first ``"ok"`` ones with a number in their name are kept; only checkpoints
    certainly older than every kept one (:func:`integrity_fs.series.certainly_older`) are
    deleted, and of those only ``"ok"`` and ``"damaged"`` ones (``"unsealed"`` ones too with
    ``unsealed``); URLs in ``keep`` are never deleted (kept when they verify). Fewer than
    ``keep_last`` verified: nothing is deleted. One that sits below the oldest kept one in the
    order but is not certainly older than every kept one (names not alike, equal or disagreeing
    numbers) is left, with a WARNING saying why (at INFO for a name without a number).
    """
    protected = set(keep)
    names = {url: _name_of(url) for url, _ in verdicts}
    chosen = [url for url, verdict in verdicts if verdict == "ok" and series.has_number(names[url])][:keep_last]
    enough = len(chosen) == keep_last
    kept = [names[url] for url in chosen]
    deletable = (*DELETABLE, "unsealed") if unsealed else DELETABLE
    below = False  # past the oldest kept one, in the order
    plan: dict[str, Action] = {}
    for url, verdict in verdicts:
        plan[url] = "left"
        if url in chosen or (url in protected and verdict == "ok"):
            plan[url] = "kept"
        elif enough and below and url not in protected and verdict in deletable:
            doubt = next(filter(None, (series.uncertainty(names[url], name) for name in kept)), None)
            if doubt is None:
                plan[url] = "deleted"
            else:
                level = logging.WARNING if series.has_number(names[url]) else logging.INFO
                log.log(
                    level,
                    "prune: leaving %s, not certainly older than those kept: %s",
                    printable(url),
                    printable(doubt),
                )
        below = below or (enough and url == chosen[-1])
    return plan


def carry_out(
    fs: fsspec.AbstractFileSystem, root: str, judged: Sequence[tuple[str, str, Verdict]], settings: PruneSettings
) -> PruneResult:
    """The plan for ``judged``, the checkpoints under ``root`` (see :func:`plan_prune`), deleted
    (unless ``dry_run``): every folder to
    delete is listed first, then every manifest and signature goes, then the files (see
    :func:`integrity_fs.storage.remove_folders`)."""
    protected = [url for path, url, _ in judged if manifests.model_name(path) in settings.keep]
    plan = plan_prune(
        [(url, verdict) for _, url, verdict in judged],
        keep_last=settings.keep_last,
        unsealed=settings.unsealed,
        keep=protected,
    )
    doomed = [path for path, url, _ in judged if plan[url] == "deleted"]
    folders = [storage.folder_of(fs, path) for path in doomed]
    verified = sum(verdict == "ok" and series.has_number(manifests.model_name(path)) for path, _, verdict in judged)
    if verified < settings.keep_last:  # a WARNING when that is for want of good ones, not a young run
        log.log(
            logging.WARNING if verified < len(judged) else logging.INFO,
            "prune: %d of the checkpoints under %s verify, fewer than keep_last=%d: nothing deleted",
            verified,
            printable(storage.describe(fs, root)),
            settings.keep_last,
        )
    if folders and not settings.dry_run:
        log.info(
            "prune: deleting %d checkpoints under %s (%d bytes)",
            len(folders),
            printable(storage.describe(fs, root)),
            sum(folder.bytes for folder in folders),
        )
        storage.remove_folders(fs, folders)
        for path in doomed:
            log.info("prune: deleted %s", printable(checkpoint_url(fs, path)))

    def of(action: Action) -> tuple[str, ...]:
        return tuple(url for _, url, _ in judged if plan[url] == action)

    return PruneResult(
        kept=of("kept"),
        deleted=of("deleted"),
        left=of("left"),
        verdicts={url: verdict for _, url, verdict in judged},
        bytes_freed=sum(folder.bytes for folder in folders),
        dry_run=settings.dry_run,
    )


def prune(
    root: URL,
    *,
    keep_last: int,
    quick: bool = False,
    attested: Attested = False,
    unsealed: bool = False,
    dry_run: bool = False,
    public_key: signing.PublicKey | None = None,
    keep: Iterable[URL] = (),
    match: str | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
) -> PruneResult:
    """Delete old checkpoints under ``root``, keeping the ``keep_last`` newest ones that verify.

    Over :func:`find_checkpoints` (newest first), each checkpoint is verified in turn (hashed;
    ``quick``: names and sizes; ``attested``: the store's checksums where they vouch, as for
    :func:`integrity_fs.verify`; with ``public_key``, a checkpoint verifies only when its signature
    does and names it) until ``keep_last`` have verified. Only checkpoints certainly older than
    every one of those are deleted (named alike but for their numbers, each number at most the
    kept one's and one smaller: :mod:`integrity_fs.series`): sealed ones (verified or damaged;
    their names and sizes are compared with their manifest, their content is not read), and
    unsealed ones only with ``unsealed=True``; invalid and changing ones are left. Nothing newer
    than the oldest kept checkpoint is ever deleted, whatever its state (a save in progress, a
    damaged one); nor is a name without a number (``base_model``, ``final``), nor one whose age
    against the kept ones is uncertain (other names, equal numbers: left, with a WARNING). Fewer
    than ``keep_last`` verify: nothing is deleted (logged at WARNING). A storage error while
    judging any checkpoint is raised before anything is deleted.

    Parameters
    ----------
    keep_last: how many verified checkpoints to keep, at least 1 (``ValueError``).
    unsealed: delete unsealed (never sealed, or half-written) checkpoints older than the oldest kept.
    dry_run: delete nothing; the result is the plan a real run carries out.
    keep: checkpoints (URLs, paths or names) never deleted, kept besides when they verify.
    match: a regular expression that candidate names must match whole (others are not touched).
    callback: progress of each verification in turn (each calls ``set_size`` with its total).

    Each checkpoint is deleted signature and manifest first, then its files, then its folder, so
    an interrupted prune leaves unsealed folders, never a sealed one with files missing. Names
    starting with ``.`` or ``_`` are not checkpoints and never touched; on local disks links are
    removed, never followed. A root that does not exist raises ``FileNotFoundError``.
    """
    settings = prune_settings(
        keep_last=keep_last, quick=quick, attested=attested, unsealed=unsealed, dry_run=dry_run, keep=keep, match=match
    )
    options = verify_options(quick=quick, attested=attested, public_key=public_key)
    glance = dataclasses.replace(options, quick=True, attested=False)
    work = Work(max_workers, callback)
    fs_, root_ = storage.resolve(root, storage_options, fs)
    candidates = prune_candidates(fs_, root_, settings.match)

    def attempt(path: str, full: bool) -> None:
        check(fs_, path, named(options if full else glance, path), work)

    return carry_out(fs_, root_, judge(candidates, settings.keep_last, attempt), settings)
