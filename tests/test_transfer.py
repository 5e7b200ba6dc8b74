"""download, upload and copy through the public API, on local disks, memory, S3 (moto) and GCS (the
emulator): round trips, damage and changes on the way (exactly the sealed bytes, each read
confirming the end of the source), the destination's rules, signatures, retries, and a failure or
a stop that ends every worker at once and leaves nothing of ours behind."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import BUCKET, Backend, backends, sigint_as_in_a_terminal
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more
#: What a staging folder's name holds (SPEC "Transfer": ``.<dest name>.integrity-fs-staging-<token>``).
STAGING_MARK = ".integrity-fs-staging-"
LEASE = "_integrity_lease.json"  # a live transfer holds an exclusive flock on it (BRIEF: liveness)

# --- round trips: upload, download, copy -------------------------------------------------------------


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


remote = backends("s3", "gcs")


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


def test_copy_local_to_local_leaves_out_files_the_manifest_does_not_list(src: Path, tmp_path: Path) -> None:
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


# --- damage on the way: refused, nothing written -----------------------------------------------------


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


# --- exactly the sealed bytes: a source that changes meanwhile ---------------------------------------


class _OnStart(Callback):  # type: ignore[misc]
    """Runs ``action`` after the listing, just before the first byte is read (``set_size``)."""

    def __init__(self, action: Callable[[], None]) -> None:
        super().__init__()
        self.action = action

    def set_size(self, size: int) -> None:
        self.action()
        super().set_size(size)


def _rewrite(backend: Backend, name: str, data: bytes | None) -> Callable[[], None]:
    """Rewrites (``None``: deletes) ``name`` as another writer would: through its own filesystem
    instance, so that the listing cached by the transfer's instance is not dropped."""
    if backend.name in ("local", "memory"):
        return lambda: backend.remove(name) if data is None else backend.write(name, data)
    other = fsspec.filesystem(backend.fs.protocol[0], skip_instance_cache=True, **backend.storage_options)
    return lambda: other.rm_file(backend.path(name)) if data is None else other.pipe_file(backend.path(name), data)


def _sealed(backend: Backend, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        backend.write(name, data)
    ifs.seal(backend.url, storage_options=backend.storage_options)


DATA = os.urandom(2500)


@pytest.mark.parametrize("change", ["grew", "shrank"])
def test_download_of_a_source_that_changed_after_the_listing_is_a_file_changed_error(
    backend: Backend, tmp_path: Path, change: str
) -> None:
    """Each source read is pinned to the version listed: a file rewritten meanwhile is refused
    (never copied as a mix of versions), and nothing lands at DEST."""
    _sealed(backend, {"a.bin": DATA, "b.bin": b"steady"})
    new = DATA + b"appended" if change == "grew" else DATA[:2000]
    dest = tmp_path / "out" / "dest"
    with pytest.raises(ifs.FileChangedError, match=r"a\.bin"):
        ifs.download(
            backend.url,
            dest,
            storage_options=backend.storage_options,
            callback=_OnStart(_rewrite(backend, "a.bin", new)),
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["grew", "shrank"])
def test_copy_of_a_source_that_changed_after_the_listing_is_a_file_changed_error(
    backend: Backend, s3_backend: Backend, change: str
) -> None:
    _sealed(backend, {"a.bin": DATA, "b.bin": b"steady"})
    new = DATA + b"appended" if change == "grew" else DATA[:2000]
    with pytest.raises(ifs.FileChangedError, match=r"a\.bin"):
        ifs.copy(
            backend.url,
            s3_backend.url,
            src_options=backend.storage_options,
            dst_options=s3_backend.storage_options,
            callback=_OnStart(_rewrite(backend, "a.bin", new)),
        )
    assert MANIFEST_FILENAME not in s3_backend.listdir()


@pytest.mark.parametrize("change", ["grew", "shrank"])
def test_upload_of_a_sealed_source_that_changed_is_a_file_changed_error(
    tmp_path: Path, gcs_backend: Backend, change: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(DATA)
    ifs.seal(src)
    new = DATA + b"appended" if change == "grew" else DATA[:2000]
    with pytest.raises(ifs.FileChangedError, match=r"a\.bin"):
        ifs.upload(
            src,
            gcs_backend.url,
            storage_options=gcs_backend.storage_options,
            callback=_OnStart(lambda: (src / "a.bin").write_bytes(new)),
        )
    assert MANIFEST_FILENAME not in gcs_backend.listdir()


def test_a_transfer_reads_no_more_than_the_sealed_bytes(tmp_path: Path) -> None:
    """A file that grew by far more than a block is refused after one more byte, not copied whole."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(DATA)
    ifs.seal(src)
    seen: list[int] = []

    class Count(_OnStart):
        def relative_update(self, inc: int = 1) -> None:
            seen.append(inc)

    with pytest.raises(ifs.FileChangedError):
        ifs.copy(src, tmp_path / "dst", callback=Count(lambda: (src / "a.bin").write_bytes(DATA + os.urandom(2**22))))
    assert sum(seen) <= len(DATA)


def test_unsealed_upload_refuses_a_file_that_grew_while_it_was_sent(tmp_path: Path, s3_backend: Backend) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(DATA)
    with pytest.raises(OSError, match=r"a\.bin"):
        ifs.upload(
            src,
            s3_backend.url,
            storage_options=s3_backend.storage_options,
            callback=_OnStart(lambda: (src / "a.bin").write_bytes(DATA + b"more")),
        )
    assert MANIFEST_FILENAME not in s3_backend.listdir()


def test_a_source_file_deleted_after_the_listing_is_a_file_changed_error(s3_backend: Backend, tmp_path: Path) -> None:
    """Deleted after the listing saw it: a change, not damage (SPEC "Verified reads"; issue 36,
    finding 19): ``FileChangedError`` naming it, and nothing at DEST."""
    _sealed(s3_backend, {"a.bin": DATA, "b.bin": b"steady"})
    with pytest.raises(ifs.FileChangedError, match=r"a\.bin"):
        ifs.download(
            s3_backend.url,
            tmp_path / "d",
            storage_options=s3_backend.storage_options,
            callback=_OnStart(_rewrite(s3_backend, "a.bin", None)),
        )
    assert os.listdir(tmp_path) == []


# --- only regular files are sent ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_upload_skips_a_fifo_with_a_warning_and_never_opens_it(
    tmp_path: Path, s3_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "w.bin").write_bytes(b"weights")
    os.mkfifo(src / "sub" / "pipe")  # opened for reading, it would wait for a writer forever
    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        manifest = ifs.upload(src, s3_backend.url, storage_options=s3_backend.storage_options)
    assert sorted(manifest.files) == ["w.bin"]
    assert "sub/pipe" in caplog.text and "not a regular file" in caplog.text
    assert s3_backend.listdir() == [MANIFEST_FILENAME, "w.bin"]


@pytest.mark.timeout(30)
def test_a_sealed_file_turned_into_a_fifo_is_never_opened(tmp_path: Path, s3_backend: Backend) -> None:
    """Replaced by a FIFO after the listing: a change (``FileChangedError``), no manifest sent;
    a FIFO already at the listing is not a file of the checkpoint: its file is missing."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(DATA)
    (src / "b.bin").write_bytes(b"steady")
    ifs.seal(src)

    def swap() -> None:
        (src / "a.bin").unlink()
        os.mkfifo(src / "a.bin")

    with pytest.raises(ifs.FileChangedError, match=r"a\.bin"):
        ifs.upload(src, s3_backend.url, storage_options=s3_backend.storage_options, callback=_OnStart(swap))
    assert MANIFEST_FILENAME not in s3_backend.listdir()
    with pytest.raises(IntegrityError) as err:  # already a FIFO at the listing: missing as well
        ifs.copy(src, tmp_path / "copy")
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("a.bin", "missing")]


# --- the destination: refusals, empty directories, staging -------------------------------------------


def test_upload_and_copy_refuse_a_sealed_destination_unless_overwrite(src: Path, s3_backend: Backend) -> None:
    uploaded(src, s3_backend)
    with pytest.raises(FileExistsError, match="already sealed"):
        uploaded(src, s3_backend)
    ifs.seal(src)
    with pytest.raises(FileExistsError):
        ifs.copy(src, s3_backend.url, dst_options=s3_backend.storage_options)
    (src / MANIFEST_FILENAME).unlink()
    (src / "model.bin").write_bytes(b"new weights")
    manifest = uploaded(src, s3_backend, overwrite=True)
    assert manifest.sizes is not None and manifest.sizes["model.bin"] == len(b"new weights")
    ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options)


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
    stale, _ = _staging_folder(dest, "mnt", live=False)  # a download into this directory that was killed
    beside: list[list[str]] = []

    class Watch(Recorder):
        def relative_update(self, inc: int = 1) -> None:
            beside.append(sorted(os.listdir(tmp_path)))

    ifs.download(src, dest, callback=Watch())
    assert beside and all(names == ["mnt", "src"] for names in beside)
    after = os.stat(dest)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)  # the same directory, filled
    assert tree(dest) == tree(src) and not stale.exists()


def _staging_folder(where: Path, dest: str, *, live: bool) -> tuple[Path, Any]:
    """A staging folder of a download to ``dest`` as SPEC "Transfer" names it, holding a partial
    file and its lease: ``live``, its lease locked (``fcntl.flock``) as a running transfer holds
    it (the open file is returned: closing it, or this process ending, releases the lock)."""
    folder = where / f".{dest}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "partial.bin").write_bytes(b"half")
    lease = open(folder / LEASE, "w")  # noqa: SIM115
    if live:
        fcntl.flock(lease, fcntl.LOCK_EX)
    else:
        lease.close()
    return folder, lease


def test_stale_staging_of_a_killed_download_is_removed_by_the_next(src: Path, tmp_path: Path) -> None:
    """The next download to ``dest`` removes the leftover of a killed one (its lease not held),
    never a live one's (held), nor another destination's."""
    ifs.seal(src)
    stale, _ = _staging_folder(tmp_path, "dest", live=False)
    live, held = _staging_folder(tmp_path, "dest", live=True)
    other, _ = _staging_folder(tmp_path, "other", live=False)
    try:
        ifs.download(src, tmp_path / "dest")
    finally:
        held.close()
    assert not stale.exists() and live.exists() and other.exists()
    assert ifs.verify(tmp_path / "dest").ok


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


def test_a_file_where_the_destination_needs_a_directory_is_refused_before_anything_is_written(
    src: Path, tmp_path: Path
) -> None:
    """A local disk cannot hold the file ``sub`` that is there and the new folder ``sub/``: the
    copy is refused (ValueError naming it, as for a forced transfer: SPEC "Transfer", every
    precondition before the first change), nothing is written, the file in the way stays."""
    ifs.seal(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "sub").write_bytes(b"in the way of sub/meta.json")
    seen = Recorder()
    with pytest.raises(ValueError, match=str(dst / "sub")):
        ifs.copy(src, dst, max_workers=1, callback=seen)
    assert seen.done == 0
    assert tree(dst) == {"sub": b"in the way of sub/meta.json"}


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


# --- overlap: source and destination judged by where the bytes live ----------------------------------


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


def _signed_at(backend: Backend, tmp_path: Path) -> dict[str, bytes]:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric import ec

    backend.write("w.bin", DATA)
    backend.write("sub/x.bin", b"x")
    ifs.seal(backend.url, storage_options=backend.storage_options, private_key=ec.generate_private_key(ec.SECP256R1()))
    return {name: backend.read(name) for name in backend.listdir()}


@pytest.mark.parametrize("into", ["itself", "a prefix inside"])
def test_copy_onto_its_own_prefix_through_other_options_is_refused(backend: Backend, tmp_path: Path, into: str) -> None:
    """One extra option gives another filesystem object for the same store: still the same store,
    so refused, and (overwrite) the source's manifest and model.sig are not deleted."""
    before = _signed_at(backend, tmp_path)
    extra = {
        "s3": {"default_block_size": 2**22},
        "gcs": {"default_block_size": 2**22},
        "memory": {"skip_instance_cache": True},
        "local": {"auto_mkdir": True},
    }[backend.name]
    dst = backend.url if into == "itself" else f"{backend.url}/sub/copy"
    with pytest.raises(ValueError, match="overlap"):
        ifs.copy(
            backend.url,
            dst,
            src_options=backend.storage_options,
            dst_options={**backend.storage_options, **extra},
            overwrite=True,
        )
    assert {name: backend.read(name) for name in backend.listdir()} == before


def test_endpoints_name_stores_loopback_aliases_included(s3_backend: Backend, s3_endpoint: str) -> None:
    """``localhost`` and ``127.0.0.1`` are one server; another server (its own process: moto's
    servers in one process share their buckets) is another store, even for the same bucket and key."""
    _sealed(s3_backend, {"w.bin": DATA})
    alias = {
        **s3_backend.storage_options,
        "client_kwargs": {"endpoint_url": s3_endpoint.replace("127.0.0.1", "localhost")},
    }
    with pytest.raises(ValueError, match="overlap"):
        ifs.copy(s3_backend.url, f"{s3_backend.url}/inside", src_options=s3_backend.storage_options, dst_options=alias)
    serve = (
        "import sys; from moto.server import ThreadedMotoServer; s = ThreadedMotoServer(ip_address='127.0.0.1', "
        "port=0, verbose=False); s.start(); print(s.get_host_and_port()[1], flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())
        options = {**s3_backend.storage_options, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        fsspec.filesystem("s3", **options).mkdir(BUCKET)
        report = ifs.copy(s3_backend.url, s3_backend.url, src_options=s3_backend.storage_options, dst_options=options)
        assert report.ok and ifs.verify(s3_backend.url, storage_options=options).ok
    finally:
        other.kill()
        other.wait()


# --- signatures travel with the checkpoint -----------------------------------------------------------


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
    (src / SIGNATURE).unlink()
    uploaded(src, s3_backend, overwrite=True)  # sealed anew from the bytes sent: the old signature must go
    assert SIGNATURE not in s3_backend.listdir()


def test_signed_upload_verifies_with_the_public_key(src: Path, s3_backend: Backend, tmp_path: Path) -> None:
    """upload(private_key=) signs what it sends: sealed from the bytes sent, or the
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
    assert SIGNATURE in s3_backend.listdir()
    assert ifs.verify(s3_backend.url, storage_options=options, public_key=str(ours[1]), strict=True).ok
    with pytest.raises(ifs.SignatureError):
        ifs.verify(s3_backend.url, storage_options=options, public_key=str(theirs[1]))

    ifs.seal(src, private_key=str(theirs[0]))  # a sealed source, signed by another key
    uploaded(src, s3_backend, overwrite=True, private_key=str(ours[0]))
    assert ifs.verify(s3_backend.url, storage_options=options, public_key=str(ours[1])).ok
    with pytest.raises(ifs.SignatureError):
        ifs.verify(s3_backend.url, storage_options=options, public_key=str(theirs[1]))


def test_the_transfer_contract_end_to_end(src: Path, s3_backend: Backend, tmp_path: Path) -> None:
    """SPEC "Transfer": callbacks count file content only (not the manifest, not model.sig), over
    all three; upload of a sealed source carries its model.sig unchanged; upload(overwrite=True)
    leaves the old checkpoint sealed, signature included, while it sends the new one, and then
    leaves exactly the new one."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric import ec

    content = sum(map(len, FILES.values()))
    ifs.seal(src, private_key=ec.generate_private_key(ec.SECP256R1()))
    signature = (src / SIGNATURE).read_bytes()
    options = s3_backend.storage_options
    seen = {how: Recorder() for how in ("upload", "download", "copy")}
    uploaded(src, s3_backend, callback=seen["upload"])
    assert s3_backend.read(SIGNATURE) == signature
    ifs.download(s3_backend.url, tmp_path / "down", storage_options=options, callback=seen["download"])
    ifs.copy(s3_backend.url, tmp_path / "copy", src_options=options, callback=seen["copy"])
    for how, recorder in seen.items():
        assert recorder.sizes == [content] and recorder.done == content, how
    for root in (tmp_path / "down", tmp_path / "copy"):
        assert (root / SIGNATURE).read_bytes() == signature

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
    (src / SIGNATURE).unlink()
    uploaded(src, s3_backend, overwrite=True, callback=Look())
    old = sorted([*FILES, MANIFEST_FILENAME, SIGNATURE])
    assert at_start == [old, old]  # the new files go to a staging folder beside it
    assert sorted(s3_backend.listdir()) == sorted([*FILES, MANIFEST_FILENAME])


# --- retries, as storage's ---------------------------------------------------------------------------


def _fail_gets(
    fs: Any, monkeypatch: pytest.MonkeyPatch, name: str, fail: Callable[[], BaseException | None]
) -> list[str]:
    """Make S3 GETs of ``name`` raise what ``fail()`` returns (``None``: let it through); the keys asked for."""
    calls: list[str] = []
    call_s3 = fs._call_s3

    async def faulty(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and kwargs.get("Key", "").endswith(name):
            calls.append(kwargs["Key"])
            error = fail()
            if error is not None:
                raise error
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", faulty)
    return calls


class _DroppingProxy:
    """A proxy in front of moto that forwards every request, except the first ``drop`` GETs of
    objects whose key ends in ``name``: those connections it closes without an answer (a network
    that drops them). ``gets``: how many GETs of ``name`` it saw."""

    def __init__(self, upstream: str, name: str, drop: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream, self.name, self.drop, self.gets = (host, int(port)), name.encode(), drop, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def options(self, attempts: int) -> dict[str, Any]:
        retries = {"max_attempts": attempts, "mode": "standard"}
        return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint},
                "config_kwargs": {"retries": retries}, "skip_instance_cache": True}  # fmt: skip

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError), client:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            method, target = head.split(b" ", 2)[:2]
            if method == b"GET" and target.split(b"?")[0].endswith(self.name):
                self.gets += 1
                if self.gets <= self.drop:
                    return  # closed unanswered
            head = head.replace(b"\r\n", b"\r\nConnection: close\r\n", 1)
            with socket.create_connection(self.upstream) as upstream:
                upstream.sendall(head)
                pump = threading.Thread(target=StallingProxy._pump, args=(client, upstream), daemon=True)
                pump.start()
                StallingProxy._pump(upstream, client)
                pump.join(5)


def test_transient_source_failures_are_retried_as_storage_does(
    s3_backend: Backend, s3_endpoint: str, tmp_path: Path
) -> None:
    """The network drops the first GET of a.bin: the store's client retries it and the download
    completes, with one GET more."""
    _sealed(s3_backend, {"a.bin": DATA})
    once = _DroppingProxy(s3_endpoint, "a.bin", drop=1)
    report = ifs.download(s3_backend.url, tmp_path / "d", storage_options=once.options(attempts=3))
    assert report.ok and (tmp_path / "d" / "a.bin").read_bytes() == DATA
    assert once.gets == 2
    once.server.close()


def test_a_refused_read_is_not_retried(s3_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _sealed(s3_backend, {"a.bin": DATA})
    calls = _fail_gets(s3_backend.fs, monkeypatch, "a.bin", lambda: PermissionError("access denied"))
    with pytest.raises(PermissionError):
        ifs.download(s3_backend.url, tmp_path / "d", fs=s3_backend.fs)
    assert len(calls) == 1


# --- a failed transfer leaves nothing of its own -----------------------------------------------------


BIG, MID = os.urandom(300_000), os.urandom(70_000)


BIG, MID = os.urandom(300_000), os.urandom(70_000)


def _damaged_source(tmp_path: Path) -> Path:
    """A sealed local checkpoint whose smallest file (copied last, one worker) no longer matches."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(BIG)
    (src / "sub" / "mid.bin").write_bytes(MID)
    (src / "z.txt").write_bytes(b"the last file")
    ifs.seal(src)
    (src / "z.txt").write_bytes(b"the LAST file")
    return src


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_transfer_that_fails_verification_leaves_nothing_of_its_own(
    backend: Backend, tmp_path: Path, how: str
) -> None:
    """The files sent before the damage was found are deleted, on every backend; a file
    that was there before and that the transfer did not touch stays. One that it overwrote is
    deleted too (its old bytes were gone): docs/transfer.md says so."""
    src = _damaged_source(tmp_path)
    backend.write("keep.txt", b"was there before")
    backend.write("sub/mid.bin", b"an old file of the same name")
    with pytest.raises(IntegrityError, match=r"z\.txt"):
        if how == "copy":
            ifs.copy(src, backend.url, dst_options=backend.storage_options, max_workers=1)
        else:
            ifs.upload(src, backend.url, storage_options=backend.storage_options, max_workers=1)
    assert backend.listdir() == ["keep.txt"]
    with pytest.raises(ifs.ManifestNotFoundError):
        ifs.verify(backend.url, storage_options=backend.storage_options)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["copy", "upload"])
def test_ctrl_c_after_some_files_were_written_leaves_nothing(backend: Backend, tmp_path: Path, how: str) -> None:
    src = _damaged_source(tmp_path)
    (src / "z.txt").write_bytes(b"the last file")  # intact: the interruption is what stops it
    if how == "upload":
        (src / MANIFEST_FILENAME).unlink()  # and sealed on the way

    class InterruptInTheSecondFile(Callback):  # type: ignore[misc]
        done = 0

        def relative_update(self, inc: int = 1) -> None:
            self.done += inc
            if self.done > len(BIG):  # big.bin is written (closed), sub/mid.bin on its way
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        if how == "copy":
            ifs.copy(
                src,
                backend.url,
                dst_options=backend.storage_options,
                max_workers=1,
                callback=InterruptInTheSecondFile(),
            )
        else:
            ifs.upload(
                src,
                backend.url,
                storage_options=backend.storage_options,
                max_workers=1,
                callback=InterruptInTheSecondFile(),
            )
    assert backend.listdir() == []


@pytest.mark.parametrize("refused", ["z.txt", SIGNATURE])
def test_a_storage_error_on_the_destination_leaves_nothing(
    s3_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A PUT refused after other files went up (the last file; the signature, written after the
    manifest): what was written is deleted, and the error is the storage's."""
    src = _damaged_source(tmp_path)
    (src / "z.txt").write_bytes(b"the last file")
    if refused == SIGNATURE:
        pytest.importorskip("cryptography")
        from cryptography.hazmat.primitives.asymmetric import ec

        ifs.seal(src, overwrite=True, private_key=ec.generate_private_key(ec.SECP256R1()))
    call_s3 = s3_backend.fs._call_s3

    async def refuse(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "put_object" and kwargs.get("Key", "").endswith(refused):
            raise PermissionError("access denied")
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(s3_backend.fs, "_call_s3", refuse)
    with pytest.raises(PermissionError):
        ifs.copy(src, s3_backend.url, dst_options=s3_backend.storage_options, max_workers=1)
    monkeypatch.undo()
    assert s3_backend.listdir() == []


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_destination_that_is_not_there_is_a_storage_error_never_damage(
    s3_backend: Backend, tmp_path: Path, how: str
) -> None:
    """A bucket that does not exist made every file "missing" (an IntegrityError about the source)."""
    src = _damaged_source(tmp_path)
    (src / "z.txt").write_bytes(b"the last file")
    url = "s3://no-such-bucket-integrity/run"
    with pytest.raises(OSError, match="no-such-bucket-integrity") as err:
        if how == "copy":
            ifs.copy(src, url, dst_options=s3_backend.storage_options)
        else:
            ifs.upload(src, url, storage_options=s3_backend.storage_options)
    assert not isinstance(err.value, IntegrityError)


@pytest.mark.parametrize("layout", ["in folders", "at the top"])
def test_download_whose_staging_directory_is_removed_meanwhile_is_never_ok(tmp_path: Path, layout: str) -> None:
    """The staging directory removed while the first file is written: later files must not
    recreate it (as the folder they go in) with the manifest over them, as if the download were
    OK with DEST holding the manifest and only the files written after the removal."""
    src = tmp_path / "src"
    names = ["a/1.bin", "b/2.bin", "c/3.bin"] if layout == "in folders" else ["1.bin", "2.bin", "3.bin"]
    for i, name in enumerate(names):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(os.urandom(300_000 - i))
    ifs.seal(src)
    dest = tmp_path / "out" / "dest"

    class RemoveStaging(Callback):  # type: ignore[misc]
        removed = False

        def relative_update(self, inc: int = 1) -> None:
            if not self.removed:
                self.removed = True
                (staged,) = [p for p in (tmp_path / "out").iterdir() if STAGING_MARK in p.name]
                shutil.rmtree(staged)

    with pytest.raises(OSError, match="removed or replaced|not there") as err:
        ifs.download(src, dest, max_workers=1, callback=RemoveStaging())
    assert not isinstance(err.value, IntegrityError)
    assert not (tmp_path / "out").exists()


# --- a stop ends every worker at once and leaves nothing ---------------------------------------------


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]


#: Longer than each test's own timeout (60 s): a stalled GET can only end when the proxy closes.
STALLED_READ_TIMEOUT_S = 120


class StallingProxy:
    """A TCP proxy in front of the moto server that forwards every request, except GETs of objects
    whose key ends in ``stall``: those it accepts and never answers (a server that hangs) until it
    is closed, after the test's assertions."""

    def __init__(self, upstream: str, stall: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.stall = stall.encode()
        self.stalled = threading.Event()  # a stalled GET is waiting for its answer
        self.closing = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def options(self) -> dict[str, Any]:
        # A read timeout longer than the test's own: a call that waits for a stalled GET cannot
        # return before the test fails; one that stops returns while the GET is still held here.
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint},
            "config_kwargs": {"read_timeout": STALLED_READ_TIMEOUT_S, "retries": {"max_attempts": 1}},
            "skip_instance_cache": True,
        }

    def close(self) -> None:
        self.closing.set()
        self.server.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            method, target = head.split(b" ", 2)[:2]
            if method == b"GET" and target.split(b"?")[0].endswith(self.stall):
                self.stalled.set()
                self.closing.wait()
                return
            # One request per connection, so that every request goes through this check.
            head = head.replace(b"\r\n", b"\r\nConnection: close\r\n", 1)
            upstream = socket.create_connection(self.upstream)
            self.sockets.append(upstream)
            upstream.sendall(head)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            self._pump(upstream, client)
        with contextlib.suppress(OSError):
            client.close()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)


@pytest.fixture
def stalling(s3_backend: Backend, s3_endpoint: str) -> Iterator[tuple[Backend, StallingProxy]]:
    """A sealed checkpoint on S3 whose ``stalled.bin`` (the largest file, so it starts first) never
    arrives through the proxy, while ``moving.bin`` and ``small.bin`` do."""
    _sealed(s3_backend, {"stalled.bin": os.urandom(3_000_000), "moving.bin": os.urandom(2_500_000), "small.bin": b"x"})
    proxy = StallingProxy(s3_endpoint, "stalled.bin")
    yield s3_backend, proxy
    proxy.close()


class _InterruptOnceStalled(Callback):  # type: ignore[misc]
    """Ctrl-C from the progress callback, once the stalled GET is waiting."""

    def __init__(self, proxy: StallingProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def relative_update(self, inc: int = 1) -> None:
        self.proxy.stalled.wait(30)
        raise KeyboardInterrupt


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_stalled_download_returns_at_once_and_leaves_nothing(
    stalling: tuple[Backend, StallingProxy], tmp_path: Path
) -> None:
    b, proxy = stalling
    with pytest.raises(KeyboardInterrupt):
        ifs.download(
            b.url, tmp_path / "out" / "dest", storage_options=proxy.options(), callback=_InterruptOnceStalled(proxy)
        )
    assert proxy.stalled.is_set() and not proxy.closing.is_set()  # returned while the stalled GET is held
    assert _workers_alive() == []
    assert os.listdir(tmp_path) == []  # no dest, no staging, not the parent it made


@pytest.mark.timeout(60)
def test_the_first_failure_stops_a_stalled_download(stalling: tuple[Backend, StallingProxy], tmp_path: Path) -> None:
    b, proxy = stalling
    fs = fsspec.filesystem("s3", **proxy.options())
    call_s3 = fs._call_s3

    async def deny(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and kwargs.get("Key", "").endswith("moving.bin"):
            while not proxy.stalled.is_set():
                await asyncio.sleep(0.01)
            raise PermissionError("access denied")
        return await call_s3(method, *args, **kwargs)

    fs._call_s3 = deny
    with pytest.raises(PermissionError):
        ifs.download(b.root, tmp_path / "dest", fs=fs, max_workers=3)
    assert proxy.stalled.is_set() and not proxy.closing.is_set()  # returned while the stalled GET is held
    assert _workers_alive() == []
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_ctrl_c_aborts_the_multipart_upload_in_flight(s3_backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(12 * 2**20))
    chunk = 5 * 2**20  # parts of exactly a chunk: the upload is multipart

    class InterruptAfterAPart(Callback):  # type: ignore[misc]
        done = 0

        def relative_update(self, inc: int = 1) -> None:
            self.done += inc
            if self.done > chunk + 2**20:  # the first part is up, the second on its way
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ifs.upload(
            src,
            s3_backend.url,
            storage_options=s3_backend.storage_options,
            granularity="chunk",
            chunk_size=chunk,
            callback=InterruptAfterAPart(),
        )
    bucket, prefix = s3_backend.root.split("/", 1)
    fs = s3_backend.fs
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert uploads == []
    assert s3_backend.listdir() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["gcs_backend", "local"])
def test_an_interrupted_stream_is_not_committed_as_a_shorter_file(store: str, request, tmp_path: Path) -> None:
    """Writes that are not S3 checksummed uploads (GCS, local, other algorithms) go through a
    stream: an interrupted one must be dropped, not closed into a short object at the destination."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 * 2**20))
    ifs.seal(src)
    if store == "local":
        url, options, listdir = str(tmp_path / "dst"), None, lambda: sorted(os.listdir(tmp_path))
    else:
        b: Backend = request.getfixturevalue(store)
        url, options, listdir = b.url, b.storage_options, b.listdir

    class InterruptMidFile(Callback):  # type: ignore[misc]
        def relative_update(self, inc: int = 1) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ifs.copy(src, url, dst_options=options, callback=InterruptMidFile())
    assert "a.bin" not in listdir() and "dst" not in listdir()


@pytest.mark.timeout(60)
def test_cli_download_exits_at_once_on_sigint_during_a_stalled_read(
    stalling: tuple[Backend, StallingProxy], tmp_path: Path
) -> None:
    b, proxy = stalling
    dest = tmp_path / "out" / "dest"
    command = [sys.executable, "-m", "integrity_fs", "download", b.url, str(dest), "--no-progress"]
    command += ["-o", "key=testing", "-o", "secret=testing", "-o", f"client_kwargs.endpoint_url={proxy.endpoint}"]
    command += [
        "-o",
        f"config_kwargs.read_timeout={STALLED_READ_TIMEOUT_S}",
        "-o",
        "config_kwargs.retries.max_attempts=1",
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal
    )
    try:
        assert proxy.stalled.wait(30), "the download never reached the stalled object"
        time.sleep(0.3)  # the other files are being copied, the stalled one waits
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)  # one that waited for the stalled GET would not end
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert not proxy.closing.is_set()  # it ended while the stalled GET was held
    assert not (tmp_path / "out").exists() or not [n for n in os.listdir(tmp_path / "out") if STAGING_MARK in n]
    assert not dest.exists()


# --- durable before declared done --------------------------------------------------------------------


class _Syscalls:
    """Records each fsync (the path its descriptor is open on) and each rename, in order; both
    still do what they do."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        fsync, rename, replace = os.fsync, os.rename, os.replace

        def traced_fsync(fd: int) -> None:
            fsync(fd)
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

        def traced_rename(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
            rename(a, b, *args, **kwargs)
            self.events.append(("rename", os.fspath(b)))

        def traced_replace(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
            replace(a, b, *args, **kwargs)
            self.events.append(("rename", os.fspath(b)))

        monkeypatch.setattr(os, "fsync", traced_fsync)
        monkeypatch.setattr(os, "rename", traced_rename)
        monkeypatch.setattr(os, "replace", traced_replace)

    def first(self, kind: str, match: Callable[[str], bool]) -> int:
        return self._all(kind, match)[0]

    def last(self, kind: str, match: Callable[[str], bool]) -> int:
        return self._all(kind, match)[-1]

    def _all(self, kind: str, match: Callable[[str], bool]) -> list[int]:
        found = [i for i, (k, path) in enumerate(self.events) if k == kind and match(path)]
        assert found, f"no {kind} of a matching path in {self.events}"
        return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a descriptor's file")
@pytest.mark.parametrize("how", ["download", "download into an empty dir", "copy", "upload"])
def test_a_local_transfer_is_fsynced_before_its_manifest_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """After a power loss, a manifest never sits over torn files. Every file written, and
    every directory that gained an entry, is fsynced before the manifest is renamed into place;
    the manifest itself, and where the checkpoint was renamed to, before the call returns."""
    src = tmp_path / "src"
    names = ["w.bin", "sub/deep/x.bin", "sub/y.bin", "empty"]
    for name in names:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(os.urandom(5000) if name != "empty" else b"")
    if how != "upload":
        ifs.seal(src)
    out = tmp_path / "out"  # created by the transfer, as is everything under it
    dest = out / "dest"
    if how == "download into an empty dir":
        dest.mkdir(parents=True)
    calls = _Syscalls(monkeypatch)
    if how.startswith("download"):
        ifs.download(src, dest)
    elif how == "copy":
        ifs.copy(src, dest)
    else:
        ifs.upload(src, dest)
    monkeypatch.undo()
    staged = how.startswith("download")

    def written(name: str) -> Callable[[str], bool]:
        """Matches the path where ``name`` (a file or folder of the checkpoint, "" its root) was written."""

        def match(path: str) -> bool:
            parts = path.split("/")
            if staged:
                at = [i for i, part in enumerate(parts) if STAGING_MARK in part]
                return bool(at) and "/".join(parts[at[0] + 1 :]) == name
            return path == os.path.join(dest, name).rstrip("/")

        return match

    manifest_lands = calls.first("rename", written(MANIFEST_FILENAME))
    for name in [*names, "sub", "sub/deep", ""]:  # the files, the folders, the root
        assert calls.first("fsync", written(name)) < manifest_lands, name
    temporary = lambda path: MANIFEST_FILENAME in path.rsplit("/", 1)[-1] and not path.endswith(f"/{MANIFEST_FILENAME}")  # noqa: E731
    assert calls.first("fsync", temporary) < manifest_lands  # the manifest's temporary file
    if how == "download":
        moved = calls.first("rename", lambda path: path == str(dest))
        assert moved > manifest_lands and calls.last("fsync", lambda path: path == str(out)) > moved
        assert calls.first("fsync", lambda path: path == str(tmp_path)) >= 0  # holds the entry of `out`
    elif how == "download into an empty dir":
        moved = calls.first("rename", lambda path: path == str(dest / MANIFEST_FILENAME))  # moved up last
        assert calls.last("fsync", lambda path: path == str(dest)) > moved
    else:
        assert calls.last("fsync", lambda path: path == str(dest)) > manifest_lands
        assert calls.first("fsync", lambda path: path == str(out)) < manifest_lands  # holds the entry of dest
        assert calls.first("fsync", lambda path: path == str(tmp_path)) < manifest_lands  # holds that of out
    content = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    content.pop(MANIFEST_FILENAME, None)
    assert {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == {
        **content,
        MANIFEST_FILENAME: (dest / MANIFEST_FILENAME).read_bytes(),
    }
