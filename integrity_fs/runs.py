"""A run's checkpoints: the directories under its root, newest first, and what a verification
that raised says of each (skipped, damaged, unsealed, ...).

Internal: shared by ``latest_verified`` and ``status`` (:mod:`integrity_fs.checkpoints`), ``prune``
(:mod:`integrity_fs.retention`), their collectives and ``dcp.load_latest``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

from . import manifests, series, storage
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .manifest import MANIFEST_FILENAME
from .options import VerifyOptions
from .report import printable

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "SKIPPED",
    "Verdict",
    "candidates",
    "checkpoint_names",
    "named",
    "names_or_none",
    "never_sealed",
    "newest_that",
    "signed_name",
    "skip_reason",
    "verdict_of",
]

log = logging.getLogger("integrity_fs")

R = TypeVar("R")

Verdict = Literal["ok", "damaged", "unsealed", "invalid", "changing"]

#: The attribute of each "skipping" log record that holds the skip as data: ``{"url", "reason",
#: "error"}`` (what ``integrity-fs latest --json`` lists).
SKIPPED = "integrity_fs_skipped"


def checkpoint_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The names of the checkpoint directories directly under ``root``, newest first (names
    starting with ``.`` or ``_``, staging and hidden folders, are not checkpoints)."""
    return series.newest_first(n for n in storage.list_dirs(fs, root) if not n.startswith((".", "_")))


def candidates(fs: fsspec.AbstractFileSystem, root: str, names: Sequence[str]) -> list[tuple[str, str]]:
    """The checkpoints ``names`` under ``root`` as ``(path, url)``: the URL is what users see
    (``s3://bucket/run/step_1``; a plain path on local disks)."""
    return [(path, storage.describe(fs, path)) for path in (storage.join(root, name) for name in names)]


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


def named(options: VerifyOptions, path: str) -> VerifyOptions:
    """``options`` for the checkpoint at ``path``: with a key, its signature must name it (see
    :func:`signed_name`)."""
    if options.public_key is None:
        return options
    return dataclasses.replace(options, expected_name=manifests.model_name(path))


def signed_name(path: str, public_key: object) -> str | None:
    """The name a checkpoint's signature must give it, when a key is checked: its directory's
    name (what model_signing and :func:`integrity_fs.seal` record); ``None`` without a key."""
    return None if public_key is None else manifests.model_name(path)


def skip_reason(exc: Exception) -> str | None:
    """Why a candidate is skipped by :func:`newest_that`, or ``None`` when ``exc`` must be raised."""
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


def newest_that(
    found: Sequence[tuple[str, str]], attempt: Callable[[str], R], *, warn: bool = True
) -> tuple[str, R] | None:
    """The first of ``found`` (``(path, url)``, newest first) for which ``attempt(path)``
    returns, with what it returned; ``None`` when none does.

    The one loop of "the newest good checkpoint": ``latest_verified`` (a verification),
    ``distributed.latest_verified`` (a collective one) and ``dcp.load_latest`` (a verified load)
    pass their own ``attempt``. A candidate whose attempt raises what :func:`skip_reason` names is
    skipped, with a WARNING (``warn``) naming the reason (the record's :data:`SKIPPED` attribute
    holds it as data); anything else (a storage error) is raised.
    """
    for path, url in found:
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
