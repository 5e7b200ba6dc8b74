"""GCS reads pinned to the generation their listing saw, and the checksums its listings show.

Each request carries ``ifGenerationMatch``: an object replaced since the listing is refused by
GCS (412) and raises ``FileChangedError``, never served. A range is read in requests of
``block_size`` bytes (gcsfs retries each itself), served to the caller in pieces.

Only ``storage`` imports this module; it talks to GCS through gcsfs's ``_call``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import fsspec

from ..errors import FileChangedError
from ..recorded import DIGEST_SIZES, ObjectState, StoreChecksum
from .errors import precondition_failed

__all__ = ["GcsRange", "is_gcs", "listed_state"]


def is_gcs(fs: fsspec.AbstractFileSystem) -> bool:
    """True for gcsfs filesystems."""
    cls = type(fs)  # the class, not the instance: fsspec's caches pass attribute lookups through
    protocols = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    return bool({"gs", "gcs"} & set(protocols)) and hasattr(cls, "_call") and hasattr(cls, "url")


def listed_state(info: Mapping[str, Any]) -> ObjectState:
    """What a GCS listing shows of an object: its generation, its MD5 (every object but a
    composite one) and its CRC32C (every object), both of the whole object."""
    found: dict[str, StoreChecksum] = {}
    for key, algorithm in (("md5Hash", "md5"), ("crc32c", "crc32c")):
        value = info.get(key)
        if not isinstance(value, str) or not value:
            continue
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) == DIGEST_SIZES[algorithm]:
            found[algorithm] = StoreChecksum(raw.hex(), False, None, algorithm)
    generation = info.get("generation")
    return ObjectState(str(generation) if generation is not None else None, found)


def _changed(path: str, generation: str) -> FileChangedError:
    return FileChangedError(
        f"{path} changed while it was read (GCS holds another generation than the {generation} listed)", (path,)
    )


class GcsRange:
    """Bytes ``[start, end)`` of a GCS object, read as they are asked for (the async-file shape
    ``storage`` streams from: ``read(n)``, ``close()``). ``total_size`` is the object's size as
    the first answer gave it (``Content-Range``), so the end of a file can be confirmed without
    reading past the range. An empty range asks for the object's metadata instead."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, path: str, start: int, end: int, generation: str | None, block_size: int
    ) -> None:
        assert end >= start >= 0
        self._fs: Any = fs
        self._path = path
        self._pos, self._end = start, end
        self._generation = generation
        self._block_size = block_size
        self._data = memoryview(b"")  # the last answer's bytes not yet read
        self.total_size: int | None = None

    def _pin(self) -> dict[str, str]:
        return {"ifGenerationMatch": self._generation} if self._generation else {}

    async def open(self) -> GcsRange:
        if self._pos == self._end:
            bucket, key, _ = self._fs.split_path(self._path)
            try:
                meta = await self._fs._call("GET", "b/{}/o/{}", bucket, key, json_out=True, **self._pin())
            except Exception as exc:
                if not precondition_failed(exc):
                    raise
                raise _changed(self._path, str(self._generation)) from exc
            self.total_size = int(meta["size"])
        return self

    async def read(self, n: int = -1) -> bytes:
        if not self._data and self._pos < self._end:
            stop = min(self._end, self._pos + self._block_size)
            try:
                headers, data = await self._fs._call(
                    "GET",
                    self._fs.url(self._path),
                    headers={"Range": f"bytes={self._pos}-{stop - 1}"},
                    **self._pin(),
                )
            except Exception as exc:
                if not precondition_failed(exc):
                    raise
                raise _changed(self._path, str(self._generation)) from exc
            total = str(headers.get("Content-Range") or "").rpartition("/")[2]
            if self.total_size is None and total.isdigit():
                self.total_size = int(total)
            self._data = memoryview(data)
            self._pos += len(self._data)
            if not self._data:
                self._end = self._pos  # the object ends here: the caller sees a short read
        take = len(self._data) if n < 0 else min(n, len(self._data))
        out, self._data = self._data[:take], self._data[take:]
        return bytes(out)

    async def close(self) -> None:
        self._data = memoryview(b"")
