"""Pure hashing rules: which algorithms exist, which granularities exist, how chunks combine.

Adding an algorithm is one entry in ``ALGORITHMS``; adding a granularity is one entry in
``GRANULARITIES`` plus its planner in ``core``. Call sites never branch on names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

__all__ = [
    "ALGORITHMS",
    "BLAKE3_INSTALL_HINT",
    "BLAKE3_THREADED_MIN",
    "DEFAULT_ALGORITHM",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_GRANULARITY",
    "GRANULARITIES",
    "MAPPED_READS",
    "READ_SIZES",
    "Blake3Hasher",
    "Hasher",
    "StreamDigest",
    "Unit",
    "check_granularity",
    "chunk_count",
    "chunk_range",
    "combine_chunk_digests",
    "file_digest",
    "hex_length",
    "new_hasher",
    "plan_units",
]


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...
    def digest(self) -> bytes: ...


#: Updates at least this long are hashed on several threads by BLAKE3; shorter ones on one,
#: where handing work to other threads costs more than it saves (measured: 64 KiB updates
#: run at 0.65x with threads, 1 MiB ones at 1.7x on 2 cores).
BLAKE3_THREADED_MIN = 1024 * 1024
BLAKE3_INSTALL_HINT = "pip install 'integrity-fs[blake3]'"


class Blake3Hasher:
    """BLAKE3 (the ``blake3`` package), multi-threaded when it is fed large buffers.

    Whether to use threads is decided by the first update, since a ``blake3`` object's
    thread setting is fixed; both settings give the same digest.
    """

    __slots__ = ("_hasher",)

    def __init__(self) -> None:
        _blake3_class()  # fail here, with the install hint, rather than on the first update
        self._hasher: Any = None

    def _state(self, first: int) -> Any:
        if self._hasher is None:
            blake3 = _blake3_class()
            self._hasher = blake3(max_threads=blake3.AUTO if first >= BLAKE3_THREADED_MIN else 1)
        return self._hasher

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._state(len(data)).update(data)

    def hexdigest(self) -> str:
        return str(self._state(0).hexdigest())

    def digest(self) -> bytes:
        return bytes(self._state(0).digest())


def _blake3_class() -> Any:
    try:
        from blake3 import blake3
    except ImportError:
        raise NotImplementedError(f"hash algorithm 'blake3' needs the blake3 package: {BLAKE3_INSTALL_HINT}") from None
    return blake3


ALGORITHMS: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    "blake3": Blake3Hasher,
}

#: Read size for hashing local files, where an algorithm gains from larger reads (BLAKE3
#: spreads one update over several threads: 4 MiB reads measured 1.13x faster than 1 MiB).
#: Others use ``storage.BLOCK_SIZE``. One buffer of this size per worker thread.
READ_SIZES: dict[str, int] = {
    "blake3": 4 * 1024 * 1024,
}

#: Algorithms fast enough that copying a local file into buffers costs much of their time (BLAKE3 on
#: every core hashes faster than one core copies): local reads of large files map the file instead.
MAPPED_READS: frozenset[str] = frozenset({"blake3"})

DEFAULT_ALGORITHM: Final = "sha256"
DEFAULT_GRANULARITY: Final = "file"
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher for ``algorithm``; ``NotImplementedError`` for an unknown name."""
    try:
        factory = ALGORITHMS[algorithm]
    except (KeyError, TypeError):
        raise NotImplementedError(
            f"unsupported hash algorithm {algorithm!r} (supported: {', '.join(sorted(ALGORITHMS))})"
        ) from None
    return factory()


def hex_length(algorithm: str) -> int:
    """How many hex characters a digest of ``algorithm`` has."""
    return len(new_hasher(algorithm).hexdigest())


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise NotImplementedError(f"unsupported granularity {granularity!r} (supported: {', '.join(GRANULARITIES)})")


def chunk_count(size: int, chunk_size: int) -> int:
    """Number of chunks of a file of ``size`` bytes; an empty file is one (empty) chunk."""
    return max(1, -(-size // chunk_size))


def chunk_range(size: int, chunk_size: int, index: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of chunk ``index`` of a file of ``size`` bytes."""
    start = index * chunk_size
    return start, min(size, start + chunk_size)


def combine_chunk_digests(algorithm: str, chunk_digests: Sequence[str]) -> str:
    """The file digest of a chunked file: the hash of its chunk digests' raw bytes, in order."""
    hasher = new_hasher(algorithm)
    for hexdigest in chunk_digests:
        hasher.update(bytes.fromhex(hexdigest))
    return hasher.hexdigest()


@dataclass(frozen=True, slots=True)
class Unit:
    """One independently hashed byte range: chunk ``index`` of file ``name``.

    ``file_size`` (not part of a unit's identity) is the size of the whole file when planned: the
    reader of the unit that ends there confirms the file ends there too.
    """

    name: str
    index: int
    offset: int
    length: int
    file_size: int | None = field(default=None, compare=False)


def _plan_file(sizes: Mapping[str, int], chunk_size: int | None) -> list[Unit]:
    return [Unit(name, 0, 0, size, size) for name, size in sizes.items()]


def _plan_chunks(sizes: Mapping[str, int], chunk_size: int | None) -> list[Unit]:
    assert chunk_size is not None and chunk_size > 0
    units = []
    for name, size in sizes.items():
        for index in range(chunk_count(size, chunk_size)):
            start, end = chunk_range(size, chunk_size, index)
            units.append(Unit(name, index, start, end - start, size))
    return units


def _digest_file(algorithm: str, digests: Sequence[str]) -> str:
    (digest,) = digests
    return digest


#: granularity -> (split files into units, turn a file's unit digests into its file digest)
_PLANNERS: dict[str, Callable[[Mapping[str, int], int | None], list[Unit]]] = {
    "file": _plan_file,
    "chunk": _plan_chunks,
}
_COMBINERS: dict[str, Callable[[str, Sequence[str]], str]] = {
    "file": _digest_file,
    "chunk": combine_chunk_digests,
}

#: "file": one digest of each file's bytes. "chunk": one digest per fixed-size chunk,
#: and a file digest derived from them (see :func:`combine_chunk_digests`).
GRANULARITIES: tuple[str, ...] = tuple(_PLANNERS)


def plan_units(granularity: str, sizes: Mapping[str, int], chunk_size: int | None = None) -> list[Unit]:
    """The units to hash for files of the given sizes, in file then chunk order."""
    check_granularity(granularity)
    return _PLANNERS[granularity](sizes, chunk_size)


def file_digest(algorithm: str, granularity: str, unit_digests: Sequence[str]) -> str:
    """A file's digest from its units' digests, in chunk order."""
    check_granularity(granularity)
    return _COMBINERS[granularity](algorithm, unit_digests)


class StreamDigest:
    """The digests of a byte stream fed in pieces: one digest, or one per ``chunk_size`` bytes."""

    def __init__(self, algorithm: str, chunk_size: int | None) -> None:
        self._algorithm = algorithm
        self._chunk_size = chunk_size
        self._hasher = new_hasher(algorithm)
        self._in_chunk = 0
        self._done: list[str] = []
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        data = memoryview(data)
        self.size += len(data)
        if self._chunk_size is None:
            self._hasher.update(data)
            return
        while data:
            take = min(len(data), self._chunk_size - self._in_chunk)
            self._hasher.update(data[:take])
            self._in_chunk += take
            data = data[take:]
            if self._in_chunk == self._chunk_size:
                self._done.append(self._hasher.hexdigest())
                self._hasher = new_hasher(self._algorithm)
                self._in_chunk = 0

    def completed(self) -> list[str]:
        """The digests of the chunks completed so far (a view: do not modify)."""
        return self._done

    def digests(self) -> tuple[str, ...]:
        """The unit digests in order; an empty stream has one (empty) unit."""
        if self._in_chunk or not self._done:
            return (*self._done, self._hasher.hexdigest())
        return tuple(self._done)
