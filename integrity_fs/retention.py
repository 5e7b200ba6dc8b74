"""Retention: delete old checkpoints of a run by the verdicts of :mod:`integrity_fs.checkpoints`.

:func:`prune` keeps the ``keep_last`` newest checkpoints that verify and deletes only what is
certainly older than each of them, so that damaged or half-written new checkpoints never make it
delete the last good one, and an uncertain order never makes it delete anything.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import manifests, series, signing, storage
from .options import Attested, Checked, VerifyOptions, Work, attested_mode, checked, optional
from .report import printable
from .runs import Verdict, candidates, checkpoint_names, named, verdict_of
from .storage import URL
from .verification import check

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback

__all__ = [
    "DELETABLE",
    "Action",
    "PruneResult",
    "PruneSettings",
    "carry_out",
    "check_keep_last",
    "judge",
    "plan_prune",
    "prune",
    "prune_at",
    "prune_candidates",
    "same_series",
]

log = logging.getLogger("integrity_fs")


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


def check_keep_last(name: str, keep_last: object) -> int:
    """``keep_last``, an integer of at least 1 (``TypeError``, ``ValueError``)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"{name} must be an integer, not {type(keep_last).__name__}")
    if keep_last < 1:
        raise ValueError(f"{name} must be at least 1, not {keep_last}: a prune never deletes every checkpoint")
    return keep_last


def _flag(name: str, value: object) -> bool:
    return bool(value)


def _names(name: str, keep: Iterable[URL] | URL) -> tuple[str, ...]:
    """The directory names of checkpoints given by URL, path or name (one, or several)."""
    given = [keep] if isinstance(keep, (str, os.PathLike)) else list(keep)
    return tuple(sorted({_name_of(k) for k in given}))


def _pattern(name: str, match: str) -> str:
    try:
        re.compile(match)
    except re.error as exc:
        raise ValueError(f"{name} is not a regular expression: {match!r} ({exc})") from None
    return match


@dataclass(frozen=True)
class PruneSettings(Checked):
    """The checked arguments of a prune that decide the plan (the same on every rank of a
    collective one): see :func:`prune`. ``keep`` becomes the names of the checkpoints never deleted."""

    keep_last: int = checked(check_keep_last)
    quick: bool = checked(_flag, False)
    attested: Attested = checked(attested_mode, False)
    unsealed: bool = checked(_flag, False)
    dry_run: bool = checked(_flag, False)
    keep: tuple[str, ...] = checked(_names, ())
    match: str | None = checked(optional(_pattern), None)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quick and self.attested:
            raise ValueError("quick and attested exclude each other: quick reads nothing, attested asks the store")

    def judging(self, public_key: signing.PublicKey | None) -> VerifyOptions:
        """How a candidate is judged in full (``public_key``: its signature must verify)."""
        return VerifyOptions(quick=self.quick, attested=self.attested, public_key=public_key)


def _name_of(checkpoint: URL) -> str:
    """The directory name of a checkpoint given by URL, path or name."""
    return os.fspath(checkpoint).replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1]


def prune_candidates(fs: fsspec.AbstractFileSystem, root: str, match: str | None = None) -> list[tuple[str, str]]:
    """The checkpoints a prune considers, ``(path, url)``, newest first: those of
    :func:`~integrity_fs.find_checkpoints` (a root that does not exist raises
    ``FileNotFoundError``) whose names fullmatch ``match``."""
    pattern = None if match is None else re.compile(match)
    return candidates(fs, root, [n for n in checkpoint_names(fs, root) if pattern is None or pattern.fullmatch(n)])


def same_series(path: str) -> str:
    """The ``match`` of a prune after a save to ``path``: the names alike but for their numbers
    (``step_[0-9]+`` for ``run/step_100``), so that other folders beside the run's checkpoints (a
    base model, another run's checkpoints) are never candidates."""
    return series.pattern(manifests.model_name(path))


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
            log.info("prune: deleted %s", printable(storage.describe(fs, path)))

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


def prune(  # noqa: PLR0913  # SPEC's signature
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
    settings = PruneSettings(keep_last, quick, attested, unsealed, dry_run, keep, match)  # type: ignore[arg-type]  # keep: made names
    return prune_at(*storage.resolve(root, storage_options, fs), settings, public_key, Work(max_workers, callback))


def prune_at(
    fs: fsspec.AbstractFileSystem, root: str, settings: PruneSettings, public_key: Any, work: Work
) -> PruneResult:
    """:func:`prune` at ``root`` of ``fs``: each candidate judged with :func:`verification.check
    <integrity_fs.verification.check>` (``public_key``: its signature must verify and name it)."""
    options = settings.judging(public_key)
    glance = dataclasses.replace(options, quick=True, attested=False)
    found = prune_candidates(fs, root, settings.match)

    def attempt(path: str, full: bool) -> None:
        check(fs, path, named(options if full else glance, path), work)

    return carry_out(fs, root, judge(found, settings.keep_last, attempt), settings)
