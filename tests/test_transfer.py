"""download, upload and copy through the public API, on S3 (moto), GCS (emulator) and local disks."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Backend
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError
from integrity_fs.cli import main
from integrity_fs.transfer import STAGING_MARK

FILES = {
    "model.bin": random.Random(1).randbytes(300_000),
    "optim.bin": random.Random(2).randbytes(70_001),
    "sub/meta.json": b'{"step": 1000}\n',
    "empty": b"",
}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``: POSIX name -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A local, unsealed checkpoint."""
    root = tmp_path / "src" / "step_1000"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture(params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


def uploaded(src: Path, remote: Backend, **kw: object) -> ifs.Manifest:
    return ifs.upload(src, remote.url, storage_options=remote.storage_options, **kw)  # type: ignore[arg-type]


class Recorder(Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int | None] = []
        self.done = 0

    def set_size(self, size: int | None) -> None:
        self.sizes.append(size)

    def relative_update(self, inc: int = 1) -> None:
        self.done += inc


# --------------------------------------------------------------------------- round trips


def test_upload_seals_what_a_local_seal_would_and_download_brings_it_back(
    src: Path, remote: Backend, tmp_path: Path
) -> None:
    up = Recorder()
    manifest = uploaded(src, remote, callback=up)
    assert up.sizes == [sum(map(len, FILES.values()))] and up.done == up.sizes[0]  # manifest not counted
    assert manifest == ifs.seal(src)  # a seal of the same files gives the same manifest
    assert ifs.verify(remote.url, storage_options=remote.storage_options).files_checked == len(FILES)

    down = Recorder()
    dest = tmp_path / "out" / "step_1000"
    report = ifs.download(remote.url, dest, storage_options=remote.storage_options, callback=down)
    assert report.ok and report.files_checked == len(FILES) and report.bytes_checked == up.done
    assert down.sizes == up.sizes and down.done == up.done
    assert tree(dest) == tree(src)  # files and the manifest, byte for byte
    assert sorted(os.listdir(dest.parent)) == ["step_1000"]  # no staging directory left


def test_upload_of_a_sealed_source_checks_it_and_writes_its_manifest_unchanged(src: Path, s3_backend: Backend) -> None:
    ifs.seal(src, granularity="chunk", chunk_size=65536)
    (src / MANIFEST_FILENAME).write_bytes(b" " + (src / MANIFEST_FILENAME).read_bytes())  # not canonical
    (src / "scratch.txt").write_bytes(b"not in the manifest")
    manifest = uploaded(src, s3_backend)
    assert manifest.granularity == "chunk" and manifest.chunk_size == 65536
    assert s3_backend.read(MANIFEST_FILENAME) == (src / MANIFEST_FILENAME).read_bytes()
    assert "scratch.txt" not in s3_backend.listdir()  # only what the manifest vouches for is sent
    ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options, strict=True)


def test_upload_of_a_damaged_sealed_source_raises_and_writes_no_manifest(src: Path, s3_backend: Backend) -> None:
    ifs.seal(src)
    data = bytearray((src / "optim.bin").read_bytes())
    data[70_000] ^= 1
    (src / "optim.bin").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="optim.bin") as info:
        uploaded(src, s3_backend)
    assert [(p.path, p.kind) for p in info.value.report.problems] == [("optim.bin", "mismatch")]
    assert MANIFEST_FILENAME not in s3_backend.listdir()  # the damage is not laundered into a seal


def test_upload_of_a_sealed_source_refuses_other_seal_options(src: Path, s3_backend: Backend) -> None:
    ifs.seal(src)
    with pytest.raises(ValueError, match="granularity"):
        uploaded(src, s3_backend, granularity="chunk")
    assert s3_backend.listdir() == []


def test_copy_s3_to_gcs_writes_the_same_manifest_bytes(src: Path, s3_backend: Backend, gcs_backend: Backend) -> None:
    uploaded(src, s3_backend, granularity="chunk", chunk_size=100_000)
    seen = Recorder()
    report = ifs.copy(
        s3_backend.url,
        gcs_backend.url,
        src_options=s3_backend.storage_options,
        dst_options=gcs_backend.storage_options,
        callback=seen,
    )
    assert report.ok and report.files_checked == len(FILES) and seen.done == sum(map(len, FILES.values()))
    assert gcs_backend.read(MANIFEST_FILENAME) == s3_backend.read(MANIFEST_FILENAME)
    ifs.verify(gcs_backend.url, storage_options=gcs_backend.storage_options, strict=True)


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_uploads_and_copies_to_s3_are_attestable(src: Path, s3_backend: Backend, granularity: str) -> None:
    """SPEC "Attested verification": what upload and copy write to S3 carries S3-checked SHA-256 checksums."""
    chunk_size = None
    if granularity == "chunk":
        chunk_size = 5 * 2**20  # S3's smallest part: a 2-chunk file goes up in 2 parts of exactly a chunk
        (src / "big.bin").write_bytes(random.Random(4).randbytes(chunk_size + 10))
    files = len(list(p for p in src.rglob("*") if p.is_file()))
    uploaded(src, s3_backend, granularity=granularity, chunk_size=chunk_size)
    report = ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True)
    assert report.files_attested == files and report.bytes_checked == 0
    copy_url = f"{s3_backend.url}-copy"
    ifs.copy(s3_backend.url, copy_url, src_options=s3_backend.storage_options, dst_options=s3_backend.storage_options)
    again = ifs.verify(copy_url, storage_options=s3_backend.storage_options, attested=True)
    assert again.files_attested == files and again.bytes_checked == 0


def test_copy_local_to_local(src: Path, tmp_path: Path) -> None:
    ifs.seal(src)
    (src / "scratch.txt").write_bytes(b"x")
    report = ifs.copy(src, tmp_path / "copy")
    assert report.extra == ("scratch.txt",)
    assert tree(tmp_path / "copy") == {k: v for k, v in tree(src).items() if k != "scratch.txt"}


def test_a_checkpoint_of_no_files_copies_and_uploads_to_a_new_local_directory(tmp_path: Path) -> None:
    """No file write creates the destination directory: the manifest's write must (it is intact)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    manifest = ifs.upload(empty, tmp_path / "up" / "step_0")  # unsealed: sealed on the way
    assert manifest.files == {}
    assert os.listdir(tmp_path / "up" / "step_0") == [MANIFEST_FILENAME]
    report = ifs.copy(tmp_path / "up" / "step_0", tmp_path / "copy" / "step_0")  # sealed
    assert report.ok and report.files_checked == 0
    assert tree(tmp_path / "copy" / "step_0") == tree(tmp_path / "up" / "step_0")
    ifs.seal(empty)
    ifs.upload(empty, tmp_path / "sealed_up")
    ifs.verify(tmp_path / "sealed_up", strict=True)


# --------------------------------------------------------------------------- damage on the way


def test_download_of_a_corrupted_object_raises_and_leaves_nothing(src: Path, remote: Backend, tmp_path: Path) -> None:
    uploaded(src, remote)
    remote.corrupt("model.bin", offset=123_456)
    dest = tmp_path / "out" / "step_1000"
    with pytest.raises(IntegrityError, match="model.bin"):
        ifs.download(remote.url, dest, storage_options=remote.storage_options)
    assert not (tmp_path / "out").exists()  # not dest, no staging, not even the parent it created


def test_download_of_a_file_that_changed_size_is_refused_before_any_copy(
    src: Path, s3_backend: Backend, tmp_path: Path
) -> None:
    uploaded(src, s3_backend)
    s3_backend.write("optim.bin", FILES["optim.bin"] + b"!")
    seen = Recorder()
    with pytest.raises(IntegrityError, match="optim.bin: size"):
        ifs.download(s3_backend.url, tmp_path / "d", storage_options=s3_backend.storage_options, callback=seen)
    assert seen.done == 0 and os.listdir(tmp_path) == ["src"]


def test_copy_of_a_corrupted_source_writes_no_manifest(src: Path, s3_backend: Backend, gcs_backend: Backend) -> None:
    uploaded(src, s3_backend)
    s3_backend.corrupt("sub/meta.json")
    with pytest.raises(IntegrityError, match="sub/meta.json"):
        ifs.copy(
            s3_backend.url,
            gcs_backend.url,
            src_options=s3_backend.storage_options,
            dst_options=gcs_backend.storage_options,
        )
    assert MANIFEST_FILENAME not in gcs_backend.listdir()


def test_unsealed_source_is_manifest_not_found_and_nothing_is_written(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ManifestNotFoundError):
        ifs.download(src, tmp_path / "d")
    with pytest.raises(ManifestNotFoundError):
        ifs.copy(src, tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["src"]


# --------------------------------------------------------------------------- refusals and dest rules


def test_upload_and_copy_refuse_a_sealed_destination_unless_overwrite(src: Path, s3_backend: Backend) -> None:
    uploaded(src, s3_backend)
    with pytest.raises(FileExistsError, match="already holds a sealed checkpoint"):
        uploaded(src, s3_backend)
    ifs.seal(src)
    with pytest.raises(FileExistsError):
        ifs.copy(src, s3_backend.url, dst_options=s3_backend.storage_options)
    (src / MANIFEST_FILENAME).unlink()
    (src / "model.bin").write_bytes(b"new weights")
    manifest = uploaded(src, s3_backend, overwrite=True)
    assert manifest.sizes is not None and manifest.sizes["model.bin"] == len(b"new weights")
    ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options)


def test_failed_overwrite_leaves_the_destination_unsealed(src: Path, s3_backend: Backend) -> None:
    """The old manifest goes first; the files the failed upload wrote (over old ones of the same
    names too) are deleted; the old files it never touched stay."""
    (src / "old-only.bin").write_bytes(b"only in the old checkpoint")
    uploaded(src, s3_backend)
    (src / "old-only.bin").unlink()
    ifs.seal(src)
    (src / "optim.bin").write_bytes(b"X" + FILES["optim.bin"][1:])
    with pytest.raises(IntegrityError):
        uploaded(src, s3_backend, overwrite=True, max_workers=1)
    with pytest.raises(ManifestNotFoundError):  # never the old manifest over a mix of old and new files
        ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options)
    assert s3_backend.listdir() == ["old-only.bin"]


@pytest.mark.parametrize("kind", ["non-empty dir", "file", "symlink to empty dir", "dangling symlink"])
def test_download_refuses_an_occupied_dest_and_leaves_it_alone(src: Path, tmp_path: Path, kind: str) -> None:
    ifs.seal(src)
    dest = tmp_path / "dest"
    empty = tmp_path / "empty"
    empty.mkdir()
    if kind == "non-empty dir":
        dest.mkdir()
        (dest / "keep.txt").write_text("mine")
    elif kind == "file":
        dest.write_text("mine")
    elif kind == "symlink to empty dir":
        dest.symlink_to(empty)
    else:
        dest.symlink_to(tmp_path / "nowhere")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileExistsError):
        ifs.download(src, dest)
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(empty) == []
    if kind == "non-empty dir":
        assert os.listdir(dest) == ["keep.txt"]


def test_download_into_an_empty_dir_fills_it_or_leaves_it_empty(src: Path, tmp_path: Path) -> None:
    ifs.seal(src)
    dest = tmp_path / "dest"
    dest.mkdir()
    (src / "model.bin").write_bytes(b"X" + FILES["model.bin"][1:])
    with pytest.raises(IntegrityError):
        ifs.download(src, dest)
    assert os.listdir(dest) == [] and sorted(os.listdir(tmp_path)) == ["dest", "src"]
    (src / "model.bin").write_bytes(FILES["model.bin"])
    ifs.download(src, dest)
    assert tree(dest) == tree(src)


def test_download_into_an_empty_dir_keeps_that_dir_and_writes_nothing_beside_it(src: Path, tmp_path: Path) -> None:
    """An empty DEST may be a mount point (a rename onto it is EBUSY, and staging beside it fills
    another disk) or sit in a parent we cannot write: the files are staged inside it."""
    ifs.seal(src)
    dest = tmp_path / "mnt"
    dest.mkdir()
    before = os.stat(dest)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = dest / f".mnt{STAGING_MARK}{int(dead.stdout)}-0123456789ab-{socket.gethostname()}"
    (stale / "sub").mkdir(parents=True)  # a download into this directory that was killed
    beside: list[list[str]] = []

    class Watch(Recorder):
        def relative_update(self, inc: int = 1) -> None:
            beside.append(sorted(os.listdir(tmp_path)))

    ifs.download(src, dest, callback=Watch())
    assert beside and all(names == ["mnt", "src"] for names in beside)
    after = os.stat(dest)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)  # the same directory, filled
    assert tree(dest) == tree(src) and not stale.exists()


def test_stale_staging_of_a_killed_download_is_removed_by_the_next(src: Path, tmp_path: Path) -> None:
    ifs.seal(src)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = tmp_path / f".dest{STAGING_MARK}{int(dead.stdout)}-0123456789ab-{host}"
    live = tmp_path / f".dest{STAGING_MARK}{os.getpid()}-0123456789ab-{host}"  # a download still running
    other = tmp_path / f".other{STAGING_MARK}{int(dead.stdout)}-0123456789ab-{host}"  # another DEST's
    for d in (stale, live, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "partial.bin").write_bytes(b"half")
    ifs.download(src, tmp_path / "dest")
    assert not stale.exists() and live.exists() and other.exists()


def test_strict_download_fails_on_files_the_manifest_does_not_list(
    src: Path, s3_backend: Backend, tmp_path: Path
) -> None:
    uploaded(src, s3_backend)
    s3_backend.write("stray.bin", b"stray")
    with pytest.raises(IntegrityError, match="stray.bin: extra"):
        ifs.download(s3_backend.url, tmp_path / "strict", storage_options=s3_backend.storage_options, strict=True)
    assert not (tmp_path / "strict").exists()
    report = ifs.download(s3_backend.url, tmp_path / "lax", storage_options=s3_backend.storage_options)
    assert report.extra == ("stray.bin",) and not (tmp_path / "lax" / "stray.bin").exists()


@pytest.mark.parametrize("first", ["file", "folder"])
def test_a_file_and_a_folder_of_one_name_are_refused_before_anything_is_transferred(
    s3_backend: Backend, tmp_path: Path, first: str
) -> None:
    """S3 holds a key ``sub`` and a key ``sub/x``, which seal and verify; a local directory cannot
    hold both: a ValueError naming both, not an IsADirectoryError naming the staging
    directory, and nothing read or written."""
    big, small = (b"a larger object, written first", b"small") if first == "file" else (b"s", b"a larger object")
    s3_backend.write("sub", big)
    s3_backend.write("sub/x", small)
    s3_backend.write("other.bin", b"other")
    names = ("sub", "sub/x", "other.bin")
    files = {name: hashlib.sha256(s3_backend.read(name)).hexdigest() for name in names}
    sizes = {name: len(s3_backend.read(name)) for name in names}
    s3_backend.write(MANIFEST_FILENAME, ifs.Manifest(files=files, sizes=sizes).to_json())  # seal refuses such a tree
    for how in ("download", "copy"):
        seen = Recorder()
        with pytest.raises(ValueError, match=r"'sub'.*'sub/x'"):
            if how == "download":
                ifs.download(s3_backend.url, tmp_path / "d", storage_options=s3_backend.storage_options, callback=seen)
            else:
                ifs.copy(s3_backend.url, tmp_path / "d", src_options=s3_backend.storage_options, callback=seen)
        assert seen.sizes == [] and os.listdir(tmp_path) == []
    copied = f"{s3_backend.url}-copy"  # object store to object store: both names are fine there
    options = s3_backend.storage_options
    assert ifs.copy(s3_backend.url, copied, src_options=options, dst_options=options).files_checked == 3


def test_a_file_where_the_destination_needs_a_directory_is_an_io_error_not_a_refusal(src: Path, tmp_path: Path) -> None:
    """os.makedirs says FileExistsError, which the CLI reports as a refused DEST (exit 2, "--force").
    The files already copied are deleted; the file in the way, which was there before, stays."""
    ifs.seal(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "sub").write_bytes(b"in the way of sub/meta.json")
    err_stream = io.StringIO()  # not capsys: main() leaves its log handler on this stream
    with contextlib.redirect_stderr(err_stream), contextlib.redirect_stdout(io.StringIO()):
        assert main(["copy", str(src), str(dst), "--workers", "1"]) == 4
    err = err_stream.getvalue()
    assert "is a file, not a directory" in err and "--force" not in err and "failed 3 times" not in err
    assert tree(dst) == {"sub": b"in the way of sub/meta.json"}  # model.bin, optim.bin were copied first


def test_download_dest_must_be_local(src: Path, s3_backend: Backend) -> None:
    ifs.seal(src)
    with pytest.raises(ValueError, match="must be a local path"):
        ifs.download(src, s3_backend.url)


def test_seed_manifest_is_copied_as_written(src: Path, tmp_path: Path) -> None:
    ifs.seal(src)
    seed = json.loads((src / MANIFEST_FILENAME).read_bytes())
    del seed["sizes"]
    raw = json.dumps(seed).encode()  # one line, no sizes: as a seed-era writer might
    (src / MANIFEST_FILENAME).write_bytes(raw)
    ifs.download(src, tmp_path / "d")
    assert (tmp_path / "d" / MANIFEST_FILENAME).read_bytes() == raw


def test_a_signature_travels_with_the_checkpoint(src: Path, s3_backend: Backend, tmp_path: Path) -> None:
    """model.sig is not content (never listed), so the transfers carry it themselves."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "key.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    ifs.seal(src, private_key=key)
    uploaded(src, s3_backend)
    ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options, public_key=str(public))
    ifs.download(s3_backend.url, tmp_path / "down", storage_options=s3_backend.storage_options)
    ifs.copy(tmp_path / "down", tmp_path / "copy")
    for root in (tmp_path / "down", tmp_path / "copy"):
        ifs.verify(root, public_key=str(public), strict=True)
    (src / MANIFEST_FILENAME).unlink()
    (src / ifs.SIGNATURE_FILENAME).unlink()
    uploaded(src, s3_backend, overwrite=True)  # sealed anew from the bytes sent: the old signature must go
    assert ifs.SIGNATURE_FILENAME not in s3_backend.listdir()


def test_signed_upload_verifies_with_the_public_key(src: Path, s3_backend: Backend, tmp_path: Path) -> None:
    """upload(private_key=) signs what it sends (issue 16): sealed from the bytes sent, or the
    checked source manifest, whose old signature (another key) is replaced, not copied."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    def keypair(name: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public

    ours, theirs = keypair("ours"), keypair("theirs")
    options = s3_backend.storage_options
    with pytest.raises(ValueError, match="cannot read the key file"):
        uploaded(src, s3_backend, private_key=str(tmp_path / "no-such.pem"))
    assert s3_backend.listdir() == []  # the bad key stopped it before anything was written

    uploaded(src, s3_backend, granularity="chunk", chunk_size=65536, private_key=str(ours[0]))
    assert ifs.SIGNATURE_FILENAME in s3_backend.listdir()
    assert ifs.verify(s3_backend.url, storage_options=options, public_key=str(ours[1]), strict=True).ok
    with pytest.raises(ifs.SignatureError):
        ifs.verify(s3_backend.url, storage_options=options, public_key=str(theirs[1]))

    ifs.seal(src, private_key=str(theirs[0]))  # a sealed source, signed by another key
    uploaded(src, s3_backend, overwrite=True, private_key=str(ours[0]))
    assert ifs.verify(s3_backend.url, storage_options=options, public_key=str(ours[1])).ok
    with pytest.raises(ifs.SignatureError):
        ifs.verify(s3_backend.url, storage_options=options, public_key=str(theirs[1]))


@pytest.mark.parametrize("how", ["download", "copy", "upload"])
def test_a_destination_inside_the_local_source_is_refused_and_the_source_left_alone(src: Path, how: str) -> None:
    if how != "upload":
        ifs.seal(src)
    before = tree(src)
    inside = src / "sub" / "copy"
    with pytest.raises(ValueError, match="overlap"):
        getattr(ifs, how)(src, inside)
    assert tree(src) == before
    assert sorted(p.name for p in src.rglob("*") if p.is_dir()) == ["sub"]


def test_the_transfer_contract_end_to_end(src: Path, s3_backend: Backend, tmp_path: Path) -> None:
    """SPEC "Transfer": callbacks count file content only (not the manifest, not model.sig), over
    all three; upload of a sealed source carries its model.sig unchanged; upload(overwrite=True)
    removes the old manifest and model.sig before it sends a byte."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric import ec

    content = sum(map(len, FILES.values()))
    ifs.seal(src, private_key=ec.generate_private_key(ec.SECP256R1()))
    signature = (src / ifs.SIGNATURE_FILENAME).read_bytes()
    options = s3_backend.storage_options
    seen = {how: Recorder() for how in ("upload", "download", "copy")}
    uploaded(src, s3_backend, callback=seen["upload"])
    assert s3_backend.read(ifs.SIGNATURE_FILENAME) == signature
    ifs.download(s3_backend.url, tmp_path / "down", storage_options=options, callback=seen["download"])
    ifs.copy(s3_backend.url, tmp_path / "copy", src_options=options, callback=seen["copy"])
    for how, recorder in seen.items():
        assert recorder.sizes == [content] and recorder.done == content, how
    for root in (tmp_path / "down", tmp_path / "copy"):
        assert (root / ifs.SIGNATURE_FILENAME).read_bytes() == signature

    at_start: list[list[str]] = []

    class Look(Recorder):
        def set_size(self, size: int | None) -> None:
            at_start.append(s3_backend.listdir())
            super().set_size(size)

        def relative_update(self, inc: int = 1) -> None:
            if len(at_start) == 1:
                at_start.append(s3_backend.listdir())
            super().relative_update(inc)

    (src / MANIFEST_FILENAME).unlink()
    (src / ifs.SIGNATURE_FILENAME).unlink()
    uploaded(src, s3_backend, overwrite=True, callback=Look())
    assert all(MANIFEST_FILENAME not in names and ifs.SIGNATURE_FILENAME not in names for names in at_start)
    assert len(at_start) == 2 and set(at_start[0]) == set(FILES)  # the old files are still there, unsealed
    assert sorted(s3_backend.listdir()) == sorted([*FILES, MANIFEST_FILENAME])
