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
from typing import Any

from .. import storage
from ..hashing import Hasher, StreamDigest, new_hasher

__all__ = ["BACKGROUND_MIN_BYTES", "BUFFERS", "HASH_THREADS", "PIECE_BYTES", "HashingStream", "SealingStream"]

#: Writes at least this large are hashed on a helper thread, overlapping the write that follows.
BACKGROUND_MIN_BYTES = 1024 * 1024


#: The helper thread hashes copies of this size, from at most ``BUFFERS`` buffers per open file.
PIECE_BYTES = 8 * 1024 * 1024


BUFFERS = 4


#: Threads per open file that hash its chunks (granularity "chunk"), each with ``BUFFERS`` buffers:
#: up to 128 MiB per file being written, so that several 64 MiB chunks are in flight at once.
HASH_THREADS = min(4, os.cpu_count() or 1)


class HashingStream(io.IOBase):
    """A write stream that passes bytes to ``raw`` and hashes them on their way.

    Whole files: small writes are hashed at once; from the first large one on, hashing moves to a
    :class:`_BackgroundDigest`, so it overlaps the writes that follow (bytes stay in order).
    Chunks: a :class:`_ParallelChunkDigest` hashes several chunks at once on ``HASH_THREADS``.
    """

    def __init__(self, raw: Any, algorithm: str, chunk_size: int | None) -> None:
        super().__init__()
        self._raw = raw
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
        if self._parallel is not None:
            self._parallel.update(view[:n])
        elif self._background is None and n < BACKGROUND_MIN_BYTES:
            self._digest.update(view[:n])
        else:
            if self._background is None:
                self._background = _BackgroundDigest(self._digest)
            self._background.update(view[:n])
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


class _BackgroundDigest:
    """Feeds a :class:`StreamDigest` on a helper thread, in order, from a few reused buffers.

    The writer copies each write into the current buffer (its own may change once ``write``
    returns) and goes on; a full buffer goes to the helper thread. With every buffer taken the
    writer waits, so hashing lags by at most ``BUFFERS * PIECE_BYTES``. Reused buffers spare the
    page faults of fresh allocations.
    """

    def __init__(self, digest: StreamDigest) -> None:
        self._digest = digest
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="integrity_fs-hash", daemon=True)
        self._thread.start()

    def update(self, view: memoryview) -> None:
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
        self._work.put((self._current, self._filled))
        self._current = None

    def _take_buffer(self) -> bytearray:
        if self._allocated < BUFFERS:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._allocated += 1
                return bytearray(PIECE_BYTES)
        return self._free.get()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            buffer, length = item
            if self._error is None:
                try:
                    self._digest.update(memoryview(buffer)[:length])
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            self._free.put(buffer)


class _ParallelChunkDigest:
    """The chunk digests of a stream fed in order, several chunks hashed at once while it is written.

    Chunks are independent: chunk ``i`` goes to thread ``i % threads``, which hashes its pieces in
    order as they arrive (the chunk's hasher travels with each piece). The writer copies each write
    into reused ``PIECE_BYTES`` buffers (pieces end at chunk boundaries) and waits when all
    ``BUFFERS * threads`` are taken, so memory stays bounded and hashing lags by at most that much.
    Until ``BACKGROUND_MIN_BYTES`` the writer hashes inline (small files start no thread).
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
        self._queues: list[queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None]] = []
        self._threads: list[threading.Thread] = []
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._closed = False

    def update(self, view: memoryview) -> None:
        if not self._threads:
            if self.size + len(view) < BACKGROUND_MIN_BYTES:
                self._inline(view)
                return
            self._start()
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
            work: queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(work,), name=f"integrity_fs-hash-{index}", daemon=True)
            self._queues.append(work)
            self._threads.append(thread)
            thread.start()

    def _submit(self, *, last: bool) -> None:
        self._queues[self._chunk % len(self._queues)].put(
            (self._chunk, self._hasher, self._current, self._filled if self._current is not None else 0, last)
        )
        self._current = None
        if last:
            self._next_chunk()

    def _take_buffer(self) -> bytearray:
        if self._allocated < BUFFERS * len(self._threads):
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._allocated += 1
                return bytearray(PIECE_BYTES)
        return self._free.get()

    def _run(self, work: queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None]) -> None:
        while (item := work.get()) is not None:
            chunk, hasher, buffer, length, last = item
            if self._error is None:
                try:
                    if buffer is not None:
                        hasher.update(memoryview(buffer)[:length])
                    if last:
                        self._digests[chunk] = hasher.hexdigest()
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            if buffer is not None:
                self._free.put(buffer)
