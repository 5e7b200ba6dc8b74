"""integrity_fs.dcp: DCP checkpoints sealed while written, verified before loaded, on local disk and S3.

In-process tests run without a process group (DCP's single-process mode); tests/dist_dcp_worker.py
runs the same flows on gloo process groups of 1 and 2 ranks, on a local directory and on S3 (moto).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import threading
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import fsspec
import pytest

pytest.importorskip("torch")

import torch
import torch.distributed.checkpoint as torch_dcp
from conftest import BUCKET, Backend
from dist_launch import run_ranks
from fsspec.implementations.memory import MemoryFileSystem
from read_counting import CountingS3Server, reads_under
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError, dcp, hashing, storage
from integrity_fs.dcp import streams as dcp_streams
from integrity_fs.dcp import writer as dcp_writer
from integrity_fs.options import Hashing


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {"big": torch.randn(600_000, generator=gen), "small": torch.arange(10)},
        "step": 42,
    }


def _empty() -> dict[str, Any]:
    return {"model": {"big": torch.zeros(600_000), "small": torch.zeros(10, dtype=torch.long)}, "step": 0}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["model"]["big"], b["model"]["big"])
        and torch.equal(a["model"]["small"], b["model"]["small"])
        and a["step"] == b["step"]
    )


def _flip(fs: fsspec.AbstractFileSystem, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 1
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()


@pytest.fixture(scope="module")
def counting_s3(s3_endpoint: str) -> Iterator[tuple[CountingS3Server, dict[str, Any]]]:
    """A second front to the session's moto S3 (moto's state is per process) that counts object GETs."""
    server = CountingS3Server()
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": server.endpoint}}
    yield server, options
    server.stop()


def test_round_trip_local(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    manifest = dcp.save(_state(), url)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp"]
    assert (tmp_path / "ckpt" / MANIFEST_FILENAME).read_bytes() == manifest.to_json()
    target = _empty()
    report = dcp.load(target, url)
    assert report == ifs.verify(url) and report is not None and report.files_checked == 2
    assert _same(target, _state())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"granularity": "file"},
        {"granularity": "chunk", "chunk_size": 100_000},
        {"thread_count": 2},
        {"single_file_per_rank": False},
    ],
    ids=["default", "file", "chunk", "two-threads", "file-per-tensor"],
)
def test_manifest_equals_a_seal_after_saving(tmp_path: Path, options: dict[str, Any]) -> None:
    """Hashing while writing gives the bytes a seal that reads everything back gives; a default
    save is sealed in chunks of the default chunk size (so that it loads in one pass)."""
    manifest = dcp.save(_state(), tmp_path / "ckpt", **options)
    seal_options = {k: v for k, v in options.items() if k in ("granularity", "chunk_size")}
    seal_options.setdefault("granularity", "chunk")
    assert ifs.seal(tmp_path / "ckpt", overwrite=True, **seal_options).to_json() == manifest.to_json()
    assert manifest.granularity == seal_options["granularity"]


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")  # DCP's note that it overwrites
def test_save_over_a_saved_checkpoint_replaces_its_manifest(tmp_path: Path) -> None:
    """seal refuses a sealed root; dcp.save seals the files it has just written, so it replaces the manifest."""
    dcp.save(_state(), tmp_path / "ckpt")
    newer = _state()
    newer["step"] = 43
    manifest = dcp.save(newer, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / MANIFEST_FILENAME).read_bytes() == manifest.to_json()
    target = _empty()
    dcp.load(target, tmp_path / "ckpt")
    assert target["step"] == 43


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")  # the planted .metadata
def test_save_never_writes_through_a_link_in_the_checkpoint_folder(tmp_path: Path) -> None:
    """Links planted where DCP writes (its data file; .metadata, to a folder outside) are replaced
    by the files saved, their targets untouched; the checkpoint verifies."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.bin").write_bytes(b"not the save's to write")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").symlink_to(outside / "victim.bin")
    (ckpt / ".metadata").symlink_to(outside / "dir", target_is_directory=True)
    dcp.save(_state(), ckpt)
    assert (outside / "victim.bin").read_bytes() == b"not the save's to write"
    assert list((outside / "dir").iterdir()) == []
    assert not any(p.is_symlink() for p in ckpt.iterdir())
    assert ifs.verify(ckpt, strict=True).files_checked == 2


@pytest.mark.parametrize("chunk_size", [None, 777, 4096])
@pytest.mark.parametrize("seed", range(4))
def test_hashing_stream_digests_any_write_pattern(
    monkeypatch: pytest.MonkeyPatch, chunk_size: int | None, seed: int
) -> None:
    """Small and large writes, across buffer and chunk boundaries, inline and on the helper thread."""
    monkeypatch.setattr(dcp_streams, "BACKGROUND_MIN_BYTES", 300)
    monkeypatch.setattr(dcp_streams, "PIECE_BYTES", 1000)
    monkeypatch.setattr(dcp_streams, "BUFFERS", 2)
    rng = random.Random(seed)
    raw = io.BytesIO()
    stream = dcp_streams.HashingStream(raw, "sha256", chunk_size)
    for _ in range(60):
        stream.write(rng.randbytes(rng.choice([0, 1, 50, 299, 300, 999, 1000, 1001, 5000])))
    size, digests = stream.finish()
    data = raw.getvalue()
    assert size == len(data)
    step = chunk_size or max(1, len(data))
    expected = [hashlib.sha256(data[i : i + step]).hexdigest() for i in range(0, max(1, len(data)), step)]
    assert list(digests) == expected


@pytest.mark.parametrize("threads", [1, 3])
def test_chunks_of_one_stream_are_hashed_on_several_threads_in_bounded_buffers(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """granularity="chunk": chunks hashed at once on HASH_THREADS threads, from at most BUFFERS each."""
    monkeypatch.setattr(dcp_streams, "BACKGROUND_MIN_BYTES", 1)
    monkeypatch.setattr(dcp_streams, "PIECE_BYTES", 1000)
    monkeypatch.setattr(dcp_streams, "HASH_THREADS", threads)
    hashed_on: set[str] = set()

    class Recording:
        def __init__(self) -> None:
            self._hasher = hashlib.sha256()

        def update(self, data: Any) -> None:
            hashed_on.add(threading.current_thread().name)
            self._hasher.update(data)

        def hexdigest(self) -> str:
            return self._hasher.hexdigest()

    monkeypatch.setattr(dcp_streams, "new_hasher", lambda algorithm: Recording())
    data = random.Random(0).randbytes(100_000)
    raw = io.BytesIO()
    stream = dcp_streams.HashingStream(raw, "sha256", 4096)
    for start in range(0, len(data), 30_000):
        stream.write(data[start : start + 30_000])
    size, digests = stream.finish()
    assert size == len(data) == len(raw.getvalue())
    assert list(digests) == [hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, len(data), 4096)]
    if threads == 1:
        return
    assert hashed_on == {f"integrity_fs-hash-{i}" for i in range(threads)}
    assert stream._parallel is not None and stream._parallel._allocated <= dcp_streams.BUFFERS * threads


class _SlowHasher:
    """SHA-256 that takes its time: hashing lags well behind the writes it hashes."""

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()

    def update(self, data: Any) -> None:
        threading.Event().wait(0.002)
        self._hasher.update(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("chunk_size", [None, 4096])
def test_writes_whose_memory_has_an_owner_are_hashed_in_place_the_others_copied(
    monkeypatch: pytest.MonkeyPatch, threads: int, chunk_size: int | None
) -> None:
    """A write of memory that an owner keeps (a tensor DCP writes) is hashed where it lies, the
    owner held until then; any other write is copied first, so that the caller reusing its buffer
    once ``write`` returns changes nothing."""
    monkeypatch.setattr(dcp_streams, "BACKGROUND_MIN_BYTES", 1)
    monkeypatch.setattr(dcp_streams, "PIECE_BYTES", 1000)
    monkeypatch.setattr(dcp_streams, "HASH_THREADS", threads)
    monkeypatch.setattr(dcp_streams, "LAG_BYTES", 20_000)
    monkeypatch.setitem(hashing.ALGORITHMS, "sha256", _SlowHasher)
    rng = random.Random(threads)
    owned: dict[int, _Owned] = {}

    def owner_of(view: memoryview) -> object | None:
        return owned.pop(id(view.obj), None)

    raw = io.BytesIO()
    stream = dcp_streams.HashingStream(raw, "sha256", chunk_size, owner_of)
    alive: list[weakref.ref[_Owned]] = []
    for i in range(40):
        size = rng.choice([10, 999, 3000, 9000])
        if i % 2:
            buffer = _Owned(rng.randbytes(size))
            owned[id(buffer)] = buffer
            alive.append(weakref.ref(buffer))
            stream.write(buffer)
        else:
            buffer = bytearray(rng.randbytes(size))
            stream.write(buffer)
            buffer[:] = bytes(size)  # reused by its writer once write returned (an owner's memory is not)
        del buffer
    assert any(ref() is not None for ref in alive)  # held by the hashing, which lags behind
    size, digests = stream.finish()
    assert all(ref() is None for ref in alive)  # let go once hashed
    data = raw.getvalue()
    step = chunk_size or len(data)
    assert size == len(data)
    assert list(digests) == [hashlib.sha256(data[i : i + step]).hexdigest() for i in range(0, len(data), step)]


class _Owned(bytearray):
    """Memory that an owner keeps as it is (a tensor's storage), weakly referable."""


def test_save_hashes_each_large_tensor_where_it_lies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """dcp.save hashes a tensor's bytes in its own memory, held until hashed: nothing copied for
    them, and the manifest is the one a seal reading everything back gives."""
    claimed: list[int] = []
    owner_of = dcp_writer.TensorOwners.owner_of

    def counting(self: Any, view: memoryview) -> Any:
        owner = owner_of(self, view)
        if owner is not None:
            claimed.append(len(view))
        return owner

    monkeypatch.setattr(dcp_writer.TensorOwners, "owner_of", counting)
    gen = torch.Generator().manual_seed(1)
    state = {"model": {f"w{i}": torch.randn(1 << 19, generator=gen) for i in range(6)}, "step": 1}
    manifest = dcp.save(state, tmp_path / "ckpt", chunk_size=3 << 20)
    assert sorted(claimed) == [1 << 21] * 6  # each 2 MiB tensor, in place
    assert ifs.seal(tmp_path / "ckpt", overwrite=True, granularity="chunk", chunk_size=3 << 20) == manifest


@pytest.mark.parametrize("read_back", [None, "verify", "cat_file"], ids=["as-is", "verify-injected", "cat-injected"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_save_reads_nothing_back(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    counting_s3: tuple[CountingS3Server, dict[str, Any]],
    where: str,
    read_back: str | None,
) -> None:
    """Counted where reads happen (the kernel; the S3 server), and shown to see an injected read-back."""
    url, options = str(tmp_path / "ckpt"), {}
    if where == "s3":
        url, options = f"s3://{BUCKET}/reads-{uuid.uuid4().hex}", counting_s3[1]
    if read_back is not None:
        finish = dcp.HashingFsspecWriter.finish

        def finish_then_read_back(self: dcp.HashingFsspecWriter, *args: Any, **kwargs: Any) -> None:
            finish(self, *args, **kwargs)
            if read_back == "verify":  # integrity_fs's own read paths: builtin open; S3 streamed GETs
                ifs.verify(url, storage_options=options)
            else:
                fs, root = fsspec.core.url_to_fs(url, **options)
                fs.cat_file(f"{root}/__0_0.distcp")

        monkeypatch.setattr(dcp.HashingFsspecWriter, "finish", finish_then_read_back)
    reads = reads_under(url, options)
    try:
        manifest = dcp.save(_state(), url, storage_options=options)
        seen = sorted(set(reads.take()))
    finally:
        reads.close()
    expected = {None: [], "verify": sorted([*manifest.files, MANIFEST_FILENAME]), "cat_file": ["__0_0.distcp"]}[
        read_back
    ]
    assert seen == expected


class FailingWriteMemoryFS(MemoryFileSystem):
    """A memory filesystem whose data files fail after their first megabytes are written."""

    protocol = "failingmem"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "w" in mode and path.endswith(".distcp"):
            write = f.write

            def failing_write(data: Any) -> int:
                if f.tell() > 1_000_000:
                    raise ConnectionResetError("injected: connection lost while writing")
                return int(write(data))

            f.write = failing_write
        return f


fsspec.register_implementation("failingmem", FailingWriteMemoryFS, clobber=True)


@pytest.mark.parametrize("options", [{}, {"granularity": "chunk", "chunk_size": 1 << 20}], ids=["file", "chunk"])
def test_failed_write_writes_no_manifest_and_leaves_no_thread(options: dict[str, Any]) -> None:
    url = f"failingmem://ckpt-{uuid.uuid4().hex}"
    state = {"big": torch.randn(1_000_000), "more": torch.randn(1_000_000)}  # 8 MB: hashed on helper threads
    with pytest.raises(CheckpointException):  # torch.save reports the failed write its own way
        dcp.save(state, url, **options)
    assert not fsspec.filesystem("failingmem").exists(f"{url}/{MANIFEST_FILENAME}")
    # Ours only: servers of other fixtures (moto's threaded HTTP server) start and end threads meanwhile.
    assert [t.name for t in threading.enumerate() if t.name.startswith("integrity_fs-hash")] == []


class FailingThreadMemoryFS(MemoryFileSystem):
    """A memory filesystem on which data files fail to open on any thread but the main one."""

    protocol = "failingthreadmem"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and path.endswith(".distcp") and threading.current_thread() is not threading.main_thread():
            raise ConnectionResetError("injected: a write failed on a DCP writer thread")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("failingthreadmem", FailingThreadMemoryFS, clobber=True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP's thread dies
def test_write_failed_on_a_writer_thread_is_not_sealed() -> None:
    """FsspecWriter's helper threads swallow their exceptions: the save must fail all the same."""
    url = f"failingthreadmem://ckpt-{uuid.uuid4().hex}"
    state = {f"t{i}": torch.randn(1000) for i in range(8)}
    with pytest.raises(CheckpointException, match="not written"):
        dcp.save(state, url, thread_count=2, single_file_per_rank=False)
    assert not fsspec.filesystem("failingthreadmem").exists(f"{url}/{MANIFEST_FILENAME}")


def test_corrupt_checkpoint_is_refused_and_state_untouched(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file")
    dcp.save(_state(), tmp_path / "ckpt")
    _flip(fs, str(tmp_path / "ckpt" / "__0_0.distcp"))
    target = _empty()
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp: mismatch") as caught:
        dcp.load(target, tmp_path / "ckpt")
    assert [p.path for p in caught.value.report.problems] == ["__0_0.distcp"]
    assert _same(target, _empty())
    dcp.load(target, tmp_path / "ckpt", verify=False)  # the user's explicit choice
    assert target["step"] == 42


def test_file_the_manifest_does_not_cover_is_not_loaded(tmp_path: Path) -> None:
    """A manifest (here one passed in) that leaves out a shard: verify calls it extra, load must not read it."""
    url = tmp_path / "ckpt"
    manifest = dcp.save(_state(), url, granularity="file")  # Megatron's manifest: whole-file digests
    partial = ifs.formats.load(
        json.dumps({"algorithm": "sha256", "files": {".metadata": manifest.files[".metadata"]}}).encode()
    )
    assert ifs.verify(url, manifest=partial).extra == ("__0_0.distcp",)
    target = _empty()
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp: extra"):
        dcp.load(target, url, manifest=partial)
    assert _same(target, _empty())


def test_missing_manifest_loads_with_an_info_line_unless_required(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dcp.save(_state(), tmp_path / "ckpt")
    (tmp_path / "ckpt" / MANIFEST_FILENAME).unlink()
    target = _empty()
    with pytest.raises(ManifestNotFoundError):
        dcp.load(target, tmp_path / "ckpt", require_manifest=True)
    assert _same(target, _empty())
    with caplog.at_level(logging.INFO, logger="integrity_fs"):
        assert dcp.load(target, tmp_path / "ckpt") is None
    assert _same(target, _state())
    assert any("loading it unverified" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_verifying_reader_composes_with_dcp_load(tmp_path: Path) -> None:
    dcp.save(_state(), tmp_path / "ckpt")
    target = _empty()
    reader = dcp.VerifyingFsspecReader(str(tmp_path / "ckpt"), collective=False)
    torch_dcp.load(target, storage_reader=reader, no_dist=True)
    assert _same(target, _state()) and reader.report is not None and reader.report.ok
    _flip(fsspec.filesystem("file"), str(tmp_path / "ckpt" / ".metadata"))
    target = _empty()
    with pytest.raises(CheckpointException, match="failed verification"):  # DCP wraps the verdict
        torch_dcp.load(target, storage_reader=dcp.VerifyingFsspecReader(str(tmp_path / "ckpt")), no_dist=True)
    assert _same(target, _empty())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hashing_writer_composes_with_dcp_save(tmp_path: Path) -> None:
    writer = dcp.HashingFsspecWriter(str(tmp_path / "ckpt"), granularity="chunk", chunk_size=1 << 20)
    torch_dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert writer.manifest is not None and writer.manifest.granularity == "chunk"
    assert ifs.read_manifest(tmp_path / "ckpt") == writer.manifest
    with pytest.raises(NotImplementedError, match="bogus"):
        dcp.HashingFsspecWriter(str(tmp_path / "other"), granularity="bogus")


def test_round_trip_and_corruption_on_s3(s3_backend: Backend) -> None:
    manifest = dcp.save(_state(), s3_backend.url, storage_options=s3_backend.storage_options)
    assert s3_backend.listdir() == sorted([".metadata", MANIFEST_FILENAME, "__0_0.distcp"])
    assert s3_backend.read(MANIFEST_FILENAME) == manifest.to_json()
    target = _empty()
    dcp.load(target, s3_backend.url, storage_options=s3_backend.storage_options)
    assert _same(target, _state())
    s3_backend.corrupt("__0_0.distcp", 1000)
    target = _empty()
    with pytest.raises(IntegrityError, match="__0_0.distcp"):
        dcp.load(target, s3_backend.url, storage_options=s3_backend.storage_options)
    assert _same(target, _empty())


# --- signed saves ------------------------------------------------------------------------------


def _key_files(where: Path) -> tuple[Path, Path]:
    """A fresh P-256 key pair as PEM files: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where / f"key-{uuid.uuid4().hex}.pem", where / f"key-{uuid.uuid4().hex}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_signed_save_verifies_here_and_with_model_signing_and_catches_resealed_tampering(
    tmp_path: Path, granularity: str
) -> None:
    model_signing = pytest.importorskip("model_signing")
    private, public = _key_files(tmp_path)
    root = tmp_path / "step_1"
    options: dict[str, Any] = {"granularity": "chunk", "chunk_size": 1 << 20}
    if granularity == "file":
        options = {"granularity": "file"}
    manifest = dcp.save(_state(), str(root), private_key=private, **options)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", MANIFEST_FILENAME, ifs.SIGNATURE_FILENAME]
    )
    assert ifs.verify(root, public_key=public).files_checked == len(manifest.files)
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public)
    if granularity == "chunk":
        config.set_hashing_config(model_signing.hashing.Config().use_shard_serialization(shard_size=1 << 20))
    config.verify(root, root / ifs.SIGNATURE_FILENAME)  # the real peer, hashing the files itself
    target = _empty()
    dcp.load(target, str(root))
    assert _same(target, _state())
    # Someone with write access and no key: change a shard, rewrite the manifest to match.
    _flip(fsspec.filesystem("file"), str(root / "__0_0.distcp"))
    (root / MANIFEST_FILENAME).unlink()
    ifs.seal(root, **options)
    assert ifs.verify(root).ok
    with pytest.raises(ifs.SignatureError, match="__0_0.distcp"):
        ifs.verify(root, public_key=public)


def test_bad_signing_key_fails_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(ValueError, match="cannot load the private key"):
        dcp.save(_state(), str(tmp_path / "ckpt"), private_key=tmp_path / "bad.pem")
    with pytest.raises(ValueError, match="signing needs algorithm 'sha256'"):
        dcp.save(_state(), str(tmp_path / "ckpt"), private_key=_key_files(tmp_path)[0], algorithm="blake3")
    assert not (tmp_path / "ckpt").exists()


# --- S3: checksums from the digests, attested verify -----------------------------------------------

S3_CHUNK = 5 * 1024 * 1024  # S3's smallest part size


def _object_gets(records: list[logging.LogRecord], backend: Backend) -> list[str]:
    """Object GETs the moto server logged under the checkpoint (not the manifest, not ``?attributes``)."""
    prefix = f"/{backend.root}/"
    out = []
    for record in records:
        match = re.search(r"GET (\S+) HTTP", record.getMessage())
        path = match.group(1) if match else ""
        if path.startswith(prefix) and "?" not in path and not path.endswith(MANIFEST_FILENAME):
            out.append(path)
    return out


@pytest.mark.parametrize(("granularity", "chunk_size"), [("chunk", S3_CHUNK), ("file", None)])
def test_s3_save_is_attested_without_reading_a_byte(
    s3_backend: Backend, caplog: pytest.LogCaptureFixture, granularity: str, chunk_size: int | None
) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(3_000_000, generator=gen), "small": torch.arange(1000), "step": 3}  # 12 MB
    options = s3_backend.storage_options
    manifest = dcp.save(state, s3_backend.url, storage_options=options, granularity=granularity, chunk_size=chunk_size)
    checksums = storage.write.store_checksums(s3_backend.fs, [s3_backend.path(name) for name in manifest.files])
    kept = checksums[s3_backend.path("__0_0.distcp")]
    assert kept is not None and kept.digest == manifest.files["__0_0.distcp"]
    if granularity == "chunk":
        assert kept.composite and len(manifest.chunks["__0_0.distcp"]) == 3  # parts of exactly chunk_size
    caplog.set_level(logging.INFO, logger="werkzeug")
    caplog.clear()
    report = ifs.verify(s3_backend.url, storage_options=options, attested=True)
    assert report.ok and report.files_attested == report.files_checked == len(manifest.files) == 2
    assert report.bytes_checked == 0
    assert _object_gets(caplog.records, s3_backend) == []
    target = {"big": torch.zeros(3_000_000), "small": torch.zeros(1000, dtype=torch.long), "step": 0}
    dcp.load(target, s3_backend.url, storage_options=options)
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["small"], state["small"])


@pytest.mark.parametrize(
    ("case", "granularity", "chunk_size", "size"),
    [
        ("one PUT", "chunk", S3_CHUNK, S3_CHUNK),
        ("parts", "chunk", S3_CHUNK, 2 * S3_CHUNK + 5),
        ("past one PUT, file granularity", "file", None, 3 << 20),
        ("parts S3 refuses", "chunk", 1 << 20, 3 << 20),
        ("past 10,000 parts", "chunk", S3_CHUNK, 3 * S3_CHUNK + 5),
    ],
)
def test_growing_sealing_writer_lays_out_what_it_can_and_streams_the_rest(
    s3_backend: Backend, monkeypatch: pytest.MonkeyPatch, case: str, granularity: str, chunk_size: int | None, size: int
) -> None:
    """The layouts a writer that does not know the size in advance (dcp.save) ends up with."""
    from integrity_fs.storage import s3 as _s3

    monkeypatch.setattr(_s3, "SINGLE_PUT_LIMIT", 2 << 20)  # file granularity: one PUT up to 2 MiB here
    if case == "past 10,000 parts":
        monkeypatch.setattr(_s3, "MAX_PARTS", 2)  # as if 10,000
    data = random.Random(size).randbytes(size)
    path = s3_backend.path("f.bin")
    writer = storage.SealingWriter(s3_backend.fs, path, Hashing("sha256", granularity, chunk_size), growing=True)
    for start in range(0, size, 1 << 20):
        writer.write(data[start : start + (1 << 20)])
    digests = writer.close()
    s3_backend.fs.invalidate_cache()
    assert s3_backend.read("f.bin") == data
    units = [data[i : i + chunk_size] for i in range(0, size, chunk_size)] if chunk_size else [data]
    assert digests == tuple(hashlib.sha256(u).hexdigest() for u in units)
    kept = storage.write.store_checksums(s3_backend.fs, [path])[path]
    whole = digests[0] if len(digests) == 1 else hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    if case in ("one PUT", "parts"):
        assert kept is not None and kept.digest == whole  # attestable
    else:
        assert kept is None or kept.digest != whole  # streamed, or parts that are not the chunks
    if case == "past 10,000 parts":
        assert kept is not None and kept.composite  # two parts (moto does not say the count)


# --- real process groups ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_prefix(counting_s3: tuple[CountingS3Server, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    return f"s3://{BUCKET}/dcp-{uuid.uuid4().hex}", counting_s3[1]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, s3_prefix: tuple[str, dict[str, Any]]
) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    world = request.param
    work = tmp_path_factory.mktemp(f"dcp-{world}")
    prefix, options = s3_prefix
    targets = {
        "local": {"url": str(work / "ckpt"), "options": {}},
        "s3": {"url": f"{prefix}/world-{world}", "options": options},
    }
    private, public = _key_files(work)
    (work / "bad.pem").write_text("not a key")
    keys = {"private": str(private), "public": str(public), "bad": str(work / "bad.pem")}
    # DCP's checkpoint process (async_save) costs a spawned interpreter per rank: 2 ranks only.
    spec = {"targets": targets, "async_process": world == 2, "keys": keys}
    results = run_ranks("dist_dcp_worker.py", world, spec, work)
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    return world, results


def _shared(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return outcomes[0]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_save_and_load(ranks: Any, target: str) -> None:
    world, results = ranks
    per_rank = results[target]
    save = _shared([r["save"] for r in per_rank])
    assert save["type"] == "Manifest" and save["reads"] == []
    distcp = [f"__{rank}_0.distcp" for rank in range(world)]
    manifest = ifs.Manifest.from_json(save["manifest"])
    assert sorted(manifest.files) == [".metadata", *distcp]
    assert _shared([r["files"] for r in per_rank]) == sorted([".metadata", MANIFEST_FILENAME, *distcp])
    assert all(set(r["load"]["reads"]) >= set(manifest.files) for r in per_rank)  # the read counter counts
    for step in ("load", "reader"):
        shared = _shared([{k: v for k, v in r[step].items() if k != "reads"} for r in per_rank])
        assert shared["type"] == "NoneType" if step == "reader" else shared["type"] == "Report"
        assert shared["equal"] and shared["report"]["ok"]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_signed_save_and_signing_failures_on_every_rank(ranks: Any, target: str) -> None:
    """The key on rank 0 only: signed and verified; a bad key or a failing signer fails every rank alike."""
    _world, results = ranks
    per_rank = results[target]
    signed = _shared([r["signed"] for r in per_rank])
    assert signed["type"] == "Manifest" and signed["verify"] == "Report"
    bad = _shared([{k: v for k, v in r["bad-key"].items()} for r in per_rank])
    assert bad["type"] == "ValueError" and "cannot load the private key" in bad["message"]
    assert bad["written"] is False  # refused before DCP wrote anything
    fails = _shared([r["sign-fails"] for r in per_rank])
    assert fails["type"] == "CheckpointException" and "injected: the signer failed" in fails["message"]
    assert fails["written"] == []  # no manifest without its signature


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_async_save_with_the_process_executor(ranks: Any, target: str) -> None:
    """torch's async_save(async_checkpointer_type=PROCESS) pickles the writer into its own process."""
    world, results = ranks
    if world == 1:
        pytest.skip("run with 2 ranks only (a spawned checkpoint process per rank)")
    outcome = _shared([r["async-process"] for r in results[target]])
    assert outcome["save"] == "Metadata", outcome["message"]
    manifest = ifs.Manifest.from_json(outcome["manifest"])
    assert sorted(manifest.files) == [".metadata", *(f"__{rank}_0.distcp" for rank in range(world))]
    assert outcome["load"]["type"] == "Report" and outcome["load"]["report"]["ok"] and outcome["load"]["equal"]
    assert outcome["signed"] == "Report"  # rank 0's key travelled to the checkpoint process, which signed


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_corruption_is_refused_on_every_rank(ranks: Any, target: str) -> None:
    world, results = ranks
    per_rank = results[target]
    corrupt = _shared([r["corrupt"] for r in per_rank])
    # One pass: ranks may have loaded verified bytes before the damage was found, never others.
    assert corrupt["type"] == "IntegrityError" and corrupt["verified-only"]
    assert [p["path"] for p in corrupt["report"]["problems"]] == [f"__{world - 1}_0.distcp"]
    reader = _shared([r["reader-corrupt"] for r in per_rank])
    assert reader["type"] == "CheckpointException" and "failed verification" in reader["message"]
    assert reader["verified-only"]
    # Damage in each rank's own tensor (a byte each rank alone reads): every rank raises one
    # IntegrityError naming the damage every rank found.
    every = _shared([r["corrupt-every-file"] for r in per_rank])
    assert every["type"] == "IntegrityError" and every["verified-only"]
    assert [p["path"] for p in every["report"]["problems"]] == [f"__{r}_0.distcp" for r in range(world)]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_a_rank_subset_load_through_the_verifying_reader_does_not_hang(ranks: Any, target: str) -> None:
    """dcp.load(no_dist=True) on rank 0 alone inside an initialised group: the reader is a drop-in
    for FsspecReader and starts no collective the caller did not ask for (a hang fails the launch)."""
    world, results = ranks
    if world == 1:
        pytest.skip("a subset of ranks needs two")
    alone = results[target][0]["subset"]
    assert alone == {"type": "NoneType", "equal": True}
    assert "subset" not in results[target][1]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_missing_manifest(ranks: Any, target: str) -> None:
    _world, results = ranks
    per_rank = results[target]
    unsealed = _shared([r["unsealed"] for r in per_rank])
    assert unsealed["type"] == "NoneType" and unsealed["equal"]
    assert len(unsealed["log"]) == 1 and "loading it unverified" in unsealed["log"][0]
    required = _shared([r["require"] for r in per_rank])
    assert required["type"] == "ManifestNotFoundError" and required["untouched"]


# --- stream extensions --------------------------------------------------------------------------


class XorExtension(StreamTransformExtension):
    """A custom stream transform (not in DCP's default registry): every byte XOR 0x5A."""

    @staticmethod
    def registry_name() -> str:
        return "test.integrity_fs.xor"

    @staticmethod
    def from_descriptor(version: str) -> XorExtension:
        return XorExtension()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes(memoryview(b))
                output.write(bytes(x ^ 0x5A for x in data))
                return len(data)

            def flush(self) -> None:
                output.flush()

        return cast(IO[bytes], Writer())

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(XorExtension)
    return registry


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_custom_stream_extension_loads_through_the_verifying_reader(tmp_path: Path) -> None:
    state = {"small": torch.arange(1000), "step": 7}
    url = str(tmp_path / "ckpt")
    manifest = dcp.save(state, url, _extensions=[XorExtension()])
    (tmp_path / "ckpt" / MANIFEST_FILENAME).unlink()
    assert ifs.seal(url, granularity="chunk") == manifest  # the digests are of the transformed bytes on disk
    target = {"small": torch.zeros(1000, dtype=torch.long), "step": 0}
    reader = dcp.VerifyingFsspecReader(url, collective=False, _extension_registry=_registry())
    torch_dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["small"], state["small"]) and target["step"] == 7
    assert reader.report is not None and reader.report.files_checked == 2
    target = {"small": torch.zeros(1000, dtype=torch.long), "step": 0}
    assert dcp.load(target, url, _extension_registry=_registry()) is not None
    assert torch.equal(target["small"], state["small"]) and target["step"] == 7


# --- ranks that disagree --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """One launch of 2 ranks; a hang fails it (20 s collective timeout, 90 s in all)."""
    work = tmp_path_factory.mktemp("dcp-disagreeing")

    def sc(id_: str, op: str, **extra: Any) -> dict[str, Any]:
        return {"id": id_, "op": op, "url": str(work / id_), **extra}

    chunk = {"granularity": "chunk"}
    scenarios = [
        sc("granularity", "save", rank_kwargs={"1": {**chunk, "chunk_size": 4096}}),
        sc("chunk-size", "save", kwargs=chunk, rank_kwargs={"0": {"chunk_size": 4096}, "1": {"chunk_size": 8192}}),
        sc("writers", "writer", rank_kwargs={"1": {**chunk, "chunk_size": 4096}}),  # torch's save, our writers
        sc("require-manifest", "load", unsealed=True, rank_kwargs={"0": {"require_manifest": True}}),
        sc("verify", "load", rank_kwargs={"1": {"verify": False}}),
        sc("after", "load"),  # the group is still in step
    ]
    return run_ranks("dist_dcp_hostile_worker.py", 2, {"scenarios": scenarios, "pg_timeout_s": 20}, work, timeout=90)


@pytest.mark.parametrize("scenario", ["granularity", "chunk-size"])
def test_save_with_different_hashing_options_per_rank_is_refused_on_every_rank(
    disagreeing: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    """Rank 0 would seal rank 1's digests as if hashed its way: a manifest that fails an intact checkpoint."""
    outcome = _shared(disagreeing[scenario])
    assert outcome["save"]["type"] == "ValueError"
    assert "ranks passed different hashing options" in outcome["save"]["message"]
    assert outcome["verify"]["type"] == "FileNotFoundError"  # refused before anything was written


def test_hashing_writers_that_hash_differently_per_rank_do_not_seal(
    disagreeing: dict[str, list[dict[str, Any]]],
) -> None:
    """torch's own dcp.save with a HashingFsspecWriter per rank: the coordinator refuses to mix the digests."""
    outcome = _shared(disagreeing["writers"])
    assert outcome["save"]["type"] == "CheckpointException"
    assert "ranks hashed their files differently" in outcome["save"]["message"]
    assert outcome["verify"]["type"] == "ManifestNotFoundError"  # written, never sealed


@pytest.mark.parametrize("scenario", ["require-manifest", "verify"])
def test_load_with_different_verify_choices_per_rank_raises_on_every_rank(
    disagreeing: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    """A rank that skips verifying (or an unsealed checkpoint) would wait in DCP's collectives for ranks that raise."""
    outcome = _shared(disagreeing[scenario])
    assert outcome["load"]["type"] == "ValueError" and "ranks passed different arguments" in outcome["load"]["message"]
    assert not outcome["loaded"]
    assert _shared(disagreeing["after"]) == {"load": {"type": "Report"}, "loaded": True}


# --- retention: save(keep_last=N) and the writer's keep_last for async_save ------------------------------


def test_save_keep_last_on_s3_prunes_from_the_store_checksums(
    counting_s3: tuple[CountingS3Server, dict[str, Any]],
) -> None:
    """The checkpoints dcp.save wrote to S3 are judged from their SHA-256 checksums: no content is read."""
    _server, options = counting_s3
    run = f"s3://{BUCKET}/keep-{uuid.uuid4().hex}"
    reads = reads_under(run, options)
    try:
        for n in (1, 2, 3, 4):
            dcp.save(_state(), f"{run}/step_{n}", storage_options=options, keep_last=2)
        seen = reads.take()
    finally:
        reads.close()
    assert ifs.find_checkpoints(run, storage_options=options) == [f"{run}/step_4", f"{run}/step_3"]
    metadata = (MANIFEST_FILENAME, "_integrity_store_checksums.json")
    assert seen and [name for name in seen if not name.endswith(metadata)] == []  # manifests only
    for n in (3, 4):
        assert ifs.verify(f"{run}/step_{n}", storage_options=options).ok


def test_save_keep_last_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    for bad, error in ((0, ValueError), (True, TypeError)):
        with pytest.raises(error, match="keep_last"):
            dcp.save(_state(), str(tmp_path / "run" / "step_1"), keep_last=bad)
    assert not (tmp_path / "run").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_with_keep_last_prunes_once_the_save_completed(tmp_path: Path) -> None:
    """torch's own async_save with HashingFsspecWriter(keep_last=2): the coordinator prunes in
    ``finish``, after the manifest; the newest damaged, the older good one stays."""
    root = tmp_path / "run"
    listed = []
    for n in (1, 2, 3, 4):
        writer = dcp.HashingFsspecWriter(str(root / f"step_{n}"), keep_last=2)
        torch_dcp.async_save(_state(), storage_writer=writer).result()
        listed.append(sorted(p.name for p in root.iterdir()))
    assert listed == [["step_1"], ["step_1", "step_2"], ["step_2", "step_3"], ["step_3", "step_4"]]
    fs = fsspec.filesystem("file")
    _flip(fs, str(root / "step_4" / "__0_0.distcp"))
    writer = dcp.HashingFsspecWriter(str(root / "step_5"), keep_last=2)
    torch_dcp.async_save(_state(), storage_writer=writer).result()
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_5"]
    assert [ifs.verify(root / f"step_{n}").ok for n in (3, 5)] == [True, True]
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        dcp.HashingFsspecWriter(str(root / "step_6"), keep_last=0)


def _save_keeping(how: str, url: str, **options: Any) -> None:
    """A save with ``keep_last``: ``dcp.save``, or torch's own ``async_save`` with the writer."""
    if how == "save":
        dcp.save(_state(), url, **options)
    else:
        torch_dcp.async_save(_state(), storage_writer=dcp.HashingFsspecWriter(url, **options)).result()


def _sealed_folder(path: Path, **options: Any) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(1000))
    ifs.seal(path, **options)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["save", "writer"])
def test_keep_last_prunes_only_folders_named_like_the_saved_one(tmp_path: Path, how: str) -> None:
    """A sealed base model, a final export and another run's checkpoints beside the run's are not its
    checkpoints: never candidates."""
    root = tmp_path / "run"
    for name in ("base_model", "final", "other_step_1", "other_step_2"):
        _sealed_folder(root / name)
    for n in (1, 2, 3):
        _save_keeping(how, str(root / f"step_{n}"), keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [
        "base_model",
        "final",
        "other_step_1",
        "other_step_2",
        "step_2",
        "step_3",
    ]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["save", "writer"])
def test_a_signed_save_keeps_the_checkpoints_its_key_signed(tmp_path: Path, how: str) -> None:
    """Two sealed but unsigned folders dropped into a signing run do not count as good ones: the
    genuine checkpoints stay, the unsigned ones are left (newer than the oldest kept)."""
    private, public = _key_files(tmp_path)
    root = tmp_path / "run"
    for n in (1, 2, 3):
        _save_keeping(how, str(root / f"step_{n}"), private_key=private, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    for n in (8, 9):  # someone without the key
        _sealed_folder(root / f"step_{n}")
    _save_keeping(how, str(root / "step_4"), private_key=private, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_8", "step_9"]
    for n in (3, 4):
        assert ifs.verify(root / f"step_{n}", public_key=public, expected_name=f"step_{n}").ok
    assert dcp.HashingFsspecWriter(str(tmp_path / "x"), private_key=private).public_key is not None
