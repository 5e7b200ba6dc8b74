"""Attested verification on S3 (moto server) and GCS (emulator): the store's own checksums confirm files unread."""

import errno
import hashlib
import json
import logging
import os
import re
from urllib.parse import unquote

import pytest
from conftest import Backend
from fsspec.asyn import sync

import integrity_fs
from integrity_fs import storage
from integrity_fs.options import Hashing

CHUNK = 5 * 1024 * 1024  # S3's smallest part size


def _write(backend: Backend, name: str, data: bytes, *, granularity: str, chunk_size: int | None) -> None:
    """Write ``name`` the way integrity_fs's uploads do: with S3 checksums from our digests."""
    writer = storage.SealingWriter(
        backend.fs,
        backend.path(name),
        Hashing("sha256", granularity, chunk_size),
        size=len(data),
    )
    for i in range(0, len(data), 1 << 20):
        writer.write(data[i : i + (1 << 20)])
    writer.close()
    backend.fs.invalidate_cache()


FILES = {"big.bin": os.urandom(2 * CHUNK + 123), "small.bin": os.urandom(1000), "empty.bin": b""}


NOT_CONTENT = (integrity_fs.MANIFEST_FILENAME, "_integrity_store_checksums.json")


def _object_gets(records: list[logging.LogRecord], backend: Backend) -> list[str]:
    """Requests the server logged that read file content: on S3 a GET of a key other than the
    manifest and the sidecar, not ``?attributes``; on the GCS emulator a media download."""
    if backend.name == "gcs":
        return _gcs_downloads(records, backend)
    prefix = f"/{backend.root}/"
    pattern = re.compile(r"GET (\S+) HTTP")  # 206 answers are logged with colour codes around
    out = []
    for record in records:
        match = pattern.search(record.getMessage())
        path = match.group(1) if match else ""
        if path.startswith(prefix) and "?" not in path and not path.endswith(NOT_CONTENT):
            out.append(path)
    return out


def _gcs_downloads(records: list[logging.LogRecord], backend: Backend) -> list[str]:
    bucket, _, root = backend.root.partition("/")
    pattern = re.compile(rf"GET /download/storage/v1/b/{re.escape(bucket)}/o/([^?\s]+)")
    out = []
    for record in records:
        match = pattern.search(record.getMessage())
        name = unquote(match.group(1)) if match else ""
        if name.startswith(f"{root}/") and not name.endswith(NOT_CONTENT):
            out.append(f"/{bucket}/{name}")
    return out


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="werkzeug")
    caplog.set_level(logging.INFO, logger="gcp_storage_emulator.server")
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
    # Attested: w?versionId=1 by the SHA-256 written with it; the others by the MD5s the seal recorded.
    assert report.ok and report.files_attested == (4 if attested else 0)

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


# --- store checksums recorded for objects integrity_fs did not write ---------------------------

SIDECAR = "_integrity_store_checksums.json"
MIB = 1024 * 1024
PLAIN = {"model.bin": os.urandom(11 * MIB + 5), "config.json": b'{"layers": 2}', "empty.bin": b""}


def _write_plain(backend: Backend, files: dict[str, bytes]) -> None:
    """Write ``files`` as other tools do: plain s3fs or gcsfs writes (on S3 a large file goes in
    parts of s3fs's 5 MiB blocks: its ETag is the MD5 of the parts' MD5s)."""
    for name, data in files.items():
        with backend.fs.open(backend.path(name), "wb", block_size=5 * MIB) as f:
            for i in range(0, len(data), MIB):
                f.write(data[i : i + MIB])
    backend.fs.invalidate_cache()


def _verify(backend: Backend, **kwargs: object) -> integrity_fs.Report:
    return integrity_fs.verify(backend.url, storage_options=backend.storage_options, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


def test_a_plain_checkpoint_sealed_once_is_attested_without_reading_it(
    store: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """A checkpoint another tool wrote: sealing reads every byte and records the store's own MD5
    (GCS's md5Hash, S3's ETag, multipart too); an attested verify then reads no object content."""
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    assert SIDECAR in store.listdir()
    server_log.clear()
    report = _verify(store, attested=True)
    assert report.ok and report.files_attested == report.files_checked == len(PLAIN)
    assert report.bytes_checked == 0
    assert report.attested_by == dict.fromkeys(sorted(PLAIN), "md5")
    assert _object_gets(server_log.records, store) == []
    # The fewest requests: the recorded MD5s attest from the listing (S3's ETags, GCS's md5Hash).
    assert not [r for r in server_log.records if "?attributes" in r.getMessage()]
    # The sidecar is never content: not extra, not a strict failure, not in the manifest.
    strict = _verify(store, strict=True)
    assert (
        strict.extra == ()
        and SIDECAR not in integrity_fs.read_manifest(store.url, storage_options=store.storage_options).files
    )


def test_an_object_replaced_after_the_seal_is_read_and_fails(
    store: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    damaged = bytearray(PLAIN["model.bin"])
    damaged[6 * MIB] ^= 1
    _write_plain(store, {"model.bin": bytes(damaged)})  # the same size, another MD5
    server_log.clear()
    with pytest.raises(integrity_fs.IntegrityError) as err:
        _verify(store, attested=True)
    (problem,) = err.value.report.problems
    assert problem.path == "model.bin" and problem.kind == "mismatch"
    assert err.value.report.files_attested == len(PLAIN) - 1
    assert set(_object_gets(server_log.records, store)) == {f"/{store.root}/model.bin"}


def test_default_manifests_are_the_same_whatever_is_recorded(backend: Backend, tmp_path: object) -> None:
    """Recording adds a sidecar on S3 and GCS; the manifest stays byte-identical on every backend."""
    _write_plain(backend, PLAIN)
    manifest = integrity_fs.seal(backend.url, storage_options=backend.storage_options)
    raw = backend.read(integrity_fs.MANIFEST_FILENAME)
    local = os.path.join(os.fspath(tmp_path), "ref")  # type: ignore[call-overload]
    os.makedirs(local)
    for name, data in PLAIN.items():
        with open(os.path.join(local, name), "wb") as f:
            f.write(data)
    assert integrity_fs.seal(local).to_json() == raw == manifest.to_json()
    assert (SIDECAR in backend.listdir()) == (backend.name in ("s3", "gcs"))


def test_a_verify_records_what_it_read_so_the_next_one_reads_nothing(
    store: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """A checkpoint sealed before anything was recorded (no sidecar): the first attested verify
    reads every file and records; the next reads none."""
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    store.remove(SIDECAR)
    first = _verify(store, attested=True)
    assert first.files_attested == 0 and first.bytes_checked == sum(map(len, PLAIN.values()))
    server_log.clear()
    second = _verify(store, attested=True)
    assert second.files_attested == len(PLAIN) and _object_gets(server_log.records, store) == []


def _compose_without_md5(backend: Backend, name: str, pieces: list[bytes]) -> None:
    """A composite GCS object, as GCS lists one: a CRC32C, no MD5 (the emulator gives composite
    objects an MD5, which GCS does not)."""
    for i, piece in enumerate(pieces):
        backend.write(f"_piece{i}", piece)
    backend.fs.merge(backend.path(name), [backend.path(f"_piece{i}") for i in range(len(pieces))])
    for i in range(len(pieces)):
        backend.remove(f"_piece{i}")
    stored = _emulator_object(backend, name)
    stored.pop("md5Hash", None)
    stored["componentCount"] = len(pieces)
    backend.fs.invalidate_cache()


def _emulator_object(backend: Backend, name: str) -> dict[str, object]:
    """The emulator's own record of an object (what it lists), from the fixture's server."""
    from conftest import GCS_STORAGES

    bucket, _, root = backend.root.partition("/")
    storage = GCS_STORAGES[backend.storage_options["endpoint_url"]]
    found: dict[str, object] = storage.objects[bucket][f"{root}/{name}"]
    return found


def _multipart_crc32(backend: Backend, name: str, parts: list[bytes]) -> None:
    """An S3 object whose only usable checksum is a CRC: a multipart upload with a full-object
    CRC32 whose parts are not of one size (so its ETag cannot be recomputed from a part size)."""
    bucket, _, prefix = backend.root.partition("/")
    key = f"{prefix}/{name}"
    call = backend.fs.call_s3
    upload = call(
        "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT"
    )
    done = []
    for number, data in enumerate(parts, 1):
        out = call(
            "upload_part",
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=data,
            ChecksumAlgorithm="CRC32",
        )
        done.append({"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32": out["ChecksumCRC32"]})
    call(
        "complete_multipart_upload",
        Bucket=bucket,
        Key=key,
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": done},
        ChecksumType="FULL_OBJECT",
    )
    backend.fs.invalidate_cache()


def test_a_crc_only_object_is_read_unless_crc_is_asked_for(
    store: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """A CRC does not attest (anyone can make other bytes with the same CRC): the object is read,
    unless ``attested="crc"`` (rot only), which attests it unread."""
    pieces = [os.urandom(5 * MIB + 7), os.urandom(5 * MIB), os.urandom(1000)]
    _write_plain(store, {"config.json": PLAIN["config.json"]})
    if store.name == "gcs":
        _compose_without_md5(store, "model.bin", pieces)
    else:
        _multipart_crc32(store, "model.bin", pieces)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    crc = "crc32c" if store.name == "gcs" else "crc32"
    server_log.clear()
    strong = _verify(store, attested=True)
    assert strong.attested_by == {"config.json": "md5"} and strong.bytes_checked == sum(map(len, pieces))
    gets = _object_gets(server_log.records, store)
    assert gets and set(gets) == {f"/{store.root}/model.bin"}
    server_log.clear()
    rot = _verify(store, attested="crc")
    assert rot.attested_by == {"config.json": "md5", "model.bin": crc} and rot.bytes_checked == 0
    assert _object_gets(server_log.records, store) == []
    # A CRC-only object replaced: its CRC changes, it is read, and the read decides.
    other = bytearray(b"".join(pieces))
    other[-1] ^= 1
    _write_plain(store, {"model.bin": bytes(other)})
    with pytest.raises(integrity_fs.IntegrityError):
        _verify(store, attested="crc")


def test_with_a_key_only_the_stores_sha256_attests(store: Backend, server_log: pytest.LogCaptureFixture) -> None:
    """The signature covers the digests, not the sidecar: whoever can replace an object could
    rewrite the sidecar to its MD5. With a key, recorded checksums attest nothing."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options, private_key=key)
    assert SIDECAR in store.listdir()  # the signature written with it ignores the sidecar
    signed = _verify(store, attested=True, public_key=key.public_key())
    assert signed.files_attested == 0 and signed.bytes_checked == sum(map(len, PLAIN.values()))
    assert _verify(store, attested=True).files_attested == len(PLAIN)


def test_a_sidecar_that_does_not_match_attests_nothing(store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    """Records bind a store checksum to the manifest's digest: a record of other content, or a
    sidecar that is not one, attests nothing; the files are read and verify decides."""
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    raw = json.loads(store.read(SIDECAR))
    raw["files"]["model.bin"]["digest"] = "0" * 64
    store.write(SIDECAR, json.dumps(raw).encode())
    report = _verify(store, attested=True)
    assert "model.bin" not in report.attested_by and report.bytes_checked == len(PLAIN["model.bin"])
    store.write(SIDECAR, b"not json")
    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        report = _verify(store, attested=True)
    assert report.ok and report.files_attested == 0
    assert any(SIDECAR in r.getMessage() for r in caplog.records)


def _forge_sidecar(store: Backend, trusted: integrity_fs.Manifest) -> None:
    """What an attacker with write access to the bucket can do: damage a file, record the store's
    checksums of the damaged bytes (a seal of its own does that), and set each record's digest
    to the trusted one, which is no secret."""
    damaged = bytearray(PLAIN["model.bin"])
    damaged[6 * MIB] ^= 1
    _write_plain(store, {"model.bin": bytes(damaged)})
    integrity_fs.seal(store.url, storage_options=store.storage_options, overwrite=True)
    raw = json.loads(store.read(SIDECAR))
    for name, record in raw["files"].items():
        record["digest"] = trusted.files[name]
    store.write(SIDECAR, json.dumps(raw).encode())


def test_a_forged_sidecar_attests_nothing_against_an_external_manifest(
    store: Backend, tmp_path: object, server_log: pytest.LogCaptureFixture
) -> None:
    """A manifest kept outside the bucket is trusted beyond whoever can write the bucket: the
    sidecar they can forge attests nothing against it. The damaged file is read and fails."""
    _write_plain(store, PLAIN)
    trusted = integrity_fs.seal(store.url, storage_options=store.storage_options)
    kept = os.path.join(os.fspath(tmp_path), "trusted.json")  # type: ignore[call-overload]
    with open(kept, "wb") as f:
        f.write(trusted.to_json())
    _forge_sidecar(store, trusted)
    server_log.clear()
    with pytest.raises(integrity_fs.IntegrityError) as err:
        _verify(store, attested=True, manifest=kept)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("model.bin", "mismatch")]
    assert err.value.report.files_attested == 0
    assert f"/{store.root}/model.bin" in _object_gets(server_log.records, store)
    with pytest.raises(integrity_fs.IntegrityError):
        _verify(store, attested=True, manifest=trusted)  # a Manifest object alike


def test_a_forged_sidecar_attests_nothing_with_a_key(store: Backend) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    _write_plain(store, PLAIN)
    trusted = integrity_fs.seal(store.url, storage_options=store.storage_options)
    integrity_fs.sign(store.url, storage_options=store.storage_options, private_key=key)
    signature = store.read(integrity_fs.SIGNATURE_FILENAME)
    _forge_sidecar(store, trusted)
    store.write(integrity_fs.MANIFEST_FILENAME, trusted.to_json())  # the forger puts the sealed manifest back
    store.write(integrity_fs.SIGNATURE_FILENAME, signature)  # and the signature a seal of its own removed
    with pytest.raises(integrity_fs.IntegrityError) as err:
        _verify(store, attested=True, public_key=key.public_key())
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("model.bin", "mismatch")]


def test_a_record_of_another_version_attests_nothing(
    gcs_backend: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """A record names the object's version (GCS's generation): an object written again, even with
    the same bytes and so the same checksums, is read again before it is attested again."""
    store = gcs_backend
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    _write_plain(store, {"model.bin": PLAIN["model.bin"]})  # a new generation, the same MD5 and CRC32C
    server_log.clear()
    report = _verify(store, attested=True)
    assert report.ok and "model.bin" not in report.attested_by
    assert set(_object_gets(server_log.records, store)) == {f"/{store.root}/model.bin"}
    server_log.clear()
    again = _verify(store, attested=True)  # recorded anew by the read
    assert again.attested_by.get("model.bin") == "md5" and _object_gets(server_log.records, store) == []


def test_a_refused_write_of_the_sidecar_never_fails_the_verify(
    store: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A role that may read but not write (an audit): the verify passes, the refusal is logged."""
    _write_plain(store, PLAIN)
    integrity_fs.seal(store.url, storage_options=store.storage_options)
    store.remove(SIDECAR)
    pipe_file = store.fs.pipe_file

    def refuse(path: str, *args: object, **kwargs: object) -> object:
        if path.endswith(SIDECAR):
            raise PermissionError(errno.EACCES, "Access Denied")
        return pipe_file(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", refuse)
    with caplog.at_level(logging.INFO, logger="integrity_fs"):
        report = integrity_fs.verify(store.root, fs=store.fs, attested=True)
    assert report.ok and report.bytes_checked == sum(map(len, PLAIN.values()))
    assert any("could not record" in r.getMessage() for r in caplog.records)
    assert SIDECAR not in store.listdir()


def _cli(*args: str) -> tuple[int, str, str]:
    """``integrity-fs ARGS`` in this process, stdout and stderr captured."""
    import contextlib
    import io

    from integrity_fs.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_the_cli_says_which_checksum_attested_each_file(store: Backend) -> None:
    """``--attested`` before or after the URL, ``--attested crc``, and ``--json``'s ``attested_by``."""
    pieces = [os.urandom(5 * MIB + 7), os.urandom(5 * MIB), os.urandom(1000)]
    _write_plain(store, {"config.json": PLAIN["config.json"]})
    if store.name == "gcs":
        _compose_without_md5(store, "model.bin", pieces)
    else:
        _multipart_crc32(store, "model.bin", pieces)
    options = [f"-o{key}={json.dumps(value)}" for key, value in _flat(store.storage_options).items()]
    assert _cli("seal", store.url, *options)[0] == 0
    crc = "crc32c" if store.name == "gcs" else "crc32"
    code, out, _ = _cli("verify", "--attested", store.url, *options)
    assert code == 0 and "1 file attested by the store unread, the rest hashed (--attested): 1 by md5" in out
    code, out, _ = _cli("verify", store.url, "--attested", "crc", "--json", *options)
    report = json.loads(out)
    assert code == 0 and report["attested"] == "crc" and report["bytes_checked"] == 0
    assert report["attested_by"] == {"config.json": "md5", "model.bin": crc}
    code, out, _ = _cli("verify", store.url, "--attested=crc", *options)
    assert code == 0 and f"none read (--attested crc): 1 by {crc}, 1 by md5" in out
    code, _, err = _cli("verify", store.url, "--attested=sha512", *options)
    assert code == 2 and "--attested crc" in err


def _flat(options: dict[str, object], prefix: str = "") -> dict[str, object]:
    """Storage options as the CLI's dotted ``-o`` keys."""
    out: dict[str, object] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_what_a_transfer_writes_is_recorded_at_the_destination(
    store: Backend, tmp_path: object, server_log: pytest.LogCaptureFixture
) -> None:
    """``upload`` and ``copy`` write every byte: the destination store's checksums of what they
    sent (GCS's MD5; S3's ETag of a plain stream) are recorded there, so an attested verify of
    the copy reads nothing. On S3, chunks of 1 MiB (parts S3 refuses) go up as a plain stream."""
    local = os.path.join(os.fspath(tmp_path), "src")  # type: ignore[call-overload]
    os.makedirs(local)
    for name, data in PLAIN.items():
        with open(os.path.join(local, name), "wb") as f:
            f.write(data)
    options = store.storage_options
    up = f"{store.url}/up"
    integrity_fs.upload(local, up, storage_options=options, granularity="chunk", chunk_size=MIB)
    server_log.clear()
    report = integrity_fs.verify(up, storage_options=options, attested=True)
    assert report.files_attested == len(PLAIN) and report.bytes_checked == 0
    assert report.attested_by["model.bin"] == "md5"  # on S3 the one-chunk files carry our SHA-256
    copied = f"{store.url}/copied"
    integrity_fs.copy(up, copied, src_options=options, dst_options=options)
    server_log.clear()
    report = integrity_fs.verify(copied, storage_options=options, attested=True)
    assert report.files_attested == len(PLAIN) and report.bytes_checked == 0
    assert _object_gets(server_log.records, store) == []


def test_a_dcp_save_to_gcs_is_attested_without_reading_it(
    gcs_backend: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """``dcp.save`` writes every byte: GCS's MD5 of each file, computed as it is written, is
    recorded once the store lists it, so the default (chunk) save attests unread."""
    pytest.importorskip("torch")
    import torch

    from integrity_fs import dcp

    state = {"big": torch.randn(3_000_000, generator=torch.Generator().manual_seed(1)), "step": 3}  # 12 MB
    manifest = dcp.save(state, gcs_backend.url, storage_options=gcs_backend.storage_options)
    assert manifest.granularity == "chunk" and SIDECAR in gcs_backend.listdir()
    server_log.clear()
    report = _verify(gcs_backend, attested=True)
    assert report.files_attested == len(manifest.files) and report.bytes_checked == 0
    assert set(report.attested_by.values()) == {"md5"}
    assert _object_gets(server_log.records, gcs_backend) == []
