"""dcp.load in one pass: each byte read once, hashed as it is read, handed to DCP only once the
unit holding it verified; the listing checked first; one version of each file.

Local reads are counted by the kernel (``rchar`` of /proc/self/io: bytes this process read),
S3 reads by a moto front that counts the bytes it served.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import BUCKET, Backend  # noqa: E402
from read_counting import CountingS3Server  # noqa: E402
from torch.distributed.checkpoint import DefaultLoadPlanner  # noqa: E402

import integrity_fs as ifs  # noqa: E402
from integrity_fs import FileChangedError, IntegrityError, PartialLoadError, dcp  # noqa: E402

CHUNK = 256 * 1024


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(100_000, generator=gen) for i in range(6)} | {"step": 42}


def _empty() -> dict[str, Any]:
    return {f"t{i}": torch.zeros(100_000) for i in range(6)} | {"step": 0}


def _verified_only(target: dict[str, Any], source: dict[str, Any]) -> list[str]:
    """The tensors of ``target`` loaded (equal to ``source``); raises if any holds anything else."""
    loaded = []
    for name, value in target.items():
        if not isinstance(value, torch.Tensor):
            continue
        if torch.equal(value, source[name]):
            loaded.append(name)
        else:
            assert not value.any(), f"{name} holds bytes that no verification saw"
    return loaded


def _bytes_read() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _total(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.name != ifs.MANIFEST_FILENAME)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io (Linux)")
def test_a_verified_load_reads_each_byte_once(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    dcp.save(_state(), url, granularity="chunk", chunk_size=CHUNK)
    target = _empty()
    before = _bytes_read()
    report = dcp.load(target, url)
    read = _bytes_read() - before
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)] and target["step"] == 42
    assert report is not None and report.bytes_checked == _total(url) and report.files_checked == 2
    # Each byte once (the manifest and the reader's look for the end of each unit aside).
    assert _total(url) <= read <= _total(url) * 1.02 + 64 * 1024


@pytest.fixture(scope="module")
def counting_s3(s3_endpoint: str) -> Iterator[tuple[CountingS3Server, dict[str, Any]]]:
    server = CountingS3Server()
    yield server, {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": server.endpoint}}
    server.stop()


def test_a_verified_load_from_s3_gets_each_byte_once(counting_s3: tuple[CountingS3Server, dict[str, Any]]) -> None:
    server, options = counting_s3
    url = f"s3://{BUCKET}/load-{uuid.uuid4().hex}"
    dcp.save(_state(), url, storage_options=options, granularity="chunk", chunk_size=CHUNK)
    total = sum(ifs.read_manifest(url, storage_options=options).sizes.values())  # type: ignore[union-attr]
    before = server.served_under(url)
    target = _empty()
    report = dcp.load(target, url, storage_options=options)
    served = server.served_under(url) - before
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)]
    assert report is not None and report.bytes_checked == total
    assert total <= served <= total * 1.02 + 4096  # the manifest's few KB aside


def test_a_damaged_chunk_never_reaches_the_state_dict(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    source = _state()
    dcp.save(source, url, granularity="chunk", chunk_size=CHUNK)
    shard = url / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # in the middle of the file: a tensor half way through the load
    shard.write_bytes(bytes(data))
    target = _empty()
    with pytest.raises(IntegrityError) as err:
        dcp.load(target, url)
    (problem,) = err.value.report.problems
    assert problem.path == "__0_0.distcp" and problem.kind == "mismatch"
    start, end = problem.byte_ranges[0]
    assert start <= len(data) // 2 < end and end - start <= CHUNK
    loaded = _verified_only(target, source)
    assert 0 < len(loaded) < 6  # what came before the damaged chunk loaded, verified; the rest did not


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io (Linux)")
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_the_listing_is_checked_before_any_content_is_read(tmp_path: Path, damage: str) -> None:
    url = tmp_path / "ckpt"
    dcp.save(_state(), url, granularity="chunk", chunk_size=CHUNK)
    shard = url / "__0_0.distcp"
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 1)
    else:
        shard.unlink()
    target = _empty()
    before = _bytes_read()
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp: (size|missing)"):
        dcp.load(target, url)
    assert _bytes_read() - before < 32 * 1024  # the manifest only: no byte of content
    assert _verified_only(target, _state()) == []


def _rewrite_keeping_the_mtime(shard: Path, other: Path) -> None:
    """Another checkpoint's bytes in place, same size, and the old mtime put back (as cp -p or
    rsync -a would): only the change time tells."""
    stat = shard.stat()
    with open(shard, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


class _RewriteAfterFirstTensor(DefaultLoadPlanner):
    """DCP's planner, that runs ``action`` once the first tensor was copied into the state dict."""

    def __init__(self, action: Any) -> None:
        super().__init__()
        self._action: Any = action

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        super().commit_tensor(read_item, tensor)
        if self._action is not None:
            self._action, action = None, self._action
            action()


class _RewriteAfterTheListing(DefaultLoadPlanner):
    """DCP's planner, that runs ``action`` once the load has listed the checkpoint and read its
    ``.metadata`` (DCP sets the planner up with it), before any shard is read."""

    def __init__(self, action: Any) -> None:
        super().__init__()
        self._action = action

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self._action()
        super().set_up_planner(*args, **kwargs)


@pytest.mark.parametrize("when", ["after-listing", "while-loading"])
def test_a_shard_rewritten_after_the_listing_is_never_loaded(tmp_path: Path, when: str) -> None:
    url, other = tmp_path / "ckpt", tmp_path / "other"
    source = _state()
    dcp.save(source, url, granularity="chunk", chunk_size=CHUNK)
    dcp.save(_state(seed=1), other, granularity="chunk", chunk_size=CHUNK)
    shard = url / "__0_0.distcp"
    assert shard.stat().st_size == (other / "__0_0.distcp").stat().st_size

    def rewrite() -> None:
        _rewrite_keeping_the_mtime(shard, other / "__0_0.distcp")

    target = _empty()
    planner = _RewriteAfterFirstTensor(rewrite) if when == "while-loading" else _RewriteAfterTheListing(rewrite)
    with pytest.raises(FileChangedError, match=r"__0_0\.distcp changed while it was read"):
        dcp.load(target, url, planner=planner)
    loaded = _verified_only(target, source)  # never a byte of the other checkpoint
    assert loaded == [] if when == "after-listing" else len(loaded) < 6


def test_an_s3_shard_replaced_after_the_listing_is_never_loaded(s3_backend: Backend) -> None:
    """IfMatch with the listed ETag on every GET: moto answers 412 once the object was replaced."""
    options = s3_backend.storage_options
    url, other = s3_backend.url + "/ckpt", s3_backend.url + "/other"
    dcp.save(_state(), url, storage_options=options, granularity="chunk", chunk_size=CHUNK)
    dcp.save(_state(seed=1), other, storage_options=options, granularity="chunk", chunk_size=CHUNK)

    def replace() -> None:
        s3_backend.fs.pipe_file(s3_backend.path("ckpt/__0_0.distcp"), s3_backend.read("other/__0_0.distcp"))

    target = _empty()
    with pytest.raises(FileChangedError):
        dcp.load(target, url, storage_options=options, planner=_RewriteAfterTheListing(replace))
    assert _verified_only(target, _state()) == []


def test_a_file_granularity_checkpoint_loads_verified(tmp_path: Path) -> None:
    """Sealed by ``seal`` (whole files): each file is held whole while it is verified, or, past
    the bound, verified first and then read (pinned to the same version)."""
    url = tmp_path / "ckpt"
    dcp.save(_state(), url, granularity="file")
    target = _empty()
    report = dcp.load(target, url)
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)]
    assert report is not None and report.bytes_checked == _total(url)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io (Linux)")
def test_load_latest_loads_in_one_pass_after_skipping_a_damaged_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        dcp.save(_state(seed=step), root / f"step_{step}", granularity="chunk", chunk_size=CHUNK)
    shard = root / "step_2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1  # the last chunk: found at the very end of the newest load
    shard.write_bytes(bytes(data))
    target = _empty()
    before = _bytes_read()
    assert dcp.load_latest(target, root) == str(root / "step_1")
    read = _bytes_read() - before
    assert _verified_only(target, _state(seed=1)) == [f"t{i}" for i in range(6)]
    both = _total(root / "step_1") + _total(root / "step_2")
    assert read <= both * 1.02 + 128 * 1024  # each candidate read once: no verify pass before the load
    skipped = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_2" in m and "failed verification" in m for m in skipped), skipped


def _damage_the_last_chunk(root: Path) -> None:
    """A flipped bit in the last chunk of the shard: found once every earlier unit has loaded."""
    shard = root / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1
    shard.write_bytes(bytes(data))


def test_load_latest_over_two_checkpoints_damaged_part_way_raises_never_none(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        dcp.save(_state(seed=step), root / f"step_{step}", granularity="chunk", chunk_size=CHUNK)
        _damage_the_last_chunk(root / f"step_{step}")
    target = _empty()
    with pytest.raises(PartialLoadError) as err:
        dcp.load_latest(target, root)
    assert isinstance(err.value, IntegrityError)
    message = str(err.value)
    assert message.startswith(f"state_dict holds partial data of {root / 'step_2'} (damaged: ")
    assert f"; {root / 'step_1'} (damaged: " in message and f"no checkpoint under {root} loaded over it" in message
    assert isinstance(err.value.__cause__, IntegrityError)
    assert [p.path for p in err.value.report.problems] == ["__0_0.distcp"]  # step_2's damage
    assert err.value.location == str(root / "step_2")
    assert 0 < len(_verified_only(target, _state(seed=1))) < 6  # partial data indeed: step_1's first tensors


def test_load_latest_raises_when_the_checkpoint_it_loads_does_not_cover_what_a_damaged_one_left(
    tmp_path: Path,
) -> None:
    """With a planner that allows partial loads, the checkpoint that loads may lack a key that a
    damaged newer one wrote into: that key still holds the damaged checkpoint's bytes."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    root = tmp_path / "run"
    older = {k: v for k, v in _state(seed=1).items() if k != "t0"}
    dcp.save(older, root / "step_1", granularity="chunk", chunk_size=CHUNK)
    dcp.save(_state(seed=2), root / "step_2", granularity="chunk", chunk_size=CHUNK)
    _damage_the_last_chunk(root / "step_2")  # t0 (the first tensor) loaded from step_2, verified
    target = _empty()
    with pytest.raises(PartialLoadError) as err:
        dcp.load_latest(target, root, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert f"{root / 'step_1'}, loaded after it, did not write every key" in str(err.value)
    assert torch.equal(target["t0"], _state(seed=2)["t0"]) and torch.equal(target["t5"], _state(seed=1)["t5"])


def test_a_checkpoint_copied_away_with_its_manifest_loads_from_the_copy(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    dcp.save(_state(), url)
    shutil.copytree(url, tmp_path / "copy")
    target = _empty()
    assert dcp.load(target, tmp_path / "copy") is not None
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)]


@pytest.mark.parametrize("form", ["file://", "local://", "relative", "Path"])
def test_every_form_of_a_local_url_saves_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """A local checkpoint named as a URL (``file://``, ``local://``), a relative path or a
    ``pathlib.Path``: each is the same directory for save, load and load_latest."""
    monkeypatch.chdir(tmp_path)

    def named(path: Path) -> str | Path:
        if form == "Path":
            return path
        if form == "relative":
            return str(path.relative_to(tmp_path))
        return form + str(path)

    dcp.save(_state(), named(tmp_path / "run" / "step_1"))
    assert ifs.verify(tmp_path / "run" / "step_1").files_checked == 2  # sealed where a path says
    target = _empty()
    report = dcp.load(target, named(tmp_path / "run" / "step_1"))
    assert report is not None and report.bytes_checked == _total(tmp_path / "run" / "step_1")
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)] and target["step"] == 42
    target = _empty()
    assert dcp.load_latest(target, named(tmp_path / "run")) == str(tmp_path / "run" / "step_1")
    assert _verified_only(target, _state()) == [f"t{i}" for i in range(6)]


# --- the shapes of state dicts: tensors that span units, and many inside one unit ---------------

#: (tensors, elements each): 6 of 400 KB span the 256 KiB units; 64 of 12 KB lie inside them.
SHAPES = {"spanning": (6, 100_000), "inside": (64, 3_000)}


def _shaped(shape: str, seed: int = 0) -> dict[str, Any]:
    count, numel = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(numel, generator=gen) for i in range(count)} | {"step": 42}


def _zeros(shape: str) -> dict[str, Any]:
    count, numel = SHAPES[shape]
    return {f"t{i}": torch.zeros(numel) for i in range(count)} | {"step": 0}


def _items(url: Path) -> dict[str, tuple[int, int]]:
    """Where DCP put each tensor in the shard: name -> (offset, length)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(url).read_metadata().storage_data
    return {index.fqn: (info.offset, info.length) for index, info in storage.items()}


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io (Linux)")
@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_loads_verified_each_byte_read_once(tmp_path: Path, shape: str) -> None:
    url = tmp_path / "ckpt"
    dcp.save(_shaped(shape), url, granularity="chunk", chunk_size=CHUNK)
    target = _zeros(shape)
    before = _bytes_read()
    report = dcp.load(target, url)
    read = _bytes_read() - before
    assert _verified_only(target, _shaped(shape)) == [f"t{i}" for i in range(SHAPES[shape][0])]
    assert report is not None and report.bytes_checked == _total(url)
    assert _total(url) <= read <= _total(url) * 1.02 + 64 * 1024


@pytest.mark.parametrize("shape", SHAPES)
def test_a_damaged_unit_hands_out_nothing_of_itself(tmp_path: Path, shape: str) -> None:
    """Exactly the tensors that end before the damaged chunk load (verified); none that touches it."""
    url = tmp_path / "ckpt"
    source = _shaped(shape)
    dcp.save(source, url, granularity="chunk", chunk_size=CHUNK)
    shard = url / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    damaged = 2 * CHUNK + 1000  # in the third chunk
    data[damaged] ^= 1
    shard.write_bytes(bytes(data))
    target = _zeros(shape)
    with pytest.raises(IntegrityError, match=rf"mismatch in bytes {2 * CHUNK}-{3 * CHUNK - 1}"):
        dcp.load(target, url)
    before_damage = sorted(
        name
        for name, (offset, length) in _items(url).items()
        if offset + length <= 2 * CHUNK and isinstance(target[name], torch.Tensor)
    )
    assert sorted(_verified_only(target, source)) == before_damage and before_damage


#: Loads a 48 MiB state dict (48 tensors of 1 MiB) sealed in 8 MiB chunks from ``sys.argv[1]``;
#: prints how far the process's peak RSS rose over its RSS before (the kernel's peak, reset first).
PEAK_OF_A_LOAD = """
import ctypes, sys, torch
from integrity_fs import dcp

ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: each unit mapped, so a freed one leaves at once

def kib(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1])

state = {f"t{i}": torch.randn(262_144) for i in range(48)}
dcp.save(state, sys.argv[1], granularity="chunk", chunk_size=8 << 20)
target = {name: torch.zeros(262_144) for name in state}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the RSS now
before = kib("VmRSS:")
dcp.load(target, sys.argv[1])
assert all(torch.equal(target[name], state[name]) for name in state)
print((kib("VmHWM:") - before) / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resets the peak RSS through /proc (Linux)")
def test_a_verified_load_holds_at_most_three_units_of_memory(tmp_path: Path) -> None:
    """The kernel's peak RSS of a load, over the RSS before it: the reader holds at most three
    units (the one DCP copies from, the one before it, the one read ahead: 24 MiB together), and
    the 1 MiB item being assembled across a unit's end (glibc maps each unit, so a freed one
    leaves at once)."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_OF_A_LOAD, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    peak_mib = float(done.stdout.split()[-1])
    assert peak_mib <= 3 * 8 + 1 + 3, f"{peak_mib:.1f} MiB over the RSS before the load"


def test_tensors_of_every_dtype_and_layout_load_as_dcp_loads_them(tmp_path: Path) -> None:
    """Tensors made over the verified units, then copied into targets of another dtype or layout:
    the same as plain ``dcp.load`` gives."""
    url = tmp_path / "ckpt"
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(300, 200, generator=gen)
    state: dict[str, Any] = {
        "f64": base.double(),
        "bf16": base.bfloat16(),
        "i8": (base * 50).to(torch.int8),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 7),
        "transposed": base.t(),
        "into_f64": base,
        "into_transposed": base,
        "into_conj": torch.complex(base, base),
    }
    dcp.save(state, url, granularity="chunk", chunk_size=CHUNK)

    def targets() -> dict[str, Any]:
        out = {name: torch.zeros_like(value) for name, value in state.items()}
        out["into_f64"] = torch.zeros(300, 200, dtype=torch.float64)  # converted as it is copied
        out["into_transposed"] = torch.zeros(200, 300).t()  # not contiguous
        out["into_conj"] = torch.zeros(300, 200, dtype=torch.complex64).conj()  # written through its conjugate
        return out

    ours, plain = targets(), targets()
    dcp.load(ours, url)
    dcp.load(plain, url, verify=False)
    for name in state:
        assert ours[name].dtype == plain[name].dtype and torch.equal(ours[name], plain[name]), name
    assert torch.equal(ours["into_f64"], base.double()) and torch.equal(ours["transposed"], base.t())


def test_load_latest_with_no_room_to_spool_raises_instead_of_skipping_every_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's ``TMPDIR`` removed under it, and shards of file granularity too large to hold
    (past 64 MiB they are verified into a spool first): a fault of this machine, raised, not every
    checkpoint skipped as vanished with ``None`` returned (a job would then start from scratch)."""
    import tempfile

    def big(seed: int) -> dict[str, Any]:
        return {"w": torch.full((17 << 20,), float(seed))}  # 68 MiB

    for step in (1, 2):
        dcp.save(big(step), tmp_path / "run" / f"step_{step}", granularity="file")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "removed-tmpdir"))
    target = {"w": torch.zeros(17 << 20)}
    with pytest.raises(OSError, match="spool") as raised:
        dcp.load_latest(target, tmp_path / "run")
    assert not isinstance(raised.value, FileNotFoundError)
    assert not target["w"].any()
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert dcp.load_latest(target, tmp_path / "run") == str(tmp_path / "run" / "step_2")
    assert torch.equal(target["w"], big(2)["w"])
