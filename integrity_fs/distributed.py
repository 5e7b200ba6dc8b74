"""``seal`` and ``verify`` as collectives over ``torch.distributed``: every rank reaches the same verdict.

Two modes:

- ``"sharded"`` (default): rank 0 reads the manifest and lists the checkpoint, every rank hashes its
  share of the units (files, or chunks of files), the digests are gathered, and every rank computes
  the same report. Time falls with world size until storage bandwidth is the limit.
- ``"rank0"``: rank 0 does all the I/O with the local function; the verdict is broadcast (the seed's
  design).

Every rank returns an equal result or raises the same exception type with the same message,
whichever rank hit the problem: each local step is wrapped so that its exception becomes data (a
:class:`Failure`), every rank runs the same sequence of collectives whatever happened, and the
verdict is raised only after the last collective. The first collective agrees on the mode (and, in
sharded mode, checks that every rank sees the same files), so a bad argument on one rank cannot
leave the others waiting; a ``KeyboardInterrupt`` (any ``BaseException``) in a step is carried
like a failure and re-raised on its own rank after the collectives. Without an initialised process
group both functions are the local ones. torch is imported only when a function here is called.

With NCCL, object collectives travel through the current CUDA device: call
``torch.cuda.set_device(local_rank)`` before calling these functions, as for any NCCL collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.callbacks import Callback

from . import checkpoints, signing, storage
from .collectives import (
    INSTALL_HINT,
    MODES,
    Call,
    Failure,
    Group,
    Mode,
    all_gather,
    broadcast,
    check_agreed,
    check_mode,
    group_of,
    name_ranks,
    ranks_by,
)
from .errors import IntegrityError
from .hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY, Unit
from .manifest import Manifest
from .options import Attested, SealOptions, VerifyOptions, Work
from .report import Report, printable
from .seal import SealPlan, finish_seal, plan_seal, seal_at, seal_options
from .verify import (
    Prepared,
    attestable_names,
    attested_names,
    check,
    fetch_checksums,
    finish_verification,
    prepare,
    verify_options,
    without_attested,
)
from .work import UnitOutcome, hash_units

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .recorded import ObjectState

__all__ = [
    "INSTALL_HINT",
    "MODES",
    "Failure",
    "Mode",
    "agreed_candidates",
    "latest_verified",
    "prune",
    "seal",
    "shard_units",
    "status",
    "verify",
]

URL = str | os.PathLike[str]

#: What opening one unit costs, counted in bytes, when balancing shares: a request to an object
#: store takes about as long as reading this much, so many small files do not pile onto one rank.
UNIT_COST_BYTES = 1024 * 1024

Digests = dict[Unit, UnitOutcome]


def verify(
    url: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    strict: bool = False,
    quick: bool = False,
    attested: Attested = False,
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
    expected_name: str | None = None,
    manifest_format: str = "auto",
) -> Report:
    """:func:`integrity_fs.verify` as a collective: call it on every rank of ``group`` (default: the world).

    Every rank returns an equal :class:`~integrity_fs.Report` or raises the same exception.
    ``storage_options``, ``fs``, ``max_workers`` and ``callback`` are each rank's own (the callback
    sees this rank's bytes); ``strict``, ``quick``, ``attested``, ``manifest``, ``manifest_format``, ``public_key`` and
    ``expected_name`` are taken from rank 0, which checks the signature before any content is
    hashed. ``mode`` must be the same on every rank (else ``ValueError`` on every rank). In sharded
    mode every rank lists ``url``, and ranks that see different files raise ``OSError``: it needs
    shared storage. Each rank's reads are pinned to the versions its own listing saw. With
    ``attested`` in sharded mode, each rank asks the store for the checksums of its share of the
    files (split by name), and only the units of the files no checksum attests are split across
    ranks and hashed.
    """
    g = group_of(group)

    def options() -> VerifyOptions:
        return verify_options(
            strict=strict,
            quick=quick,
            attested=attested,
            manifest=manifest,
            public_key=public_key,
            expected_name=expected_name,
            manifest_format=manifest_format,
        )

    def local_verify() -> Report:
        return check(*storage.resolve(url, storage_options, fs), options(), Work(max_workers, callback))

    if g is None:
        check_mode(mode)
        return local_verify()
    call = Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs, leftovers=True))
    if agreed == "rank0":
        return call.on_rank0(local_verify)
    work = call.attempt(lambda: Work(max_workers, callback))  # this rank's own: a bad one travels as its share
    planned = broadcast(g, call.attempt(lambda: _plan_verify(view, options())) if g.rank == 0 else None)
    checksums: list[_Checksums | Failure] = []
    if isinstance(planned, _VerifyPlan) and planned.attest:  # rank 0's choice: the same on every rank
        before = planned
        checksums = all_gather(g, call.attempt(lambda: _checksum_share(g, view, before)))
        planned = call.attempt(lambda: _attest(before, checksums))
    share = call.attempt(lambda: _hash_share(g, view, planned, work))
    shares = all_gather(g, share)
    call.raise_first([planned, *checksums, *shares])
    assert isinstance(planned, _VerifyPlan)
    prepared = planned.prepared
    report = finish_verification(prepared.manifest, prepared.plan, _merge(shares))
    if not report.ok:
        raise IntegrityError(report, prepared.location)
    return report


def seal(
    url: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    algorithm: str = DEFAULT_ALGORITHM,
    granularity: str = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """:func:`integrity_fs.seal` as a collective: call it on every rank of ``group`` (default: the world).

    Rank 0 writes the manifest once every share is hashed (and ``model.sig`` with rank 0's
    ``private_key``; other ranks may pass ``None``); every rank returns an equal
    :class:`~integrity_fs.Manifest` or raises the same exception (``FileExistsError`` for a root
    that is already sealed, unless ``overwrite=True``). ``algorithm``, ``granularity``,
    ``chunk_size`` and ``overwrite`` are taken from rank 0; the storage options are each rank's own.
    The guards are :func:`integrity_fs.seal`'s own (one pipeline): names checked and chunk counts
    bounded before any content is read, every read pinned to the version listed.
    """
    g = group_of(group)

    def local_seal() -> Manifest:
        options = seal_options(algorithm, granularity, chunk_size, overwrite, private_key)
        return seal_at(*storage.resolve(url, storage_options, fs), options, Work(max_workers, callback))

    if g is None:
        check_mode(mode)
        return local_seal()
    call = Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs))
    if agreed == "rank0":
        # The manifest travels as its canonical JSON: the bytes every rank must agree on.
        return Manifest.from_json(call.on_rank0(lambda: local_seal().to_json()))
    work = call.attempt(lambda: Work(max_workers, callback))
    options = call.attempt(lambda: seal_options(algorithm, granularity, chunk_size, overwrite, private_key))
    planned = broadcast(g, call.attempt(lambda: _plan_seal(view, options)) if g.rank == 0 else None)
    share = call.attempt(lambda: _hash_share(g, view, planned, work))
    shares = all_gather(g, share)
    written = broadcast(g, call.attempt(lambda: _write_seal(view, options, planned, shares)) if g.rank == 0 else None)
    call.raise_first([planned, *shares, written])
    assert isinstance(written, bytes)
    return Manifest.from_json(written)


def shard_units(units: Sequence[Unit], world_size: int) -> list[list[Unit]]:
    """Split ``units`` into ``world_size`` shares of about equal bytes, the same on every rank.

    Largest first, each onto the least-loaded rank (the lowest rank on ties); each unit also
    counts :data:`UNIT_COST_BYTES` for opening it.
    """
    shares: list[list[Unit]] = [[] for _ in range(world_size)]
    loads = [(0, rank) for rank in range(world_size)]
    for unit in sorted(units, key=lambda u: (-u.length, u.name, u.index)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(unit)
        heapq.heappush(loads, (load + unit.length + UNIT_COST_BYTES, rank))
    return shares


@dataclass(frozen=True)
class _VerifyPlan:
    """Rank 0's preparation, as every rank receives it; ``attest``: ask the store for checksums
    (``True``, or ``"crc"``: CRCs attest too)."""

    prepared: Prepared
    algorithm: str
    attest: Attested = False

    @property
    def units(self) -> Sequence[Unit]:
        return self.prepared.plan.units


@dataclass(frozen=True)
class _SealPlan:
    plan: SealPlan
    algorithm: str

    @property
    def units(self) -> Sequence[Unit]:
        return self.plan.units


@dataclass(frozen=True)
class _View:
    """What one rank sees at the URL: its filesystem and root, its listing (sizes, and the versions
    its reads are pinned to), and the token ranks compare."""

    fs: fsspec.AbstractFileSystem
    root: str
    sizes: dict[str, int]
    versions: dict[str, storage.Version]
    token: tuple[str, str]  # (where, fingerprint of the names, sizes and version stamps)


def _look(
    url: URL, storage_options: dict[str, Any] | None, fs: fsspec.AbstractFileSystem | None, *, leftovers: bool = False
) -> _View:
    """List ``url`` on this rank, with a fingerprint that changes with any name, size, mtime or ETag
    (``leftovers``: as :func:`integrity_fs.storage.list_files`, for a verification)."""
    fs_, root = storage.resolve(url, storage_options, fs)
    stamps: dict[str, str] = {}
    versions: dict[str, storage.Version] = {}
    sizes = storage.list_files(fs_, root, stamps=stamps, versions=versions, leftovers=leftovers)
    listing = json.dumps([[name, size, stamps.get(name, "")] for name, size in sizes.items()])
    token = (storage.describe(fs_, root), hashlib.sha256(listing.encode()).hexdigest())
    return _View(fs_, root, sizes, versions, token)


def _plan_verify(view: _View | None, options: VerifyOptions) -> _VerifyPlan:
    """Rank 0: read the manifest (and check the signature with a key) against its listing."""
    assert view is not None
    prepared = prepare(view.fs, view.root, options, sizes=view.sizes)
    attest = options.attested if options.attested and not options.quick else False
    if attest and not attestable_names(prepared.manifest, prepared.plan):
        attest = False
    return _VerifyPlan(prepared, prepared.manifest.algorithm, attest)


_Checksums = dict[str, "ObjectState | None"]


def _checksum_share(g: Group, view: _View | None, planned: _VerifyPlan) -> _Checksums:
    """Every rank: the store's checksums of this rank's share of the files (every ``size``-th name)."""
    assert view is not None
    names = attestable_names(planned.prepared.manifest, planned.prepared.plan)
    return fetch_checksums(view.fs, view.root, names[g.rank :: g.size])


def _attest(planned: _VerifyPlan, checksums: Sequence[_Checksums | Failure]) -> _VerifyPlan | Failure:
    """Every rank, from the gathered checksums: the plan less the attested files (the same on every
    rank); the first failure instead when a rank could not fetch its share."""
    merged: _Checksums = {}
    for share in checksums:
        if isinstance(share, Failure):
            return share
        merged.update(share)
    prepared = planned.prepared
    confirmed = attested_names(prepared.manifest, merged, records=prepared.records, mode=planned.attest)
    plan = without_attested(prepared.plan, confirmed)
    return dataclasses.replace(planned, prepared=dataclasses.replace(prepared, plan=plan))


def _plan_seal(view: _View | None, options: SealOptions | Failure) -> _SealPlan | Failure:
    """Rank 0: the seal's own checks and plan (see :func:`integrity_fs.seal.plan_seal`), from its listing."""
    if isinstance(options, Failure):
        return options
    assert view is not None
    return _SealPlan(plan_seal(view.fs, view.root, options, sizes=view.sizes), options.hashing.algorithm)


def _hash_share(
    g: Group,
    view: _View | None,
    planned: _VerifyPlan | _SealPlan | Failure | None,
    work: Work | Failure,
) -> Digests | Failure:
    """Every rank: hash this rank's share of the planned units (nothing if planning failed), each
    read pinned to this rank's own listing; this rank's bad options instead, as its share."""
    if isinstance(work, Failure):
        return work
    if not isinstance(planned, (_VerifyPlan, _SealPlan)):
        return {}
    assert view is not None
    share = shard_units(planned.units, g.size)[g.rank]
    return hash_units(view.fs, view.root, planned.algorithm, share, versions=view.versions, work=work)


def _write_seal(
    view: _View | None,
    options: SealOptions | Failure,
    planned: _SealPlan | Failure | None,
    shares: Sequence[Digests | Failure],
) -> bytes | None:
    """Rank 0: build and write the manifest (then the signature) once every share is in; its bytes."""
    if view is None or not isinstance(planned, _SealPlan) or isinstance(options, Failure):
        return None
    if any(isinstance(share, Failure) for share in shares):
        return None
    return finish_seal(view.fs, view.root, options, planned.plan, _merge(shares)).to_json()


def _merge(shares: Sequence[Mapping[Unit, UnitOutcome] | Failure]) -> Digests:
    merged: Digests = {}
    for share in shares:
        assert not isinstance(share, Failure)
        merged.update(share)
    return merged


def latest_verified(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    quick: bool = False,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    public_key: signing.PublicKey | None = None,
) -> tuple[str, Report] | None:
    """:func:`integrity_fs.latest_verified` as a collective: the same answer on every rank of ``group``.

    The mode is agreed as for :func:`verify` (the same messages, the same handling of an interrupt);
    rank 0 lists the candidates and shares them; then every rank runs :func:`verify` on each,
    newest first, until one passes, so the hashing of each candidate is shared across ranks (in
    ``mode``). Skipped candidates are logged at WARNING on rank 0. A storage error, or a bad
    argument on any rank, is raised on every rank. The returned URL is rank 0's.
    """
    g = group_of(group)
    if g is None:
        check_mode(mode)
        return checkpoints.latest_verified(
            root,
            quick=quick,
            strict=strict,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
            public_key=public_key,
        )
    call = Call(g)
    call.agree(mode)
    candidates = _agreed(g, call, root, storage_options, fs)
    fs_, _root = storage.resolve(root, storage_options, fs)

    def attempt(path: str) -> Report:
        # The same exception on every rank: every rank goes on alike.
        return verify(
            path,
            group=group,
            mode=mode,
            fs=fs_,
            max_workers=max_workers,
            strict=strict,
            quick=quick,
            public_key=public_key,
            expected_name=checkpoints.signed_name(path, public_key),
        )

    return checkpoints.newest_that(candidates, attempt, warn=g.rank == 0)


def status(
    root: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    full: bool = False,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    public_key: signing.PublicKey | None = None,
) -> list[checkpoints.CheckpointStatus]:
    """:func:`integrity_fs.checkpoints.status` as a collective: the same list (or exception) on
    every rank of ``group``.

    The mode is agreed as for :func:`verify`; every rank lists ``root``, and all must see the same
    checkpoints (else ``OSError``). Each is judged with :func:`verify`, newest first, so with
    ``full`` its hashing is shared across the ranks (in ``mode``); ``full``, ``strict`` and
    ``public_key`` are rank 0's, as :func:`verify` takes them. Rank 0 reads the manifests and
    makes the list, which is every rank's. A storage error is raised on every rank.
    """
    g = group_of(group)
    if g is None:
        check_mode(mode)
        return checkpoints.status(
            root,
            full=full,
            strict=strict,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
            public_key=public_key,
        )
    call = Call(g)
    call.agree(mode)

    def named(fs_: fsspec.AbstractFileSystem, root_: str) -> list[tuple[str, str]]:
        names = checkpoints.checkpoint_names(fs_, root_)
        return [(name, checkpoints.checkpoint_url(fs_, storage.join(root_, name))) for name in names]

    names = [name for name, _url in _agreed(g, call, root, storage_options, fs, named)]
    fs_, root_ = storage.resolve(root, storage_options, fs)
    verdicts: dict[str, Exception | None] = {}
    for name in names:
        path = storage.join(root_, name)
        try:  # the same outcome on every rank: every rank goes on alike
            verify(
                path,
                group=group,
                mode=mode,
                fs=fs_,
                max_workers=max_workers,
                strict=strict,
                quick=not full,
                public_key=public_key,
                expected_name=checkpoints.signed_name(path, public_key),
            )
            verdicts[path] = None
        except Exception as exc:
            if checkpoints.verdict_of(exc) is None:
                raise  # a storage error, as status raises it
            verdicts[path] = exc

    def judged(path: str, _callback: Callback | None) -> None:
        verdict = verdicts[path]
        if verdict is not None:
            raise verdict

    return call.on_rank0(lambda: checkpoints.statuses(fs_, root_, names, judged, full=full))


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
    names = checkpoints.names_or_none(fs, root, warn=warn)
    return [(storage.join(root, name), checkpoints.checkpoint_url(fs, storage.join(root, name))) for name in names]


def prune(
    root: URL,
    *,
    keep_last: int,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
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
) -> checkpoints.PruneResult:
    """:func:`integrity_fs.prune` as a collective: the same verdicts, the same plan and the same
    result (or exception) on every rank of ``group``; rank 0 alone deletes.

    The mode and the arguments that decide the plan (``keep_last``, ``quick``, ``attested``,
    ``unsealed``, ``dry_run``, ``keep``, ``match``) must be the same on every rank (else
    ``ValueError`` on every rank, before anything is listed); every rank lists ``root`` and all
    must see the same checkpoints (else ``OSError``). Each candidate is judged with
    :func:`verify`, newest first, so its hashing is shared across the ranks (in ``mode``); then
    rank 0 deletes what the plan says and its result (or its storage error) is every rank's.
    ``public_key`` is rank 0's; ``storage_options``, ``fs`` and ``max_workers`` each rank's own.
    """
    g = group_of(group)

    def settings_here() -> checkpoints.PruneSettings:
        return checkpoints.prune_settings(
            keep_last=keep_last,
            quick=quick,
            attested=attested,
            unsealed=unsealed,
            dry_run=dry_run,
            keep=keep,
            match=match,
        )

    if g is None:
        check_mode(mode)
        return checkpoints.prune(
            root,
            keep_last=keep_last,
            quick=quick,
            attested=attested,
            unsealed=unsealed,
            dry_run=dry_run,
            public_key=public_key,
            keep=keep,
            match=match,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
        )
    call = Call(g)
    call.agree(mode)
    gathered = all_gather(g, call.attempt(settings_here))
    call.raise_first(gathered)
    check_agreed([repr(s) for s in gathered], "arguments to distributed.prune")
    settings = gathered[0]
    assert isinstance(settings, checkpoints.PruneSettings)
    candidates = _agreed(
        g, call, root, storage_options, fs, lambda fs_, root_: checkpoints.prune_candidates(fs_, root_, settings.match)
    )
    fs_, root_ = storage.resolve(root, storage_options, fs)

    def attempt(path: str, full: bool) -> None:
        # The same verdict (or exception) on every rank: every rank goes on alike.
        verify(
            path,
            group=group,
            mode=mode,
            fs=fs_,
            max_workers=max_workers,
            quick=settings.quick or not full,
            attested=settings.attested if full else False,
            public_key=public_key,
            expected_name=checkpoints.signed_name(path, public_key),
        )

    judged = checkpoints.judge(candidates, settings.keep_last, attempt, warn=g.rank == 0)
    return call.on_rank0(lambda: checkpoints.carry_out(fs_, root_, judged, settings))
