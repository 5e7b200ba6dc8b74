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
import logging
import time
from typing import Any

from . import runs, staging, storage
from .collectives import MODES, agree, by_rank, check_same, fingerprint, gather, group_of, logged_once, rank, ranks
from .errors import IntegrityError
from .hashing import plan_units
from .manifest import MANIFEST_FILENAME, Manifest
from .options import SealOptions, VerifyOptions, count, flag
from .report import PruneResult, Report, printable
from .storage import URL, Stat
from .verify import attest, build_manifest, check, check_sealable, finish, hash_units, prepare, seal_root, write_sealed
from .work import log_done

__all__ = ["latest_verified", "prune", "seal", "verify"]

log = logging.getLogger("integrity_fs")


def _mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    return str(mode)


def _view(fs: Any, listing: dict[str, Stat]) -> dict[str, tuple[int, Any]]:
    """What ranks on different machines can compare: names, sizes, and times (local) or versions."""
    local = storage.is_local(fs)
    return {n: (s.size, s.mtime if local else s.version) for n, s in listing.items()}


def _check_views(g: Any, fs: Any, listing: dict[str, Stat], location: str) -> None:
    """``OSError`` on every rank, with one message, when ranks see different files (sharded mode
    would add up digests of different copies)."""
    seen = gather(g, (location, _view(fs, listing)))
    views = [v for _, v in seen]
    if all(v == views[0] for v in views):
        return
    groups: list[list[int]] = []
    for r, v in enumerate(views):
        group = next((grp for grp in groups if views[grp[0]] == v), None)
        group.append(r) if group is not None else groups.append([r])
    other = groups[1][0]
    a, b = views[0], views[other]
    name = sorted(set(a) ^ set(b) or {n for n in a if a[n] != b[n]})[0]
    if name not in a or name not in b:
        differs = f"{name} is on rank {0 if name in a else other} only"
    elif a[name][0] != b[name][0]:
        differs = f"{name} holds {a[name][0]} bytes on rank 0, {b[name][0]} on rank {other}"
    else:
        differs = f"{name} was written at another time (or is another version) on rank {other} than on rank 0"
    agree_ = " | ".join(ranks(grp) for grp in groups)
    raise OSError(
        f"ranks see different files under {seen[0][0]} (as rank 0 names it): {differs}; ranks that agree: {agree_}. "
        "Sharded mode needs every rank to see the same shared storage; with node-local copies, use mode='rank0'"
    )


def _start(g: Any, url: URL, storage_options: Any, fs: Any, mode: str, make: Any, what: str) -> tuple[Any, str, Any]:
    """The first agreement: arguments checked on every rank, then the same mode and options everywhere."""
    fs_, root, options = agree(g, lambda: (*storage.resolve(url, storage_options, fs), make(_mode(mode))))
    check_same(g, {"mode": mode, **dict(fingerprint(options))}, f"the arguments of {what}")
    return fs_, root, options


def _shares(g: Any, units: list[Any]) -> list[Any]:
    """This rank's share of the units, largest first, dealt round-robin."""
    world = len(gather(g, None))
    return sorted(units, key=lambda u: (-u.length, u.name, u.chunk))[rank(g) :: world]


def _verify(g: Any, fs: Any, root: str, options: VerifyOptions, mode: str) -> Report:
    """The verification at ``root`` as a collective (every rank returns the same or raises the same)."""
    if mode == "rank0":
        return agree(g, lambda: check(fs, root, options), only=0)  # type: ignore[no-any-return]
    started = time.perf_counter()
    plan = agree(g, lambda: prepare(fs, root, options))
    _check_views(g, fs, plan.listing, plan.location)
    if options.attested:

        def attested() -> dict[str, str]:
            attest(fs, root, plan)
            return dict(plan.attested)

        plan.attested = agree(g, attested, only=0)
        plan.units = [u for u in plan.units if u.name not in plan.attested]
    mine = _shares(g, plan.units)
    digests: dict[Any, str] = {}
    for part in agree(
        g,
        lambda: hash_units(
            fs,
            root,
            plan.manifest.algorithm,
            mine,
            plan.listing,
            max_workers=options.max_workers,
            callback=options.callback,
        ),
        every=True,
    ):
        digests.update(part)
    report = finish(plan, digests)
    if not report.ok:
        raise IntegrityError(report, plan.location)
    log_done("verified", plan.location, report.files_checked, report.bytes_checked, started)
    return report


def verify(
    url: URL,
    *,
    group: Any = None,
    mode: str = "sharded",
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Any,
) -> Report:
    """:func:`integrity_fs.verify` as a collective (see the module docstring)."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return check(*storage.resolve(url, storage_options, fs), VerifyOptions.of(**options))
    fs_, root, checked = _start(g, url, storage_options, fs, mode, lambda m: VerifyOptions.of(**options), "verify")
    return _verify(g, fs_, root, checked, mode)


def seal(
    url: URL,
    *,
    group: Any = None,
    mode: str = "sharded",
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Any,
) -> Manifest:
    """:func:`integrity_fs.seal` as a collective: rank 0 writes the manifest once every rank's
    share is hashed; every rank returns it."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return seal_root(*storage.resolve(url, storage_options, fs), SealOptions.of(**options))
    fs_, root, checked = _start(g, url, storage_options, fs, mode, lambda m: SealOptions.of(**options), "seal")
    if mode == "rank0":
        return agree(g, lambda: seal_root(fs_, root, checked), only=0)  # type: ignore[no-any-return]

    def survey() -> dict[str, Stat]:
        if not checked.overwrite and storage.exists(fs_, storage.join(root, MANIFEST_FILENAME)):
            raise FileExistsError(
                f"{storage.describe(fs_, root)} is already sealed: pass overwrite=True (CLI --force) to seal it again"
            )
        listing = storage.list_files(fs_, root)
        check_sealable(fs_, root, list(listing))
        return listing

    listing = agree(g, survey)
    _check_views(g, fs_, listing, storage.describe(fs_, root))
    mine = _shares(g, plan_units({n: s.size for n, s in listing.items()}, checked.chunk_size))
    digests: dict[Any, str] = {}
    for part in agree(
        g,
        lambda: hash_units(
            fs_, root, checked.algorithm, mine, listing, max_workers=checked.max_workers, callback=checked.callback
        ),
        every=True,
    ):
        digests.update(part)
    by_file: dict[str, list[str]] = {n: [] for n in listing}
    for unit in sorted(digests, key=lambda u: (u.name, u.chunk)):
        by_file[unit.name].append(digests[unit])
    manifest = build_manifest(checked, {n: s.size for n, s in listing.items()}, by_file)
    agree(g, lambda: write_sealed(fs_, root, manifest, key=checked.private_key), only=0)
    return manifest


def candidates(g: Any, fs: Any, root: str, pattern: str | None, mode: str) -> runs.Candidates:
    """A run's checkpoints, the same on every rank: rank 0's listing in rank0 mode; in sharded
    mode every rank lists and an ``OSError`` says when ranks see different checkpoints (a node
    without the run's storage must never start afresh alone)."""
    if mode == "rank0":
        return agree(g, lambda: runs.candidates_of(fs, root, pattern), only=0)  # type: ignore[no-any-return]
    found = agree(g, lambda: (storage.describe(fs, root), runs.candidates_of(fs, root, pattern)), every=True)
    orders = [order for _, (order, _, _) in found]
    if any(order != orders[0] for order in orders):
        counts = by_rank([f"{len(order)} checkpoints" for order in orders]).replace("'", "")
        raise OSError(
            f"ranks see different checkpoints under {found[0][0]} (as rank 0 names it): {counts}. "
            "Every rank must see the run's storage (a node without it would start afresh alone)"
        )
    return found[0][1]  # type: ignore[no-any-return]


def _judge(g: Any, mode: str) -> Any:
    """A verdict every rank reaches together: the listing's by rank 0, the hashing shared."""

    def judge(fs: Any, path: str, options: VerifyOptions) -> runs.Judged:
        base = agree(g, lambda: runs.survey(fs, path, options)[0], only=0)
        if base.verdict:
            return base  # type: ignore[no-any-return]
        return runs.verdict(base, lambda: _verify(g, fs, path, options, mode), options.quick)

    return judge


def latest_verified(
    root: URL,
    *,
    group: Any = None,
    mode: str = "sharded",
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Any,
) -> tuple[str, Report] | None:
    """:func:`integrity_fs.latest_verified` as a collective: the same answer on every rank."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.latest_verified(root, pattern=pattern, storage_options=storage_options, fs=fs, **options)
    fs_, root_, checked = _start(
        g, root, storage_options, fs, mode, lambda m: VerifyOptions.of(**options), "latest_verified"
    )
    with logged_once(g):
        found = candidates(g, fs_, root_, pattern, mode)
        return runs.latest(fs_, root_, pattern, checked, _judge(g, mode), found)


def status(
    root: URL,
    *,
    group: Any = None,
    mode: str = "sharded",
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """The rows of ``integrity-fs status`` (see ``runs.status``), agreed by every rank."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.status(*storage.resolve(root, storage_options, fs), pattern, VerifyOptions.of(**options))
    fs_, root_, checked = _start(g, root, storage_options, fs, mode, lambda m: VerifyOptions.of(**options), "status")
    with logged_once(g):
        found = candidates(g, fs_, root_, pattern, mode)
        left = agree(g, lambda: staging.leftovers(fs_, root_), only=0)
        return runs.status(fs_, root_, pattern, checked, _judge(g, mode), found, left)


def prune(root: URL, *, group: Any = None, mode: str = "sharded", **kw: Any) -> PruneResult:
    """:func:`integrity_fs.prune` as a collective: verdicts agreed by every rank, rank 0 deletes,
    the same result or the same error everywhere. ``kw``: ``prune``'s (``keep_last``, ``pattern``,
    ``unsealed``, ``dry_run``, ``storage_options``, ``fs``, and the verify options)."""
    g = group_of(group)
    if g is None:
        _mode(mode)
        return runs.prune(root, **kw)
    return _prune(g, root, mode, kw)


_PRUNING = ("keep_last", "pattern", "unsealed", "dry_run", "storage_options", "fs")


def _prune(g: Any, root: URL, mode: str, kw: dict[str, Any]) -> PruneResult:
    """The collective prune over ``g`` (``kw``: ``prune``'s keywords)."""
    keep_last, pattern = kw.get("keep_last"), kw.get("pattern")
    unsealed, dry_run = kw.get("unsealed", False), kw.get("dry_run", False)

    def make(m: str) -> VerifyOptions:
        if "keep_last" not in kw:
            raise TypeError("prune() needs keep_last")
        count("keep_last", keep_last, optional=False)
        flag("unsealed", unsealed)
        flag("dry_run", dry_run)
        return VerifyOptions.of(**{k: v for k, v in kw.items() if k not in _PRUNING})

    fs_, root_, checked = _start(g, root, kw.get("storage_options"), kw.get("fs"), mode, make, "prune")
    check_same(
        g,
        {"keep_last": keep_last, "pattern": pattern, "unsealed": unsealed, "dry_run": dry_run},
        "the arguments of prune",
    )
    assert isinstance(keep_last, int)  # checked by make() on every rank
    with logged_once(g):
        found = candidates(g, fs_, root_, pattern, mode)
        planned = runs.prune_root(
            fs_,
            root_,
            keep_last=keep_last,
            pattern=pattern,
            unsealed=unsealed,
            dry_run=True,
            options=checked,
            judge_fn=_judge(g, mode),
            candidates=found,
        )
    if dry_run:
        return planned

    def delete() -> PruneResult:
        for url in planned.deleted:
            runs.delete_checkpoint(fs_, storage.join(root_, url.rstrip("/").rsplit("/", 1)[-1]))
            log.info("deleted %s", printable(url))
        staging.clear(fs_, root_)  # dead leftovers, by the rule the local prune follows
        return dataclasses.replace(planned, dry_run=False)

    return agree(g, delete, only=0)  # type: ignore[no-any-return]
