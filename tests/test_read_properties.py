"""Verified reads against the file's own bytes: random sequences of seeks and reads through
``integrity_fs.open``, on the local disk and the moto S3 server, in every granularity and unit
size, and through the streams ``dcp.load`` reads (``VerifyingFsspecReader``).

The model is the file's bytes: whatever the file object returns must be exactly the bytes at its
position, whatever was read before (the end before the start, far ahead then back, the same unit
again, one object shared by two threads). Hypothesis draws the sequences from a fixed seed
(``derandomize``), so a run is repeatable and bounded.
"""

from __future__ import annotations

import io
import os
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import _make_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import integrity_fs as ifs

#: Per backend: the local disk answers in microseconds, moto in milliseconds per ranged read.
EXAMPLES = {"local": 60, "s3": 15}
#: Files of each shape: (name, size, granularity, chunk size).
FILES = [
    ("c4k.bin", 10 * 4096 + 123, "chunk", 4096),  # eleven chunks, the last one short
    ("c4k_even.bin", 8 * 4096, "chunk", 4096),  # chunks that end where the file ends
    ("c1k.bin", 3 * 1000 + 1, "chunk", 1000),  # a last chunk of one byte
    ("c_one.bin", 700, "chunk", 4096),  # one chunk, shorter than the chunk size
    ("c_empty.bin", 0, "chunk", 4096),
    ("f_small.bin", 5000, "file", None),  # one unit, held whole
]
SETTINGS: dict[str, Any] = {
    "derandomize": True,
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "database": None,
}


def _data(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


@pytest.fixture(scope="module", params=["local", "s3"])
def sealed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """The backend's name, storage options, and each file's checkpoint URL (one per hashing)."""
    maker = _make_backend(request.param, request, tmp_path_factory.mktemp(request.param))
    backend = next(maker)
    urls: dict[str, str] = {}
    for name, size, granularity, chunk in FILES:
        folder = f"{granularity}_{chunk}"
        backend.write(f"{folder}/{name}", _data(name, size))
        urls[name] = f"{backend.url}/{folder}"
    for granularity, chunk in {(f[2], f[3]) for f in FILES}:
        ifs.seal(
            f"{backend.url}/{granularity}_{chunk}",
            storage_options=backend.storage_options,
            granularity=granularity,
            chunk_size=chunk,
        )
    yield request.param, backend.storage_options, urls
    for _ in maker:
        pass


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
    )
    return st.lists(step, min_size=1, max_size=25)


def _run(f: io.RawIOBase, data: bytes, steps: list[Step]) -> None:
    """Apply ``steps`` to ``f`` and to the model (a position in ``data``); every answer must agree."""
    position = 0
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
            buffer = bytearray(b"\xaa" * step[1])
            got = f.readinto(buffer)
            want = data[position : position + step[1]]
            assert got == len(want) and bytes(buffer[:got]) == want, f"readinto({step[1]}) at {position}"
            position += got
        else:
            assert f.readall() == data[position:], f"readall() at {position}"
            position = max(position, len(data))
        assert f.tell() == position


@pytest.mark.parametrize("file", [f[0] for f in FILES])
def test_random_seeks_and_reads_return_the_files_bytes(
    sealed: tuple[str, dict[str, Any], dict[str, str]], file: str
) -> None:
    where, options, urls = sealed
    size = next(f[1] for f in FILES if f[0] == file)
    data = _data(file, size)

    @settings(max_examples=EXAMPLES[where], **SETTINGS)
    @given(steps=_steps(size))
    def check(steps: list[Step]) -> None:
        with ifs.open(urls[file], file, storage_options=options) as f:
            _run(f, data, steps)

    check()


def test_two_threads_sharing_one_file_read_its_bytes(sealed: tuple[str, dict[str, Any], dict[str, str]]) -> None:
    """One file object, two threads seeking and reading at once: each read returns the bytes at the
    position it asked for (the lock serialises seek+read pairs, as for io.BufferedReader)."""
    _, options, urls = sealed
    name, size = "c4k.bin", 10 * 4096 + 123
    data = _data(name, size)
    errors: list[BaseException] = []
    with ifs.open(urls[name], name, storage_options=options) as f:
        lock = threading.Lock()

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    at, n = rng.randrange(size), rng.randrange(1, 9000)
                    with lock:
                        f.seek(at)
                        got = f.read(n)
                    assert got == data[at : at + n]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def test_random_seeks_and_reads_of_the_streams_dcp_loads(sealed: tuple[str, dict[str, Any], dict[str, str]]) -> None:
    """The streams ``VerifyingFsspecReader`` hands DCP, for each file of a sealed checkpoint."""
    pytest.importorskip("torch")
    from integrity_fs.dcp import VerifyingFsspecReader

    where, options, urls = sealed
    chunked = [f for f in FILES if f[2] == "chunk"]
    readers = {urls[f[0]]: VerifyingFsspecReader(urls[f[0]], storage_options=options) for f in chunked}

    @settings(max_examples=EXAMPLES[where], **SETTINGS)
    @given(file=st.sampled_from(chunked), data=st.data())
    def check(file: tuple[str, int, str, int | None], data: st.DataObject) -> None:
        name, size, _granularity, _chunk = file
        steps = data.draw(_steps(size))
        reader = readers[urls[name]]
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, name), "rb") as stream:
            _run(stream, _data(name, size), steps)

    check()


def test_a_large_file_of_file_granularity_is_served_from_a_verified_spool(tmp_path: Any) -> None:
    """A file of file granularity over 64 MiB is verified whole before its first byte is served."""
    data = random.Random(7).randbytes(64 * 1024 * 1024 + 4097)
    (tmp_path / "big.bin").write_bytes(data)
    ifs.seal(tmp_path)
    with ifs.open(tmp_path, "big.bin") as f:
        f.seek(len(data) - 5000)
        assert f.read(6000) == data[-5000:]
        f.seek(3)
        assert f.read(10) == data[3:13]
    flipped = bytearray(data)
    flipped[-1] ^= 1
    (tmp_path / "big.bin").write_bytes(flipped)
    with ifs.open(tmp_path, "big.bin") as f, pytest.raises(ifs.IntegrityError):
        f.read(1)  # the damage is at the very end, and still no byte is served


@settings(max_examples=40, **SETTINGS)
@given(
    size=st.integers(0, 70_000),
    chunk=st.sampled_from([None, 4096, 10_000]),
    algorithm=st.sampled_from(["blake3", "crc64nvme", "crc32c"]),
)
def test_every_algorithm_seals_the_digests_of_the_bytes(
    tmp_path_factory: pytest.TempPathFactory, size: int, chunk: int | None, algorithm: str
) -> None:
    """Sealed digests are those of the bytes, for every unit at every offset, and a verify passes."""
    import awscrt.checksums
    from blake3 import blake3

    def digest(data: bytes) -> str:
        if algorithm == "blake3":
            return str(blake3(data).hexdigest())
        width = 8 if algorithm == "crc64nvme" else 4
        return int(getattr(awscrt.checksums, algorithm)(data)).to_bytes(width, "big").hex()

    root = tmp_path_factory.mktemp("algorithms")
    data = _data(f"m{size}", size)
    (root / "w.bin").write_bytes(data)
    manifest = ifs.seal(root, algorithm=algorithm, granularity="file" if chunk is None else "chunk", chunk_size=chunk)
    assert ifs.verify(root).ok
    if chunk is None or algorithm != "blake3":
        assert manifest.files["w.bin"] == digest(data)  # a CRC file digest is the whole file's CRC, chunked or not
    if chunk is not None:
        assert manifest.chunks is not None
        assert list(manifest.chunks["w.bin"]) == [digest(data[i : i + chunk]) for i in range(0, max(1, size), chunk)]
