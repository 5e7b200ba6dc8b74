"""``seal`` and ``verify`` as collectives: the hashing split across ranks, one verdict for all.

Internal: :mod:`integrity_fs.distributed` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import storage
from ..collectives import Call, Failure, Group, Mode, all_gather, broadcast, check_mode, group_of
from ..errors import IntegrityError
from ..hashing import Unit
from ..manifest import Manifest
from ..options import Attested, SealOptions, VerifyOptions, Work
from ..report import Report
from ..sealing import SealPlan, finish_seal, plan_seal, seal_at
from ..storage import URL
from ..verification import (
    Prepared,
    attestable_names,
    attested_names,
    check,
    fetch_checksums,
    finish_verification,
    prepare,
    without_attested,
)
from ..work import UnitOutcome, hash_units

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback
    from torch.distributed import ProcessGroup

    from ..recorded import ObjectState

__all__ = ["UNIT_COST_BYTES", "collective_verify", "seal", "shard_units", "verify"]


#: What opening one unit costs, counted in bytes, when balancing shares: a request to an object
#: store takes about as long as reading this much, so many small files do not pile onto one rank.
UNIT_COST_BYTES = 1024 * 1024

Digests = dict[Unit, UnitOutcome]


def verify(
    url: URL,
    *,
    group: ProcessGroup | None = None,
    mode: Mode = "sharded",
    options: VerifyOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    **kw: Any,
) -> Report:
    """:func:`integrity_fs.verify` as a collective: call it on every rank of ``group`` (default: the world).

    Every rank returns an equal :class:`~integrity_fs.Report` or raises the same exception.
    ``storage_options``, ``fs``, ``max_workers`` and ``callback`` are each rank's own (the callback
    sees this rank's bytes); what is checked, ``options`` (a :class:`~integrity_fs.VerifyOptions`)
    or the keywords that make one (``strict``, ``quick``, ``attested``, ``manifest``,
    ``manifest_format``, ``public_key``, ``expected_name``), is rank 0's, which checks the
    signature before any content is hashed. ``mode`` must be the same on every rank (else
    ``ValueError`` on every rank). In sharded mode every rank lists ``url``, and ranks that see
    different files raise ``OSError``: it needs shared storage. Each rank's reads are pinned to
    the versions its own listing saw. With ``attested`` in sharded mode, each rank asks the store
    for the checksums of its share of the files (split by name), and only the units of the files
    no checksum attests are split across ranks and hashed.
    """

    def checked() -> VerifyOptions:
        return VerifyOptions.build(options, **kw)

    work = (max_workers, callback)
    return collective_verify(url, storage_options, fs, group=group, mode=mode, options=checked, work=work)


def collective_verify(
    url: URL,
    storage_options: dict[str, Any] | None,
    fs: fsspec.AbstractFileSystem | None,
    *,
    group: ProcessGroup | None,
    mode: Mode,
    options: Callable[[], VerifyOptions],
    work: tuple[int | None, Callback | None] = (None, None),
) -> Report:
    """:func:`verify`, with the options made by ``options()`` where they are needed (rank 0, or
    the one process), so that other ranks' options are never looked at; ``work``: this rank's
    ``(max_workers, callback)``."""
    g = group_of(group)

    def local_verify() -> Report:
        return check(*storage.resolve(url, storage_options, fs), options(), Work(*work))

    if g is None:
        check_mode(mode)
        return local_verify()
    call = Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs, leftovers=True))
    if agreed == "rank0":
        return call.on_rank0(local_verify)
    mine = call.attempt(lambda: Work(*work))  # this rank's own: a bad one travels as its share
    planned = broadcast(g, call.attempt(lambda: _plan_verify(view, options())) if g.rank == 0 else None)
    checksums: list[_Checksums | Failure] = []
    if isinstance(planned, _VerifyPlan) and planned.attest:  # rank 0's choice: the same on every rank
        before = planned
        checksums = all_gather(g, call.attempt(lambda: _checksum_share(g, view, before)))
        planned = call.attempt(lambda: _attest(before, checksums))
    share = call.attempt(lambda: _hash_share(g, view, planned, mine))
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
    options: SealOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    **kw: Any,
) -> Manifest:
    """:func:`integrity_fs.seal` as a collective: call it on every rank of ``group`` (default: the world).

    Rank 0 writes the manifest once every share is hashed (and ``model.sig`` with rank 0's
    ``private_key``; other ranks may pass ``None``); every rank returns an equal
    :class:`~integrity_fs.Manifest` or raises the same exception (``FileExistsError`` for a root
    that is already sealed, unless ``overwrite=True``). What is written, ``options`` (a
    :class:`~integrity_fs.SealOptions`) or the keywords that make one (``algorithm``,
    ``granularity``, ``chunk_size``, ``overwrite``, ``private_key``), is rank 0's, checked on every
    rank; the storage options, ``max_workers`` and ``callback`` are each rank's own. The guards are
    :func:`integrity_fs.seal`'s own (one pipeline): names checked and chunk counts bounded before
    any content is read, every read pinned to the version listed.
    """
    g = group_of(group)

    def local_seal() -> Manifest:
        checked = SealOptions.build(options, **kw)
        return seal_at(*storage.resolve(url, storage_options, fs), checked, Work(max_workers, callback))

    if g is None:
        check_mode(mode)
        return local_seal()
    call = Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs))
    if agreed == "rank0":
        # The manifest travels as its canonical JSON: the bytes every rank must agree on.
        return Manifest.from_json(call.on_rank0(lambda: local_seal().to_json()))
    mine = call.attempt(lambda: Work(max_workers, callback))
    checked = call.attempt(lambda: SealOptions.build(options, **kw))
    planned = broadcast(g, call.attempt(lambda: _plan_seal(view, checked)) if g.rank == 0 else None)
    share = call.attempt(lambda: _hash_share(g, view, planned, mine))
    shares = all_gather(g, share)
    written = broadcast(g, call.attempt(lambda: _write_seal(view, checked, planned, shares)) if g.rank == 0 else None)
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
