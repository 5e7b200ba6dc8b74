"""Thousands of small files: local whole files are hashed in batches (one task reads many files).
Every check of the one-file-per-task path holds for a file in the middle of a batch: growth,
vanishing, a FIFO, a shrunk file, the stop between files, the first failure stopping the rest."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import AfterListing
from fsspec.callbacks import Callback

import integrity_fs as ifs


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("integrity_fs_")]


def _many(root: Path, count: int, size: int = 1000) -> dict[str, bytes]:
    files = {f"d{i % 3}/f{i:03d}.bin": os.urandom(size) for i in range(count)}
    for name, data in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.mark.parametrize("workers", [1, 3])
def test_many_small_files_hash_to_their_own_digests(tmp_path: Path, workers: int) -> None:
    files = _many(tmp_path, 130, size=3000)
    files["empty.bin"] = b""
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "big.bin").write_bytes(big := os.urandom(3 * 1024 * 1024))  # beside them, a file of its own
    files["big.bin"] = big
    sealed = ifs.seal(tmp_path, max_workers=workers)
    assert dict(sealed.files) == {n: hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())}
    report = ifs.verify(tmp_path, max_workers=workers)
    assert report.files_checked == 132 and report.bytes_checked == sum(map(len, files.values()))


@pytest.mark.parametrize("how", ["vanished", "fifo", "folder"])
def test_a_file_gone_after_the_listing_inside_a_batch_is_a_file_changed_error(tmp_path: Path, how: str) -> None:
    """Deleted, or replaced by a FIFO or a folder, after the listing: a change, never damage (and
    a FIFO is never opened for reading: nothing blocks)."""
    _many(tmp_path, 150)
    ifs.seal(tmp_path)
    path = tmp_path / "d1/f061.bin"

    def change() -> None:
        path.unlink()
        if how == "fifo":
            os.mkfifo(path)
        elif how == "folder":
            path.mkdir()

    with pytest.raises(ifs.FileChangedError, match=r"f061\.bin changed while it was read") as err:
        ifs.verify(tmp_path, callback=AfterListing(change), max_workers=2)
    assert not isinstance(err.value, ifs.IntegrityError)


@pytest.mark.parametrize("how", ["grew", "shrank", "rewritten"])
def test_a_file_changed_after_the_listing_inside_a_batch_is_a_file_changed_error(tmp_path: Path, how: str) -> None:
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


class _Files(Callback):  # type: ignore[misc]
    """Counts the files hashed (each small file is one progress update), calling ``each(count)``
    after each: progress is told from the worker that read the file."""

    count = 0

    def __init__(self, each: Any) -> None:
        super().__init__()
        self.each = each

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        self.count += 1
        self.each(self.count)


@pytest.fixture
def interrupted() -> Any:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread, as in a terminal, and sets the event first."""
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
def test_ctrl_c_stops_a_batch_between_files(tmp_path: Path, interrupted: threading.Event) -> None:
    """A real Ctrl-C once 20 of 400 files are hashed; the workers go on only once it was delivered
    (and the stop had time to be set): each stops at its next file, none outlives the call."""
    _many(tmp_path, 400, size=100)
    ifs.seal(tmp_path)

    def each(count: int) -> None:
        if count == 20:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        if count >= 20:
            interrupted.wait(10)
            time.sleep(0.2)

    files = _Files(each)
    with pytest.raises(KeyboardInterrupt):
        ifs.verify(tmp_path, max_workers=2, callback=files)
    assert _workers_alive() == []
    count = files.count
    time.sleep(0.1)
    assert files.count == count <= 22  # 20, then at most one more per worker; nothing after the call returned


@pytest.mark.timeout(30)
def test_the_first_failure_stops_the_other_batches(tmp_path: Path) -> None:
    """The first file of the first batch turns into a folder after the listing: its worker fails at
    once; the other, hashing a batch of its own (a file each 10 ms), stops at its next file."""
    _many(tmp_path, 200, size=100)
    ifs.seal(tmp_path)
    first = tmp_path / "d0/f000.bin"

    def change() -> None:
        first.unlink()
        first.mkdir()

    class Slow(AfterListing):
        hashed = 0

        def relative_update(self, inc: int = 1) -> None:
            super().relative_update(inc)
            self.hashed += 1
            time.sleep(0.01)

    progress = Slow(change)
    with pytest.raises(ifs.FileChangedError, match="f000.bin"):
        ifs.verify(tmp_path, max_workers=2, callback=progress)
    assert _workers_alive() == []
    assert progress.hashed < 20  # 199 without the stop
