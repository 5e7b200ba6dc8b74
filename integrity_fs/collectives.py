"""The collectives beneath ``distributed``, ``dcp`` and the command line under torchrun: every
rank runs the same collectives whatever happened on it, and raises the same exception after the
last one. Exceptions travel pickled; one that cannot (a backend's own type) travels as a
``RuntimeError`` naming it, and a ``BaseException`` (Ctrl-C) is raised again on its own rank.
torch is imported only when a function here is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "INSTALL_HINT",
    "MODES",
    "agree",
    "broadcast",
    "by_rank",
    "check_same",
    "fingerprint",
    "gather",
    "group_of",
    "logged_once",
    "rank",
    "ranks",
    "torch_distributed",
]

T = TypeVar("T")
INSTALL_HINT = "pip install 'integrity-fs[torch]'"
MODES = ("sharded", "rank0")


def torch_distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(f"integrity_fs.distributed needs torch: {INSTALL_HINT}") from exc
    return dist


def group_of(group: Any) -> Any:
    """``group`` (the world by default) when a process group of more than one rank is there, else ``None``."""
    dist = torch_distributed()
    if not dist.is_available() or not dist.is_initialized():
        return None
    g = group if group is not None else dist.group.WORLD
    return g if dist.get_world_size(g) > 1 else None


def rank(g: Any) -> int:
    return int(torch_distributed().get_rank(g)) if g is not None else 0


def gather(g: Any, value: Any) -> list[Any]:
    dist = torch_distributed()
    out: list[Any] = [None] * dist.get_world_size(g)
    dist.all_gather_object(out, value, group=g)
    return out


def broadcast(g: Any, value: Any) -> Any:
    dist = torch_distributed()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0) if g is not dist.group.WORLD else 0, group=g)
    return box[0]


def _text(exc: BaseException) -> str | None:
    """``str(exc)``, or ``None`` when that raises (a backend's exception formatting fields it never set)."""
    try:
        return str(exc)
    except Exception:
        return None


def _portable(exc: BaseException, where: int) -> BaseException:
    """``exc`` if it pickles and unpickles as itself, else a ``RuntimeError`` naming it; never raises."""
    text = _text(exc)
    if isinstance(exc, Exception) and text is not None:
        try:
            back = pickle.loads(pickle.dumps(exc))
            if type(back) is type(exc) and _text(back) == text:
                return exc
        except Exception:
            pass
    said = "<exception str() failed>" if text is None else text
    return RuntimeError(f"{type(exc).__name__} on rank {where}" + (f": {said}" if said else ""))


def agree(g: Any, step: Callable[[], T], *, only: int | None = None, every: bool = False) -> Any:
    """``step()`` on every rank (on rank ``only`` alone, its result sent to all), then one gather:
    this rank's result (rank ``only``'s; every rank's in order with ``every``), or the first
    failure by rank, raised on every rank with the same type and message (a ``BaseException``
    such as Ctrl-C is raised again on its own rank; the others raise a ``RuntimeError`` naming it)."""
    me = rank(g)
    result: Any = None
    failure: BaseException | None = None
    if only is None or me == only:
        try:
            result = step()
        except BaseException as exc:
            failure = exc
    sent = result if failure is None and (only is not None or every) else None
    if sent is not None:
        try:
            pickle.dumps(sent)
        except Exception as exc:  # what cannot travel fails here, on every rank alike
            failure, sent = exc, None
    mine = None if failure is None else _portable(failure, me)
    outcomes = gather(g, (mine, sent))
    first = next((i for i, (f, _) in enumerate(outcomes) if f is not None), None)
    if first is not None:
        if failure is not None and not isinstance(failure, Exception):
            raise failure
        if first == me:
            assert failure is not None and mine is not None
            if mine is failure:
                raise failure
            raise mine from failure
        error: BaseException = outcomes[first][0]
        error.add_note(f"(raised on rank {first})")
        raise error
    if every:
        return [r for _, r in outcomes]
    return outcomes[only][1] if only is not None else result


def check_same(g: Any, value: Any, what: str) -> None:
    """``ValueError`` on every rank, the same message, when ranks pass different ``value``s (for a
    ``dict``, the keys that differ are named, with what each rank passed)."""
    seen = gather(g, value)
    if all(v == seen[0] for v in seen):
        return
    if all(isinstance(v, dict) for v in seen):
        keys = sorted({k for v in seen for k in v}, key=str)
        parts = [f"{k}: {by_rank([v.get(k) for v in seen])}" for k in keys if len({repr(v.get(k)) for v in seen}) > 1]
    else:
        parts = [by_rank(seen)]
    raise ValueError(f"ranks disagree on {what}: " + "; ".join(parts))


def by_rank(values: list[Any]) -> str:
    """``'a' on ranks 0, 2 | 'b' on rank 1``: each value once, with the ranks that have it."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), []).append(r)
    return " | ".join(f"{v} on {ranks(rs)}" for v, rs in groups.items())


def ranks(numbers: list[int]) -> str:
    return f"rank {numbers[0]}" if len(numbers) == 1 else "ranks " + ", ".join(map(str, numbers))


def fingerprint(options: Any) -> tuple[Any, ...]:
    """What ranks must agree on in an options object: every field but the per-rank ones
    (progress, workers, a key: rank 0's counts)."""
    skip = {"callback", "max_workers", "private_key", "public_key"}
    return tuple((f.name, repr(getattr(options, f.name))) for f in dataclasses.fields(options) if f.name not in skip)


class _OtherThreads(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def logged_once(g: Any) -> Iterator[None]:
    """What a collective logs, logged by rank 0 alone (every rank reaches the same verdicts):
    on the other ranks, ``integrity_fs``'s records from this thread are dropped meanwhile."""
    if g is None or rank(g) == 0:
        yield
        return
    logger = logging.getLogger("integrity_fs")
    quiet = _OtherThreads()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
