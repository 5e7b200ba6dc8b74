"""Where upload, copy and download write: never through a symbolic link at or under a local
destination (nor dcp.save and seal), and a forced upload or copy onto a sealed checkpoint that
leaves it exactly as it was when it fails, and exactly the new checkpoint when it succeeds, on
local disks and S3 (moto)."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend, backends
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more
#: What a staging folder's name holds (SPEC "Transfer": ``.<dest name>.integrity-fs-staging-<token>``).
STAGING_MARK = ".integrity-fs-staging-"

NEW = {
    "model.bin": os.urandom(300_000),
    "optim.bin": os.urandom(70_000),
    "sub/meta.json": b'{"step": 2000}\n',
    "z.txt": b"the last file",
}
OLD = {
    "model.bin": os.urandom(250_000),
    "old-only.bin": os.urandom(1_000),
    "olddir/x.bin": b"a file only the old checkpoint has, in a folder of its own",
}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (links not followed): POSIX name -> bytes; a link -> its target."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            key = path.relative_to(root).as_posix()
            out[key] = f"-> {os.readlink(path)}".encode() if path.is_symlink() else path.read_bytes()
    return out


# --- links at a local destination -------------------------------------------------------------------


def _outside(tmp_path: Path) -> Path:
    """Files beside the destination: their bytes and their listing must never change."""
    return write_tree(tmp_path / "outside", {"victim.txt": b"not the transfer's to write", "dir/keep.bin": b"mine"})


LINKS = {
    "file": ("model.bin", "../outside/victim.txt"),  # where a file of the checkpoint goes
    "folder": ("sub", "../outside/dir"),  # where a folder of the checkpoint goes
}


def _transfer(how: str, tmp_path: Path, dst: Path, **kw: Any) -> object:
    src = write_tree(tmp_path / "src" / "step_2000", NEW)
    if how == "upload":
        return ifs.upload(src, dst, **kw)
    ifs.seal(src)
    if how == "copy":
        return ifs.copy(src, dst, **kw)
    return ifs.download(src, dst, **kw)


@pytest.mark.parametrize("link", sorted(LINKS))
@pytest.mark.parametrize("how", ["copy", "upload", "download"])
def test_a_link_where_a_transfer_would_write_is_refused_or_replaced_never_written_through(
    tmp_path: Path, how: str, link: str
) -> None:
    """SPEC "Transfer": a link planted before the transfer is refused or ignored, never written
    through. A link where a folder goes (``sub``) is refused (ValueError naming it; what was
    written is deleted); a link where a file goes (``model.bin``) is replaced by the file, its
    target untouched; download refuses a ``dest`` that is not empty."""
    outside = _outside(tmp_path)
    before = tree(outside)
    dst = tmp_path / "dst"
    dst.mkdir()
    name, target = LINKS[link]
    (dst / name).symlink_to(target)
    if how == "download":
        with pytest.raises(FileExistsError, match="not an empty"):
            _transfer(how, tmp_path, dst)
        assert tree(dst) == {name: f"-> {target}".encode()}
    elif link == "folder":
        with pytest.raises(ValueError, match=str(dst / name)):
            _transfer(how, tmp_path, dst)
        assert tree(dst) == {name: f"-> {target}".encode()}
    else:
        _transfer(how, tmp_path, dst)
        assert not (dst / name).is_symlink() and (dst / name).read_bytes() == NEW[name]
        assert ifs.verify(dst, strict=True).files_checked == len(NEW)
    assert tree(outside) == before


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_link_out_of_the_way_is_left_and_the_copy_verifies(tmp_path: Path, how: str) -> None:
    outside = _outside(tmp_path)
    before = tree(outside)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes").symlink_to("../outside/victim.txt")
    _transfer(how, tmp_path, dst)
    assert tree(outside) == before
    assert ifs.verify(dst).files_checked == len(NEW)
    assert {name: data for name, data in tree(dst).items() if name in NEW} == NEW
    assert not any(os.path.islink(dst / name) for name in NEW)


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_link_to_the_destination_itself_is_refused(tmp_path: Path, how: str) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "dst").symlink_to("real")
    with pytest.raises(ValueError, match="is a symbolic link"):
        _transfer(how, tmp_path, tmp_path / "dst")
    assert os.listdir(tmp_path / "real") == []


class _PlantAtFirstByte(Callback):  # type: ignore[misc]
    """Plants a link once the transfer has started (after the checks): a race, not a refusal."""

    def __init__(self, plant: Callable[[], None]) -> None:
        super().__init__()
        self.plant: Callable[[], None] | None = plant

    def relative_update(self, inc: int = 1) -> None:
        if self.plant is not None:
            self.plant, plant = None, self.plant
            plant()


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_folder_link_planted_while_a_transfer_runs_is_never_written_through(tmp_path: Path, how: str) -> None:
    """model.bin goes first (one worker, largest first); then sub/ is a link: the write of
    sub/meta.json is refused, and what was written is deleted."""
    outside = _outside(tmp_path)
    before = tree(outside)
    dst = tmp_path / "dst"
    plant = _PlantAtFirstByte(lambda: (dst / "sub").symlink_to("../outside/dir"))
    with pytest.raises(ValueError, match="is a symbolic link"):
        _transfer(how, tmp_path, dst, max_workers=1, callback=plant)
    assert tree(outside) == before
    assert tree(dst) == {"sub": b"-> ../outside/dir"}


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_file_link_planted_while_a_transfer_runs_is_replaced_never_followed(tmp_path: Path, how: str) -> None:
    outside = _outside(tmp_path)
    before = tree(outside)
    dst = tmp_path / "dst"
    plant = _PlantAtFirstByte(lambda: (dst / "optim.bin").symlink_to("../outside/victim.txt"))
    _transfer(how, tmp_path, dst, max_workers=1, callback=plant)
    assert tree(outside) == before
    assert not (dst / "optim.bin").is_symlink() and (dst / "optim.bin").read_bytes() == NEW["optim.bin"]
    assert ifs.verify(dst, strict=True).files_checked == len(NEW)


def test_a_link_in_a_sealed_destination_refuses_a_forced_transfer_before_anything_is_staged(tmp_path: Path) -> None:
    """The sealed destination holds a link ``sub`` (not part of its checkpoint) where the new
    checkpoint has a folder ``sub/``: refused (ValueError naming it) before any change."""
    outside = _outside(tmp_path)
    dst = tmp_path / "dst"
    ifs.upload(write_tree(tmp_path / "old", OLD), dst)
    (dst / "sub").symlink_to("../outside/dir")
    before, old = tree(outside), tree(dst)
    with pytest.raises(ValueError, match=str(dst / "sub")):
        _transfer("copy", tmp_path, dst, overwrite=True)
    assert tree(outside) == before and tree(dst) == old
    assert ifs.verify(dst).files_checked == len(OLD)
    assert sorted(os.listdir(tmp_path)) == ["dst", "old", "outside", "src"]  # no staging folder


def test_a_forced_transfer_keeps_the_links_beside_the_old_checkpoint(tmp_path: Path) -> None:
    """Entries of the sealed destination that are not its checkpoint's (a file, a link to a file
    and one to a folder outside) are there, as they were, beside the new checkpoint."""
    outside = _outside(tmp_path)
    before = tree(outside)
    dst = tmp_path / "dst"
    ifs.upload(write_tree(tmp_path / "old", OLD), dst)
    write_tree(dst, {"logs/events.txt": b"the user's"})
    (dst / "notes").symlink_to("../outside/victim.txt")
    (dst / "linked").symlink_to("../outside/dir")
    _transfer("copy", tmp_path, dst, overwrite=True)
    got = tree(dst)
    assert {k: v for k, v in got.items() if k in ("logs/events.txt", "notes", "linked")} == {
        "logs/events.txt": b"the user's",
        "notes": b"-> ../outside/victim.txt",
        "linked": b"-> ../outside/dir",
    }
    assert ifs.verify(dst).files_checked == len(NEW)
    assert not any(name in got for name in OLD if name not in NEW)
    assert tree(outside) == before


def test_seal_replaces_a_link_at_the_manifest_never_its_target(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    before = tree(outside)
    ckpt = write_tree(tmp_path / "ckpt", NEW)
    (ckpt / MANIFEST_FILENAME).symlink_to("../outside/victim.txt")
    ifs.seal(ckpt, overwrite=True)
    assert tree(outside) == before
    assert not (ckpt / MANIFEST_FILENAME).is_symlink() and ifs.verify(ckpt, strict=True).ok


# --- a forced transfer onto a sealed checkpoint -----------------------------------------------------

store = backends("local", "s3")


def _sealed_old(store: Backend, tmp_path: Path) -> dict[str, bytes]:
    """The old checkpoint at ``store``; every file there, as bytes."""
    ifs.upload(write_tree(tmp_path / "old", OLD), store.url, storage_options=store.storage_options)
    return {name: store.read(name) for name in store.listdir()}


def _staging_left(store: Backend) -> list[str]:
    parent, name = store.root.rsplit("/", 1)
    store.fs.invalidate_cache()
    listed = store.fs.ls(parent or "/", detail=False)
    return [p for p in listed if p.rsplit("/", 1)[-1].startswith(f".{name}{STAGING_MARK}")]


def _new(tmp_path: Path, files: dict[str, bytes], *, sealed: bool) -> Path:
    src = write_tree(tmp_path / f"new-{uuid.uuid4().hex}", files)
    if sealed:
        ifs.seal(src)
    return src


def _forced(how: str, store: Backend, src: Path, **kw: Any) -> None:
    """upload (of ``src`` as it is) or copy (of a sealed ``src``) onto ``store``, ``overwrite=True``."""
    if how == "upload":
        ifs.upload(src, store.url, storage_options=store.storage_options, overwrite=True, **kw)
    else:
        ifs.copy(src, store.url, dst_options=store.storage_options, overwrite=True, **kw)


class _FailAfterFirstFile(Callback):  # type: ignore[misc]
    """Raises ``error`` once more than model.bin (the first file, one worker) has been sent."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error
        self.done = 0

    def relative_update(self, inc: int = 1) -> None:
        self.done += inc
        if self.done > len(NEW["model.bin"]):
            raise self.error


def _refuse_puts_of(store: Backend, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """S3 refuses to store ``name`` (a PUT, or a part of it)."""
    call_s3 = store.fs._call_s3

    async def refuse(method: str, *args: Any, **kwargs: Any) -> Any:
        if method in ("put_object", "upload_part") and kwargs.get("Key", "").endswith(name):
            raise PermissionError("access denied")
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", refuse)


FAILURES = ["damaged source", "storage error", "interrupted"]


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_failed_forced_transfer_leaves_the_old_checkpoint_exactly_as_it_was(
    store: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, failure: str
) -> None:
    """Each failure comes after model.bin (which the old checkpoint holds too) was sent."""
    old = _sealed_old(store, tmp_path)
    src = _new(tmp_path, NEW, sealed=how == "copy" or failure == "damaged source")
    kw: dict[str, Any] = {"max_workers": 1}
    expected: type[BaseException] = OSError
    if failure == "damaged source":  # z.txt, sent last, no longer matches the source's manifest
        (src / "z.txt").write_bytes(b"the LAST file")
        expected = IntegrityError
    elif failure == "interrupted":
        kw["callback"], expected = _FailAfterFirstFile(KeyboardInterrupt()), KeyboardInterrupt
    elif store.name == "s3":
        _refuse_puts_of(store, monkeypatch, "optim.bin")
        expected = PermissionError
    else:
        kw["callback"] = _FailAfterFirstFile(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(expected):
        _forced(how, store, src, **kw)
    monkeypatch.undo()
    assert {name: store.read(name) for name in store.listdir()} == old
    report = ifs.verify(store.url, storage_options=store.storage_options, strict=True)
    assert report.files_checked == len(OLD)
    assert _staging_left(store) == []


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_forced_transfer_leaves_exactly_the_new_checkpoint(backend: Backend, tmp_path: Path, how: str) -> None:
    """The old checkpoint's files that the new one lacks are gone (old-only.bin, olddir/x.bin and
    its folder), and so is the staging folder; on every backend (the store copies the files in)."""
    _sealed_old(backend, tmp_path)
    _forced(how, backend, _new(tmp_path, NEW, sealed=how == "copy"))
    assert backend.listdir() == sorted([*NEW, MANIFEST_FILENAME])
    assert all(backend.read(name) == data for name, data in NEW.items())
    assert ifs.verify(backend.url, storage_options=backend.storage_options, strict=True).files_checked == len(NEW)
    assert _staging_left(backend) == []
    if backend.name == "local":
        assert not Path(backend.root, "olddir").exists()


def test_a_forced_transfer_replaces_a_folder_with_a_file_of_its_name(tmp_path: Path) -> None:
    """The old checkpoint's sub/meta.json goes before the new file sub comes in."""
    dst = tmp_path / "dst"
    ifs.upload(write_tree(tmp_path / "old", {"sub/meta.json": b"old"}), dst)
    ifs.upload(write_tree(tmp_path / "new", {"sub": b"now a file"}), dst, overwrite=True)
    assert tree(dst) == {"sub": b"now a file", MANIFEST_FILENAME: (dst / MANIFEST_FILENAME).read_bytes()}
    assert ifs.verify(dst, strict=True).ok


def test_a_forced_transfer_to_a_bucket_root_stages_inside_it(s3_backend: Backend, tmp_path: Path) -> None:
    """A bucket has no folder beside it: the staging folder goes inside, and is gone afterwards."""
    bucket = f"integrity-root-{uuid.uuid4().hex[:12]}"
    s3_backend.fs.mkdir(bucket)
    root = Backend("s3", s3_backend.fs, bucket, f"s3://{bucket}", s3_backend.storage_options)
    _sealed_old(root, tmp_path)
    _forced("upload", root, _new(tmp_path, NEW, sealed=False))
    assert root.listdir() == sorted([*NEW, MANIFEST_FILENAME])
    assert ifs.verify(root.url, storage_options=root.storage_options, strict=True).files_checked == len(NEW)


def test_a_forced_transfer_to_s3_stays_attestable(s3_backend: Backend, tmp_path: Path) -> None:
    """The store copies the staged objects in the parts they were sent in, with their SHA-256s: a
    file of three 5 MiB chunks (a multipart object) and one of one chunk are attested, unread."""
    chunk = 5 * 2**20
    files = {"big.bin": os.urandom(2 * chunk + 1000), "small.bin": os.urandom(1000)}
    _sealed_old(s3_backend, tmp_path)
    src = write_tree(tmp_path / "new", files)
    ifs.upload(
        src,
        s3_backend.url,
        storage_options=s3_backend.storage_options,
        granularity="chunk",
        chunk_size=chunk,
        overwrite=True,
    )
    report = ifs.verify(s3_backend.url, storage_options=s3_backend.storage_options, attested=True, strict=True)
    assert report.files_attested == report.files_checked == 2 and report.bytes_checked == 0
