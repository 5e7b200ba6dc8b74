"""open: a file of a sealed checkpoint that returns only verified bytes, read once.

The file is read in its manifest's units (a chunk, or the whole file). A unit is read through
the guarded reader (pinned to the version listed) into a new ``bytes`` object, hashed as it
lands, and compared with the manifest; only then is it kept, and only kept units are served. A
kept unit is never written to again and never reused for another: dropping it only forgets it,
so bytes a caller copies or views are always the bytes that verified, whatever else happens
meanwhile (read-ahead, a seek back, another thread, ``close``). A damaged unit raises
``IntegrityError``, a file whose version changed ``FileChangedError``.

At most :data:`HELD_UNITS` units are kept per open file, two when it is read in order (the one
being read and the next). The next :data:`READ_AHEAD` unit is read ahead on a helper thread while
the caller works on the current one (and hashed beside it, while the caller waits for that one),
when the caller reads on
into a unit from where its last read ended (or starts a region, see
:meth:`VerifiedFile.release_before`), not when it looks at the end of a file before its start
(``torch.load`` reads a zip's directory first). Read-ahead takes only a free place or that of a unit
behind the one being read; a unit asked for drops units behind it first, then the one furthest
ahead. So a file read in order is read once, and so is one whose end is read first. Through a
caching layer (``filecache::…``) units are read one at a time, on the caller's thread: fsspec's
caches are filled by the first thread that opens a file and may serve it to another before it is
whole.
One lock serialises the file's methods, as ``io.BufferedReader`` does, so one object can be
shared between threads; ``close`` stops every read under way first, so no waiter is left blocked.

A file of file granularity larger than :data:`WHOLE_FILE_LIMIT` is one unit too large to hold: it
is read once, hashed, and copied as it is read into a private spool (an unlinked temporary file
of this process); once it verified, reads are served from the spool. No second read of the store.

``dcp.load``, ``VerifyingFsspecReader`` and the safetensors loader read through :class:`VerifiedFile`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import operator
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import manifests, signing, storage
from .buffers import FILLABLE_BYTES, copy_out, unfilled_bytes
from .errors import IntegrityError
from .hashing import DEFAULT_CHUNK_SIZE, chunk_range
from .manifest import Manifest
from .options import VerifyOptions
from .report import Problem, Report, printable
from .storage import URL

if TYPE_CHECKING:
    import fsspec

__all__ = ["HELD_UNITS", "READ_AHEAD", "READ_THREADS", "WHOLE_FILE_LIMIT", "Entry", "VerifiedFile", "open"]


#: A file of file granularity up to this size is read, hashed and held whole; a larger one is
#: verified into a private spool and served from there. The same bound as a default chunk.
WHOLE_FILE_LIMIT = DEFAULT_CHUNK_SIZE
#: Units read ahead of the one the caller reads: that one and the next are hashed at once (on
#: two helper threads) while the caller waits, and the next while it works on the bytes already
#: verified; so two cores stay busy, and a caller reading in order holds two units at most.
READ_AHEAD = 1
#: Helper threads per open file: the unit the caller waits for and the one after it.
READ_THREADS = 1 + READ_AHEAD
#: Units held at once per open file: the one being read, the one read ahead, and one more for a
#: unit read out of order that will be read again (the end of a file looked at before its start).
HELD_UNITS = 2 + READ_AHEAD


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
    options = VerifyOptions(manifest=manifest, public_key=public_key)
    in_use = manifests.manifest_in_use(store, root, options)
    found = in_use.manifest
    location = storage.describe(store, root)
    not_listed = FileNotFoundError(f"{printable(name)} is not in the manifest of {location}")
    if name not in found.files and not in_use.empty_unsigned:
        raise not_listed
    size, version = storage.stat_file(store, root, name)
    if name not in found.files and size == 0:
        found = signing.with_empty_files(found, {name: 0})  # model_signing's shards: passes while empty
    if name not in found.files:
        raise not_listed
    path = storage.join(root, name)
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


class _Stops:
    """The stop events of a file's reads under way: ``close`` sets them all, without the file's
    lock (a reader may hold it while it waits), so every read ends at its next block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[threading.Event] = set()
        self.closing = False

    def new(self) -> threading.Event:
        event = threading.Event()
        with self._lock:
            if self.closing:
                event.set()
            self._live.add(event)
        return event

    def done(self, event: threading.Event) -> None:
        with self._lock:
            self._live.discard(event)

    def close(self) -> None:
        with self._lock:
            self.closing = True
            for event in self._live:
                event.set()


@dataclass
class _Fetch:
    """A unit being read (or read): its verified bytes once ``future`` is done, and the event that
    stops its read when the unit is dropped before it is done."""

    future: Future[bytes]
    stop: threading.Event


class VerifiedFile(io.RawIOBase):
    """A read-only binary file object over one file of a sealed checkpoint that returns only
    verified bytes: ``read``, ``readinto``, ``readall``, ``seek``, ``tell``; a context manager;
    safe to share between threads.

    ``bytes_verified`` counts the bytes hashed so far (each unit once when read in order).
    """

    def __init__(self, entry: Entry, *, read_ahead: bool = True) -> None:
        super().__init__()
        self.entry = entry
        self.name = entry.path
        self._units = _Units(entry)
        self._position = 0
        self._lock = threading.RLock()  # every method; RawIOBase.read calls readinto
        self._held: dict[int, _Fetch] = {}
        self._stops = _Stops()
        self._pool: ThreadPoolExecutor | None = None
        # Through a caching layer, one read at a time: fsspec's caches are filled by the first
        # thread to open a file and may serve it to another before it is whole.
        self._serial = storage.beneath_caches(entry.fs) is not entry.fs
        self._read_ahead = read_ahead and len(self._units) > 1 and not self._serial
        self._last_end = 0  # where the last read ended
        self._region = 0  # where the caller's current region of the file starts (see release_before)
        self._counted = threading.Lock()
        self.bytes_verified = 0
        self._spool: _Spool | None = None
        if entry.manifest.granularity != "chunk" and entry.size > WHOLE_FILE_LIMIT:
            self._spool = _Spool(entry, self._stops, self._count)

    # --- the file object ---------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        with self._lock:
            self._check_open()
            return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        offset, whence = operator.index(offset), operator.index(whence)  # TypeError, as FileIO's
        with self._lock:
            self._check_open()
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
        with self._lock:
            self._check_open()
            return self._read_into(memoryview(buffer).cast("B"), let_go=False)

    def _read_into(self, view: memoryview, *, let_go: bool) -> int:
        """``readinto``; ``let_go``: each unit the read passes goes once its bytes are copied (a
        region read once, whose units are not needed again: while the read waits for its next
        unit, the room of the one before is free for the units read ahead)."""
        start = self._position
        # Read ahead for a read that starts a region, or for each unit a read entered going
        # on from where the last one ended: not for a look at the end before the start.
        on = start in (self._last_end, self._region)
        done = 0
        while done < len(view) and self._position < self.entry.size:
            if self._spool is not None:
                with self._close_is_value_error():
                    n = self._spool.readinto(view[done:], self._position)
            else:
                entered = self._position == start == self._region or self._position % self._units.size == 0
                n = self._copy_from_unit(view[done:], read_ahead=on and entered)
                index = self._units.at(self._position)
                if let_go and done + n < len(view) and index in self._held:
                    self._drop(index)
            self._position += n
            done += n
        self._last_end = self._position
        return done

    def readall(self) -> bytes:
        with self._lock:
            self._check_open()
            size = max(0, self.entry.size - self._position)
            if FILLABLE_BYTES and size >= 2:  # CPython shares its bytes objects of 0 and 1 byte
                data, view = unfilled_bytes(size)
                self.read_rest_into(view)
                return data
            out = bytearray(size)
            self.read_rest_into(out)
            return bytes(out)

    def read_rest_into(self, buffer: Any) -> int:
        """Read from the position to the end of the file into ``buffer``, which must be exactly that
        long; returns the count.

        Units already held, and the unit the position lies inside, are copied from there; every
        other unit is read and hashed where it lands in ``buffer``, up to :data:`HELD_UNITS` at
        once: no unit held, no second copy. So when this raises, ``buffer`` may hold bytes of a
        unit that did not match: it is for a caller that owns ``buffer`` and drops it then
        (``read()`` returns its object only once every unit matched).
        """
        with self._lock:
            self._check_open()
            view = memoryview(buffer).cast("B")
            base = self._position
            if len(view) != max(0, self.entry.size - base):
                raise ValueError(f"read_rest_into needs a buffer of {self.entry.size - base} bytes, not {len(view)}")
            if self._spool is not None or not view:
                return self.readinto(view)
            indexes = range(self._units.at(base), len(self._units))
            in_place = [i for i in indexes if i not in self._held and self._units.range(i)[0] >= base]
            stop = self._stops.new()

            def one(index: int) -> None:
                start, end = self._units.range(index)
                try:
                    self._check(index, _hash_into(self.entry, start, view[start - base : end - base], stop))
                except BaseException:
                    stop.set()  # the other units stop at their next block
                    raise

            at_once = 1 if self._serial else HELD_UNITS
            pool = ThreadPoolExecutor(max(1, min(len(in_place), at_once)), thread_name_prefix="integrity_fs-read")
            try:
                futures = [pool.submit(one, index) for index in in_place]
                for index in (i for i in indexes if i not in in_place):
                    start, end = self._units.range(index)
                    at = max(base, start)
                    copy_out(view[at - base : end - base], self._verified(index, read_ahead=False), at - start)
                wait(futures)
            except BaseException:  # a held unit that did not match, or Ctrl-C: the others stop
                stop.set()
                raise
            finally:
                pool.shutdown(wait=True)
                self._stops.done(stop)
            failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
            if failures:  # the failure itself, not a unit it stopped
                failure = next((e for e in failures if not isinstance(e, storage.Cancelled)), failures[0])
                raise self._closed_or(failure) if isinstance(failure, Exception) else failure
            self._position = self.entry.size
            return len(view)

    def close(self) -> None:
        """Stop every read under way (readers waiting on one get ``ValueError``), then let go of
        every unit and helper thread."""
        if self.closed:
            return
        self._stops.close()
        with self._lock:
            if self.closed:
                return
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self._held.clear()
            if self._spool is not None:
                self._spool.close()
            super().close()

    def __enter__(self) -> VerifiedFile:
        return self

    # --- units -------------------------------------------------------------------------------

    def release_before(self, position: int) -> None:
        """The caller will read nothing before ``position`` again, and its next region of the file
        starts there (perhaps after a look at the region's end, as ``torch.load`` takes): units that
        end there can go, and reads from ``position`` on are read ahead (``dcp.load`` calls this
        before each item)."""
        with self._lock:
            for index in [i for i in self._held if self._units.range(i)[1] <= position]:
                self._drop(index)
            self._region = position

    def region(self, offset: int, length: int) -> memoryview:
        """The verified bytes ``[offset, offset + length)``, read-only: a view of the unit that holds
        them all when one does (no copy), else of a new object they were copied into (then each
        unit but the last goes once copied: a region is read once). Units are never written to
        again, so the view is right for as long as it is kept (it keeps its unit's bytes alive).
        The position moves to the region's end; a region that starts where the last read ended,
        or where :meth:`release_before` put the next one, reads ahead."""
        with self._lock:
            self._check_open()
            if offset < 0 or length < 0 or offset + length > self.entry.size:
                raise ValueError(f"bytes {offset}-{offset + length} of a file of {self.entry.size}")
            index = self._units.at(offset)
            start, end = self._units.range(index)
            if self._spool is not None or not length or offset + length > end:
                out: bytes | bytearray
                if FILLABLE_BYTES and length >= 2:  # handed out only once every byte verified
                    out, view = unfilled_bytes(length)
                else:
                    out = bytearray(length)
                    view = memoryview(out)
                self._position = offset
                self._read_into(view, let_go=True)
                return memoryview(out).toreadonly()
            on = offset in (self._last_end, self._region)
            entered = offset in (self._region, start)
            data = self._verified(index, read_ahead=on and entered and self._read_ahead)
            self._position = self._last_end = offset + length
            return memoryview(data)[offset - start : offset + length - start].toreadonly()

    def _copy_from_unit(self, view: memoryview, *, read_ahead: bool) -> int:
        index = self._units.at(self._position)
        start, end = self._units.range(index)
        data = self._verified(index, read_ahead=read_ahead and self._read_ahead)
        n = min(len(view), end - self._position)
        copy_out(view[:n], data, self._position - start)
        return n

    def _verified(self, index: int, *, read_ahead: bool) -> bytes:
        """The verified bytes of unit ``index``: held, being read ahead, or read now, in this
        thread (after the next ones were sent to be read ahead, so that they are hashed while
        this one is). A unit that fails is not kept: asked for again, it is read again."""
        fetch = self._held.get(index)
        here = fetch is None
        if fetch is None:
            self._make_room(index)
            fetch = self._held[index] = _Fetch(Future(), self._stops.new())
        if read_ahead:
            for ahead in range(index + 1, min(index + 1 + READ_AHEAD, len(self._units))):
                self._ahead(ahead, index)
        if here:
            self._load(index, fetch)
        with self._close_is_value_error():
            try:
                return fetch.future.result()
            except BaseException:
                if self._held.get(index) is fetch:
                    del self._held[index]
                raise

    def _load(self, index: int, fetch: _Fetch) -> None:
        try:
            fetch.future.set_result(self._read_unit(index, fetch.stop))
        except BaseException as exc:
            fetch.future.set_exception(exc)
        finally:
            self._stops.done(fetch.stop)

    def _ahead(self, index: int, current: int) -> None:
        """Read unit ``index`` ahead, if it has a place: a free one, or that of a unit done and
        behind ``current`` (never one that may still be read next, nor the one being read)."""
        if index in self._held:
            return
        if len(self._held) >= HELD_UNITS:
            behind = sorted(i for i, f in self._held.items() if i < current and f.future.done())
            if not behind:
                return
            self._drop(behind[0])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="integrity_fs-read")
        fetch = self._held[index] = _Fetch(Future(), self._stops.new())
        self._pool.submit(self._load, index, fetch)

    def _make_room(self, index: int) -> None:
        """Room for unit ``index``, asked for now: units behind it go first (done ones before those
        still being read, lowest first), then the one furthest ahead (a read under way is stopped)."""
        while len(self._held) >= HELD_UNITS:
            behind = sorted(i for i in self._held if i < index)
            if behind:
                done = [i for i in behind if self._held[i].future.done()]
                self._drop((done or behind)[0])
            else:
                self._drop(max(self._held))

    def _drop(self, index: int) -> None:
        """Forget unit ``index`` (its bytes live on while anything still refers to them); a read
        still under way is stopped."""
        self._held.pop(index).stop.set()

    def _read_unit(self, index: int, stop: threading.Event) -> bytes:
        start, end = self._units.range(index)
        if FILLABLE_BYTES and end - start >= 2:
            data, view = unfilled_bytes(end - start)
            self._check(index, _hash_into(self.entry, start, view, stop))
            return data  # never written to again
        out = bytearray(end - start)
        self._check(index, _hash_into(self.entry, start, memoryview(out), stop))
        return bytes(out)

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
        with self._counted:
            self.bytes_verified += n

    @contextlib.contextmanager
    def _close_is_value_error(self) -> Iterator[None]:
        """A read that ``close`` stopped raises ``ValueError``, not the internal stop."""
        try:
            yield
        except Exception as exc:
            closed = self._closed_or(exc)
            if closed is exc:
                raise
            raise closed from exc

    def _closed_or(self, exc: Exception) -> Exception:
        """What a read stopped by ``close`` raises (``ValueError``, as for a closed file), else ``exc``."""
        if self._stops.closing and isinstance(exc, storage.Cancelled):
            return ValueError("I/O operation on a closed file (closed while it was read)")
        return exc

    def _check_open(self) -> None:
        if self.closed or self._stops.closing:
            raise ValueError("I/O operation on a closed file")


@contextlib.contextmanager
def _as_content(entry: Entry) -> Iterator[None]:
    """A file shorter or longer than sealed, or gone, is an ``IntegrityError`` of the file."""
    try:
        yield
    except storage.SizeChangedError as exc:
        problem = Problem(entry.name, "size", expected=entry.size, actual=exc.size)
        raise IntegrityError(Report(problems=(problem,)), entry.location) from exc
    except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError) as exc:
        problem = Problem(entry.name, "missing", expected=entry.manifest.files[entry.name])
        raise IntegrityError(Report(problems=(problem,)), entry.location) from exc


def _hash_into(entry: Entry, start: int, buffer: memoryview, stop: threading.Event) -> str:
    """The digest of ``len(buffer)`` bytes of the file from ``start``, read into ``buffer`` through
    the guarded reader."""
    with _as_content(entry):
        return storage.hash_range(
            storage.Span(entry.fs, entry.path, start, len(buffer), entry.size, entry.version),
            entry.manifest.algorithm,
            stop=stop,
            into=buffer,
        )


class _Spool:
    """A file of file granularity too large to hold: read once through the guarded reader, hashed
    and written as it is read to an unlinked temporary file of this process (in ``TMPDIR``), then
    served from there once it matched. The spool is private, so what is served is what was hashed."""

    def __init__(self, entry: Entry, stops: _Stops, count: Callable[[int], None]) -> None:
        self._entry, self._stops, self._count = entry, stops, count
        self._file: Any = None  # the spool, once its bytes verified

    def readinto(self, view: memoryview, position: int) -> int:
        if self._file is None:
            self._file = self._fill()
        want = view[: self._entry.size - position]
        return int(os.preadv(self._file.fileno(), (want,), position)) if _PREADV else self._read(want, position)

    def _read(self, want: memoryview, position: int) -> int:
        self._file.seek(position)
        return int(self._file.readinto(want))

    def _fill(self) -> Any:
        entry = self._entry
        spool = _new_spool(entry)
        stop = self._stops.new()
        try:
            with _as_content(entry), _spooling(entry):
                digest = storage.hash_range(
                    storage.Span(entry.fs, entry.path, 0, entry.size, entry.size, entry.version),
                    entry.manifest.algorithm,
                    stop=stop,
                    extra=lambda: [_SpoolWriter(spool)],
                )
            expected = entry.manifest.files[entry.name]
            if digest != expected:
                problem = Problem(entry.name, "mismatch", expected, digest)
                raise IntegrityError(Report(problems=(problem,)), entry.location)
        except BaseException:
            spool.close()
            raise
        finally:
            self._stops.done(stop)
        self._count(entry.size)
        return spool

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_PREADV = hasattr(os, "preadv")


class _SpoolWriter:
    """Writes the bytes of one read attempt to the spool from its start (a retry starts again)."""

    def __init__(self, spool: Any) -> None:
        self._spool = spool
        spool.seek(0)
        spool.truncate()

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data)
        while view:
            view = view[self._spool.write(view) :]


def _new_spool(entry: Entry) -> Any:
    """An unlinked temporary file in ``TMPDIR``. One that cannot be made is a plain ``OSError`` (its
    ``errno`` kept) that names the spool: a missing ``TMPDIR`` is not the checkpoint's file gone."""
    try:
        return tempfile.TemporaryFile(prefix="integrity_fs-spool-", buffering=0)  # kept until close
    except OSError as exc:
        error = OSError(
            f"cannot make a spool in {tempfile.gettempdir()} to verify {printable(entry.name)} ({entry.size} "
            f"bytes) before serving it: {exc.strerror or exc} (set TMPDIR to a folder that exists and has room, "
            "or seal with granularity='chunk')"
        )
        error.errno = exc.errno  # not in the constructor: OSError(ENOENT, ...) would be a FileNotFoundError
        raise error from exc


@contextlib.contextmanager
def _spooling(entry: Entry) -> Iterator[None]:
    """A spool that cannot be written (a full ``TMPDIR``) says what it is and how to avoid it."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise type(exc)(
            exc.errno,
            f"cannot spool {printable(entry.name)} ({entry.size} bytes) to {tempfile.gettempdir()} to verify it "
            f"before serving it: {exc.strerror} (set TMPDIR to a disk with room, or seal with granularity='chunk')",
        ) from exc
