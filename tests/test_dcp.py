"""integrity_fs.dcp: DCP checkpoints sealed while written, verified before loaded, on local disk and S3.

In-process tests run without a process group (DCP's single-process mode); tests/dist_dcp_worker.py
runs the same flows on gloo process groups of 1 and 2 ranks, on a local directory and on S3 (moto).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import threading
import uuid
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
from torch.distributed.checkpoint._extension import StreamTransformExtension

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError, dcp, formats

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more


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
    verified = ifs.verify(url)
    assert report is not None and report.ok and report.files_checked == 2
    assert (report.files_checked, report.bytes_checked) == (verified.files_checked, verified.bytes_checked)
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


@pytest.mark.parametrize("chunk_size", [None, 777, 4096])
@pytest.mark.parametrize("seed", range(2))
def test_the_digests_of_a_save_hold_for_any_write_pattern(tmp_path: Path, chunk_size: int | None, seed: int) -> None:
    """Tensors of many sizes (empty, one byte, across chunk ends), one file each or one file per
    rank, on DCP's writer threads: the manifest hashed while writing is the one a seal reading
    everything back writes."""
    rng = random.Random(seed)
    state: dict[str, Any] = {
        f"t{i}": torch.randint(0, 255, (rng.choice([0, 1, 50, 299, 777, 1001, 5000, 40_000]),), dtype=torch.uint8)
        for i in range(24)
    }
    state["step"] = seed
    options: dict[str, Any] = {"granularity": "file"} if chunk_size is None else {"chunk_size": chunk_size}
    url = tmp_path / "ckpt"
    manifest = dcp.save(state, url, thread_count=3, single_file_per_rank=bool(seed), **options)
    assert ifs.seal(url, overwrite=True, **({"granularity": "chunk", **options} if chunk_size else options)) == manifest
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}
    dcp.load(target, url)
    assert all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))


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


@pytest.mark.parametrize("where", ["local", "s3"])
def test_save_reads_nothing_back(
    tmp_path: Path, counting_s3: tuple[CountingS3Server, dict[str, Any]], where: str
) -> None:
    """Counted where reads happen (the kernel; the S3 server); the same counter sees a verify's reads."""
    url, options = str(tmp_path / "ckpt"), {}
    if where == "s3":
        url, options = f"s3://{BUCKET}/reads-{uuid.uuid4().hex}", counting_s3[1]
    reads = reads_under(url, options)
    try:
        manifest = dcp.save(_state(), url, storage_options=options)
        saved = sorted(set(reads.take()))
        ifs.verify(url, storage_options=options)
        verified = sorted(set(reads.take()))
    finally:
        reads.close()
    assert saved == []
    assert verified == sorted([*manifest.files, MANIFEST_FILENAME])  # the counter counts


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
    state = {"big": torch.randn(1_000_000), "more": torch.randn(1_000_000)}  # 8 MB
    with pytest.raises(CheckpointException):  # torch.save reports the failed write its own way
        dcp.save(state, url, **options)
    assert not fsspec.filesystem("failingmem").exists(f"{url}/{MANIFEST_FILENAME}")
    # Ours only: servers of other fixtures (moto's threaded HTTP server) start and end threads meanwhile.
    assert [t.name for t in threading.enumerate() if t.name.startswith("integrity_fs")] == []


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
    with pytest.raises((CheckpointException, OSError)):
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
    partial = formats.load(
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
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("ckpt" in m and "without verification" in m for m in said), said


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_verifying_reader_composes_with_dcp_load(tmp_path: Path) -> None:
    dcp.save(_state(), tmp_path / "ckpt")
    target = _empty()
    reader = dcp.VerifyingFsspecReader(str(tmp_path / "ckpt"))
    torch_dcp.load(target, storage_reader=reader, no_dist=True)
    assert _same(target, _state())
    assert reader.report().ok and reader.report().files_checked == 2
    _flip(fsspec.filesystem("file"), str(tmp_path / "ckpt" / "__0_0.distcp"))
    target = _empty()
    with pytest.raises((CheckpointException, IntegrityError), match=r"__0_0\.distcp"):  # DCP may wrap the verdict
        torch_dcp.load(target, storage_reader=dcp.VerifyingFsspecReader(str(tmp_path / "ckpt")), no_dist=True)
    assert _same(target, _empty())


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
    assert sorted(p.name for p in root.iterdir()) == sorted([".metadata", "__0_0.distcp", MANIFEST_FILENAME, SIGNATURE])
    assert ifs.verify(root, public_key=public).files_checked == len(manifest.files)
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public)
    if granularity == "chunk":
        config.set_hashing_config(model_signing.hashing.Config().use_shard_serialization(shard_size=1 << 20))
    config.verify(root, root / SIGNATURE)  # the real peer, hashing the files itself
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
    with pytest.raises(ValueError, match="key"):
        dcp.save(_state(), str(tmp_path / "ckpt"), private_key=tmp_path / "bad.pem")
    with pytest.raises(ValueError, match="sha256"):
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
    """dcp.save uploads with S3 checksums made from its own digests (parts of exactly the chunk
    size): an attested verify confirms every file from them, and reads no byte of content."""
    gen = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(3_000_000, generator=gen), "small": torch.arange(1000), "step": 3}  # 12 MB
    options = s3_backend.storage_options
    manifest = dcp.save(state, s3_backend.url, storage_options=options, granularity=granularity, chunk_size=chunk_size)
    if granularity == "chunk":
        assert len(manifest.chunks["__0_0.distcp"]) == 3
    caplog.set_level(logging.INFO, logger="werkzeug")
    caplog.clear()
    report = ifs.verify(s3_backend.url, storage_options=options, attested=True)
    assert report.ok and report.files_attested == report.files_checked == len(manifest.files) == 2
    assert report.bytes_checked == 0
    assert _object_gets(caplog.records, s3_backend) == []
    target = {"big": torch.zeros(3_000_000), "small": torch.zeros(1000, dtype=torch.long), "step": 0}
    dcp.load(target, s3_backend.url, storage_options=options)
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["small"], state["small"])


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
    results = run_ranks("dist_dcp_worker.py", world, {"targets": targets, "keys": keys}, work)
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
    """The key on rank 0 only: signed and verified; a bad key fails every rank alike, before DCP writes."""
    _world, results = ranks
    per_rank = results[target]
    signed = _shared([r["signed"] for r in per_rank])
    assert signed["type"] == "Manifest" and signed["verify"] == "Report"
    bad = _shared(list(per_rank[i]["bad-key"] for i in range(len(per_rank))))
    assert bad["type"] == "ValueError" and "key" in bad["message"]
    assert bad["written"] is False  # refused before DCP wrote anything


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_corruption_is_refused_on_every_rank(ranks: Any, target: str) -> None:
    world, results = ranks
    per_rank = results[target]
    corrupt = _shared([r["corrupt"] for r in per_rank])
    # One pass: ranks may have loaded verified bytes before the damage was found, never others.
    assert corrupt["type"] == "IntegrityError" and corrupt["verified-only"]
    assert [p["path"] for p in corrupt["report"]["problems"]] == [f"__{world - 1}_0.distcp"]
    reader = _shared([r["reader-corrupt"] for r in per_rank])
    assert reader["type"] in ("CheckpointException", "IntegrityError") and "failed verification" in reader["message"]
    assert reader["verified-only"]
    # Damage in each rank's own tensor (a byte each rank alone reads): every rank raises an
    # IntegrityError, and none loads a byte that did not verify.
    every = [r["corrupt-every-file"] for r in per_rank]
    assert all(o["type"] == "IntegrityError" and o["verified-only"] for o in every), every
    assert len({o["message"] for o in every}) == 1, every


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
    assert len(unsealed["log"]) == 1 and "without verification" in unsealed["log"][0]
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


def test_a_save_through_a_stream_extension_seals_the_bytes_on_disk(tmp_path: Path) -> None:
    """FsspecWriter's ``_extensions`` pass through dcp.save: the digests are of the transformed
    bytes on disk, the ones a seal reading them back computes."""
    state = {"small": torch.arange(1000), "step": 7}
    url = str(tmp_path / "ckpt")
    manifest = dcp.save(state, url, _extensions=[XorExtension()])
    (tmp_path / "ckpt" / MANIFEST_FILENAME).unlink()
    assert ifs.seal(url, granularity="chunk") == manifest


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
        sc("bad-on-one", "save", rank_kwargs={"1": {"granularity": "bogus"}}),
        sc("keep-last", "save", rank_kwargs={"0": {"keep_last": 2}, "1": {"keep_last": 3}}, ckpt="step_1"),
        sc("require-manifest", "load", unsealed=True, rank_kwargs={"0": {"require_manifest": True}}),
        sc("verify", "load", rank_kwargs={"1": {"verify": False}}),
        sc("strict", "load", rank_kwargs={"1": {"strict": True}}),
        sc("after", "load"),  # the group is still in step
    ]
    return run_ranks("dist_dcp_hostile_worker.py", 2, {"scenarios": scenarios, "pg_timeout_s": 20}, work, timeout=90)


@pytest.mark.parametrize("scenario", ["granularity", "chunk-size", "bad-on-one", "keep-last"])
def test_save_with_different_options_per_rank_is_refused_on_every_rank_before_writing(
    disagreeing: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    """Rank 0 would seal rank 1's digests as if hashed its way: a manifest that fails an intact
    checkpoint. Every rank raises the same error, and nothing is written."""
    outcome = _shared(disagreeing[scenario])
    expected = "NotImplementedError" if scenario == "bad-on-one" else "ValueError"
    assert outcome["save"]["type"] == expected, outcome
    if scenario != "bad-on-one":
        assert "ranks disagree" in outcome["save"]["message"]
    assert outcome["verify"]["type"] == "FileNotFoundError"  # refused before anything was written
    assert outcome["written"] == []


@pytest.mark.parametrize("scenario", ["require-manifest", "verify", "strict"])
def test_load_with_different_verify_choices_per_rank_raises_on_every_rank(
    disagreeing: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    """A rank that skips verifying (or an unsealed checkpoint) would wait in DCP's collectives for ranks that raise."""
    outcome = _shared(disagreeing[scenario])
    assert outcome["load"]["type"] == "ValueError" and "ranks disagree" in outcome["load"]["message"]
    assert not outcome["loaded"]
    assert _shared(disagreeing["after"]) == {"load": {"type": "Report"}, "loaded": True}


# --- retention: save(keep_last=N) ---------------------------------------------------------------------


def test_save_keep_last_on_s3_reads_no_content(counting_s3: tuple[CountingS3Server, dict[str, Any]]) -> None:
    """The checkpoints dcp.save wrote (and hashed as it wrote them) are judged without reading them again."""
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
    assert [name for name in seen if not name.endswith(MANIFEST_FILENAME)] == []  # manifests at most
    for n in (3, 4):
        assert ifs.verify(f"{run}/step_{n}", storage_options=options).ok


def test_save_keep_last_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    for bad, error in ((0, ValueError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(error, match="keep_last"):
            dcp.save(_state(), str(tmp_path / "run" / "step_1"), keep_last=bad)
    assert not (tmp_path / "run").exists()


def _sealed_folder(path: Path, **options: Any) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(1000))
    ifs.seal(path, **options)


def test_keep_last_prunes_only_folders_named_like_the_saved_one(tmp_path: Path) -> None:
    """A sealed base model, a final export and another run's checkpoints beside the run's are not its
    checkpoints: never candidates."""
    root = tmp_path / "run"
    for name in ("base_model", "final", "other_step_1", "other_step_2"):
        _sealed_folder(root / name)
    for n in (1, 2, 3):
        dcp.save(_state(), str(root / f"step_{n}"), keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [
        "base_model",
        "final",
        "other_step_1",
        "other_step_2",
        "step_2",
        "step_3",
    ]


def test_a_signed_save_keeps_the_checkpoints_its_key_signed(tmp_path: Path) -> None:
    """Two sealed but unsigned folders dropped into a signing run do not count as good ones: the
    genuine checkpoints stay, the unsigned ones are left (newer than the oldest kept)."""
    private, public = _key_files(tmp_path)
    root = tmp_path / "run"
    for n in (1, 2, 3):
        dcp.save(_state(), str(root / f"step_{n}"), private_key=private, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    for n in (8, 9):  # someone without the key
        _sealed_folder(root / f"step_{n}")
    dcp.save(_state(), str(root / "step_4"), private_key=private, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4", "step_8", "step_9"]
    for n in (3, 4):
        assert ifs.verify(root / f"step_{n}", public_key=public, expected_name=f"step_{n}").ok
