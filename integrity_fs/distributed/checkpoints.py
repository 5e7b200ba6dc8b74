"""The checkpoints of a run as collectives: the newest that verifies, their status, retention.

Each checkpoint is judged with :func:`~integrity_fs.distributed.verify` (its hashing shared across
the ranks), in the same order on every rank, so that every rank reaches the same verdicts.
Internal: :mod:`integrity_fs.distributed` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import checkpoints, retention, storage
from ..collectives import Call, Group, Mode, all_gather, check_agreed, check_mode, group_of, name_ranks, ranks_by
from ..options import VerifyOptions, Work
from ..report import Report, printable
from ..runs import candidates, checkpoint_names, named, names_or_none, newest_that, verdict_of
from ..storage import URL
from .pipelines import collective_verify

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback
    from torch.distributed import ProcessGroup

__all__ = ["agreed_candidates", "latest_verified", "prune", "status"]


def latest_verified(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    options: VerifyOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    **kw: Any,
) -> tuple[str, Report] | None:
    """:func:`integrity_fs.latest_verified` as a collective: the same answer on every rank of ``group``.

    The mode is agreed as for :func:`verify` (the same messages, the same handling of an interrupt);
    rank 0 lists the candidates and shares them; then every rank runs :func:`verify` on each,
    newest first, until one passes, so the hashing of each candidate is shared across ranks (in
    ``mode``). ``options`` (a :class:`~integrity_fs.VerifyOptions`), or the keywords that make one
    (``quick``, ``strict``, ``public_key``, ...), are rank 0's, as :func:`verify` takes them; with
    a key, each candidate's signature must name it. Skipped candidates are logged at WARNING on
    rank 0. A storage error, or a bad argument on any rank, is raised on every rank. The returned
    URL is rank 0's.
    """
    g = group_of(group)
    if g is None:
        check_mode(mode)
        checked = VerifyOptions.build(options, **kw)
        return checkpoints.newest_verified(*storage.resolve(root, storage_options, fs), checked, Work(max_workers))
    call = Call(g)
    call.agree(mode)
    found = _agreed(g, call, root, storage_options, fs)
    fs_, _root = storage.resolve(root, storage_options, fs)

    def attempt(path: str) -> Report:
        # The same exception on every rank: every rank goes on alike.
        def judging() -> VerifyOptions:
            return named(VerifyOptions.build(options, **kw), path)

        return collective_verify(path, None, fs_, group=group, mode=mode, options=judging, work=(max_workers, None))

    return newest_that(found, attempt, warn=g.rank == 0)


def status(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    full: bool = False,
    options: VerifyOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    **kw: Any,
) -> list[checkpoints.CheckpointStatus]:
    """:func:`integrity_fs.checkpoints.status` as a collective: the same list (or exception) on
    every rank of ``group``.

    The mode is agreed as for :func:`verify`; every rank lists ``root``, and all must see the same
    checkpoints (else ``OSError``). Each is judged with :func:`verify`, newest first, so with
    ``full`` its hashing is shared across the ranks (in ``mode``); ``full``, and ``options`` or
    the keywords that make them (``strict``, ``public_key``), are rank 0's, as :func:`verify`
    takes them (``full`` decides ``quick``). Rank 0 reads the manifests and makes the list, which
    is every rank's. A storage error is raised on every rank.
    """
    g = group_of(group)

    def judging(path: str | None = None) -> VerifyOptions:
        checked = dataclasses.replace(VerifyOptions.build(options, **kw), quick=not full)
        return checked if path is None else named(checked, path)

    if g is None:
        check_mode(mode)
        return checkpoints.status_at(*storage.resolve(root, storage_options, fs), judging(), Work(max_workers))
    call = Call(g)
    call.agree(mode)

    def listed(fs_: fsspec.AbstractFileSystem, root_: str) -> list[tuple[str, str]]:
        names = checkpoint_names(fs_, root_)
        return [(name, url) for name, (_path, url) in zip(names, candidates(fs_, root_, names), strict=True)]

    names = [name for name, _url in _agreed(g, call, root, storage_options, fs, listed)]
    fs_, root_ = storage.resolve(root, storage_options, fs)
    verdicts: dict[str, Exception | None] = {}
    for name in names:
        path = storage.join(root_, name)
        try:  # the same outcome on every rank: every rank goes on alike
            judged_here = functools.partial(judging, path)
            collective_verify(path, None, fs_, group=group, mode=mode, options=judged_here, work=(max_workers, None))
            verdicts[path] = None
        except Exception as exc:
            if verdict_of(exc) is None:
                raise  # a storage error, as status raises it
            verdicts[path] = exc

    def judged(path: str, _callback: Callback | None) -> None:
        verdict = verdicts[path]
        if verdict is not None:
            raise verdict

    return call.on_rank0(lambda: checkpoints.statuses(fs_, root_, names, judged, full=full))


def prune(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    public_key: Any = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    **kw: Any,
) -> retention.PruneResult:
    """:func:`integrity_fs.prune` as a collective: the same verdicts, the same plan and the same
    result (or exception) on every rank of ``group``; rank 0 alone deletes.

    The mode and the arguments that decide the plan (``keep_last``, ``quick``, ``attested``,
    ``unsealed``, ``dry_run``, ``keep``, ``match``: the keywords ``kw``) must be the same on every
    rank (else ``ValueError`` on every rank, before anything is listed); every rank lists ``root``
    and all must see the same checkpoints (else ``OSError``). Each candidate is judged with
    :func:`verify`, newest first, so its hashing is shared across the ranks (in ``mode``); then
    rank 0 deletes what the plan says and its result (or its storage error) is every rank's.
    ``public_key`` is rank 0's; ``storage_options``, ``fs`` and ``max_workers`` each rank's own.
    """
    g = group_of(group)
    if g is None:
        check_mode(mode)
        settings = retention.PruneSettings(**kw)
        return retention.prune_at(*storage.resolve(root, storage_options, fs), settings, public_key, Work(max_workers))
    call = Call(g)
    call.agree(mode)
    gathered = all_gather(g, call.attempt(lambda: retention.PruneSettings(**kw)))
    call.raise_first(gathered)
    check_agreed([repr(s) for s in gathered], "arguments to distributed.prune")
    first = gathered[0]
    assert isinstance(first, retention.PruneSettings)
    settings = first
    found = _agreed(
        g, call, root, storage_options, fs, lambda fs_, root_: retention.prune_candidates(fs_, root_, settings.match)
    )
    fs_, root_ = storage.resolve(root, storage_options, fs)

    def attempt(path: str, full: bool) -> None:
        # The same verdict (or exception) on every rank: every rank goes on alike.
        def judging() -> VerifyOptions:
            options = settings.judging(public_key)
            return named(options if full else dataclasses.replace(options, quick=True, attested=False), path)

        collective_verify(path, None, fs_, group=group, mode=mode, options=judging, work=(max_workers, None))

    judged = retention.judge(found, settings.keep_last, attempt, warn=g.rank == 0)
    return call.on_rank0(lambda: retention.carry_out(fs_, root_, judged, settings))


def agreed_candidates(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
) -> list[str]:
    """The URLs of the checkpoints under ``root``, newest first (:func:`integrity_fs.find_checkpoints`),
    the same on every rank of ``group``: each rank lists ``root`` itself, and a rank that cannot,
    or lists other checkpoints (a node that does not see the run's storage), raises ``OSError``
    on every rank naming the ranks, never a silent fresh start or roll-back. A root that no rank
    sees yet (a run that never saved) has no candidates."""
    g = group_of(group)
    if g is None:
        fs_, root_ = storage.resolve(root, storage_options, fs)
        return [url for _path, url in _latest_candidates(fs_, root_)]
    return [url for _path, url in _agreed(g, Call(g), root, storage_options, fs)]


def _agreed(
    g: Group,
    call: Call,
    root: URL,
    storage_options: dict[str, Any] | None,
    fs: fsspec.AbstractFileSystem | None,
    listing: Callable[[fsspec.AbstractFileSystem, str], list[tuple[str, str]]] | None = None,
) -> list[tuple[str, str]]:
    """Every rank lists the candidates (with ``listing``, by default those of a resume); all must
    list the same (see :func:`agreed_candidates`)."""

    def mine() -> list[tuple[str, str]]:
        fs_, root_ = storage.resolve(root, storage_options, fs)
        return listing(fs_, root_) if listing else _latest_candidates(fs_, root_, warn=g.rank == 0)

    listed = call.attempt(mine)
    gathered = all_gather(g, listed)
    call.raise_first(gathered)
    views = [repr([url for _path, url in listing]) for listing in gathered]  # type: ignore[union-attr]
    groups = ranks_by(views)
    if len(groups) > 1:
        counts = "; ".join(f"{name_ranks(ranks)}: {len(gathered[ranks[0]])} checkpoints" for ranks in groups.values())  # type: ignore[arg-type]
        raise OSError(
            f"ranks see different checkpoints under {printable(str(root))} ({counts}): every rank must see the "
            "run's storage (a node without the mount would start afresh or roll back alone)"
        )
    assert isinstance(listed, list)
    return listed


def _latest_candidates(fs: fsspec.AbstractFileSystem, root: str, *, warn: bool = True) -> list[tuple[str, str]]:
    """The candidates' paths and URLs, newest first (a root not there yet logged once a job: ``warn``)."""
    return candidates(fs, root, names_or_none(fs, root, warn=warn))
