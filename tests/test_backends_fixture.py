"""Self-test of the `backend` fixture helpers on every backend."""

import fsspec
import pytest
from conftest import Backend

FILES = {
    "top.bin": b"top",
    "a/one.bin": bytes(range(256)),
    "a/b/c/deep.bin": b"deep" * 1000,
}


def _write_all(backend: Backend) -> None:
    for name, data in FILES.items():
        backend.write(name, data)


def test_root_starts_empty(backend: Backend) -> None:
    assert backend.listdir() == []
    assert not backend.root.endswith("/") and "://" not in backend.root


def test_write_nested_and_list(backend: Backend) -> None:
    _write_all(backend)
    assert backend.listdir() == sorted(FILES)
    for name, data in FILES.items():
        assert backend.read(name) == data
    backend.remove("a/one.bin")
    assert backend.listdir() == ["a/b/c/deep.bin", "top.bin"]


def test_ranged_and_streamed_reads(backend: Backend) -> None:
    _write_all(backend)
    path = backend.path("a/one.bin")
    # Keyword start/end: s3fs's cat_file takes version_id as its second positional argument.
    assert backend.fs.cat_file(path, start=10, end=20) == bytes(range(10, 20))
    with backend.fs.open(path, "rb") as f:
        assert f.read(100) + f.read() == FILES["a/one.bin"]
    sizes = {p: d["size"] for p, d in backend.fs.find(backend.root, detail=True).items()}
    assert sizes == {backend.path(n): len(d) for n, d in FILES.items()}


@pytest.mark.parametrize("offset", [0, 7, -1])
def test_corrupt_flips_exactly_one_byte(backend: Backend, offset: int) -> None:
    original = FILES["a/one.bin"]
    backend.write("a/one.bin", original)
    backend.corrupt("a/one.bin", offset)
    corrupted = backend.read("a/one.bin")
    assert len(corrupted) == len(original)
    diffs = [i for i, (x, y) in enumerate(zip(original, corrupted, strict=True)) if x != y]
    assert diffs == [offset % len(original)]
    assert bin(original[diffs[0]] ^ corrupted[diffs[0]]).count("1") == 1


def test_truncate(backend: Backend) -> None:
    backend.write("x.bin", b"0123456789")
    backend.truncate("x.bin", 4)
    assert backend.read("x.bin") == b"0123"
    assert backend.fs.size(backend.path("x.bin")) == 4
    backend.truncate("x.bin", 0)
    assert backend.read("x.bin") == b""
    assert backend.listdir() == ["x.bin"]


def test_url_reaches_same_store(backend: Backend) -> None:
    _write_all(backend)
    fs, root = fsspec.core.url_to_fs(backend.url, **backend.storage_options)
    assert root == backend.root
    assert fs is backend.fs  # same cached instance, hence same listing cache
    assert sorted(fs.find(root)) == sorted(backend.path(n) for n in FILES)
    assert fs.cat_file(f"{root}/a/b/c/deep.bin") == FILES["a/b/c/deep.bin"]


def test_missing_object_is_file_not_found(backend: Backend) -> None:
    with pytest.raises(FileNotFoundError):
        backend.read("absent.bin")
    with pytest.raises(FileNotFoundError):
        backend.fs.open(backend.path("absent.bin"), "rb")
    with pytest.raises(FileNotFoundError):
        backend.fs.info(backend.path("absent.bin"))


def test_single_backend_fixtures(s3_backend: Backend, gcs_backend: Backend) -> None:
    assert (s3_backend.name, gcs_backend.name) == ("s3", "gcs")
    assert s3_backend.url.startswith("s3://") and gcs_backend.url.startswith("gs://")
    s3_backend.write("f", b"s3")
    gcs_backend.write("f", b"gcs")
    assert (s3_backend.listdir(), gcs_backend.listdir()) == (["f"], ["f"])


@pytest.mark.parametrize("data", [b"ends in CR\r", b"CRLF\r\n", b"\r", b"\n\r\n\r", bytes(range(256))[::-1]])
def test_every_byte_is_stored_as_written(backend: Backend, data: bytes) -> None:
    """Tests compare sizes and digests with the bytes they wrote, often random: the store must
    keep every byte (the GCS emulator's own multipart parser drops a trailing CR; see conftest)."""
    backend.write("x.bin", data)
    assert backend.fs.size(backend.path("x.bin")) == len(data)
    assert backend.read("x.bin") == data
