"""Thousands of small files (issue 15 part 2): local whole files up to ``core.SMALL_FILE`` are
hashed in batches, one task each, every file in one read into the task's buffer. Every check of
the one-file-per-task path holds for a file in the middle of a batch: growth, vanishing, a FIFO,
a shrunk file, the stop flag between files, the first failure stopping the rest."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import AfterListing, ctrl_c_until

import integrity_fs as ifs
from integrity_fs import IntegrityError, storage
from integrity_fs import work as core
from integrity_fs.hashing import Unit


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]


def _many(root: Path, count: int, size: int = 1000) -> dict[str, bytes]:
    files = {f"d{i % 3}/f{i:03d}.bin": os.urandom(size) for i in range(count)}
    for name, data in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_small_files_go_in_batches_and_large_units_alone() -> None:
    big = core.SMALL_FILE + 1
    units = [Unit("big", 0, 0, big, big), Unit("chunked", 1, 100, 100, 1000), Unit("lone-chunk", 0, 0, 10, 10)]
    units += [Unit(f"s{i}", 0, 0, 1000, 1000) for i in range(core.BATCH_FILES + 1)]
    units += [Unit(f"m{i}", 0, 0, core.SMALL_FILE, core.SMALL_FILE) for i in range(5)]
    tasks = core._tasks(sorted(units, key=lambda u: -u.length))
    per_batch = core.BATCH_BYTES // core.SMALL_FILE
    assert [len(t) for t in tasks] == [1, per_batch, core.BATCH_FILES, 1, 7 - per_batch]
    assert tasks[0] == [units[0]]  # larger than SMALL_FILE: a task of its own
    assert [u.name for u in tasks[1]] == [f"m{i}" for i in range(per_batch)]  # BATCH_BYTES ends it
    assert [u.name for u in tasks[3]] == ["chunked"]  # a chunk that is not its whole file
    assert tasks[-1][-1].name == "lone-chunk"  # a file's only chunk is its whole file


def test_a_file_that_vanished_or_became_a_fifo_inside_a_batch_is_missing(tmp_path, monkeypatch):
    files = _many(tmp_path, 150)
    ifs.seal(tmp_path)
    monkeypatch.setattr(storage.calls, "_RETRY_DELAY_S", 0)

    def change() -> None:
        (tmp_path / "d1/f061.bin").unlink()
        (tmp_path / "d2/f062.bin").unlink()
        os.mkfifo(tmp_path / "d2/f062.bin")

    with pytest.raises(IntegrityError) as err:
        ifs.verify(tmp_path, callback=AfterListing(change), max_workers=2)
    problems = {p.path: (p.kind, p.actual) for p in err.value.report.problems}
    assert problems == {"d1/f061.bin": ("missing", None), "d2/f062.bin": ("missing", None)}
    assert err.value.report.files_checked == 148
    assert len(files) == 150


@pytest.mark.parametrize("how", ["grew", "shrank", "rewritten"])
def test_a_file_changed_after_the_listing_inside_a_batch_is_a_file_changed_error(tmp_path, how):
    """Every read is pinned to the identity the listing saw: a batched small file written to after
    the listing (longer, shorter, or the same size with other bytes) is never judged, never OK."""
    files = _many(tmp_path, 150)
    ifs.seal(tmp_path)
    old = files["d0/f063.bin"]
    new = {"grew": old + b"more", "shrank": old[:10], "rewritten": b"y" + old[1:]}[how]
    with pytest.raises(ifs.FileChangedError, match=r"f063\.bin changed while it was read") as err:
        ifs.verify(tmp_path, callback=AfterListing(lambda: (tmp_path / "d0/f063.bin").write_bytes(new)))
    assert err.value.names and err.value.names[0].endswith("d0/f063.bin")
    (tmp_path / "d0/f063.bin").write_bytes(old)
    assert ifs.verify(tmp_path).ok


def test_batched_files_hash_as_one_file_per_task_does(tmp_path, monkeypatch):
    files = _many(tmp_path, 130, size=3000)
    (tmp_path / "empty.bin").write_bytes(b"")
    sealed = ifs.seal(tmp_path)
    monkeypatch.setattr(core, "SMALL_FILE", -1)  # nothing is small: every file its own task
    assert ifs.seal(tmp_path, overwrite=True).files == sealed.files
    assert len(files) + 1 == len(sealed.files)
    monkeypatch.undo()
    report = ifs.verify(tmp_path, max_workers=3)
    assert report.files_checked == 131 and report.bytes_checked == 130 * 3000


@pytest.mark.timeout(30)
def test_ctrl_c_stops_a_batch_between_files(tmp_path, monkeypatch, ctrl_c, hashing):
    _many(tmp_path, 400, size=100)
    ifs.seal(tmp_path)
    started_files: list[str] = []
    original, lock = storage.hash_range, threading.Lock()

    def held(span: storage.Span, *args: Any, **kwargs: Any) -> str:
        with lock:
            started_files.append(span.path)
            count = len(started_files)
        if count == 20:  # a real Ctrl-C once 20 of the 400 files have started and verify waits for them
            assert hashing.waiting.wait(10)
            ctrl_c_until(kwargs["stop"])
        if count >= 20:  # no file goes on before the stop is set: nothing outruns it
            kwargs["stop"].wait(10)
        return original(span, *args, **kwargs)

    monkeypatch.setattr(storage, "hash_range", held)
    with pytest.raises(KeyboardInterrupt):
        ifs.verify(tmp_path, max_workers=2)
    assert _workers_alive() == []
    count = len(started_files)
    time.sleep(0.1)
    assert len(started_files) == count < 120  # nothing read after the call returned


@pytest.mark.timeout(30)
def test_the_first_failure_stops_the_other_batches(tmp_path, monkeypatch):
    _many(tmp_path, 200, size=100)
    ifs.seal(tmp_path)
    original = storage.hash_range
    calls: list[str] = []

    failed = threading.Event()

    def failing(span: storage.Span, *args: Any, **kwargs: Any) -> str:
        calls.append(span.path)
        if span.path.endswith("f001.bin"):
            failed.set()
            raise PermissionError(13, "denied (injected)", span.path)
        if failed.is_set():  # no file goes on before the stop is set: nothing outruns it
            kwargs["stop"].wait(10)
        time.sleep(0.01)
        return original(span, *args, **kwargs)

    monkeypatch.setattr(storage, "hash_range", failing)
    with pytest.raises(PermissionError, match="injected"):
        ifs.verify(tmp_path, max_workers=2)
    assert _workers_alive() == []
    after = calls[[c.endswith("f001.bin") for c in calls].index(True) + 1 :]
    assert len(after) <= 2 and len(calls) < 200  # each of the 2 workers stopped at its next file
