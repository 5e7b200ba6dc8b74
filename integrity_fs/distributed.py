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
verdict is raised only after the last collective. Without an initialised process group both
functions are the local ones. torch is imported only when a function here is called.

With NCCL, object collectives travel through the current CUDA device: call
``torch.cuda.set_device(local_rank)`` before calling these functions, as for any NCCL collective.
"""

from __future__ import annotations

import builtins
import heapq
import importlib.util
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

__all__ = ["MODES", "Failure", "Mode", "latest_verified", "seal", "shard_units", "verify"]

Mode = Literal["sharded", "rank0"]
MODES: tuple[str, ...] = ("sharded", "rank0")
INSTALL_HINT = "pip install 'integrity-fs[torch]'"

#: What opening one unit costs, counted in bytes, when balancing shares: a request to an object
#: store takes about as long as reading this much, so many small files do not pile onto one rank.
UNIT_COST_BYTES = 1024 * 1024

T = TypeVar("T")
FsRoot = tuple[fsspec.AbstractFileSystem, str]
Digests = dict[Unit, str | None]


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
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> Report:
    """:func:`integrity_fs.verify` as a collective: call it on every rank of ``group`` (default: the world).

    Every rank returns an equal :class:`~integrity_fs.Report` or raises the same exception.
    ``storage_options``, ``fs``, ``max_workers`` and ``callback`` are each rank's own (the callback
    sees this rank's bytes); ``strict``, ``quick``, ``manifest`` and ``public_key`` are taken from
    rank 0, which checks the signature before any content is hashed.
    """
    _check_mode(mode)
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
            manifest=manifest,
            public_key=public_key,
        )

    if g is None:
        return local_verify()
    if mode == "rank0":
        return _on_rank0(g, local_verify)
    local = _attempt(g.rank, lambda: storage.resolve(url, storage_options, fs))
    planned = _broadcast(
        g, _attempt(g.rank, lambda: _plan_verify(local, strict, quick, manifest, public_key)) if g.rank == 0 else None
    )
    share = _attempt(g.rank, lambda: _hash_share(g, local, planned, max_workers, callback))
    shares = _all_gather(g, share)
    _raise_first([planned, *shares])
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
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """:func:`integrity_fs.seal` as a collective: call it on every rank of ``group`` (default: the world).

    Rank 0 writes the manifest once every share is hashed (and ``model.sig`` with rank 0's
    ``private_key``; other ranks may pass ``None``); every rank returns an equal
    :class:`~integrity_fs.Manifest` or raises the same exception. ``algorithm``, ``granularity``
    and ``chunk_size`` are taken from rank 0; the storage options are each rank's own.
    """
    _check_mode(mode)
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
            private_key=private_key,
        )

    if g is None:
        return local_seal()
    if mode == "rank0":
        # The manifest travels as its canonical JSON: the bytes every rank must agree on.
        return Manifest.from_json(_on_rank0(g, lambda: local_seal().to_json()))
    local = _attempt(g.rank, lambda: storage.resolve(url, storage_options, fs))
    planned = _broadcast(
        g,
        _attempt(g.rank, lambda: _plan_seal(local, algorithm, granularity, chunk_size, private_key))
        if g.rank == 0
        else None,
    )
    share = _attempt(g.rank, lambda: _hash_share(g, local, planned, max_workers, callback))
    shares = _all_gather(g, share)
    written = _broadcast(
        g, _attempt(g.rank, lambda: _write_seal(local, planned, shares, private_key)) if g.rank == 0 else None
    )
    _raise_first([planned, *shares, written])
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
    ``ManifestNotFoundError``, ``ManifestError``, or a built-in exception. Other
    types arrive as ``RuntimeError`` whose message starts with the original type's name.
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
    def from_exception(cls, exc: Exception, rank: int) -> Failure:
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
            return cls("RuntimeError", f"{type(exc).__name__}: {exc}", rank, cause=exc)
        return cls(kept.__name__, str(exc), rank, os_args=_os_args(exc), cause=exc)

    def to_exception(self) -> Exception:
        """A fresh exception of the recorded type whose ``str()`` is the recorded message."""
        if self.type_name == "SignatureError":
            assert self.report is not None
            return SignatureError(self.message, self.report, self.location)
        if self.type_name == "IntegrityError":
            assert self.report is not None
            return IntegrityError(self.report, self.location)
        if self.type_name == "ManifestNotFoundError":
            return ManifestNotFoundError(self.message)
        if self.type_name == "ManifestError":
            return ManifestError(self.message)
        kind: type[Exception] = getattr(builtins, self.type_name)
        if self.os_args is not None:
            exc = kind(*self.os_args)
            if str(exc) == self.message:
                return exc
        return kind(self.message)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "cause": None}


def _os_args(exc: Exception) -> tuple[Any, ...] | None:
    """``(errno, strerror[, filename[, None, filename2]])`` of an OSError that has an errno."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return None
    if exc.filename2 is not None:
        return (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
    if exc.filename is not None:
        return (exc.errno, exc.strerror, exc.filename)
    return (exc.errno, exc.strerror)


def _attempt(rank: int, step: Callable[[], T | Failure]) -> T | Failure:
    """Run one local step; its exception becomes a :class:`Failure` instead of leaving the sequence."""
    try:
        return step()
    except Exception as exc:
        return Failure.from_exception(exc, rank)


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


def _plan_verify(
    local: FsRoot | Failure,
    strict: bool,
    quick: bool,
    manifest_arg: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> _VerifyPlan | Failure:
    """Rank 0: read the manifest (and check the signature with a key) and list the checkpoint."""
    if isinstance(local, Failure):
        return local
    fs, root = local
    manifest, listing = core.manifest_and_listing(fs, root, manifest_arg, public_key)
    plan = core.plan_verification(manifest, listing, strict=strict, quick=quick)
    return _VerifyPlan(manifest.to_json(), plan, manifest.algorithm, storage.describe(fs, root))


def _plan_seal(
    local: FsRoot | Failure,
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
    private_key: signing.PrivateKey | None,
) -> _SealPlan | Failure:
    """Rank 0: check the options (and the signing key) and list the checkpoint."""
    chunk_size = core.check_seal_options(algorithm, granularity, chunk_size)
    if private_key is not None:
        core.load_signing_key(private_key, algorithm, granularity)
    if isinstance(local, Failure):
        return local
    fs, root = local
    sizes = core.list_for_seal(fs, root)
    units = plan_units(granularity, sizes, chunk_size)
    return _SealPlan(algorithm, granularity, chunk_size, sizes, units, storage.describe(fs, root))


def _hash_share(
    g: _Group,
    local: FsRoot | Failure,
    planned: _VerifyPlan | _SealPlan | Failure | None,
    max_workers: int | None,
    callback: Callback | None,
) -> Digests | Failure:
    """Every rank: hash this rank's share of the planned units (nothing if planning failed)."""
    if isinstance(planned, Failure) or planned is None:
        return {}
    if isinstance(local, Failure):
        return local
    fs, root = local
    share = shard_units(planned.units, g.size)[g.rank]
    return core.hash_units(fs, root, planned.algorithm, share, max_workers=max_workers, callback=callback)


def _write_seal(
    local: FsRoot | Failure,
    planned: _SealPlan | Failure | None,
    shares: Sequence[Digests | Failure],
    private_key: signing.PrivateKey | None,
) -> bytes | None:
    """Rank 0: build and write the manifest (then the signature) once every share is in; its bytes."""
    if isinstance(local, Failure) or not isinstance(planned, _SealPlan):
        return None
    if any(isinstance(share, Failure) for share in shares):
        return None
    fs, root = local
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


def _merge(shares: Sequence[Mapping[Unit, str | None] | Failure]) -> Digests:
    merged: Digests = {}
    for share in shares:
        assert not isinstance(share, Failure)
        merged.update(share)
    return merged


def _on_rank0(g: _Group, work: Callable[[], T]) -> T:
    """Rank 0 does ``work``; its result or exception is every rank's."""
    outcome = _broadcast(g, _attempt(g.rank, work) if g.rank == 0 else None)
    _raise_first([outcome])
    return cast(T, outcome)


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

    Rank 0 lists the candidates and broadcasts them; then every rank runs :func:`verify` on each,
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
    local = _attempt(g.rank, lambda: storage.resolve(root, storage_options, fs))
    _latest_agree(g, mode, local)
    assert not isinstance(local, Failure)
    fs_, root_ = local
    interrupted: BaseException | None = None
    listed: list[tuple[str, str]] | Failure | None = None
    if g.rank == 0:
        try:
            listed = _attempt(g.rank, lambda: _latest_candidates(fs_, root_))
        except BaseException as exc:  # Ctrl-C: the other ranks still get a verdict, then it is raised here
            interrupted = exc
            listed = Failure("RuntimeError", f"{type(exc).__name__}: {exc}", g.rank)
    listed = _broadcast(g, listed)
    if interrupted is not None:
        raise interrupted
    _raise_first([listed])
    assert isinstance(listed, list)
    for name, url in listed:
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


def _latest_agree(g: _Group, mode: str, local: FsRoot | Failure) -> None:
    """One collective over every rank's arguments: a bad or differing ``mode``, or a root that does
    not resolve on some rank, raises on every rank."""
    check = _attempt(g.rank, lambda: _check_mode(mode))
    gathered = _all_gather(g, (mode, check, local if isinstance(local, Failure) else None))
    _raise_first([check for _, check, _ in gathered])
    modes = [m for m, _, _ in gathered]
    if len(set(modes)) > 1:
        raise ValueError(f"every rank must pass the same mode; by rank: {modes}")
    _raise_first([failed for _, _, failed in gathered])
