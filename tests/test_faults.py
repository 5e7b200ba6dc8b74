"""Storage failures are OSErrors (never corruption, never success); seals are all-or-nothing;
nothing outside the root is read."""

from __future__ import annotations

import io
import json
import os
import uuid
from typing import Any

import botocore.exceptions
import pytest
from fsspec.callbacks import Callback
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError


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


def test_permission_denied_is_raised_at_once(faulty):
    fs, root = faulty
    fs.faults["b.bin"] = [PermissionError("denied")] * 10
    with pytest.raises(PermissionError):
        ifs.verify(root, fs=fs, max_workers=1)
    assert fs.opens["b.bin"] == 1


def test_failed_seal_leaves_the_previous_manifest_untouched(faulty):
    fs, root = faulty
    before = fs.cat_file(f"{root}/{MANIFEST_FILENAME}")
    fs.pipe_file(f"{root}/a.bin", b"changed")
    fs.faults["b.bin"] = [PermissionError("denied")]
    with pytest.raises(PermissionError):
        ifs.seal(root, fs=fs, overwrite=True)
    assert fs.cat_file(f"{root}/{MANIFEST_FILENAME}") == before


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


def test_unreachable_object_store_is_a_connection_error(tmp_path):
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        ifs.verify("s3://bucket/run", storage_options=options)


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


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: ifs.seal(p / "nope"), FileNotFoundError, "no checkpoint directory"),
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
