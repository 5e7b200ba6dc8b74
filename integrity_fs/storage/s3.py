"""S3's own checksums: objects written with them, objects copied keeping them, and what S3 keeps.

S3 checks a checksum sent with a PUT or a part against the bytes it received and keeps it.
SHA-256 manifests: one PUT keeps the object's SHA-256 (full object); a multipart upload in parts
of exactly ``chunk_size`` keeps the SHA-256 of the parts' digests with ``-N`` (composite), which
is a chunk manifest's file digest. CRC manifests: one PUT, or a multipart upload of any part
size with a full-object CRC, keeps the whole object's CRC: the manifest's file digest.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from fsspec.asyn import _run_coros_in_chunks, sync

from ..hashing import new_hasher
from .errors import storage_errors

__all__ = ["CHECKSUMS", "Checksum", "Upload", "attributes", "copy_object", "layout", "split"]

log = logging.getLogger("integrity_fs")

#: S3's name for each algorithm whose checksum it keeps.
CHECKSUMS = {"sha256": "SHA256", "crc64nvme": "CRC64NVME", "crc32c": "CRC32C"}
MIN_PART, MAX_PART, MAX_PARTS = 5 * 1024 * 1024, 5 * 1024**3, 10_000
#: File-granularity SHA-256 files up to this size go in one PUT (full-object checksum).
SINGLE_PUT = 64 * 1024 * 1024
#: Part size of CRC uploads (any size gives the same full-object CRC).
CRC_PART = 64 * 1024 * 1024


def split(fs: Any, path: str) -> tuple[str, str]:
    """Bucket and key of ``path``, the key exactly as listed (s3fs's ``split_path`` cuts a key at
    ``?versionId=``: another object's)."""
    bucket, _, key = fs._strip_protocol(path).partition("/")
    return bucket, key


def _b64(hexdigest: str) -> str:
    return base64.b64encode(bytes.fromhex(hexdigest)).decode("ascii")


def _supports(fs: Any, algorithm: str) -> bool:
    """Whether this botocore knows the checksum (CRC-64/NVME and full-object CRCs came in 2025)."""
    shape = fs.s3.meta.service_model.operation_model("CreateMultipartUpload").input_shape.members
    return algorithm == "sha256" or ("ChecksumType" in shape and algorithm in CHECKSUMS)


def _fits(part: int, size: int | None) -> bool:
    """Whether S3 takes parts of ``part`` bytes for an object of ``size`` bytes."""
    return MIN_PART <= part <= MAX_PART and (size is None or -(-size // part) <= MAX_PARTS)


def layout(fs: Any, algorithm: str, chunk_size: int | None, size: int | None) -> int | None:
    """The part size that makes an object of ``size`` bytes (``None``: not known yet) attestable:
    ``0`` for one PUT only; ``None`` when no layout is. A CRC is the whole object's whatever the
    parts: they are the chunks where S3 takes those, else ``CRC_PART`` (larger for a huge object)."""
    if algorithm not in CHECKSUMS or not _supports(fs, algorithm):
        return None
    if algorithm != "sha256":
        if chunk_size is not None and _fits(chunk_size, size):
            return chunk_size
        return CRC_PART if size is None else min(MAX_PART, max(CRC_PART, -(-size // MAX_PARTS)))
    if chunk_size is None:
        return 0 if size is None or size <= SINGLE_PUT else None
    if _fits(chunk_size, size):
        return chunk_size
    return 0 if size is None or size <= chunk_size else None


class Upload:
    """One object written with S3 checksums, part by part: ``part(data, digest)`` then
    ``finish(digest)`` (one PUT when no part was sent). ``digest``: the hex checksum of the
    part, or of the whole object; ``None`` for a CRC part (computed here, from the part's bytes)."""

    def __init__(self, fs: Any, path: str, algorithm: str) -> None:
        self._fs, self._path, self._algorithm = fs, path, algorithm
        self._bucket, self._key = split(fs, path)
        self._kind = CHECKSUMS[algorithm]
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def _call(self, method: str, **kw: Any) -> Any:
        with storage_errors(f"writing {self._fs.unstrip_protocol(self._path)}"):
            return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, Key=self._key, **kw)

    def _checksum(self, data: bytes, digest: str | None) -> dict[str, str]:
        if digest is None:
            hasher = new_hasher(self._algorithm)
            hasher.update(data)
            digest = hasher.hexdigest()
        return {f"Checksum{self._kind}": _b64(digest)}

    def part(self, data: bytes, digest: str | None) -> None:
        if self._upload_id is None:
            kind = {} if self._algorithm == "sha256" else {"ChecksumType": "FULL_OBJECT"}
            out = self._call("create_multipart_upload", ChecksumAlgorithm=self._kind, **kind)
            self._upload_id = out["UploadId"]
        number = len(self._parts) + 1
        checksum = self._checksum(data, digest)
        out = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=data, **checksum)
        self._parts.append({"PartNumber": number, "ETag": out["ETag"], **checksum})

    def finish(self, data: bytes, digest: str) -> None:
        """The last bytes, and the whole object's checksum (CRC) or the last part's (SHA-256)."""
        if self._upload_id is None:
            self._call("put_object", Body=data, ChecksumAlgorithm=self._kind, **self._checksum(data, digest))
        else:
            if data or not self._parts:
                self.part(data, digest if self._algorithm == "sha256" else None)
            whole = (
                {} if self._algorithm == "sha256" else {**self._checksum(b"", digest), "ChecksumType": "FULL_OBJECT"}
            )
            parts = {"Parts": self._parts}
            self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload=parts, **whole)
            self._upload_id = None
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=upload_id)


def copy_object(
    fs: Any, source: str, etag: str, path: str, algorithm: str, parts: list[tuple[int, int, str | None]]
) -> None:
    """Copy ``source`` (pinned: ``etag``, else S3 refuses with 412) to ``path`` in the same store,
    keeping an attestable layout: ``parts`` (``start``, ``end``, SHA-256 of each, for a composite
    object) or one CopyObject that S3 gives the checksum of ``algorithm`` (when it keeps one)."""
    bucket, key = split(fs, source)
    src = {"Bucket": bucket, "Key": key}
    upload = Upload(fs, path, algorithm if algorithm in CHECKSUMS else "sha256")
    if not parts:
        kind = (
            {"ChecksumAlgorithm": CHECKSUMS[algorithm]} if algorithm in CHECKSUMS and _supports(fs, algorithm) else {}
        )
        upload._call("copy_object", CopySource=src, CopySourceIfMatch=etag, **kind)
        fs.invalidate_cache(path)
        return
    try:
        sums = all(d is not None for _, _, d in parts)
        upload._upload_id = upload._call(
            "create_multipart_upload", **({"ChecksumAlgorithm": "SHA256"} if sums else {})
        )["UploadId"]
        for number, (start, end, digest) in enumerate(parts, 1):
            out = upload._call(
                "upload_part_copy",
                UploadId=upload._upload_id,
                PartNumber=number,
                CopySource=src,
                CopySourceIfMatch=etag,
                CopySourceRange=f"bytes={start}-{end - 1}",
            )
            sha = {"ChecksumSHA256": _b64(digest)} if digest is not None and sums else {}
            upload._parts.append({"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"], **sha})
        upload._call("complete_multipart_upload", UploadId=upload._upload_id, MultipartUpload={"Parts": upload._parts})
        upload._upload_id = None
    finally:
        upload.abort()
    fs.invalidate_cache(path)


class Checksum(NamedTuple):
    """A checksum S3 keeps: ``value`` (hex), and for a multipart SHA-256 (``composite``: the hash
    of the parts' digests) the number of ``parts`` when S3 says it."""

    value: str
    composite: bool = False
    parts: int | None = None


def _decode(text: str) -> str | None:
    try:
        raw = base64.b64decode(text, validate=True) if text else b""
    except (binascii.Error, ValueError):
        return None
    return raw.hex() or None


def attributes(fs: Any, paths: Iterable[str]) -> dict[str, dict[str, Checksum]]:
    """What S3 keeps of each object, without reading it (one GetObjectAttributes each, 16 at a
    time): algorithm → :class:`Checksum`. An object gone, or whose attributes S3 will not give
    (refused, not offered), has none: its read decides."""
    paths = list(paths)

    async def one(path: str) -> dict[str, Checksum]:
        bucket, key = split(fs, path)
        try:
            out = await fs._call_s3(
                "get_object_attributes", Bucket=bucket, Key=key, ObjectAttributes=["Checksum", "ObjectParts"]
            )
        except OSError as exc:
            log.debug("no checksum for %s: %s", path, exc)
            return {}
        checksum, found = out.get("Checksum") or {}, {}
        total = (out.get("ObjectParts") or {}).get("TotalPartsCount")
        for algorithm, kind in CHECKSUMS.items():
            text, dash, suffix = str(checksum.get(f"Checksum{kind}") or "").partition("-")
            value = _decode(text)
            if value is None:
                continue
            composite = bool(dash) or checksum.get("ChecksumType") == "COMPOSITE"
            parts = int(suffix) if suffix.isdigit() else total if isinstance(total, int) else None
            found[algorithm] = Checksum(value, composite, parts if composite else None)
        return found

    with storage_errors(f"reading the checksums of {len(paths)} objects"):
        results = sync(fs.loop, _run_coros_in_chunks, [one(p) for p in paths], batch_size=16)
    return dict(zip(paths, results, strict=True))


def remove_prefix(fs: Any, path: str) -> None:
    """Delete every object under the folder ``path``, its folder markers (zero-byte ``name/``
    objects) included, in S3's own batches: s3fs before 2025 strips the "/" from the keys it
    deletes, so its ``rm(recursive=True)`` leaves the markers behind."""
    bucket, key = split(fs, path)

    async def run() -> None:
        client = await fs.set_session()
        async for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                out = await fs._call_s3("delete_objects", Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                if out.get("Errors"):
                    first = out["Errors"][0]
                    raise OSError(
                        f"S3 refused to delete {len(out['Errors'])} objects, {first.get('Key')}: {first.get('Message')}"
                    )

    sync(fs.loop, run)
