"""The newest good checkpoint: find_checkpoints, latest_verified, checkpoints.status and
dcp.load_latest, on local disk and S3 (moto); tests/dist_latest_worker.py runs the collective
versions on 2 gloo ranks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fork_server
import fsspec
import pytest
import s3fs
from botocore.exceptions import ClientError
from conftest import Backend, backends
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs
import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, checkpoints, distributed, series

MIXED = ["step_1000", "step_999", "global_step1000", "checkpoint-1000", "iter_0001000", "latest", "step_5", "step_10"]
NEWEST_FIRST = [
    "checkpoint-1000",
    "global_step1000",
    "iter_0001000",
    "step_1000",
    "step_999",
    "step_10",
    "step_5",
    "latest",
]


store = backends("local", "s3")


def _url(store: Backend, name: str) -> str:
    return f"{store.url}/{name}"


def _checkpoint(store: Backend, name: str, *, seal: bool = True, size: int = 3000) -> None:
    store.write(f"{name}/model.bin", os.urandom(size))
    store.write(f"{name}/sub/optim.bin", os.urandom(size // 3))
    if seal:
        ifs.seal(_url(store, name), storage_options=store.storage_options)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "integrity_fs" and r.levelno == logging.WARNING]


# --- find_checkpoints ---------------------------------------------------------------------------


def test_find_checkpoints_orders_mixed_names_newest_first(store: Backend) -> None:
    for name in [*MIXED, "_tmp", ".hidden", "_tmp_step_5000", ".step_9000"]:
        store.write(f"{name}/x.bin", b"x")
    store.write("notes_step_99999.txt", b"a file, not a checkpoint")
    found = ifs.find_checkpoints(store.url, storage_options=store.storage_options)
    assert found == [_url(store, name) for name in NEWEST_FIRST]
    if store.name == "local":
        assert all("://" not in url for url in found)  # plain paths for local roots
    else:
        assert found[0].startswith("s3://")
        # each URL reaches the same store with the same options
        assert fsspec.core.url_to_fs(found[0], **store.storage_options)[1] == store.path(NEWEST_FIRST[0])


def test_find_checkpoints_lists_once_and_reads_nothing() -> None:
    class Counting(MemoryFileSystem):
        protocol = "countingls"

        def __init__(self) -> None:
            super().__init__(skip_instance_cache=True)
            self.calls: list[str] = []

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
            self.calls.append(f"ls {path}")
            return super().ls(path, detail=detail, **kwargs)

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            self.calls.append(f"open {path}")
            return super()._open(path, mode, **kwargs)

        def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
            self.calls.append(f"cat {path}")
            return super().cat_file(path, start, end, **kwargs)

    fs = Counting()
    root = f"/run-{uuid.uuid4().hex}"
    for name in MIXED:
        fs.pipe_file(f"{root}/{name}/{MANIFEST_FILENAME}", b"{}")
    fs.calls.clear()
    found = ifs.find_checkpoints(root, fs=fs)
    assert found == [f"countingls://{root}/{name}" for name in NEWEST_FIRST]
    assert fs.calls == [f"ls {root}"]
    fs.rm(root, recursive=True)


def test_find_checkpoints_on_gcs(gcs_backend: Backend) -> None:
    for name in ["step_2", "step_10", "_staging"]:
        gcs_backend.write(f"{name}/x.bin", b"x")
    found = ifs.find_checkpoints(gcs_backend.url, storage_options=gcs_backend.storage_options)
    assert found == [f"{gcs_backend.url}/step_10", f"{gcs_backend.url}/step_2"]


def test_folder_markers_are_directories_on_s3(s3_backend: Backend) -> None:
    s3_backend.write("step_1/x.bin", b"x")
    s3_backend.folder_marker("step_2")  # what "Create folder" makes
    s3_backend.folder_marker()
    s3_backend.fs.invalidate_cache()
    found = ifs.find_checkpoints(s3_backend.url, storage_options=s3_backend.storage_options)
    assert found == [_url(s3_backend, "step_2"), _url(s3_backend, "step_1")]


def test_find_checkpoints_missing_root_and_file_root(store: Backend) -> None:
    store.write("file", b"x")
    with pytest.raises(FileNotFoundError, match="no directory at") as err:
        ifs.find_checkpoints(_url(store, "nope"), storage_options=store.storage_options)
    assert not isinstance(err.value, ifs.ManifestNotFoundError)
    with pytest.raises(NotADirectoryError):
        ifs.find_checkpoints(_url(store, "file"), storage_options=store.storage_options)


def test_find_checkpoints_sees_a_checkpoint_added_after_an_earlier_listing(s3_backend: Backend) -> None:
    s3_backend.write("step_1/x.bin", b"x")
    options = s3_backend.storage_options
    assert len(ifs.find_checkpoints(s3_backend.url, storage_options=options)) == 1
    other = s3fs.S3FileSystem(skip_instance_cache=True, **options)  # another writer
    other.pipe_file(s3_backend.path("step_2/x.bin"), b"x")
    assert ifs.find_checkpoints(s3_backend.url, storage_options=options)[0] == _url(s3_backend, "step_2")


# --- latest_verified ----------------------------------------------------------------------------


def test_latest_verified_skips_unsealed_invalid_and_damaged(store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    for name in ["step_500", "step_1000", "step_2000"]:
        _checkpoint(store, name)
    _checkpoint(store, "step_3000", seal=False)  # a save that died before sealing
    _checkpoint(store, "step_2500")
    store.write(f"step_2500/{MANIFEST_FILENAME}", b"{not json")
    store.corrupt("step_2000/model.bin", 100)
    store.write("_tmp_step_9000/x.bin", b"staging")
    caplog.set_level(logging.INFO, logger="integrity_fs")

    found = ifs.latest_verified(store.url, storage_options=store.storage_options)
    assert found is not None
    url, report = found
    assert url == _url(store, "step_1000")
    assert report.ok and report.files_checked == 2 and report.bytes_checked == 4000
    warnings = _warnings(caplog)
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith(f"skipping {_url(store, 'step_3000')} (unsealed): ")
    assert warnings[1].startswith(f"skipping {_url(store, 'step_2500')} (invalid manifest): ")
    assert warnings[2].startswith(f"skipping {_url(store, 'step_2000')} (damaged): ")
    assert "model.bin" in warnings[2]


def test_latest_verified_quick_and_strict(store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    _checkpoint(store, "step_1")
    _checkpoint(store, "step_2")
    _checkpoint(store, "step_3")
    store.corrupt("step_3/model.bin", 5)  # same size: only hashing sees it
    store.write("step_2/stray.bin", b"not sealed")
    opts = store.storage_options
    assert ifs.latest_verified(store.url, storage_options=opts, quick=True)[0] == _url(store, "step_3")  # type: ignore[index]
    assert ifs.latest_verified(store.url, storage_options=opts)[0] == _url(store, "step_2")  # type: ignore[index]
    assert ifs.latest_verified(store.url, storage_options=opts, strict=True)[0] == _url(store, "step_1")  # type: ignore[index]
    store.truncate("step_1/model.bin", 10)  # a listing shows it
    store.truncate("step_3/model.bin", 10)
    caplog.clear()
    assert ifs.latest_verified(store.url, storage_options=opts, quick=True, strict=True) is None
    assert len(_warnings(caplog)) == 3


def test_latest_verified_none_and_a_root_not_there_yet(store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="integrity_fs")
    missing = _url(store, "run-never-saved")
    assert ifs.latest_verified(missing, storage_options=store.storage_options) is None
    assert _warnings(caplog) == [f"no checkpoints under {missing}: no directory at {missing}"]
    _checkpoint(store, "run/step_1", seal=False)
    assert ifs.latest_verified(_url(store, "run"), storage_options=store.storage_options) is None
    store.write("file", b"x")
    with pytest.raises(NotADirectoryError):
        ifs.latest_verified(_url(store, "file"), storage_options=store.storage_options)


def test_without_logging_configured_the_skips_name_their_level_and_logger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A training script that configured no logging (no handler anywhere): the WARNING records of
    ``latest_verified`` print as ``integrity_fs: WARNING: …``, not as bare ``skipping …`` lines;
    once the application has a handler of its own, only that one prints them."""
    for name in ("step_1", "step_2"):
        (tmp_path / "run" / name).mkdir(parents=True)
        (tmp_path / "run" / name / "w.bin").write_bytes(b"w")
    ifs.seal(tmp_path / "run" / "step_1")
    root = logging.getLogger()
    configured = root.handlers[:]  # pytest's own: a plain script has none
    for handler in configured:
        root.removeHandler(handler)
    try:
        capsys.readouterr()
        assert ifs.latest_verified(tmp_path / "run") is not None
        assert ifs.latest_verified(tmp_path / "never") is None
        printed = capsys.readouterr().err.splitlines()
        mine = logging.StreamHandler(sys.stdout)  # the application configures logging: it takes over
        root.addHandler(mine)
        try:
            assert ifs.latest_verified(tmp_path / "never") is None
        finally:
            root.removeHandler(mine)
        again = capsys.readouterr()
    finally:
        for handler in configured:
            root.addHandler(handler)
    assert printed == [
        f"integrity_fs: WARNING: skipping {tmp_path / 'run' / 'step_2'} (unsealed): "
        f"no {MANIFEST_FILENAME} at {tmp_path / 'run' / 'step_2'}: the checkpoint was never sealed",
        f"integrity_fs: WARNING: no checkpoints under {tmp_path / 'never'}: no directory at {tmp_path / 'never'}",
    ]
    assert (
        again.err == ""
        and again.out == f"no checkpoints under {tmp_path / 'never'}: no directory at {tmp_path / 'never'}\n"
    )
    caplog.set_level(logging.WARNING, logger="integrity_fs")
    ifs.latest_verified(tmp_path / "never")
    assert [(r.name, r.levelname) for r in caplog.records] == [("integrity_fs", "WARNING")]


class FaultyFS(MemoryFileSystem):
    """A memory filesystem where reading the manifest, or the content, of one checkpoint fails."""

    protocol = "faultyckpt"

    def __init__(self) -> None:
        super().__init__(skip_instance_cache=True)
        self.fail: tuple[str, str, OSError] | None = None  # checkpoint, "manifest" or "content", error

    def _check(self, path: str, what: str) -> None:
        if self.fail is not None and f"/{self.fail[0]}/" in path and self.fail[1] == what:
            raise self.fail[2]

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        self._check(path, "manifest" if path.endswith(MANIFEST_FILENAME) else "content")
        return super().cat_file(path, start, end, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._check(path, "manifest" if path.endswith(MANIFEST_FILENAME) else "content")
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize(
    "error", [PermissionError(13, "Permission denied"), ConnectionResetError("reset")], ids=["permission", "connection"]
)
@pytest.mark.parametrize("what", ["manifest", "content"])
def test_storage_error_on_the_newest_is_raised_not_skipped(error: OSError, what: str) -> None:
    fs = FaultyFS()
    root = f"/run-{uuid.uuid4().hex}"
    for name in ["step_1", "step_2"]:
        fs.pipe_file(f"{root}/{name}/w.bin", os.urandom(1000))
        ifs.seal(f"{root}/{name}", fs=fs)
    fs.fail = ("step_2", what, error)
    with pytest.raises(type(error)):
        ifs.latest_verified(root, fs=fs)
    fs.fail = None
    assert ifs.latest_verified(root, fs=fs)[0] == f"faultyckpt://{root}/step_2"  # type: ignore[index]
    fs.rm(root, recursive=True)


def test_listing_error_is_raised() -> None:
    class Unreachable(MemoryFileSystem):
        protocol = "unreachable"

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
            raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(ConnectionRefusedError):
        ifs.latest_verified("/run", fs=Unreachable(skip_instance_cache=True))


class DeniedS3(s3fs.S3FileSystem):
    """Real S3 (moto) where reading any object of one checkpoint is refused, as S3 refuses it."""

    denied = "step_2/"

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and self.denied in kwargs.get("Key", ""):

            async def refuse(**_: Any) -> Any:
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")

            return await s3fs.core._error_wrapper(refuse, kwargs={}, retries=1)
        return await super()._call_s3(method, *args, **kwargs)


def test_s3_access_denied_on_the_newest_is_raised(s3_backend: Backend) -> None:
    _checkpoint(s3_backend, "step_1")
    _checkpoint(s3_backend, "step_2")
    fs = DeniedS3(skip_instance_cache=True, **s3_backend.storage_options)
    with pytest.raises(PermissionError):
        ifs.latest_verified(s3_backend.url, fs=fs)
    fs.denied = "step_3/"
    assert ifs.latest_verified(s3_backend.url, fs=fs)[0] == _url(s3_backend, "step_2")  # type: ignore[index]


def _sealed_checkpoint(root: Path, name: str) -> None:
    (root / name).mkdir()
    (root / name / "model.bin").write_bytes(os.urandom(100))
    ifs.seal(root / name)


class _DeleteOnSkip(logging.Handler):
    """Deletes ``victim`` when latest_verified logs that it skips a newer checkpoint: the run's
    rotation removing an old checkpoint while a resume looks for the newest good one."""

    def __init__(self, victim: Path) -> None:
        super().__init__(logging.WARNING)
        self.victim = victim

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("skipping") and self.victim.exists():
            for file in self.victim.iterdir():
                file.unlink()
            self.victim.rmdir()


def test_latest_verified_skips_a_candidate_that_vanishes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("step_1", "step_2", "step_3"):
        _sealed_checkpoint(tmp_path, name)
    (tmp_path / "step_3" / "model.bin").write_bytes(b"damaged")
    handler = _DeleteOnSkip(tmp_path / "step_2")
    logger = logging.getLogger("integrity_fs")
    logger.addHandler(handler)
    try:
        found = ifs.latest_verified(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert found is not None and found[0] == str(tmp_path / "step_1")
    assert any("step_2" in r.getMessage() and "vanished" in r.getMessage() for r in caplog.records)


# --- status -------------------------------------------------------------------------------------


def test_status_rows(store: Backend) -> None:
    _checkpoint(store, "step_1")
    _checkpoint(store, "step_2")
    _checkpoint(store, "step_3", seal=False)
    _checkpoint(store, "step_4")
    store.write(f"step_4/{MANIFEST_FILENAME}", b"[]")
    store.corrupt("step_2/model.bin", 7)
    store.truncate("step_1/sub/optim.bin", 10)
    opts = store.storage_options

    rows = checkpoints.status(store.url, storage_options=opts)
    assert [r.to_dict() for r in rows] == [
        {
            "name": "step_4",
            "url": _url(store, "step_4"),
            "sealed": True,
            "files": 2,
            "bytes": 4000,
            "verdict": "invalid",
            "problems": [],
        },
        {
            "name": "step_3",
            "url": _url(store, "step_3"),
            "sealed": False,
            "files": 2,
            "bytes": 4000,
            "verdict": "unsealed",
            "problems": [],
        },
        {
            "name": "step_2",
            "url": _url(store, "step_2"),
            "sealed": True,
            "files": 2,
            "bytes": 4000,
            "verdict": "ok",  # quick: a flipped bit is not visible in a listing
            "problems": [],
        },
        {
            "name": "step_1",
            "url": _url(store, "step_1"),
            "sealed": True,
            "files": 2,
            "bytes": 4000,
            "verdict": "damaged",
            "problems": [
                {
                    "path": "sub/optim.bin",
                    "kind": "size",
                    "expected": 1000,
                    "actual": 10,
                    "byte_ranges": [],
                }
            ],
        },
    ]
    assert "never sealed" in rows[1].detail and "sub/optim.bin" in rows[3].detail
    json.dumps([r.to_dict() for r in rows])

    full = checkpoints.status(store.url, storage_options=opts, full=True)
    assert [r.verdict for r in full] == ["invalid", "unsealed", "damaged", "damaged"]
    assert [(p.path, p.kind) for p in full[2].problems] == [("model.bin", "mismatch")]


def test_status_of_a_seed_manifest_counts_the_bytes_there(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "a.bin").write_bytes(b"12345")
    manifest = ifs.seal(tmp_path / "step_1")
    seed = {"algorithm": "sha256", "files": dict(manifest.files), "granularity": "file", "version": 1}
    (tmp_path / "step_1" / MANIFEST_FILENAME).write_text(json.dumps(seed))
    [row] = checkpoints.status(tmp_path)
    assert (row.files, row.bytes, row.verdict) == (1, 5, "ok")


@pytest.mark.parametrize("algorithm", ["md5", "blake3"])
def test_status_reports_a_manifest_of_an_unsupported_algorithm_as_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    from integrity_fs import hashing

    def no_blake3() -> Any:  # as where the blake3 package is not installed
        raise NotImplementedError("hash algorithm 'blake3' needs the blake3 package")

    monkeypatch.setitem(hashing.ALGORITHMS, "blake3", no_blake3)
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.bin").write_bytes(b"12345")
        ifs.seal(tmp_path / name)
    manifest = json.loads((tmp_path / "step_2" / MANIFEST_FILENAME).read_text())
    (tmp_path / "step_2" / MANIFEST_FILENAME).write_text(json.dumps({**manifest, "algorithm": algorithm}))
    for full in (False, True):
        rows = checkpoints.status(tmp_path, full=full)  # one such checkpoint does not stop the listing
        assert [(r.name, r.sealed, r.files, r.bytes, r.verdict) for r in rows] == [
            ("step_2", True, 1, 5, "invalid"),
            ("step_1", True, 1, 5, "ok"),
        ]
        assert algorithm in rows[0].detail


def test_status_raises_storage_errors() -> None:
    fs = FaultyFS()
    root = f"/run-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/step_1/w.bin", b"x")
    ifs.seal(f"{root}/step_1", fs=fs)
    fs.fail = ("step_1", "manifest", PermissionError(13, "Permission denied"))
    with pytest.raises(PermissionError):
        checkpoints.status(root, fs=fs)
    fs.rm(root, recursive=True)


class _PhantomMemory(MemoryFileSystem):  # type: ignore[misc]
    """A listing that still shows ``run/step_9``, deleted since (an eventually consistent store,
    or a rotation between the listing and the reads)."""

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = super().ls(path, detail=detail, **kwargs)
        if path.rstrip("/").endswith("/run") and detail:
            out = [*out, {"name": path.rstrip("/") + "/step_9", "type": "directory", "size": 0}]
        return out


def test_status_leaves_out_a_candidate_that_vanishes() -> None:
    fs = _PhantomMemory()
    root = f"/phantom-{os.getpid()}/run"
    fs.pipe(f"{root}/step_1/model.bin", b"weights")
    ifs.seal(f"{root}/step_1", fs=fs)
    try:
        rows = checkpoints.status(root, fs=fs)
        assert [(r.name, r.verdict) for r in rows] == [("step_1", "ok")]
        assert ifs.latest_verified(root, fs=fs) is not None
    finally:
        fs.rm(f"/phantom-{os.getpid()}", recursive=True)


# --- dcp.load_latest ----------------------------------------------------------------------------


def _dcp_state(value: int) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    return {"model": {"w": torch.full((100_000,), float(value)), "b": torch.arange(10) * value}, "step": value}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    torch = pytest.importorskip("torch")
    return all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")) and a["step"] == b["step"]


def test_load_latest_loads_the_older_checkpoint_after_the_newest_is_corrupted(
    store: Backend, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from integrity_fs import dcp

    opts = store.storage_options
    for value in (100, 200, 300):
        dcp.save(_dcp_state(value), _url(store, f"step_{value}"), storage_options=opts)
    store.corrupt("step_200/__0_0.distcp", 500)
    store.remove(f"step_300/{MANIFEST_FILENAME}")
    loaded: list[str] = []
    original = dcp.load

    def spy(state_dict: Any, url: Any, **kwargs: Any) -> Any:
        loaded.append(str(url).rsplit("/", 1)[-1])
        assert kwargs.get("verify", True), "a candidate is loaded verified, in one pass"
        return original(state_dict, url, **kwargs)

    monkeypatch.setattr(dcp, "load", spy)
    caplog.set_level(logging.WARNING, logger="integrity_fs")
    target = _dcp_state(0)
    assert dcp.load_latest(target, store.url, storage_options=opts) == _url(store, "step_100")
    assert _same(target, _dcp_state(100))
    assert loaded == ["step_300", "step_200", "step_100"]  # each once: the load is the verification
    assert [m.split(" (")[1].split(")")[0] for m in _warnings(caplog)] == ["unsealed", "damaged"]

    store.corrupt("step_100/.metadata", 3)
    target = _dcp_state(0)
    assert dcp.load_latest(target, store.url, storage_options=opts) is None
    assert _same(target, _dcp_state(0))


def test_load_latest_on_a_run_that_never_saved(tmp_path: Path) -> None:
    from integrity_fs import dcp

    target = _dcp_state(0)
    assert dcp.load_latest(target, tmp_path / "run") is None
    assert _same(target, _dcp_state(0))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("torch")
    from dist_launch import run_ranks

    work = tmp_path_factory.mktemp("latest")
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    targets = {
        "local": {"url": str(work / "run"), "options": {}},
        "s3": {"url": f"s3://integrity-test/latest-{uuid.uuid4().hex}", "options": options},
    }
    results = run_ranks("dist_latest_worker.py", 2, {"targets": targets}, work, timeout=240)
    # What each rank printed (its stdout and stderr): the worker configures no logging, as a plain script.
    printed = [{"log": (work / "out-2" / f"rank{rank}.log").read_text()} for rank in range(2)]
    return {"printed": printed, **{key: results[key] for name in targets for key in (name, f"{name}-prune")}}


def _one(per_rank: list[dict[str, Any]], key: str, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    outcomes = [{k: v for k, v in r[key].items() if k not in ignore} for r in per_rank]
    assert outcomes[0] == outcomes[1], outcomes
    return outcomes[0]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_load_latest_on_two_ranks_makes_the_same_choice(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[target]
    loaded = _one(per_rank, "load_latest", ignore=("warnings", "hashed"))
    assert loaded["type"] == "str" and loaded["value"].endswith("/step_200") and loaded["loaded_200"]
    assert target == "local" or loaded["value"].startswith("s3://")
    rank0, rank1 = per_rank[0]["load_latest"], per_rank[1]["load_latest"]
    assert [m.split(" (")[1].split(")")[0] for m in rank0["warnings"]] == ["unsealed", "damaged"]
    assert "__1_0.distcp" in rank0["warnings"][1]
    assert rank1["warnings"] == []  # logged once, on rank 0
    assert rank0["hashed"] > 0 and rank1["hashed"] > 0  # the hashing is shared

    by_rank0 = _one(per_rank, "rank0_mode", ignore=("hashed",))
    assert by_rank0["type"] == "tuple" and by_rank0["url"] == loaded["value"] and by_rank0["report"]["ok"]
    assert per_rank[0]["rank0_mode"]["hashed"] > 0 and per_rank[1]["rank0_mode"]["hashed"] == 0
    assert _one(per_rank, "quick")["url"].endswith("/step_300")  # a flipped bit is invisible to a listing


@pytest.mark.parametrize("target", ["local", "s3"])
def test_two_ranks_agree_on_none_and_on_errors(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[target]
    # step_300's load failed part-way (rank 1 found the damage after loading model.w from rank
    # 0's file; rank 0 loaded all it asks for): never None with a state_dict holding its bytes.
    none = _one(per_rank, "none")
    assert none["type"] == "PartialLoadError" and none["verified_only"], none
    assert none["message"].startswith("state_dict holds partial data of "), none
    assert "/step_300 on ranks 0, 1 (damaged: " in none["message"] and "__1_0.distcp" in none["message"]
    assert _one(per_rank, "file_root")["type"] == "NotADirectoryError"
    assert _one(per_rank, "missing_root") == {"type": "NoneType", "value": None}
    differ = _one(per_rank, "modes_differ")
    assert differ == {
        "type": "ValueError",
        "message": "ranks passed different modes: 'sharded' on rank 0; 'rank0' on rank 1",
    }
    # Rank 1 sees no checkpoint (a node without the mount): every rank raises, nothing is loaded.
    unseen = [r["unseen_root"] for r in per_rank]
    assert all(u["type"] == "OSError" and "ranks see different checkpoints" in u["message"] for u in unseen), unseen
    assert all("rank 1: 0 checkpoints" in u["message"] and u["untouched"] for u in unseen)
    bad = _one(per_rank, "bad_mode")  # the messages of distributed.seal and verify
    assert bad == {"type": "ValueError", "message": "mode must be one of 'sharded', 'rank0', not 'bogus' (rank 1)"}


def test_a_root_not_there_yet_is_logged_once_a_job_with_its_level_and_logger(two_ranks: Any) -> None:
    """``latest_verified`` of a run that never saved, on 2 ranks that configured no logging: one
    ``integrity_fs: WARNING: no checkpoints under …`` line per call for the whole job (rank 0's),
    not one bare line per rank."""
    rank0, rank1 = (rank["log"].splitlines() for rank in two_ranks["printed"])
    lines = [line for line in rank0 + rank1 if "no checkpoints under" in line]
    assert len(lines) == 2 and lines == [line for line in rank0 if "no checkpoints under" in line], lines
    assert all(line.startswith("integrity_fs: WARNING: no checkpoints under ") for line in lines), lines
    assert lines[0].split()[5].endswith("/run-never:") and lines[1].split()[5].startswith("s3://"), lines


@pytest.mark.parametrize("target", ["local", "s3"])
def test_two_ranks_raise_a_storage_error_of_either_rank(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[target]
    for key in ("listing_denied", "read_denied"):  # rank 0 lists; rank 1 hashes a share
        denied = _one(per_rank, key)
        assert denied["type"] == "PermissionError" and "injected" in denied["message"], key
    interrupted = [r["interrupted"] for r in per_rank]
    assert interrupted[0]["type"] == "KeyboardInterrupt"  # the interrupted rank raises its own
    assert interrupted[1]["type"] == "RuntimeError" and "KeyboardInterrupt" in interrupted[1]["message"]


@pytest.mark.parametrize(
    ("names", "newest_first"),
    [
        (["step_9", "step_10", "step_1e5"], ["step_10", "step_9", "step_1e5"]),  # 1e5: its last integer is 5
        (["run2_step_7", "run1_step_8"], ["run1_step_8", "run2_step_7"]),
        (["b", "a", "step_0", "x_\u0663"], ["step_0", "a", "b", "x_\u0663"]),  # ASCII digits only
        (["step_00100", "step_100", "step_99"], ["step_00100", "step_100", "step_99"]),
        ([f"s{10**40}", f"s{10**40 - 1}"], [f"s{10**40}", f"s{10**40 - 1}"]),
        # alike but for their numbers: the integer that differs tells the age, not the last one (16)
        (
            ["ckpt-1000-bf16", "ckpt-10000-bf16", "ckpt-2000-bf16", "ckpt-4000-bf16"],
            ["ckpt-10000-bf16", "ckpt-4000-bf16", "ckpt-2000-bf16", "ckpt-1000-bf16"],
        ),
        (
            ["iter_5000_rank0", "iter_900_rank0", "model-step100-fp16"],
            ["iter_5000_rank0", "iter_900_rank0", "model-step100-fp16"],
        ),
        (
            ["epoch_2_step_900", "epoch_1_step_500", "epoch_2_step_1000"],
            ["epoch_2_step_1000", "epoch_2_step_900", "epoch_1_step_500"],
        ),
    ],
)
def test_checkpoint_order(names: list[str], newest_first: list[str]) -> None:
    assert series.newest_first(names) == newest_first


def test_find_and_latest_verified_order_names_with_a_numeric_suffix_by_their_step(tmp_path: Path) -> None:
    for step in (1000, 2000, 3000, 4000, 10000):
        (tmp_path / f"ckpt-{step}-bf16").mkdir()
        (tmp_path / f"ckpt-{step}-bf16" / "model.pt").write_bytes(os.urandom(100))
        ifs.seal(tmp_path / f"ckpt-{step}-bf16")
    found = [url.rsplit("/", 1)[-1] for url in ifs.find_checkpoints(tmp_path)]
    assert found == ["ckpt-10000-bf16", "ckpt-4000-bf16", "ckpt-3000-bf16", "ckpt-2000-bf16", "ckpt-1000-bf16"]
    latest = ifs.latest_verified(tmp_path)
    assert latest is not None and latest[0] == str(tmp_path / "ckpt-10000-bf16")


def test_status_full_reports_progress_as_one_total(tmp_path: Path) -> None:
    from fsspec.callbacks import Callback

    class Recorder(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []
            self.done = 0

        def set_size(self, size: int) -> None:
            self.sizes.append(size)

        def relative_update(self, inc: int = 1) -> None:
            self.done += inc

    store = Backend("local", fsspec.filesystem("file"), tmp_path.as_posix(), tmp_path.as_posix(), {})
    for name in ("step_1", "step_2"):
        _checkpoint(store, name)
    _checkpoint(store, "step_3", seal=False)
    recorder = Recorder()
    rows = checkpoints.status(tmp_path, full=True, callback=recorder)
    assert [r.verdict for r in rows] == ["unsealed", "ok", "ok"]
    assert recorder.sizes == [8000] and recorder.done == 8000
    quiet = Recorder()
    checkpoints.status(tmp_path, callback=quiet)  # quick: nothing is hashed
    assert quiet.sizes == [] and quiet.done == 0


def test_readme_resume_example_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The README's save/resume loop, with a small model on local disk: a corrupted newest is skipped."""
    torch = pytest.importorskip("torch")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [block] = [b for b in readme.split("```python\n")[1:] if "import get_state_dict, set_state_dict" in b]
    block = block.split("```", 1)[0]
    code = block.replace('"checkpoints/run"', repr(str(tmp_path / "run")))
    assert repr(str(tmp_path / "run")) in code
    code, loop = code.split("start = resume(")
    assert "save(model, optimizer, step)" in loop
    ns: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), ns)

    def make() -> tuple[Any, Any]:
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.Adam(model.parameters())

    assert ns["resume"](*make()) == 0  # a fresh run
    model, optimizer = make()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    weights = model.weight.detach().clone()
    ns["save"](model, optimizer, 1000)
    with torch.no_grad():
        model.weight.add_(1)
    ns["save"](model, optimizer, 2000)
    [shard] = (tmp_path / "run" / "step_2000").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))

    model, optimizer = make()
    assert ns["resume"](model, optimizer) == 1000
    assert torch.equal(model.weight, weights) and optimizer.state_dict()["state"][0]["step"] == 1
    assert any("step_2000 (damaged)" in m for m in _warnings(caplog))


def test_the_readme_loop_resaves_a_skipped_checkpoint_without_dcps_overwrite_warning(tmp_path: Path) -> None:
    """Resuming past a damaged step_4 and saving step_4 again prints no DCP "Detected an existing
    checkpoint ... overwriting" warning (on any rank): the README's save starts fresh."""
    pytest.importorskip("torch")
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    loop = readme.split("<!-- readme-test: ranks=1,2 -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "train.py").write_text(loop)

    def train() -> subprocess.CompletedProcess[str]:  # python train.py, forked from a warm interpreter
        proc = fork_server.run([tmp_path / "train.py"], cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    train()
    shard = next((tmp_path / "checkpoints" / "run" / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    again = train()
    assert "skipping" in again.stderr and "(damaged)" in again.stderr
    assert "overwriting" not in again.stderr, again.stderr
    assert integrity_fs.verify(tmp_path / "checkpoints" / "run" / "step_4").ok


def test_latest_verified_with_a_public_key_skips_a_resealed_tampering(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
    private = ec.generate_private_key(ec.SECP256R1())
    store = Backend("local", fsspec.filesystem("file"), tmp_path.as_posix(), tmp_path.as_posix(), {})
    for name in ("step_1", "step_2"):
        _checkpoint(store, name, seal=False)
        ifs.seal(tmp_path / name, private_key=private)
    store.corrupt("step_2/model.bin", 9)
    (tmp_path / "step_2" / MANIFEST_FILENAME).unlink()
    ifs.seal(tmp_path / "step_2")  # what someone with write access and no key can do
    assert ifs.latest_verified(tmp_path)[0] == str(tmp_path / "step_2")  # type: ignore[index]
    caplog.clear()
    found = ifs.latest_verified(tmp_path, public_key=private.public_key())
    assert found is not None and found[0] == str(tmp_path / "step_1")
    [warning] = _warnings(caplog)
    assert "step_2 (bad signature)" in warning and "model.bin" in warning


def test_a_signed_checkpoint_copied_to_a_newer_name_is_skipped(
    store: Backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replay: step_1000 (signed) copied whole to step_9000 verifies byte for byte, and its
    signature with it; but the signed statement names step_1000, so with a key the newest that
    verifies is step_1000 itself. status with a key says why step_9000 is not good."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "key.pub"
    public.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    opts = store.storage_options
    _checkpoint(store, "step_1000", seal=False)
    ifs.seal(_url(store, "step_1000"), storage_options=opts, private_key=private)
    for name in ("model.bin", "sub/optim.bin", MANIFEST_FILENAME, ifs.SIGNATURE_FILENAME):
        store.write(f"step_9000/{name}", store.read(f"step_1000/{name}"))
    replayed = _url(store, "step_9000")
    assert ifs.latest_verified(store.url, storage_options=opts)[0] == replayed  # type: ignore[index]
    caplog.clear()
    for found in (
        ifs.latest_verified(store.url, storage_options=opts, public_key=public),
        distributed.latest_verified(store.url, storage_options=opts, public_key=public),
    ):
        assert found is not None and found[0] == _url(store, "step_1000")
    assert any("step_9000 (bad signature)" in m and "signed as 'step_1000'" in m for m in _warnings(caplog))
    assert ifs.verify(replayed, storage_options=opts, public_key=public).ok  # the check is asked for
    with pytest.raises(ifs.SignatureError, match="signed as 'step_1000', not 'step_9000'"):
        ifs.verify(replayed, storage_options=opts, public_key=public, expected_name="step_9000")
    with pytest.raises(ValueError, match="public_key"):
        ifs.verify(replayed, storage_options=opts, expected_name="step_9000")

    rows = {r.name: r for r in checkpoints.status(store.url, storage_options=opts, public_key=public)}
    assert rows["step_1000"].verdict == "ok"
    assert rows["step_9000"].verdict == "damaged" and "signed as 'step_1000'" in rows["step_9000"].detail
    assert [r.verdict for r in checkpoints.status(store.url, storage_options=opts)] == ["ok", "ok"]
    out = _cli(["status", store.url, "--public-key", str(public), "--json", *_cli_options(opts)])
    assert [(r["name"], r["verdict"]) for r in json.loads(out)] == [("step_9000", "damaged"), ("step_1000", "ok")]


def _cli_options(options: dict[str, Any]) -> list[str]:
    endpoint = options.get("client_kwargs", {}).get("endpoint_url")
    flat = {k: v for k, v in options.items() if k != "client_kwargs"}
    args = [f"-o{k}={json.dumps(v)}" for k, v in flat.items()]
    return args + ([f"-oclient_kwargs.endpoint_url={endpoint}"] if endpoint else [])


def _cli(argv: list[str]) -> str:
    import contextlib
    import io

    from integrity_fs.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, out.getvalue()
    return out.getvalue()


# --- retention on two ranks (tests/dist_latest_worker.py) ------------------------------------------------


def _same_on_both(per_rank: list[dict[str, Any]], key: str) -> Any:
    assert per_rank[0][key] == per_rank[1][key], (per_rank[0][key], per_rank[1][key])
    return per_rank[0][key]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_dcp_save_keep_last_on_two_ranks(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[f"{target}-prune"]
    assert _same_on_both(per_rank, "after_each_save") == [
        ["step_1"],
        ["step_1", "step_2"],
        ["step_2", "step_3"],
        ["step_3", "step_4"],
        ["step_4", "step_5"],
    ]
    assert _same_on_both(per_rank, "verified") == [{"type": "bool", "value": True}] * 2
    # step_5 damaged before step_6 was saved: step_4, the older good one, stays; so does step_5 (newer).
    assert _same_on_both(per_rank, "after_damage") == ["step_4", "step_5", "step_6"]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_prune_on_two_ranks(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[f"{target}-prune"]
    dry = [{k: v for k, v in r["dry_run"].items() if k != "hashed"} for r in per_rank]
    assert dry[0] == dry[1] and dry[0]["type"] == "PruneResult" and dry[0]["dry_run"] is True
    names = {key: [url.rsplit("/", 1)[-1] for url in dry[0][key]] for key in ("kept", "deleted", "left")}
    assert names == {"kept": ["step_6"], "deleted": ["step_5", "step_4"], "left": []}
    # Older than the one kept: judged by names and sizes (a flipped bit keeps them), deleted either way.
    assert [v for url, v in dry[0]["verdicts"].items() if url.endswith("step_5")] == ["ok"]
    assert all(r["dry_run"]["hashed"] > 0 for r in per_rank)  # the hashing of step_6 is shared
    differ = _same_on_both(per_rank, "differ")
    assert (
        differ["type"] == "ValueError" and "ranks passed different arguments to distributed.prune" in differ["message"]
    )
    assert _same_on_both(per_rank, "bad_on_one") == {
        "type": "ValueError",
        "message": "keep_last must be at least 1, not 0: a prune never deletes every checkpoint",
    }
    denied = _same_on_both(per_rank, "denied_on_one")  # rank 1 cannot read its share: nothing deleted
    assert denied["type"] == "PermissionError" and denied["left"] == ["step_4", "step_5", "step_6"]
    assert _same_on_both(per_rank, "save_differ") == {
        "type": "ValueError",
        "message": "ranks passed different keep_last to dcp.save: 2 on rank 0; 3 on rank 1",
    }
    real = _same_on_both(per_rank, "real")
    assert {k: v for k, v in real.items() if k != "dry_run"} == {k: v for k, v in dry[0].items() if k != "dry_run"}
    assert _same_on_both(per_rank, "after_real") == ["step_6"]
