"""Hash algorithms through one dispatch, on every backend: SHA-256 (the default), BLAKE3, and the
stores' own CRCs, CRC-64/NVME and CRC32C (issue 38): digests equal awscrt's, a chunked file's
digest is the whole file's CRC, a flipped bit is caught with its byte range."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, FileChangedError, IntegrityError
from integrity_fs.cli import main as cli_main

blake3 = pytest.importorskip("blake3").blake3
checksums = pytest.importorskip("awscrt.checksums")

MIB = 1024 * 1024
FILES = {
    "big.bin": os.urandom(3 * MIB + 12345),  # several reads, several chunks
    "small.bin": os.urandom(1000),
    "sub/empty": b"",
}
CRCS = {"crc64nvme": (checksums.crc64nvme, 8), "crc32c": (checksums.crc32c, 4)}


def crc(algorithm: str, data: bytes) -> str:
    """What S3 and GCS show (in base64) for these bytes, as the manifest writes it: big-endian hex."""
    function, width = CRCS[algorithm]
    return int(function(data)).to_bytes(width, "big").hex()


@pytest.fixture
def ckpt(backend: Backend) -> Backend:
    for name, data in FILES.items():
        backend.write(name, data)
    return backend


# --- BLAKE3 ----------------------------------------------------------------------------------------


def test_seal_and_verify_with_blake3(ckpt: Backend) -> None:
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm="blake3")
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    assert raw["algorithm"] == "blake3"
    assert raw["files"] == {name: blake3(data).hexdigest() for name, data in FILES.items()}
    assert manifest.files == raw["files"]
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.bytes_checked == sum(map(len, FILES.values()))
    ckpt.corrupt("big.bin", -1)
    with pytest.raises(IntegrityError, match="big.bin: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


def test_chunk_granularity_combines_chunk_digests_with_blake3(ckpt: Backend) -> None:
    chunk = MIB + 7
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm="blake3", granularity="chunk", chunk_size=chunk)
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    data = FILES["big.bin"]
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    assert raw["chunks"]["big.bin"] == [blake3(p).hexdigest() for p in pieces]
    combined = blake3(b"".join(blake3(p).digest() for p in pieces)).hexdigest()
    assert raw["files"]["big.bin"] == combined
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok
    ckpt.corrupt("big.bin", chunk + 3)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    (problem,) = err.value.report.problems
    assert problem.byte_ranges == ((chunk, 2 * chunk),)


def test_sha256_stays_the_default(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    assert ifs.seal(tmp_path).algorithm == "sha256"


def test_without_the_package_blake3_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").write_bytes(b"a")
    sealed = tmp_path / "sealed"
    sealed.mkdir()
    (sealed / "a").write_bytes(b"a")
    ifs.seal(sealed, algorithm="blake3")
    monkeypatch.setitem(sys.modules, "blake3", None)  # the package is not installed: import blake3 raises ImportError
    hint = r"pip install 'integrity-fs\[blake3\]'"
    with pytest.raises(NotImplementedError, match=hint):
        ifs.seal(tmp_path, algorithm="blake3")
    assert not (tmp_path / MANIFEST_FILENAME).exists()
    with pytest.raises(NotImplementedError, match=hint):
        ifs.verify(sealed)
    assert cli_main(["verify", str(sealed)]) == 3  # unsupported algorithm: the CLI's "manifest" code


# --- CRC-64/NVME and CRC32C ------------------------------------------------------------------------


def test_the_crcs_are_the_standard_ones(tmp_path: Path) -> None:
    """The catalogue's check values (the CRC of ``123456789``), so that "equal to awscrt" means the
    CRCs S3 and GCS keep, and an empty file's CRC is all zeros."""
    (tmp_path / "check").write_bytes(b"123456789")
    (tmp_path / "empty").write_bytes(b"")
    nvme = ifs.seal(tmp_path, algorithm="crc64nvme")
    assert dict(nvme.files) == {"check": "ae8b14860a799888", "empty": "0" * 16}
    castagnoli = ifs.seal(tmp_path, algorithm="crc32c", overwrite=True)
    assert dict(castagnoli.files) == {"check": "e3069283", "empty": "0" * 8}


@pytest.mark.parametrize("algorithm", list(CRCS))
def test_crc_file_digests_equal_awscrts(ckpt: Backend, algorithm: str) -> None:
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm=algorithm)
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    assert raw["algorithm"] == algorithm and raw["granularity"] == "file"
    assert raw["files"] == {name: crc(algorithm, data) for name, data in FILES.items()}
    assert dict(manifest.files) == raw["files"]
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.bytes_checked == sum(map(len, FILES.values()))
    ckpt.corrupt("small.bin", 17)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    (problem,) = err.value.report.problems
    assert (problem.path, problem.kind, problem.expected) == (
        "small.bin",
        "mismatch",
        crc(algorithm, FILES["small.bin"]),
    )


@pytest.mark.parametrize("algorithm", list(CRCS))
def test_a_chunked_crc_manifest_keeps_each_chunks_crc_and_the_whole_files(ckpt: Backend, algorithm: str) -> None:
    """``chunks[name]``: each chunk's CRC; ``files[name]``: the CRC of the whole file (combined from
    the chunks), the value the store keeps for the object."""
    chunk = MIB + 7
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm=algorithm, granularity="chunk", chunk_size=chunk)
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    for name, data in FILES.items():
        pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
        assert raw["chunks"][name] == [crc(algorithm, p) for p in pieces]
        assert raw["files"][name] == crc(algorithm, data)  # the combine equals the whole file's CRC
    assert len(raw["chunks"]["big.bin"]) == 4
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok


@pytest.mark.parametrize("algorithm", list(CRCS))
@pytest.mark.parametrize("offset", [0, MIB + 6, MIB + 7, 3 * MIB + 12344])
def test_a_flipped_bit_is_caught_with_its_byte_range(tmp_path: Path, algorithm: str, offset: int) -> None:
    chunk = MIB + 7
    data = FILES["big.bin"]
    (tmp_path / "big.bin").write_bytes(data)
    ifs.seal(tmp_path, algorithm=algorithm, granularity="chunk", chunk_size=chunk)
    flipped = bytearray(data)
    flipped[offset] ^= 0x40
    (tmp_path / "big.bin").write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path)
    (problem,) = err.value.report.problems
    start = offset // chunk * chunk
    assert problem.path == "big.bin" and problem.kind == "mismatch"
    assert problem.byte_ranges == ((start, min(len(data), start + chunk)),)
    assert problem.actual == crc(algorithm, bytes(flipped))
    with (
        pytest.raises(IntegrityError, match=f"big.bin: mismatch in bytes {start}-"),
        ifs.open(tmp_path, "big.bin") as f,
    ):
        f.seek(start)
        f.read(1)


@pytest.mark.parametrize("algorithm", list(CRCS))
def test_open_serves_verified_bytes_of_a_crc_manifest(tmp_path: Path, algorithm: str) -> None:
    for name, data in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    ifs.seal(tmp_path, algorithm=algorithm, granularity="chunk", chunk_size=MIB)
    with ifs.open(tmp_path, "big.bin") as f:
        assert f.read() == FILES["big.bin"]
    with ifs.open(tmp_path, "sub/empty") as f:
        assert f.read() == b""


@pytest.mark.parametrize("algorithm", list(CRCS))
def test_a_crc_manifest_with_a_wrong_combined_digest_is_refused(tmp_path: Path, algorithm: str) -> None:
    (tmp_path / "big.bin").write_bytes(FILES["big.bin"])
    ifs.seal(tmp_path, algorithm=algorithm, granularity="chunk", chunk_size=MIB)
    raw = json.loads((tmp_path / MANIFEST_FILENAME).read_bytes())
    raw["files"]["big.bin"] = "0" * len(raw["files"]["big.bin"])
    (tmp_path / MANIFEST_FILENAME).write_text(json.dumps(raw))
    with pytest.raises(ifs.ManifestError, match="chunk digests"):
        ifs.verify(tmp_path)
    raw["files"]["big.bin"] = "0" * 64  # a SHA-256-long digest in a CRC manifest
    (tmp_path / MANIFEST_FILENAME).write_text(json.dumps(raw))
    with pytest.raises(ifs.ManifestError, match=algorithm):
        ifs.read_manifest(tmp_path)


def test_without_awscrt_crc_manifests_say_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").write_bytes(b"a")
    sealed = tmp_path / "sealed"
    sealed.mkdir()
    (sealed / "a").write_bytes(b"a")
    ifs.seal(sealed, algorithm="crc64nvme")
    for module in ("awscrt", "awscrt.checksums"):
        monkeypatch.setitem(sys.modules, module, None)  # the package is not installed
    hint = r"pip install 'integrity-fs\[crc\]'"
    with pytest.raises(NotImplementedError, match=hint):
        ifs.seal(tmp_path, algorithm="crc32c")
    assert not (tmp_path / MANIFEST_FILENAME).exists()
    with pytest.raises(NotImplementedError, match=hint):
        ifs.verify(sealed)
    assert cli_main(["verify", str(sealed)]) == 3


# --- every algorithm: a file rewritten while it is read is a change, not damage ---------------------


class _After(Callback):  # type: ignore[misc]
    """Runs ``action`` once, when ``count`` bytes were hashed."""

    def __init__(self, count: int, action: Any) -> None:
        super().__init__()
        self._count = count
        self._action: Any = action

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        if self._action is not None and self.value >= self._count:
            self._action, action = None, self._action
            action()


@pytest.mark.parametrize("algorithm", ["sha256", "blake3", "crc64nvme", "crc32c"])
@pytest.mark.parametrize("when", ["between-reads", "after-the-last"])
def test_a_file_rewritten_in_place_with_its_mtime_put_back_is_a_file_changed_error(
    tmp_path: Path, algorithm: str, when: str
) -> None:
    """Rewritten in place, the modification time put back (as ``cp -p`` does): the change time tells,
    between two reads of the file or after the last."""
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(5 * MIB + 777))
    ifs.seal(tmp_path, algorithm=algorithm)

    def rewrite() -> None:
        stat = path.stat()
        with open(path, "r+b") as f:
            f.seek(4 * MIB)
            f.write(b"\1" * 100)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    after = 1 if when == "between-reads" else path.stat().st_size
    with pytest.raises(FileChangedError, match=r"big\.bin changed while it was read"):
        ifs.verify(tmp_path, max_workers=1, callback=_After(after, rewrite))
