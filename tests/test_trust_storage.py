"""Trust at the storage layer: local paths stay local, reads confirm the end of each file, listings
come from the store, folder markers and special files are not content, nothing blocks or outlives
a stopped call, wrapped backend errors are storage errors, and the manifest honours the umask."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import Backend
from fsspec.asyn import AsyncFileSystem
from fsspec.callbacks import Callback
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError


def _problems(err: pytest.ExceptionInfo[IntegrityError]) -> dict[str, tuple[str, Any, Any]]:
    return {p.path: (p.kind, p.expected, p.actual) for p in err.value.report.problems}


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]  # the hashing pool


# 1. A string with no protocol is a local path.


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


# 2. Reads confirm the end of the file.


class _GrowWhenHashingStarts(Callback):  # type: ignore[misc]
    """Appends to a file after the listing, just before the first byte is read."""

    def __init__(self, grow: Any) -> None:
        super().__init__()
        self.grow = grow

    def set_size(self, size: int) -> None:
        self.grow()
        super().set_size(size)


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
    changed = _GrowWhenHashingStarts(lambda: backend.write("a.bin", new))
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
        changed = _GrowWhenHashingStarts(lambda new=new: fs.pipe_file(f"{root}/a.bin", new))
        with pytest.raises(IntegrityError) as err:
            ifs.verify(root, fs=fs, callback=changed)
        assert _problems(err) == {"a.bin": ("size", 2500, size)}
        fs.pipe_file(f"{root}/a.bin", data)
    fs.rm(root, recursive=True)


def test_an_empty_file_that_grew_after_the_listing_is_a_file_changed_error(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    ifs.seal(tmp_path)
    grown = _GrowWhenHashingStarts(lambda: (tmp_path / "empty.bin").write_bytes(b"now full"))
    with pytest.raises(ifs.FileChangedError, match=r"empty\.bin"):
        ifs.verify(tmp_path, callback=grown)


def test_seal_refuses_a_file_that_grew_while_it_was_read(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"first")
    grown = _GrowWhenHashingStarts(lambda: (tmp_path / "a.bin").write_bytes(b"first and more"))
    with pytest.raises(OSError, match=r"a\.bin"):
        ifs.seal(tmp_path, callback=grown)
    assert not (tmp_path / MANIFEST_FILENAME).exists()


# 5. Fresh truth: no cache filled earlier in the process.


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


# 6. Folder markers are directories.


@pytest.mark.parametrize("store", ["s3_backend", "gcs_backend"])
def test_folder_markers_are_directories_not_files(store, request):
    b: Backend = request.getfixturevalue(store)
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


# 8. FIFOs, sockets and devices are never opened.


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
        ifs.verify(tmp_path, callback=_GrowWhenHashingStarts(swap))
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


# 10. A stop (Ctrl-C, first failure) ends every worker at once; no thread outlives the call.


class _SlowFile(io.RawIOBase):
    """A file that trickles: each read waits a little and returns at most 16 KiB."""

    def __init__(self, data: bytes, fail: BaseException | None = None) -> None:
        self.data, self.pos, self.fail = data, 0, fail

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self.fail is not None:
            raise self.fail
        time.sleep(0.01)
        n = min(len(buf), 16 * 1024, len(self.data) - self.pos)
        buf[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


class SlowFS(MemoryFileSystem):
    protocol = "slowfs"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail: dict[str, BaseException] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        return _SlowFile(self.cat_file(path), self.fail.get(path.rsplit("/", 1)[-1]))


@pytest.fixture
def slow() -> Any:
    fs = SlowFS(skip_instance_cache=True)
    root = f"/slow-{uuid.uuid4().hex}"
    for i in range(4):
        fs.pipe_file(f"{root}/f{i}.bin", os.urandom(2 * 1024 * 1024))  # 128 slow reads each: > 1 s
    fs.pipe_file(f"{root}/bad.bin", b"x")
    ifs.seal(root, fs=MemoryFileSystem(skip_instance_cache=True))  # the same store, read fast
    yield fs, root
    fs.rm(root, recursive=True)


@pytest.mark.timeout(30)
def test_ctrl_c_stops_every_worker_before_the_call_returns(slow, ctrl_c):
    fs, root = slow
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # a real Ctrl-C
    started = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ifs.verify(root, fs=fs, max_workers=4)
    elapsed = time.perf_counter() - started
    assert _workers_alive() == []
    assert elapsed < 1.0


@pytest.mark.timeout(30)
def test_the_first_failure_stops_the_other_workers(slow):
    fs, root = slow
    fs.fail["bad.bin"] = PermissionError("denied")
    started = time.perf_counter()
    with pytest.raises(PermissionError):
        ifs.verify(root, fs=fs, max_workers=5)
    assert time.perf_counter() - started < 0.8
    assert _workers_alive() == []


class _Stream:
    def __init__(self, fs: StallingFS, path: str) -> None:
        self.fs, self.path, self.pos = fs, path, 0

    async def read(self, n: int = -1) -> bytes:
        if self.path.endswith("stalled.bin"):
            self.fs.stalling.set()
            try:
                await asyncio.sleep(3600)  # a server that accepted the request and never answers
            except asyncio.CancelledError:
                self.fs.cancelled = True
                raise
        else:  # the other file's bytes (and so the interrupt) come once the stalled read is waiting
            while not self.fs.stalling.is_set():
                await asyncio.sleep(0.01)
        data = self.fs.files[self.path][self.pos : self.pos + (n if n >= 0 else None)]  # type: ignore[operator]
        self.pos += len(data)
        return data

    async def close(self) -> None:
        pass


class StallingFS(AsyncFileSystem):  # type: ignore[misc]
    """An async store whose streamed GET of ``stalled.bin`` never delivers a byte."""

    protocol = "stalling"

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(skip_instance_cache=True)
        self.files = files
        self.cancelled = False
        self.stalling = threading.Event()

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = path.rstrip("/")
        if path in self.files:
            return {"name": path, "size": len(self.files[path]), "type": "file"}
        if any(name.startswith(path + "/") for name in self.files):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        path = path.rstrip("/")
        out = {}
        for name in self.files:
            if name.startswith(path + "/"):
                child = path + "/" + name[len(path) + 1 :].split("/")[0]
                out[child] = await self._info(child)
        if not out:
            raise FileNotFoundError(path)
        return list(out.values()) if detail else list(out)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path][start:end]

    async def open_async(self, path: str, mode: str = "rb", **kwargs: Any) -> _Stream:
        return _Stream(self, path)


class _InterruptOnProgress(Callback):  # type: ignore[misc]
    def relative_update(self, inc: int = 1) -> None:
        raise KeyboardInterrupt


@pytest.mark.timeout(30)
def test_ctrl_c_cancels_a_stalled_object_store_read(tmp_path):
    (tmp_path / "moving.bin").write_bytes(os.urandom(1000))
    (tmp_path / "stalled.bin").write_bytes(os.urandom(1000))
    ifs.seal(tmp_path)
    files = {f"ck/{p.name}": p.read_bytes() for p in tmp_path.iterdir()}
    fs = StallingFS(files)
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        ifs.verify("ck", fs=fs, max_workers=2, callback=_InterruptOnProgress())
    assert time.perf_counter() - started < 2.0
    assert _workers_alive() == []
    assert fs.cancelled


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


# 11. Badly wrapped backend errors are storage errors.


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


class FaultyFS(MemoryFileSystem):
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
def faulty() -> Any:
    fs = FaultyFS(skip_instance_cache=True)
    root = f"/chain-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/a.bin", os.urandom(1000))
    ifs.seal(root, fs=fs)
    fs.opens = 0
    yield fs, root
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("make", [_s3fs_style_timeout, FSTimeoutError], ids=["indexerror-from-timeout", "fstimeout"])
def test_a_timeout_wrapped_in_another_exception_is_a_retried_timeout_error(faulty, make):
    fs, root = faulty
    fs.faults = [make(), make()]
    assert ifs.verify(root, fs=fs).ok
    assert fs.opens == 3
    fs.faults = [make() for _ in range(5)]
    with pytest.raises(TimeoutError, match=r"a\.bin"):
        ifs.verify(root, fs=fs)


def test_a_plain_bug_is_not_mistaken_for_a_storage_error(faulty):
    fs, root = faulty
    fs.faults = [IndexError("a bug, not storage")]
    with pytest.raises(IndexError):
        ifs.verify(root, fs=fs)


# 14. The manifest honours the umask.


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_the_manifest_is_written_with_the_umask_permissions(tmp_path, umask, mode):
    (tmp_path / "w.bin").write_bytes(b"weights")
    old = os.umask(umask)
    try:
        ifs.seal(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / MANIFEST_FILENAME).st_mode) == mode


# 17. DirFileSystem over a sync filesystem.


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


# 18. Special files stay special through any wrapper over a local filesystem.


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


# 19. A key and a folder of one name (object stores only) cannot be copied to a disk: refused at the listing.


def test_seal_refuses_a_file_that_is_also_a_folder_before_reading_anything(s3_backend: Backend, monkeypatch):
    s3_backend.write("sub", b"a key named like the folder beside it")
    s3_backend.write("sub/x.bin", b"weights")
    s3_backend.write("w.bin", b"more")
    hashed: list[str] = []
    real = ifs.storage.hash_range
    monkeypatch.setattr(
        ifs.storage, "hash_range", lambda fs, path, *a, **k: hashed.append(path) or real(fs, path, *a, **k)
    )
    options = s3_backend.storage_options
    with pytest.raises(ValueError, match=r"'sub' is a file and also a folder holding 'sub/x.bin'"):
        ifs.seal(s3_backend.url, storage_options=options)
    assert hashed == [] and MANIFEST_FILENAME not in s3_backend.listdir()
    assert ifs.storage.file_folder_clashes(["sub", "sub/x.bin", "sub/y/z", "a", "ab/c"]) == [("sub", "sub/x.bin")]
