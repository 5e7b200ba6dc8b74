"""S3's own SHA-256 checksums: writes that carry them, and reads of what S3 kept.

S3 checks a ``ChecksumSHA256`` sent with a PUT or an uploaded part against the bytes it
received and keeps it. A single PUT keeps the object's SHA-256 (a full-object checksum); a
multipart upload keeps the SHA-256 of the parts' raw SHA-256 digests, with ``-N`` for N parts
(a composite checksum). With parts of exactly ``chunk_size`` bytes that composite is the file
digest of a chunk manifest, so a store checksum can attest a file without reading it.

Reads are pinned to the ETag their listing saw (``IfMatch``): an object replaced since then is
refused by S3 (412) and raises ``FileChangedError``, never served.

Only ``storage`` imports this module; it talks to S3 through s3fs's ``_call_s3``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import fsspec
from fsspec.asyn import _run_coros_in_chunks, sync

from ..errors import FileChangedError
from ..recorded import DIGEST_SIZES, ObjectState, StoreChecksum
from ..report import printable
from .errors import precondition_failed

__all__ = [
    "ChecksummedUpload",
    "RangeStream",
    "StoreChecksum",
    "bucket_and_key",
    "copy_object",
    "delete_objects",
    "etag_md5",
    "etag_of",
    "first_part_sizes",
    "head_size",
    "is_s3",
    "listed_state",
    "object_checksums",
    "part_layout",
    "store_checksums",
]

#: Largest file of file granularity sent in one PUT, so that S3 keeps its full SHA-256.
SINGLE_PUT_LIMIT = 64 * 1024 * 1024
#: S3's multipart limits: every part but the last at least MIN_PART, at most MAX_PART bytes.
MIN_PART = 5 * 1024 * 1024
MAX_PART = 5 * 1024 * 1024 * 1024
MAX_PARTS = 10_000
#: Checksum requests in flight at once.
CHECKSUM_REQUESTS = 16
#: What s3fs makes of a request the store does not offer (NotImplemented, 501); MethodNotAllowed
#: comes as a PermissionError, as an access denied does.
_NOT_OFFERED = errno.ENOSYS

log = logging.getLogger("integrity_fs")


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    """True for s3fs filesystems (the only store whose SHA-256 checksums we use)."""
    cls = type(fs)  # the class, not the instance: fsspec's caches pass attribute lookups through
    protocols = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    return "s3" in protocols and hasattr(cls, "_call_s3")


def part_layout(granularity: str, chunk_size: int | None, size: int) -> int | None:
    """The part size that makes a file of ``size`` bytes attestable, 0 for one PUT, None if none does.

    Chunk granularity: one chunk goes in one PUT (full-object checksum = its chunk digest); more
    go in parts of exactly ``chunk_size``. File granularity: up to ``SINGLE_PUT_LIMIT`` in one PUT.
    """
    if granularity == "file":
        return 0 if size <= SINGLE_PUT_LIMIT else None
    if granularity != "chunk" or chunk_size is None:
        return None
    if size <= chunk_size:
        return 0 if size <= MAX_PART else None
    if not MIN_PART <= chunk_size <= MAX_PART or -(-size // chunk_size) > MAX_PARTS:
        return None
    return chunk_size


_VERSION_MARK = "?versionId="


def bucket_and_key(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, str]:
    """The bucket and key of ``path``, the key exactly as listed.

    s3fs's ``split_path`` cuts a key at ``?versionId=`` (version_aware or not), so a file named
    ``w?versionId=1`` would be read as ``w``: another object. S3 keys may hold that text; our
    paths never carry a version id. Before 2025 it also cut the ``/`` that ends a folder marker's
    key (``a/``): it is put back.
    """
    head, mark, tail = path.partition(_VERSION_MARK)
    fs_: Any = fs
    bucket, key, _ = fs_.split_path(head)
    if head.endswith("/") and key and not key.endswith("/"):
        key += "/"
    return bucket, key + mark + tail


async def head_size(fs: fsspec.AbstractFileSystem, path: str, etag: str | None = None) -> int:
    """The size of the object at ``path`` as S3 says now (one HEAD, no cache); with ``etag``, of
    that version only (``FileChangedError`` when the object is another one now)."""
    bucket, key = bucket_and_key(fs, path)
    fs_: Any = fs
    with _pinned(path, etag):
        out = await fs_._call_s3("head_object", Bucket=bucket, Key=key, **_if_match(etag))
    return int(out["ContentLength"])


def delete_objects(
    fs: fsspec.AbstractFileSystem, paths: Iterable[str], *, errors: list[str] | None = None
) -> list[str]:
    """Delete the objects at ``paths`` (those already gone are fine), up to 1,000 a request; the
    paths S3 did not delete (a request that failed leaves all of its paths). ``errors`` receives
    what S3 (or the request) said about each failure, for a caller that raises."""
    keys: dict[str, dict[str, str]] = {}
    for path in paths:
        bucket, key = bucket_and_key(fs, path)
        keys.setdefault(bucket, {})[key] = path
    fs_: Any = fs
    left: list[str] = []
    for bucket, named in keys.items():
        names = list(named)
        for start in range(0, len(names), 1000):
            batch = names[start : start + 1000]
            delete = {"Objects": [{"Key": key} for key in batch], "Quiet": True}
            try:
                out = sync(fs_.loop, fs_._call_s3, "delete_objects", Bucket=bucket, Delete=delete)
            except FileNotFoundError:  # no such bucket: none of its objects is there
                continue
            except Exception as exc:
                log.info("deleting %d objects from %s failed: %s", len(batch), bucket, exc)
                left += [named[key] for key in batch]
                if errors is not None:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            failed = [e for e in out.get("Errors", []) if e.get("Key") in named]
            left += [named[e["Key"]] for e in failed]
            if errors is not None:
                errors += [f"{e.get('Code', 'Error')} ({e.get('Message', '')}) on {e['Key']}" for e in failed]
    for named in keys.values():
        for path in named.values():
            fs.invalidate_cache(path)
    return left


def _if_match(etag: str | None) -> dict[str, str]:
    return {"IfMatch": etag} if etag else {}


class _pinned:
    """Turns S3's answer to a failed ``IfMatch`` (412 PreconditionFailed, which s3fs raises as an
    ``OSError`` with the ``ClientError`` as its cause) into ``FileChangedError``."""

    def __init__(self, path: str, etag: str | None) -> None:
        self._path, self._etag = path, etag

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self._etag and isinstance(exc, OSError) and precondition_failed(exc):
            raise FileChangedError(
                f"{self._path} changed while it was read (S3 holds another version than the ETag {self._etag} listed)",
                (self._path,),
            ) from exc


def _b64(hexdigest: str) -> str:
    return base64.b64encode(bytes.fromhex(hexdigest)).decode("ascii")


class ChecksummedUpload:
    """One object written with SHA-256 checksums, from digests the caller already computed.

    ``put(data, digest)`` for a single PUT; or ``part(data, digest)`` for each part in order and
    ``complete()``. ``abort()`` drops a started multipart upload.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self._fs: Any = fs
        self._bucket, self._key = bucket_and_key(fs, path)
        self._path = path
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, Key=self._key, **kwargs)

    def put(self, data: bytes | bytearray | memoryview, digest: str) -> None:
        self._call("put_object", Body=bytes(data), ChecksumAlgorithm="SHA256", ChecksumSHA256=_b64(digest))
        self._fs.invalidate_cache(self._path)

    @property
    def started(self) -> bool:
        """A multipart upload is under way."""
        return self._upload_id is not None

    def part(self, data: bytes | bytearray | memoryview, digest: str) -> None:
        number = self._next_part()
        out = self._call(
            "upload_part",
            UploadId=self._upload_id,
            PartNumber=number,
            Body=bytes(data),
            ChecksumAlgorithm="SHA256",
            ChecksumSHA256=_b64(digest),
        )
        self._parts.append({"PartNumber": number, "ETag": out["ETag"], "ChecksumSHA256": _b64(digest)})

    def copy(self, source: str, digest: str) -> None:
        """One CopyObject of ``source`` (in this store), S3 computing the copy's SHA-256: an
        ``OSError`` unless it is ``digest`` (the source is not the object it was)."""
        out = self._call("copy_object", CopySource=self._source(source), ChecksumAlgorithm="SHA256")
        self._fs.invalidate_cache(self._path)
        found = out.get("CopyObjectResult", {}).get("ChecksumSHA256")
        if found is not None and found != _b64(digest):
            raise OSError(f"copying {source} to {self._path}: S3 computed another SHA-256 than the one verified")

    def copy_part(self, source: str, start: int, end: int, digest: str) -> None:
        """Bytes ``[start, end)`` of ``source`` as the next part, whose SHA-256 is ``digest`` (S3
        refuses to complete the object if the bytes copied are not those)."""
        number = self._next_part()
        out = self._call(
            "upload_part_copy",
            UploadId=self._upload_id,
            PartNumber=number,
            CopySource=self._source(source),
            CopySourceRange=f"bytes={start}-{end - 1}",
        )
        etag = out["CopyPartResult"]["ETag"]
        self._parts.append({"PartNumber": number, "ETag": etag, "ChecksumSHA256": _b64(digest)})

    def _next_part(self) -> int:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", ChecksumAlgorithm="SHA256")["UploadId"]
        return len(self._parts) + 1

    def _source(self, source: str) -> dict[str, str]:
        bucket, key = bucket_and_key(self._fs, source)
        return {"Bucket": bucket, "Key": key}

    def complete(self) -> None:
        assert self._upload_id is not None, "complete() without parts"
        self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": self._parts})
        self._upload_id = None
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._call("abort_multipart_upload", UploadId=upload_id)


def copy_object(
    fs: fsspec.AbstractFileSystem, source: str, path: str, size: int, part_size: int, digests: Sequence[str]
) -> None:
    """Copy ``source`` to ``path`` inside S3, laid out as it was written (see :func:`part_layout`):
    one CopyObject (``part_size`` 0, ``digests`` the object's SHA-256) or parts of exactly
    ``part_size`` bytes, each with its SHA-256 from ``digests``; so a copy of an attestable
    object is attestable. A multipart copy that fails is aborted."""
    upload = ChecksummedUpload(fs, path)
    if part_size == 0:
        upload.copy(source, digests[0])
        return
    try:
        for index, start in enumerate(range(0, size, part_size)):
            upload.copy_part(source, start, min(size, start + part_size), digests[index])
        upload.complete()
    except BaseException:
        with contextlib.suppress(Exception):
            upload.abort()
        raise


_CHECKSUM_KEYS = {f"Checksum{kind.upper()}": kind for kind in DIGEST_SIZES}
_ETAG = re.compile(r'"?([0-9a-fA-F]{32})(?:-([1-9][0-9]{0,4}))?"?')


def etag_of(value: object) -> str:
    """An ETag as S3 lists or returns it, without the quotes S3 puts around it."""
    return str(value or "").strip('"')


def etag_md5(etag: str) -> StoreChecksum | None:
    """The MD5 an ETag is, when it has an MD5's shape: the object's (one PUT, without SSE-KMS or
    SSE-C), or the MD5 of its parts' MD5s with ``-N`` (a multipart upload). Other ETags, and ETags
    of that shape that are not an MD5 (SSE-KMS), give a value no read of the bytes will equal."""
    match = _ETAG.fullmatch(etag_of(etag))
    if match is None:
        return None
    parts = int(match[2]) if match[2] else None
    return StoreChecksum(match[1].lower(), parts is not None, parts, "md5")


def listed_state(info: Mapping[str, Any]) -> ObjectState:
    """What an S3 listing shows of an object: its ETag (the MD5 it may be), and the algorithms of
    the checksums it keeps, whose values the listing does not give (``ChecksumAlgorithm``)."""
    etag = etag_of(info.get("ETag") or info.get("etag"))
    md5 = etag_md5(etag)
    kept = info.get("ChecksumAlgorithm") or ()
    unlisted = tuple(str(kind).lower() for kind in kept if isinstance(kind, str) and kind.lower() in DIGEST_SIZES)
    return ObjectState(etag or None, {"md5": md5} if md5 is not None else {}, unlisted)


def _parse(attributes: Mapping[str, Any]) -> ObjectState:
    """A GetObjectAttributes answer: the object's ETag (and the MD5 it may be) and every checksum S3 keeps."""
    checksum = attributes.get("Checksum") or {}
    total = (attributes.get("ObjectParts") or {}).get("TotalPartsCount")
    kind_of = checksum.get("ChecksumType")
    found: dict[str, StoreChecksum] = {}
    etag = etag_of(attributes.get("ETag"))
    md5 = etag_md5(etag)
    if md5 is not None:
        found["md5"] = md5
    for key, algorithm in _CHECKSUM_KEYS.items():
        value = checksum.get(key)
        if not value:
            continue
        value, _, suffix = str(value).partition("-")
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) != DIGEST_SIZES[algorithm]:
            continue
        parts = int(suffix) if suffix.isdigit() else (int(total) if isinstance(total, int) else None)
        composite = kind_of == "COMPOSITE" if kind_of else bool(suffix)
        found[algorithm] = StoreChecksum(raw.hex(), composite, parts if composite else None, algorithm)
    return ObjectState(etag or None, found)


def store_checksums(fs: fsspec.AbstractFileSystem, paths: Iterable[str]) -> dict[str, StoreChecksum | None]:
    """The SHA-256 S3 keeps for each path (``None``: none there); see :func:`object_checksums`."""
    return {
        path: None if state is None else state.checksums.get("sha256")
        for path, state in object_checksums(fs, paths).items()
    }


def object_checksums(fs: fsspec.AbstractFileSystem, paths: Iterable[str]) -> dict[str, ObjectState | None]:
    """What S3 keeps for each path (its ETag and checksums), ``CHECKSUM_REQUESTS`` at a time.

    One GetObjectAttributes request per object; no byte of content is read. An object that is
    gone has no checksum (``None``), nor has one whose checksum the store will not give: a role
    allowed s3:GetObject but not s3:GetObjectAttributes, or a store without that request (its
    read decides, and raises if it too is refused). Other errors are raised.
    """
    fs_: Any = fs
    paths = list(paths)

    async def one(path: str) -> ObjectState | None:
        bucket, key = bucket_and_key(fs_, path)
        try:
            out = await fs_._call_s3(
                "get_object_attributes",
                Bucket=bucket,
                Key=key,
                ObjectAttributes=["ETag", "Checksum", "ObjectParts", "ObjectSize"],
            )
        except FileNotFoundError:  # gone since the listing: no checksum; the read reports it missing
            return None
        except OSError as exc:
            if not isinstance(exc, PermissionError) and exc.errno != _NOT_OFFERED:
                raise
            refused.append(exc)
            return None
        return _parse(out)

    refused: list[OSError] = []
    results = sync(fs_.loop, _run_coros_in_chunks, [one(p) for p in paths], batch_size=CHECKSUM_REQUESTS)
    if refused:
        log.warning(
            "the store gave no checksum for %d of %d objects (GetObjectAttributes refused: %s); they are read",
            len(refused),
            len(paths),
            printable(str(refused[0])),
        )
    return dict(zip(paths, results, strict=True))


def first_part_sizes(fs: fsspec.AbstractFileSystem, paths: Iterable[str]) -> dict[str, int | None]:
    """The size of the first part of each multipart object (a HEAD of part 1 each, no content
    read); ``None`` where S3 does not say (gone, refused, not offered)."""
    fs_: Any = fs
    paths = list(paths)

    async def one(path: str) -> int | None:
        bucket, key = bucket_and_key(fs_, path)
        try:
            out = await fs_._call_s3("head_object", Bucket=bucket, Key=key, PartNumber=1)
        except OSError:
            return None
        size = out.get("ContentLength")
        return int(size) if isinstance(size, int) and size > 0 else None

    results = sync(fs_.loop, _run_coros_in_chunks, [one(p) for p in paths], batch_size=CHECKSUM_REQUESTS)
    return dict(zip(paths, results, strict=True))


class RangeStream:
    """Bytes ``[start, end)`` of an S3 object from one ranged GET, read as they arrive.

    The async-file shape ``storage`` streams from (``read(n)``, ``close()``). ``total_size`` is
    the object's size when the request was answered (from ``Content-Range``), so the end of a
    file can be confirmed without reading past the range. An empty range is no GET: ``open()``
    asks for the size (a HEAD) and ``read`` gives nothing. With ``etag`` every request is pinned
    to that version (``FileChangedError`` once the object is another).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, start: int, end: int, etag: str | None = None) -> None:
        assert end >= start >= 0
        self._fs: Any = fs
        self._path = path
        self._etag = etag
        self._range = f"bytes={start}-{end - 1}"
        self._empty = end == start
        self.r: Any = None  # the response body, as s3fs's streamed file calls it
        self.total_size: int | None = None

    async def open(self) -> RangeStream:
        if self._empty:
            self.total_size = await head_size(self._fs, self._path, self._etag)
        return self

    async def read(self, n: int = -1) -> bytes:
        if self._empty:
            return b""
        if self.r is None:
            bucket, key = bucket_and_key(self._fs, self._path)
            with _pinned(self._path, self._etag):
                out = await self._fs._call_s3(
                    "get_object", Bucket=bucket, Key=key, Range=self._range, **_if_match(self._etag)
                )
            content_range = str(out.get("ContentRange") or "")
            total = content_range.rpartition("/")[2]
            self.total_size = int(total) if total.isdigit() else None
            self.r = out["Body"]
        data: bytes = await self.r.read(n)
        return data

    async def close(self) -> None:
        if self.r is not None:
            self.r.close()
