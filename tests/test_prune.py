"""Retention (SPEC "Retention"): prune keeps the keep_last newest checkpoints that verify and
deletes only what is older, on local disk, memory, S3 (moto) and GCS (emulator). The collective
version runs on two gloo ranks in test_checkpoints.py, the command line in test_cli_checkpoints.py,
killed and interrupted prunes and the two clocks in test_trust_retention.py."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import fsspec
import gcsfs
import pytest
import s3fs
from botocore.exceptions import ClientError
from cli_run import make_keys
from conftest import AfterListing, Backend, backends
from fsspec.callbacks import Callback
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME

MARKER = "_integrity_deleting"  # what a prune writes into a folder before its first delete

local_and_s3 = backends("local", "s3")


def _url(store: Backend, name: str) -> str:
    return f"{store.url}/{name}"


def _checkpoint(store: Backend, name: str, *, seal: bool = True, size: int = 3000) -> None:
    store.write(f"{name}/model.bin", os.urandom(size))
    store.write(f"{name}/sub/optim.bin", os.urandom(size // 3))
    if seal:
        ifs.seal(_url(store, name), storage_options=store.storage_options)


def _run(store: Backend, *names: str) -> None:
    for name in names:
        _checkpoint(store, name)


def _folders(store: Backend) -> set[str]:
    """The top-level folders under the root that hold any file."""
    return {name.split("/", 1)[0] for name in store.listdir() if "/" in name}


def _held(store: Backend, *names: str) -> int:
    """The bytes of every file of the checkpoints ``names`` (manifest and sidecar included), as listed
    (s3fs before 2025 lists a folder marker ``a/`` as a file ``a``, which cannot be read)."""
    store.fs.invalidate_cache()
    listed = store.fs.find(store.root, detail=True)
    prefix = store.root + "/"
    return sum(int(info["size"]) for path, info in listed.items() if path[len(prefix) :].split("/", 1)[0] in names)


def _prune(store: Backend, **kw: Any) -> ifs.PruneResult:
    return ifs.prune(store.url, storage_options=store.storage_options, **kw)


def _urls(store: Backend, *names: str) -> tuple[str, ...]:
    return tuple(_url(store, name) for name in names)


# --- the rule --------------------------------------------------------------------------------------


def test_the_two_newest_damaged_the_good_ones_behind_them_are_kept(backend: Backend) -> None:
    _run(backend, "step_1", "step_2", "step_3", "step_4", "step_5")
    backend.corrupt("step_5/model.bin", 100)  # same size: only hashing sees it
    backend.truncate("step_4/sub/optim.bin", 10)
    before = {name: backend.read(name) for name in backend.listdir() if name.startswith(("step_3", "step_4", "step_5"))}
    held = _held(backend, "step_1")

    result = _prune(backend, keep_last=2)

    assert result.kept == _urls(backend, "step_3", "step_2")
    assert result.deleted == _urls(backend, "step_1")
    assert result.left == _urls(backend, "step_5", "step_4")  # newer than the oldest kept: never deleted
    assert result.verdicts == dict(
        zip(
            _urls(backend, "step_5", "step_4", "step_3", "step_2", "step_1"),
            ["damaged", "damaged", "ok", "ok", "sizes ok"],  # older than those kept: only size-checked
            strict=True,
        )
    )
    assert _folders(backend) == {"step_2", "step_3", "step_4", "step_5"}
    assert {name: backend.read(name) for name in before} == before  # not a byte of them changed
    assert result.bytes_freed == held > 4000  # its files and its manifest
    assert not result.dry_run
    found = ifs.latest_verified(backend.url, storage_options=backend.storage_options)
    assert found is not None and found[0] == _url(backend, "step_3")


def test_bytes_freed_counts_every_file_deleted(local_and_s3: Backend) -> None:
    _run(local_and_s3, "step_1", "step_2", "step_3")
    local_and_s3.write("step_1/.hidden/notes.txt", b"12345")  # whatever the folder holds goes with it
    held = _held(local_and_s3, "step_1", "step_2")
    manifests = sum(len(local_and_s3.read(f"step_{n}/{MANIFEST_FILENAME}")) for n in (1, 2))
    result = _prune(local_and_s3, keep_last=1)
    assert result.deleted == _urls(local_and_s3, "step_2", "step_1")
    assert result.bytes_freed == held >= 2 * (3000 + 1000) + 5 + manifests
    assert _folders(local_and_s3) == {"step_3"}


def test_a_save_in_progress_survives_and_old_unsealed_ones_only_with_unsealed(backend: Backend) -> None:
    _checkpoint(backend, "step_0", seal=False)  # written before sealing was there
    _run(backend, "step_1", "step_2", "step_3")
    _checkpoint(backend, "step_4", seal=False)  # a save still being written: the newest
    result = _prune(backend, keep_last=2)
    assert result.kept == _urls(backend, "step_3", "step_2")
    assert result.deleted == _urls(backend, "step_1")
    assert result.left == _urls(backend, "step_4", "step_0")
    assert result.verdicts[_url(backend, "step_4")] == "unsealed"

    again = _prune(backend, keep_last=2, unsealed=True)
    assert again.deleted == _urls(backend, "step_0")
    assert again.left == _urls(backend, "step_4")  # newer than the kept ones: never, unsealed or not
    assert _folders(backend) == {"step_2", "step_3", "step_4"}


def test_fewer_verified_than_keep_last_deletes_nothing(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    _run(backend, "step_1", "step_2", "step_3")
    backend.corrupt("step_3/model.bin")
    backend.corrupt("step_2/model.bin")
    before = backend.listdir()
    result = _prune(backend, keep_last=2)
    assert result.kept == _urls(backend, "step_1") and result.deleted == ()
    assert result.left == _urls(backend, "step_3", "step_2") and result.bytes_freed == 0
    assert backend.listdir() == before
    assert any("fewer than keep_last=2" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_invalid_and_damaged_older_ones(local_and_s3: Backend) -> None:
    """Older than the oldest kept: damaged ones are deleted, invalid ones (a manifest this
    installation cannot read) left."""
    _run(local_and_s3, "step_1", "step_2", "step_3", "step_4")
    local_and_s3.write(f"step_2/{MANIFEST_FILENAME}", b"{not json")
    local_and_s3.truncate("step_1/model.bin", 5)
    result = _prune(local_and_s3, keep_last=2)
    assert result.deleted == _urls(local_and_s3, "step_1")
    assert result.left == _urls(local_and_s3, "step_2")
    assert result.verdicts[_url(local_and_s3, "step_2")] == "invalid"
    assert result.verdicts[_url(local_and_s3, "step_1")] == "damaged"


def test_dry_run_deletes_nothing_and_is_the_plan_the_real_run_executes(backend: Backend) -> None:
    _checkpoint(backend, "step_0", seal=False)
    _run(backend, "step_1", "step_2", "step_3", "step_4", "step_5")
    backend.corrupt("step_5/model.bin")
    backend.corrupt("step_1/model.bin")
    before = {name: backend.read(name) for name in backend.listdir()}

    dry = _prune(backend, keep_last=2, unsealed=True, dry_run=True)
    assert {name: backend.read(name) for name in backend.listdir()} == before
    assert dry.dry_run and dry.deleted == _urls(backend, "step_2", "step_1", "step_0") and dry.bytes_freed > 0

    real = _prune(backend, keep_last=2, unsealed=True)
    assert real == dataclasses.replace(dry, dry_run=False)
    assert _folders(backend) == {"step_3", "step_4", "step_5"}


def test_quick_and_attested_judge_as_verify_does(s3_backend: Backend) -> None:
    _run(s3_backend, "step_1", "step_2", "step_3")
    s3_backend.corrupt("step_3/model.bin")  # the same size: a listing cannot see it
    quick = _prune(s3_backend, keep_last=2, quick=True, dry_run=True)
    assert quick.kept == _urls(s3_backend, "step_3", "step_2") and quick.deleted == _urls(s3_backend, "step_1")
    attested = _prune(s3_backend, keep_last=2, attested=True, dry_run=True)  # what no checksum attests is read
    assert attested.verdicts[_url(s3_backend, "step_3")] == "damaged"
    assert attested.kept == _urls(s3_backend, "step_2", "step_1") and attested.deleted == ()


def test_a_pattern_names_the_run_and_other_folders_are_never_touched(local_and_s3: Backend) -> None:
    """``final-9`` beside ``step_N``: two kinds of name, so which are the run is not certain (a
    ValueError naming ``pattern=``, nothing deleted); ``pattern="step_{step}"`` says it."""
    _run(local_and_s3, "step_1", "step_2", "step_3", "step_4", "final-9")
    with pytest.raises(ValueError, match="pattern="):
        _prune(local_and_s3, keep_last=1)
    assert _folders(local_and_s3) == {"final-9", "step_1", "step_2", "step_3", "step_4"}
    result = _prune(local_and_s3, keep_last=1, pattern="step_{step}")
    assert result.kept == _urls(local_and_s3, "step_4")
    assert result.deleted == _urls(local_and_s3, "step_3", "step_2", "step_1")
    assert _url(local_and_s3, "final-9") not in result.verdicts
    assert _folders(local_and_s3) == {"final-9", "step_4"}


def test_names_alike_but_for_their_numbers_are_aged_by_the_number_that_differs(local_and_s3: Backend) -> None:
    """ckpt-1000-bf16 ... ckpt-10000-bf16: the 16 they all end with says nothing about their age."""
    _run(local_and_s3, *(f"ckpt-{step}-bf16" for step in (1000, 2000, 3000, 4000, 10000)))
    result = _prune(local_and_s3, keep_last=2)
    assert result.kept == _urls(local_and_s3, "ckpt-10000-bf16", "ckpt-4000-bf16")
    assert result.deleted == _urls(local_and_s3, "ckpt-3000-bf16", "ckpt-2000-bf16", "ckpt-1000-bf16")
    assert _folders(local_and_s3) == {"ckpt-10000-bf16", "ckpt-4000-bf16"}


def test_names_without_a_number_are_never_deleted(local_and_s3: Backend) -> None:
    """A sealed base model or final export beside the checkpoints has no step: not a checkpoint
    of the run, neither judged nor deleted, whatever it holds."""
    _run(local_and_s3, "base_model", "final", "step_1", "step_2", "step_3")
    local_and_s3.truncate("final/model.bin", 10)
    result = _prune(local_and_s3, keep_last=1)
    assert result.kept == _urls(local_and_s3, "step_3")
    assert result.deleted == _urls(local_and_s3, "step_2", "step_1")
    assert result.left == ()
    assert set(result.verdicts) == set(_urls(local_and_s3, "step_3", "step_2", "step_1"))
    assert _folders(local_and_s3) == {"base_model", "final", "step_3"}


def _set_times(folder: Path, when: float) -> None:
    for path in folder.rglob("*"):
        os.utime(path, (when, when))


def test_an_uncertain_order_deletes_nothing_and_a_pattern_settles_it(tmp_path: Path) -> None:
    """Names of two kinds (``step_N`` and ``model_2``), or that differ in two integers (``run1_step_200``
    and ``run2_step_150``): no step is certain, so prune refuses (ValueError naming ``pattern=``)
    and deletes nothing. With a pattern: ``step_03`` has the step of ``step_3`` (kept), so it is
    not older and is left; ``run2_step_150``, sealed after the kept ``run1_step_200``, is not
    older on the second clock and is left."""
    t0 = 1_700_000_000.0
    for root, names in (
        ("a", ("step_1", "step_2", "step_3", "step_03", "model_2")),
        ("b", ("run1_step_100", "run1_step_200", "run2_step_150")),
    ):
        for i, name in enumerate(names):
            (tmp_path / root / name).mkdir(parents=True)
            (tmp_path / root / name / "model.bin").write_bytes(os.urandom(100))
            ifs.seal(tmp_path / root / name)
            _set_times(tmp_path / root / name, t0 + i)  # written in this order
        with pytest.raises(ValueError, match="pattern="):
            ifs.prune(tmp_path / root, keep_last=1)
        assert sorted(p.name for p in (tmp_path / root).iterdir()) == sorted(names)

    a = ifs.prune(tmp_path / "a", keep_last=1, pattern="step_{step}")
    assert a.kept == (str(tmp_path / "a" / "step_3"),)
    assert a.deleted == tuple(str(tmp_path / "a" / n) for n in ("step_2", "step_1"))
    assert a.left == (str(tmp_path / "a" / "step_03"),)
    b = ifs.prune(tmp_path / "b", keep_last=1, pattern="run*_step_{step}")
    assert b.kept == (str(tmp_path / "b" / "run1_step_200"),)
    assert b.deleted == (str(tmp_path / "b" / "run1_step_100"),)
    assert b.left == (str(tmp_path / "b" / "run2_step_150"),)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["model_2", "step_03", "step_3"]


def test_hidden_and_staging_folders_are_never_touched(local_and_s3: Backend) -> None:
    _run(local_and_s3, "_staging_step_0", ".tmp_step_1", "step_2", "step_3", "step_4")
    result = _prune(local_and_s3, keep_last=1)
    assert result.deleted == _urls(local_and_s3, "step_3", "step_2")
    assert _folders(local_and_s3) == {"_staging_step_0", ".tmp_step_1", "step_4"}


def test_bad_input(local_and_s3: Backend) -> None:
    _run(local_and_s3, "step_1", "step_2")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="keep_last must be at least 1"):
            _prune(local_and_s3, keep_last=bad)
    for wrong in (True, "2", 1.0):
        with pytest.raises(TypeError, match="keep_last must be an integer"):
            _prune(local_and_s3, keep_last=wrong)
    for flag in ("unsealed", "dry_run", "quick"):
        with pytest.raises(TypeError, match=flag):
            _prune(local_and_s3, keep_last=1, **{flag: "false"})
    with pytest.raises(ValueError, match="exclude each other"):
        _prune(local_and_s3, keep_last=1, quick=True, attested=True)
    for pattern in ("step_", "step_{step}_{step}", "run/step_{step}"):
        with pytest.raises(ValueError, match="pattern"):
            _prune(local_and_s3, keep_last=1, pattern=pattern)
    with pytest.raises(FileNotFoundError) as missing:
        ifs.prune(_url(local_and_s3, "nope"), keep_last=1, storage_options=local_and_s3.storage_options)
    assert not isinstance(missing.value, ifs.ManifestNotFoundError)
    assert _folders(local_and_s3) == {"step_1", "step_2"}


def test_a_checkpoint_changing_while_it_is_judged_is_never_deleted(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for n in (1, 2, 3):
        (root / f"step_{n}").mkdir(parents=True)
        (root / f"step_{n}" / "model.bin").write_bytes(os.urandom(1 << 20))
        ifs.seal(root / f"step_{n}")

    def rewrite() -> None:  # another writer, after the newest one was listed, before it is read
        victim = root / "step_3" / "model.bin"
        fresh = victim.with_name("model.bin.new")
        fresh.write_bytes(victim.read_bytes())
        os.replace(fresh, victim)

    class Once(AfterListing):  # the first verification only: the newest checkpoint's
        def set_size(self, size: int) -> None:
            if self.change is not None:
                change, self.change = self.change, None
                change()
            Callback.set_size(self, size)

    result = ifs.prune(root, keep_last=1, callback=Once(rewrite))
    assert result.verdicts[str(root / "step_3")] == "changing"
    assert result.left == (str(root / "step_3"),) and result.kept == (str(root / "step_2"),)
    assert result.deleted == (str(root / "step_1"),)


def test_with_a_public_key_only_signed_checkpoints_verify(tmp_path: Path) -> None:
    keys, other = make_keys(tmp_path), make_keys(tmp_path, "other")
    root = tmp_path / "run"
    for n in (1, 2, 3, 4):
        (root / f"step_{n}").mkdir(parents=True)
        (root / f"step_{n}" / "model.bin").write_bytes(os.urandom(1000))
        ifs.seal(root / f"step_{n}", private_key=other.private if n == 4 else keys.private)
    (root / "step_0").mkdir()  # never sealed (nor signed): unsealed, left without unsealed=True
    (root / "step_0" / "model.bin").write_bytes(b"half written")
    result = ifs.prune(root, keep_last=2, public_key=keys.public)
    assert result.verdicts[str(root / "step_4")] == "damaged"  # signed by another key
    assert result.verdicts[str(root / "step_0")] == "unsealed"
    assert result.kept == (str(root / "step_3"), str(root / "step_2"))
    assert result.deleted == (str(root / "step_1"),) and result.left == (str(root / "step_4"), str(root / "step_0"))
    assert not (root / "step_1").exists() and (root / "step_0").exists()


# --- storage errors ----------------------------------------------------------------------------------


class _DeniedMemory(MemoryFileSystem):  # type: ignore[misc]
    """The memory store where reading anything of ``denied`` fails, as an outage does."""

    protocol = "deniedmemory"
    denied = ""

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        if self.denied and self.denied in path:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")
        return super().cat_file(path, start, end, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if self.denied and self.denied in path:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)")
        return super()._open(path, mode, **kwargs)


class _DeniedS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """Real S3 (moto) refusing every read of one checkpoint's objects, as S3 refuses them."""

    denied = ""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and self.denied and self.denied in kwargs.get("Key", ""):

            async def refuse(**_: Any) -> Any:
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")

            return await s3fs.core._error_wrapper(refuse, kwargs={}, retries=1)
        return await super()._call_s3(method, *args, **kwargs)


class _DeniedGCS(gcsfs.GCSFileSystem):  # type: ignore[misc]
    """The GCS emulator refusing every read of one checkpoint's objects, as gcsfs reports a 403."""

    denied = ""

    async def _cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.denied and self.denied in path:
            raise OSError(f"Forbidden: {path}\nAccess denied (injected)")
        return await super()._cat_file(path, *args, **kwargs)


@contextmanager
def _outage(store: Backend, victim: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Reads of the checkpoint ``victim`` fail with a storage error; yields the keyword arguments
    (``fs=`` or ``storage_options=``) that reach the store through the failing path."""
    if store.name == "local":
        real_open = os.open

        def failing_open(path: Any, *args: Any, **kwargs: Any) -> int:
            if f"/{victim}/" in os.fspath(path):
                raise OSError(errno.EIO, "Input/output error (injected)", os.fspath(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)
        try:
            yield {"storage_options": {}}
        finally:
            monkeypatch.setattr(os, "open", real_open)
        return
    kinds: dict[str, Any] = {"memory": _DeniedMemory, "s3": _DeniedS3, "gcs": _DeniedGCS}
    fs = kinds[store.name](skip_instance_cache=True, **store.storage_options)
    fs.denied = f"/{victim}/"
    yield {"fs": fs}


def test_an_outage_while_judging_deletes_nothing(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(backend, "step_1", "step_2", "step_3", "step_4")
    before = {name: backend.read(name) for name in backend.listdir()}
    url = backend.root if backend.name != "local" else backend.url
    injected = "injected|Access ?Denied|Forbidden"
    with _outage(backend, "step_1", monkeypatch) as where, pytest.raises(OSError, match=injected) as err:
        ifs.prune(url, keep_last=1, **where)  # step_1, judged last, cannot be read
    assert not isinstance(err.value, (ifs.ManifestNotFoundError, FileNotFoundError))
    assert {name: backend.read(name) for name in backend.listdir()} == before  # not step_3 nor step_2 either
    assert _prune(backend, keep_last=1).deleted == _urls(backend, "step_3", "step_2", "step_1")


# --- the deletion itself ------------------------------------------------------------------------------


def test_a_prune_refused_while_deleting_leaves_a_marked_unsealed_folder_the_next_prune_finishes(
    s3_backend: Backend,
) -> None:
    """S3 refuses to delete one checkpoint's content: that prune raises, the folders it began are
    marked and unsealed (never sealed with files missing), and the next prune, once S3 lets it,
    finishes them whatever its keep_last."""
    _run(s3_backend, "step_1", "step_2", "step_3")

    class NoDeletes(s3fs.S3FileSystem):  # type: ignore[misc]
        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            keys = [o["Key"] for o in kwargs.get("Delete", {}).get("Objects", [])]
            if method == "delete_objects" and any(k.endswith("model.bin") for k in keys):
                return {"Errors": [{"Key": k, "Code": "AccessDenied", "Message": "Access Denied"} for k in keys]}
            return await super()._call_s3(method, *args, **kwargs)

    fs = NoDeletes(skip_instance_cache=True, **s3_backend.storage_options)
    with pytest.raises(OSError, match="could not delete"):
        ifs.prune(s3_backend.root, keep_last=1, fs=fs)
    files = s3_backend.listdir()
    begun = [name for name in ("step_1", "step_2") if f"{name}/{MARKER}" in files]
    assert begun, files
    for name in begun:
        with pytest.raises(ifs.ManifestNotFoundError):
            ifs.verify(_url(s3_backend, name), storage_options=s3_backend.storage_options)
        assert f"{name}/model.bin" in files
    assert _prune(s3_backend, keep_last=3).deleted == _urls(s3_backend, *sorted(begun, reverse=True))
    assert all(not f.startswith(tuple(f"{n}/" for n in begun)) for f in s3_backend.listdir())


def test_local_links_are_never_candidates_nor_followed(tmp_path: Path) -> None:
    """``step_1`` is a link to a checkpoint elsewhere: not a candidate (neither kept nor deleted).
    ``step_2`` holds links out of the run: they are removed with it, their targets untouched, and
    free nothing."""
    outside = tmp_path / "outside"
    (outside / "ckpt").mkdir(parents=True)
    (outside / "ckpt" / "model.bin").write_bytes(b"elsewhere" * 100)
    ifs.seal(outside / "ckpt")
    (outside / "dir").mkdir()
    (outside / "dir" / "keep.bin").write_bytes(b"keep")
    (outside / "file.bin").write_bytes(b"keep too")
    root = tmp_path / "run"
    root.mkdir()
    (root / "step_1").symlink_to(outside / "ckpt", target_is_directory=True)  # a checkpoint folder that is a link
    step_2 = root / "step_2"
    step_2.mkdir()
    (step_2 / "model.bin").write_bytes(os.urandom(500))
    (step_2 / "linked.bin").symlink_to(outside / "file.bin")  # links inside it, leaving the root
    (step_2 / "linked_dir").symlink_to(outside / "dir", target_is_directory=True)
    ifs.seal(step_2)
    for n in (3, 4):
        (root / f"step_{n}").mkdir()
        (root / f"step_{n}" / "model.bin").write_bytes(os.urandom(500))
        ifs.seal(root / f"step_{n}")
    before = sorted((str(p), p.read_bytes()) for p in outside.rglob("*") if p.is_file())
    manifest = len((step_2 / MANIFEST_FILENAME).read_bytes())

    result = ifs.prune(root, keep_last=2)

    assert result.deleted == (str(root / "step_2"),)
    assert str(root / "step_1") not in result.verdicts
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_3", "step_4"]
    assert (root / "step_1").is_symlink()
    assert sorted((str(p), p.read_bytes()) for p in outside.rglob("*") if p.is_file()) == before
    assert ifs.verify(outside / "ckpt").ok
    assert result.bytes_freed == 500 + manifest  # links free nothing: only step_2's own file and manifest


class _SwapForLink(Callback):  # type: ignore[misc]
    """Another writer while prune hashes the newest checkpoint (after it listed the run, before
    it judges and deletes the older ones): replaces ``victim`` by a link to ``target``."""

    def __init__(self, victim: Path, target: Path) -> None:
        super().__init__()
        self.victim, self.target, self.swapped = victim, target, False

    def set_size(self, size: int) -> None:
        if not self.swapped:
            self.swapped = True
            for path in sorted(self.victim.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            self.victim.rmdir()
            self.victim.symlink_to(self.target, target_is_directory=True)
        super().set_size(size)


def test_a_folder_swapped_for_a_link_after_it_was_listed_is_unlinked_not_followed(tmp_path: Path) -> None:
    """The link that replaced step_1 goes; its target gets nothing (no deletion marker) and loses
    nothing (its manifest and signature), and still verifies."""
    keys = make_keys(tmp_path)
    precious = tmp_path / "outside" / "precious"
    precious.mkdir(parents=True)
    (precious / "model.bin").write_bytes(b"elsewhere" * 100)
    ifs.seal(precious, private_key=keys.private)
    before = sorted(p.name for p in precious.iterdir())
    root = tmp_path / "run"
    for n in (1, 2, 3):
        (root / f"step_{n}").mkdir(parents=True)
        (root / f"step_{n}" / "model.bin").write_bytes(os.urandom(100))
        ifs.seal(root / f"step_{n}")
    swap = _SwapForLink(root / "step_1", precious)
    result = ifs.prune(root, keep_last=2, callback=swap)
    assert swap.swapped
    assert result.deleted == (str(root / "step_1"),)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]  # the link went
    assert sorted(p.name for p in precious.iterdir()) == before  # no marker, manifest and signature kept
    assert ifs.verify(precious, public_key=keys.public).ok


class _CountingS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """Real S3 (moto), counting the requests of each kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(method)
        return await super()._call_s3(method, *args, **kwargs)


def test_s3_deletes_in_batches_folder_markers_included(s3_backend: Backend) -> None:
    for n in range(1, 6):
        for i in range(8):
            s3_backend.write(f"step_{n}/shard_{i}.bin", os.urandom(100))
        ifs.seal(_url(s3_backend, f"step_{n}"), storage_options=s3_backend.storage_options)
        s3_backend.folder_marker(f"step_{n}")
        s3_backend.folder_marker(f"step_{n}/empty")
    held = _held(s3_backend, "step_1", "step_2", "step_3", "step_4")
    fs = _CountingS3(skip_instance_cache=True, **s3_backend.storage_options)
    result = ifs.prune(s3_backend.root, keep_last=1, fs=fs)
    assert len(result.deleted) == 4
    # per checkpoint: its manifest, then its files, then the rest (the marker, the folder markers)
    assert 4 <= fs.calls.count("delete_objects") <= 3 * 4
    assert "delete_object" not in fs.calls  # no request per object
    s3_backend.fs.invalidate_cache()
    assert s3_backend.fs.find(s3_backend.path("step_1"), withdirs=True) == []  # the folder markers too
    assert _folders(s3_backend) == {"step_5"}
    assert result.bytes_freed == held


class _GoogleGCS(gcsfs.GCSFileSystem):  # type: ignore[misc]
    """gcsfs as it talks to Google Cloud Storage, which deletes in batch requests (to emulators it
    sends one request per object); the emulator answers gcsfs's batch requests as Google does.
    ``meanwhile``: (a name, a change) run once, just before a batch deleting that name goes."""

    on_google = True
    meanwhile: tuple[str, str] | None = None  # when a batch deletes the first, the second is deleted first

    async def _rm_files(self, paths: Any, *args: Any, **kwargs: Any) -> Any:
        if self.meanwhile is not None and any(str(p).endswith(self.meanwhile[0]) for p in paths):
            gone, self.meanwhile = self.meanwhile[1], None
            await super()._rm_file(gone)  # one request, as another client deletes it
        return await super()._rm_files(paths, *args, **kwargs)


def test_gcs_batch_deletion_on_google(gcs_backend: Backend) -> None:
    """Deleted objects come back by name, and one deleted by someone else meanwhile ("No such
    object") is no failure."""
    _run(gcs_backend, "step_1", "step_2", "step_3")
    fs = _GoogleGCS(skip_instance_cache=True, **gcs_backend.storage_options)
    # another client, after prune listed step_2's files, before it deletes them
    fs.meanwhile = ("step_2/model.bin", gcs_backend.path("step_2/sub/optim.bin"))
    result = ifs.prune(gcs_backend.root, keep_last=1, fs=fs)
    assert fs.meanwhile is None and result.deleted == _urls(gcs_backend, "step_2", "step_1")
    gcs_backend.fs.invalidate_cache()
    assert _folders(gcs_backend) == {"step_3"}


def test_a_failed_gcs_batch_request_is_a_storage_error_and_deletes_nothing_more(
    gcs_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulator refuses every batch request as a whole (403, as Cloud Storage does for a
    caller it does not let in): gcsfs gives one outcome for the batch, not one per object."""
    from gcp_storage_emulator import server

    def refuse(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        response.status = HTTPStatus.FORBIDDEN
        response.json({"error": {"code": 403, "message": "batch refused (injected)"}})

    route = (f"^{server.settings.BATCH_API_ENDPOINT}$", {server.POST: refuse})
    _run(gcs_backend, "step_1", "step_2", "step_3")
    before = {name: gcs_backend.read(name) for name in gcs_backend.listdir()}
    fs = _GoogleGCS(skip_instance_cache=True, **gcs_backend.storage_options)
    monkeypatch.setattr(server, "HANDLERS", (route, *server.HANDLERS))
    with pytest.raises(OSError, match="(?s)step_2.*injected") as err:
        ifs.prune(gcs_backend.root, keep_last=1, fs=fs)
    assert not isinstance(err.value, FileNotFoundError)
    monkeypatch.undo()
    gcs_backend.fs.invalidate_cache()
    after = {name: gcs_backend.read(name) for name in gcs_backend.listdir() if not name.endswith(MARKER)}
    assert after == before  # only the marker of the folder it began was written
    for name in ("step_1", "step_2"):  # still sealed: no file went before its manifest
        assert ifs.verify(_url(gcs_backend, name), storage_options=gcs_backend.storage_options).ok


def test_the_default_is_to_hash_and_a_storage_error_is_no_verdict(tmp_path: Path) -> None:
    fs = _DeniedMemory(skip_instance_cache=True)
    root = f"/prune-{uuid.uuid4().hex}"
    try:
        for n in (1, 2, 3):
            fs.pipe_file(f"{root}/step_{n}/w.bin", os.urandom(100))
            ifs.seal(f"{root}/step_{n}", fs=fs)
        fs.denied = "/step_3/"
        with pytest.raises(ConnectionResetError):
            ifs.prune(root, keep_last=1, fs=fs)
        fs.denied = ""
        assert ifs.prune(root, keep_last=1, fs=fs).kept == (f"deniedmemory://{root}/step_3",)
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)
