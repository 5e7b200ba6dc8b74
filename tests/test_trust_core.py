"""Trust in the manifest and the root (issue 10, items 4, 12, 13, 15), through the public API on
every backend: strict manifest parsing, empty manifests, names a manifest cannot hold, and a root
that is not there or is a file."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, Manifest, ManifestError, ManifestNotFoundError
from integrity_fs.cli import main as cli_main
from integrity_fs.seal import MAX_CHUNKS_PER_FILE

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


# --- item 13 and item 4: every parse failure is a ManifestError; duplicate keys anywhere ------

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


@pytest.mark.parametrize("name", ["size of 5000 digits", "duplicate file name"])
def test_cli_says_manifest_invalid_for_parse_failures(tmp_path: Path, name: str) -> None:
    (tmp_path / "a").write_bytes(b"")
    (tmp_path / MANIFEST_FILENAME).write_text(BAD_MANIFESTS[name])
    assert cli_main(["verify", str(tmp_path)]) == 3


# --- item 4: a manifest that lists no files verifies only a directory with no files ----------


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


def test_seal_of_an_empty_directory_verifies_until_a_file_appears(tmp_path: Path) -> None:
    ifs.seal(tmp_path)
    assert ifs.verify(tmp_path).ok
    (tmp_path / "planted.pt").write_bytes(b"not sealed")
    with pytest.raises(IntegrityError, match="planted.pt"):
        ifs.verify(tmp_path)


def test_extra_files_beside_a_nonempty_manifest_stay_allowed(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    ifs.seal(tmp_path)
    (tmp_path / "b").write_bytes(b"b")
    assert ifs.verify(tmp_path).extra == ("b",)


# --- item 12: names a manifest cannot hold fail seal before any content is read ---------------


class _Counting(Callback):  # type: ignore[misc]  # fsspec is untyped
    def __init__(self) -> None:
        super().__init__()
        self.sized = False

    def set_size(self, size: int) -> None:
        self.sized = True


def _seal_refuses(url: str, storage_options: dict[str, Any], shown: str) -> None:
    callback = _Counting()
    with pytest.raises(ValueError) as err:
        ifs.seal(url, storage_options=storage_options, callback=callback)
    assert not isinstance(err.value, ManifestError)  # the checkpoint is fine, its names are not
    assert shown in str(err.value)
    assert not callback.sized and callback.value == 0  # refused before hashing started


def test_seal_refuses_a_name_that_is_not_utf8_before_reading(tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(os.urandom(1 << 20))
    (tmp_path / os.fsdecode(b"caf\xe9.pt")).write_bytes(b"latin-1 name")
    _seal_refuses(str(tmp_path), {}, r"caf\xe9.pt")
    assert not (tmp_path / MANIFEST_FILENAME).exists()


def test_seal_refuses_a_backslash_in_a_name_before_reading(backend: Any) -> None:
    backend.write("big.bin", os.urandom(1 << 20))
    backend.write("dir\\x.pt", b"backslash")
    _seal_refuses(backend.url, backend.storage_options, "dir\\\\x.pt")
    assert MANIFEST_FILENAME not in backend.listdir()


# --- item 15: a root that is not there, or is a file, is not "never sealed" -----------------

OPERATIONS: dict[str, Callable[..., object]] = {
    "seal": ifs.seal,
    "verify": ifs.verify,
    "verify quick": lambda url, **kw: ifs.verify(url, quick=True, **kw),
    "read_manifest": ifs.read_manifest,
}


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


@pytest.mark.parametrize("operation", ["verify", "read_manifest"])
def test_only_an_existing_root_without_manifest_is_never_sealed(backend: Any, operation: str) -> None:
    backend.write("a", b"a")
    with pytest.raises(ManifestNotFoundError, match="never sealed"):
        OPERATIONS[operation](backend.url, storage_options=backend.storage_options)


def test_cli_verify_of_a_missing_path_is_a_storage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "path"
    assert cli_main(["verify", str(missing)]) == 4
    assert cli_main(["verify", "--quick", str(missing)]) == 4
    assert "seal it first" not in capsys.readouterr().err


def test_a_stale_manifest_json_with_valid_body_still_parses_as_before() -> None:
    """Strict parsing leaves canonical manifests (and seed-era ones, without sizes) alone."""
    seed = {"algorithm": "sha256", "files": {"a": DIGEST}, "granularity": "file", "version": 1}
    assert Manifest.from_json(json.dumps(seed)).sizes is None
    m = Manifest(files={"a": DIGEST}, sizes={"a": 3})
    assert Manifest.from_json(m.to_json()) == m


def test_a_chunk_size_that_would_cut_a_file_into_millions_of_chunks_is_refused_before_any_read(tmp_path):
    """`--chunk-size 64` means 64 bytes: on a large file, millions of digests and work without end.
    seal, upload and the CLI refuse it at once, naming the file, and write nothing."""
    big = tmp_path / "ckpt" / "model.bin"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(MAX_CHUNKS_PER_FILE * 64 + 1)  # sparse: nothing is read before the refusal
    (tmp_path / "ckpt" / "small.bin").write_bytes(b"s")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"chunk_size=64 would cut 'model\.bin' .* 1,000,001 chunks"):
        ifs.seal(big.parent, granularity="chunk", chunk_size=64)
    with pytest.raises(ValueError, match="more than 1,000,000"):
        ifs.upload(big.parent, tmp_path / "copy", granularity="chunk", chunk_size=64)
    assert time.perf_counter() - started < 5
    assert not (big.parent / MANIFEST_FILENAME).exists() and not (tmp_path / "copy").exists()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["seal", str(big.parent), "--granularity", "chunk", "--chunk-size", "64"]) == 2
    assert "choose a larger chunk size" in err.getvalue()
    ifs.seal(big.parent, granularity="chunk", chunk_size=64 * 1024 * 1024)  # the size meant: fine
