"""seal: the manifest it writes (the same bytes on every backend), what it refuses before reading
a byte, and all or nothing: a failed or disturbed seal leaves no manifest (or the old one)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from conftest import AfterListing, Backend
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestError, ManifestNotFoundError

# --- what seal writes --------------------------------------------------------------------------------


FILES = {
    ".metadata": b"metadata bytes",
    "__0_0.distcp": os.urandom(300_000),
    "__1_0.distcp": os.urandom(200_001),
    "sub/dir/x.bin": b"nested",
    "empty": b"",
}


@pytest.fixture
def ckpt(backend):
    for name, data in FILES.items():
        backend.write(name, data)
    return backend


def test_seal_writes_canonical_manifest_of_every_file(ckpt):
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    raw = ckpt.read(MANIFEST_FILENAME)
    expected = {
        "algorithm": "sha256",
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(FILES.items())},
        "granularity": "file",
        "sizes": {name: len(data) for name, data in sorted(FILES.items())},
        "version": 1,
    }
    assert raw == (json.dumps(expected, indent=2, sort_keys=True) + "\n").encode()
    assert manifest == ifs.Manifest.from_json(raw)
    assert list(manifest.files) == sorted(FILES)
    # Sealing again (the manifest now present) gives the same bytes: it never lists itself.
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, overwrite=True)
    assert ckpt.read(MANIFEST_FILENAME) == raw


def test_manifest_bytes_are_identical_across_backends(ckpt, tmp_path):
    local = tmp_path / "reference"
    for name, data in FILES.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    ifs.seal(local)
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    assert ckpt.read(MANIFEST_FILENAME) == (local / MANIFEST_FILENAME).read_bytes()


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_worker_count_does_not_change_the_manifest(ckpt, workers):
    reference = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, max_workers=1).to_json()
    again = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, max_workers=workers, overwrite=True)
    assert again.to_json() == reference


def test_callback_sees_every_byte(ckpt):
    class Recorder(Callback):
        pass

    total = sum(map(len, FILES.values()))
    seal_cb = Recorder()
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, callback=seal_cb)
    assert (seal_cb.size, seal_cb.value) == (total, total)
    verify_cb = Recorder()
    ifs.verify(ckpt.url, storage_options=ckpt.storage_options, callback=verify_cb, max_workers=3)
    assert (verify_cb.size, verify_cb.value) == (total, total)


def test_fs_argument_takes_a_path_inside_that_filesystem(ckpt):
    ifs.seal(ckpt.root, fs=ckpt.fs)
    assert ifs.verify(ckpt.root, fs=ckpt.fs).ok


def test_seal_of_an_empty_directory_verifies_until_a_file_appears(tmp_path: Path) -> None:
    ifs.seal(tmp_path)
    assert ifs.verify(tmp_path).ok
    (tmp_path / "planted.pt").write_bytes(b"not sealed")
    with pytest.raises(IntegrityError, match="planted.pt"):
        ifs.verify(tmp_path)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_the_manifest_is_written_with_the_umask_permissions(tmp_path, umask, mode):
    (tmp_path / "w.bin").write_bytes(b"weights")
    old = os.umask(umask)
    try:
        ifs.seal(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / MANIFEST_FILENAME).st_mode) == mode


def test_dcp_save_writes_a_manifest_others_can_read(tmp_path: Path) -> None:
    """dcp.save writes the manifest with the umask's permissions too, not 0600."""
    torch = pytest.importorskip("torch")
    from integrity_fs import dcp

    old = os.umask(0o022)
    try:
        dcp.save({"w": torch.arange(10.0)}, str(tmp_path / "step_1"))
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "step_1" / ifs.MANIFEST_FILENAME).st_mode)
    assert mode == 0o644


# --- what seal refuses, before reading any content ---------------------------------------------------


def test_seal_refuses_a_sealed_root_unless_overwrite(ckpt):
    """seal -> damage -> seal must not launder the damage into a "good" manifest."""

    class Recorder(Callback):
        pass

    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    sealed = ckpt.read(MANIFEST_FILENAME)
    ckpt.corrupt("__0_0.distcp", 7)
    recorder = Recorder()
    with pytest.raises(FileExistsError, match=r"already sealed: pass overwrite=True") as err:
        ifs.seal(ckpt.url, storage_options=ckpt.storage_options, callback=recorder)
    assert not isinstance(err.value, ManifestNotFoundError)
    assert (recorder.size, recorder.value) == (None, 0)  # refused before any content was read
    assert ckpt.read(MANIFEST_FILENAME) == sealed
    with pytest.raises(IntegrityError, match="__0_0.distcp: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, overwrite=True)
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok


def test_seal_of_a_missing_directory_is_file_not_found(backend):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nothing-here") as err:
        ifs.seal(backend.url + "/nothing-here", storage_options=backend.storage_options)
    assert not isinstance(err.value, ManifestNotFoundError)


class _Counting(Callback):  # type: ignore[misc]  # fsspec is untyped
    def __init__(self) -> None:
        super().__init__()
        self.sized = False

    def set_size(self, size: int) -> None:
        self.sized = True


def _seal_refuses(url: str, storage_options: dict[str, Any], shown: str) -> None:
    callback = _Counting()
    with pytest.raises(ValueError) as err:
        ifs.seal(url, storage_options=storage_options, callback=callback)
    assert not isinstance(err.value, ManifestError)  # the checkpoint is fine, its names are not
    assert shown in str(err.value)
    assert not callback.sized and callback.value == 0  # refused before hashing started


def test_seal_refuses_a_name_that_is_not_utf8_before_reading(tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(os.urandom(1 << 20))
    (tmp_path / os.fsdecode(b"caf\xe9.pt")).write_bytes(b"latin-1 name")
    _seal_refuses(str(tmp_path), {}, r"caf\xe9.pt")
    assert not (tmp_path / MANIFEST_FILENAME).exists()


def test_seal_refuses_a_backslash_in_a_name_before_reading(backend: Any) -> None:
    backend.write("big.bin", os.urandom(1 << 20))
    backend.write("dir\\x.pt", b"backslash")
    _seal_refuses(backend.url, backend.storage_options, "dir\\\\x.pt")
    assert MANIFEST_FILENAME not in backend.listdir()


def test_seal_refuses_a_file_that_is_also_a_folder_before_reading_anything(s3_backend: Backend) -> None:
    """An object store holds ``sub`` and ``sub/x.bin``; no disk can: seal refuses from the listing."""
    s3_backend.write("sub", b"a key named like the folder beside it")
    s3_backend.write("sub/x.bin", b"weights")
    s3_backend.write("w.bin", b"more")
    callback = _Counting()
    with pytest.raises(ValueError, match=r"'sub' is a file and also a folder holding 'sub/x.bin'"):
        ifs.seal(s3_backend.url, storage_options=s3_backend.storage_options, callback=callback)
    assert not callback.sized and callback.value == 0  # refused before hashing started
    assert MANIFEST_FILENAME not in s3_backend.listdir()


# --- a seal is all or nothing ------------------------------------------------------------------------


def test_local_seal_interrupted_at_the_rename_leaves_no_trace(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(b"one")
    ifs.seal(tmp_path)
    before = (tmp_path / MANIFEST_FILENAME).read_bytes()
    (tmp_path / "a.bin").write_bytes(b"two")

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        ifs.seal(tmp_path, overwrite=True)
    assert (tmp_path / MANIFEST_FILENAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_integrity_manifest.json", "a.bin"]


@pytest.mark.parametrize(
    ("granularity", "chunk_size", "size"),
    [("file", None, 4 << 20), ("chunk", 64 * 1024, 256 * 1024)],
    ids=["file-streamed", "chunk-batched"],
)
@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_a_file_rewritten_while_it_is_sealed_is_never_sealed(tmp_path, granularity, chunk_size, size, how):
    """A same-size rewrite during the read: the digest would be of bytes that never sat on disk
    together (the first block old, the rest new). The seal must fail, writing no manifest."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * size)
    new = b"b" * size

    class Rewriter(Callback):
        def relative_update(self, inc: int = 1) -> None:
            if self.value == 0 and inc > 0:  # after the first block (or chunk): a writer steps in
                if how == "in-place":
                    with open(path, "r+b") as f:
                        f.write(new)
                else:
                    (tmp_path / "w.tmp").write_bytes(new)
                    os.replace(tmp_path / "w.tmp", path)
            super().relative_update(inc)

    with pytest.raises(ifs.FileChangedError, match=r"w\.bin changed while it was read"):
        ifs.seal(tmp_path, granularity=granularity, chunk_size=chunk_size, max_workers=1, callback=Rewriter())
    assert not (tmp_path / MANIFEST_FILENAME).exists()
    ifs.seal(tmp_path, granularity=granularity, chunk_size=chunk_size)  # once nothing writes, it seals
    assert ifs.verify(tmp_path).ok


def test_seal_refuses_a_file_that_grew_while_it_was_read(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"first")
    grown = AfterListing(lambda: (tmp_path / "a.bin").write_bytes(b"first and more"))
    with pytest.raises(OSError, match=r"a\.bin"):
        ifs.seal(tmp_path, callback=grown)
    assert not (tmp_path / MANIFEST_FILENAME).exists()


# --- what interrupted writes leave behind is not content ---------------------------------------------

LEFTOVER = ".integrity-fs-tmp-_integrity_manifest.json.k3_x9q0z"  # what a killed local seal leaves


def _killed_seal(root: Path) -> Path:
    """Kill a local seal between writing its temporary manifest and renaming it (OOM, preemption):
    a real child process, killed while it waits before the rename, leaves what it leaves."""
    import subprocess
    import sys

    (root / "w.bin").write_bytes(b"weights")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time, integrity_fs\n"
            "real = os.replace\n"
            "def stall(a, b):\n"
            "    print('written', flush=True)\n"
            "    time.sleep(60)\n"
            "os.replace = stall\n"
            "integrity_fs.seal(sys.argv[1])\n",
            str(root),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "written\n"
    finally:
        child.kill()
        child.wait()
    (left,) = [p for p in root.iterdir() if p.name.startswith(".integrity-fs-tmp-")]
    return left


def test_a_temporary_manifest_left_by_a_killed_seal_is_not_content(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The next seal must not list what a killed seal left as content (deleting it later would
    fail the checkpoint); verify names it as extra (``strict`` fails until it is gone)."""
    left = _killed_seal(tmp_path)
    assert not (tmp_path / MANIFEST_FILENAME).exists()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / left.name).write_bytes(b"user data, not at the root")
    manifest = ifs.seal(tmp_path)
    assert sorted(manifest.files) == [f"sub/{left.name}", "w.bin"]
    assert "interrupted" in caplog.text and left.name in caplog.text
    report = ifs.verify(tmp_path)  # there, and not content: extra, and named
    assert report.ok and report.extra == (left.name,)
    with pytest.raises(IntegrityError, match="extra"):
        ifs.verify(tmp_path, strict=True)
    left.unlink()
    assert ifs.verify(tmp_path, strict=True).ok


def test_a_file_named_like_a_leftover_never_passes_strict_nor_a_signature(tmp_path: Path) -> None:
    """Whatever a file of a temporary name holds, it is never sealed and never passed over by
    ``strict=True`` or a signature: it is there, and not in the manifest."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "w.bin").write_bytes(b"weights")
    payload = tmp_path / LEFTOVER
    payload.write_bytes(b"\x80\x04import os; os.system('...')")
    manifest = ifs.seal(tmp_path, private_key=key)
    assert sorted(manifest.files) == ["w.bin"]
    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path, strict=True)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [(LEFTOVER, "extra")]
    with pytest.raises(ifs.SignatureError, match="does not cover"):
        ifs.verify(tmp_path, public_key=key.public_key())
