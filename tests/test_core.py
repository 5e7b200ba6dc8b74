"""The contract of seal/verify/read_manifest, run on every backend (local, memory, S3, GCS)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError

FILES = {
    ".metadata": b"metadata bytes",
    "__0_0.distcp": os.urandom(300_000),
    "__1_0.distcp": os.urandom(200_001),
    "sub/dir/x.bin": b"nested",
    "empty": b"",
}


@pytest.fixture
def ckpt(backend):
    for name, data in FILES.items():
        backend.write(name, data)
    return backend


def test_seal_writes_canonical_manifest_of_every_file(ckpt):
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    raw = ckpt.read(MANIFEST_FILENAME)
    expected = {
        "algorithm": "sha256",
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(FILES.items())},
        "granularity": "file",
        "sizes": {name: len(data) for name, data in sorted(FILES.items())},
        "version": 1,
    }
    assert raw == (json.dumps(expected, indent=2, sort_keys=True) + "\n").encode()
    assert manifest == ifs.Manifest.from_json(raw)
    assert list(manifest.files) == sorted(FILES)
    # Sealing again (the manifest now present) gives the same bytes: it never lists itself.
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, overwrite=True)
    assert ckpt.read(MANIFEST_FILENAME) == raw


def test_seal_refuses_a_sealed_root_unless_overwrite(ckpt):
    """seal -> damage -> seal must not launder the damage into a "good" manifest."""

    class Recorder(Callback):
        pass

    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    sealed = ckpt.read(MANIFEST_FILENAME)
    ckpt.corrupt("__0_0.distcp", 7)
    recorder = Recorder()
    with pytest.raises(FileExistsError, match=r"already sealed.*pass overwrite=True / --force") as err:
        ifs.seal(ckpt.url, storage_options=ckpt.storage_options, callback=recorder)
    assert not isinstance(err.value, ManifestNotFoundError)
    assert (recorder.size, recorder.value) == (None, 0)  # refused before any content was read
    assert ckpt.read(MANIFEST_FILENAME) == sealed
    with pytest.raises(IntegrityError, match="__0_0.distcp: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, overwrite=True)
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok


def test_verify_passes_on_intact_checkpoint(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.problems == ()
    assert report.files_checked == len(FILES)
    assert report.bytes_checked == sum(map(len, FILES.values()))
    assert ifs.read_manifest(ckpt.url, storage_options=ckpt.storage_options).files.keys() == FILES.keys()


def test_fs_argument_takes_a_path_inside_that_filesystem(ckpt):
    ifs.seal(ckpt.root, fs=ckpt.fs)
    assert ifs.verify(ckpt.root, fs=ckpt.fs).ok


def test_every_problem_is_collected_before_raising(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.corrupt("__0_0.distcp", 12345)
    ckpt.corrupt("sub/dir/x.bin", -1)
    ckpt.remove(".metadata")
    ckpt.truncate("__1_0.distcp", 1000)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    kinds = {p.path: p.kind for p in err.value.report.problems}
    assert kinds == {
        ".metadata": "missing",
        "__0_0.distcp": "mismatch",
        "__1_0.distcp": "size",
        "sub/dir/x.bin": "mismatch",
    }
    for name in kinds:
        assert name in str(err.value)
    bad = next(p for p in err.value.report.problems if p.path == "__0_0.distcp")
    assert bad.expected == hashlib.sha256(FILES["__0_0.distcp"]).hexdigest()
    assert bad.actual == hashlib.sha256(ckpt.read("__0_0.distcp")).hexdigest()
    size = next(p for p in err.value.report.problems if p.path == "__1_0.distcp")
    assert (size.expected, size.actual) == (200_001, 1000)
    assert ifs.CheckpointingException is IntegrityError


def test_quick_reads_no_content_but_catches_truncation(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.corrupt("__0_0.distcp", 7)
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options, quick=True)
    assert report.ok and report.bytes_checked == 0  # a flipped bit needs a full verify
    ckpt.truncate("__0_0.distcp", 10)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options, quick=True)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("__0_0.distcp", "size")]


def test_extra_files_are_allowed_unless_strict(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    ckpt.write("README.md", b"notes")
    report = ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert report.ok and report.extra == ("README.md",)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options, strict=True)
    assert [(p.path, p.kind) for p in err.value.report.problems] == [("README.md", "extra")]


def test_missing_manifest_is_its_own_error(ckpt):
    with pytest.raises(ManifestNotFoundError, match="never sealed"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    assert issubclass(ManifestNotFoundError, FileNotFoundError)


def test_seed_manifest_without_sizes_is_accepted(ckpt):
    seed = {
        "version": 1,
        "granularity": "file",
        "algorithm": "sha256",
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()},
    }
    ckpt.write(MANIFEST_FILENAME, json.dumps(seed).encode())
    assert ifs.read_manifest(ckpt.url, storage_options=ckpt.storage_options).sizes is None
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok
    ckpt.truncate("__0_0.distcp", 100)
    with pytest.raises(IntegrityError, match="__0_0.distcp: mismatch"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


def test_chunk_granularity_names_the_bad_byte_range(ckpt):
    chunk = 64 * 1024
    manifest = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, granularity="chunk", chunk_size=chunk)
    assert manifest.granularity == "chunk" and manifest.chunk_size == chunk
    data = FILES["__0_0.distcp"]
    expected_chunks = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    assert list(manifest.chunks["__0_0.distcp"]) == expected_chunks
    # The file digest is the hash of the chunk digests' raw bytes, in order (documented in README).
    combined = hashlib.sha256(b"".join(bytes.fromhex(d) for d in expected_chunks)).hexdigest()
    assert manifest.files["__0_0.distcp"] == combined
    assert manifest.chunks["empty"] == (hashlib.sha256(b"").hexdigest(),)
    assert ifs.verify(ckpt.url, storage_options=ckpt.storage_options).ok

    ckpt.corrupt("__0_0.distcp", 3 * chunk + 5)
    with pytest.raises(IntegrityError) as err:
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)
    (problem,) = err.value.report.problems
    assert problem.byte_ranges == ((3 * chunk, 4 * chunk),)
    assert f"bytes {3 * chunk}-{4 * chunk - 1}" in str(err.value)


def test_callback_sees_every_byte(ckpt):
    class Recorder(Callback):
        pass

    total = sum(map(len, FILES.values()))
    seal_cb = Recorder()
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options, callback=seal_cb)
    assert (seal_cb.size, seal_cb.value) == (total, total)
    verify_cb = Recorder()
    ifs.verify(ckpt.url, storage_options=ckpt.storage_options, callback=verify_cb, max_workers=3)
    assert (verify_cb.size, verify_cb.value) == (total, total)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_worker_count_does_not_change_the_manifest(ckpt, workers):
    reference = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, max_workers=1).to_json()
    again = ifs.seal(ckpt.url, storage_options=ckpt.storage_options, max_workers=workers, overwrite=True)
    assert again.to_json() == reference


def test_manifest_bytes_are_identical_across_backends(ckpt, tmp_path):
    local = tmp_path / "reference"
    for name, data in FILES.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    ifs.seal(local)
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    assert ckpt.read(MANIFEST_FILENAME) == (local / MANIFEST_FILENAME).read_bytes()


def test_unsupported_algorithm_in_manifest_is_not_implemented(ckpt):
    ifs.seal(ckpt.url, storage_options=ckpt.storage_options)
    doc = json.loads(ckpt.read(MANIFEST_FILENAME))
    doc["algorithm"] = "md5"
    ckpt.write(MANIFEST_FILENAME, json.dumps(doc).encode())
    with pytest.raises(NotImplementedError, match="md5"):
        ifs.verify(ckpt.url, storage_options=ckpt.storage_options)


def test_seal_of_a_missing_directory_is_file_not_found(backend):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        ifs.seal(backend.url + "/nothing-here", storage_options=backend.storage_options)
