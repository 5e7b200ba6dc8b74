"""A forced upload or copy onto a sealed checkpoint never leaves less than one complete, verifying
copy of the old or the new checkpoint, whatever fails or is killed; leftovers of killed transfers
are listed and removed, never a live one's; and a destination is never written through a link nor
sealed over bytes replaced after they were confirmed (SPEC "Transfer", issue 36 findings 10-15).

Faults come by real means only: an HTTP proxy in front of moto or the GCS emulator that answers
chosen requests itself (``FaultProxy``: a refusal, or a change made to the store just before the
request goes on), a subprocess killed with SIGKILL while it is held in its progress callback
(``Child``), a progress callback that changes the destination mid-transfer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import fsspec
import pytest
from conftest import Backend, backends
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, FileChangedError, IntegrityError
from integrity_fs.cli import main

SIGNATURE = "model.sig"
LEASE = "_integrity_lease.json"
#: The destination's name inside each test's folder: its parent is that folder (staging goes beside it).
DEST = "step_1"

NEW = {  # model.bin is the largest: with one worker it is sent first
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

store = backends("local", "s3")
remote = backends("s3", "gcs")


# --- trees and where a transfer writes --------------------------------------------------------------


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every entry under ``root`` (links not followed): POSIX name -> bytes; a link -> its target."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            key = path.relative_to(root).as_posix()
            out[key] = f"-> {os.readlink(path)}".encode() if path.is_symlink() else path.read_bytes()
    return out


def files_at(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, bytes]:
    """Every file under ``root`` in ``fs``: name relative to root -> bytes."""
    fs.invalidate_cache()
    prefix = root.rstrip("/") + "/"
    return {p[len(prefix) :]: fs.cat_file(p) for p in sorted(fs.find(root))}


def beside(fs: fsspec.AbstractFileSystem, parent: str, name: str) -> list[str]:
    """The folders a transfer to ``parent/name`` made beside it (``.<name>.…``: staging, leftovers)."""
    fs.invalidate_cache()
    try:
        listed = fs.ls(parent, detail=False)
    except FileNotFoundError:
        return []
    return sorted(p.rstrip("/") for p in listed if p.rstrip("/").rsplit("/", 1)[-1].startswith(f".{name}."))


def verifying(url: str, options: dict[str, Any] | None = None) -> set[str] | None:
    """The files of the checkpoint at ``url`` (those its manifest lists) when it verifies, else
    None (not there, unsealed, damaged, invalid). Not strict: a staging folder may hold a lease."""
    try:
        ifs.verify(url, storage_options=options)
        return set(ifs.read_manifest(url, storage_options=options).files)
    except (OSError, IntegrityError, ValueError):
        return None


def complete_copies(fs: fsspec.AbstractFileSystem, protocol: str, parent: str, options: dict[str, Any]) -> list[str]:
    """Which of the destination and the folders beside it hold a complete copy, verifying, of the
    old or of the new checkpoint (URLs)."""
    found = []
    for path in [f"{parent}/{DEST}", *beside(fs, parent, DEST)]:
        url = f"{protocol}://{path}" if protocol != "file" else path
        if verifying(url, options) in (set(OLD), set(NEW)):
            found.append(url)
    return found


class Store:
    """The destination ``<test folder>/step_1`` on a backend: its URL, options, parent."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.fs = backend.fs
        self.parent = backend.root
        self.path = f"{backend.root}/{DEST}"
        self.url = f"{backend.url}/{DEST}"
        self.protocol = "file" if backend.name == "local" else backend.url.split("://")[0]
        self.options = backend.storage_options
        self.parent_url = backend.url

    def files(self) -> dict[str, bytes]:
        return files_at(self.fs, self.path)

    def beside(self) -> list[str]:
        return beside(self.fs, self.parent, DEST)

    def complete_copies(self) -> list[str]:
        return complete_copies(self.fs, self.protocol, self.parent, self.options)

    def seal_old(self, tmp_path: Path, **kw: Any) -> dict[str, bytes]:
        ifs.upload(write_tree(tmp_path / f"old-{uuid.uuid4().hex}", OLD), self.url, storage_options=self.options, **kw)
        return self.files()


def new_source(tmp_path: Path, files: dict[str, bytes] = NEW, *, sealed: bool = False) -> Path:
    src = write_tree(tmp_path / f"new-{uuid.uuid4().hex}", files)
    if sealed:
        ifs.seal(src)
    return src


def forced(how: str, src: Path, url: str, options: dict[str, Any] | None, **kw: Any) -> object:
    """``upload`` (of ``src`` as it is) or ``copy`` (of ``src``, sealed) onto ``url`` with ``overwrite=True``."""
    if how == "upload":
        return ifs.upload(src, url, storage_options=options, overwrite=True, **kw)
    return ifs.copy(src, url, dst_options=options, overwrite=True, **kw)


# --- fault injection --------------------------------------------------------------------------------


class Request:
    """What the proxy saw of one request: method, target (path and query) and headers (lowercase)."""

    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.method, self.target = lines[0].split(" ")[:2]
        self.headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            if key:
                self.headers[key.strip().lower()] = value.strip()

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def is_s3_copy(self) -> bool:
        """A CopyObject or UploadPartCopy: a PUT that names its source in a header."""
        return self.method == "PUT" and "x-amz-copy-source" in self.headers


@dataclass(frozen=True)
class Reply:
    """An answer the proxy gives itself instead of forwarding."""

    status: int
    reason: str
    body: bytes
    content_type: str = "application/xml"


#: S3 throttling a request (botocore and s3fs retry it).
SLOW_DOWN = Reply(
    503,
    "Slow Down",
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>",
)
#: S3 unavailable (a 503 that is not a throttle: s3fs passes it on; botocore retries it unless told not to).
SERVICE_UNAVAILABLE = Reply(
    503,
    "Service Unavailable",
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>Service is unable to handle request.</Message><RequestId>fault-proxy</RequestId></Error>",
)
S3_PRECONDITION_FAILED = Reply(
    412,
    "Precondition Failed",
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>'
    b"<Message>At least one of the pre-conditions you specified did not hold</Message>"
    b"<Condition>x-amz-copy-source-If-Match</Condition><RequestId>fault-proxy</RequestId></Error>",
)
GCS_PRECONDITION_FAILED = Reply(
    412, "Precondition Failed", b'{"error": {"code": 412, "message": "conditionNotMet"}}', "application/json"
)
GCS_NO_SUCH_GENERATION = Reply(
    404, "Not Found", b'{"error": {"code": 404, "message": "No such object"}}', "application/json"
)


class FaultProxy:
    """An HTTP proxy on a free port in front of a server (moto, the GCS emulator): every request
    goes through ``hook(request)``, one request per connection; a :class:`Reply` it returns is
    the answer (recorded in ``answered``), ``None`` forwards the request as it is. ``options``:
    storage options that reach the server through the proxy."""

    def __init__(self, upstream: str, hook: Callable[[Request], Reply | None], options: dict[str, Any]) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.hook = hook
        self.answered: list[tuple[Request, Reply]] = []
        self.errors: list[Exception] = []
        self.closing = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.options = json.loads(json.dumps(options).replace(upstream, self.endpoint))
        self.options["skip_instance_cache"] = True
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.close()

    def _accept(self) -> None:
        while not self.closing.is_set():
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
            head, _, body = head.partition(b"\r\n\r\n")
            request = Request(head)
            try:
                reply = self.hook(request)
            except Exception as exc:  # the test's own failure: answered, and raised after the test
                self.errors.append(exc)
                reply = Reply(500, "Proxy Hook Failed", repr(exc).encode(), "text/plain")
            if reply is not None:
                self.answered.append((request, reply))
                self._drain(client, request, body)
                client.sendall(
                    f"HTTP/1.1 {reply.status} {reply.reason}\r\nContent-Type: {reply.content_type}\r\n"
                    f"Content-Length: {len(reply.body)}\r\nConnection: close\r\n\r\n".encode()
                    + reply.body
                )
                return
            # One request per connection, so that every request goes through the hook.
            head = head.replace(b"\r\n", b"\r\nConnection: close\r\n", 1)
            with socket.create_connection(self.upstream) as upstream:
                upstream.sendall(head + b"\r\n\r\n" + body)
                pump = threading.Thread(target=self._pump, args=(client, upstream), daemon=True)
                pump.start()
                self._pump(upstream, client)
                pump.join(5)

    @staticmethod
    def _drain(client: socket.socket, request: Request, body: bytes) -> None:
        """Read the answered request's body, so that the client reads the answer, not a reset."""
        length = int(request.headers.get("content-length", "0") or 0)
        chunked = "chunked" in request.headers.get("transfer-encoding", "")
        client.settimeout(5)
        while (len(body) < length) if not chunked else not body.endswith(b"0\r\n\r\n"):
            data = client.recv(65536)
            if not data:
                return
            body += data

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxies() -> Iterator[Callable[[Backend, Callable[[Request], Reply | None]], FaultProxy]]:
    """Makes a :class:`FaultProxy` in front of a backend's server (S3 or GCS), closed after the test."""
    made: list[FaultProxy] = []

    def make(backend: Backend, hook: Callable[[Request], Reply | None]) -> FaultProxy:
        key = "client_kwargs" if backend.name == "s3" else None
        upstream = backend.storage_options[key]["endpoint_url"] if key else backend.storage_options["endpoint_url"]
        made.append(FaultProxy(upstream, hook, backend.storage_options))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()
    for proxy in made:
        if proxy.errors:
            raise proxy.errors[0]


def copy_source(request: Request) -> str | None:
    """The object (``bucket/key``) a store-side copy reads: S3 CopyObject or UploadPartCopy,
    GCS rewriteTo or copyTo; ``None`` for any other request."""
    if request.is_s3_copy():
        return unquote(request.headers["x-amz-copy-source"].partition("?")[0]).lstrip("/")
    match = re.search(r"/b/([^/]+)/o/([^/]+)/(?:rewriteTo|copyTo)/", request.path)
    return f"{match[1]}/{unquote(match[2])}" if match else None


def honour_copy_preconditions(fs: fsspec.AbstractFileSystem) -> Callable[[Request], Reply | None]:
    """What S3 and GCS do with a copy pinned to the source's version, and moto and the emulator
    do not: S3 refuses (412) a copy whose ``x-amz-copy-source-if-match`` is not the source's ETag
    now; GCS one whose ``ifSourceGenerationMatch`` is not its generation (412), or whose
    ``sourceGeneration`` is gone (404). ``fs`` reaches the server directly."""

    def check(request: Request) -> Reply | None:
        source = copy_source(request)
        if source is None:
            return None
        fs.invalidate_cache()
        try:
            info = fs.info(source)
        except FileNotFoundError:
            return None  # the store answers that itself
        if request.is_s3_copy():
            wanted = request.headers.get("x-amz-copy-source-if-match")
            if wanted is not None and wanted.strip('"') != str(info["ETag"]).strip('"'):
                return S3_PRECONDITION_FAILED
            return None
        query = parse_qs(request.target.partition("?")[2])
        generation = str(info.get("generation"))
        if "ifSourceGenerationMatch" in query and query["ifSourceGenerationMatch"][0] != generation:
            return GCS_PRECONDITION_FAILED
        if "sourceGeneration" in query and query["sourceGeneration"][0] != generation:
            return GCS_NO_SUCH_GENERATION
        return None

    return check


# --- 10: a failure during the swap ------------------------------------------------------------------


GCS_FORBIDDEN = Reply(403, "Forbidden", b'{"error": {"code": 403, "message": "Forbidden"}}', "application/json")


def _writes_to(name: str) -> Callable[[Request], bool]:
    """Every write (PUT, POST: an object, a part, a store-side copy) of ``<destination>/name``,
    never of the staging folder's object of that name (``.step_1.…/name``)."""
    return lambda r: (
        r.method in ("PUT", "POST") and re.search(rf"/{DEST}/{re.escape(name)}($|\?|&)", unquote(r.target)) is not None
    )


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_forced_transfer_refused_during_the_swap_leaves_a_complete_verifying_copy(
    remote: Backend, proxies: Callable[..., FaultProxy], tmp_path: Path, how: str
) -> None:
    """The store refuses, every time, the write of optim.bin into the destination (S3 with a 503,
    GCS with a 403): only the swap writes there, and the old checkpoint has no optim.bin, so its
    own files are never refused. Afterwards the destination verifies, or the error names a
    folder that does, holding the old or the new checkpoint whole."""
    dst = Store(remote)
    dst.seal_old(tmp_path)
    src = new_source(tmp_path, sealed=how == "copy")
    hit, reply = _writes_to("optim.bin"), SERVICE_UNAVAILABLE if remote.name == "s3" else GCS_FORBIDDEN
    proxy = proxies(remote, lambda r: reply if hit(r) else None)
    options = proxy.options
    if remote.name == "s3":
        options = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}  # botocore: no retries of its own
    error: BaseException | None = None
    try:
        forced(how, src, dst.url, options, max_workers=1)
    except OSError as exc:
        error = exc
    assert proxy.answered, "the destination's optim.bin was never written"
    assert error is not None, "a transfer whose file the store always refused reported success"
    _assert_a_complete_copy_is_left(dst, error)


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_forced_transfer_throttled_once_during_the_swap_leaves_a_complete_verifying_copy(
    s3_backend: Backend, proxies: Callable[..., FaultProxy], tmp_path: Path, how: str
) -> None:
    """S3 answers SlowDown once, to the first write of optim.bin into the destination (the swap)."""
    dst = Store(s3_backend)
    dst.seal_old(tmp_path)
    src = new_source(tmp_path, sealed=how == "copy")
    hit, throttled = _writes_to("optim.bin"), threading.Event()

    def throttle_once(request: Request) -> Reply | None:
        if hit(request) and not throttled.is_set():
            throttled.set()
            return SLOW_DOWN
        return None

    proxy = proxies(s3_backend, throttle_once)
    error: BaseException | None = None
    try:
        forced(how, src, dst.url, {**proxy.options, "config_kwargs": {"retries": {"max_attempts": 1}}}, max_workers=1)
    except OSError as exc:
        error = exc
    assert proxy.answered, "the destination's optim.bin was never written"
    _assert_a_complete_copy_is_left(dst, error)


def _assert_a_complete_copy_is_left(dst: Store, error: BaseException | None) -> None:
    copies = dst.complete_copies()
    assert copies, f"no complete verifying copy of either checkpoint is left (error: {error!r})"
    if dst.url not in copies:
        assert error is not None and any(c.split("://")[-1] in str(error) for c in copies), (
            f"only {copies} verifies, and the error does not say where: {error}"
        )


# --- a transfer in another process, killed --------------------------------------------------------

CHILD = r'''
import json, os, sys, time
from fsspec.callbacks import Callback
import integrity_fs as ifs

args = json.loads(sys.argv[1])


class Pause(Callback):
    """Once more than ``pause_after`` bytes were sent: say so (the ready file), then hold until
    the go file exists."""

    def __init__(self):
        super().__init__()
        self.done = 0

    def relative_update(self, inc=1):
        self.done += inc
        if args["pause_after"] is not None and self.done > args["pause_after"]:
            args["pause_after"] = None
            open(args["ready"], "w").close()
            deadline = time.monotonic() + 600
            while not os.path.exists(args["go"]) and time.monotonic() < deadline:
                time.sleep(0.02)


kw = {"callback": Pause(), "max_workers": 1, "overwrite": True}
if args["how"] == "upload":
    ifs.upload(args["src"], args["url"], storage_options=args["options"], **kw)
else:
    ifs.copy(args["src"], args["url"], dst_options=args["options"], **kw)
open(args["done"], "w").close()
'''


class Child:
    """A forced transfer in a subprocess (this worktree's integrity_fs): it holds (waits in its
    progress callback) once ``pause_after`` bytes were sent, until it is killed or :meth:`go`."""

    def __init__(
        self, tmp_path: Path, how: str, src: Path, url: str, options: dict[str, Any], pause_after: int | None
    ) -> None:
        token = uuid.uuid4().hex[:8]
        self.ready = tmp_path / f"ready-{token}"
        self.done = tmp_path / f"done-{token}"
        self.go_file = tmp_path / f"go-{token}"
        args = {
            "how": how,
            "src": str(src),
            "url": url,
            "options": options,
            "pause_after": pause_after,
            "ready": str(self.ready),
            "done": str(self.done),
            "go": str(self.go_file),
        }
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)], env=env, stderr=subprocess.PIPE, text=True
        )

    def wait_until(self, condition: Callable[[], bool], timeout: float = 60, interval: float = 0.01) -> bool:
        """Polls ``condition`` until it holds (True) or the child ended (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            if self.proc.poll() is not None:
                return condition()
            time.sleep(interval)
        raise AssertionError("the transfer in the child process neither got there nor ended")

    def held(self) -> bool:
        return self.ready.exists()

    def go(self) -> int:
        """Let it go on; its exit status once it ended."""
        self.go_file.touch()
        return self.proc.wait(60)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr else ""


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        if child.proc.poll() is None:
            child.kill()


#: Many small files: the swap renames (or copies) each, so a kill can land while it runs.
SHARDS = {**NEW, **{f"shards/{i:04d}.bin": os.urandom(64) for i in range(1500)}}


def _local_store(tmp_path: Path) -> Store:
    (tmp_path / "store").mkdir()
    return Store(Backend("local", fsspec.filesystem("file"), str(tmp_path / "store"), str(tmp_path / "store"), {}))


def _kill_during_the_swap(dst: Store, tmp_path: Path, children: list[Child]) -> None:
    """A local forced upload of SHARDS onto the old checkpoint sealed at ``dst``, SIGKILLed as
    soon as the old checkpoint's manifest is gone (the swap has begun), or left to finish when
    that never happens."""
    dst.seal_old(tmp_path)
    manifest = Path(dst.path, MANIFEST_FILENAME)
    child = Child(tmp_path, "upload", new_source(tmp_path, SHARDS), dst.url, {}, None)
    children.append(child)
    if child.wait_until(lambda: not manifest.exists(), interval=0):
        child.kill()
    else:
        assert child.proc.wait(30) == 0, child.stderr()


def test_a_forced_upload_killed_during_the_swap_leaves_a_complete_verifying_copy(
    tmp_path: Path, children: list[Child]
) -> None:
    """A local forced upload of 1,504 files, SIGKILLed as soon as the old checkpoint's manifest is
    gone: the destination, or a folder beside it, verifies whole (the old or the new checkpoint)."""
    dst = _local_store(tmp_path)
    _kill_during_the_swap(dst, tmp_path, children)
    candidates = [dst.path, *dst.beside()]
    found = [path for path in candidates if verifying(path) in (set(OLD), set(SHARDS))]
    assert found, f"after a kill during the swap, nothing verifies: {candidates}"


# --- 11: preconditions before the first change -----------------------------------------------------


#: An entry the sealed destination holds beyond its manifest (extras are allowed), and the new
#: checkpoint's file that clashes with it: a local disk cannot hold both.
CLASHES = {
    "file-where-a-folder-goes": ("logs", "logs/events.txt"),
    "folder-where-a-file-goes": ("z.txt/notes.txt", "z.txt"),
}


@pytest.mark.parametrize("clash", sorted(CLASHES))
@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_name_clash_with_the_destination_refuses_a_forced_transfer_before_any_change(
    tmp_path: Path, how: str, clash: str
) -> None:
    """The sealed destination also holds an extra file ``logs`` where the new checkpoint has a
    folder ``logs/`` (or a folder ``z.txt/`` where it has a file): the transfer is refused before
    the old checkpoint is touched, which still verifies, and nothing of it is left beside."""
    extra, clashing = CLASHES[clash]
    dst = tmp_path / "store" / DEST
    ifs.upload(write_tree(tmp_path / "old", OLD), dst)
    write_tree(dst, {extra: b"the user's, not part of the checkpoint\n"})
    assert list(ifs.verify(dst).extra) == [extra]
    before = tree(dst)
    src = new_source(tmp_path, {**NEW, clashing: b"the new checkpoint's\n"}, sealed=how == "copy")
    with pytest.raises((ValueError, OSError)) as caught:
        forced(how, src, str(dst), None, max_workers=1)
    assert tree(dst) == before, f"the destination was changed before the refusal ({caught.value!r})"
    assert ifs.verify(dst).files_checked == len(OLD)
    assert beside(fsspec.filesystem("file"), str(dst.parent), DEST) == []


# --- 12: a checkpoint sealed only by a signature ------------------------------------------------------


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An EC key pair as PEM files: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = tmp_path_factory.mktemp("keys")
    private_key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / "key.pem", folder / "key.pub"
    private.write_bytes(
        private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _signed_only(tmp_path: Path, private: Path) -> Path:
    """OLD signed by model_signing (its Python API, as its CLI signs): model.sig, no manifest."""
    import model_signing

    root = write_tree(tmp_path / "signed" / DEST, OLD)
    hashing = model_signing.hashing.Config()  # type: ignore[no-untyped-call]
    hashing.set_ignored_paths(paths=[SIGNATURE, MANIFEST_FILENAME])
    config = model_signing.signing.Config()  # type: ignore[no-untyped-call]
    config.use_elliptic_key_signer(private_key=private)
    config.set_hashing_config(hashing).sign(root, root / SIGNATURE)
    return root


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_destination_sealed_only_by_a_signature_refuses_a_transfer_without_overwrite(
    store: Backend, tmp_path: Path, key: tuple[Path, Path], how: str
) -> None:
    private, public = key
    dst = Store(store)
    signed = _signed_only(tmp_path, private)
    for path in sorted(signed.rglob("*")):
        if path.is_file():
            store.write(f"{DEST}/{path.relative_to(signed).as_posix()}", path.read_bytes())
    before = dst.files()
    assert sorted(before) == sorted([*OLD, SIGNATURE])
    assert ifs.verify(dst.url, storage_options=dst.options, public_key=str(public)).files_checked == len(OLD)
    src = new_source(tmp_path, sealed=how == "copy")
    with pytest.raises(FileExistsError):
        if how == "upload":
            ifs.upload(src, dst.url, storage_options=dst.options)
        else:
            ifs.copy(src, dst.url, dst_options=dst.options)
    assert dst.files() == before
    assert ifs.verify(dst.url, storage_options=dst.options, public_key=str(public)).files_checked == len(OLD)


# --- 13: the destination root swapped for a link ---------------------------------------------------


class SwapRootForLink(Callback):  # type: ignore[misc]
    """At the first byte sent (after every check): the destination root is renamed away and a
    symbolic link to ``target`` put in its place, as another user of the machine could. Each
    later update notes what ``target`` holds (``seen``: every name it ever held)."""

    def __init__(self, root: Path, target: Path) -> None:
        super().__init__()
        self.root, self.target = root, target
        self.swapped = False
        self.seen: set[str] = set(tree(target))

    def relative_update(self, inc: int = 1) -> None:
        if not self.swapped:
            self.swapped = True
            if self.root.exists():
                self.root.rename(self.root.with_name(self.root.name + ".moved"))
            self.root.symlink_to(self.target, target_is_directory=True)
        self.seen |= set(tree(self.target))


#: The link's target: files of its own, two of them named as files of the checkpoint.
VICTIM = {"keep.txt": b"not the transfer's", "optim.bin": b"the victim's optim.bin", "z.txt": b"the victim's z.txt"}


@pytest.mark.parametrize("before", ["absent", "empty", "sealed"])
@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_destination_root_swapped_for_a_link_during_a_transfer_is_never_written_through(
    tmp_path: Path, how: str, before: str
) -> None:
    """``absent``: the transfer creates the root; ``empty``: an empty folder; ``sealed``: the old
    checkpoint, replaced with ``overwrite=True``. Nothing lands in the link's target, not even
    for a while (nor is anything of it replaced or deleted), and the transfer fails rather than
    report a checkpoint that is not where it was asked to be."""
    victim = write_tree(tmp_path / "victim", VICTIM)
    dst = tmp_path / "store" / DEST
    if before == "empty":
        dst.mkdir(parents=True)
    elif before == "sealed":
        ifs.upload(write_tree(tmp_path / "old", OLD), dst)
    src = new_source(tmp_path, sealed=how == "copy")
    swap = SwapRootForLink(dst, victim)
    kw: dict[str, Any] = {"max_workers": 1, "callback": swap, "overwrite": before == "sealed"}
    outcome: object
    try:
        outcome = ifs.upload(src, dst, **kw) if how == "upload" else ifs.copy(src, dst, **kw)
    except (ValueError, OSError) as exc:
        outcome = exc
    assert swap.swapped
    assert tree(victim) == VICTIM, f"the transfer wrote through the link ({outcome!r})"
    assert swap.seen == set(VICTIM), f"the transfer wrote {sorted(swap.seen - set(VICTIM))} through the link"
    assert isinstance(outcome, (ValueError, OSError)), f"the transfer reported success: {outcome!r}"


# --- 14: leftovers of killed transfers ------------------------------------------------------------


def _killed_leftover(dst: Store, tmp_path: Path, children: list[Child]) -> str:
    """A forced upload onto the old checkpoint sealed at ``dst``, SIGKILLed while its staging
    folder exists (model.bin sent, and the transfer held in its callback): the leftover's path.
    On an object store its lease is then written expired, as it is once a dead transfer's time
    ran out."""
    dst.seal_old(tmp_path)
    child = Child(tmp_path, "upload", new_source(tmp_path), dst.url, dst.options, len(NEW["model.bin"]))
    children.append(child)
    assert child.wait_until(child.held), child.stderr()
    assert child.wait_until(lambda: bool(dst.beside())), "the transfer staged nothing beside the destination"
    child.kill()
    left = dst.beside()
    assert len(left) == 1, left
    if dst.backend.name != "local":
        dst.fs.pipe_file(f"{left[0]}/{LEASE}", json.dumps({"expires": time.time() - 3600}).encode())
        dst.fs.invalidate_cache()
    assert verifying(dst.url, dst.options) == set(OLD)  # killed before the swap: the old one, untouched
    return left[0]


def _status(dst: Store, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """``integrity-fs status PARENT --json``: one object per folder it lists."""
    argv = ["status", dst.parent_url, "--json"]
    if dst.backend.name == "s3":
        argv += ["-o", "key=testing", "-o", "secret=testing"]
        argv += ["-o", f"client_kwargs.endpoint_url={dst.options['client_kwargs']['endpoint_url']}"]
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    listed: list[dict[str, Any]] = json.loads(out)
    return listed


def _listed_as_leftover(listed: list[dict[str, Any]], path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(e.get("verdict") == "leftover" and name in f"{e.get('name')} {e.get('url')}" for e in listed)


def test_a_killed_forced_transfers_leftover_is_listed_by_status(
    store: Backend, tmp_path: Path, children: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    dst = Store(store)
    left = _killed_leftover(dst, tmp_path, children)
    listed = _status(dst, capsys)
    assert _listed_as_leftover(listed, left), f"status does not list {left} as a leftover: {listed}"


def test_the_next_forced_transfer_removes_a_killed_ones_leftover(
    store: Backend, tmp_path: Path, children: list[Child]
) -> None:
    dst = Store(store)
    left = _killed_leftover(dst, tmp_path, children)
    forced("upload", new_source(tmp_path), dst.url, dst.options)
    assert verifying(dst.url, dst.options) == set(NEW)
    assert dst.beside() == [], f"{left} is still there after the next forced transfer"


def test_the_next_forced_transfer_removes_the_leftover_of_one_killed_during_the_swap(
    tmp_path: Path, children: list[Child]
) -> None:
    """Killed during the swap, a local forced upload may leave the destination unsealed: the next
    forced transfer still removes what the killed one left beside it."""
    dst = _local_store(tmp_path)
    _kill_during_the_swap(dst, tmp_path, children)
    forced("upload", new_source(tmp_path), dst.url, None)
    assert verifying(dst.url) == set(NEW)
    assert dst.beside() == [], "the killed transfer's staging folder is still there after the next forced transfer"


def test_prune_removes_a_killed_forced_transfers_leftover(
    store: Backend, tmp_path: Path, children: list[Child]
) -> None:
    dst = Store(store)
    left = _killed_leftover(dst, tmp_path, children)
    result = ifs.prune(dst.parent_url, keep_last=1, storage_options=dst.options)
    assert list(result.kept) and not list(result.deleted)
    assert verifying(dst.url, dst.options) == set(OLD)
    assert dst.beside() == [], f"{left} is still there after prune"


class Hold(Callback):  # type: ignore[misc]
    """Holds the transfer in its callback, once model.bin was sent, until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.done = 0
        self.held = threading.Event()
        self.go = threading.Event()

    def relative_update(self, inc: int = 1) -> None:
        self.done += inc
        if self.done > len(NEW["model.bin"]) and not self.held.is_set():
            self.held.set()
            self.go.wait(60)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_live_forced_transfers_staging_is_never_removed(
    store: Backend,
    tmp_path: Path,
    children: list[Child],
    capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    """While a forced upload is held in its callback (in a thread here, or another process),
    ``status`` does not call its staging folder a leftover and ``prune`` leaves it; let go, the
    transfer completes and the new checkpoint verifies."""
    dst = Store(store)
    dst.seal_old(tmp_path)
    src = new_source(tmp_path)
    errors: list[BaseException] = []
    if where == "thread":
        hold = Hold()

        def run() -> None:
            try:
                forced("upload", src, dst.url, dst.options, max_workers=1, callback=hold)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert hold.held.wait(30), errors
    else:
        child = Child(tmp_path, "upload", src, dst.url, dst.options, len(NEW["model.bin"]))
        children.append(child)
        assert child.wait_until(child.held), child.stderr()
    deadline = time.monotonic() + 30
    while not dst.beside() and time.monotonic() < deadline:
        time.sleep(0.02)
    staging = dst.beside()
    assert len(staging) == 1, staging
    staged = files_at(dst.fs, staging[0])
    try:
        listed = _status(dst, capsys)
        assert not _listed_as_leftover(listed, staging[0]), (
            f"status calls a live transfer's staging a leftover: {listed}"
        )
        ifs.prune(dst.parent_url, keep_last=1, storage_options=dst.options)
        assert dst.beside() == staging and files_at(dst.fs, staging[0]) == staged, (
            "a live transfer's staging was touched"
        )
    finally:
        if where == "thread":
            hold.go.set()
            thread.join(60)
        else:
            code = child.go()
            if code != 0:
                errors.append(AssertionError(child.stderr()))
    assert errors == []
    assert verifying(dst.url, dst.options) == set(NEW)
    assert dst.beside() == []


# --- 15: the swap copies what was confirmed, or nothing -------------------------------------------


@pytest.mark.parametrize("how", ["copy", "upload"])
def test_a_staged_object_replaced_before_the_swap_copies_it_is_never_sealed(
    remote: Backend, proxies: Callable[..., FaultProxy], tmp_path: Path, how: str
) -> None:
    """Every file was staged and confirmed; as the swap's first store-side copy arrives, its
    source object in the staging folder is replaced by as many other bytes (what another writer
    could do). On GCS, and on S3 with BLAKE3 (whose copies carry no SHA-256 for S3 to check), the
    transfer fails with ``FileChangedError`` or ``IntegrityError``, and the destination is never
    sealed over the replaced bytes. The proxy makes moto and the emulator honour a copy pinned to
    the source's version (ETag, generation), as S3 and GCS do."""
    dst = Store(remote)
    dst.seal_old(tmp_path)
    algorithm: Any = "blake3" if remote.name == "s3" else "sha256"
    src = new_source(tmp_path)
    if how == "copy":
        ifs.seal(src, algorithm=algorithm)
    pinned = honour_copy_preconditions(remote.fs)
    replaced: list[str] = []

    def replace_then_copy(request: Request) -> Reply | None:
        source = copy_source(request)
        if source is not None and not replaced and f"/.{DEST}." in f"/{source}":
            remote.fs.invalidate_cache()
            remote.fs.pipe_file(source, bytes(remote.fs.info(source)["size"]))  # zeros: NEW's files are random
            remote.fs.invalidate_cache()
            replaced.append(source)
        return pinned(request)

    proxy = proxies(remote, replace_then_copy)
    outcome: object
    try:
        if how == "upload":
            outcome = ifs.upload(
                src, dst.url, storage_options=proxy.options, overwrite=True, max_workers=1, algorithm=algorithm
            )
        else:
            outcome = ifs.copy(src, dst.url, dst_options=proxy.options, overwrite=True, max_workers=1)
    except (OSError, IntegrityError) as exc:
        outcome = exc
    assert replaced, "the swap made no store-side copy of a staged object"
    try:
        ifs.verify(dst.url, storage_options=dst.options)
    except ifs.ManifestNotFoundError:
        pass  # unsealed: nothing was sealed over the replaced bytes
    except IntegrityError as exc:
        raise AssertionError(f"the destination was sealed over the replaced {replaced[0]} ({outcome!r})") from exc
    assert isinstance(outcome, (FileChangedError, IntegrityError)), f"the transfer ended with {outcome!r}"
