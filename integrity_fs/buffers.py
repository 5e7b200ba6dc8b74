"""The memory verified reads fill: new ``bytes`` objects filled in place (huge pages where Linux
has them), copies out of them without the GIL, and the room the units of one open file may take.

Internal: :mod:`integrity_fs.read` and the loaders built on it use these.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Hashable
from typing import Any

from . import storage

__all__ = ["FILLABLE_BYTES", "HUGE_PAGE", "UNLOCKED_COPY_MIN", "Room", "copy_out", "huge_pages", "unfilled_bytes"]

#: Copies at least this long are made without holding the GIL (``ctypes.memmove`` releases it), so
#: that the read-ahead threads hash while the caller copies; shorter ones are a slice assignment.
UNLOCKED_COPY_MIN = 256 * 1024
#: Memory at least this large is asked to be backed by huge pages (Linux's transparent huge pages).
HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # linux/mman.h


def copy_out(target: memoryview, data: bytes, offset: int) -> None:
    """``target[:] = data[offset : offset + len(target)]`` without an intermediate copy; a large
    copy releases the GIL while it runs."""
    n = len(target)
    if offset < 0 or offset + n > len(data):
        raise ValueError(f"{n} bytes from {offset} of a unit of {len(data)}")
    if n < UNLOCKED_COPY_MIN or target.readonly or not isinstance(data, bytes):
        target[:] = memoryview(data)[offset : offset + n]
        return
    ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(target)), _bytes_address(data) + offset, n)


def _bytes_address(data: bytes) -> int:
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return address


def unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``size`` (at least 2) bytes, not yet filled, and a writable view of
    its bytes: the caller fills the view and only then hands the object out, as CPython's own
    ``FileIO.readall`` does with ``PyBytes_FromStringAndSize(NULL, size)``. So a verified read
    returns the very bytes it hashed, without a copy. Its memory is asked for huge pages
    (:func:`huge_pages`). CPython only (:data:`FILLABLE_BYTES`)."""
    data = _BYTES_NEW(None, size)
    address = _bytes_address(data)
    huge_pages(address, size)
    return data, memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def huge_pages(address: int, size: int) -> None:
    """Ask Linux to back the untouched memory ``[address, address + size)`` with huge pages: filling
    a fresh 64 MiB unit then takes 32 page faults, not 16,384 (measured: 17 ms instead of 48 ms
    for a read from the page cache into it, a third of hashing it). Only advice: a no-op where
    huge pages are off, and elsewhere than Linux."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + size) // HUGE_PAGE * HUGE_PAGE
    if end > start and _MADVISE is not None:
        _MADVISE(start, end - start, _MADV_HUGEPAGE)


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()

FILLABLE_BYTES = sys.implementation.name == "cpython" and hasattr(ctypes, "pythonapi")
if FILLABLE_BYTES:
    _BYTES_NEW = ctypes.pythonapi.PyBytes_FromStringAndSize
    _BYTES_NEW.restype = ctypes.py_object
    _BYTES_NEW.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


class Room:
    """The memory the units of one open file fill, at most ``limit`` bytes: a unit read ahead waits
    before each piece until it fits, counting the units up to the one the caller reads as whole (they
    never wait, so the caller is never kept waiting for room that only its own progress frees).
    A unit with huge pages is counted with the whole huge page its bytes end in. A unit given back
    (dropped) frees its room: a view of it still alive keeps its bytes, but no read fills new ones.
    Each unit's read is known by a key of its own (the same index may be read again later)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._units: dict[Hashable, tuple[int, int, int]] = {}  # key -> index, bytes filled, size
        self._reading = 0  # the unit the caller reads
        self._changed = threading.Condition()

    def reserve(self, key: Hashable, index: int, filled: int, size: int, stop: threading.Event) -> None:
        """Room for unit ``index`` (of ``size`` bytes) to have ``filled`` bytes; ``Cancelled`` once
        ``stop`` is set (its read was stopped)."""
        if size >= HUGE_PAGE:  # the huge page the filled bytes end in is held whole
            filled = min(size, filled + HUGE_PAGE)
        with self._changed:
            while True:
                if stop.is_set():
                    raise storage.Cancelled("stopped")
                if index <= self._reading or self._used(without=key) + filled <= self._limit:
                    self._units[key] = (index, filled, size)
                    return
                self._changed.wait()

    def _used(self, without: Hashable) -> int:
        return sum(
            size if index <= self._reading else filled
            for key, (index, filled, size) in self._units.items()
            if key is not without
        )

    def reading(self, key: Hashable, index: int, size: int) -> None:
        """The caller now reads unit ``index`` (of ``size`` bytes, read under ``key``): it counts
        whole from now on, before its read has filled anything."""
        with self._changed:
            self._reading = index
            self._units.setdefault(key, (index, 0, size))
            self._changed.notify_all()

    def give_back(self, key: Hashable) -> None:
        with self._changed:
            self._units.pop(key, None)
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake the reads waiting for room (to see that they are stopped)."""
        with self._changed:
            self._changed.notify_all()
