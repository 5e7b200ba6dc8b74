"""Verified reads against the file's own bytes: random sequences of seeks and reads, on the local
disk and the moto S3 server, in every granularity and unit size, through ``integrity_fs.open`` and
through the streams ``dcp.load`` reads (``VerifyingFsspecReader``).

The model is the file's bytes: whatever a ``VerifiedFile`` returns must be exactly the bytes at
its position, whatever was read before (the end before the start, far ahead then back, the
same unit again). Hypothesis draws the sequences from a fixed seed (``derandomize``), so a run
is repeatable and bounded; the example counts are per backend.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import Backend, backends
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import integrity_fs as ifs
from integrity_fs import read

store = backends("local", "s3")

#: Per backend: the local disk answers in microseconds, moto in milliseconds per ranged read.
EXAMPLES = {"local": 2100, "s3": 700}

#: Files of each shape, sealed once per backend: (name, size, granularity, chunk size).
FILES = [
    ("c4k.bin", 10 * 4096 + 123, "chunk", 4096),  # eleven chunks, the last one short
    ("c4k_even.bin", 8 * 4096, "chunk", 4096),  # chunks that end where the file ends
    ("c1k.bin", 3 * 1000 + 1, "chunk", 1000),  # a last chunk of one byte
    ("c_one.bin", 700, "chunk", 4096),  # one chunk, shorter than the chunk size
    ("c_empty.bin", 0, "chunk", 4096),
    ("f_small.bin", 5000, "file", None),  # held whole
    ("f_large.bin", 70_000, "file", None),  # over the (lowered) whole-file limit: spooled
]
#: The whole-file limit while these tests run, so that f_large.bin is spooled (the default is 64 MiB).
WHOLE_FILE_LIMIT = 16 * 1024


def _data(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


@dataclass
class Sealed:
    backend: Backend
    roots: dict[tuple[str, int | None], str]  # (granularity, chunk size) -> the checkpoint's URL

    def url(self, name: str) -> str:
        _name, _size, granularity, chunk_size = next(f for f in FILES if f[0] == name)
        return self.roots[(granularity, chunk_size)]


@pytest.fixture(scope="module")
def sealed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sealed]]:
    """One checkpoint per hashing on each backend, each holding the files of that hashing."""
    from conftest import _make_backend

    out: dict[str, Sealed] = {}
    makers = []
    for name in ("local", "s3"):
        maker = _make_backend(name, request, tmp_path_factory.mktemp(name))
        backend = next(maker)
        makers.append(maker)
        roots: dict[tuple[str, int | None], str] = {}
        for file, size, granularity, chunk_size in FILES:
            key = (granularity, chunk_size)
            folder = f"{granularity}_{chunk_size}"
            backend.write(f"{folder}/{file}", _data(file, size))
            roots[key] = f"{backend.url}/{folder}"
        for (granularity, chunk_size), url in roots.items():
            ifs.seal(url, storage_options=backend.storage_options, granularity=granularity, chunk_size=chunk_size)
        out[name] = Sealed(backend, roots)
    yield out
    for maker in makers:
        for _ in maker:
            pass


#: One step: ("seek", offset, whence), ("read", n), ("readinto", n), ("readall",), ("release", offset),
#: ("region", offset, length).
Step = tuple[Any, ...]


def _steps(size: int) -> st.SearchStrategy[list[Step]]:
    where = st.integers(min_value=0, max_value=size + 10)
    seek = st.one_of(
        st.tuples(st.just("seek"), where, st.just(os.SEEK_SET)),
        st.tuples(st.just("seek"), st.integers(-size - 5, size + 5), st.just(os.SEEK_CUR)),
        st.tuples(st.just("seek"), st.integers(-size - 5, 5), st.just(os.SEEK_END)),
    )
    count = st.one_of(st.integers(0, 64), st.integers(0, size + 10), st.sampled_from([-1, 1, 4095, 4096, 4097]))
    step = st.one_of(
        seek,
        st.tuples(st.just("read"), count),
        st.tuples(st.just("readinto"), st.integers(0, size + 10)),
        st.tuples(st.just("readall")),
        st.tuples(st.just("release"), where),
        st.tuples(st.just("region"), where, st.one_of(st.integers(0, 64), st.integers(0, size + 10))),
    )
    return st.lists(step, min_size=1, max_size=25)


def _run(f: io.RawIOBase, data: bytes, steps: list[Step]) -> None:
    """Apply ``steps`` to ``f`` and to the model (a position in ``data``); every answer must agree.
    The regions handed out (views of verified units) are kept to the end and must still hold their
    bytes then, whatever was read, dropped and read ahead meanwhile."""
    position = 0
    regions: list[tuple[memoryview, int]] = []
    for step in steps:
        kind = step[0]
        if kind == "seek":
            _, offset, whence = step
            target = {os.SEEK_SET: offset, os.SEEK_CUR: position + offset, os.SEEK_END: len(data) + offset}[whence]
            if target < 0:
                with pytest.raises(ValueError):
                    f.seek(offset, whence)
                continue
            assert f.seek(offset, whence) == target
            position = target
        elif kind == "read":
            n = step[1]
            want = data[position:] if n < 0 else data[position : position + n]
            assert f.read(n) == want, f"read({n}) at {position}"
            position += len(want)
        elif kind == "readinto":
            n = step[1]
            buffer = bytearray(b"\xaa" * n)
            got = f.readinto(buffer)
            want = data[position : position + n]
            assert got == len(want) and bytes(buffer[:got]) == want, f"readinto({n}) at {position}"
            position += got
        elif kind == "readall":
            assert f.readall() == data[position:], f"readall() at {position}"
            position = max(position, len(data))
        elif kind == "release":
            release = getattr(f, "release_before", None)
            if release is not None and step[1] <= position:  # DCP's promise: nothing before is read again
                release(step[1])
        elif kind == "region":
            _, offset, length = step
            assert isinstance(f, ifs.VerifiedFile)
            if offset + length > len(data):
                with pytest.raises(ValueError):
                    f.region(offset, length)
                continue
            view = f.region(offset, length)
            assert view.readonly and bytes(view) == data[offset : offset + length], f"region({offset}, {length})"
            regions.append((view, offset))
            position = offset + length
        assert f.tell() == position
    for view, offset in regions:
        assert bytes(view) == data[offset : offset + len(view)], (
            f"the region at {offset} changed after it was handed out"
        )


SETTINGS = {
    "derandomize": True,
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "database": None,
}


@pytest.mark.parametrize("file", [f[0] for f in FILES])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_random_seeks_and_reads_return_the_files_bytes(sealed: dict[str, Sealed], where: str, file: str) -> None:
    checkpoint = sealed[where]
    size = next(f[1] for f in FILES if f[0] == file)
    data = _data(file, size)

    with ifs.open(checkpoint.url(file), file, storage_options=checkpoint.backend.storage_options) as opened:
        entry = opened.entry  # each example reads the file afresh, as a new open() would

    @settings(max_examples=EXAMPLES[where] // len(FILES), **SETTINGS)
    @given(steps=_steps(size))
    def check(steps: list[Step]) -> None:
        with ifs.VerifiedFile(entry) as f:
            _run(f, data, steps)

    with mock.patch.object(read, "WHOLE_FILE_LIMIT", WHOLE_FILE_LIMIT):
        check()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_random_seeks_and_reads_of_the_streams_dcp_loads(sealed: dict[str, Sealed], where: str, tmp_path: Path) -> None:
    """The streams ``VerifyingFsspecReader`` hands DCP, each file of a sealed checkpoint."""
    pytest.importorskip("torch")
    from integrity_fs.dcp import VerifyingFsspecReader

    checkpoint = sealed[where]
    options = checkpoint.backend.storage_options

    chunked = [f for f in FILES if f[2] == "chunk"]
    readers = {}
    for name, *_rest in chunked:
        url = checkpoint.url(name)
        if url not in readers:
            readers[url] = VerifyingFsspecReader(url, **options)
            readers[url].use(_checkpoint(url, options))

    @settings(max_examples=EXAMPLES[where] // len(FILES), **SETTINGS)
    @given(file=st.sampled_from(chunked), data=st.data())
    def check(file: tuple[str, int, str, int | None], data: st.DataObject) -> None:
        name, size, _granularity, _chunk = file
        steps = data.draw(_steps(size))
        reader = readers[checkpoint.url(name)]
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, name), "rb") as stream:
            _run(stream, _data(name, size), steps)

    check()


def _checkpoint(url: str, options: dict[str, Any]) -> Any:
    from integrity_fs.dcp.reader import check_listing, load_manifest

    found = load_manifest(url, options, manifest=None, public_key=None, require_manifest=True)
    return check_listing(url, options, found, strict=False)


@settings(max_examples=40, **SETTINGS)
@given(
    size=st.one_of(st.integers(0, 70_000), st.integers(1024 * 1024 + 1, 3 * 1024 * 1024)),
    chunk=st.sampled_from([None, 4096, 10_000, 65_536]),
    piece=st.sampled_from([4096, 8192, 65_536, 1 << 20]),
)
def test_mapped_blake3_reads_hash_the_files_bytes(
    tmp_path_factory: pytest.TempPathFactory, size: int, chunk: int | None, piece: int
) -> None:
    """BLAKE3 reads of local files map them (here from their first byte, in pieces of ``piece``):
    the digests sealed are those of the bytes, for every unit at every offset (a mapping starts at a
    page boundary, a chunk anywhere)."""
    blake3 = pytest.importorskip("blake3").blake3
    from integrity_fs.storage import read as storage_read

    root = tmp_path_factory.mktemp("mapped")
    data = _data(f"m{size}", size)
    (root / "w.bin").write_bytes(data)
    with mock.patch.object(storage_read, "MAPPED_MIN", 1), mock.patch.object(storage_read, "MAPPED_PIECE", piece):
        manifest = ifs.seal(
            root, algorithm="blake3", granularity="file" if chunk is None else "chunk", chunk_size=chunk
        )
        assert ifs.verify(root).ok
    if chunk is None:
        assert manifest.files["w.bin"] == blake3(data).hexdigest()
    else:
        assert manifest.chunks is not None
        units = [data[i : i + chunk] for i in range(0, max(1, size), chunk)]
        assert list(manifest.chunks["w.bin"]) == [blake3(unit).hexdigest() for unit in units]
