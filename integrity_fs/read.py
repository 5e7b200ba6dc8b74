"""open: a file of a sealed checkpoint that returns only verified bytes, each read once.

The file is read in its manifest's units (a chunk, or the whole file). A unit is read through the
pinned reader into a buffer of its own, hashed, and compared with the manifest; only then is it
kept, and only kept units are served. A kept unit is never written to while it is kept: whatever
happens meanwhile (read-ahead, a seek back, another thread, ``close``), bytes served are bytes
that verified; a dropped unit's buffer is filled again only after every read copied out of it
under the file's lock. At most three units are kept; when a file is read in order, the next unit
is read ahead on a helper thread, and a reader that has to wait for it reads the one after
meanwhile. ``readinto`` of a buffer that covers whole units reads them into the buffer itself and
hashes them there; it returns only once every one of them matched (on a failure it raises, and
the buffer's content is undefined, as after any failed read).

A file of file granularity over 64 MiB is verified first into a private spool (an unlinked
temporary file) and then served from there: one read of the store, pinned to one version.
Through a caching layer (``simplecache::…``) the bytes are hashed as the cache serves them, one
unit at a time.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import operator
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import hashing, storage
from .errors import IntegrityError
from .options import VerifyOptions
from .report import Problem, Report, printable
from .storage import URL
from .verify import manifest_in_use

__all__ = ["VerifiedFile", "open"]

#: The largest file-granularity file held whole; larger ones are spooled.
WHOLE_FILE_LIMIT = hashing.DEFAULT_CHUNK_SIZE
_MAPPED = 1024 * 1024  # units at least this large get an anonymous mapping
_HELD = 3  # the unit being read, the end of a region looked at first (torch.load's zip), one read ahead


def open(
    url: URL,
    name: str,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    manifest: Any = None,
    public_key: Any = None,
) -> VerifiedFile:
    """The file ``name`` of the sealed checkpoint at ``url``: a read-only binary file object that
    returns only verified bytes (see the module docstring).

    ``ManifestNotFoundError`` without a manifest, ``FileNotFoundError`` when ``name`` is not in
    it, ``IntegrityError`` when the file is missing or of another size (and later, when a unit does
    not match), ``SignatureError`` when ``public_key`` is given and the signature does not hold.
    """
    serving, root = storage.resolve(url, storage_options, fs, through_caches=True)
    store = storage.under_cache(serving)
    found, _, empty_pass = manifest_in_use(store, root, VerifyOptions(manifest=manifest, public_key=public_key))
    location = storage.describe(store, root)
    stat = storage.stat_file(store, root, name) if isinstance(name, str) else None
    if empty_pass and stat is not None and stat.size == 0 and name not in found.files:
        from .signing import with_empty_files

        found = with_empty_files(found, {name: 0})  # model_signing's shards: an empty file passes while empty
    if not isinstance(name, str) or name not in found.files:
        raise FileNotFoundError(f"{printable(str(name))} is not in the manifest of {location}")
    if stat is None:
        raise IntegrityError(Report(problems=(Problem(name, "missing", expected=found.files[name]),)), location)
    expected = stat.size if found.sizes is None else found.sizes[name]
    if stat.size != expected:
        raise IntegrityError(Report(problems=(Problem(name, "size", expected=expected, actual=stat.size),)), location)
    version = stat.version if serving is store else None  # through a cache: hashed as served
    return VerifiedFile(serving, root, name, stat.size, version, found, location)


class VerifiedFile(io.RawIOBase):
    """A read-only binary file over one file of a sealed checkpoint that returns only verified
    bytes; a context manager; safe to share between threads. ``bytes_verified`` counts the bytes hashed."""

    def __init__(self, fs: Any, root: str, name: str, size: int, version: Any, manifest: Any, location: str) -> None:
        super().__init__()
        self.name, self.size = name, size
        self._fs, self._path, self._version = fs, storage.join(root, name), version
        self._algorithm, self._location = manifest.algorithm, location
        chunk = manifest.chunk_size
        if chunk is None:
            self._unit, self._digests = max(1, size), (manifest.files[name],)
        else:
            self._unit, self._digests = chunk, manifest.chunks[name]
        self._chunked = chunk is not None
        self._lock = threading.RLock()
        self._held: dict[int, Future[Any]] = {}
        self._stops: dict[int, threading.Event] = {}
        self._free: list[Any] = []  # buffers of dropped units, to be filled again
        self._last_end = 0  # where the last read ended: a read that goes on from there reads ahead
        self._closing = threading.Event()
        self._serial = storage.under_cache(fs) is not fs
        self._pool: ThreadPoolExecutor | None = None
        self._position = 0
        self._spool: Any = None
        self._spooled = not self._chunked and size > WHOLE_FILE_LIMIT
        self.bytes_verified = 0
        if size == 0:
            self._check(0, self._hash(0, memoryview(bytearray(0)), self._closing))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._check_open()
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        offset, whence = operator.index(offset), operator.index(whence)
        with self._lock:
            self._check_open()
            base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self.size}.get(whence)
            if base is None:
                raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
            if base + offset < 0:
                raise ValueError(f"negative seek position {base + offset}")
            self._position = base + offset
            return self._position

    def readinto(self, buffer: Any) -> int:
        with self._lock:
            self._check_open()
            view = memoryview(buffer).cast("B")
            done = 0
            while done < len(view) and self._position < self.size:
                if self._spooled:
                    n = os.preadv(
                        self._spool_fd(),
                        (view[done : min(len(view), done + self.size - self._position)],),
                        self._position,
                    )
                else:
                    n = self._read_unit_into(view[done:])
                self._position += n
                done += n
            self._last_end = self._position
            return done

    def _read_unit_into(self, view: memoryview) -> int:
        index = self._position // self._unit
        start, end = hashing.chunk_range(self.size, self._unit, index)
        if self._position == start and len(view) >= end - start and index not in self._held:
            return self._read_whole_units_into(view, index)
        data = self._verified(index, sequential=self._position in (self._last_end, start))
        n = min(len(view), end - self._position)
        view[:n] = memoryview(data)[self._position - start : self._position - start + n]
        return n

    def _read_whole_units_into(self, view: memoryview, first: int) -> int:
        """The whole units from ``first`` that ``view`` covers (none held), read and hashed in
        place, two at a time (the second on the helper thread); their byte count once all matched."""
        base = hashing.chunk_range(self.size, self._unit, first)[0]
        last = first
        while (
            last + 1 < len(self._digests)
            and last + 1 not in self._held
            and hashing.chunk_range(self.size, self._unit, last + 1)[1] - base <= len(view)
        ):
            last += 1
        for index in range(first, last + 1, 2):
            pair = [i for i in (index, index + 1) if i <= last]
            ranges = [hashing.chunk_range(self.size, self._unit, i) for i in pair]
            futures = []
            if len(pair) == 2 and not self._serial:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="integrity_fs-read")
                (a, b) = ranges[1]
                futures.append(self._pool.submit(self._hash, a, view[a - base : b - base], self._closing))
            try:
                digests = [
                    self._hash(a, view[a - base : b - base], self._closing) for a, b in ranges[: 2 - len(futures)]
                ]
            finally:  # the helper's read into the caller's buffer ends before this call does
                for f in futures:
                    f.exception()
            digests += [f.result() for f in futures]
            for i, digest in zip(pair, digests, strict=True):
                self._check(i, digest)
        return hashing.chunk_range(self.size, self._unit, last)[1] - base

    def readall(self) -> bytes:
        with self._lock:
            out = bytearray(max(0, self.size - self._position))
            self.readinto(out)
            return bytes(out)

    def close(self) -> None:
        """Stop every read under way (a reader waiting on one gets ``ValueError``), then let go of every unit."""
        if self.closed:
            return
        self._closing.set()
        for stop in list(self._stops.values()):
            stop.set()
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._held.clear()
            if self._spool is not None:
                os.close(self._spool)
            super().close()

    def _check_open(self) -> None:
        if self.closed or self._closing.is_set():
            raise ValueError("I/O operation on a closed file")

    def _hash(self, start: int, into: memoryview, stop: threading.Event) -> str:
        try:
            return storage.hash_range(
                self._fs, self._path, start, len(into), self._algorithm, version=self._version, stop=stop, into=into
            )
        except storage.Cancelled:
            if self._closing.is_set():
                raise ValueError("I/O operation on a closed file (closed while it was read)") from None
            raise

    def _check(self, index: int, digest: str) -> None:
        if digest != self._digests[index]:
            start, end = hashing.chunk_range(self.size, self._unit, index)
            ranges = ((start, end),) if self._chunked else ()
            problem = Problem(self.name, "mismatch", self._digests[index], digest, ranges)
            raise IntegrityError(Report(problems=(problem,)), self._location)
        start, end = hashing.chunk_range(self.size, self._unit, index)
        self.bytes_verified += end - start

    def _buffer(self, index: int) -> Any:
        """A buffer for unit ``index``: a dropped unit's (units never leave this object: every read
        copies out of them under its lock, so no one still looks at a dropped one), else a new one
        (an anonymous mapping for a large unit: its pages are zeroed as the read first fills them)."""
        start, end = hashing.chunk_range(self.size, self._unit, index)
        for i, free in enumerate(self._free):
            if len(free) == end - start:
                return self._free.pop(i)
        return mmap.mmap(-1, end - start) if end - start >= _MAPPED else bytearray(end - start)

    def _load(self, index: int, buffer: Any, stop: threading.Event) -> Any:
        """Unit ``index`` read into ``buffer``, hashed, compared: not written to again while held."""
        start, _ = hashing.chunk_range(self.size, self._unit, index)
        self._check(index, self._hash(start, memoryview(buffer), stop))
        return buffer

    def _verified(self, index: int, *, sequential: bool) -> Any:
        """Unit ``index``'s verified bytes: held, being read ahead, or read now. A read that goes
        on from where the last one ended sends the next unit ahead (so both are hashed at once)."""
        future = self._held.get(index)
        if future is None:
            self._room(index, ahead=False)
            future = self._held[index] = Future()
            self._stops[index] = threading.Event()
            buffer = self._buffer(index)
            if sequential:
                self._ahead(index + 1, index)
            try:
                future.set_result(self._load(index, buffer, self._stops[index]))
            except BaseException as exc:
                future.set_exception(exc)
        elif sequential:
            self._ahead(index + 1, index)
        if not future.done():  # waiting for the helper: read the unit after it here meanwhile
            self._ahead(index + 1, index, here=True)
        try:
            return future.result()
        except BaseException:
            if self._held.get(index) is future:
                self._drop(index)
            if self._closing.is_set():
                raise ValueError("I/O operation on a closed file (closed while it was read)") from None
            raise

    def _room(self, current: int, *, ahead: bool) -> bool:
        """Room for one more unit while ``current`` is read: units behind it that are done go first
        (lowest first); a unit asked for then takes the place of one being read behind it, or of
        the one furthest ahead; a read-ahead never takes a unit's place ahead of ``current``."""
        while len(self._held) >= _HELD:
            behind = sorted(i for i in self._held if i < current)
            done = [i for i in behind if self._held[i].done()]
            if done or (behind and not ahead):
                self._drop((done or behind)[0])
            elif ahead:
                return False
            else:
                self._drop(max(self._held))
        return True

    def _drop(self, index: int) -> None:
        future = self._held.pop(index, None)
        stop = self._stops.pop(index, None)
        if stop is not None:
            stop.set()
        if future is not None and future.done() and future.exception() is None and len(self._free) < _HELD:
            self._free.append(future.result())

    def _ahead(self, index: int, current: int, *, here: bool = False) -> None:
        """Read unit ``index`` on a helper thread (``here``: on this one), if it is not held, there is
        room, and reads are not serial."""
        if self._serial or index >= len(self._digests) or index in self._held or not self._room(current, ahead=True):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="integrity_fs-read")
        future: Future[Any] = Future()
        stop = self._stops[index] = threading.Event()
        self._held[index] = future
        buffer = self._buffer(index)

        def run() -> None:
            try:
                future.set_result(self._load(index, buffer, stop))
            except BaseException as exc:
                if here and not isinstance(exc, Exception):  # Ctrl-C on this thread is the caller's
                    self._drop(index)
                    raise
                future.set_exception(exc)  # the unit's own failure: raised when it is read

        run() if here else self._pool.submit(run)

    def _spool_fd(self) -> int:
        """The spool, once the whole file verified into it."""
        if self._spool is None:
            try:
                with tempfile.TemporaryFile(prefix="integrity_fs-spool-") as spool:  # unlinked: private
                    fd = os.dup(spool.fileno())
            except OSError as exc:
                where, hint = tempfile.gettempdir(), "(set TMPDIR, or seal with granularity='chunk')"
                what = f"cannot make a spool in {where} to verify {printable(self.name)} before serving it"
                error = OSError(f"{what}: {exc.strerror} {hint}")
                error.errno = exc.errno  # a plain OSError: not the checkpoint's file gone (FileNotFoundError)
                raise error from exc
            try:
                hasher = hashing.new_hasher(self._algorithm)
                pieces = storage.read_blocks(
                    self._fs, self._path, 0, self.size, version=self._version, stop=self._closing
                )
                with contextlib.closing(pieces):
                    for piece in pieces:
                        hasher.update(piece)
                        while piece:  # a short write (a full disk) must never leave a hole in what is served
                            piece = piece[os.write(fd, piece) :]
                self._check(0, hasher.hexdigest())
            except storage.Cancelled:
                os.close(fd)
                raise ValueError("I/O operation on a closed file (closed while it was read)") from None
            except BaseException:
                os.close(fd)
                raise
            self._spool = fd
        return int(self._spool)
