"""Storage-agnostic fixtures: one test suite, run offline on local, memory, S3 (moto) and GCS (emulator)."""

import json
import logging
import os

# Must be set before gcsfs is first imported: gcsfs reads it at import time, and with its default
# ("true") calls first probe the bucket type over gRPC and stall 45-90 s each against the emulator.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# So that fsspec.url_to_fs("s3://...") and CLI subprocesses find credentials without extra options.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

import posixpath
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.callbacks import Callback
from fsspec.spec import AbstractFileSystem

BUCKET = "integrity-test"
BACKENDS = ["local", "memory", "s3", "gcs"]


@dataclass
class Backend:
    name: str
    fs: AbstractFileSystem
    root: str  # inside fs, no protocol, no trailing slash
    url: str  # root as a URL; fsspec.core.url_to_fs(url, **storage_options) reaches the same store
    storage_options: dict[str, Any]

    def path(self, relname: str) -> str:
        return f"{self.root}/{relname}"

    def write(self, relname: str, data: bytes) -> None:
        path = self.path(relname)
        if self.name in ("local", "memory"):  # object stores have no folders (s3fs would ask for the bucket)
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache()

    def folder_marker(self, relname: str = "") -> None:
        """A zero-byte object named ``relname/`` (what the S3 console's "Create folder" makes), put
        through the store's own API on S3: s3fs before 2025 drops the "/" that pipe_file is given."""
        path = (self.path(relname) if relname else self.root).rstrip("/") + "/"
        if self.name == "s3":
            bucket, _, key = path.partition("/")
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"")
        else:
            self.fs.pipe_file(path, b"")
        self.fs.invalidate_cache()

    def read(self, relname: str) -> bytes:
        return self.fs.cat_file(self.path(relname))

    def remove(self, relname: str) -> None:
        self.fs.rm_file(self.path(relname))
        self.fs.invalidate_cache()

    def corrupt(self, relname: str, offset: int = 0) -> None:
        """Flip the lowest bit of the byte at offset (negative counts from the end)."""
        data = bytearray(self.read(relname))
        data[offset] ^= 0x01
        self.write(relname, bytes(data))

    def truncate(self, relname: str, n: int) -> None:
        self.write(relname, self.read(relname)[:n])

    def listdir(self) -> list[str]:
        """All files under root, recursively, relative to root, sorted, POSIX separators."""
        self.fs.invalidate_cache()
        prefix = self.root + "/"
        return sorted(p[len(prefix) :] for p in self.fs.find(self.root))


def free_port() -> int:
    """A TCP port free right now, for servers that cannot bind port 0 themselves (prefer port 0: no race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _moto_lists_its_services_once() -> None:
    """moto's server finds the service a request is for by listing its own package (a ``stat`` of
    each of its ~180 service folders, for every request): about half of the server's time on a
    request. The folders do not change while the tests run: they are listed once."""
    from moto import backends

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules


def _moto_computes_crc32c() -> None:
    """Make moto compute CRC32C as S3 does. moto computes it with the optional ``crc32c`` package
    and, without it, silently computes CRC32 instead and calls that CRC32C (what it keeps for a
    multipart upload with a full-object CRC32C). Here awscrt's CRC32C (installed with boto3's
    ``crt`` extra and integrity_fs's ``crc``) stands in for the package."""
    try:
        import crc32c  # noqa: F401  # moto's own choice works

        return
    except ImportError:
        pass
    try:
        from awscrt import checksums
    except ImportError:
        return
    import base64

    from moto.s3 import models, responses, utils

    original = utils.compute_checksum

    def compute_checksum(body: bytes, algorithm: str, encode_base64: bool = True) -> bytes:
        if algorithm != "CRC32C":
            return original(body, algorithm, encode_base64=encode_base64)
        raw = int(checksums.crc32c(bytes(body))).to_bytes(4, "big")
        return base64.b64encode(raw) if encode_base64 else raw

    for module in (utils, models, responses):
        module.compute_checksum = compute_checksum  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    _moto_lists_its_services_once()
    _moto_computes_crc32c()

    # moto's in-process mock_aws does not intercept aiobotocore (s3fs): use a real local server.
    # werkzeug logs every request at INFO, through a handler of its own to stderr, when nothing
    # says otherwise; the tests that count requests through that log set INFO themselves.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()  # the port the OS gave: no race with other processes
    endpoint = f"http://{host}:{port}"
    # No region_name in client_kwargs: with one, bucket creation fails against moto.
    fs = fsspec.filesystem("s3", **_s3_options(endpoint))
    fs.mkdir(BUCKET)
    fs.invalidate_cache()
    yield endpoint
    server.stop()


def _keep_every_byte_of_multipart_uploads() -> None:
    """Make the GCS emulator store what gcsfs uploads, byte for byte.

    gcsfs sends small objects as one multipart/related request, each part followed by "\n" and
    the boundary. The emulator parses it with Python's email package, which takes a "\r" that
    ends the content for half of a "\r\n" line break and drops it: an object whose last byte is
    CR was stored one byte short (1 random blob in 256; it made size tests flaky). Real GCS keeps
    it. Here the two parts are cut at the boundary, after exactly the line break that gcsfs wrote.
    """
    from gcp_storage_emulator import server

    original = server._read_data

    def read_data(request_handler: Any, query: Any) -> Any:
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(request_handler, query)
        raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
        boundary = b"--" + content_type.partition("boundary=")[2].strip().strip('"').encode()
        newline = b"\r\n" if raw.startswith(boundary + b"\r\n") else b"\n"
        meta_part, _, rest = raw.partition(boundary)[2].partition(boundary)
        content_part = rest.rpartition(boundary)[0]  # up to the closing boundary: the content may hold anything
        meta = meta_part.partition(newline * 2)[2][: -len(newline)]
        head, _, content = content_part.partition(newline * 2)
        kind = head.decode().partition("Content-Type:")[2].strip() or "application/octet-stream"
        return {"meta": json.loads(meta), "content": content[: -len(newline)], "content-type": kind}

    server._read_data = read_data


def _honour_generation_preconditions() -> None:
    """Make the GCS emulator answer ``ifGenerationMatch`` on object reads as GCS does.

    GCS refuses a read whose ``ifGenerationMatch`` is not the object's generation now with 412
    Precondition Failed; the emulator ignores the parameter and serves whatever it holds. Reads
    pinned to a listed generation are tested against the former behaviour, so the fixture adds it
    to the emulator's two object GET handlers (metadata and media), and nothing else.
    """
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def pinned(handler: Any) -> Any:
        def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            wanted = (request.query.get("ifGenerationMatch") or [None])[0]
            if wanted is not None:
                try:
                    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
                except NotFound:
                    obj = None
                if obj is not None and str(obj.get("generation")) != str(wanted):
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                    return None
            return handler(request, response, storage, *args, **kwargs)

        handle.__wrapped__ = handler  # type: ignore[attr-defined]
        return handle

    for _regex, handlers in server.HANDLERS:
        get = handlers.get(server.GET)
        if get in (objects.get, objects.download):
            handlers[server.GET] = pinned(get)


def _answer_move_to() -> None:
    """Give the GCS emulator the objects.moveTo call that GCS has and current gcsfs tries first
    for a rename: the emulator answers 501, which gcsfs retries for about 35 s before it falls back
    to copy and delete. Here moveTo is that copy and delete, answered at once."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def move(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        bucket, source, dest = (request.params[k] for k in ("bucket_name", "object_id", "dest_object_id"))
        try:
            moved = objects._copy(request.base_url, storage, bucket, source, bucket, dest)
            storage.delete_file(bucket, source)
        except NotFound:
            response.status = HTTPStatus.NOT_FOUND
            return
        response.json(moved)

    route = (
        rf"^{server.settings.API_ENDPOINT}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
        r"(?P<dest_object_id>.*[^/]+)$",
        {server.POST: move},
    )
    if not any(regex == route[0] for regex, _ in server.HANDLERS):
        server.HANDLERS = (route, *server.HANDLERS)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    from gcp_storage_emulator.server import create_server

    _keep_every_byte_of_multipart_uploads()
    _honour_generation_preconditions()
    _answer_move_to()
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=BUCKET)
    server.start()
    port = server._api._httpd.server_address[1]  # bound to port 0; the emulator has no public getter
    endpoint = f"http://127.0.0.1:{port}"
    GCS_STORAGES[endpoint] = server._storage
    fsspec.filesystem("gcs", **_gcs_options(endpoint)).invalidate_cache()
    yield endpoint
    server.stop()


#: The GCS emulator's own store behind each endpoint, for tests that must shape an object as GCS
#: would hold it and gcsfs cannot write (a composite object without an MD5).
GCS_STORAGES: dict[str, Any] = {}


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def _gcs_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon"}


def _object_store_backend(name: str, protocol: str, options: dict[str, Any]) -> Backend:
    # fs is built from exactly storage_options so that url_to_fs returns this same cached
    # instance (same listing cache) rather than a second one that could see stale listings.
    fs = fsspec.filesystem(protocol, **options)
    root = f"{BUCKET}/test-{uuid.uuid4().hex}"
    return Backend(name, fs, root, f"{protocol}://{root}", options)


def _make_backend(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if name == "local":
        root_path = tmp_path / "store"
        root_path.mkdir()
        root = root_path.as_posix()
        yield Backend(name, fsspec.filesystem("file"), root, root, {})
    elif name == "memory":
        fs = fsspec.filesystem("memory")
        root = f"/test-{uuid.uuid4().hex}"
        fs.makedirs(root)
        yield Backend(name, fs, root, f"memory://{root}", {})
        # The memory store is process-global: drop this test's files.
        fs.rm(root, recursive=True)
    elif name == "s3":
        yield _object_store_backend(name, "s3", _s3_options(request.getfixturevalue("s3_endpoint")))
    elif name == "gcs":
        yield _object_store_backend(name, "gs", _gcs_options(request.getfixturevalue("gcs_endpoint")))
    else:
        raise ValueError(f"unknown backend {name!r}")


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` during the test, as in a terminal, also when the suite was
    started with SIGINT ignored (a background job, nohup): such a process inherits SIG_IGN."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of a child that a test sends SIGINT: Python turns it into
    ``KeyboardInterrupt`` only when it starts with SIGINT at its default, not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(params=BACKENDS, ids=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield from _make_backend(request.param, request, tmp_path)


@pytest.fixture
def s3_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield from _make_backend("s3", request, tmp_path)


@pytest.fixture
def gcs_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield from _make_backend("gcs", request, tmp_path)


def backends(*names: str) -> Any:
    """A fixture like ``backend`` over some of BACKENDS only, for a module whose tests need those:
    ``store = backends("local", "s3")`` makes the fixture ``store``."""

    @pytest.fixture(params=names, ids=names)
    def fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
        yield from _make_backend(request.param, request, tmp_path)

    return fixture


def pytest_configure(config: pytest.Config) -> None:
    """In the processes that run tests: only the tests' own asserts are rewritten, and torch
    computes on one thread (the models here are tiny, and on a loaded machine its second thread
    spins waiting for a core: a Trainer step took 3x the CPU; the launched ranks get the same
    with ``OMP_NUM_THREADS=1``)."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test
    _rewrite_only_the_tests_asserts(config)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def _rewrite_only_the_tests_asserts(config: pytest.Config) -> None:
    """pytest rewrites the asserts of every module of each installed package that brings a pytest
    plugin (hypothesis: the ~75 modules the tests import), for its failure reports, and with
    nothing cached (a fresh environment, or PYTHONDONTWRITEBYTECODE) every pytest process does
    it again: ~5 s of CPU each. The tests' own files (``test_*.py``, ``conftest.py``) are still
    rewritten; the packages' modules are left as they are. (pytest has no public switch for
    this: without its private list of marked packages, nothing changes.)"""
    try:
        from _pytest.assertion.rewrite import assertstate_key
    except ImportError:
        return
    marked = getattr(getattr(config.stash.get(assertstate_key, None), "hook", None), "_must_rewrite", None)
    if isinstance(marked, set):
        marked.clear()


def xdist_group_of(item: pytest.Item) -> str | None:
    """The tests that must run in one pytest-xdist worker, one after the other: those of a file
    that share a fixture built once per file (a launch of ranks, a tree of checkpoints), so that
    it is built once; and those marked ``xdist_group(name)`` (the steps of one docs page)."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0])
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else []
    if any(d.scope == "module" for fixturedefs in defs for d in fixturedefs):
        return item.nodeid.split("::")[0]
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: write down the groups, for the scheduler below."""
    where = getattr(config, "workerinput", {}).get("test_groups")
    if where is not None:
        groups = {item.nodeid: group for item in items if (group := xdist_group_of(item)) is not None}
        Path(where).write_text(json.dumps(groups))


#: Where the workers write their groups (one file each, all the same: they collect the same tests).
_GROUPS: list[Path] = []


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if not _GROUPS:
        _GROUPS.append(Path(tempfile.mkdtemp(prefix="test-groups-")))
    node.workerinput["test_groups"] = str(_GROUPS[0] / f"{node.gateway.id}.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _GROUPS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n 2``: pytest-xdist's scheduling by scope, each group (``xdist_group_of``) one scope sent to
    one worker, every other test a scope of its own. The groups go out first, those of the most
    tests first, then one test at a time to whichever worker has little left. (pytest-xdist's
    own ``--dist loadgroup`` finds no group under pytest 9.2, whose node ids it cannot amend.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(next(_GROUPS[0].iterdir()).read_text()) if _GROUPS else {}
            return self.groups.get(nodeid, nodeid)

    return ByGroup(config, log)


class AfterListing(Callback):  # type: ignore[misc]  # fsspec is untyped
    """A progress callback that runs ``change`` once the listing is done, just before the first
    byte is read (fsspec calls ``set_size`` with the total then): a file changed in between."""

    def __init__(self, change: Any) -> None:
        super().__init__()
        self.change = change

    def set_size(self, size: int) -> None:
        self.change()
        super().set_size(size)


# --- the command-line tests' checkpoints (test_cli*.py) -----------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A local, unsealed checkpoint directory (test files of other parts define their own)."""
    from cli_run import FILES

    root = tmp_path / "step_1000"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def sealed(ckpt: Path) -> Path:
    """``ckpt``, sealed by ``integrity-fs seal``."""
    from cli_run import cli

    proc = cli("seal", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    return ckpt


@pytest.fixture
def s3(s3_backend: Backend, s3_endpoint: str) -> tuple[Backend, list[str]]:
    """An unsealed checkpoint in the moto bucket, and the -o options that reach it."""
    from cli_run import FILES

    for name, data in FILES.items():
        s3_backend.write(name, data)
    return s3_backend, ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
