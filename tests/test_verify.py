"""verify's verdicts on every backend (local, memory, S3, GCS): every problem named, quick and
strict, the manifest it trusts (strictly parsed), the root it is given, and a stop that ends every
worker before the call returns."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3fs
from conftest import Backend
from fsspec.asyn import AsyncFileSystem
from fsspec.callbacks import Callback
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import (
    MANIFEST_FILENAME,
    IntegrityError,
    Manifest,
    ManifestError,
    ManifestNotFoundError,
)
from integrity_fs.cli import main as cli_main

# --- verdicts, on every backend ----------------------------------------------------------------------


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


def test_verify_passes_on_intact_checkpoint(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.problems == ()
    assert report.files_checked == len(FILES)
    assert report.bytes_checked == sum(map(len, FILES.values()))
    assert ifs.read_manifest(ckpt.url, storage_options=ckpt.storage_options).files.keys() == FILES.keys()


def test_every_problem_is_collected_before_raising(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.corrupt("__0_0.distcp", 12345)
    ckpt.corrupt("sub/dir/x.bin", -1)
    ckpt.remove(".metadata")
    ckpt.truncate("__1_0.distcp", 1000)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    kinds = {p.path: p.kind for p in err.value.report.problems}
    assert kinds == {
        ".metadata": "missing",
        "__0_0.distcp": "mismatch",
        "__1_0.distcp": "size",
        "sub/dir/x.bin": "mismatch",
    }
    for name in kinds:
        assert name in str(err.value)
    bad = next(p for p in err.value.report.problems if p.path == "__0_0.distcp")
    assert bad.expected == hashlib.sha256(FILES["__0_0.distcp"]).hexdigest()
    assert bad.actual == hashlib.sha256(ckpt.read("__0_0.distcp")).hexdigest()
    size = next(p for p in err.value.report.problems if p.path == "__1_0.distcp")
    assert (size.expected, size.actual) == (200_001, 1000)
    assert ifs.CheckpointingException is IntegrityError


def test_chunk_granularity_names_the_bad_byte_range(ckpt):
    chunk = 64 * 1024
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, granularity="chunk", chunk_size=chunk)
    assert manifest.granularity == "chunk" and manifest.chunk_size == chunk
    data = FILES["__0_0.distcp"]
    expected_chunks = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    assert list(manifest.chunks["__0_0.distcp"]) == expected_chunks
    # The file digest is the hash of the chunk digests' raw bytes, in order (documented in README).
    combined = hashlib.sha256(b"".join(bytes.fromhex(d) for d in expected_chunks)).hexdigest()
    assert manifest.files["__0_0.distcp"] == combined
    assert manifest.chunks["empty"] == (hashlib.sha256(b"").hexdigest(),)
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok

    ckpt.corrupt("__0_0.distcp", 3 * chunk + 5)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    (problem,) = err.value.report.problems
    assert problem.byte_ranges == ((3 * chunk, 4 * chunk),)
    assert f"bytes {3 * chunk}-{4 * chunk - 1}" in str(err.value)


def test_seed_manifest_without_sizes_is_accepted(ckpt):
    seed = {
        "version": 1,
        "granularity": "file",
        "algorithm": "sha256",
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()},
    }
    ckpt.write(MANIFEST_FILENAME, json.dumps(seed).encode())
    assert ifs.read_manifest(ckpt.url, storage_options=ckpt.storage_options).sizes is None
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok
    ckpt.truncate("__0_0.distcp", 100)
    with pytest.raises(IntegrityError, match="__0_0.distcp: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


def test_unsupported_algorithm_in_manifest_is_not_implemented(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    doc = json.loads(ckpt.read(MANIFEST_FILENAME))
    doc["algorithm"] = "md5"
    ckpt.write(MANIFEST_FILENAME, json.dumps(doc).encode())
    with pytest.raises(NotImplementedError, match="md5"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


# --- quick and strict --------------------------------------------------------------------------------


def test_quick_reads_no_content_but_catches_truncation(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.corrupt("__0_0.distcp", 7)
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options, quick=True)
    assert report.ok and report.bytes_checked == 0  # a flipped bit needs a full verify
    ckpt.truncate("__0_0.distcp", 10)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options, quick=True)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("__0_0.distcp", "size")]


def test_extra_files_are_allowed_unless_strict(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.write("README.md", b"notes")
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.extra == ("README.md",)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options, strict=True)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("README.md", "extra")]


def test_extra_files_beside_a_nonempty_manifest_stay_allowed(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    ifs.seal(tmp_path)
    (tmp_path / "b").write_bytes(b"b")
    assert ifs.verify(tmp_path).extra == ("b",)


def test_empty_manifest_verifies_only_a_directory_without_files(backend: Any) -> None:
    backend.write(MANIFEST_FILENAME, Manifest(files={}, sizes={}).to_json())
    backend.write("model.pt", b"weights")
    backend.write("sub/x.bin", b"x")
    for quick in (False, True):
        with pytest.raises(IntegrityError) as err:
            ifs.verify(backend.url, storage_options=backend.storage_options, quick=quick)
        problems = err.value.report.problems
        assert [(p.path, p.kind) for p in problems] == [("model.pt", "extra"), ("sub/x.bin", "extra")]
        assert "model.pt" in str(err.value) and "sub/x.bin" in str(err.value)
    backend.remove("model.pt")
    backend.remove("sub/x.bin")
    report = ifs.verify(backend.url, storage_options=backend.storage_options)
    assert report.ok and report.files_checked == 0


# --- the manifest: every parse failure is a ManifestError --------------------------------------------


DIGEST = "0" * 64


def _manifest_text(**override: str) -> str:
    """A valid one-file manifest as JSON text, with pieces of its body replaced verbatim."""
    parts = {
        "algorithm": '"sha256"',
        "files": f'{{"a": "{DIGEST}"}}',
        "granularity": '"file"',
        "sizes": '{"a": 0}',
        "version": "1",
    }
    parts.update(override)
    return "{" + ", ".join(f'"{key}": {value}' for key, value in parts.items()) + "}"


BAD_MANIFESTS = {
    "duplicate top-level key": _manifest_text(version='1, "version": 1'),
    "duplicate file name": _manifest_text(files=f'{{"a": "{DIGEST}", "a": "{"1" * 64}"}}'),
    "duplicate size": _manifest_text(sizes='{"a": 0, "a": 0}'),
    "duplicate unknown key": _manifest_text(extra='{"k": 1, "k": 2}'),
    "size of 5000 digits": _manifest_text(sizes='{"a": ' + "9" * 5000 + "}"),
    "NaN size": _manifest_text(sizes='{"a": NaN}'),
    "Infinity version": _manifest_text(version="Infinity"),
}


@pytest.mark.parametrize("text", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_every_parse_failure_and_duplicate_key_is_a_manifest_error(backend: Any, text: str) -> None:
    backend.write("a", b"")
    backend.write(MANIFEST_FILENAME, text.encode())
    with pytest.raises(ManifestError):
        Manifest.from_json(text)
    with pytest.raises(ManifestError):
        ifs.read_manifest(backend.url, storage_options=backend.storage_options)
    with pytest.raises(ManifestError):
        ifs.verify(backend.url, storage_options=backend.storage_options)


def test_the_valid_form_of_those_manifests_parses() -> None:
    """The cases above differ from a valid manifest only in the part that breaks it."""
    assert Manifest.from_json(_manifest_text(extra='{"k": 1}')).files == {"a": DIGEST}


def test_a_stale_manifest_json_with_valid_body_still_parses_as_before() -> None:
    """Strict parsing leaves canonical manifests (and seed-era ones, without sizes) alone."""
    seed = {"algorithm": "sha256", "files": {"a": DIGEST}, "granularity": "file", "version": 1}
    assert Manifest.from_json(json.dumps(seed)).sizes is None
    m = Manifest(files={"a": DIGEST}, sizes={"a": 3})
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("name", ["size of 5000 digits", "duplicate file name"])
def test_cli_says_manifest_invalid_for_parse_failures(tmp_path: Path, name: str) -> None:
    (tmp_path / "a").write_bytes(b"")
    (tmp_path / MANIFEST_FILENAME).write_text(BAD_MANIFESTS[name])
    assert cli_main(["verify", str(tmp_path)]) == 3


# --- the root: missing, a file, or never sealed ------------------------------------------------------


def test_missing_manifest_is_its_own_error(ckpt):
    with pytest.raises(ManifestNotFoundError, match="never sealed"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert issubclass(ManifestNotFoundError, FileNotFoundError)


OPERATIONS: dict[str, Callable[..., object]] = {
    "seal": ifs.seal,
    "verify": ifs.verify,
    "verify quick": lambda url, **kw: ifs.verify(url, quick=True, **kw),
    "read_manifest": ifs.read_manifest,
}


@pytest.mark.parametrize("operation", ["verify", "read_manifest"])
def test_only_an_existing_root_without_manifest_is_never_sealed(backend: Any, operation: str) -> None:
    backend.write("a", b"a")
    with pytest.raises(ManifestNotFoundError, match="never sealed"):
        OPERATIONS[operation](backend.url, storage_options=backend.storage_options)


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
def test_a_missing_root_is_file_not_found_not_unsealed(backend: Any, operation: Callable[..., object]) -> None:
    backend.write("other/a", b"a")  # the store is not empty; the root under it just is not there
    with pytest.raises(FileNotFoundError, match="no checkpoint") as err:
        operation(backend.url + "/missing", storage_options=backend.storage_options)
    assert not isinstance(err.value, ManifestNotFoundError)
    assert "missing" in str(err.value)


@pytest.mark.parametrize("operation", OPERATIONS.values(), ids=OPERATIONS.keys())
def test_a_root_that_is_a_file_is_not_a_directory(backend: Any, operation: Callable[..., object]) -> None:
    backend.write("model.pt", b"weights")
    with pytest.raises(NotADirectoryError, match="model.pt"):
        operation(backend.url + "/model.pt", storage_options=backend.storage_options)
    assert backend.listdir() == ["model.pt"]  # nothing written under or beside it


def test_cli_verify_of_a_missing_path_is_a_storage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "path"
    assert cli_main(["verify", str(missing)]) == 4
    assert cli_main(["verify", "--quick", str(missing)]) == 4
    assert "seal it first" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: ifs.seal(p / "nope"), FileNotFoundError, "no checkpoint at"),
        (lambda p: ifs.seal(p / "file"), NotADirectoryError, "not a checkpoint directory"),
        (lambda p: ifs.verify(p / "nope"), FileNotFoundError, "no checkpoint at"),
        (lambda p: ifs.verify(p / "file"), NotADirectoryError, "not a checkpoint directory"),
        (lambda p: ifs.verify(123), TypeError, "url must be"),
        (lambda p: ifs.verify(""), ValueError, "url is empty"),
        (lambda p: ifs.verify(p, fs=MemoryFileSystem(), storage_options={"x": 1}), ValueError, "not both"),
    ],
)
def test_bad_input_gets_a_clear_typed_error(tmp_path, call, error, message):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(error, match=message):
        call(tmp_path)


# --- attested: a file gone since the listing is a change, not damage --------------------------------


def test_attested_verify_of_a_file_gone_since_the_listing_is_a_file_changed_error(s3_backend: Backend) -> None:
    s3_backend.write("kept.bin", b"kept")
    s3_backend.write("gone.bin", b"gone")
    ifs.seal(s3_backend.url, storage_options=s3_backend.storage_options)

    class StaleListing(s3fs.S3FileSystem):  # type: ignore[misc]
        """Lists ``gone.bin`` after it was deleted (the listing came before the delete)."""

        def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
            out = super().find(path, *args, **kwargs)
            name = f"{s3_backend.root}/gone.bin"
            if kwargs.get("detail"):
                out[name] = {"name": name, "type": "file", "size": 4, "ETag": '"0123"'}
            return out

    s3_backend.remove("gone.bin")
    fs = StaleListing(**s3_backend.storage_options, skip_instance_cache=True)
    with pytest.raises(ifs.FileChangedError, match="gone.bin") as caught:
        ifs.verify(s3_backend.root, fs=fs, attested=True)
    assert not isinstance(caught.value, IntegrityError)


# --- a stop (Ctrl-C, the first failure) ends every worker before the call returns --------------------


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]  # the hashing pool


class SlowFS(MemoryFileSystem):
    """fsspec's memory store, whose reads (``cat_file`` of a range) each call ``before_read`` first
    and are counted per file; a file in ``fail`` raises its exception instead."""

    protocol = "slowfs"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail: dict[str, BaseException] = {}
        self.failed = threading.Event()
        self.reads: collections.Counter[str] = collections.Counter()
        self.before_read: Callable[[str], object] = lambda name: None

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        name = path.rsplit("/", 1)[-1]
        if name in self.fail:
            self.failed.set()
            raise self.fail[name]
        if name in LARGE:
            self.before_read(name)
            self.reads[name] += 1
        return super().cat_file(path, start, end, **kwargs)


#: The large files of ``slow``: each more than two reads long (a read of an object store takes 8 MiB).
LARGE = [f"f{i}.bin" for i in range(4)]
SIZE = 2 * 8 * 1024 * 1024 + 1


@pytest.fixture
def slow() -> Any:
    fs = SlowFS(skip_instance_cache=True)
    root = f"/slow-{uuid.uuid4().hex}"
    data = os.urandom(SIZE)
    for name in LARGE:
        fs.pipe_file(f"{root}/{name}", data)
    fs.pipe_file(f"{root}/bad.bin", b"x")
    ifs.seal(root, fs=MemoryFileSystem(skip_instance_cache=True))  # the same store, read without delays
    yield fs, root
    fs.rm(root, recursive=True)


@pytest.fixture
def interrupted() -> Any:
    """A real Ctrl-C whose delivery is seen: SIGINT raises ``KeyboardInterrupt`` in the main thread
    (as in a terminal) and sets the event first."""
    seen = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        seen.set()
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.timeout(30)
def test_ctrl_c_stops_every_worker_before_the_call_returns(slow: Any, interrupted: threading.Event) -> None:
    """Every large file is being read when Ctrl-C comes; each worker's read returns only once it
    was delivered (and a little later): none reads on to the file's end, none outlives the call."""
    fs, root = slow

    def once_all_read() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    everyone = threading.Barrier(len(LARGE), action=once_all_read)

    def before_read(name: str) -> None:
        if fs.reads[name] == 0:
            everyone.wait(10)
            interrupted.wait(10)
            time.sleep(0.3)  # the main thread sets the stop meanwhile

    fs.before_read = before_read
    with pytest.raises(KeyboardInterrupt):
        ifs.verify(root, fs=fs, max_workers=4)
    assert _workers_alive() == []
    assert interrupted.is_set()
    assert [fs.reads[name] for name in LARGE] == [1] * len(LARGE)  # each stopped after its first read


@pytest.mark.timeout(30)
def test_the_first_failure_stops_the_other_workers(slow: Any) -> None:
    fs, root = slow
    fs.fail["bad.bin"] = PermissionError("denied")

    def before_read(name: str) -> None:
        if fs.reads[name] == 0:  # nothing read before bad.bin fails, then the stop has time to come
            fs.failed.wait(10)
            time.sleep(0.3)

    fs.before_read = before_read
    with pytest.raises(PermissionError):
        ifs.verify(root, fs=fs, max_workers=5)
    assert _workers_alive() == []
    assert fs.failed.is_set()
    assert all(fs.reads[name] <= 1 for name in LARGE), fs.reads  # none read on past its first read


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
        if path.endswith("stalled.bin"):
            self.stalling.set()
            try:
                await asyncio.sleep(3600)  # a server that accepted the request and never answers
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        elif not path.endswith(
            MANIFEST_FILENAME
        ):  # the other file's bytes (and so the interrupt) come once the stalled read waits
            while not self.stalling.is_set():
                await asyncio.sleep(0.01)
        return self.files[path][start:end]


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
    with pytest.raises(KeyboardInterrupt):  # returns, though the stalled read would wait an hour
        ifs.verify("ck", fs=fs, max_workers=2, callback=_InterruptOnProgress())
    assert _workers_alive() == []
    assert fs.cancelled
