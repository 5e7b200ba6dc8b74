"""``seal``, ``verify``, ``latest_verified`` and ``prune`` as collectives over ``torch.distributed``:
every rank reaches the same verdict, or raises the same exception.

- ``mode="sharded"`` (default): every rank lists the checkpoint and the ranks compare what they
  see (names, sizes, and modification times or versions: never an OK built from different
  copies); each rank hashes its share of the units; the digests are gathered and every rank
  computes the same report. ``mode="rank0"``: rank 0 does all the I/O; the outcome is sent to all.
- Every step runs on every rank inside one agreement: a failure on one rank (a bad argument,
  ranks passing different modes or options, Ctrl-C) makes every rank raise after the same
  collectives; none is left waiting.
- Without an initialised process group of more than one rank, these are the local functions.
The keywords are the local function's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from . import runs, storage
from .collectives import MODES, agree, check_same, gather, group_of, rank
from .errors import IntegrityError
from .hashing import plan_units
from .manifest import MANIFEST_FILENAME, Manifest
from .options import SealOptions, VerifyOptions, count, flag
from .report import PruneResult, Report
from .storage import URL, Stat
from .verify import attest, build_manifest, check, check_sealable, finish, hash_units, prepare, seal_root, write_sealed
from .work import log_done

__all__ = ["latest_verified", "prune", "seal", "verify"]


def _mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    return str(mode)


def _fingerprint(options: Any) -> tuple[Any, ...]:
    """What ranks must agree on: every option but the per-rank ones (progress, workers, a key)."""
    skip = {"callback", "max_workers", "private_key", "public_key"}
    return tuple((f.name, repr(getattr(options, f.name))) for f in dataclasses.fields(options) if f.name not in skip)


def _view(fs: Any, listing: dict[str, Stat]) -> tuple[Any, ...]:
    """What ranks on different machines can compare: names, sizes, and times (local) or versions."""
    local = storage.is_local(fs)
    return tuple((n, s.size, s.mtime if local else s.version) for n, s in listing.items())


def _start(g: Any, url: URL, storage_options: Any, fs: Any, mode: str, make: Any, what: str) -> tuple[Any, str, Any]:
    """The first agreement: arguments checked on every rank, then the same mode and options everywhere."""
    fs_, root, options = agree(g, lambda: (*storage.resolve(url, storage_options, fs), make(_mode(mode))))
    check_same(g, (mode, _fingerprint(options)), f"the mode and options of {what}")
    return fs_, root, options


def _shares(g: Any, units: list[Any]) -> list[Any]:
    """This rank's share of the units, largest first, dealt round-robin."""
    world = len(gather(g, None))
    return sorted(units, key=lambda u: (-u.length, u.name, u.index))[rank(g) :: world]


def _verify(g: Any, fs: Any, root: str, options: VerifyOptions, mode: str) -> Report:
    """The verification at ``root`` as a collective (every rank returns the same or raises the same)."""
    if mode == "rank0":
        return agree(g, lambda: check(fs, root, options), only=0)  # type: ignore[no-any-return]
    started = time.perf_counter()
    plan = agree(g, lambda: prepare(fs, root, options))
    check_same(g, _view(fs, plan.listing), f"the files under {plan.location} (every rank must see the same storage)")
    if options.attested:
        plan.attested = agree(g, lambda: (attest(fs, root, plan), plan.attested)[1], only=0)
        plan.units = [u for u in plan.units if u.name not in plan.attested]
    mine = _shares(g, plan.units)
    digests: dict[Any, str] = {}
    for part in agree(g, lambda: hash_units(fs, root, plan.manifest.algorithm, mine, plan.listing, max_workers=options.max_workers, callback=options.callback), every=True):
        digests.update(part)
    report = finish(plan, digests)
    if not report.ok:
        raise IntegrityError(report, plan.location)
    log_done("verified", plan.location, report.files_checked, report.bytes_checked, started)
    return report


def verify(url: URL, *, group: Any = None, mode: str = "sharded", storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Any) -> Report:
    """:func:`integrity_fs.verify` as a collective (see the module docstring)."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return check(*storage.resolve(url, storage_options, fs), VerifyOptions(**options))
    fs_, root, checked = _start(g, url, storage_options, fs, mode, lambda m: VerifyOptions(**options), "verify")
    return _verify(g, fs_, root, checked, mode)


def seal(url: URL, *, group: Any = None, mode: str = "sharded", storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Any) -> Manifest:
    """:func:`integrity_fs.seal` as a collective: rank 0 writes the manifest once every rank's
    share is hashed; every rank returns it."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return seal_root(*storage.resolve(url, storage_options, fs), SealOptions(**options))
    fs_, root, checked = _start(g, url, storage_options, fs, mode, lambda m: SealOptions(**options), "seal")
    if mode == "rank0":
        return agree(g, lambda: seal_root(fs_, root, checked), only=0)  # type: ignore[no-any-return]

    def survey() -> dict[str, Stat]:
        if not checked.overwrite and storage.exists(fs_, storage.join(root, MANIFEST_FILENAME)):
            raise FileExistsError(f"{storage.describe(fs_, root)} is already sealed: pass overwrite=True (CLI --force) to seal it again")
        listing = storage.list_files(fs_, root)
        check_sealable(fs_, root, list(listing))
        return listing

    listing = agree(g, survey)
    check_same(g, _view(fs_, listing), f"the files under {storage.describe(fs_, root)} (every rank must see the same storage)")
    mine = _shares(g, plan_units({n: s.size for n, s in listing.items()}, checked.chunk_size))
    digests: dict[Any, str] = {}
    for part in agree(g, lambda: hash_units(fs_, root, checked.algorithm, mine, listing, max_workers=checked.max_workers, callback=checked.callback), every=True):
        digests.update(part)
    by_file: dict[str, list[str]] = {n: [] for n in listing}
    for unit in sorted(digests, key=lambda u: (u.name, u.index)):
        by_file[unit.name].append(digests[unit])
    manifest = build_manifest(checked, {n: s.size for n, s in listing.items()}, by_file)
    agree(g, lambda: write_sealed(fs_, root, manifest, key=checked.private_key), only=0)
    return manifest


def _judge(g: Any, mode: str) -> Any:
    """A verdict every rank reaches together: the listing's by rank 0, the hashing shared."""

    def judge(fs: Any, path: str, options: VerifyOptions) -> runs.Judged:
        base = agree(g, lambda: runs.survey(fs, path, options)[0], only=0)
        if base.verdict:
            return base  # type: ignore[no-any-return]
        return runs.verdict(base, lambda: _verify(g, fs, path, options, mode), options.quick)

    return judge


def latest_verified(
    root: URL, *, group: Any = None, mode: str = "sharded", pattern: str | None = None, storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Any
) -> tuple[str, Report] | None:
    """:func:`integrity_fs.latest_verified` as a collective: the same answer on every rank."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.latest_verified(root, pattern=pattern, storage_options=storage_options, fs=fs, **options)
    fs_, root_, checked = _start(g, root, storage_options, fs, mode, lambda m: VerifyOptions(**options), "latest_verified")
    found = agree(g, lambda: runs.candidates_of(fs_, root_, pattern), only=0)
    return runs.latest(fs_, root_, pattern, checked, _judge(g, mode), found)


def status(root: URL, *, group: Any = None, mode: str = "sharded", pattern: str | None = None, storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Any) -> list[dict[str, Any]]:
    """The rows of ``integrity-fs status`` (see ``runs.status``), agreed by every rank."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.status(*storage.resolve(root, storage_options, fs), pattern, VerifyOptions(**options))
    fs_, root_, checked = _start(g, root, storage_options, fs, mode, lambda m: VerifyOptions(**options), "status")
    found = agree(g, lambda: runs.candidates_of(fs_, root_, pattern), only=0)
    from .staging import leftovers

    left = agree(g, lambda: leftovers(fs_, root_), only=0)
    return runs.status(fs_, root_, pattern, checked, _judge(g, mode), found, left)


def prune(
    root: URL,
    *,
    group: Any = None,
    mode: str = "sharded",
    keep_last: int,
    pattern: str | None = None,
    unsealed: bool = False,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Any,
) -> PruneResult:
    """:func:`integrity_fs.prune` as a collective: verdicts agreed by every rank, rank 0 deletes,
    the same result or the same error everywhere."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.prune(root, keep_last=keep_last, pattern=pattern, unsealed=unsealed, dry_run=dry_run, storage_options=storage_options, fs=fs, **options)

    def make(m: str) -> VerifyOptions:
        count("keep_last", keep_last, optional=False)
        flag("unsealed", unsealed)
        flag("dry_run", dry_run)
        return VerifyOptions(**options)

    fs_, root_, checked = _start(g, root, storage_options, fs, mode, make, "prune")
    check_same(g, (keep_last, pattern, unsealed, dry_run), "the arguments of prune")
    found = agree(g, lambda: runs.candidates_of(fs_, root_, pattern), only=0)
    planned = runs.prune_root(fs_, root_, keep_last=keep_last, pattern=pattern, unsealed=unsealed, dry_run=True, options=checked, judge_fn=_judge(g, mode), candidates=found)
    if dry_run:
        return planned

    def delete() -> PruneResult:
        for url in planned.deleted:
            runs.delete_checkpoint(fs_, storage.join(root_, url.rstrip("/").rsplit("/", 1)[-1]))
        return dataclasses.replace(planned, dry_run=False)

    return agree(g, delete, only=0)  # type: ignore[no-any-return]
