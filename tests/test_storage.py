"""The storage layer through the public API: URLs, listings (fresh, from the store), reads pinned
to the listed version, symlinks and special files, retries, and backend errors that are storage
errors (never corruption, never success)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import socket
import stat
import subprocess
import sys
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


@pytest.fixture(autouse=True)
def no_backoff_between_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries run as they do, without the waits between them: these tests count attempts and name
    errors, never time them (0.2 s, then 0.4 s, per exhausted read otherwise)."""
    monkeypatch.setattr("integrity_fs.storage.calls._RETRY_DELAY_S", 0.0)


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


def test_entries_that_vanish_while_the_tree_is_listed_are_not_a_storage_error(tmp_path: Path, monkeypatch) -> None:
    """Another process creating and removing temporary files beside an intact checkpoint: a file or
    directory removed between the directory read and its stat is simply not there (a listed one
    would be "missing"), never a raw FileNotFoundError that reads as "no checkpoint"."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "w.bin").write_bytes(b"weights")
    ifs.seal(root)
    real_scandir = os.scandir

    class Listed:
        def __init__(self, path: str) -> None:
            with real_scandir(path) as entries:
                self.entries = list(entries)  # read, then the other process removes its files

        def __enter__(self) -> list[os.DirEntry[str]]:
            for victim in (root / "scratch.tmp", root / "scratch" / "x", root / "scratch", root / "link"):
                if victim.is_symlink() or victim.is_file():
                    victim.unlink()
                elif victim.is_dir():
                    victim.rmdir()
            return self.entries

        def __exit__(self, *exc: object) -> None:
            pass

    for call in (lambda: ifs.verify(root, strict=True), lambda: ifs.seal(root, overwrite=True)):
        (root / "scratch").mkdir()
        (root / "scratch" / "x").write_bytes(b"")
        (root / "scratch.tmp").write_bytes(b"partial")
        (root / "link").symlink_to(root / "scratch.tmp")
        monkeypatch.setattr(os, "scandir", Listed)
        result = call()
        monkeypatch.setattr(os, "scandir", real_scandir)
        if isinstance(result, ifs.Manifest):
            assert list(result.files) == ["sub/w.bin"]
        else:
            assert result.ok and result.extra == ()


def _after_listing(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    """Run ``change`` right after every listing of content (another process at work meanwhile)."""
    real = ifs.storage.list_files

    def listing(*args: Any, **kwargs: Any) -> dict[str, int]:
        found = real(*args, **kwargs)
        change()
        return found

    monkeypatch.setattr(ifs.storage, "list_files", listing)


def test_a_file_replaced_by_a_directory_after_the_listing_is_missing(tmp_path, monkeypatch, caplog):
    """Not a storage error: a file that is a directory now is not there, as a vanished one."""
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w.bin").write_bytes(os.urandom(1000))
        ifs.seal(tmp_path / name)
    target = tmp_path / "step_2" / "w.bin"

    def swap() -> None:
        if target.is_file():
            target.unlink()
            target.mkdir()

    _after_listing(monkeypatch, swap)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path / "step_2")
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("w.bin", "missing")]
    target.rmdir()
    target.write_bytes(b"again")
    found = ifs.latest_verified(tmp_path)
    assert found is not None and found[0] == str(tmp_path / "step_1")
    assert "step_2 (damaged)" in caplog.text


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
def test_on_a_store_without_versions_a_file_that_changed_size_is_a_size_problem(granularity):
    """Nothing to pin to: each read still confirms the end of the file, and the store's size now
    says shorter; either way a "size" problem, never an OK."""
    fs = _Unversioned(skip_instance_cache=True)
    root = f"/unversioned-{os.getpid()}-{granularity}"
    data = os.urandom(2500)
    fs.pipe_file(f"{root}/a.bin", data)
    chunk_size = 1000 if granularity == "chunk" else None
    ifs.seal(root, fs=fs, granularity=granularity, chunk_size=chunk_size)
    for new, size in ((data + b"appended", 2508), (data[:1700], 1700)):
        changed = AfterListing(lambda new=new: fs.pipe_file(f"{root}/a.bin", new))
        with pytest.raises(IntegrityError) as err:
            ifs.verify(root, fs=fs, callback=changed)
        assert _problems(err) == {"a.bin": ("size", 2500, size)}
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
def test_a_symlink_swapped_in_after_the_listing_is_never_followed_out_of_the_root(
    tmp_path, monkeypatch, caplog, granularity
):
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
        if not target.is_symlink():
            target.unlink()
            target.symlink_to(outside)

    _after_listing(monkeypatch, swap)
    with pytest.raises(ifs.FileChangedError, match="w.bin"):
        ifs.verify(run / "step_2")
    target.unlink()
    target.write_bytes(data)
    found = ifs.latest_verified(run)
    assert found is not None and found[0] == str(run / "step_1")
    assert "step_2 (changed while it was read)" in caplog.text
    target.unlink()
    target.write_bytes(data)
    with pytest.raises(ifs.FileChangedError):
        ifs.seal(run / "step_2", overwrite=True)
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

    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path, callback=AfterListing(swap))
    assert [p.kind for p in err.value.report.problems] == ["missing"]


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
    os.mkfifo(run / "step_3" / ifs.SIGNATURE_FILENAME)
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


FAKE = "x\nintegrity-fs: verified ckpt: 3 files"


def test_every_warning_that_names_a_file_or_checkpoint_escapes_it(tmp_path: Path, caplog) -> None:
    """Through the library (whatever handler a program gives its logging): a name with a
    newline cannot add a line to a WARNING, whichever warning it is."""
    run = tmp_path / f"run{FAKE}"
    good, bad = run / "step_1", run / f"step_2{FAKE}"
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
        "a symlink out of the root": (lambda: ifs.verify(good), "leaves the checkpoint root"),
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


# --- retries: transient failures retried, once per layer ---------------------------------------------


class FaultyFS(MemoryFileSystem):
    """A memory filesystem whose reads of chosen files fail in chosen ways."""

    protocol = "faulty"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults: dict[str, list[BaseException | str]] = {}
        self.opens: dict[str, int] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        name = path.rsplit("/", 1)[-1]
        if "r" in mode:
            self.opens[name] = self.opens.get(name, 0) + 1
            queue = self.faults.get(name)
            if queue:
                fault = queue.pop(0)
                if fault == "short":
                    data = super()._open(path, "rb").read()
                    return io.BytesIO(data[: len(data) // 2])
                raise fault  # type: ignore[misc]
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def faulty() -> Any:
    fs = FaultyFS(skip_instance_cache=True)
    root = f"/faulty-{uuid.uuid4().hex}"
    for name in ("a.bin", "b.bin"):
        fs.pipe_file(f"{root}/{name}", os.urandom(100_000))
    ifs.seal(root, fs=fs)
    fs.opens.clear()
    yield fs, root
    fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    "fault",
    [ConnectionResetError("reset"), "short", botocore.exceptions.ReadTimeoutError(endpoint_url="http://x")],
    ids=["reset", "short-read", "botocore-timeout"],
)
def test_transient_read_errors_are_retried(faulty, fault):
    fs, root = faulty
    fs.faults["a.bin"] = [fault, fault]
    assert ifs.verify(root, fs=fs).ok
    assert fs.opens["a.bin"] == 3


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


class FailingOpensFS(MemoryFileSystem):
    protocol = "faulty-chain"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults: list[BaseException] = []
        self.opens = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode and not path.endswith(MANIFEST_FILENAME):
            self.opens += 1
            if self.faults:
                raise self.faults.pop(0)
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def failing_opens() -> Any:
    fs = FailingOpensFS(skip_instance_cache=True)
    root = f"/chain-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/a.bin", os.urandom(1000))
    ifs.seal(root, fs=fs)
    fs.opens = 0
    yield fs, root
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("make", [_s3fs_style_timeout, FSTimeoutError], ids=["indexerror-from-timeout", "fstimeout"])
def test_a_timeout_wrapped_in_another_exception_is_a_retried_timeout_error(failing_opens, make):
    fs, root = failing_opens
    fs.faults = [make(), make()]
    assert ifs.verify(root, fs=fs).ok
    assert fs.opens == 3
    fs.faults = [make() for _ in range(5)]
    with pytest.raises(TimeoutError, match=r"a\.bin"):
        ifs.verify(root, fs=fs)


def test_self_retrying_backends_are_not_retried_three_times_more(s3_backend: Backend, monkeypatch):
    b = s3_backend
    b.write("a.bin", b"weights")
    ifs.seal(b.root, fs=b.fs)
    calls = []
    call_s3 = b.fs._call_s3

    async def reset(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and kwargs.get("Key", "").endswith("a.bin"):
            calls.append(kwargs["Key"])
            raise ConnectionResetError("reset by peer")
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(b.fs, "_call_s3", reset)
    with pytest.raises(ConnectionResetError):
        ifs.verify(b.root, fs=b.fs)
    assert len(calls) == 2  # s3fs already retries each request itself


def test_a_failure_retried_to_the_end_keeps_its_class_and_errno(faulty):
    fs, root = faulty
    fs.faults["a.bin"] = [ConnectionResetError(errno.ECONNRESET, "reset by peer")] * 10
    with pytest.raises(ConnectionResetError) as err:
        ifs.verify(root, fs=fs, max_workers=1)
    assert err.value.errno == errno.ECONNRESET and "failed 3 times" in str(err.value)
    assert fs.opens["a.bin"] == 3


def test_permission_denied_is_raised_at_once(faulty):
    fs, root = faulty
    fs.faults["b.bin"] = [PermissionError("denied")] * 10
    with pytest.raises(PermissionError):
        ifs.verify(root, fs=fs, max_workers=1)
    assert fs.opens["b.bin"] == 1


# --- backend errors are storage errors: never corruption, never success ------------------------------


@pytest.mark.parametrize(
    ("fault", "raised"),
    [
        (ConnectionResetError("reset"), ConnectionResetError),
        ("short", OSError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), TimeoutError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), ConnectionError),
    ],
    ids=["reset", "short-read", "botocore-timeout", "botocore-connect"],
)
def test_persistent_storage_failure_is_an_oserror_not_corruption(faulty, fault, raised):
    fs, root = faulty
    fs.faults["a.bin"] = [fault] * 10
    with pytest.raises(raised) as err:
        ifs.verify(root, fs=fs)
    assert not isinstance(err.value, (IntegrityError, FileNotFoundError))
    assert "a.bin" in str(err.value)


def test_a_plain_bug_is_not_mistaken_for_a_storage_error(failing_opens):
    fs, root = failing_opens
    fs.faults = [IndexError("a bug, not storage")]
    with pytest.raises(IndexError):
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
    it): two pinned reads of one file, interleaved as the read-ahead threads of a verified read
    interleave them, must still each read their own range."""
    from integrity_fs.storage import read

    fs = MemoryFileSystem(skip_instance_cache=True)
    path = f"/shared-{uuid.uuid4().hex}/w.bin"
    data = bytes(range(256)) * 1024
    fs.pipe_file(path, data)
    first = read.open_range(fs, path, 0, 4096, file_size=len(data))
    second = read.open_range(fs, path, 100_000, 4096, file_size=len(data))
    try:
        got_first, got_second = bytearray(4096), bytearray(4096)
        assert first.readinto(memoryview(got_first)) == 4096
        assert second.readinto(memoryview(got_second)) == 4096
        assert bytes(got_first) == data[:4096] and bytes(got_second) == data[100_000:104_096]
    finally:
        first.close()
        second.close()
    fs.rm(path)
