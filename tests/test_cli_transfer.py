"""The download, upload and copy commands (in-process main(argv)), on local paths and S3 (moto)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import FILES, TIMEOUT_S, cli, error_lines, sha256
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
    assert "not an empty folder" in error_lines(proc)[0]
    assert os.listdir(dest) == ["keep.txt"]


#: In a private mount namespace (``unshare --mount --map-root-user``: no root needed where user
#: namespaces are allowed), a 128 KiB tmpfs over ``$0``, then the command; then what ``$0`` holds.
_ON_A_TINY_DISK = 'mount -t tmpfs -o size=128k tmpfs "$0" 2>/dev/null || exit 77; "$@"; code=$?; ls -A "$0"; exit $code'


def test_download_onto_a_full_disk_exits_4_with_the_disk_hint_after_one_attempt(sealed: Path, tmp_path: Path) -> None:
    """A real ENOSPC from a real filesystem: ``download`` of a 400 KB checkpoint into a 128 KiB
    tmpfs. A full disk is never retried (``--debug`` logs every retry), and the CLI gets the
    ``errno`` that says so."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [sys.executable, "-m", "integrity_fs", "--debug", "download", str(sealed), str(disk / "d")]
    try:
        proc = subprocess.run(
            ["unshare", "--mount", "--map-root-user", "sh", "-c", _ON_A_TINY_DISK, str(disk), *command],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        pytest.skip("needs unshare (util-linux)")
    if proc.returncode == 77 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 4, proc.stderr
    [error] = error_lines(proc)
    assert error.endswith("[Errno 28] No space left on device"), error
    names = [p.relative_to(sealed).as_posix() for p in sealed.rglob("*") if p.is_file()]
    assert any(f"/{name}: [Errno 28]" in error for name in names), error  # the file the disk had no room for
    assert "integrity-fs: hint: the disk is full" in proc.stderr
    assert "retrying" not in proc.stderr and "times:" not in error  # one attempt
    assert proc.stdout == ""  # nothing left on the disk: no DEST, no staging directory


# --- upload ------------------------------------------------------------------------------------------


def test_upload_then_verify(ckpt: Path, s3_backend: Backend, s3_endpoint: str) -> None:
    options = ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
    proc = cli("upload", str(ckpt), s3_backend.url, "--granularity", "chunk", "--chunk-size", "64K", *options)
    assert proc.returncode == 0, proc.stderr
    # 64 KiB chunks are parts S3 refuses: sent as plain streams, and nothing is recorded beside the manifest.
    assert s3_backend.listdir() == sorted([*FILES, MANIFEST_FILENAME])
    assert all(s3_backend.read(name) == data for name, data in FILES.items())
    manifest = json.loads(s3_backend.read(MANIFEST_FILENAME))
    assert manifest["granularity"] == "chunk" and len(manifest["chunks"]["model.bin"]) == 5
    assert manifest["files"]["sub/meta.json"] != sha256(FILES["sub/meta.json"])  # a chunk-derived digest
    assert cli("verify", s3_backend.url, "--strict", *options).returncode == 0

    again = cli("upload", str(ckpt), s3_backend.url, *options)
    assert again.returncode == 2 and "already sealed" in error_lines(again)[0] and "--force" in again.stderr


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


# --- the destination: links, and --force ------------------------------------------------------------


@pytest.mark.parametrize("command", ["copy", "upload", "download"])
def test_a_link_at_the_destination_is_refused_and_nothing_outside_changes(
    sealed: Path, tmp_path: Path, command: str
) -> None:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.bin").write_bytes(b"not the transfer's")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.bin").symlink_to(outside / "victim.bin")
    (dst / "sub").symlink_to(outside / "dir", target_is_directory=True)
    proc = cli(command, str(sealed), str(dst))
    assert proc.returncode == 2
    if command == "download":
        assert "not an empty folder" in error_lines(proc)[0]
    else:  # the first link met is named
        assert re.search(f"{re.escape(str(dst))}/(model.bin|sub) .*link", error_lines(proc)[0]), proc.stderr
    assert (outside / "victim.bin").read_bytes() == b"not the transfer's"
    assert sorted(p.name for p in outside.rglob("*")) == ["dir", "victim.bin"]
    assert sorted(os.listdir(dst)) == ["model.bin", "sub"] and (dst / "sub").is_symlink()


def test_failed_copy_force_leaves_the_old_checkpoint_verifying(
    sealed: Path, s3: tuple[Backend, list[str]], tmp_path: Path
) -> None:
    backend, options = s3
    assert cli("seal", backend.url, *options).returncode == 0
    old = {name: backend.read(name) for name in backend.listdir()}
    (sealed / "sub" / "meta.json").write_bytes(b'{"step": 9999}\n')  # damaged: found once the rest was sent
    proc = cli("copy", str(sealed), backend.url, "--force", "--workers", "1", *options)
    assert proc.returncode == 1 and "sub/meta.json" in error_lines(proc)[0]
    assert {name: backend.read(name) for name in backend.listdir()} == old
    assert cli("verify", backend.url, "--strict", *options).returncode == 0


def test_failed_upload_force_leaves_the_old_checkpoint_verifying(sealed: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    assert cli("upload", str(sealed), str(dst)).returncode == 0
    old = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    (sealed / "sub" / "meta.json").write_bytes(b'{"step": 9999}\n')  # damaged: found once the rest was sent
    proc = cli("upload", str(sealed), str(dst), "--force", "--workers", "1")
    assert proc.returncode == 1 and "sub/meta.json" in error_lines(proc)[0]
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == old
    assert cli("verify", str(dst), "--strict").returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "step_1000"]  # no staging folder left beside it


def test_upload_force_leaves_exactly_the_new_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    (ckpt / "old-only.bin").write_bytes(b"only in the old checkpoint")
    assert cli("upload", str(ckpt), str(dst)).returncode == 0
    (ckpt / "old-only.bin").unlink()
    (ckpt / "model.bin").write_bytes(b"new weights")
    assert cli("upload", str(ckpt), str(dst)).returncode == 2
    assert cli("upload", str(ckpt), str(dst), "--force").returncode == 0
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == sorted([*FILES, MANIFEST_FILENAME])
    assert (dst / "model.bin").read_bytes() == b"new weights"
    assert cli("verify", str(dst), "--strict").returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "step_1000"]  # no staging folder left beside it
