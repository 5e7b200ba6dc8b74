"""Attested verification on S3 (moto server) and GCS (emulator): the store's own checksums confirm
files unread, counted at the server.

- SHA-256 manifests: what integrity_fs uploads to S3 carries SHA-256 checksums S3 keeps (one PUT,
  or parts of exactly ``chunk_size``), equal to the manifest's digests.
- CRC manifests (issue 38): any object whose store checksum is a full-object CRC of the manifest's
  algorithm equal to ``files[name]`` is attested, whoever wrote it and in whatever parts: S3's
  CRC-64/NVME (boto3, single PUT or multipart full-object), GCS's CRC32C (every object has one).
- Anything else is read, and the read decides: a checksum alone never condemns a file.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from conftest import Backend

import integrity_fs
from integrity_fs import IntegrityError, Report

checksums = pytest.importorskip("awscrt.checksums")

MIB = 1024 * 1024
CHUNK = 5 * MIB  # S3's smallest part size
FILES = {"big.bin": os.urandom(2 * CHUNK + 123), "small.bin": os.urandom(1000), "empty.bin": b""}


def crc64(data: bytes) -> str:
    return int(checksums.crc64nvme(data)).to_bytes(8, "big").hex()


# --- what the servers saw --------------------------------------------------------------------------


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="werkzeug")
    caplog.set_level(logging.INFO, logger="gcp_storage_emulator.server")
    return caplog


def _object_gets(records: list[logging.LogRecord], backend: Backend) -> list[str]:
    """Requests the server logged that read file content: on S3 a GET of a key other than the
    manifest, not ``?attributes``; on the GCS emulator a media download."""
    if backend.name == "gcs":
        bucket, _, root = backend.root.partition("/")
        pattern = re.compile(rf"GET /download/storage/v1/b/{re.escape(bucket)}/o/([^?\s]+)")
        found = [unquote(m.group(1)) for r in records if (m := pattern.search(r.getMessage()))]
        return [
            f"/{bucket}/{n}"
            for n in found
            if n.startswith(f"{root}/") and not n.endswith(integrity_fs.MANIFEST_FILENAME)
        ]
    prefix = f"/{backend.root}/"
    pattern = re.compile(r"GET (\S+) HTTP")  # 206 answers are logged with colour codes around
    paths = [m.group(1) for r in records if (m := pattern.search(r.getMessage()))]
    return [
        p for p in paths if p.startswith(prefix) and "?" not in p and not p.endswith(integrity_fs.MANIFEST_FILENAME)
    ]


# --- writing objects as other tools do -----------------------------------------------------------


def _client(backend: Backend) -> Any:
    """A plain boto3 client of the moto server, as a user's own code has."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=backend.storage_options["client_kwargs"]["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def _key(backend: Backend, name: str) -> tuple[str, str]:
    bucket, _, prefix = backend.root.partition("/")
    return bucket, f"{prefix}/{name}"


def _put(backend: Backend, name: str, data: bytes, checksum: str | None = None) -> None:
    """One boto3 PUT, with the checksum boto3 computes (``None``: boto3's default, CRC32)."""
    bucket, key = _key(backend, name)
    extra = {"ChecksumAlgorithm": checksum} if checksum else {}
    _client(backend).put_object(Bucket=bucket, Key=key, Body=data, **extra)
    backend.fs.invalidate_cache()


def _multipart(backend: Backend, name: str, data: bytes, part: int, checksum: str, kind: str) -> None:
    """A boto3 multipart upload in parts of ``part`` bytes with ``checksum`` of type ``kind``
    (``"FULL_OBJECT"`` or ``"COMPOSITE"``)."""
    bucket, key = _key(backend, name)
    client = _client(backend)
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm=checksum, ChecksumType=kind)
    parts = []
    for number, start in enumerate(range(0, len(data), part), 1):
        out = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=data[start : start + part],
            ChecksumAlgorithm=checksum,
        )
        field = f"Checksum{checksum}"
        parts.append({"PartNumber": number, "ETag": out["ETag"], field: out[field]})
    done = {"MultipartUpload": {"Parts": parts}}
    if kind == "FULL_OBJECT":
        whole = {"CRC64NVME": checksums.crc64nvme, "CRC32C": checksums.crc32c, "CRC32": checksums.crc32}[checksum](data)
        width = 8 if checksum == "CRC64NVME" else 4
        done |= {
            "ChecksumType": kind,
            f"Checksum{checksum}": base64.b64encode(int(whole).to_bytes(width, "big")).decode(),
        }
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"], **done)
    backend.fs.invalidate_cache()


def _attributes(backend: Backend, name: str) -> dict[str, Any]:
    bucket, key = _key(backend, name)
    out: dict[str, Any] = _client(backend).get_object_attributes(Bucket=bucket, Key=key, ObjectAttributes=["Checksum"])
    return out.get("Checksum") or {}


def _verify(backend: Backend, **kwargs: Any) -> Report:
    return integrity_fs.verify(backend.url, storage_options=backend.storage_options, **kwargs)


def _local(tmp_path: Path, files: dict[str, bytes]) -> Path:
    src = tmp_path / "src"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    return src


# --- SHA-256: what integrity_fs uploads carries S3's SHA-256 ---------------------------------------


@pytest.mark.parametrize(("granularity", "chunk_size"), [("chunk", CHUNK), ("file", None)])
def test_what_upload_wrote_with_sha256_is_attested_without_reading_it(
    s3_backend: Backend, tmp_path: Path, server_log: pytest.LogCaptureFixture, granularity: str, chunk_size: int | None
) -> None:
    src = _local(tmp_path, FILES)
    integrity_fs.upload(
        src, s3_backend.url, storage_options=s3_backend.storage_options, granularity=granularity, chunk_size=chunk_size
    )
    server_log.clear()
    report = _verify(s3_backend, attested=True)
    assert report.ok
    assert report.files_attested == 3 and report.files_checked == 3
    assert report.bytes_checked == 0
    assert report.attested_by == dict.fromkeys(sorted(FILES), "sha256")
    assert _object_gets(server_log.records, s3_backend) == []
    if granularity == "chunk":  # the big file went in parts of exactly chunk_size: a composite of 3
        assert _attributes(s3_backend, "big.bin").get("ChecksumType") == "COMPOSITE"


def test_a_replaced_object_is_read_and_caught_with_its_byte_range(s3_backend: Backend, tmp_path: Path) -> None:
    src = _local(tmp_path, FILES)
    integrity_fs.upload(
        src, s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK
    )
    damaged = bytearray(FILES["big.bin"])
    damaged[CHUNK + 7] ^= 1
    _put(s3_backend, "big.bin", bytes(damaged))  # another tool, with its default checksum: read, the read decides
    with pytest.raises(IntegrityError) as err:
        _verify(s3_backend, attested=True)
    (problem,) = err.value.report.problems
    assert problem.path == "big.bin" and problem.kind == "mismatch"
    assert problem.byte_ranges == ((CHUNK, 2 * CHUNK),)
    assert err.value.report.files_attested == 2
    # Replaced with a SHA-256 composite of its own (the damaged bytes' parts): not equal, read, caught.
    _multipart(s3_backend, "big.bin", bytes(damaged), CHUNK, "SHA256", "COMPOSITE")
    with pytest.raises(IntegrityError, match="big.bin: mismatch"):
        _verify(s3_backend, attested=True)


def test_the_same_bytes_in_another_layout_are_read_and_pass(
    s3_backend: Backend, tmp_path: Path, server_log: pytest.LogCaptureFixture
) -> None:
    src = _local(tmp_path, FILES)
    integrity_fs.upload(
        src, s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK
    )
    _multipart(s3_backend, "big.bin", FILES["big.bin"], CHUNK + MIB, "SHA256", "COMPOSITE")  # parts of another size
    _put(s3_backend, "small.bin", FILES["small.bin"])  # a plain PUT (CRC32 only)
    server_log.clear()
    report = _verify(s3_backend, attested=True)
    assert report.ok
    assert report.attested_by == {"empty.bin": "sha256"}
    assert report.bytes_checked == len(FILES["big.bin"]) + len(FILES["small.bin"])
    assert sorted(set(_object_gets(server_log.records, s3_backend))) == [
        f"/{s3_backend.root}/{n}" for n in ("big.bin", "small.bin")
    ]


def test_chunks_s3_refuses_as_parts_are_uploaded_otherwise_read_and_pass(s3_backend: Backend, tmp_path: Path) -> None:
    """Parts of 1 MiB break S3's 5 MiB minimum: a file of several chunks goes up in another layout
    (not attestable, read); a file of one chunk is one PUT (attested)."""
    files = {"two-chunks.bin": os.urandom(2 * MIB), "one-chunk.bin": os.urandom(MIB)}
    integrity_fs.upload(
        _local(tmp_path, files),
        s3_backend.url,
        storage_options=s3_backend.storage_options,
        granularity="chunk",
        chunk_size=MIB,
    )
    report = _verify(s3_backend, attested=True)
    assert report.ok and report.attested_by == {"one-chunk.bin": "sha256"}
    assert report.bytes_checked == 2 * MIB


def test_attested_is_ignored_for_local_files(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    integrity_fs.seal(tmp_path, algorithm="crc64nvme")
    report = integrity_fs.verify(tmp_path, attested=True)
    assert report.files_attested == 0 and report.bytes_checked == 1000 and report.attested_by == {}


def test_a_full_verify_reads_each_chunk_with_one_ranged_get(
    s3_backend: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """Without ``attested``, each chunk of an object is one GET of exactly its range: no GET that
    runs on past its chunk (moto answers each ranged GET from the whole object, and S3 bills every
    request)."""
    chunk = 6 * MIB
    data = os.urandom(2 * chunk + 5)
    s3_backend.write("big.bin", data)
    integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=chunk)
    server_log.clear()
    report = _verify(s3_backend, max_workers=1)
    assert report.bytes_checked == len(data)
    assert _object_gets(server_log.records, s3_backend) == [f"/{s3_backend.root}/big.bin"] * 3


@pytest.mark.parametrize("attested", [False, True])
def test_a_key_holding_version_id_text_is_read_as_itself(s3_backend: Backend, attested: bool) -> None:
    """S3 keys may hold '?versionId='; s3fs's split_path drops it and what follows. Sealing and
    verifying ``w?versionId=1`` must read that key, never ``w``."""
    _put(s3_backend, "w", b"A" * 100)
    _put(s3_backend, "w?versionId=1", b"B" * 100, "CRC64NVME")
    _put(s3_backend, "d?versionId=2/x.bin", b"D" * 10)
    _put(s3_backend, "e?versionId=3", b"")
    manifest = integrity_fs.seal(s3_backend.url, storage_options=s3_backend.storage_options, algorithm="crc64nvme")
    assert manifest.files["w?versionId=1"] == crc64(b"B" * 100)
    assert manifest.files["d?versionId=2/x.bin"] == crc64(b"D" * 10)
    assert manifest.files["e?versionId=3"] == "0" * 16
    report = _verify(s3_backend, attested=attested)
    assert report.ok and report.attested_by == ({"w?versionId=1": "crc64nvme"} if attested else {})

    _put(s3_backend, "w?versionId=1", b"C" * 100, "CRC64NVME")
    with pytest.raises(IntegrityError) as err:
        _verify(s3_backend, attested=attested)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("w?versionId=1", "mismatch")]


def _refusing(refusal: OSError) -> Any:
    """An S3 filesystem whose role may GET objects but not their attributes (a common policy), or
    an S3 lookalike without GetObjectAttributes."""
    from s3fs import S3FileSystem

    class Refusing(S3FileSystem):  # type: ignore[misc]
        cachable = False

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "get_object_attributes":
                raise refusal
            return await super()._call_s3(method, *args, **kwargs)

    return Refusing


@pytest.mark.parametrize(
    "refusal",
    [PermissionError(13, "Access Denied"), OSError(38, "NotImplemented")],
    ids=["access-denied", "not-implemented"],
)
def test_a_store_that_refuses_checksum_requests_gets_its_files_read(
    s3_backend: Backend, tmp_path: Path, refusal: OSError
) -> None:
    """No checksums: the files are read and the read decides, as for any file without one;
    ``attested=True`` must not fail for that."""
    integrity_fs.upload(
        _local(tmp_path, FILES), s3_backend.url, storage_options=s3_backend.storage_options, algorithm="crc64nvme"
    )
    fs = _refusing(refusal)(**s3_backend.storage_options)
    report = integrity_fs.verify(s3_backend.root, fs=fs, attested=True)
    assert report.ok and report.files_attested == 0
    assert report.bytes_checked == sum(map(len, FILES.values()))
    s3_backend.corrupt("small.bin")
    with pytest.raises(IntegrityError, match="small.bin"):
        integrity_fs.verify(s3_backend.root, fs=fs, attested=True)


# --- CRC manifests: objects written by anyone ---------------------------------------------------------

#: model.bin: two parts of a multipart upload in 5 MiB parts.
PLAIN = {"model.bin": os.urandom(CHUNK + MIB + 5), "config.json": b'{"layers": 2}', "empty.bin": b""}


def _write_crc64(backend: Backend, files: dict[str, bytes]) -> None:
    """As a user's boto3 code writes with CRC-64/NVME: one PUT each, the large file in 5 MiB parts
    with a full-object CRC."""
    for name, data in files.items():
        if len(data) > CHUNK:
            _multipart(backend, name, data, CHUNK, "CRC64NVME", "FULL_OBJECT")
        else:
            _put(backend, name, data, "CRC64NVME")


def _write_plain(backend: Backend, files: dict[str, bytes]) -> None:
    """Plain fsspec writes (gcsfs: the store computes the CRC32C of every object)."""
    for name, data in files.items():
        with backend.fs.open(backend.path(name), "wb", block_size=5 * MIB) as f:
            for i in range(0, len(data), MIB):
                f.write(data[i : i + MIB])
    backend.fs.invalidate_cache()


@pytest.fixture(params=["s3", "gcs"])
def crc_store(request: pytest.FixtureRequest) -> tuple[Backend, str]:
    """A store and the CRC it keeps of objects written as its users write them: S3 and CRC-64/NVME
    (boto3), GCS and CRC32C (plain gcsfs), with ``PLAIN`` written there."""
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    if backend.name == "s3":
        _write_crc64(backend, PLAIN)
        return backend, "crc64nvme"
    _write_plain(backend, PLAIN)
    return backend, "crc32c"


@pytest.mark.parametrize(("granularity", "chunk_size"), [("file", None), ("chunk", 4 * MIB)])
def test_objects_with_the_stores_crc_are_attested_with_no_content_read(
    crc_store: tuple[Backend, str], server_log: pytest.LogCaptureFixture, granularity: str, chunk_size: int | None
) -> None:
    store, algorithm = crc_store
    if store.name == "s3":
        assert _attributes(store, "model.bin")["ChecksumType"] == "FULL_OBJECT"  # multipart indeed
    integrity_fs.seal(
        store.url,
        storage_options=store.storage_options,
        algorithm=algorithm,
        granularity=granularity,
        chunk_size=chunk_size,
    )
    server_log.clear()
    report = _verify(store, attested=True)
    assert report.ok and report.files_attested == report.files_checked == len(PLAIN)
    assert report.bytes_checked == 0
    assert report.attested_by == dict.fromkeys(sorted(PLAIN), algorithm)
    assert _object_gets(server_log.records, store) == []
    if store.name == "gcs":  # the CRC32C is in the listing: no request per object
        assert not [r for r in server_log.records if "/o/" in r.getMessage() and "model.bin" in r.getMessage()]


def test_an_object_replaced_after_the_seal_is_read_and_fails(
    crc_store: tuple[Backend, str], server_log: pytest.LogCaptureFixture
) -> None:
    store, algorithm = crc_store
    integrity_fs.seal(store.url, storage_options=store.storage_options, algorithm=algorithm)
    damaged = bytearray(PLAIN["model.bin"])
    damaged[CHUNK + 3] ^= 1
    (_write_crc64 if store.name == "s3" else _write_plain)(store, {"model.bin": bytes(damaged)})  # its own, other CRC
    server_log.clear()
    with pytest.raises(IntegrityError) as err:
        _verify(store, attested=True)
    (problem,) = err.value.report.problems
    assert problem.path == "model.bin" and problem.kind == "mismatch"
    assert err.value.report.files_attested == len(PLAIN) - 1
    assert set(_object_gets(server_log.records, store)) == {f"/{store.root}/model.bin"}


def test_objects_with_another_checksum_are_read_and_pass(
    s3_backend: Backend, server_log: pytest.LogCaptureFixture
) -> None:
    """A CRC-64/NVME manifest, objects that carry CRC32 (boto3's default), SHA-256, a composite
    CRC32C: none is comparable, each is read and passes."""
    store = s3_backend
    _put(store, "config.json", PLAIN["config.json"])
    _put(store, "empty.bin", b"", "SHA256")
    _multipart(store, "model.bin", PLAIN["model.bin"], CHUNK, "CRC32C", "COMPOSITE")
    integrity_fs.seal(store.url, storage_options=store.storage_options, algorithm="crc64nvme")
    server_log.clear()
    report = _verify(store, attested=True)
    assert report.ok and report.files_attested == 0 and report.files_checked == 3
    assert report.bytes_checked == sum(map(len, PLAIN.values()))
    assert set(_object_gets(server_log.records, store)) == {f"/{store.root}/{n}" for n in ("config.json", "model.bin")}


def test_a_crc_the_store_does_not_keep_is_read_and_passes(gcs_backend: Backend) -> None:
    """GCS keeps CRC32C, never CRC-64/NVME: a CRC-64/NVME manifest of GCS objects is read."""
    _write_plain(gcs_backend, PLAIN)
    integrity_fs.seal(gcs_backend.url, storage_options=gcs_backend.storage_options, algorithm="crc64nvme")
    report = _verify(gcs_backend, attested=True)
    assert report.ok and report.files_attested == 0 and report.bytes_checked == sum(map(len, PLAIN.values()))


def test_a_manifest_from_elsewhere_is_never_attested_by_a_crc(crc_store: tuple[Backend, str], tmp_path: Path) -> None:
    """A manifest kept outside the store is trusted beyond whoever can write the store; a CRC
    anyone can match attests nothing against it: every file is read."""
    store, algorithm = crc_store
    trusted = integrity_fs.seal(store.url, storage_options=store.storage_options, algorithm=algorithm)
    kept = tmp_path / "trusted.json"
    kept.write_bytes(trusted.to_json())
    for manifest in (kept, trusted):
        report = _verify(store, attested=True, manifest=manifest)
        assert report.ok and report.files_attested == 0 and report.bytes_checked == sum(map(len, PLAIN.values()))


# --- CRC manifests: what integrity_fs writes carries the CRC -----------------------------------------


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c"])
@pytest.mark.parametrize(("granularity", "chunk_size"), [("file", None), ("chunk", CHUNK), ("chunk", MIB)])
def test_what_upload_writes_to_s3_with_a_crc_manifest_is_attested(
    s3_backend: Backend,
    tmp_path: Path,
    server_log: pytest.LogCaptureFixture,
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
) -> None:
    """Each object carries the whole file's CRC, a multipart one as a full-object CRC (parts of
    ``chunk_size`` where S3 takes them; 1 MiB it does not, and the CRC is the same whatever the
    parts), so everything upload wrote is attested."""
    integrity_fs.upload(
        _local(tmp_path, PLAIN),
        s3_backend.url,
        storage_options=s3_backend.storage_options,
        algorithm=algorithm,
        granularity=granularity,
        chunk_size=chunk_size,
    )
    if chunk_size == CHUNK:
        stored = _attributes(s3_backend, "model.bin")
        assert stored["ChecksumType"] == "FULL_OBJECT" and f"Checksum{algorithm.upper()}" in stored
    server_log.clear()
    report = _verify(s3_backend, attested=True)
    assert report.ok and report.bytes_checked == 0
    assert report.attested_by == dict.fromkeys(sorted(PLAIN), algorithm)
    assert _object_gets(server_log.records, s3_backend) == []


@pytest.mark.parametrize("source", ["local", "s3"])
def test_what_copy_writes_to_s3_with_a_crc_manifest_is_attested(
    s3_backend: Backend, tmp_path: Path, server_log: pytest.LogCaptureFixture, source: str
) -> None:
    options = s3_backend.storage_options
    src: Any = _local(tmp_path, PLAIN)
    if source == "s3":
        integrity_fs.upload(
            src,
            f"{s3_backend.url}/src",
            storage_options=options,
            algorithm="crc64nvme",
            granularity="chunk",
            chunk_size=CHUNK,
        )
        src = f"{s3_backend.url}/src"
    else:
        integrity_fs.seal(src, algorithm="crc64nvme", granularity="chunk", chunk_size=CHUNK)
    copied = f"{s3_backend.url}/copied"
    integrity_fs.copy(src, copied, src_options=options if source == "s3" else None, dst_options=options)
    server_log.clear()
    report = integrity_fs.verify(copied, storage_options=options, attested=True)
    assert report.ok and report.bytes_checked == 0
    assert report.attested_by == dict.fromkeys(sorted(PLAIN), "crc64nvme")


@pytest.mark.parametrize(("kind", "algorithm"), [("s3", "crc64nvme"), ("gcs", "crc32c")])
def test_a_dcp_save_with_the_stores_crc_is_attested_without_reading_it(
    request: pytest.FixtureRequest, server_log: pytest.LogCaptureFixture, kind: str, algorithm: str
) -> None:
    torch = pytest.importorskip("torch")
    from integrity_fs import dcp

    store: Backend = request.getfixturevalue(f"{kind}_backend")
    state = {"big": torch.randn(300_000, generator=torch.Generator().manual_seed(1)), "step": 3}
    manifest = dcp.save(state, store.url, storage_options=store.storage_options, algorithm=algorithm)
    assert manifest.algorithm == algorithm
    server_log.clear()
    report = _verify(store, attested=True)
    assert report.files_attested == len(manifest.files) and report.bytes_checked == 0
    assert set(report.attested_by.values()) == {algorithm}
    assert _object_gets(server_log.records, store) == []


# --- the command line --------------------------------------------------------------------------------


def _cli(*args: str) -> tuple[int, str, str]:
    """``integrity-fs ARGS`` in this process, stdout and stderr captured."""
    from integrity_fs.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _flat(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Storage options as the CLI's dotted ``-o`` keys."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_cli_says_which_checksum_attested_each_file(crc_store: tuple[Backend, str]) -> None:
    store, algorithm = crc_store
    options = [f"-o{key}={json.dumps(value)}" for key, value in _flat(store.storage_options).items()]
    assert _cli("seal", store.url, "--algorithm", algorithm, *options)[0] == 0
    code, out, err = _cli("verify", store.url, "--attested", "--json", *options)
    assert code == 0, err
    report = json.loads(out)
    assert report["files_attested"] == len(PLAIN) and report["bytes_checked"] == 0
    assert report["attested_by"] == dict.fromkeys(sorted(PLAIN), algorithm)
    code, _, err = _cli("verify", store.url, "--attested", "crc", *options)  # attested takes no value any more
    assert code == 2, err
