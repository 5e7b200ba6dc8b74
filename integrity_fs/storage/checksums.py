"""The stores' own checksums: what S3 and GCS show of an object, and computing the same
checksums from the bytes integrity_fs reads or writes (:mod:`.recording` records them).

- GCS lists an MD5 (every object but a composite one) and a CRC32C (every object): attesting
  from them takes no request beyond the listing.
- S3 lists the ETag, which is the object's MD5 for one PUT without SSE-KMS or SSE-C, and the MD5
  of its parts' MD5s (``-N``) for a multipart upload; its other checksums (CRC32, CRC32C,
  CRC64NVME, SHA-1, SHA-256, full-object or composite) take a GetObjectAttributes request, and
  a composite's part layout a HEAD of its first part.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec

from ..hashing import Hasher
from ..recorded import ObjectState, StoreChecksum
from . import gcs, s3
from .errors import storage_errors
from .urls import describe, join

__all__ = [
    "StoreHasher",
    "computable",
    "computed_values",
    "keeps_checksums",
    "listed_state",
    "listed_states",
    "object_states",
]

log = logging.getLogger("integrity_fs")


def keeps_checksums(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is a store whose own checksums integrity_fs records and attests from (S3, GCS)."""
    return s3.is_s3(fs) or gcs.is_gcs(fs)


def listed_state(fs: fsspec.AbstractFileSystem, info: Mapping[str, Any]) -> ObjectState | None:
    """What a listing entry of ``fs`` shows of an object's checksums (``None``: not S3 or GCS)."""
    if gcs.is_gcs(fs):
        return gcs.listed_state(info)
    if s3.is_s3(fs):
        return s3.listed_state(info)
    return None


def listed_states(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, ObjectState]:
    """What a fresh listing of ``root`` shows of each object's checksums, by name under ``root``."""
    prefix = root.rstrip("/") + "/"
    with storage_errors(f"listing {describe(fs, root)}"):
        fs.invalidate_cache(root)
        found = fs.find(root, detail=True, withdirs=False)
    out: dict[str, ObjectState] = {}
    for path, info in found.items():
        state = listed_state(fs, info) if path.startswith(prefix) else None
        if state is not None:
            out[path[len(prefix) :]] = state
    return out


def object_states(
    fs: fsspec.AbstractFileSystem, root: str, names: Iterable[str], listed: Mapping[str, ObjectState] | None
) -> dict[str, ObjectState | None]:
    """What the store shows now of each of ``names``: the listing's view (``listed``, or a fresh
    listing), and on S3 what GetObjectAttributes adds (one request per name; no content read)."""
    names = list(names)
    if listed is None and gcs.is_gcs(fs):
        listed = listed_states(fs, root)
    states: dict[str, ObjectState | None] = {n: (listed or {}).get(n) for n in names}
    if s3.is_s3(fs) and names:
        from . import object_checksums  # through the package, where tests count the requests

        paths = {join(root, name): name for name in names}
        for path, state in object_checksums(fs, list(paths)).items():
            name = paths[path]
            before = states.get(name)
            if state is not None and before is not None and before.version == state.version:
                state = ObjectState(state.version, {**before.checksums, **state.checksums})
            states[name] = state
    return states


# --------------------------------------------------------------------------- computing store checksums


class _Crc32:
    __slots__ = ("_crc",)

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        return self._crc.to_bytes(4, "big")

    def hexdigest(self) -> str:
        return self.digest().hex()


class _Crc32c:
    __slots__ = ("_crc", "_extend")

    def __init__(self, extend: Callable[[int, bytes], int]) -> None:
        self._crc, self._extend = 0, extend

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._crc = self._extend(self._crc, data if isinstance(data, bytes) else bytes(data))  # it takes bytes only

    def digest(self) -> bytes:
        return self._crc.to_bytes(4, "big")

    def hexdigest(self) -> str:
        return self.digest().hex()


def _crc32c_extend() -> Callable[[int, bytes], int] | None:
    try:
        import google_crc32c
    except ImportError:  # comes with gcsfs; without it, CRC32C-only objects are read
        return None
    extend: Callable[[int, bytes], int] = google_crc32c.extend
    return extend


def _new(algorithm: str) -> Hasher | None:
    if algorithm in ("md5", "sha1", "sha256"):
        hasher: Hasher = hashlib.new(algorithm, usedforsecurity=False) if algorithm != "sha256" else hashlib.sha256()
        return hasher
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "crc32c":
        extend = _crc32c_extend()
        return _Crc32c(extend) if extend is not None else None
    return None  # CRC64NVME: no library here computes it


def computable(algorithm: str) -> bool:
    """Whether integrity_fs can compute this store checksum from the bytes."""
    return _new(algorithm) is not None


class StoreHasher:
    """One store checksum of an object, computed from its bytes fed in order from the first:
    of the whole object, or composite over parts of ``part_size`` bytes each but the last, which
    takes the rest (the layouts of s3fs, boto3 and the AWS CLI). ``size`` ``None`` (a write of
    unknown length): every part is ``part_size`` bytes but the last, however many there are."""

    def __init__(self, want: StoreChecksum, size: int | None, part_size: int | None = None) -> None:
        hasher = _new(want.algorithm)
        assert hasher is not None, want.algorithm
        self.want, self._size = want, size
        self._hasher = hasher
        self._fed = 0
        self._parts: list[bytes] | None = None
        self._part_size = part_size or 0
        self._part_end = size
        if want.composite:
            assert part_size and (want.parts or size is None)
            self._parts = []
            self._part_end = size if want.parts == 1 else part_size

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        if self._parts is None:
            self._hasher.update(data)
            self._fed += len(data)
            return
        view = memoryview(data)
        while len(view):
            room = self._part_end - self._fed if self._part_end is not None else len(view)
            take = view[:room] if room > 0 else view  # past the object's end: result() says so
            self._hasher.update(take)
            self._fed += len(take)
            view = view[len(take) :]
            if self._fed == self._part_end and (self._size is None or self._fed < self._size):
                self._next_part()

    def _next_part(self) -> None:
        assert self._parts is not None
        self._parts.append(self._hasher.digest())
        hasher = _new(self.want.algorithm)
        assert hasher is not None
        self._hasher = hasher
        last = self.want.parts is not None and len(self._parts) + 1 >= self.want.parts
        self._part_end = self._size if last else self._fed + self._part_size

    def result(self) -> str | None:
        """The checksum's value (:attr:`StoreChecksum.value`), or ``None`` when the bytes fed were
        not exactly the object's."""
        if self._size is not None and self._fed != self._size:
            return None
        if self._parts is None:
            return self._hasher.hexdigest()
        parts = list(self._parts)
        if self._size is not None or self._fed % self._part_size or not parts:
            parts.append(self._hasher.digest())  # the last part (or the only one)
        if self.want.parts is not None and len(parts) != self.want.parts:
            return None
        outer = _new(self.want.algorithm)
        assert outer is not None
        outer.update(b"".join(parts))
        return f"{outer.hexdigest()}-{len(parts)}"


def computed_values(made: Iterable[StoreHasher]) -> tuple[tuple[str, str], ...]:
    """The (algorithm, value) of each hasher that saw a whole object."""
    return tuple((h.want.algorithm, value) for h in made if (value := h.result()) is not None)
