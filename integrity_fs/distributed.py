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

import builtins
import dataclasses
import hashlib
import heapq
import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import fsspec
from fsspec.callbacks import Callback

from . import checkpoints, core, signing, storage
from .core import URL, Report, VerificationPlan
from .errors import IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY, Unit, plan_units
from .manifest import Manifest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ._s3 import StoreChecksum

__all__ = ["MODES", "Failure", "Mode", "latest_verified", "seal", "shard_units", "verify"]

Mode = Literal["sharded", "rank0"]
MODES: tuple[str, ...] = ("sharded", "rank0")
INSTALL_HINT = "pip install 'integrity-fs[torch]'"

#: What opening one unit costs, counted in bytes, when balancing shares: a request to an object
#: store takes about as long as reading this much, so many small files do not pile onto one rank.
UNIT_COST_BYTES = 1024 * 1024

T = TypeVar("T")
Digests = dict[Unit, core.UnitOutcome]


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
    attested: bool = False,
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> Report:
    """:func:`integrity_fs.verify` as a collective: call it on every rank of ``group`` (default: the world).

    Every rank returns an equal :class:`~integrity_fs.Report` or raises the same exception.
    ``storage_options``, ``fs``, ``max_workers`` and ``callback`` are each rank's own (the callback
    sees this rank's bytes); ``strict``, ``quick``, ``attested``, ``manifest`` and ``public_key`` are
    taken from rank 0, which checks the signature before any content is hashed. ``mode`` must be the
    same on every rank (else ``ValueError`` on every rank). In sharded mode every rank lists ``url``,
    and ranks that see different files raise ``OSError``: it needs shared storage. With ``attested``
    in sharded mode, each rank asks the store for the checksums of its share of the files (split by
    name), and only the units of the files no checksum attests are split across ranks and hashed.
    """
    g = _group(group)

    def local_verify() -> Report:
        return core.verify(
            url,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
            callback=callback,
            strict=strict,
            quick=quick,
            attested=attested,
            manifest=manifest,
            public_key=public_key,
        )

    if g is None:
        _check_mode(mode)
        return local_verify()
    call = _Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs))
    if agreed == "rank0":
        return call.on_rank0(local_verify)
    planned = _broadcast(
        g,
        call.attempt(lambda: _plan_verify(view, strict, quick, attested, manifest, public_key))
        if g.rank == 0
        else None,
    )
    checksums: list[_Checksums | Failure] = []
    if isinstance(planned, _VerifyPlan) and planned.attest:  # rank 0's choice: the same on every rank
        before = planned
        checksums = _all_gather(g, call.attempt(lambda: _checksum_share(g, view, before)))
        planned = call.attempt(lambda: _attest(before, checksums))
    share = call.attempt(lambda: _hash_share(g, view, planned, max_workers, callback))
    shares = _all_gather(g, share)
    call.raise_first([planned, *checksums, *shares])
    assert isinstance(planned, _VerifyPlan)
    manifest = Manifest.from_json(planned.manifest_json)
    report = core.finish_verification(manifest, planned.plan, _merge(shares))
    if not report.ok:
        raise IntegrityError(report, planned.location)
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
    """
    g = _group(group)

    def local_seal() -> Manifest:
        return core.seal(
            url,
            algorithm=algorithm,
            granularity=granularity,
            chunk_size=chunk_size,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
            callback=callback,
            overwrite=overwrite,
            private_key=private_key,
        )

    if g is None:
        _check_mode(mode)
        return local_seal()
    call = _Call(g)
    agreed, view = call.agree(mode, lambda: _look(url, storage_options, fs))
    if agreed == "rank0":
        # The manifest travels as its canonical JSON: the bytes every rank must agree on.
        return Manifest.from_json(call.on_rank0(lambda: local_seal().to_json()))
    planned = _broadcast(
        g,
        call.attempt(lambda: _plan_seal(view, algorithm, granularity, chunk_size, overwrite, private_key))
        if g.rank == 0
        else None,
    )
    share = call.attempt(lambda: _hash_share(g, view, planned, max_workers, callback))
    shares = _all_gather(g, share)
    written = _broadcast(
        g, call.attempt(lambda: _write_seal(view, planned, shares, private_key)) if g.rank == 0 else None
    )
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


# --- failures as data --------------------------------------------------------------------------

#: Built-in exception types that are raised again as themselves; any other becomes a RuntimeError.
_KEPT: tuple[type[Exception], ...] = (NotImplementedError, ValueError, TypeError, RuntimeError, OSError)


@dataclass(frozen=True)
class Failure:
    """An exception as picklable data, so that every rank can raise the same one.

    ``type_name`` names a type that can be rebuilt: ``IntegrityError`` (with ``report`` and
    ``location``), ``SignatureError`` (the same, and ``message`` is its ``detail``),
    ``ManifestNotFoundError``, ``ManifestError``, or a built-in exception. Other types, a
    ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``), and any type that
    cannot be rebuilt from its message alone (``UnicodeEncodeError``) arrive as ``RuntimeError``
    whose message starts with the original type's name.
    ``cause`` is the original exception, kept only on the rank that raised it.
    """

    type_name: str
    message: str
    rank: int
    report: Report | None = None
    location: str = ""
    os_args: tuple[Any, ...] | None = None
    cause: BaseException | None = field(default=None, compare=False)

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int) -> Failure:
        if isinstance(exc, SignatureError):  # before IntegrityError: it is one
            return cls("SignatureError", exc.detail, rank, exc.report, exc.location, cause=exc)
        if isinstance(exc, IntegrityError):
            return cls("IntegrityError", str(exc), rank, exc.report, exc.location, cause=exc)
        if isinstance(exc, ManifestNotFoundError):  # before OSError: it is a FileNotFoundError
            return cls("ManifestNotFoundError", str(exc), rank, cause=exc)
        if isinstance(exc, ManifestError):
            return cls("ManifestError", str(exc), rank, cause=exc)
        kept = next((c for c in type(exc).__mro__ if c.__module__ == "builtins" and issubclass(c, _KEPT)), None)
        if kept is None:
            return cls(
                "RuntimeError", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, rank, cause=exc
            )
        return cls(kept.__name__, str(exc), rank, os_args=_os_args(exc), cause=exc)

    def to_exception(self) -> Exception:
        """A fresh exception of the recorded type whose ``str()`` is the recorded message; a
        ``RuntimeError`` ("<type name>: <message>") when that type cannot be built that way."""
        if self.type_name == "SignatureError" and self.report is not None:
            return SignatureError(self.message, self.report, self.location)
        if self.type_name == "IntegrityError" and self.report is not None:
            return IntegrityError(self.report, self.location)
        if self.type_name == "ManifestNotFoundError":
            return ManifestNotFoundError(self.message)
        if self.type_name == "ManifestError":
            return ManifestError(self.message)
        kind = getattr(builtins, self.type_name, None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            for args in ([self.os_args] if self.os_args is not None else []) + [(self.message,)]:
                try:
                    exc = kind(*args)
                except Exception:  # e.g. UnicodeEncodeError takes 5 arguments
                    continue
                if str(exc) == self.message:
                    return exc
        return RuntimeError(f"{self.type_name}: {self.message}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "cause": None}


def _os_args(exc: BaseException) -> tuple[Any, ...] | None:
    """``(errno, strerror[, filename[, None, filename2]])`` of an OSError that has an errno."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return None
    if exc.filename2 is not None:
        return (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
    if exc.filename is not None:
        return (exc.errno, exc.strerror, exc.filename)
    return (exc.errno, exc.strerror)


class _Call:
    """One collective call as this rank runs it: the group, and this rank's own interrupt.

    Each local step runs through :meth:`attempt`, so that no exception (``KeyboardInterrupt``
    included) leaves the sequence of collectives early; :meth:`raise_first` raises the verdict
    after the last one. A collective is built from :meth:`agree` first, then steps and
    collectives, then :meth:`raise_first`.
    """

    def __init__(self, g: _Group) -> None:
        self.g = g
        self.interrupt: BaseException | None = None

    def attempt(self, step: Callable[[], T | Failure]) -> T | Failure:
        """Run one local step; its exception becomes a :class:`Failure` instead of leaving the sequence.

        A ``BaseException`` that is not an ``Exception`` is kept to be re-raised by
        :meth:`raise_first`, and every later step of this rank is skipped.
        """
        if self.interrupt is not None:
            return Failure.from_exception(self.interrupt, self.g.rank)
        try:
            return step()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.interrupt = exc
            return Failure.from_exception(exc, self.g.rank)

    def raise_first(self, outcomes: Sequence[object]) -> None:
        """After the last collective: this rank's own interrupt, else the first failure of ``outcomes``."""
        if self.interrupt is not None:
            raise self.interrupt
        _raise_first(outcomes)

    def agree(self, mode: object, look: Callable[[], _View] | None = None) -> tuple[Mode, _View | None]:
        """The first collective of a call: every rank's ``mode`` (and, in sharded mode, its view) gathered.

        Raises the same on every rank, after this one collective: ``ValueError`` when a rank's mode
        is not one of :data:`MODES` or ranks passed different modes. In sharded mode each rank
        also lists the checkpoint with ``look``; a rank's failure to list is raised on every rank,
        and views that differ (the same URL naming different storage on different ranks, such as
        node-local paths) raise ``OSError``. Returns the mode and this rank's view (``None`` in
        rank0 mode or without ``look``).
        """
        view = self.attempt(look) if look is not None and mode == "sharded" else None
        token = view.token if isinstance(view, _View) else view
        gathered = _all_gather(self.g, (repr(mode), token))
        if self.interrupt is not None:
            raise self.interrupt
        agreed = _agreed_mode([m for m, _ in gathered])
        if agreed == "rank0" or look is None:
            return agreed, None
        _raise_first([t for _, t in gathered])
        _check_same_views([cast(tuple[str, str], t) for _, t in gathered])
        assert isinstance(view, _View)
        return agreed, view

    def on_rank0(self, work: Callable[[], T]) -> T:
        """Rank 0 does ``work``; its result or exception is every rank's."""
        outcome = _broadcast(self.g, self.attempt(work) if self.g.rank == 0 else None)
        self.raise_first([outcome])
        return cast(T, outcome)


def _raise_first(outcomes: Sequence[object]) -> None:
    """Raise the first failure among ``outcomes`` (they are in the same order on every rank)."""
    for outcome in outcomes:
        if isinstance(outcome, Failure):
            exc = outcome.to_exception()
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {outcome.rank})")
            raise exc from outcome.cause


# --- the steps of the sharded collectives ------------------------------------------------------


@dataclass(frozen=True)
class _VerifyPlan:
    manifest_json: bytes
    plan: VerificationPlan
    algorithm: str
    location: str
    attest: bool = False  # ask the store for checksums of ``plan``'s files (rank 0's ``attested``)

    @property
    def units(self) -> Sequence[Unit]:
        return self.plan.units


@dataclass(frozen=True)
class _SealPlan:
    algorithm: str
    granularity: str
    chunk_size: int | None
    sizes: dict[str, int]
    units: list[Unit]
    location: str


@dataclass(frozen=True)
class _View:
    """What one rank sees at the URL: its filesystem and root, and the token ranks compare."""

    fs: fsspec.AbstractFileSystem
    root: str
    token: tuple[str, str]  # (where, fingerprint of the names, sizes and version stamps)


def _look(url: URL, storage_options: dict[str, Any] | None, fs: fsspec.AbstractFileSystem | None) -> _View:
    """List ``url`` on this rank, with a fingerprint that changes with any name, size, mtime or ETag."""
    fs_, root = storage.resolve(url, storage_options, fs)
    stamps: dict[str, str] = {}
    sizes = storage.list_files(fs_, root, stamps=stamps)
    listing = json.dumps([[name, size, stamps.get(name, "")] for name, size in sizes.items()])
    return _View(fs_, root, (storage.describe(fs_, root), hashlib.sha256(listing.encode()).hexdigest()))


def _agreed_mode(modes: Sequence[str]) -> Mode:
    """The mode every rank passed (each given as its ``repr``), or ``ValueError`` naming the ranks."""
    valid: dict[str, Mode] = {repr(m): cast(Mode, m) for m in MODES}
    bad = [(rank, m) for rank, m in enumerate(modes) if m not in valid]
    if bad:
        rank, m = bad[0]
        raise ValueError(f"mode must be one of {', '.join(valid)}, not {m} (rank {rank})")
    _check_agreed(modes, "modes")
    return valid[modes[0]]


def _check_agreed(values: Sequence[str], what: str) -> None:
    """``ValueError``, the same on every rank, when ranks passed different ``what`` (``values``: one
    per rank, gathered): each value named with the ranks that passed it."""
    by_value = _ranks_by(values)
    if len(by_value) > 1:
        raise ValueError(
            f"ranks passed different {what}: " + "; ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items())
        )


def _check_same_views(tokens: Sequence[tuple[str, str]]) -> None:
    """``OSError`` on every rank when ranks list different files at the URL."""
    groups = _ranks_by([fingerprint for _where, fingerprint in tokens])
    if len(groups) == 1:
        return
    raise OSError(
        f"ranks see different files at {tokens[0][0]} (names, sizes or modification times differ; "
        f"ranks that agree: {' | '.join(map(_ranks, groups.values()))}): sharded mode needs every rank to see "
        "the same storage at the URL (shared storage, not node-local paths); use mode='rank0' to let rank 0 "
        "alone read it, or wait until every rank has finished writing"
    )


def _ranks_by(values: Sequence[str]) -> dict[str, list[int]]:
    """The ranks holding each value, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _plan_verify(
    view: _View | None,
    strict: bool,
    quick: bool,
    attested: bool = False,
    manifest_arg: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> _VerifyPlan:
    """Rank 0: read the manifest (and check the signature with a key) and list the checkpoint."""
    assert view is not None
    manifest, listing = core.manifest_and_listing(view.fs, view.root, manifest_arg, public_key)
    plan = core.plan_verification(manifest, listing, strict=strict, quick=quick)
    attest = attested and not quick and bool(core.attestable_names(manifest, plan))
    return _VerifyPlan(manifest.to_json(), plan, manifest.algorithm, storage.describe(view.fs, view.root), attest)


_Checksums = dict[str, "StoreChecksum | None"]


def _checksum_share(g: _Group, view: _View | None, planned: _VerifyPlan) -> _Checksums:
    """Every rank: the store's checksums of this rank's share of the files (every ``size``-th name)."""
    assert view is not None
    names = core.attestable_names(Manifest.from_json(planned.manifest_json), planned.plan)
    return core.fetch_checksums(view.fs, view.root, names[g.rank :: g.size])


def _attest(planned: _VerifyPlan, checksums: Sequence[_Checksums | Failure]) -> _VerifyPlan | Failure:
    """Every rank, from the gathered checksums: the plan less the attested files (the same on every
    rank); the first failure instead when a rank could not fetch its share."""
    merged: _Checksums = {}
    for share in checksums:
        if isinstance(share, Failure):
            return share
        merged.update(share)
    confirmed = core.attested_names(Manifest.from_json(planned.manifest_json), merged)
    return dataclasses.replace(planned, plan=core.without_attested(planned.plan, confirmed))


def _plan_seal(
    view: _View | None,
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
    overwrite: bool,
    private_key: signing.PrivateKey | None,
) -> _SealPlan:
    """Rank 0: check the options (and the signing key), refuse a sealed root (before any content
    is read) and list the checkpoint."""
    chunk_size = core.check_seal_options(algorithm, granularity, chunk_size)
    if private_key is not None:
        core.load_signing_key(private_key, algorithm, granularity)
    assert view is not None
    if not overwrite:
        core.refuse_if_sealed(view.fs, view.root)
    sizes = core.list_for_seal(view.fs, view.root)
    core.check_chunk_count(sizes, chunk_size)
    units = plan_units(granularity, sizes, chunk_size)
    return _SealPlan(algorithm, granularity, chunk_size, sizes, units, storage.describe(view.fs, view.root))


def _hash_share(
    g: _Group,
    view: _View | None,
    planned: _VerifyPlan | _SealPlan | Failure | None,
    max_workers: int | None,
    callback: Callback | None,
) -> Digests:
    """Every rank: hash this rank's share of the planned units (nothing if planning failed)."""
    if not isinstance(planned, (_VerifyPlan, _SealPlan)):
        return {}
    assert view is not None
    share = shard_units(planned.units, g.size)[g.rank]
    return core.hash_units(view.fs, view.root, planned.algorithm, share, max_workers=max_workers, callback=callback)


def _write_seal(
    view: _View | None,
    planned: _SealPlan | Failure | None,
    shares: Sequence[Digests | Failure],
    private_key: signing.PrivateKey | None,
) -> bytes | None:
    """Rank 0: build and write the manifest (then the signature) once every share is in; its bytes."""
    if view is None or not isinstance(planned, _SealPlan):
        return None
    if any(isinstance(share, Failure) for share in shares):
        return None
    fs, root = view.fs, view.root
    digests = _merge(shares)
    gone = sorted({u.name for u, d in digests.items() if d is None})
    if gone:
        raise FileNotFoundError(f"files vanished while sealing {planned.location}: {', '.join(gone)}")
    manifest = core.build_manifest(planned.algorithm, planned.granularity, planned.chunk_size, planned.sizes, digests)
    signature = None if private_key is None else signing.sign(manifest, private_key, core.model_name(root))
    core.write_manifest(fs, root, manifest)
    if signature is not None:
        core.write_signature(fs, root, signature)
    return manifest.to_json()


def _merge(shares: Sequence[Mapping[Unit, core.UnitOutcome] | Failure]) -> Digests:
    merged: Digests = {}
    for share in shares:
        assert not isinstance(share, Failure)
        merged.update(share)
    return merged


# --- torch.distributed -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """The process group this call runs over, and where this process stands in it."""

    handle: ProcessGroup | None
    rank: int
    size: int
    src: int  # global rank of the group's rank 0, as broadcast_object_list wants it


def _torch_distributed() -> ModuleType:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(f"integrity_fs.distributed needs torch: {INSTALL_HINT}") from exc
    return dist


def _check_numpy() -> None:
    """torch's object collectives unpickle through ``Tensor.numpy()``, and torch does not require numpy.

    Checked before the first collective: failing inside one would leave the other ranks waiting.
    """
    if importlib.util.find_spec("numpy") is None:
        raise ImportError(f"torch.distributed object collectives need numpy: {INSTALL_HINT} (or pip install numpy)")


def _group(group: ProcessGroup | None) -> _Group | None:
    """This process's place in ``group``; ``None`` when there is no initialised process group."""
    dist = _torch_distributed()
    if not dist.is_available() or not dist.is_initialized():
        return None
    _check_numpy()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return _Group(group, rank, dist.get_world_size(group), src)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")


def _broadcast(g: _Group, obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    _torch_distributed().broadcast_object_list(box, src=g.src, group=g.handle)
    return box[0]


def _all_gather(g: _Group, obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out: list[Any] = [None] * g.size
    _torch_distributed().all_gather_object(out, obj, group=g.handle)
    return out


# --- the newest good checkpoint ----------------------------------------------------------------


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
    g = _group(group)
    if g is None:
        _check_mode(mode)
        return checkpoints.latest_verified(
            root,
            quick=quick,
            strict=strict,
            storage_options=storage_options,
            fs=fs,
            max_workers=max_workers,
            public_key=public_key,
        )
    call = _Call(g)
    call.agree(mode)
    # Every rank resolves the root (each verify below runs on its own); rank 0 also lists the
    # candidates. One collective carries both, so a failure on any rank is raised on every rank.
    local = call.attempt(lambda: storage.resolve(root, storage_options, fs))
    listed = None
    if g.rank == 0 and not isinstance(local, Failure):
        listed = call.attempt(lambda: _latest_candidates(*local))
    gathered = _all_gather(g, local if isinstance(local, Failure) else listed)
    call.raise_first(gathered)
    candidates = gathered[0]
    assert isinstance(candidates, list) and not isinstance(local, Failure)
    fs_, root_ = local
    for name, url in candidates:
        try:
            report = verify(
                storage.join(root_, name),
                group=group,
                mode=mode,
                fs=fs_,
                max_workers=max_workers,
                strict=strict,
                quick=quick,
                public_key=public_key,
            )
        except Exception as exc:  # the same exception on every rank: every rank goes on alike
            reason = checkpoints.skip_reason(exc)
            if reason is None:
                raise
            if g.rank == 0:
                checkpoints.log.warning("skipping %s (%s): %s", url, reason, exc)
            continue
        return url, report
    return None


def _latest_candidates(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, str]]:
    """Rank 0: the candidates' names and URLs, newest first."""
    names = checkpoints.names_or_none(fs, root)
    return [(name, checkpoints.checkpoint_url(fs, storage.join(root, name))) for name in names]
