"""The memory verified reads fill: new ``bytes`` objects filled in place, and copies out of them
without the GIL.

Internal: :mod:`integrity_fs.read` and the loaders built on it use these.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

__all__ = ["FILLABLE_BYTES", "UNLOCKED_COPY_MIN", "copy_out", "unfilled_bytes"]

#: Copies at least this long are made without holding the GIL (``ctypes.memmove`` releases it), so
#: that the read-ahead threads hash while the caller copies; shorter ones are a slice assignment.
UNLOCKED_COPY_MIN = 256 * 1024


def copy_out(target: memoryview, data: bytes | bytearray | mmap.mmap, offset: int) -> None:
    """``target[:] = data[offset : offset + len(target)]`` without an intermediate copy; a large
    copy releases the GIL while it runs."""
    n = len(target)
    if offset < 0 or offset + n > len(data):
        raise ValueError(f"{n} bytes from {offset} of a unit of {len(data)}")
    if n < UNLOCKED_COPY_MIN or target.readonly:
        target[:] = memoryview(data)[offset : offset + n]
        return
    source = _bytes_address(data) if isinstance(data, bytes) else ctypes.addressof(ctypes.c_char.from_buffer(data))
    ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(target)), source + offset, n)


def _bytes_address(data: bytes) -> int:
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return address


def unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``size`` (at least 2) bytes, not yet filled, and a writable view of
    its bytes: the caller fills the view and only then hands the object out, as CPython's own
    ``FileIO.readall`` does with ``PyBytes_FromStringAndSize(NULL, size)``. So a verified read
    returns the very bytes it hashed, without a copy (and without first filling it with zeros, as
    ``bytearray(size)`` does). CPython only (:data:`FILLABLE_BYTES`)."""
    data = _BYTES_NEW(None, size)
    return data, memoryview((ctypes.c_char * size).from_address(_bytes_address(data))).cast("B")


FILLABLE_BYTES = sys.implementation.name == "cpython" and hasattr(ctypes, "pythonapi")
if FILLABLE_BYTES:
    _BYTES_NEW = ctypes.pythonapi.PyBytes_FromStringAndSize
    _BYTES_NEW.restype = ctypes.py_object
    _BYTES_NEW.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
