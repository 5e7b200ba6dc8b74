"""Hash algorithms: BLAKE3 through the same dispatch as SHA-256, on every backend; SHA-256 the default."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from fsspec.callbacks import Callback

blake3 = pytest.importorskip("blake3").blake3

import integrity_fs as ifs  # noqa: E402
from integrity_fs import MANIFEST_FILENAME, FileChangedError, IntegrityError, Manifest  # noqa: E402
from integrity_fs.cli import main as cli_main  # noqa: E402
from integrity_fs.hashing import BLAKE3_THREADED_MIN, new_hasher  # noqa: E402

FILES = {
    "big.bin": os.urandom(3 * BLAKE3_THREADED_MIN + 12345),  # threaded updates, several reads
    "small.bin": os.urandom(1000),
    "sub/empty": b"",
}


@pytest.fixture
def ckpt(backend: Any) -> Any:
    for name, data in FILES.items():
        backend.write(name, data)
    return backend


def test_seal_and_verify_with_blake3(ckpt: Any) -> None:
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm="blake3")
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    assert raw["algorithm"] == "blake3"
    assert raw["files"] == {name: blake3(data).hexdigest() for name, data in FILES.items()}
    assert manifest.files == raw["files"]
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.bytes_checked == sum(map(len, FILES.values()))
    ckpt.corrupt("big.bin", -1)
    with pytest.raises(IntegrityError, match="big.bin: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


def test_chunk_granularity_combines_chunk_digests_with_blake3(ckpt: Any) -> None:
    chunk = BLAKE3_THREADED_MIN + 7
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, algorithm="blake3", granularity="chunk", chunk_size=chunk)
    raw = json.loads(ckpt.read(MANIFEST_FILENAME))
    data = FILES["big.bin"]
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    assert raw["chunks"]["big.bin"] == [blake3(p).hexdigest() for p in pieces]
    combined = blake3(b"".join(blake3(p).digest() for p in pieces)).hexdigest()
    assert raw["files"]["big.bin"] == combined
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok
    ckpt.corrupt("big.bin", chunk + 3)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    (problem,) = err.value.report.problems
    assert problem.byte_ranges == ((chunk, 2 * chunk),)


@pytest.mark.parametrize("pieces", [[1], [10, BLAKE3_THREADED_MIN, 5], [4 * BLAKE3_THREADED_MIN, 3, 0]])
def test_threaded_and_single_threaded_updates_give_the_same_digest(pieces: list[int]) -> None:
    data = os.urandom(sum(pieces))
    hasher = new_hasher("blake3")
    offset = 0
    for n in pieces:
        hasher.update(memoryview(data)[offset : offset + n])
        offset += n
    assert hasher.hexdigest() == blake3(data).hexdigest()
    assert hasher.digest() == blake3(data).digest()


def test_sha256_stays_the_default(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    assert ifs.seal(tmp_path).algorithm == "sha256"


def test_without_the_package_blake3_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").write_bytes(b"a")
    sealed = tmp_path / "sealed"
    sealed.mkdir()
    (sealed / "a").write_bytes(b"a")
    ifs.seal(sealed, algorithm="blake3")
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 now raises ImportError
    hint = r"pip install 'integrity-fs\[blake3\]'"
    with pytest.raises(NotImplementedError, match=hint):
        ifs.seal(tmp_path, algorithm="blake3")
    assert not (tmp_path / MANIFEST_FILENAME).exists()
    with pytest.raises(NotImplementedError, match=hint):
        ifs.verify(sealed)
    with pytest.raises(NotImplementedError, match=hint):
        Manifest.from_json((sealed / MANIFEST_FILENAME).read_bytes())
    assert cli_main(["verify", str(sealed)]) == 3  # unsupported algorithm: the CLI's "manifest" code


def test_docs_blake3_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (Path(__file__).parent.parent / "docs" / "manifest.md").read_text()
    section = page.split("## Algorithms", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    exec(compile(snippet, "docs/manifest.md (Algorithms)", "exec"), {})


# --- local BLAKE3 reads map the file ---------------------------------------------------------------

PIECE = 1024 * 1024  # the mapping is hashed in pieces of this size here (16 MiB by default)


def _bytes_read() -> int:
    """Bytes this process has read with read(2) and its kind (``rchar``): a mapped file's are not."""
    with open("/proc/self/io", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


class _After(Callback):  # type: ignore[misc]
    """Runs ``action`` once, when ``count`` bytes were hashed."""

    def __init__(self, count: int, action: Any) -> None:
        super().__init__()
        self._count = count
        self._action: Any = action

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        if self._action is not None and self.value >= self._count:
            self._action, action = None, self._action
            action()


@pytest.fixture
def mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file of 5 pieces and a bit, sealed with BLAKE3, hashed from a mapping in 1 MiB pieces."""
    from integrity_fs.storage import read as storage_read

    monkeypatch.setattr(storage_read, "MAPPED_PIECE", PIECE)
    (tmp_path / "big.bin").write_bytes(os.urandom(5 * PIECE + 777))
    ifs.seal(tmp_path, algorithm="blake3")
    return tmp_path


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io (Linux)")
def test_a_blake3_verify_maps_a_large_file_instead_of_reading_it(mapped: Path) -> None:
    before = _bytes_read()
    report = ifs.verify(mapped)
    read = _bytes_read() - before
    assert report.ok and report.bytes_checked == 5 * PIECE + 777
    assert read < 64 * 1024  # the manifest and the look past the end: none of the file's bytes


@pytest.mark.parametrize("when", ["between-pieces", "after-the-last"])
def test_a_mapped_read_of_a_file_rewritten_meanwhile_is_a_file_changed_error(mapped: Path, when: str) -> None:
    """Rewritten in place, the modification time put back (as ``cp -p`` does): the change time tells,
    before the next piece or after the last."""
    path = mapped / "big.bin"

    def rewrite() -> None:
        stat = path.stat()
        with open(path, "r+b") as f:
            f.seek(4 * PIECE)
            f.write(b"\1" * 100)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    after = PIECE if when == "between-pieces" else path.stat().st_size
    with pytest.raises(FileChangedError, match=r"big\.bin changed while it was read"):
        ifs.verify(mapped, max_workers=1, callback=_After(after, rewrite))


def test_a_mapped_read_finds_a_damaged_byte(mapped: Path) -> None:
    data = bytearray((mapped / "big.bin").read_bytes())
    data[3 * PIECE + 5] ^= 1
    (mapped / "big.bin").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"big\.bin: mismatch"):
        ifs.verify(mapped)
