"""Work on a pool of threads: the first failure, or Ctrl-C, stops every worker within one block,
and the call returns only once none is left running. Progress goes to an fsspec ``Callback``."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from fsspec.callbacks import Callback

from . import storage
from .report import printable

__all__ = ["Progress", "log_done", "run_parallel", "workers_for"]

log = logging.getLogger("integrity_fs")
T = TypeVar("T")
R = TypeVar("R")

#: Concurrent reads on object stores, where latency, not the CPU, is the limit.
REMOTE_WORKERS = 16


def workers_for(fs: Any, max_workers: int | None) -> int:
    return max_workers or ((os.cpu_count() or 1) if storage.is_local(fs) else REMOTE_WORKERS)


class Progress:
    """Bytes done, told to an fsspec ``Callback`` (``set_size`` once, then ``relative_update``) from any thread."""

    def __init__(self, callback: Any, total: int) -> None:
        self._callback = Callback.as_callback(callback)
        self._lock = threading.Lock()
        self._callback.set_size(total)

    def __call__(self, n: int) -> None:
        with self._lock:
            self._callback.relative_update(n)


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, stop: threading.Event) -> list[R]:
    """``fn`` on every item, on up to ``workers`` threads, results in order. On the first
    exception or Ctrl-C, ``stop`` is set (``fn`` reads check it), items not started are dropped,
    and the exception is raised once every worker has stopped."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    prefix = f"integrity_fs_{next(_pools)}"
    pool = ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix=prefix)
    try:
        futures = [pool.submit(fn, item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [e for f in futures if f in done and (e := f.exception()) is not None]
        if errors:
            stop.set()
            _stop_all(pool, prefix)
            raise next((e for e in errors if not isinstance(e, storage.Cancelled)), errors[0])
    except BaseException:
        stop.set()
        _stop_all(pool, prefix)
        raise
    pool.shutdown(wait=True)
    return [f.result() for f in futures]


_pools = itertools.count()


def _stop_all(pool: ThreadPoolExecutor, prefix: str) -> None:
    """Drop the work not started and wait for every thread of ``pool``: also one whose start a
    Ctrl-C interrupted (started, but not yet among the pool's own threads)."""
    pool.shutdown(wait=True, cancel_futures=True)
    for thread in threading.enumerate():
        if thread.name.startswith(prefix + "_") and thread is not threading.current_thread():
            thread.join()


def log_done(what: str, where: str, files: int, nbytes: int, started: float) -> None:
    elapsed = time.perf_counter() - started
    rate = nbytes / elapsed / 1e9 if elapsed > 0 else 0.0
    log.info("%s %s: %d files, %d bytes in %.2f s (%.2f GB/s)", what, printable(where), files, nbytes, elapsed, rate)
