"""Write streams that hash what passes through them, for ``dcp.save``: whole files hashed on a
helper thread from reused buffers, chunks hashed several at once, and S3 writes that carry the
digests as checksums. Nothing here reads a byte back.

Internal.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from .. import storage
from ..hashing import Hasher, StreamDigest, new_hasher

__all__ = [
    "BACKGROUND_MIN_BYTES",
    "BUFFERS",
    "HASH_THREADS",
    "LAG_BYTES",
    "PIECE_BYTES",
    "HashingStream",
    "OwnerOf",
    "SealingStream",
]

#: Writes at least this large are hashed on a helper thread, overlapping the write that follows.
BACKGROUND_MIN_BYTES = 1024 * 1024


#: The helper thread hashes copies of this size, from at most ``BUFFERS`` buffers per open file.
PIECE_BYTES = 8 * 1024 * 1024


BUFFERS = 4


#: Threads per open file that hash its chunks (granularity "chunk"), each with ``BUFFERS`` buffers:
#: up to 128 MiB per file being written, so that several 64 MiB chunks are in flight at once.
HASH_THREADS = min(4, os.cpu_count() or 1)


#: How far hashing may lag behind the writes it hashes in place (memory an owner keeps alive, not
#: copied): enough for the next chunks to be hashed while the writer goes on.
LAG_BYTES = 256 * 1024 * 1024


#: Given a write's bytes, the object that keeps that memory alive and unchanged until the save
#: ends (a tensor DCP is writing), or ``None``: then the bytes are copied before another thread
#: may hash them, since the caller may reuse its buffer once ``write`` returns.
OwnerOf = Callable[[memoryview], object | None]


class HashingStream(io.IOBase):
    """A write stream that passes bytes to ``raw`` and hashes them on their way.

    Whole files: small writes are hashed at once; from the first large one on, hashing moves to a
    :class:`_BackgroundDigest`, so it overlaps the writes that follow (bytes stay in order).
    Chunks: a :class:`_ParallelChunkDigest` hashes several chunks at once on ``HASH_THREADS``.
    """

    def __init__(self, raw: Any, algorithm: str, chunk_size: int | None, owner_of: OwnerOf | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._owner_of = owner_of
        self._digest = StreamDigest(algorithm, chunk_size)
        self._background: _BackgroundDigest | None = None
        self._parallel = None
        if chunk_size is not None and HASH_THREADS > 1:
            self._parallel = _ParallelChunkDigest(algorithm, chunk_size, HASH_THREADS)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(data)
        n = len(view) if written is None else written
        piece = view[:n]
        owner = None
        if self._owner_of is not None and n >= BACKGROUND_MIN_BYTES:
            owner = self._owner_of(piece)  # a tensor's own memory: hashed there, not copied
        if self._parallel is not None:
            self._parallel.update(piece, owner)
        elif self._background is None and n < BACKGROUND_MIN_BYTES:
            self._digest.update(piece)
        else:
            if self._background is None:
                self._background = _BackgroundDigest(self._digest)
            self._background.update(piece, owner)
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        if not getattr(self._raw, "closed", False):
            self._raw.flush()

    def finish(self) -> tuple[int, tuple[str, ...]]:
        """The stream's size and unit digests, once every byte is hashed."""
        digest: StreamDigest | _ParallelChunkDigest = self._digest
        if self._parallel is not None:
            self._parallel.close()
            digest = self._parallel
        if self._background is not None:
            self._background.close()
        position = self._raw.tell()
        if position != digest.size:
            raise OSError(f"hashed {digest.size} bytes but the stream is at {position}: it was seeked")
        return digest.size, digest.digests()

    def abandon(self) -> None:
        """Stop hashing (the write failed); errors of hashing no longer matter."""
        for hashing in (self._background, self._parallel):
            if hashing is not None:
                with contextlib.suppress(Exception):
                    hashing.close()


class SealingStream(io.IOBase):
    """A write stream into a :class:`~integrity_fs.storage.SealingWriter` (S3 with checksums).

    The writer hashes what it sends (once) and uses the digests as S3 checksums. Writes are fed
    ``PIECE_BYTES`` at a time, so that it holds at most a part plus a piece.
    """

    def __init__(self, writer: storage.SealingWriter) -> None:
        super().__init__()
        self._writer = writer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            self._writer.write(view[start : start + PIECE_BYTES])
        return len(view)

    def tell(self) -> int:
        return self._writer.size

    def finish(self) -> tuple[int, tuple[str, ...]]:
        """Complete the object; its size and unit digests."""
        digests = self._writer.close()
        return self._writer.size, digests

    def abandon(self) -> None:
        """Drop what was sent, as far as the store allows."""
        self._writer.abort()


def _take_buffer(free: queue.SimpleQueue[bytearray], allocated: int, limit: int) -> tuple[bytearray, int]:
    """A buffer of ``PIECE_BYTES`` and how many are allocated now: a free one, a new one while
    fewer than ``limit`` are, else the next one freed (waiting for it)."""
    if allocated < limit:
        try:
            return free.get_nowait(), allocated
        except queue.Empty:
            return bytearray(PIECE_BYTES), allocated + 1
    return free.get(), allocated


class _Lag:
    """Bytes handed to hashing in place and not hashed yet, at most ``limit`` (one piece more
    when nothing else is in flight): the writer waits beyond that."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._changed = threading.Condition()

    def take(self, n: int) -> None:
        with self._changed:
            while self._held and self._held + n > self._limit:
                self._changed.wait()
            self._held += n

    def give_back(self, n: int) -> None:
        with self._changed:
            self._held -= n
            self._changed.notify_all()


#: A piece of a stream for a hashing thread: the bytes (a reused buffer to give back, or memory
#: that ``owner`` keeps alive), how many of them, and who keeps them.
_Bytes = tuple[bytearray | memoryview, int, object]


class _BackgroundDigest:
    """Feeds a :class:`StreamDigest` on a helper thread, in order, from a few reused buffers.

    The writer copies each write into the current buffer (its own may change once ``write``
    returns) and goes on; a full buffer goes to the helper thread. With every buffer taken the
    writer waits, so hashing lags by at most ``BUFFERS * PIECE_BYTES``. Reused buffers spare the
    page faults of fresh allocations. A write whose memory has an owner (see :data:`OwnerOf`) is
    not copied: the helper hashes it in place, holding the owner, up to ``LAG_BYTES`` behind.
    """

    def __init__(self, digest: StreamDigest) -> None:
        self._digest = digest
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[_Bytes | None] = queue.SimpleQueue()
        self._lag = _Lag(LAG_BYTES)
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="integrity_fs-hash", daemon=True)
        self._thread.start()

    def update(self, view: memoryview, owner: object = None) -> None:
        if owner is not None and view:
            if self._current is not None:
                self._submit()  # the bytes before these, first
            self._lag.take(len(view))
            self._work.put((view, len(view), owner))
            return
        while view:
            if self._current is None:
                self._current, self._filled = self._take_buffer(), 0
            take = min(len(view), PIECE_BYTES - self._filled)
            self._current[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == PIECE_BYTES:
                self._submit()

    def close(self) -> None:
        """Wait until every byte is hashed; raise what hashing raised."""
        if self._current is not None:
            self._submit()
        self._work.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _submit(self) -> None:
        assert self._current is not None
        self._work.put((self._current, self._filled, None))
        self._current = None

    def _take_buffer(self) -> bytearray:
        buffer, self._allocated = _take_buffer(self._free, self._allocated, BUFFERS)
        return buffer

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            data, length, owner = item
            if self._error is None:
                try:
                    self._digest.update(memoryview(data)[:length])
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            if owner is None:
                assert isinstance(data, bytearray)
                self._free.put(data)
            else:
                self._lag.give_back(length)
            del data, owner  # the owner's memory may go once hashed


#: A piece of a chunk for its thread: the chunk's index and hasher, its bytes (see ``_Bytes``),
#: and whether it is the chunk's last.
_ChunkPiece = tuple[int, Hasher, bytearray | memoryview | None, int, object, bool]


class _ParallelChunkDigest:
    """The chunk digests of a stream fed in order, several chunks hashed at once while it is written.

    Chunks are independent: chunk ``i`` goes to thread ``i % threads``, which hashes its pieces in
    order as they arrive (the chunk's hasher travels with each piece). The writer copies each write
    into reused ``PIECE_BYTES`` buffers (pieces end at chunk boundaries) and waits when all
    ``BUFFERS * threads`` are taken, so memory stays bounded and hashing lags by at most that much.
    A write whose memory has an owner (see :data:`OwnerOf`) is not copied: its pieces are hashed in
    place, the owner held, up to ``LAG_BYTES`` behind. Until ``BACKGROUND_MIN_BYTES`` the writer
    hashes inline (small files start no thread).
    """

    def __init__(self, algorithm: str, chunk_size: int, threads: int) -> None:
        self._algorithm = algorithm
        self._chunk_size = chunk_size
        self._threads_wanted = threads
        self.size = 0
        self._chunk = 0  # the chunk being written
        self._in_chunk = 0  # its bytes so far
        self._hasher = new_hasher(algorithm)  # of the chunk being written
        self._digests: dict[int, str] = {}
        self._queues: list[queue.SimpleQueue[_ChunkPiece | None]] = []
        self._threads: list[threading.Thread] = []
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._lag = _Lag(LAG_BYTES)
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._closed = False

    def update(self, view: memoryview, owner: object = None) -> None:
        if not self._threads:
            if self.size + len(view) < BACKGROUND_MIN_BYTES:
                self._inline(view)
                return
            self._start()
        if owner is not None:
            self._in_place(view, owner)
            return
        while view:
            if self._current is None:
                self._current, self._filled = self._take_buffer(), 0
            take = min(len(view), len(self._current) - self._filled, self._chunk_size - self._in_chunk)
            self._current[self._filled : self._filled + take] = view[:take]
            self._filled += take
            self._in_chunk += take
            self.size += take
            view = view[take:]
            if self._in_chunk == self._chunk_size:
                self._submit(last=True)
            elif self._filled == len(self._current):
                self._submit(last=False)

    def _in_place(self, view: memoryview, owner: object) -> None:
        """``view``'s pieces (one per chunk it spans) to the chunks' threads, not copied."""
        if self._current is not None:
            self._submit(last=False)  # the bytes before these, first
        while view:
            take = min(len(view), self._chunk_size - self._in_chunk)
            self._lag.take(take)
            self._in_chunk += take
            self.size += take
            last = self._in_chunk == self._chunk_size
            self._queues[self._chunk % len(self._queues)].put(
                (self._chunk, self._hasher, view[:take], take, owner, last)
            )
            view = view[take:]
            if last:
                self._next_chunk()

    def close(self) -> None:
        """Wait until every byte is hashed; raise what hashing raised."""
        if self._closed:
            return
        self._closed = True
        if not self._threads:
            if self._in_chunk or self._chunk == 0:
                self._digests[self._chunk] = self._hasher.hexdigest()
            return
        if self._in_chunk or self._chunk == 0:
            self._submit(last=True)
        for work in self._queues:
            work.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error

    def digests(self) -> tuple[str, ...]:
        return tuple(self._digests[i] for i in range(len(self._digests)))

    def _inline(self, view: memoryview) -> None:
        while view:
            take = min(len(view), self._chunk_size - self._in_chunk)
            self._hasher.update(view[:take])
            self._in_chunk += take
            self.size += take
            view = view[take:]
            if self._in_chunk == self._chunk_size:
                self._digests[self._chunk] = self._hasher.hexdigest()
                self._next_chunk()

    def _next_chunk(self) -> None:
        self._chunk += 1
        self._in_chunk = 0
        self._hasher = new_hasher(self._algorithm)

    def _start(self) -> None:
        for index in range(self._threads_wanted):
            work: queue.SimpleQueue[_ChunkPiece | None] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(work,), name=f"integrity_fs-hash-{index}", daemon=True)
            self._queues.append(work)
            self._threads.append(thread)
            thread.start()

    def _submit(self, *, last: bool) -> None:
        """The current buffer (if any) to the chunk's thread; ``last``: the chunk ends here."""
        filled = self._filled if self._current is not None else 0
        self._queues[self._chunk % len(self._queues)].put(
            (self._chunk, self._hasher, self._current, filled, None, last)
        )
        self._current = None
        if last:
            self._next_chunk()

    def _take_buffer(self) -> bytearray:
        buffer, self._allocated = _take_buffer(self._free, self._allocated, BUFFERS * len(self._threads))
        return buffer

    def _run(self, work: queue.SimpleQueue[_ChunkPiece | None]) -> None:
        while (item := work.get()) is not None:
            chunk, hasher, data, length, owner, last = item
            if self._error is None:
                try:
                    if data is not None:
                        hasher.update(memoryview(data)[:length])
                    if last:
                        self._digests[chunk] = hasher.hexdigest()
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            if owner is not None:
                self._lag.give_back(length)
            elif data is not None:
                assert isinstance(data, bytearray)
                self._free.put(data)
            del data, owner  # the owner's memory may go once hashed
