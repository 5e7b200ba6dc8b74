"""The collectives beneath ``distributed``, ``dcp`` and the command line under torchrun: every
rank runs the same collectives whatever happened on it, and raises the same exception after the
last one. Exceptions travel pickled; one that cannot (a backend's own type) travels as a
``RuntimeError`` naming it, and a ``BaseException`` (Ctrl-C) is raised again on its own rank.
torch is imported only when a function here is called.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["INSTALL_HINT", "MODES", "agree", "broadcast", "check_same", "gather", "group_of", "rank", "torch_distributed"]

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


def _portable(exc: BaseException, where: int) -> BaseException:
    """``exc`` if it pickles and unpickles as itself, else a ``RuntimeError`` naming it."""
    if isinstance(exc, Exception):
        try:
            back = pickle.loads(pickle.dumps(exc))
            if type(back) is type(exc) and str(back) == str(exc):
                return exc
        except Exception:
            pass
    return RuntimeError(f"{type(exc).__name__} on rank {where}: {exc}")


def agree(g: Any, step: Callable[[], T], *, only: int | None = None, every: bool = False) -> Any:
    """``step()`` on every rank (on rank ``only`` alone, its result sent to all), then one gather:
    this rank's result (rank ``only``'s; every rank's in order with ``every``), or the first
    failure by rank, raised on every rank (the rank that hit it raises its own)."""
    me = rank(g)
    result: Any = None
    failure: BaseException | None = None
    if only is None or me == only:
        try:
            result = step()
        except BaseException as exc:
            failure = exc
    sent = result if only is not None or every else None
    outcomes = gather(g, (None if failure is None else _portable(failure, me), sent))
    first = next((i for i, (f, _) in enumerate(outcomes) if f is not None), None)
    if first is not None:
        if failure is not None and (first == me or not isinstance(failure, Exception)):
            raise failure
        raise outcomes[first][0]
    if every:
        return [r for _, r in outcomes]
    return outcomes[only][1] if only is not None else result


def check_same(g: Any, value: Any, what: str) -> None:
    """``ValueError`` on every rank when ranks pass different ``value``s."""
    seen = gather(g, value)
    if any(v != seen[0] for v in seen):
        differ = next(i for i, v in enumerate(seen) if v != seen[0])
        raise ValueError(f"ranks disagree on {what}: rank 0 has {seen[0]!r}, rank {differ} has {seen[differ]!r}")
