"""The collectives beneath ``distributed`` and ``dcp``: a process group as this process sees it,
failures as picklable data, and one call's sequence of collectives, so that every rank runs the
same collectives whatever happened on it and raises the same exception after the last one.

Internal. torch is imported only when a function here is called.
"""

from __future__ import annotations

import builtins
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .report import Report

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "INSTALL_HINT",
    "MODES",
    "Call",
    "Failure",
    "Group",
    "Mode",
    "all_gather",
    "broadcast",
    "check_agreed",
    "check_mode",
    "group_of",
    "name_ranks",
    "raise_first",
    "ranks_by",
    "torch_distributed",
]

V = TypeVar("V")


Mode = Literal["sharded", "rank0"]

MODES: tuple[str, ...] = ("sharded", "rank0")

INSTALL_HINT = "pip install 'integrity-fs[torch]'"

T = TypeVar("T")

#: Built-in exception types that are raised again as themselves; any other becomes a RuntimeError.
_KEPT: tuple[type[Exception], ...] = (NotImplementedError, ValueError, TypeError, RuntimeError, OSError)


@dataclass(frozen=True)
class Failure:
    """An exception as picklable data, so that every rank can raise the same one.

    ``type_name`` names a type that can be rebuilt: ``IntegrityError`` (with ``report`` and
    ``location``), ``SignatureError`` (the same, and ``message`` is its ``detail``),
    ``ManifestNotFoundError``, ``ManifestError``, ``FileChangedError`` (with ``names``), or a
    built-in exception. Other types, a
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
    names: tuple[str, ...] = ()
    cause: BaseException | None = field(default=None, compare=False)

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int) -> Failure:
        if isinstance(exc, SignatureError):  # before IntegrityError: it is one
            return cls("SignatureError", exc.detail, rank, exc.report, exc.location, cause=exc)
        message = _message(exc)
        if isinstance(exc, IntegrityError):
            return cls("IntegrityError", message, rank, exc.report, exc.location, cause=exc)
        if isinstance(exc, ManifestNotFoundError):  # before OSError: it is a FileNotFoundError
            return cls("ManifestNotFoundError", message, rank, cause=exc)
        if isinstance(exc, ManifestError):
            return cls("ManifestError", message, rank, cause=exc)
        if isinstance(exc, FileChangedError):  # before OSError: it is one
            return cls("FileChangedError", message, rank, names=exc.names, cause=exc)
        kept = next((c for c in type(exc).__mro__ if c.__module__ == "builtins" and issubclass(c, _KEPT)), None)
        if kept is None:
            named = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
            return cls("RuntimeError", named, rank, cause=exc)
        return cls(kept.__name__, message, rank, os_args=_os_args(exc), cause=exc)

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
        if self.type_name == "FileChangedError":
            return FileChangedError(self.message, self.names)
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


def _message(exc: BaseException) -> str:
    """``str(exc)``; for an exception whose ``str()`` itself raises, what Python's tracebacks print
    instead: a rank must never leave the sequence of collectives while describing its failure."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def _os_args(exc: BaseException) -> tuple[Any, ...] | None:
    """``(errno, strerror[, filename[, None, filename2]])`` of an OSError that has an errno."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return None
    if exc.filename2 is not None:
        return (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
    if exc.filename is not None:
        return (exc.errno, exc.strerror, exc.filename)
    return (exc.errno, exc.strerror)


class Call:
    """One collective call as this rank runs it: the group, and this rank's own interrupt.

    Each local step runs through :meth:`attempt`, so that no exception (``KeyboardInterrupt``
    included) leaves the sequence of collectives early; :meth:`raise_first` raises the verdict
    after the last one. A collective is built from :meth:`agree` first, then steps and
    collectives, then :meth:`raise_first`.
    """

    def __init__(self, g: Group) -> None:
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
        raise_first(outcomes)

    def agree(self, mode: object, look: Callable[[], V] | None = None) -> tuple[Mode, V | None]:
        """The first collective of a call: every rank's ``mode`` (and, in sharded mode, its view) gathered.

        Raises the same on every rank, after this one collective: ``ValueError`` when a rank's mode
        is not one of :data:`MODES` or ranks passed different modes. In sharded mode each rank
        also lists the checkpoint with ``look``; a rank's failure to list is raised on every rank,
        and views that differ (the same URL naming different storage on different ranks, such as
        node-local paths) raise ``OSError``. Returns the mode and this rank's view (``None`` in
        rank0 mode or without ``look``).
        """
        view = self.attempt(look) if look is not None and mode == "sharded" else None
        token = view if isinstance(view, Failure) or view is None else view.token  # type: ignore[attr-defined]
        gathered = all_gather(self.g, (repr(mode), token))
        if self.interrupt is not None:
            raise self.interrupt
        agreed = _agreed_mode([m for m, _ in gathered])
        if agreed == "rank0" or look is None:
            return agreed, None
        raise_first([t for _, t in gathered])
        _check_same_views([cast(tuple[str, str], t) for _, t in gathered])
        assert view is not None and not isinstance(view, Failure)
        return agreed, view

    def on_rank0(self, work: Callable[[], T]) -> T:
        """Rank 0 does ``work``; its result or exception is every rank's."""
        outcome = broadcast(self.g, self.attempt(work) if self.g.rank == 0 else None)
        self.raise_first([outcome])
        return cast(T, outcome)


def raise_first(outcomes: Sequence[object]) -> None:
    """Raise the first failure among ``outcomes`` (they are in the same order on every rank)."""
    for outcome in outcomes:
        if isinstance(outcome, Failure):
            exc = outcome.to_exception()
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {outcome.rank})")
            raise exc from outcome.cause


def _agreed_mode(modes: Sequence[str]) -> Mode:
    """The mode every rank passed (each given as its ``repr``), or ``ValueError`` naming the ranks."""
    valid: dict[str, Mode] = {repr(m): cast(Mode, m) for m in MODES}
    bad = [(rank, m) for rank, m in enumerate(modes) if m not in valid]
    if bad:
        rank, m = bad[0]
        raise ValueError(f"mode must be one of {', '.join(valid)}, not {m} (rank {rank})")
    check_agreed(modes, "modes")
    return valid[modes[0]]


def check_agreed(values: Sequence[str], what: str) -> None:
    """``ValueError``, the same on every rank, when ranks passed different ``what`` (``values``: one
    per rank, gathered): each value named with the ranks that passed it."""
    by_value = ranks_by(values)
    if len(by_value) > 1:
        raise ValueError(
            f"ranks passed different {what}: " + "; ".join(f"{v} on {name_ranks(r)}" for v, r in by_value.items())
        )


def _check_same_views(tokens: Sequence[tuple[str, str]]) -> None:
    """``OSError`` on every rank when ranks list different files at the URL."""
    groups = ranks_by([fingerprint for _where, fingerprint in tokens])
    if len(groups) == 1:
        return
    raise OSError(
        f"ranks see different files at {tokens[0][0]} (names, sizes or modification times differ; "
        f"ranks that agree: {' | '.join(map(name_ranks, groups.values()))}): sharded mode needs every rank to see "
        "the same storage at the URL (shared storage, not node-local paths); use mode='rank0' to let rank 0 "
        "alone read it, or wait until every rank has finished writing"
    )


def ranks_by(values: Sequence[str]) -> dict[str, list[int]]:
    """The ranks holding each value, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def name_ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


@dataclass(frozen=True)
class Group:
    """The process group this call runs over, and where this process stands in it."""

    handle: ProcessGroup | None
    rank: int
    size: int
    src: int  # global rank of the group's rank 0, as broadcast_object_list wants it


def torch_distributed() -> ModuleType:
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


def group_of(group: ProcessGroup | None) -> Group | None:
    """This process's place in ``group``; ``None`` when there is no initialised process group."""
    dist = torch_distributed()
    if not dist.is_available() or not dist.is_initialized():
        return None
    _check_numpy()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return Group(group, rank, dist.get_world_size(group), src)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")


def broadcast(g: Group, obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    torch_distributed().broadcast_object_list(box, src=g.src, group=g.handle)
    return box[0]


def all_gather(g: Group, obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out: list[Any] = [None] * g.size
    torch_distributed().all_gather_object(out, obj, group=g.handle)
    return out
