"""Pure hashing rules: the algorithms, how files split into units (chunks), how chunk digests
combine into a file digest. No I/O.

- ``sha256`` (hashlib) and ``blake3`` (the ``blake3`` package): cryptographic; a chunked file's
  digest is the hash of its chunk digests' raw bytes, in order.
- ``crc64nvme`` and ``crc32c`` (the ``awscrt`` package): accidental damage only, at the speed of
  the read; the digest is the CRC's big-endian bytes in hex, and a chunked file's digest is the
  CRC of the whole file (combined from the chunks' CRCs), the value S3 and GCS keep.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = [
    "ALGORITHMS",
    "DEFAULT_CHUNK_SIZE",
    "GRANULARITIES",
    "Hasher",
    "StreamDigest",
    "Unit",
    "check_granularity",
    "check_signable",
    "chunk_range",
    "combine",
    "digest_length",
    "is_crc",
    "new_hasher",
    "plan_units",
]

ALGORITHMS = ("sha256", "blake3", "crc64nvme", "crc32c")
GRANULARITIES = ("file", "chunk")
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
_CRC_BYTES = {"crc64nvme": 8, "crc32c": 4}
_HINTS = {"blake3": "pip install 'integrity-fs[blake3]'", "crc": "pip install 'integrity-fs[crc]'"}


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc:
    """A CRC with ``hashlib``'s shape."""

    __slots__ = ("_crc", "_function", "_width")

    def __init__(self, function: Callable[..., int], width: int) -> None:
        self._function, self._width, self._crc = function, width, 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._crc = self._function(data, self._crc)

    def hexdigest(self) -> str:
        return self._crc.to_bytes(self._width, "big").hex()


def _crc_module() -> Any:
    try:
        import awscrt.checksums
    except ImportError:
        raise NotImplementedError(f"CRC manifests need the awscrt package: {_HINTS['crc']}") from None
    return awscrt.checksums


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher; ``NotImplementedError`` for an unknown algorithm or a missing package."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise NotImplementedError(f"hash algorithm 'blake3' needs the blake3 package: {_HINTS['blake3']}") from None
        hasher: Hasher = blake3()  # type: ignore[assignment]  # one thread: units are spread over the caller's pool
        return hasher
    if algorithm in _CRC_BYTES:
        return _Crc(getattr(_crc_module(), algorithm), _CRC_BYTES[algorithm])
    raise NotImplementedError(f"unsupported hash algorithm {algorithm!r} (supported: {', '.join(ALGORITHMS)})")


def is_crc(algorithm: str) -> bool:
    return algorithm in _CRC_BYTES


def digest_length(algorithm: str) -> int:
    """Hex characters in a digest of ``algorithm`` (``NotImplementedError`` when unknown)."""
    if algorithm in _CRC_BYTES:
        return 2 * _CRC_BYTES[algorithm]
    if algorithm in ALGORITHMS:
        return 64
    raise NotImplementedError(f"unsupported hash algorithm {algorithm!r} (supported: {', '.join(ALGORITHMS)})")


def check_granularity(granularity: object) -> None:
    if granularity not in GRANULARITIES:
        raise NotImplementedError(f"unsupported granularity {granularity!r} (supported: file, chunk)")


def chunk_range(size: int, chunk_size: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of chunk ``index`` of a file of ``size`` bytes."""
    start = index * chunk_size
    return start, min(size, start + chunk_size)


def chunk_count(size: int, chunk_size: int) -> int:
    """Chunks of a file of ``size`` bytes; an empty file is one empty chunk."""
    return max(1, -(-size // chunk_size))


def combine(algorithm: str, digests: Sequence[str], size: int, chunk_size: int) -> str:
    """A chunked file's digest from its chunk digests (see the module docstring)."""
    if algorithm in _CRC_BYTES:
        combine_crc = getattr(_crc_module(), f"combine_{algorithm}")
        total = int(digests[0], 16)
        for index in range(1, len(digests)):
            start, end = chunk_range(size, chunk_size, index)
            total = combine_crc(total, int(digests[index], 16), end - start)
        return total.to_bytes(_CRC_BYTES[algorithm], "big").hex()
    hasher = new_hasher(algorithm)
    for digest in digests:
        hasher.update(bytes.fromhex(digest))
    return hasher.hexdigest()


class Unit(NamedTuple):
    """One independently hashed range: chunk ``chunk`` of file ``name``, ``length`` bytes from
    ``offset``, in a file of ``file_size`` bytes."""

    name: str
    chunk: int
    offset: int
    length: int
    file_size: int


def plan_units(sizes: Mapping[str, int], chunk_size: int | None) -> list[Unit]:
    """The units of files of these sizes: whole files (``chunk_size`` None), or chunks."""
    if chunk_size is None:
        return [Unit(name, 0, 0, size, size) for name, size in sizes.items()]
    return [
        Unit(name, i, start, end - start, size)
        for name, size in sizes.items()
        for i in range(chunk_count(size, chunk_size))
        for start, end in (chunk_range(size, chunk_size, i),)
    ]


class StreamDigest:
    """The digests of a stream fed in pieces: one, or one per ``chunk_size`` bytes."""

    def __init__(self, algorithm: str, chunk_size: int | None) -> None:
        self.algorithm, self.chunk_size = algorithm, chunk_size
        self._hasher = new_hasher(algorithm)
        self._in_chunk = 0
        self.done: list[str] = []  # digests of the chunks completed so far
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self.chunk_size is None:
            self._hasher.update(view)
            return
        while view:
            take = min(len(view), self.chunk_size - self._in_chunk)
            self._hasher.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_size:
                self.done.append(self._hasher.hexdigest())
                self._hasher, self._in_chunk = new_hasher(self.algorithm), 0

    def digests(self) -> tuple[str, ...]:
        """Every unit's digest; an empty stream has one (empty) unit."""
        if self._in_chunk or not self.done:
            return (*self.done, self._hasher.hexdigest())
        return tuple(self.done)

    def file_digest(self) -> str:
        units = self.digests()
        if self.chunk_size is None:
            return units[0]
        return combine(self.algorithm, units, self.size, self.chunk_size)


def check_signable(algorithm: str) -> None:
    """Signatures carry SHA-256 digests (model_signing's format): ``ValueError`` for any other."""
    if algorithm != "sha256":
        kind = "a CRC only detects accidental damage" if is_crc(algorithm) else "model_signing signs SHA-256"
        raise ValueError(f"cannot sign a {algorithm} manifest: {kind}; seal with algorithm='sha256' to sign")
