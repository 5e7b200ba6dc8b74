"""open: a file of a sealed checkpoint that returns only verified bytes, read once.

The file is read in its manifest's units (a chunk, or the whole file): a unit is read through the
guarded reader (pinned to the version listed), hashed as it lands in a buffer, and compared with
the manifest before any of its bytes is returned. A damaged unit raises ``IntegrityError``, a file
whose version changed ``FileChangedError``. The next unit is read ahead on a helper thread while
the caller consumes the current one, so hashing overlaps the caller's own work. At most
:data:`HELD_UNITS` units are held per open file.

A file of file granularity larger than :data:`WHOLE_FILE_LIMIT` cannot be held whole: it is
verified first (one pinned pass) and then served by a second pass pinned to the same version
(local files: the identity is checked after each read, before its bytes are returned).

``dcp.load``, ``VerifyingFsspecReader`` and the safetensors loader read through :class:`VerifiedFile`.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import fsspec

from . import manifests, signing, storage
from .errors import IntegrityError
from .hashing import DEFAULT_CHUNK_SIZE, chunk_range
from .manifest import Manifest
from .report import Problem, Report, printable
from .verify import verify_options

__all__ = ["HELD_UNITS", "READ_AHEAD", "WHOLE_FILE_LIMIT", "Buffers", "Entry", "VerifiedFile", "open"]

URL = str | os.PathLike[str]

#: A file of file granularity up to this size is read, hashed and held whole; a larger one is
#: verified first and then served by a second pinned read. The same bound as a default chunk.
WHOLE_FILE_LIMIT = DEFAULT_CHUNK_SIZE
#: Units read ahead at once, each on a helper thread: hashing is what reading costs, and two
#: units hashed at once keep two cores busy while the caller works on the bytes already verified.
READ_AHEAD = 2
#: Units held at once per open file: the one being read, the next (read ahead), and one more for
#: readers that look at a file's end before its start (``torch.load`` reads a zip's directory first).
HELD_UNITS = 1 + READ_AHEAD


@dataclass(frozen=True)
class Entry:
    """One file of a checkpoint, as a verified read needs it: where it is, its size and version as
    listed, its digests from the manifest, and the checkpoint it belongs to (for messages)."""

    fs: fsspec.AbstractFileSystem  # what serves the bytes (a caching layer, or the store)
    path: str
    name: str
    size: int
    version: storage.Version | None  # None: nothing to pin to (reads through a cache)
    manifest: Manifest
    location: str


def open(
    url: URL,
    name: str,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> VerifiedFile:
    """The file ``name`` of the sealed checkpoint at ``url``, as a read-only binary file object
    that returns only verified bytes (see the module docstring).

    Raises ``ManifestNotFoundError`` without a manifest, ``FileNotFoundError`` when ``name`` is not
    in the manifest, ``IntegrityError`` when the file is missing or of another size than sealed
    (and later, when a unit read does not match), ``SignatureError`` when ``public_key`` is given
    and the signature does not verify. ``manifest`` is as for :func:`integrity_fs.verify`. Through
    a caching layer (``simplecache::…``), the bytes are hashed as the cache serves them.
    """
    serving, root = storage.resolve(url, storage_options, fs, through_caches=True)
    store = storage.beneath_caches(serving)
    options = verify_options(manifest=manifest, public_key=public_key)
    found, _in_use, _kind = manifests.manifest_in_use(store, root, options)
    location = storage.describe(store, root)
    if name not in found.files:
        raise FileNotFoundError(f"{printable(name)} is not in the manifest of {location}")
    path = storage.join(root, name)
    size, version = storage.stat_file(store, root, name)
    expected = found.sizes[name] if found.sizes is not None else size
    if size is None:
        raise IntegrityError(Report(problems=(Problem(name, "missing", expected=found.files[name]),)), location)
    if size != expected:
        raise IntegrityError(Report(problems=(Problem(name, "size", expected=expected, actual=size),)), location)
    pin = version if serving is store else None
    return VerifiedFile(Entry(serving, path, name, size, pin, found, location))


class _Units:
    """The byte ranges ``[start, end)`` a file is verified in, with the digest each must have."""

    def __init__(self, entry: Entry) -> None:
        manifest = entry.manifest
        if manifest.granularity == "chunk":
            assert manifest.chunks is not None and manifest.chunk_size is not None
            self.size = manifest.chunk_size
            self.digests: tuple[str, ...] = manifest.chunks[entry.name]
        else:
            self.size = max(1, entry.size)
            self.digests = (manifest.files[entry.name],)
        self.file_size = entry.size

    def __len__(self) -> int:
        return len(self.digests)

    def range(self, index: int) -> tuple[int, int]:
        return chunk_range(self.file_size, self.size, index)

    def at(self, position: int) -> int:
        return min(position // self.size, len(self.digests) - 1)


class Buffers:
    """Unit buffers kept for reuse, so that reading unit after unit does not fault fresh pages in
    each time (one pool can serve the files of one load, read one after another)."""

    def __init__(self, keep: int = HELD_UNITS) -> None:
        self._free: list[Any] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if len(buffer) == size:
                    return memoryview(self._free.pop(i))
        return memoryview(_new_buffer(size))

    def give(self, view: memoryview) -> None:
        buffer = view.obj
        if isinstance(buffer, (bytearray, mmap.mmap)):
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buffer)


#: Buffers at least this large are mapped with their pages made present at once (one call) rather
#: than faulted in one page at a time as the first read writes them.
POPULATED_MIN = 1024 * 1024
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _new_buffer(size: int) -> Any:
    if size >= POPULATED_MIN and _POPULATE and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return bytearray(size)


class VerifiedFile(io.RawIOBase):
    """A read-only binary file object over one file of a sealed checkpoint that returns only
    verified bytes: ``read``, ``readinto``, ``seek``, ``tell``; a context manager.

    ``bytes_verified`` counts the bytes hashed so far (each unit once, whatever is read of it).
    """

    def __init__(self, entry: Entry, *, read_ahead: bool = True, buffers: Buffers | None = None) -> None:
        super().__init__()
        self.entry = entry
        self.name = entry.path
        self._buffers = buffers if buffers is not None else Buffers()
        self._units = _Units(entry)
        self._position = 0
        self._read_to = 0  # where the last read ended
        self._passed = 0  # read through in order up to here: units that end before are done with
        self._lock = threading.Lock()
        self._held: dict[int, Future[memoryview]] = {}
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._read_ahead = read_ahead and len(self._units) > 1
        self.bytes_verified = 0
        self._passthrough: _Passthrough | None = None
        if entry.manifest.granularity != "chunk" and entry.size > WHOLE_FILE_LIMIT:
            self._passthrough = _Passthrough(entry, self._stop, self._count)

    # --- the file object ---------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            target = offset
        elif whence == os.SEEK_CUR:
            target = self._position + offset
        elif whence == os.SEEK_END:
            target = self.entry.size + offset
        else:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        self._position = target
        return target

    def readinto(self, buffer: Any) -> int:
        self._check_open()
        view = memoryview(buffer).cast("B")
        if self._position == self._read_to:  # read on from where the last read ended: all before is passed
            self._passed = max(self._passed, self._position)
        done = 0
        while done < len(view) and self._position < self.entry.size:
            if done:  # this read goes on past a unit's end: what lies before is read through
                self._passed = max(self._passed, self._position)
            if self._passthrough is not None:
                n = self._passthrough.readinto(view[done:], self._position)
            else:
                n = self._copy_from_unit(view[done:])
            self._position += n
            done += n
        self._read_to = self._position
        return done

    def readall(self) -> bytes:
        self._check_open()
        size = max(0, self.entry.size - self._position)
        if _FILLABLE_BYTES and size >= 2:  # CPython shares its bytes objects of 0 and 1 byte
            data, view = _unfilled_bytes(size)
            self.read_rest_into(view)
            return data
        out = bytearray(size)
        self.read_rest_into(out)
        return bytes(out)

    def read_rest_into(self, buffer: Any) -> int:
        """Read from the position to the end of the file into ``buffer``, which must be exactly that
        long; returns the count.

        Units already held (read ahead), and a unit the position lies inside, are copied as
        :meth:`readinto` copies them; every other unit is read and hashed where it lands in
        ``buffer``, up to ``1 + READ_AHEAD`` at once: no unit buffer, no second copy. So when this
        raises, ``buffer`` may hold bytes of a unit that did not match: it is for a caller that owns
        ``buffer`` and drops it then (``read()`` returns its object only once every unit matched).
        """
        self._check_open()
        view = memoryview(buffer).cast("B")
        base = self._position
        if len(view) != max(0, self.entry.size - base):
            raise ValueError(f"read_rest_into needs a buffer of {self.entry.size - base} bytes, not {len(view)}")
        if self._passthrough is not None or not view:
            return self.readinto(view)
        read_ahead, self._read_ahead = self._read_ahead, False  # every unit to the end is read here
        indexes = range(self._units.at(base), len(self._units))
        with self._lock:
            in_place = [i for i in indexes if i not in self._held and self._units.range(i)[0] >= base]
        stop = threading.Event()

        def one(index: int) -> None:
            start, end = self._units.range(index)
            try:
                self._check(index, _hash_into(self.entry, start, view[start - base : end - base], stop))
            except BaseException:
                stop.set()  # the other units stop at their next piece
                raise

        pool = ThreadPoolExecutor(max(1, min(len(in_place), 1 + READ_AHEAD)), thread_name_prefix="integrity_fs-read")
        try:
            futures = [pool.submit(one, index) for index in in_place]
            for index in (i for i in indexes if i not in in_place):
                start, end = self._units.range(index)
                self._position = max(base, start)
                self.readinto(view[self._position - base : end - base])
                self.release_before(end)
            wait(futures)
        except BaseException:  # a held unit that did not match, or Ctrl-C: the others stop
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True)
            self._read_ahead = read_ahead
        failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
        if failures:  # the failure itself, not a unit it stopped
            raise next((e for e in failures if not isinstance(e, storage.Cancelled)), failures[0])
        self._position = self._read_to = self._passed = self.entry.size
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for index in list(self._held):
                self._drop(index)
        if self._passthrough is not None:
            self._passthrough.close()
        super().close()

    def __enter__(self) -> VerifiedFile:
        return self

    # --- units -------------------------------------------------------------------------------

    def release_before(self, position: int) -> None:
        """The caller will read nothing before ``position`` again: units that end there can go."""
        with self._lock:
            for index in [i for i in self._held if self._units.range(i)[1] <= position and self._held[i].done()]:
                self._drop(index)

    def _copy_from_unit(self, view: memoryview) -> int:
        index = self._units.at(self._position)
        start, end = self._units.range(index)
        data = self._unit(index).result()
        offset = self._position - start
        n = min(len(view), end - self._position)
        copy(view[:n], data[offset : offset + n])
        return n

    def _unit(self, index: int) -> Future[memoryview]:
        """The verified bytes of unit ``index``: held, being read ahead, or read now (in this
        thread); the next ones are read ahead first, so that they are hashed while this one is."""
        with self._lock:
            future = self._held.get(index)
            if future is None:
                future = Future()
                self._make_room(index, demand=True)
                self._held[index] = future
                load_here = True
            else:
                load_here = False
        if self._read_ahead:
            for ahead in range(index + 1, min(index + 1 + READ_AHEAD, len(self._units))):
                self._ahead(ahead)
        if load_here:
            self._load(index, future)
        return future

    def _ahead(self, index: int) -> None:
        with self._lock:
            if index in self._held or not self._make_room(index, demand=False):
                return
            future: Future[memoryview] = Future()
            self._held[index] = future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="integrity_fs-read")
        self._pool.submit(self._load, index, future)

    def _make_room(self, index: int, *, demand: bool) -> bool:
        """Make room for unit ``index`` (under the lock). Reading ahead only takes a free place, or
        that of a unit read through in order (the reader went on past its end): it never pushes
        out what may still be read. A unit asked for now first drops the unit furthest behind the
        position, else the one furthest ahead (and is read even past the bound while the others
        are still being read)."""
        if len(self._held) < HELD_UNITS:
            return True
        done = [i for i in self._held if i != index and self._held[i].done()]
        passed = [i for i in done if self._units.range(i)[1] <= self._passed]
        if passed:
            self._drop(min(passed))
            return True
        if not demand:
            return False
        if done:
            here = self._units.at(self._position)
            behind = [i for i in done if i < here]
            self._drop(min(behind) if behind else max(done))
        return True

    def _drop(self, index: int) -> None:
        """Forget unit ``index`` (under the lock) and give its buffer back."""
        future = self._held.pop(index)
        if future.done() and future.exception() is None:
            self._buffers.give(future.result())

    def _load(self, index: int, future: Future[memoryview]) -> None:
        try:
            future.set_result(self._read_unit(index))
        except BaseException as exc:
            future.set_exception(exc)

    def _read_unit(self, index: int) -> memoryview:
        entry = self.entry
        start, end = self._units.range(index)
        buffer = self._buffers.take(end - start)
        try:
            self._check(index, _hash_into(entry, start, buffer, self._stop))
        except BaseException:
            self._buffers.give(buffer)
            raise
        return buffer

    def _check(self, index: int, digest: str) -> None:
        """Unit ``index`` hashed to ``digest``: counted when it matches the manifest, else an
        ``IntegrityError`` naming its byte range (chunks)."""
        start, end = self._units.range(index)
        if digest != self._units.digests[index]:
            ranges = ((start, end),) if self.entry.manifest.granularity == "chunk" else ()
            problem = Problem(self.entry.name, "mismatch", self._units.digests[index], digest, ranges)
            raise IntegrityError(Report(problems=(problem,)), self.entry.location)
        self._count(end - start)

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_verified += n

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on a closed file")


#: Copies at least this long are made without holding the GIL (``ctypes.memmove`` releases it), so
#: that the read-ahead thread hashes while the caller copies; shorter ones are a slice assignment.
UNLOCKED_COPY_MIN = 256 * 1024


def copy(target: memoryview, source: memoryview) -> None:
    """``target[:] = source`` (same length); a large copy releases the GIL while it runs."""
    n = len(source)
    if n < UNLOCKED_COPY_MIN or target.readonly:
        target[:] = source
        return
    ctypes.memmove(_address(target), _address(source), n)


def _unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``size`` (at least 2) bytes, not yet filled, and a writable view of
    its bytes: the caller fills the view and only then hands the object out, as CPython's own
    ``FileIO.readall`` does with ``PyBytes_FromStringAndSize(NULL, size)``. So a verified read
    returns the very bytes it hashed, without a copy. CPython only (:data:`_FILLABLE_BYTES`)."""
    data = _BYTES_NEW(None, size)
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert address is not None
    return data, memoryview((ctypes.c_char * size).from_address(address)).cast("B")


_FILLABLE_BYTES = sys.implementation.name == "cpython" and hasattr(ctypes, "pythonapi")
if _FILLABLE_BYTES:
    _BYTES_NEW = ctypes.pythonapi.PyBytes_FromStringAndSize
    _BYTES_NEW.restype = ctypes.py_object
    _BYTES_NEW.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _address(view: memoryview) -> int:
    if view.readonly:  # never a unit buffer (a bytearray): only the caller's, checked above
        raise ValueError("read-only buffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _hash_into(entry: Entry, start: int, buffer: memoryview, stop: threading.Event) -> str:
    """The digest of ``len(buffer)`` bytes of the file from ``start``, read into ``buffer`` through
    the guarded reader; a file that is shorter or longer than sealed is an ``IntegrityError``."""
    try:
        return storage.hash_range(
            entry.fs,
            entry.path,
            entry.manifest.algorithm,
            start,
            len(buffer),
            file_size=entry.size,
            version=entry.version,
            stop=stop,
            into=buffer,
        )
    except storage.SizeChangedError as exc:
        problem = Problem(entry.name, "size", expected=entry.size, actual=exc.size)
        raise IntegrityError(Report(problems=(problem,)), entry.location) from exc
    except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError) as exc:
        problem = Problem(entry.name, "missing", expected=entry.manifest.files[entry.name])
        raise IntegrityError(Report(problems=(problem,)), entry.location) from exc


class _Passthrough:
    """A file too large to hold whole: verified first (one pinned pass), then served by reads
    pinned to the same version. Local reads check the identity after each read, before its
    bytes are returned; S3 and GCS refuse another version on every request."""

    def __init__(self, entry: Entry, stop: threading.Event, count: Callable[[int], None]) -> None:
        self._entry, self._stop, self._count = entry, stop, count
        self._verified = False
        self._reader: storage.Range | None = None
        self._at = -1  # the position the open reader is at

    def readinto(self, view: memoryview, position: int) -> int:
        if not self._verified:
            self._verify()
        if self._reader is None or self._at != position:
            self.close()
            entry = self._entry
            self._reader = storage.open_range(
                entry.fs, entry.path, position, entry.size - position, version=entry.version, stop=self._stop
            )
            self._at = position
        n = self._reader.readinto(view[: self._entry.size - position])
        self._reader.check_version()
        if not n:
            raise IntegrityError(
                Report(problems=(Problem(self._entry.name, "size", self._entry.size, position),)), self._entry.location
            )
        self._at += n
        return n

    def _verify(self) -> None:
        entry = self._entry
        try:
            digest = storage.hash_range(
                entry.fs,
                entry.path,
                entry.manifest.algorithm,
                0,
                entry.size,
                file_size=entry.size,
                version=entry.version,
                stop=self._stop,
            )
        except storage.SizeChangedError as exc:
            problem = Problem(entry.name, "size", expected=entry.size, actual=exc.size)
            raise IntegrityError(Report(problems=(problem,)), entry.location) from exc
        expected = entry.manifest.files[entry.name]
        if digest != expected:
            raise IntegrityError(Report(problems=(Problem(entry.name, "mismatch", expected, digest),)), entry.location)
        self._verified = True
        self._count(entry.size)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
