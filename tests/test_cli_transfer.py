"""The download, upload and copy commands (in-process main(argv)), on local paths and S3 (moto)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_run import FILES, cli, error_lines, sha256
from conftest import Backend

from integrity_fs import MANIFEST_FILENAME

# --- download ----------------------------------------------------------------------------------------


def test_download_verified_checkpoint(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("seal", backend.url, *options).returncode == 0
    backend.write("late.bin", b"written after sealing")
    dest = tmp_path / "downloads" / "step_1000"
    proc = cli("download", backend.url, str(dest), *options)
    assert proc.returncode == 0, proc.stderr
    assert "late.bin" in proc.stdout and "not downloaded" in proc.stdout
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(
        [*FILES, MANIFEST_FILENAME]
    )
    assert all((dest / name).read_bytes() == data for name, data in FILES.items())
    assert cli("verify", str(dest), "--strict").returncode == 0
    assert os.listdir(dest.parent) == ["step_1000"]  # no staging directory left behind


def test_download_of_corrupt_checkpoint_writes_nothing(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("seal", backend.url, "--chunk-size", "64K", *options).returncode == 0
    backend.corrupt("model.bin", 200_000)
    parent = tmp_path / "downloads"
    parent.mkdir()
    proc = cli("download", backend.url, str(parent / "step_1000"), "--workers", "2", *options)
    assert proc.returncode == 1
    assert "model.bin" in error_lines(proc)[0]
    assert "model.bin: mismatch in bytes 196608-262143" in proc.stdout
    assert os.listdir(parent) == []  # neither DEST nor a staging directory with the corrupt bytes


def test_download_without_manifest_exits_3_and_writes_nothing(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    proc = cli("download", backend.url, str(tmp_path / "dl" / "step_1000"), *options)
    assert proc.returncode == 3
    assert not (tmp_path / "dl").exists()


def test_download_refuses_a_non_empty_destination(sealed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    proc = cli("download", str(sealed), str(dest))
    assert proc.returncode == 2
    assert "not an empty directory" in error_lines(proc)[0]
    assert os.listdir(dest) == ["keep.txt"]


# --- upload ------------------------------------------------------------------------------------------


def test_upload_then_verify(ckpt: Path, s3_backend: Backend, s3_endpoint: str) -> None:
    options = ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
    proc = cli("upload", str(ckpt), s3_backend.url, "--granularity", "chunk", "--chunk-size", "64K", *options)
    assert proc.returncode == 0, proc.stderr
    # 64 KiB chunks are parts S3 refuses: sent as plain streams, whose S3 MD5s are recorded beside the manifest.
    assert s3_backend.listdir() == sorted([*FILES, MANIFEST_FILENAME, "_integrity_store_checksums.json"])
    assert all(s3_backend.read(name) == data for name, data in FILES.items())
    manifest = json.loads(s3_backend.read(MANIFEST_FILENAME))
    assert manifest["granularity"] == "chunk" and len(manifest["chunks"]["model.bin"]) == 5
    assert manifest["files"]["sub/meta.json"] != sha256(FILES["sub/meta.json"])  # a chunk-derived digest
    assert cli("verify", s3_backend.url, "--strict", *options).returncode == 0

    again = cli("upload", str(ckpt), s3_backend.url, *options)
    assert again.returncode == 2 and "already holds a sealed checkpoint" in error_lines(again)[0]


def test_upload_to_a_bucket_that_does_not_exist_says_only_that(ckpt: Path, s3_endpoint: str) -> None:
    """Nothing was written, so nothing is left to delete: no WARNING about files it could not delete."""
    endpoint = f"client_kwargs.endpoint_url={s3_endpoint}"
    proc = cli("upload", str(ckpt), "s3://no-such-bucket-here/run/step_1000", "-o", endpoint)
    assert proc.returncode == 4 and proc.stdout == ""
    assert "WARNING" not in proc.stderr, proc.stderr
    assert len(error_lines(proc)) == 1 and "bucket does not exist" in error_lines(proc)[0], proc.stderr


@pytest.mark.parametrize("granularity", [["--granularity", "file"], ["--chunk-size", "64K"]])
def test_upload_to_local_url_gives_the_same_manifest_as_seal(
    ckpt: Path, tmp_path: Path, granularity: list[str]
) -> None:
    """The digests computed while streaming equal seal's, chunk boundaries included."""
    (ckpt / "empty.bin").write_bytes(b"")
    (ckpt / "exact.bin").write_bytes(bytes(2 * 65536))  # ends on a chunk boundary
    target = tmp_path / "uploaded"
    assert cli("upload", str(ckpt), f"file://{target}", *granularity).returncode == 0
    assert cli("seal", str(ckpt), *granularity).returncode == 0
    assert (target / MANIFEST_FILENAME).read_bytes() == (ckpt / MANIFEST_FILENAME).read_bytes()


# --- copy --------------------------------------------------------------------------------------------


def test_copy_between_urls(sealed: Path, s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("upload", str(sealed), f"{backend.url}/copy-src", "--dst-o", "x=1", *options).returncode == 2
    assert cli("upload", str(sealed), f"{backend.url}/copy-src", *options).returncode == 0
    proc = cli("copy", f"{backend.url}/copy-src", str(tmp_path / "copied"), "--src-o", options[1])
    assert proc.returncode == 0, proc.stderr
    assert "copied and verified" in proc.stdout
    assert cli("verify", str(tmp_path / "copied"), "--strict").returncode == 0
