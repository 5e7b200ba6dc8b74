"""Progress: fsspec's callbacks, the type of every ``callback=`` (SPEC), through the door.

Internal: the verbs count bytes through :func:`progress_fn`; the command line draws its bars
with :class:`TqdmCallback`.
"""

from __future__ import annotations

import threading

from fsspec.callbacks import DEFAULT_CALLBACK, Callback, TqdmCallback

from .read import ProgressFn

__all__ = ["DEFAULT_CALLBACK", "Callback", "TqdmCallback", "progress_fn"]


def progress_fn(callback: Callback | None, total: int) -> ProgressFn:
    """A thread-safe byte counter on ``callback`` (none: fsspec's no-op callback), after telling it the total."""
    cb = Callback.as_callback(callback)
    cb.set_size(total)
    lock = threading.Lock()

    def update(n: int) -> None:
        with lock:
            cb.relative_update(n)

    return update
