"""The newest good checkpoint: find_checkpoints, latest_verified, ``integrity-fs status`` and
dcp.load_latest, on local disk and S3 (moto) (SPEC "Newest good checkpoint");
tests/dist_latest_worker.py runs the collective versions on 2 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
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

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, distributed
from integrity_fs.cli import main

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more

#: One run's names (the step is the one integer that differs), newest first.
RUN = ["step_1000", "step_999", "step_10", "step_5"]
#: The checkpoints of four runs that name their step each its own way.
SEVERAL_RUNS = ["step_1000", "global_step1000", "checkpoint-1000", "iter_0001000"]


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


def _cli_options(options: dict[str, Any]) -> list[str]:
    endpoint = options.get("client_kwargs", {}).get("endpoint_url")
    flat = {k: v for k, v in options.items() if k != "client_kwargs"}
    args = [f"-o{k}={json.dumps(v)}" for k, v in flat.items()]
    return args + ([f"-oclient_kwargs.endpoint_url={endpoint}"] if endpoint else [])


def _cli(argv: list[str], code: int = 0) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        got = main(argv)
    assert got == code, (got, out.getvalue(), err.getvalue())
    return out.getvalue()


def _status(store: Backend, *args: str) -> list[dict[str, Any]]:
    """``integrity-fs status URL --json ARGS``: one object per folder it lists."""
    rows: list[dict[str, Any]] = json.loads(
        _cli(["status", store.url, "--json", *args, *_cli_options(store.storage_options)])
    )
    return rows


# --- find_checkpoints ---------------------------------------------------------------------------


def test_find_checkpoints_orders_one_run_by_its_step_newest_first(store: Backend) -> None:
    """By the step's value (1000 after 999), never by text; hidden and staging folders (``.``/``_``
    first), names without an integer and plain files are not checkpoints of the run."""
    for name in [*RUN, "latest", "_tmp", ".hidden", "_tmp_step_5000", ".step_9000"]:
        store.write(f"{name}/x.bin", b"x")
    store.write("notes_step_99999.txt", b"a file, not a checkpoint")
    found = ifs.find_checkpoints(store.url, storage_options=store.storage_options)
    assert found == [_url(store, name) for name in RUN]
    if store.name == "local":
        assert all("://" not in url for url in found)  # plain paths for local roots
    else:
        assert found[0].startswith("s3://")
        # each URL reaches the same store with the same options
        assert fsspec.core.url_to_fs(found[0], **store.storage_options)[1] == store.path(RUN[0])


@pytest.mark.parametrize(
    "names",
    [SEVERAL_RUNS, ["step_1", "step_2", "tb_logs_2"]],
    ids=["four-naming-schemes", "a-log-folder-beside"],
)
def test_several_runs_in_one_folder_are_ambiguous_without_a_pattern(tmp_path: Path, names: list[str]) -> None:
    """Names that fall in several runs (their shapes differ): which are the checkpoints is not
    certain, so every reader refuses (ValueError naming two of the names and ``pattern=``) and
    prune deletes nothing; a pattern names the run."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.bin").write_bytes(b"x")
        ifs.seal(tmp_path / name)
    for call in (ifs.find_checkpoints, ifs.latest_verified, lambda r: ifs.prune(r, keep_last=1)):
        with pytest.raises(ValueError, match="pattern=") as err:
            call(tmp_path)
        assert sum(name in str(err.value) for name in names) >= 2, err.value
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    pattern, newest = (
        ("checkpoint-{step}", "checkpoint-1000") if "checkpoint-1000" in names else ("step_{step}", "step_2")
    )
    assert ifs.find_checkpoints(tmp_path, pattern=pattern)[0] == str(tmp_path / newest)


def test_find_checkpoints_lists_once_and_reads_nothing() -> None:
    class Counting(MemoryFileSystem):  # type: ignore[misc]
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
    for name in RUN:
        fs.pipe_file(f"{root}/{name}/{MANIFEST_FILENAME}", b"{}")
    fs.calls.clear()
    found = ifs.find_checkpoints(root, fs=fs)
    assert found == [f"countingls://{root}/{name}" for name in RUN]
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
    with pytest.raises(FileNotFoundError, match="no checkpoint at") as err:
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


AMBIGUOUS = "ambiguous"


@pytest.mark.parametrize(
    ("names", "newest_first"),
    [
        (["step_9", "step_10", "step_99"], ["step_99", "step_10", "step_9"]),  # by value, not by text
        (["step_9", "step_10", "step_1e5"], AMBIGUOUS),  # step_1e5 holds two integers: another run
        (["run2_step_7", "run1_step_8"], AMBIGUOUS),  # two integers differ: which is the step?
        (["b", "a", "step_0", "x_\u0663"], ["step_0"]),  # ASCII digits only; no integer: not a checkpoint
        ([f"s{10**40}", f"s{10**40 - 1}"], [f"s{10**40}", f"s{10**40 - 1}"]),
        # alike but for one integer: that one is the step, not the 16 they all end with
        (
            ["ckpt-1000-bf16", "ckpt-10000-bf16", "ckpt-2000-bf16", "ckpt-4000-bf16"],
            ["ckpt-10000-bf16", "ckpt-4000-bf16", "ckpt-2000-bf16", "ckpt-1000-bf16"],
        ),
        (["iter_5000_rank0", "iter_900_rank0", "model-step100-fp16"], AMBIGUOUS),
        (["epoch_2_step_900", "epoch_1_step_500", "epoch_2_step_1000"], AMBIGUOUS),
    ],
)
def test_checkpoint_order(tmp_path: Path, names: list[str], newest_first: Any) -> None:
    for name in names:
        (tmp_path / name).mkdir()
    if newest_first == AMBIGUOUS:
        with pytest.raises(ValueError, match="pattern="):
            ifs.find_checkpoints(tmp_path)
    else:
        assert ifs.find_checkpoints(tmp_path) == [str(tmp_path / n) for n in newest_first]


def test_equal_steps_are_both_newest(tmp_path: Path) -> None:
    """``step_00100`` and ``step_100`` hold the same step: both come before ``step_99``."""
    for name in ("step_00100", "step_100", "step_99"):
        (tmp_path / name).mkdir()
    found = [url.rsplit("/", 1)[-1] for url in ifs.find_checkpoints(tmp_path)]
    assert sorted(found[:2]) == ["step_00100", "step_100"] and found[2] == "step_99"


def test_a_pattern_orders_by_the_integer_at_its_placeholder(tmp_path: Path) -> None:
    """``epoch_*_step_{step}``: the step, whatever the epoch; names that do not match are not the run's."""
    for name in ("epoch_2_step_900", "epoch_1_step_500", "epoch_2_step_1000", "eval_3", "epoch_1_step_x"):
        (tmp_path / name).mkdir()
    found = ifs.find_checkpoints(tmp_path, pattern="epoch_*_step_{step}")
    assert found == [str(tmp_path / n) for n in ("epoch_2_step_1000", "epoch_2_step_900", "epoch_1_step_500")]
    for bad in ("step", "step_{step}_{step}", "a/step_{step}"):
        with pytest.raises(ValueError, match="pattern"):
            ifs.find_checkpoints(tmp_path, pattern=bad)


def test_a_link_is_not_a_checkpoint(tmp_path: Path) -> None:
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_3").symlink_to(tmp_path / "step_2", target_is_directory=True)
    assert ifs.find_checkpoints(tmp_path) == [str(tmp_path / "step_2"), str(tmp_path / "step_1")]


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
    assert warnings[1].startswith(f"skipping {_url(store, 'step_2500')} (invalid): ")
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
    """A run that never saved (its root not there yet) has no checkpoint: ``None``, with a WARNING
    saying so; a root that is a file is an error."""
    caplog.set_level(logging.WARNING, logger="integrity_fs")
    missing = _url(store, "run-never-saved")
    assert ifs.latest_verified(missing, storage_options=store.storage_options) is None
    assert _warnings(caplog) == [f"no checkpoints under {missing}"]
    _checkpoint(store, "run/step_1", seal=False)
    assert ifs.latest_verified(_url(store, "run"), storage_options=store.storage_options) is None
    store.write("file", b"x")
    with pytest.raises(NotADirectoryError):
        ifs.latest_verified(_url(store, "file"), storage_options=store.storage_options)


def test_an_unsupported_algorithm_is_invalid_and_skipped(tmp_path: Path) -> None:
    """A manifest of an algorithm this installation does not know (written by a newer one): that
    checkpoint is ``invalid`` in latest_verified, prune and status alike; the others are judged."""
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.bin").write_bytes(b"12345")
        ifs.seal(tmp_path / name)
    manifest = json.loads((tmp_path / "step_2" / MANIFEST_FILENAME).read_text())
    (tmp_path / "step_2" / MANIFEST_FILENAME).write_text(json.dumps({**manifest, "algorithm": "md5"}))
    found = ifs.latest_verified(tmp_path)
    assert found is not None and found[0] == str(tmp_path / "step_1")
    result = ifs.prune(tmp_path, keep_last=1, dry_run=True)
    assert result.verdicts == {str(tmp_path / "step_2"): "invalid", str(tmp_path / "step_1"): "ok"}
    local = Backend("local", fsspec.filesystem("file"), tmp_path.as_posix(), tmp_path.as_posix(), {})
    for full in ([], ["--full"]):
        rows = _status(local, *full)
        assert [(r["name"], r["sealed"], r["files"], r["bytes"], r["verdict"]) for r in rows] == [
            ("step_2", True, 1, 5, "invalid"),
            ("step_1", True, 1, 5, "ok" if full else "sizes ok"),
        ]
        assert "md5" in " ".join(rows[0]["problems"])


class FaultyFS(MemoryFileSystem):  # type: ignore[misc]
    """A memory filesystem where reading the manifest, or the content, of one checkpoint fails."""

    protocol = "faultyckpt"
    cachable = False  # each instance its own (the files live in the memory store all share)
    fail: tuple[str, str, OSError] | None = None  # checkpoint, "manifest" or "content", error

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(skip_instance_cache=True)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # MemoryFileSystem strips only "memory://"
        return str(super()._strip_protocol(path.removeprefix("faultyckpt://")))

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
    class Unreachable(MemoryFileSystem):  # type: ignore[misc]
        protocol = "unreachable"

        def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
            raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(ConnectionRefusedError):
        ifs.latest_verified("/run", fs=Unreachable(skip_instance_cache=True))


class DeniedS3(s3fs.S3FileSystem):  # type: ignore[misc]
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
    assert any(f"{tmp_path / 'step_2'} (changing)" in m and "gone" in m for m in _warnings(caplog)), _warnings(caplog)


# --- status -------------------------------------------------------------------------------------


def test_status_rows(store: Backend) -> None:
    _checkpoint(store, "step_1")
    _checkpoint(store, "step_2")
    _checkpoint(store, "step_3", seal=False)
    _checkpoint(store, "step_4")
    store.write(f"step_4/{MANIFEST_FILENAME}", b"[]")
    store.corrupt("step_2/model.bin", 7)
    store.truncate("step_1/sub/optim.bin", 10)

    rows = _status(store)
    assert [{k: v for k, v in r.items() if k != "problems"} for r in rows] == [
        {"name": f"step_{n}", "url": _url(store, f"step_{n}"), "sealed": n != 3, "files": 2, "bytes": b, "verdict": v}
        for n, b, v in (
            (4, 4000, "invalid"),
            (3, 4000, "unsealed"),
            (2, 4000, "sizes ok"),  # quick: a flipped bit is not visible in a listing
            (1, 3010, "damaged"),
        )
    ]
    assert rows[1]["problems"] == [] and rows[2]["problems"] == []
    assert "sub/optim.bin" in json.dumps(rows[3]["problems"])

    full = _status(store, "--full")
    assert [r["verdict"] for r in full] == ["invalid", "unsealed", "damaged", "damaged"]
    assert "model.bin" in json.dumps(full[2]["problems"])


def test_status_of_a_seed_manifest_counts_the_bytes_there(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "a.bin").write_bytes(b"12345")
    manifest = ifs.seal(tmp_path / "step_1")
    seed = {"algorithm": "sha256", "files": dict(manifest.files), "granularity": "file", "version": 1}
    (tmp_path / "step_1" / MANIFEST_FILENAME).write_text(json.dumps(seed))
    local = Backend("local", fsspec.filesystem("file"), tmp_path.as_posix(), tmp_path.as_posix(), {})
    [row] = _status(local, "--full")
    assert (row["files"], row["bytes"], row["verdict"]) == (1, 5, "ok")


def test_status_reports_a_storage_error_as_one() -> None:
    """Reading one checkpoint's manifest is refused: ``status`` exits 4 (a storage error), never
    a verdict. ``faultyckpt://`` is registered for the test: the CLI makes its own filesystem."""
    fsspec.register_implementation("faultyckpt", FaultyFS, clobber=True)
    fs = FaultyFS()
    root = f"/run-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/step_1/w.bin", b"x")
    ifs.seal(f"{root}/step_1", fs=fs)
    FaultyFS.fail = ("step_1", "manifest", PermissionError(13, "Permission denied"))
    try:
        out = _cli(["status", f"faultyckpt://{root}", "--json", "--full"], code=4)
        assert "Permission denied" in out
    finally:
        FaultyFS.fail = None
        fs.rm(root, recursive=True)


class _PhantomMemory(MemoryFileSystem):  # type: ignore[misc]
    """A listing that still shows ``run/step_9``, deleted since (an eventually consistent store,
    or a rotation between the listing and the reads)."""

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = super().ls(path, detail=detail, **kwargs)
        if path.rstrip("/").endswith("/run") and detail:
            out = [*out, {"name": path.rstrip("/") + "/step_9", "type": "directory", "size": 0}]
        return out


def test_a_candidate_that_vanishes_after_the_listing_is_never_good() -> None:
    """The listing shows step_9, gone when it is read: ``changing`` (never ``ok``), and the newest
    good checkpoint is the one that is there."""
    fs = _PhantomMemory(skip_instance_cache=True)
    root = f"/phantom-{os.getpid()}/run"
    fs.pipe(f"{root}/step_1/model.bin", b"weights")
    ifs.seal(f"{root}/step_1", fs=fs)
    try:
        found = ifs.latest_verified(root, fs=fs)
        assert found is not None and found[0].endswith("/run/step_1")
        result = ifs.prune(root, keep_last=1, fs=fs, dry_run=True)
        assert [v for url, v in result.verdicts.items() if url.endswith("step_9")] == ["changing"]
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
    store: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    from integrity_fs import dcp

    opts = store.storage_options
    for value in (100, 200, 300):
        dcp.save(_dcp_state(value), _url(store, f"step_{value}"), storage_options=opts)
    store.corrupt("step_200/__0_0.distcp", 500)
    store.remove(f"step_300/{MANIFEST_FILENAME}")
    caplog.set_level(logging.WARNING, logger="integrity_fs")
    target = _dcp_state(0)
    assert dcp.load_latest(target, store.url, storage_options=opts) == _url(store, "step_100")
    assert _same(target, _dcp_state(100))
    skipped = [m for m in _warnings(caplog) if m.startswith("skipping ")]
    assert len(skipped) == 2, skipped
    assert _url(store, "step_300") in skipped[0] and "never sealed" in skipped[0]
    assert _url(store, "step_200") in skipped[1] and "__0_0.distcp" in skipped[1]

    store.corrupt("step_100/.metadata", 3)
    target = _dcp_state(0)
    assert dcp.load_latest(target, store.url, storage_options=opts) is None
    assert _same(target, _dcp_state(0))


def test_load_latest_on_a_run_that_never_saved(tmp_path: Path) -> None:
    from integrity_fs import dcp

    target = _dcp_state(0)
    assert dcp.load_latest(target, tmp_path / "run") is None
    assert _same(target, _dcp_state(0))


def test_find_and_latest_verified_order_names_with_a_numeric_suffix_by_their_step(tmp_path: Path) -> None:
    for step in (1000, 2000, 3000, 4000, 10000):
        (tmp_path / f"ckpt-{step}-bf16").mkdir()
        (tmp_path / f"ckpt-{step}-bf16" / "model.pt").write_bytes(os.urandom(100))
        ifs.seal(tmp_path / f"ckpt-{step}-bf16")
    found = [url.rsplit("/", 1)[-1] for url in ifs.find_checkpoints(tmp_path)]
    assert found == ["ckpt-10000-bf16", "ckpt-4000-bf16", "ckpt-3000-bf16", "ckpt-2000-bf16", "ckpt-1000-bf16"]
    latest = ifs.latest_verified(tmp_path)
    assert latest is not None and latest[0] == str(tmp_path / "ckpt-10000-bf16")


def _readme_loop(tmp_path: Path) -> Any:
    """The README's training loop as ``train.py``, configuring logging (``logging.basicConfig()``)
    as a script that wants to see the skips does; a function that runs it (forked from a warm
    interpreter) and returns the finished process."""
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    loop = readme.split("<!-- readme-test: ranks=1,2 -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "train.py").write_text("import logging\nlogging.basicConfig()\n" + loop)

    def train() -> Any:
        proc = fork_server.run([tmp_path / "train.py"], cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    return train


def _damage_step_4(tmp_path: Path) -> None:
    shard = next((tmp_path / "checkpoints" / "run" / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))


def test_the_readme_loop_resumes_past_a_damaged_checkpoint_and_saves_it_again(tmp_path: Path) -> None:
    """The README's loop run twice, step_4 damaged between: the second run says it skips step_4,
    resumes from step_2 and saves a step_4 that verifies."""
    pytest.importorskip("torch")
    train = _readme_loop(tmp_path)
    train()
    _damage_step_4(tmp_path)
    again = train()
    assert "skipping" in again.stderr and "step_4" in again.stderr
    assert ifs.verify(tmp_path / "checkpoints" / "run" / "step_4").ok
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "run").iterdir()) == ["step_4", "step_6"]


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
    assert f"{tmp_path / 'step_2'} (damaged)" in warning and "signature" in warning and "model.bin" in warning


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
    for name in ("model.bin", "sub/optim.bin", MANIFEST_FILENAME, SIGNATURE):
        store.write(f"step_9000/{name}", store.read(f"step_1000/{name}"))
    replayed = _url(store, "step_9000")
    assert ifs.latest_verified(store.url, storage_options=opts)[0] == replayed  # type: ignore[index]
    caplog.clear()
    for found in (
        ifs.latest_verified(store.url, storage_options=opts, public_key=public),
        distributed.latest_verified(store.url, storage_options=opts, public_key=public),
    ):
        assert found is not None and found[0] == _url(store, "step_1000")
    assert any("step_9000 (damaged)" in m and "step_1000" in m for m in _warnings(caplog)), _warnings(caplog)
    assert ifs.verify(replayed, storage_options=opts, public_key=public).ok  # the check is asked for
    with pytest.raises(ifs.SignatureError, match="step_1000"):
        ifs.verify(replayed, storage_options=opts, public_key=public, expected_name="step_9000")

    rows = {r["name"]: r for r in _status(store, "--public-key", str(public))}
    assert rows["step_1000"]["verdict"] == "sizes ok"
    assert rows["step_9000"]["verdict"] == "damaged" and "step_1000" in json.dumps(rows["step_9000"]["problems"])
    assert [r["verdict"] for r in _status(store)] == ["sizes ok", "sizes ok"]
    full = {r["name"]: r["verdict"] for r in _status(store, "--public-key", str(public), "--full")}
    assert full == {"step_9000": "damaged", "step_1000": "ok"}


# --- on two ranks (tests/dist_latest_worker.py) ----------------------------------------------------


#: The rank side of the two-rank tests, written to the test's folder and run by
#: ``dist_launch.run_ranks`` (it reaches integrity_fs through the public API only).
WORKER = r'''
"""One rank of the two-rank retention test (test_checkpoints.py writes this file and runs it with
``dist_launch.run_ranks``): ``python <this> SPEC.json RANK``.

For each target (a local directory and an S3 prefix): saves step_100 to step_400, rank 0 damages
a file of step_300 that rank 1 wrote and strips the manifest of step_400, then every rank resumes
with ``dcp.load_latest(group=)`` and ``distributed.latest_verified``. Also: no checkpoint that
verifies, a root that is a file, a root not there, a rank that sees no checkpoint, ranks passing
different modes, a storage error or Ctrl-C on one rank. Then retention under ``<target>-prune``:
five ``dcp.save(keep_last=2)``, a sixth after the newest was damaged, ``distributed.prune``.
Faults on one rank come by public means only: on S3 an ``s3fs.S3FileSystem`` subclass passed as
``fs=``; on a local disk an audit hook (``sys.addaudithook``) that refuses the listing or the open
of a checkpoint's files while a flag is set. Bytes hashed are counted by a ``callback=``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import fsspec
import s3fs
import torch
import torch.distributed as dist
from dist_rank import run_rank
from fsspec.asyn import sync
from fsspec.callbacks import Callback

from integrity_fs import MANIFEST_FILENAME, dcp, distributed

WORLD: Any = None  # dist.group.WORLD once the group is up


def state(rank: int, value: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((50_000,), float(value))},
        f"rank{rank}": torch.full((100,), float(value * 10 + rank)),
        "step": value,
    }


def each_from(a: dict[str, Any], *sources: dict[str, Any]) -> bool:
    """Every value of ``a`` is that of one of ``sources``: never anything else."""
    if not any(torch.equal(a["model"]["w"], s["model"]["w"]) for s in sources):
        return False
    keys = [k for k in a if k.startswith("rank")]
    return all(any(torch.equal(a[k], s[k]) for s in sources) for k in keys) and a["step"] in [
        s["step"] for s in sources
    ]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and all(torch.equal(a[k], b[k]) for k in a if k.startswith("rank"))
        and a["step"] == b["step"]
    )


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Hashed(Callback):  # type: ignore[misc]
    """The bytes this rank hashed (what a verification reports through ``callback=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def relative_update(self, inc: int = 1) -> None:
        self.total += inc


# --- faults on one rank -----------------------------------------------------------------------------

FAULT: dict[str, Any] = {}  # {"what": "list" | "read", "under": path, "error": exception}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not FAULT:
        return
    if FAULT["what"] == "list" and event == "os.scandir":
        path = os.fsdecode(args[0]) if args and args[0] is not None and not isinstance(args[0], int) else ""
        if path.rstrip("/") == FAULT["under"]:
            raise FAULT["error"]
    if FAULT["what"] == "read" and event == "open" and args and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if path.startswith(FAULT["under"] + "/") and not path.endswith(MANIFEST_FILENAME):
            raise FAULT["error"]


sys.addaudithook(_audit)


class FaultyS3(s3fs.S3FileSystem):  # type: ignore[misc]
    """S3 (moto) that, while ``FAULT`` is set, refuses the listing of a prefix (in the caller's
    thread, where a Ctrl-C lands) or the GETs of its files."""

    def ls(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if FAULT and FAULT["what"] == "list" and path.rstrip("/") == FAULT["under"]:
            raise FAULT["error"]
        return sync(self.loop, self._ls, path, *args, **kwargs)

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if FAULT and FAULT["what"] == "read" and method == "get_object":
            key = str(kwargs.get("Key", ""))
            path = f"{kwargs.get('Bucket', '')}/{key}"
            if path.startswith(FAULT["under"] + "/") and not key.endswith(MANIFEST_FILENAME):
                raise FAULT["error"]
        return await super()._call_s3(method, *args, **kwargs)


def where(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The keywords that reach ``url`` through a filesystem that can fail (S3), or the storage options (local)."""
    if url.startswith("s3://"):
        return {"fs": FaultyS3(skip_instance_cache=True, **options)}
    return {"storage_options": options}


def path_of(url: str) -> str:
    return url.removeprefix("s3://")


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = fn()
    except (Exception, KeyboardInterrupt) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(value, tuple):
        report = {"ok": value[1].ok, "files_checked": value[1].files_checked}
        return {"type": "tuple", "url": value[0], "report": report}
    return {"type": type(value).__name__, "value": value}


def faulted(rank: int, faulty: int, fault: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank while ``fault`` holds on rank ``faulty`` only."""
    if rank == faulty:
        FAULT.update(fault)
    try:
        return fn()
    finally:
        FAULT.clear()


def on_one_rank(rank: int, faulty: int, fault: dict[str, Any], fn: Callable[[], Any]) -> dict[str, Any]:
    return attempt(lambda: faulted(rank, faulty, fault, fn))


def on_rank0(rank: int, fn: Callable[[], None]) -> None:
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


def latest(url: str, options: dict[str, Any], **kw: Any) -> tuple[str, Any] | None:
    if url.startswith("s3://"):
        return distributed.latest_verified(path_of(url), **where(url, options), **kw)
    return distributed.latest_verified(url, storage_options=options, **kw)


def run_target(url: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(url, **options)
    for value in (100, 200, 300, 400):
        dcp.save(state(rank, value), f"{url}/step_{value}", storage_options=options)

    def damage() -> None:
        path = f"{root}/step_300/__1_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 1
        fs.pipe_file(path, bytes(data))
        fs.rm_file(f"{root}/step_400/{MANIFEST_FILENAME}")
        fs.makedirs(f"{root}/_staging_step_900", exist_ok=True)
        fs.pipe_file(f"{root}/_staging_step_900/x", b"x")
        fs.pipe_file(f"{root}-file", b"not a directory")
        fs.invalidate_cache()

    on_rank0(rank, damage)
    out: dict[str, Any] = {}
    warnings = Warnings()
    logging.getLogger("integrity_fs").addHandler(warnings)
    target = state(rank, 0)
    out["load_latest"] = {
        **attempt(lambda: dcp.load_latest(target, url, storage_options=options, group=WORLD)),
        "loaded_200": same(target, state(rank, 200)),
        "warnings": warnings.messages,
    }
    warnings.messages = []
    hashed = Hashed()
    out["sharded"] = {**attempt(lambda: latest(url, options, callback=hashed)), "hashed": hashed.total}
    hashed = Hashed()
    out["rank0_mode"] = {**attempt(lambda: latest(url, options, mode="rank0", callback=hashed)), "hashed": hashed.total}
    out["quick"] = attempt(lambda: latest(url, options, quick=True))
    denied = PermissionError(13, "Permission denied (injected)")
    listing = {"what": "list", "under": path_of(url) if url.startswith("s3://") else url}
    reading = {"what": "read", "under": listing["under"]}
    out["listing_denied"] = on_one_rank(rank, 0, {**listing, "error": denied}, lambda: latest(url, options))
    ctrl_c = KeyboardInterrupt("injected")
    out["interrupted"] = on_one_rank(rank, 0, {**listing, "error": ctrl_c}, lambda: latest(url, options))
    out["read_denied"] = on_one_rank(rank, 1, {**reading, "error": denied}, lambda: latest(url, options))
    logging.getLogger("integrity_fs").removeHandler(warnings)

    def remove_good() -> None:
        fs.invalidate_cache()
        fs.rm([f"{root}/step_100", f"{root}/step_200"], recursive=True)

    on_rank0(rank, remove_good)
    target = state(rank, 0)
    out["none"] = {
        **attempt(lambda: dcp.load_latest(target, url, storage_options=options, group=WORLD)),
        # One pass: the damaged step_300 may have left its verified bytes; nothing else.
        "verified_only": each_from(target, state(rank, 0), state(rank, 300)),
    }
    out["file_root"] = attempt(lambda: distributed.latest_verified(f"{url}-file", storage_options=options))
    out["missing_root"] = attempt(lambda: distributed.latest_verified(f"{url}-never", storage_options=options))
    modes = ["sharded", "rank0"]
    out["modes_differ"] = attempt(lambda: distributed.latest_verified(url, mode=modes[rank], storage_options=options))
    # A node without the run's storage (rank 1 sees no checkpoint there): never a fresh start alone.
    unseen = [url, f"{url}-never"]
    target = state(rank, 0)
    out["unseen_root"] = {
        **attempt(lambda: distributed.latest_verified(unseen[rank], storage_options=options)),
        "untouched": same(target, state(rank, 0)),
    }
    bad = ["sharded", "bogus"]
    out["bad_mode"] = attempt(lambda: distributed.latest_verified(url, mode=bad[rank], storage_options=options))
    return out


def names(fs: Any, root: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def run_prune(url: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    """Retention on 2 ranks: dcp.save(keep_last=2) and distributed.prune."""
    url = f"{url}-prune"
    fs, root = fsspec.core.url_to_fs(url, **options)
    out: dict[str, Any] = {"after_each_save": []}
    for value in (1, 2, 3, 4, 5):
        dcp.save(state(rank, value), f"{url}/step_{value}", storage_options=options, keep_last=2)
        dist.barrier()
        out["after_each_save"].append(names(fs, root))
    out["verified"] = [
        attempt(lambda n=n: distributed.verify(f"{url}/step_{n}", storage_options=options).ok) for n in (4, 5)
    ]

    def damage_newest() -> None:
        path = f"{root}/step_5/__0_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 1
        fs.pipe_file(path, bytes(data))
        fs.invalidate_cache()

    on_rank0(rank, damage_newest)
    dcp.save(state(rank, 6), f"{url}/step_6", storage_options=options, keep_last=2)
    dist.barrier()
    out["after_damage"] = names(fs, root)

    def pruned(**kw: Any) -> dict[str, Any]:
        try:
            if url.startswith("s3://"):
                result = distributed.prune(path_of(url), **where(url, options), **kw)
            else:
                result = distributed.prune(url, storage_options=options, **kw)
        except (Exception, KeyboardInterrupt) as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
        return {"type": "PruneResult", "kept": list(result.kept), "deleted": list(result.deleted),
                "left": list(result.left), "verdicts": result.verdicts, "dry_run": result.dry_run}  # fmt: skip

    hashed = Hashed()
    out["dry_run"] = {**pruned(keep_last=1, dry_run=True, callback=hashed), "hashed": hashed.total}
    out["differ"] = pruned(keep_last=[1, 2][rank])
    out["bad_on_one"] = pruned(keep_last=[1, 0][rank])
    reading = {"what": "read", "under": path_of(url) if url.startswith("s3://") else url}
    denied = PermissionError(13, "Permission denied (injected)")
    out["denied_on_one"] = faulted(rank, 1, {**reading, "error": denied}, lambda: pruned(keep_last=1))
    dist.barrier()
    out["denied_on_one"]["left"] = names(fs, root)
    out["save_differ"] = attempt(
        lambda: dcp.save(state(rank, 7), f"{url}/step_7", storage_options=options, keep_last=[2, 3][rank])
    )
    out["real"] = pruned(keep_last=1)
    dist.barrier()
    out["after_real"] = names(fs, root)
    return out


def main() -> None:
    def targets(spec: dict[str, Any], rank: int) -> dict[str, Any]:
        global WORLD
        WORLD = dist.group.WORLD
        out = {name: run_target(t["url"], t["options"], rank) for name, t in spec["targets"].items()}
        out.update({f"{name}-prune": run_prune(t["url"], t["options"], rank) for name, t in spec["targets"].items()})
        return out

    run_rank(targets)


if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("torch")
    from dist_launch import run_ranks

    work = tmp_path_factory.mktemp("latest")
    (work / "retention_worker.py").write_text(WORKER)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    targets = {
        "local": {"url": str(work / "run"), "options": {}},
        "s3": {"url": f"s3://integrity-test/latest-{uuid.uuid4().hex}", "options": options},
    }
    spec = {"targets": targets, "pg_timeout_s": 30}
    results = run_ranks(str(work / "retention_worker.py"), 2, spec, work, timeout=120)
    return {key: results[key] for name in targets for key in (name, f"{name}-prune")}


def _one(per_rank: list[dict[str, Any]], key: str, *, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The outcome of ``key``, the same on both ranks (but for ``ignore``)."""
    outcomes = [{k: v for k, v in r[key].items() if k not in ignore} for r in per_rank]
    assert outcomes[0] == outcomes[1], outcomes
    return outcomes[0]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_load_latest_on_two_ranks_makes_the_same_choice(two_ranks: Any, target: str) -> None:
    """step_400 unsealed, step_300 damaged in a file rank 1 wrote: both ranks load step_200 with
    ``dcp.load_latest(group=)``, the skips logged once (on rank 0); ``distributed.latest_verified``
    agrees, its hashing shared in sharded mode and rank 0's alone in rank0 mode; quick cannot see
    the flipped bit."""
    per_rank = two_ranks[target]
    loaded = _one(per_rank, "load_latest", ignore=("warnings",))
    assert loaded["type"] == "str" and loaded["value"].endswith("/step_200") and loaded["loaded_200"]
    assert target == "local" or loaded["value"].startswith("s3://")
    rank0, rank1 = per_rank[0]["load_latest"], per_rank[1]["load_latest"]
    assert [m.split(" (")[1].split(")")[0] for m in rank0["warnings"]] == ["unsealed", "damaged"]
    assert "step_400" in rank0["warnings"][0] and "__1_0.distcp" in rank0["warnings"][1]
    assert rank1["warnings"] == []  # logged once, on rank 0

    sharded = _one(per_rank, "sharded", ignore=("hashed",))
    assert sharded["type"] == "tuple" and sharded["url"] == loaded["value"] and sharded["report"]["ok"]
    assert per_rank[0]["sharded"]["hashed"] > 0 and per_rank[1]["sharded"]["hashed"] > 0  # the hashing is shared
    by_rank0 = _one(per_rank, "rank0_mode", ignore=("hashed",))
    assert by_rank0 == sharded
    assert per_rank[0]["rank0_mode"]["hashed"] > 0 and per_rank[1]["rank0_mode"]["hashed"] == 0
    assert _one(per_rank, "quick")["url"].endswith("/step_300")  # a flipped bit is invisible to a listing


@pytest.mark.parametrize("target", ["local", "s3"])
def test_two_ranks_agree_on_none_and_on_errors(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[target]
    # step_300's load failed part-way (rank 1 found the damage after loading model.w from rank
    # 0's file): never None with a state_dict holding its bytes.
    none = _one(per_rank, "none")
    assert none["type"] == "PartialLoadError" and none["verified_only"], none
    assert "step_300" in none["message"] and "__1_0.distcp" in none["message"]
    assert _one(per_rank, "file_root")["type"] == "NotADirectoryError"
    assert _one(per_rank, "missing_root") == {"type": "NoneType", "value": None}  # a run that never saved
    differ = _one(per_rank, "modes_differ")
    assert differ["type"] == "ValueError" and "'sharded' on rank 0" in differ["message"], differ
    assert "'rank0' on rank 1" in differ["message"]
    # Rank 1 sees no checkpoint (a node without the run's storage): every rank raises.
    unseen = _one(per_rank, "unseen_root")
    assert unseen["type"] == "OSError" and "ranks see different checkpoints" in unseen["message"], unseen
    assert "0 checkpoints on rank 1" in unseen["message"] and unseen["untouched"]
    bad = _one(per_rank, "bad_mode")
    assert bad["type"] == "ValueError" and "'bogus'" in bad["message"]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_two_ranks_raise_a_storage_error_of_either_rank(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[target]
    for key in ("listing_denied", "read_denied"):  # rank 0's listing refused; rank 1's share of the reads
        denied = _one(per_rank, key)
        assert denied["type"] == "PermissionError" and "injected" in denied["message"], key
    interrupted = [r["interrupted"] for r in per_rank]
    assert interrupted[0]["type"] == "KeyboardInterrupt"  # the interrupted rank raises its own
    assert interrupted[1]["type"] == "RuntimeError" and "KeyboardInterrupt" in interrupted[1]["message"]


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
    differ = _same_on_both(per_rank, "save_differ")
    assert differ["type"] == "ValueError" and "keep_last: 2 on rank 0 | 3 on rank 1" in differ["message"]


@pytest.mark.parametrize("target", ["local", "s3"])
def test_distributed_prune_on_two_ranks(two_ranks: Any, target: str) -> None:
    per_rank = two_ranks[f"{target}-prune"]
    dry = [{k: v for k, v in r["dry_run"].items() if k != "hashed"} for r in per_rank]
    assert dry[0] == dry[1] and dry[0]["type"] == "PruneResult" and dry[0]["dry_run"] is True
    names = {key: [url.rsplit("/", 1)[-1] for url in dry[0][key]] for key in ("kept", "deleted", "left")}
    assert names == {"kept": ["step_6"], "deleted": ["step_5", "step_4"], "left": []}
    # Older than the one kept: judged by names and sizes (a flipped bit keeps them), deleted either way.
    assert sorted((url.rsplit("/", 1)[-1], v) for url, v in dry[0]["verdicts"].items()) == [
        ("step_4", "sizes ok"),
        ("step_5", "sizes ok"),
        ("step_6", "ok"),
    ]
    assert all(r["dry_run"]["hashed"] > 0 for r in per_rank)  # the hashing of step_6 is shared
    differ = _same_on_both(per_rank, "differ")
    assert differ["type"] == "ValueError" and "keep_last: 1 on rank 0 | 2 on rank 1" in differ["message"]
    bad = _same_on_both(per_rank, "bad_on_one")
    assert bad["type"] == "ValueError" and "keep_last must be at least 1" in bad["message"]
    denied = _same_on_both(per_rank, "denied_on_one")  # rank 1 cannot read its share: nothing deleted
    assert denied["type"] == "PermissionError" and denied["left"] == ["step_4", "step_5", "step_6"]
    real = _same_on_both(per_rank, "real")
    assert {k: v for k, v in real.items() if k != "dry_run"} == {k: v for k, v in dry[0].items() if k != "dry_run"}
    assert _same_on_both(per_rank, "after_real") == ["step_6"]
