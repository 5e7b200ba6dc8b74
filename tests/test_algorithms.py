"""Hash algorithms: BLAKE3 through the same dispatch as SHA-256, on every backend; SHA-256 the default."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

blake3 = pytest.importorskip("blake3").blake3

import integrity_fs as ifs  # noqa: E402
from integrity_fs import MANIFEST_FILENAME, IntegrityError, Manifest  # noqa: E402
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
