"""The storage layer through the public API: URLs, listings (fresh, from the store), reads pinned
to the listed version, symlinks and special files, retries, and backend errors that are storage
errors (never corruption, never success)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import botocore.exceptions
import fsspec
import pytest
from conftest import AfterListing, Backend, backends
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError

# --- URLs: a string with no protocol is a local path -------------------------------------------------


def test_local_path_with_double_colon_is_that_path_not_a_chained_url(tmp_path):
    decoy = tmp_path / "run"
    decoy.mkdir()
    (decoy / "w.bin").write_bytes(b"the other run")
    target = tmp_path / "run::1"
    target.mkdir()
    (target / "w.bin").write_bytes(b"weights")

    ifs.seal(str(target))
    assert (target / MANIFEST_FILENAME).exists()
    assert not (decoy / MANIFEST_FILENAME).exists()
    (target / "w.bin").write_bytes(b"weightz")
    with pytest.raises(IntegrityError) as err:
        ifs.verify(str(target))
    assert str(target) in str(err.value)
    with pytest.raises(IntegrityError):
        ifs.verify(f"file://{target}")


def test_cli_seals_and_verifies_the_double_colon_path_it_names(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "w.bin").write_bytes(b"the other run")
    target = tmp_path / "run::1"
    target.mkdir()
    (target / "w.bin").write_bytes(b"weights")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "integrity_fs", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

    assert cli("seal", str(target)).returncode == 0
    (target / "w.bin").write_bytes(b"weightz")
    proc = cli("verify", str(target))
    assert proc.returncode == 1, proc.stderr
    assert "run::1" in proc.stderr
    assert not (tmp_path / "run" / MANIFEST_FILENAME).exists()


def _problems(err: pytest.ExceptionInfo[IntegrityError]) -> dict[str, tuple[str, Any, Any]]:
    return {p.path: (p.kind, p.expected, p.actual) for p in err.value.report.problems}


@pytest.mark.parametrize("inner", ["local", "memory", "s3"])
def test_dirfilesystem_reads_through_to_its_filesystem(inner, tmp_path, request):
    if inner == "local":
        base, fs = str(tmp_path), LocalFileSystem()
    elif inner == "memory":
        base, fs = f"/dirfs-{uuid.uuid4().hex}", MemoryFileSystem(skip_instance_cache=True)
    else:
        b: Backend = request.getfixturevalue("s3_backend")
        base, fs = b.root, b.fs
    fs.makedirs(f"{base}/ck/sub", exist_ok=True)
    fs.pipe_file(f"{base}/ck/a.bin", os.urandom(3000))
    fs.pipe_file(f"{base}/ck/sub/b.bin", b"weights")
    dirfs = DirFileSystem(path=base, fs=fs)

    ifs.seal("ck", fs=dirfs)
    assert ifs.verify("ck", fs=dirfs).files_checked == 2
    fs.pipe_file(f"{base}/ck/sub/b.bin", b"weightz")
    with pytest.raises(IntegrityError) as err:
        ifs.verify("ck", fs=dirfs)
    assert list(_problems(err)) == ["sub/b.bin"]


# --- listing: from the store, fresh, folder markers are folders --------------------------------------


def test_listings_cached_earlier_in_the_process_are_not_trusted(s3_backend: Backend):
    b = s3_backend
    fs = b.fs  # the long-lived instance: it writes, lists, and later verifies
    old = os.urandom(3000)
    fs.pipe_file(b.path("sub/rewritten.bin"), old)
    fs.pipe_file(b.path("sub/deep/kept.bin"), b"kept")
    fs.ls(b.path("sub"))
    fs.ls(b.path("sub/deep"))  # both subdirectory listings are now cached, with ETags

    other = fsspec.filesystem("s3", skip_instance_cache=True, **b.storage_options)
    new = bytearray(old)
    new[2500] ^= 1
    other.pipe_file(b.path("sub/rewritten.bin"), bytes(new))
    other.pipe_file(b.path("sub/deep/added.bin"), os.urandom(2500))
    ifs.seal(b.url, fs=other, granularity="chunk", chunk_size=1000)
    other.pipe_file(b.path("sub/rewritten.bin"), old)  # back to the first bytes: a mismatch now

    with pytest.raises(IntegrityError) as err:
        ifs.verify(b.root, fs=fs)
    problems = _problems(err)
    assert list(problems) == ["sub/rewritten.bin"]
    assert problems["sub/rewritten.bin"][0] == "mismatch"
    assert err.value.report.problems[0].byte_ranges == ((2000, 3000),)


object_store = backends("s3", "gcs")


def test_folder_markers_are_directories_not_files(object_store: Backend) -> None:
    b = object_store
    b.write("a.bin", b"weights")
    b.write("sub/b.bin", b"more")
    b.folder_marker("sub")  # what the S3 console's "Create folder" makes
    b.folder_marker("empty")
    b.fs.invalidate_cache()

    manifest = ifs.seal(b.url, storage_options=b.storage_options)
    assert sorted(manifest.files) == ["a.bin", "sub/b.bin"]
    report = ifs.verify(b.url, storage_options=b.storage_options, strict=True)
    assert report.ok and report.extra == ()
    b.corrupt("sub/b.bin")
    with pytest.raises(IntegrityError):
        ifs.verify(b.url, storage_options=b.storage_options)


def test_entries_that_vanish_while_the_tree_is_listed_are_not_a_storage_error(tmp_path: Path) -> None:
    """Another process creating and removing temporary files, folders and links beside an intact
    checkpoint, as fast as it can: a file or folder removed between the directory read and its
    stat is simply not there, never a raw FileNotFoundError that reads as "no checkpoint"."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "w.bin").write_bytes(b"weights")
    ifs.seal(root)
    churn = [root / "scratch.tmp", root / "scratch", root / "link", root / "sub" / "part.tmp"]
    done = threading.Event()

    def other_process() -> None:
        while not done.is_set():
            (root / "scratch.tmp").write_bytes(b"partial")
            (root / "sub" / "part.tmp").write_bytes(b"partial")
            (root / "scratch").mkdir()
            (root / "scratch" / "x").write_bytes(b"")
            (root / "link").symlink_to(root / "scratch.tmp")
            for victim in (
                root / "link",
                root / "scratch.tmp",
                root / "scratch" / "x",
                root / "scratch",
                root / "sub" / "part.tmp",
            ):
                victim.rmdir() if victim.is_dir() and not victim.is_symlink() else victim.unlink()

    churning = threading.Thread(target=other_process, daemon=True)
    churning.start()
    try:
        calls = 0
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            report = ifs.verify(root, strict=False)
            assert report.ok and set(report.extra) <= {"scratch.tmp", "scratch/x", "link", "sub/part.tmp"}
            calls += 1
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:
            with contextlib.suppress(ifs.FileChangedError):  # what was listed is sealed, or it went before it was read
                assert "sub/w.bin" in ifs.seal(root, overwrite=True).files
            calls += 1
    finally:
        done.set()
        churning.join()
    assert calls > 10 and not any(p.exists() for p in churn)


def test_a_file_replaced_by_a_directory_after_the_listing_is_a_file_changed_error(tmp_path, caplog):
    """Not damage, not a storage failure: a file that is a directory now changed after the listing
    (as a deleted one did): ``FileChangedError``; ``latest_verified`` skips it as changing."""
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w.bin").write_bytes(os.urandom(1000))
        ifs.seal(tmp_path / name)
    target = tmp_path / "step_2" / "w.bin"

    def swap() -> None:
        if target.is_file():
            target.unlink()
            target.mkdir()

    with pytest.raises(ifs.FileChangedError, match="w.bin") as err:
        ifs.verify(tmp_path / "step_2", callback=AfterListing(swap))
    assert not isinstance(err.value, IntegrityError)
    target.rmdir()
    target.write_bytes(b"again")
    swapped = tmp_path / "step_2" / "w.bin"
    swapped.unlink()
    swapped.write_bytes(os.urandom(1000))  # a file again, of other bytes: damaged now
    found = ifs.latest_verified(tmp_path)
    assert found is not None and found[0] == str(tmp_path / "step_1")
    assert "step_2" in caplog.text and "damaged" in caplog.text


# --- reads are pinned to the listed version and confirm the end of each file -------------------------


@pytest.mark.parametrize("granularity", ["file", "chunk"])
@pytest.mark.parametrize("change", ["grew", "shrank"])
def test_a_file_that_changed_size_after_the_listing_is_a_file_changed_error(backend: Backend, granularity, change):
    """Every read is pinned to the version the listing saw (S3 ETag, GCS generation, local
    identity, the memory store's creation time): a file rewritten longer or shorter after the
    listing is never judged from a mix of versions, and never passes."""
    data = os.urandom(2500)
    backend.write("a.bin", data)
    backend.write("b.bin", b"steady")
    chunk_size = 1000 if granularity == "chunk" else None
    ifs.seal(backend.url, storage_options=backend.storage_options, granularity=granularity, chunk_size=chunk_size)

    new = data + b"appended" if change == "grew" else data[:1700]
    changed = AfterListing(lambda: backend.write("a.bin", new))
    with pytest.raises(ifs.FileChangedError, match=r"a\.bin changed while it was read"):
        ifs.verify(backend.url, storage_options=backend.storage_options, callback=changed)


class _Unversioned(MemoryFileSystem):  # type: ignore[misc]
    """A store that lists no version of any kind (no ETag, generation or modification time)."""

    protocol = "unversioned"

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return {k: v for k, v in super().info(path, **kwargs).items() if k != "created"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = super().ls(path, detail=detail, **kwargs)
        return [{k: v for k, v in entry.items() if k != "created"} for entry in out] if detail else out

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        out = super().find(path, maxdepth=maxdepth, withdirs=withdirs, **kwargs)
        if kwargs.get("detail"):
            return {name: {k: v for k, v in entry.items() if k != "created"} for name, entry in out.items()}
        return out


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_on_a_store_without_versions_a_file_that_changed_size_is_never_ok(granularity):
    """Nothing to pin to: each read still confirms the end of the file by the store's size now:
    a file longer or shorter than listed is a change (or a "size" problem), never an OK."""
    fs = _Unversioned(skip_instance_cache=True)
    root = f"/unversioned-{os.getpid()}-{granularity}"
    data = os.urandom(2500)
    fs.pipe_file(f"{root}/a.bin", data)
    chunk_size = 1000 if granularity == "chunk" else None
    ifs.seal(root, fs=fs, granularity=granularity, chunk_size=chunk_size)
    for new in (data + b"appended", data[:1700]):
        changed = AfterListing(lambda new=new: fs.pipe_file(f"{root}/a.bin", new))
        with pytest.raises((IntegrityError, ifs.FileChangedError)) as err:
            ifs.verify(root, fs=fs, callback=changed)
        if isinstance(err.value, IntegrityError):
            assert _problems(err) == {"a.bin": ("size", 2500, len(new))}  # type: ignore[arg-type]
        else:
            assert "a.bin changed while it was read" in str(err.value)
        fs.pipe_file(f"{root}/a.bin", data)
    fs.rm(root, recursive=True)


def test_a_backend_that_lists_no_version_is_read_unpinned_and_says_so(tmp_path, caplog):
    """A checkpoint inside a zip archive: fsspec's ZipFileSystem lists no ETag, generation or
    modification time. Its files verify and open as hashed, and the lack of a pin is a WARNING,
    once per filesystem, never silence."""
    import zipfile

    root = tmp_path / "step_1"
    root.mkdir()
    data = os.urandom(300_000)
    (root / "w.bin").write_bytes(data)
    ifs.seal(root, granularity="chunk", chunk_size=65536)
    with zipfile.ZipFile(tmp_path / "run.zip", "w") as archive:
        for path in root.iterdir():
            archive.write(path, f"step_1/{path.name}")
    fs = fsspec.filesystem("zip", fo=str(tmp_path / "run.zip"), skip_instance_cache=True)
    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        assert ifs.verify("step_1", fs=fs).bytes_checked == len(data)
        with ifs.open("step_1", "w.bin", fs=fs) as f:
            assert f.read() == data
    warnings = [r for r in caplog.records if "lists no version" in r.getMessage()]
    assert len(warnings) == 1 and "ZipFileSystem" in warnings[0].getMessage()


def test_an_empty_file_that_grew_after_the_listing_is_a_file_changed_error(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    ifs.seal(tmp_path)
    grown = AfterListing(lambda: (tmp_path / "empty.bin").write_bytes(b"now full"))
    with pytest.raises(ifs.FileChangedError, match=r"empty\.bin"):
        ifs.verify(tmp_path, callback=grown)


# --- symlinks never lead out of the root -------------------------------------------------------------


def test_symlinks_out_of_the_root_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"secret")
    root = tmp_path / "ckpt"
    (root / "real").mkdir(parents=True)
    (root / "real" / "w.bin").write_bytes(b"weights")
    (root / "leak.bin").symlink_to(outside / "secret.bin")
    (root / "leakdir").symlink_to(outside, target_is_directory=True)
    (root / "alias.bin").symlink_to(root / "real" / "w.bin")

    manifest = ifs.seal(root)
    assert list(manifest.files) == ["alias.bin", "real/w.bin"]

    # A manifest that claims the outside file's digest must still fail: the link is not read.
    doc = json.loads(manifest.to_json())
    secret = __import__("hashlib").sha256(b"secret").hexdigest()
    doc["files"]["leak.bin"] = doc["files"]["leakdir/secret.bin"] = secret
    doc["sizes"]["leak.bin"] = doc["sizes"]["leakdir/secret.bin"] = 6
    (root / MANIFEST_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(IntegrityError) as err:
        ifs.verify(root)
    assert {(p.path, p.kind) for p in err.value.report.problems} == {
        ("leak.bin", "missing"),
        ("leakdir/secret.bin", "missing"),
    }


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_a_symlink_swapped_in_after_the_listing_is_never_followed_out_of_the_root(tmp_path, caplog, granularity):
    """A sealed file replaced, after the listing, by a link to a file outside the root that holds
    the very same bytes: if anything outside the root were read, the verdict would be OK. The read
    is pinned to the listed file, so it is a ``FileChangedError`` (latest_verified: skipped as
    "changed while it was read"), and seal writes no manifest."""
    data = os.urandom(200_000)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data)
    run = tmp_path / "run"
    for name in ("step_1", "step_2"):
        (run / name).mkdir(parents=True)
        (run / name / "w.bin").write_bytes(data)
        ifs.seal(run / name, granularity=granularity, chunk_size=64 * 1024 if granularity == "chunk" else None)
    target = run / "step_2" / "w.bin"

    def swap() -> None:
        if target.is_symlink():
            target.unlink()
            target.write_bytes(data)  # each call starts from the sealed file
        target.unlink()
        target.symlink_to(outside)

    with pytest.raises(ifs.FileChangedError, match="w.bin"):
        ifs.verify(run / "step_2", callback=AfterListing(swap))
    target.unlink()
    target.write_bytes(data)
    swaps = AfterListing(lambda: swap() if not target.is_symlink() else None)
    found = ifs.latest_verified(run, callback=swaps)
    assert found is not None and found[0] == str(run / "step_1")
    assert "step_2" in caplog.text and "changed while it was read" in caplog.text
    target.unlink()
    target.write_bytes(data)
    with pytest.raises(ifs.FileChangedError):
        ifs.seal(run / "step_2", overwrite=True, callback=AfterListing(swap))
    assert ifs.read_manifest(run / "step_2").granularity == granularity  # the old manifest, untouched


# --- FIFOs, sockets and devices are never opened -----------------------------------------------------


@pytest.fixture
def unix_socket(tmp_path: Path):  # type: ignore[no-untyped-def]
    socks = []

    def make(path: Path) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        socks.append(s)

    yield make
    for s in socks:
        s.close()


@pytest.mark.timeout(20)
def test_fifos_sockets_and_devices_are_skipped_with_a_warning(tmp_path, caplog, unix_socket):
    (tmp_path / "w.bin").write_bytes(b"weights")
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "sub" / "pipe")
    unix_socket(tmp_path / "sock")
    special = ["sub/pipe", "sock"]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        special.append("null")

    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        manifest = ifs.seal(tmp_path)
    assert sorted(manifest.files) == ["w.bin"]
    for name in special:
        assert name in caplog.text
    assert ifs.verify(tmp_path, strict=True).ok


@pytest.mark.timeout(20)
def test_a_sealed_file_replaced_by_a_fifo_is_missing_and_nothing_blocks(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "w.bin").write_bytes(b"weights")
    ifs.seal(tmp_path)
    (tmp_path / "empty.bin").unlink()
    os.mkfifo(tmp_path / "empty.bin")
    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path)
    assert _problems(err) == {"empty.bin": ("missing", ifs.read_manifest(tmp_path).files["empty.bin"], None)}


@pytest.mark.timeout(20)
def test_a_file_turned_into_a_fifo_after_the_listing_is_never_opened(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    ifs.seal(tmp_path)

    def swap() -> None:
        (tmp_path / "empty.bin").unlink()
        os.mkfifo(tmp_path / "empty.bin")

    with pytest.raises(ifs.FileChangedError, match="empty.bin") as err:
        ifs.verify(tmp_path, callback=AfterListing(swap))
    assert not isinstance(err.value, IntegrityError)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("quick", [False, True])
def test_a_fifo_named_like_the_manifest_is_a_clear_error_not_a_hang(tmp_path, quick):
    (tmp_path / "w.bin").write_bytes(b"weights")
    os.mkfifo(tmp_path / MANIFEST_FILENAME)
    # Never opened, so nothing blocks; an unreadable manifest, as a directory there is (exit 3).
    with pytest.raises(ifs.ManifestError, match="FIFO"):
        ifs.read_manifest(tmp_path)
    with pytest.raises(ifs.ManifestError, match="FIFO"):
        ifs.verify(tmp_path, quick=quick)


def test_manifest_that_is_a_directory_is_invalid(tmp_path):
    (tmp_path / MANIFEST_FILENAME).mkdir()
    with pytest.raises(ifs.ManifestError, match="is a directory"):
        ifs.verify(tmp_path)


def test_manifest_that_is_a_fifo_is_invalid_not_a_storage_error(tmp_path):
    """Like a directory there: a checkpoint fault that stays, so latest_verified skips it as
    invalid rather than stopping on an OSError (an outage); never opened, so nothing blocks."""
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "a.bin").write_bytes(b"new")
    os.mkfifo(tmp_path / "step_2" / MANIFEST_FILENAME)
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "a.bin").write_bytes(b"old")
    ifs.seal(tmp_path / "step_1")
    for call in (ifs.verify, ifs.read_manifest):
        with pytest.raises(ifs.ManifestError, match="FIFO"):
            call(tmp_path / "step_2")
    found = ifs.latest_verified(tmp_path)
    assert found is not None and found[0] == str(tmp_path / "step_1")


@pytest.fixture(scope="module")
def ec_key() -> Any:
    ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
    return ec.generate_private_key(ec.SECP256R1())


@pytest.mark.timeout(30)
def test_fifos_in_place_of_a_manifest_or_signature_through_a_dirfilesystem(tmp_path, ec_key):
    """A FIFO where the manifest, the signature or a --manifest file should be, reached through
    ``DirFileSystem`` over a local directory: never opened (nothing blocks), and the error of what
    it stands for: an unreadable manifest (``ManifestError``), a missing signature
    (``SignatureError``). ``latest_verified`` skips such checkpoints for the older good one."""
    run = tmp_path / "run"
    for name in ("step_1", "step_2", "step_3"):
        (run / name).mkdir(parents=True)
        (run / name / "w.bin").write_bytes(name.encode())
    ifs.seal(run / "step_1", private_key=ec_key)
    os.mkfifo(run / "step_2" / MANIFEST_FILENAME)
    ifs.seal(run / "step_3")
    os.mkfifo(run / "step_3" / "model.sig")
    os.mkfifo(run / "step_1" / "SUMS")
    dirfs = DirFileSystem(path=str(tmp_path), fs=LocalFileSystem())

    for call in (lambda: ifs.verify("run/step_2", fs=dirfs), lambda: ifs.read_manifest("run/step_2", fs=dirfs)):
        with pytest.raises(ifs.ManifestError, match="FIFO"):
            call()
    with pytest.raises(ifs.SignatureError, match="FIFO"):
        ifs.verify("run/step_3", fs=dirfs, public_key=ec_key.public_key())
    for manifest in ("SUMS", str(run / "step_1" / "SUMS")):
        with pytest.raises(ifs.ManifestError, match="FIFO"):
            ifs.verify("run/step_1", fs=dirfs, manifest=manifest)
    assert ifs.latest_verified("run", fs=dirfs)[0] == str(run / "step_3")  # type: ignore[index]
    found = ifs.latest_verified("run", fs=dirfs, public_key=ec_key.public_key())
    assert found is not None and found[0] == str(run / "step_1")


FAKE = "x\nintegrity-fs: verified ckpt: all files"


def test_every_warning_that_names_a_file_or_checkpoint_escapes_it(tmp_path: Path, caplog) -> None:
    """Through the library (whatever handler a program gives its logging): a name with a
    newline cannot add a line to a WARNING, whichever warning it is."""
    run = tmp_path / f"run{FAKE}"
    good, bad = run / f"step_1{FAKE}", run / f"step_2{FAKE}"
    good.mkdir(parents=True)
    (good / "w.bin").write_bytes(b"weights")
    ifs.seal(good)
    import shutil

    shutil.copytree(good, bad)
    (bad / "w.bin").write_bytes(b"damaged")
    os.mkfifo(good / f"fifo{FAKE}")
    (tmp_path / "outside.bin").write_bytes(b"o")
    (good / f"link{FAKE}").symlink_to(tmp_path / "outside.bin")
    (good / f"extra{FAKE}").write_bytes(b"e")

    checks = {
        "a FIFO": (lambda: ifs.verify(good), "not a regular file"),
        "a symlink out of the root": (lambda: ifs.verify(good), "out of the checkpoint root"),
        "a skipped checkpoint": (lambda: ifs.latest_verified(run), "skipping"),
        "a root not there": (lambda: ifs.latest_verified(tmp_path / f"none{FAKE}"), "no checkpoints under"),
        "files left behind by upload": (lambda: ifs.upload(good, str(tmp_path / "up")), "not uploading"),
    }
    sums = good / f"SUMS{FAKE}"
    sums.write_text(f"{'0' * 64}  {ifs.MANIFEST_FILENAME}\n")
    checks["a manifest file that lists ours"] = (
        lambda: ifs.verify(good, manifest=str(sums)),
        "left out",
    )
    unescaped = []
    for what, (call, phrase) in checks.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="integrity_fs"), contextlib.suppress(Exception):
            call()
        lines = [m for m in caplog.messages if phrase in m]
        assert lines, (what, caplog.text)
        unescaped += [(what, m) for m in lines if not m.isprintable()]
    assert not unescaped


# --- backend errors are storage errors: never corruption, never success ------------------------------
#
# Retries are the stores' own libraries' (botocore/s3fs, gcsfs): integrity_fs adds no layer of its own.


class FaultyFS(MemoryFileSystem):
    """A memory filesystem whose reads of chosen files fail in chosen ways."""

    protocol = "faulty"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults: dict[str, list[BaseException | str]] = {}
        self.reads: dict[str, int] = {}

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        name = path.rsplit("/", 1)[-1]
        if name != MANIFEST_FILENAME:
            self.reads[name] = self.reads.get(name, 0) + 1
            queue = self.faults.get(name)
            if queue:
                fault = queue.pop(0)
                if fault == "short":
                    data = super().cat_file(path, start, end, **kwargs)
                    return data[: len(data) // 2]
                raise fault  # type: ignore[misc]
        return super().cat_file(path, start, end, **kwargs)


@pytest.fixture
def faulty() -> Any:
    fs = FaultyFS(skip_instance_cache=True)
    root = f"/faulty-{uuid.uuid4().hex}"
    for name in ("a.bin", "b.bin"):
        fs.pipe_file(f"{root}/{name}", os.urandom(100_000))
    ifs.seal(root, fs=fs)
    fs.reads.clear()
    yield fs, root
    fs.rm(root, recursive=True)


def _s3fs_style_timeout() -> IndexError:
    """What s3fs raises on a ranged-read timeout: ``ex.args[0]`` on an ``FSTimeoutError()``."""
    try:
        raise FSTimeoutError
    except FSTimeoutError as timeout:
        try:
            timeout.args[0]
        except IndexError as wrapped:
            return wrapped
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("fault", "raised"),
    [
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), ConnectionResetError),
        ("short", OSError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), TimeoutError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), ConnectionError),
        (_s3fs_style_timeout(), TimeoutError),
        (FSTimeoutError(), TimeoutError),
        (PermissionError(errno.EACCES, "denied"), PermissionError),
    ],
    ids=[
        "reset",
        "short-read",
        "botocore-timeout",
        "botocore-connect",
        "indexerror-from-timeout",
        "fstimeout",
        "denied",
    ],
)
def test_a_storage_failure_is_an_oserror_naming_the_file_not_corruption(faulty, fault, raised):
    """Whatever the backend raises, and however it wraps it (s3fs turns a timeout into an
    ``IndexError``): an ``OSError`` of the right kind naming the file, never damage, never "gone"."""
    fs, root = faulty
    fs.faults["a.bin"] = [fault] * 10
    with pytest.raises(raised) as err:
        ifs.verify(root, fs=fs, max_workers=1)
    assert not isinstance(err.value, (IntegrityError, FileNotFoundError))
    assert "a.bin" in str(err.value)
    if isinstance(fault, OSError) and fault.errno:
        assert err.value.errno == fault.errno  # its class and errno kept
    if fault == "short":
        assert "changed while it was read" in str(err.value)  # fewer bytes than listed


def test_self_retrying_backends_are_not_retried_more(s3_backend: Backend) -> None:
    """s3fs retries a request itself; a failure it gave up on is raised as it is, not retried
    again (each layer of retries multiplies the wait of an outage)."""
    from s3fs import S3FileSystem

    calls: list[str] = []

    class Resetting(S3FileSystem):  # type: ignore[misc]
        cachable = False

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "get_object" and kwargs.get("Key", "").endswith("a.bin"):
                calls.append(kwargs["Key"])
                raise ConnectionResetError("reset by peer")
            return await super()._call_s3(method, *args, **kwargs)

    b = s3_backend
    b.write("a.bin", b"weights")
    ifs.seal(b.url, storage_options=b.storage_options)
    fs = Resetting(**b.storage_options)
    with pytest.raises(ConnectionResetError, match="a.bin"):
        ifs.verify(b.root, fs=fs)
    assert 1 <= len(calls) <= fs.retries  # s3fs's own attempts at most, none added


def test_a_plain_bug_is_not_mistaken_for_a_storage_error(faulty):
    fs, root = faulty
    fs.faults["a.bin"] = [IndexError("a bug, not storage")]
    with pytest.raises(IndexError, match="a bug"):
        ifs.verify(root, fs=fs)


def test_failed_seal_leaves_the_previous_manifest_untouched(faulty):
    fs, root = faulty
    before = fs.cat_file(f"{root}/{MANIFEST_FILENAME}")
    fs.pipe_file(f"{root}/a.bin", b"changed")
    fs.faults["b.bin"] = [PermissionError("denied")]
    with pytest.raises(PermissionError):
        ifs.seal(root, fs=fs, overwrite=True)
    assert fs.cat_file(f"{root}/{MANIFEST_FILENAME}") == before


def test_unreachable_object_store_is_a_connection_error(tmp_path):
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        ifs.verify("s3://bucket/run", storage_options=options)


# --- local disks without the POSIX-only calls --------------------------------------------------------


def test_importing_and_verifying_without_the_posix_only_calls(tmp_path: Path) -> None:
    """macOS and Windows lack some of os.readv, os.preadv, os.O_NONBLOCK, os.fchmod (and
    /proc): with them gone before `import integrity_fs`, sealing, verifying (a flipped bit caught),
    downloading and the manifest's permissions still work."""
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "small.bin").write_bytes(b"s" * 100)
    (tmp_path / "ckpt" / "sub" / "large.bin").write_bytes(os.urandom(3 << 20))
    script = f"""
import os
for name in ("readv", "preadv", "O_NONBLOCK", "fchmod"):
    if hasattr(os, name):
        delattr(os, name)
real_open = open
def no_proc(file, *args, **kwargs):
    if str(file).startswith("/proc/"):
        raise FileNotFoundError(file)
    return real_open(file, *args, **kwargs)
import builtins
builtins.open = no_proc
os.umask(0o022)
import integrity_fs
root = {str(tmp_path / "ckpt")!r}
integrity_fs.seal(root, granularity="chunk", chunk_size=1 << 20)
assert oct(os.stat(os.path.join(root, integrity_fs.MANIFEST_FILENAME)).st_mode & 0o777) == "0o644"
assert integrity_fs.verify(root).files_checked == 2
integrity_fs.download(root, {str(tmp_path / "copy")!r})
with open(os.path.join(root, "sub", "large.bin"), "r+b") as f:
    f.seek(1 << 20)
    byte = f.read(1)
    f.seek(1 << 20)
    f.write(bytes([byte[0] ^ 1]))
try:
    integrity_fs.verify(root)
except integrity_fs.IntegrityError as exc:
    assert [p.path for p in exc.report.problems] == ["sub/large.bin"], exc
else:
    raise AssertionError("the flipped bit went unseen")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    assert ifs.verify(tmp_path / "copy").files_checked == 2


def test_two_reads_of_one_file_on_the_memory_file_system_each_get_their_own_bytes() -> None:
    """fsspec's memory file system hands every opener the one ``BytesIO`` it stores (and rewinds
    it): two verified reads of one file, interleaved, must still each read their own range."""
    fs = MemoryFileSystem(skip_instance_cache=True)
    root = f"/shared-{uuid.uuid4().hex}"
    data = bytes(range(256)) * 1024
    fs.pipe_file(f"{root}/w.bin", data)
    ifs.seal(root, fs=fs, granularity="chunk", chunk_size=4096)
    try:
        with ifs.open(root, "w.bin", fs=fs) as first, ifs.open(root, "w.bin", fs=fs) as second:
            second.seek(100_000)
            got_first, got_second = [], []
            for _ in range(8):
                got_first.append(first.read(1000))
                got_second.append(second.read(1000))
        assert b"".join(got_first) == data[:8000] and b"".join(got_second) == data[100_000:108_000]
    finally:
        fs.rm(root, recursive=True)
