"""download, upload and copy keep verify's rules (issue 10 items 2, 8, 10): exactly the sealed bytes
(each read confirms the end of the source), a stop that ends every worker at once and leaves
nothing of ours behind, special files never opened, and storage's retry policy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import Backend, sigint_as_in_a_terminal
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError
from integrity_fs.transfer import STAGING_MARK


def _problems(err: pytest.ExceptionInfo[IntegrityError]) -> dict[str, tuple[str, Any, Any]]:
    return {p.path: (p.kind, p.expected, p.actual) for p in err.value.report.problems}


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]


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


# --------------------------------------------------------------------------- exactly the sealed bytes

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


def test_a_source_file_deleted_after_the_listing_is_missing(s3_backend: Backend, tmp_path: Path) -> None:
    _sealed(s3_backend, {"a.bin": DATA, "b.bin": b"steady"})
    with pytest.raises(IntegrityError) as err:
        ifs.download(
            s3_backend.url,
            tmp_path / "d",
            storage_options=s3_backend.storage_options,
            callback=_OnStart(_rewrite(s3_backend, "a.bin", None)),
        )
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("a.bin", "missing")]
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- only regular files


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
    assert "sub/pipe" in caplog.text and "FIFO" in caplog.text
    assert s3_backend.listdir() == [MANIFEST_FILENAME, "w.bin"]


@pytest.mark.timeout(30)
def test_a_sealed_file_turned_into_a_fifo_is_missing_never_opened(tmp_path: Path, s3_backend: Backend) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(DATA)
    (src / "b.bin").write_bytes(b"steady")
    ifs.seal(src)

    def swap() -> None:
        (src / "a.bin").unlink()
        os.mkfifo(src / "a.bin")

    with pytest.raises(IntegrityError) as err:
        ifs.upload(src, s3_backend.url, storage_options=s3_backend.storage_options, callback=_OnStart(swap))
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("a.bin", "missing")]
    assert MANIFEST_FILENAME not in s3_backend.listdir()
    with pytest.raises(IntegrityError) as err:  # already a FIFO at the listing: missing as well
        ifs.copy(src, tmp_path / "copy")
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("a.bin", "missing")]


# --------------------------------------------------------------------------- retries as storage's


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


def test_transient_source_failures_are_retried_as_storage_does(
    s3_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sealed(s3_backend, {"a.bin": DATA})
    calls = _fail_gets(
        s3_backend.fs, monkeypatch, "a.bin", lambda: ConnectionResetError("reset") if len(calls) == 1 else None
    )
    report = ifs.download(s3_backend.url, tmp_path / "d", fs=s3_backend.fs)
    assert report.ok and (tmp_path / "d" / "a.bin").read_bytes() == DATA
    assert len(calls) == 2

    calls = _fail_gets(s3_backend.fs, monkeypatch, "a.bin", lambda: ConnectionResetError("reset by peer"))
    with pytest.raises(ConnectionResetError, match=r"a\.bin"):
        ifs.download(s3_backend.url, tmp_path / "e", fs=s3_backend.fs)
    assert len(calls) == 2  # s3fs already retries each request itself: ours do not multiply its own
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_a_refused_read_is_not_retried(s3_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _sealed(s3_backend, {"a.bin": DATA})
    calls = _fail_gets(s3_backend.fs, monkeypatch, "a.bin", lambda: PermissionError("access denied"))
    with pytest.raises(PermissionError):
        ifs.download(s3_backend.url, tmp_path / "d", fs=s3_backend.fs)
    assert len(calls) == 1


# --------------------------------------------------------------------------- a stop ends every worker


class StallingProxy:
    """A TCP proxy in front of the moto server that forwards every request, except GETs of objects
    whose key ends in ``stall``: those it accepts and never answers (a server that hangs)."""

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
        # Short backend timeouts, so that the old code fails the timing assertions instead of hanging.
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint},
            "config_kwargs": {"read_timeout": 8, "retries": {"max_attempts": 1}},
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
        self.proxy.stalled.wait(10)
        raise KeyboardInterrupt


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_stalled_download_returns_at_once_and_leaves_nothing(
    stalling: tuple[Backend, StallingProxy], tmp_path: Path
) -> None:
    b, proxy = stalling
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        ifs.download(
            b.url, tmp_path / "out" / "dest", storage_options=proxy.options(), callback=_InterruptOnceStalled(proxy)
        )
    assert time.perf_counter() - started < 2.0
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
    started = time.perf_counter()
    with pytest.raises(PermissionError):
        ifs.download(b.root, tmp_path / "dest", fs=fs, max_workers=3)
    assert time.perf_counter() - started < 2.0
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
        url, options, listdir = str(tmp_path / "dst"), None, lambda: sorted(os.listdir(tmp_path / "dst"))
    else:
        b: Backend = request.getfixturevalue(store)
        url, options, listdir = b.url, b.storage_options, b.listdir

    class InterruptMidFile(Callback):  # type: ignore[misc]
        def relative_update(self, inc: int = 1) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ifs.copy(src, url, dst_options=options, callback=InterruptMidFile())
    assert "a.bin" not in listdir()


@pytest.mark.timeout(60)
def test_cli_download_exits_at_once_on_sigint_during_a_stalled_read(
    stalling: tuple[Backend, StallingProxy], tmp_path: Path
) -> None:
    b, proxy = stalling
    dest = tmp_path / "out" / "dest"
    command = [sys.executable, "-m", "integrity_fs", "download", b.url, str(dest), "--no-progress"]
    command += ["-o", "key=testing", "-o", "secret=testing", "-o", f"client_kwargs.endpoint_url={proxy.endpoint}"]
    command += ["-o", "config_kwargs.read_timeout=8", "-o", "config_kwargs.retries.max_attempts=1"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal
    )
    try:
        assert proxy.stalled.wait(30), "the download never reached the stalled object"
        time.sleep(0.3)  # the other files are being copied, the stalled one waits
        proc.send_signal(signal.SIGINT)
        sent = time.perf_counter()
        _, stderr = proc.communicate(timeout=30)
        elapsed = time.perf_counter() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert elapsed < 2.0
    assert not (tmp_path / "out").exists() or not [n for n in os.listdir(tmp_path / "out") if STAGING_MARK in n]
    assert not dest.exists()
