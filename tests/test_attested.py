"""Attested verification on S3 (moto server): the store's own SHA-256 confirms files unread."""

import errno
import hashlib
import logging
import os
import re

import pytest
from conftest import Backend
from fsspec.asyn import sync

import integrity_fs
from integrity_fs import storage

CHUNK = 5 * 1024 * 1024  # S3's smallest part size


def _write(backend: Backend, name: str, data: bytes, *, granularity: str, chunk_size: int | None) -> None:
    """Write ``name`` the way integrity_fs's uploads do: with S3 checksums from our digests."""
    writer = storage.SealingWriter(
        backend.fs,
        backend.path(name),
        algorithm="sha256",
        granularity=granularity,
        chunk_size=chunk_size,
        size=len(data),
    )
    for i in range(0, len(data), 1 << 20):
        writer.write(data[i : i + (1 << 20)])
    writer.close()
    backend.fs.invalidate_cache()


FILES = {"big.bin": os.urandom(2 * CHUNK + 123), "small.bin": os.urandom(1000), "empty.bin": b""}


def _object_gets(records: list[logging.LogRecord], backend: Backend) -> list[str]:
    """Requests the moto server logged that read file content (GET of a key other than the
    manifest, not ``?attributes``)."""
    prefix = f"/{backend.root}/"
    pattern = re.compile(r"GET (\S+) HTTP")  # 206 answers are logged with colour codes around
    out = []
    for record in records:
        match = pattern.search(record.getMessage())
        path = match.group(1) if match else ""
        if path.startswith(prefix) and "?" not in path and not path.endswith(integrity_fs.MANIFEST_FILENAME):
            out.append(path)
    return out


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="werkzeug")
    return caplog


@pytest.mark.parametrize(("granularity", "chunk_size"), [("chunk", CHUNK), ("file", None)])
def test_attested_verify_reads_no_object_bytes(
    s3_backend: Backend, server_log: pytest.LogCaptureFixture, granularity: str, chunk_size: int | None
) -> None:
    for name, data in FILES.items():
        _write(s3_backend, name, data, granularity=granularity, chunk_size=chunk_size)
    integrity_fs.seal(
        s3_backend.url, storage_options=s3_backend.storage_options, granularity=granularity, chunk_size=chunk_size
    )
    server_log.clear()
    report = integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True)
    assert report.ok
    assert report.files_attested == 3 and report.files_checked == 3
    assert report.bytes_checked == 0
    assert _object_gets(server_log.records, s3_backend) == []


def test_replaced_object_is_read_and_caught(s3_backend: Backend, server_log: pytest.LogCaptureFixture) -> None:
    for name, data in FILES.items():
        _write(s3_backend, name, data, granularity="chunk", chunk_size=CHUNK)
    integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK)
    damaged = bytearray(FILES["big.bin"])
    damaged[CHUNK + 7] ^= 1
    # Replaced by another tool, with no SHA-256 checksum: read, and the read decides.
    s3_backend.write("big.bin", bytes(damaged))
    with pytest.raises(integrity_fs.IntegrityError) as err:
        integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True)
    (problem,) = err.value.report.problems
    assert problem.path == "big.bin" and problem.kind == "mismatch"
    assert problem.byte_ranges == ((CHUNK, 2 * CHUNK),)
    # Replaced with a checksum of its own (the damaged bytes' parts): not comparable, read, caught.
    _write(s3_backend, "big.bin", bytes(damaged), granularity="chunk", chunk_size=CHUNK)
    with pytest.raises(integrity_fs.IntegrityError):
        integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True)


def test_same_bytes_other_layout_is_read_and_passes(s3_backend: Backend, server_log: pytest.LogCaptureFixture) -> None:
    for name, data in FILES.items():
        _write(s3_backend, name, data, granularity="chunk", chunk_size=CHUNK)
    integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK)
    # The same bytes, rewritten by a plain s3fs PUT (CRC32 only): read, hashed, fine.
    s3_backend.write("big.bin", FILES["big.bin"])
    # The same bytes in parts of another size: a composite that is not ours, read, fine.
    _write(s3_backend, "small.bin", FILES["small.bin"], granularity="file", chunk_size=None)
    server_log.clear()
    report = integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True)
    assert report.ok
    assert report.files_attested == 2  # small.bin: one PUT of the whole file is its only chunk
    assert report.bytes_checked == len(FILES["big.bin"])
    assert set(_object_gets(server_log.records, s3_backend)) == {f"/{s3_backend.root}/big.bin"}


def test_attested_is_ignored_for_local_files(tmp_path: object) -> None:
    root = os.fspath(tmp_path)  # type: ignore[call-overload]
    with open(os.path.join(root, "a.bin"), "wb") as f:
        f.write(b"x" * 1000)
    integrity_fs.seal(root)
    report = integrity_fs.verify(root, attested=True)
    assert report.files_attested == 0 and report.bytes_checked == 1000


@pytest.mark.parametrize(
    ("granularity", "chunk_size", "size", "expected"),
    [
        ("file", None, 64 * 1024 * 1024, 0),
        ("file", None, 64 * 1024 * 1024 + 1, None),
        ("chunk", CHUNK, CHUNK, 0),
        ("chunk", CHUNK, CHUNK + 1, CHUNK),
        ("chunk", 1024 * 1024, 2 * 1024 * 1024, None),  # parts under 5 MiB: S3 refuses them
        ("chunk", CHUNK, 10_001 * CHUNK, None),  # more than 10,000 parts
    ],
)
def test_part_layout_follows_s3_limits(
    granularity: str, chunk_size: int | None, size: int, expected: int | None
) -> None:
    from integrity_fs.storage import s3 as _s3

    assert _s3.part_layout(granularity, chunk_size, size) == expected


def test_full_verify_reads_each_chunk_with_one_ranged_get(
    s3_backend: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """Without ``attested``, each chunk of an object is one GET of exactly its range: no GET that
    runs on past its chunk, no readahead blocks (moto answers each ranged GET from the whole
    object, and S3 bills every request)."""
    chunk = 12 * 1024 * 1024  # more than the 8 MiB readahead block of a ranged fs.open read
    data = os.urandom(2 * chunk + 5)
    s3_backend.write("big.bin", data)
    integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=chunk)
    server_log.clear()
    report = integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, max_workers=1)
    assert report.bytes_checked == len(data)
    assert _object_gets(server_log.records, s3_backend) == [f"/{s3_backend.root}/big.bin"] * 3


def _put(backend: Backend, name: str, data: bytes) -> None:
    """A PUT of exactly the key ``name`` under the root (s3fs's own paths cut a key at '?versionId=')."""
    bucket, _, prefix = backend.root.partition("/")
    sync(backend.fs.loop, backend.fs._call_s3, "put_object", Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    backend.fs.invalidate_cache()


@pytest.mark.parametrize("attested", [False, True])
def test_a_key_holding_version_id_text_is_read_as_itself(s3_backend: Backend, attested: bool) -> None:
    """S3 keys may hold '?versionId='; s3fs's split_path drops it and what follows. Sealing and
    verifying ``w?versionId=1`` read ``w`` instead: its own bytes were never checked."""
    _put(s3_backend, "w", b"A" * 100)
    _put(s3_backend, "w?versionId=1", b"B" * 100)
    _put(s3_backend, "d?versionId=2/x.bin", b"D" * 10)
    _put(s3_backend, "e?versionId=3", b"")
    manifest = integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options)
    assert manifest.files["w?versionId=1"] == hashlib.sha256(b"B" * 100).hexdigest()
    assert manifest.files["d?versionId=2/x.bin"] == hashlib.sha256(b"D" * 10).hexdigest()
    assert manifest.files["e?versionId=3"] == hashlib.sha256(b"").hexdigest()
    _write(s3_backend, "w?versionId=1", b"B" * 100, granularity="file", chunk_size=None)  # with its SHA-256
    assert s3_backend.read("w") == b"A" * 100
    report = integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=attested)
    assert report.ok and report.files_attested == (1 if attested else 0)

    _put(s3_backend, "w?versionId=1", b"C" * 100)
    with pytest.raises(integrity_fs.IntegrityError) as err:
        integrity_fs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=attested)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("w?versionId=1", "mismatch")]


@pytest.mark.parametrize(
    "refusal",
    [PermissionError(errno.EACCES, "Access Denied"), OSError(errno.ENOSYS, "NotImplemented")],
    ids=["access-denied", "not-implemented"],
)
def test_a_store_that_refuses_checksum_requests_gets_its_files_read(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch, refusal: OSError
) -> None:
    """A role allowed s3:GetObject but not s3:GetObjectAttributes (a common policy), or an S3
    lookalike without GetObjectAttributes, gives no checksums: the files are read and the read
    decides, as for any file without a checksum; ``verify --attested`` must not fail for that."""
    for name, data in FILES.items():
        _write(s3_backend, name, data, granularity="chunk", chunk_size=CHUNK)
    integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK)
    call_s3 = s3_backend.fs._call_s3

    async def refuse(method: str, *args: object, **kwargs: object) -> object:
        if method == "get_object_attributes":
            raise refusal
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(s3_backend.fs, "_call_s3", refuse)
    report = integrity_fs.verify(s3_backend.root, fs=s3_backend.fs, attested=True)
    assert report.ok and report.files_attested == 0
    assert report.bytes_checked == sum(map(len, FILES.values()))
    s3_backend.corrupt("small.bin")
    with pytest.raises(integrity_fs.IntegrityError):
        integrity_fs.verify(s3_backend.root, fs=s3_backend.fs, attested=True)
