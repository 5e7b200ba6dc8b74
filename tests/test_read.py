"""Hash what you load: integrity_fs.open, reads pinned to one version of each file, and caches.

Every test here goes through the public API on the backend where the behaviour lives: the local
disk, the moto S3 server, the GCS emulator (its generations), fsspec's caching layers.
"""

from __future__ import annotations

import errno
import io
import os
import random
import threading
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pytest
from conftest import Backend
from fsspec.callbacks import Callback

import integrity_fs as ifs
from integrity_fs import FileChangedError, IntegrityError, ManifestNotFoundError

CHUNK = 64 * 1024
DATA = random.Random(19).randbytes(5 * CHUNK + 1234)  # six chunks, the last one short
#: A file-granularity file larger than this is verified into a spool first (64 MiB, the default chunk size).
HELD = 64 * 1024 * 1024


def _large() -> bytes:
    """A file too large to hold as one unit: verified into a spool, then served from there."""
    data = bytearray(HELD + 5 * CHUNK + 1234)
    data[: len(DATA)] = DATA
    data[-len(DATA) :] = DATA
    return bytes(data)


def _sealed(backend: Backend, granularity: str = "chunk", files: dict[str, bytes] | None = None) -> None:
    for name, data in (files or {"w.bin": DATA, "small.txt": b"hello"}).items():
        backend.write(name, data)
    chunk_size = CHUNK if granularity == "chunk" else None
    ifs.seal(backend.url, storage_options=backend.storage_options, granularity=granularity, chunk_size=chunk_size)


def _open(backend: Backend, name: str = "w.bin", **kwargs: Any) -> BinaryIO:
    return ifs.open(backend.url, name, storage_options=backend.storage_options, **kwargs)


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_open_returns_the_sealed_bytes_on_every_backend(backend: Backend, granularity: str) -> None:
    _sealed(backend, granularity)
    with _open(backend) as f:
        assert f.readable() and f.seekable()
        assert f.read(10) == DATA[:10] and f.tell() == 10
        f.seek(CHUNK * 3 + 5)
        buffer = bytearray(CHUNK)
        assert f.readinto(buffer) == CHUNK and bytes(buffer) == DATA[CHUNK * 3 + 5 : CHUNK * 4 + 5]
        f.seek(-100, os.SEEK_END)
        assert f.read() == DATA[-100:]
        f.seek(0)
        assert f.read() == DATA
    with _open(backend) as f:
        assert f.read() == DATA
        assert f.bytes_verified == len(DATA)  # read in order: each unit hashed once
    with _open(backend, "small.txt") as f:
        assert f.read() == b"hello"
    assert f.closed


def test_torch_load_reads_a_checkpoint_file_through_open(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 7}
    torch.save(state, tmp_path / "model.pt")
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)
    with ifs.open(tmp_path, "model.pt") as f:
        loaded = torch.load(f, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_a_damaged_unit_raises_before_any_of_its_bytes_is_returned(backend: Backend, granularity: str) -> None:
    _sealed(backend, granularity)
    backend.corrupt("w.bin", CHUNK * 2 + 7)  # chunk 2
    got = bytearray()
    with _open(backend) as f, pytest.raises(IntegrityError) as err:
        while block := f.read(1000):
            got += block
    if granularity == "chunk":
        # What came back verified: chunks 0 and 1 (up to the read that reached into chunk 2), nothing of 2.
        assert bytes(got) == DATA[: len(got)] and CHUNK * 2 - 1000 < len(got) <= CHUNK * 2
        (problem,) = err.value.report.problems
        assert problem.path == "w.bin" and problem.byte_ranges == ((CHUNK * 2, CHUNK * 3),)
    else:
        assert got == b""  # one unit: nothing comes back
        assert [p.kind for p in err.value.report.problems] == ["mismatch"]


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_a_whole_read_of_a_damaged_file_returns_nothing(backend: Backend, granularity: str) -> None:
    """read() of the whole file hashes its units where they land, in the object it returns: a
    damaged unit anywhere (the last one here) means no object is returned at all."""
    _sealed(backend, granularity)
    backend.corrupt("w.bin", len(DATA) - 3)
    with _open(backend) as f:
        with pytest.raises(IntegrityError) as err:
            f.read()
        (problem,) = err.value.report.problems
        assert problem.path == "w.bin" and problem.kind == "mismatch"
        if granularity == "chunk":
            assert problem.byte_ranges == ((CHUNK * 5, len(DATA)),)
            f.seek(0)
            assert f.read(CHUNK) == DATA[:CHUNK]  # the chunks that match are still served


def test_open_refuses_what_is_not_sealed_as_it_is(backend: Backend) -> None:
    _sealed(backend)
    with pytest.raises(FileNotFoundError, match="not in the manifest") as missing:
        _open(backend, "other.bin")
    assert not isinstance(missing.value, ManifestNotFoundError)
    backend.truncate("small.txt", 3)
    with pytest.raises(IntegrityError, match=r"small\.txt: size \(expected 5 bytes, found 3\)"):
        _open(backend, "small.txt")
    backend.remove("small.txt")
    with pytest.raises(IntegrityError, match=r"small\.txt: missing"):
        _open(backend, "small.txt")
    backend.remove(ifs.MANIFEST_FILENAME)
    with pytest.raises(ManifestNotFoundError):
        _open(backend)


def test_open_checks_the_signature_first(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "w.bin").write_bytes(DATA)
    ifs.seal(tmp_path, private_key=key)
    with ifs.open(tmp_path, "w.bin", public_key=key.public_key()) as f:
        assert f.read() == DATA
    with pytest.raises(ifs.SignatureError, match="signature"):
        ifs.open(tmp_path, "w.bin", public_key=other.public_key())
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "w.bin").write_bytes(DATA[::-1])
    ifs.seal(tmp_path, overwrite=True)  # the attack: new content, new manifest, no key
    with pytest.raises(ifs.SignatureError):
        ifs.open(tmp_path, "w.bin", public_key=pem)


def test_a_large_file_of_file_granularity_is_read_once_and_served_as_it_verified(tmp_path: Path) -> None:
    """Too large to hold: one read, hashed and spooled; what is served comes from the spool. A
    rewrite after that read (mtime put back) changes nothing that is served; a damaged file serves
    nothing at all."""
    data = _large()
    (tmp_path / "w.bin").write_bytes(data)
    ifs.seal(tmp_path, algorithm="crc32c")  # the spool is the same for every algorithm; a CRC is quick
    with ifs.open(tmp_path, "w.bin") as f:
        assert f.read(100) == data[:100] and f.bytes_verified == len(data)
        stat = os.stat(tmp_path / "w.bin")
        with open(tmp_path / "w.bin", "r+b") as raw:
            raw.seek(HELD)
            raw.write(b"\1" * 10)
        os.utime(tmp_path / "w.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # `touch -r`: mtime as it was
        f.seek(HELD - 5)
        assert f.read(20) == data[HELD - 5 : HELD + 15]
        f.seek(0)
        assert f.read() == data and f.bytes_verified == len(data)  # the file was read once
    with ifs.open(tmp_path, "w.bin") as f, pytest.raises(IntegrityError, match="mismatch"):
        f.read(1)  # the whole file verifies before any byte of it is returned


def test_a_writers_shared_mapping_cannot_change_what_a_large_file_serves(tmp_path: Path) -> None:
    """A writer's MAP_SHARED mapping whose page is already dirty changes bytes without moving
    mtime or ctime: no identity check can see it. The file is read once, so it does not matter."""
    import mmap

    data = _large()
    (tmp_path / "w.bin").write_bytes(data)
    ifs.seal(tmp_path, algorithm="crc32c")
    with open(tmp_path / "w.bin", "r+b") as raw, mmap.mmap(raw.fileno(), 0) as mapped:
        offset = HELD
        mapped[offset] = data[offset]  # the writer's first store: the page is now writable and dirty, bytes as sealed
        with ifs.open(tmp_path, "w.bin") as f:
            assert f.read(100) == data[:100]
            before = os.stat(tmp_path / "w.bin")
            mapped[offset + 1] = data[offset + 1] ^ 0xFF  # no fault, no new mtime or ctime
            after = os.stat(tmp_path / "w.bin")
            assert (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)
            assert f.read() == data[100:]  # the bytes that verified, not the writer's


def test_a_large_file_read_through_a_cache_is_never_read_twice(s3_backend: Backend, tmp_path: Path) -> None:
    """Through ``filecache::`` a second read would fetch again whatever the bucket holds then: a
    replaced object must never be served after the sealed one verified."""
    data = _large()
    s3_backend.write("w.bin", data)
    ifs.seal(s3_backend.url, storage_options=s3_backend.storage_options, algorithm="crc32c")
    options = {"s3": s3_backend.storage_options, "filecache": {"cache_storage": str(tmp_path / "cache")}}
    url = f"filecache::{s3_backend.url}"
    replaced = data[:HELD] + bytes(len(data) - HELD)  # same size
    with ifs.open(url, "w.bin", storage_options=options) as f:
        assert f.read(100) == data[:100]
        _replace_by_another_client(s3_backend, "w.bin", replaced)()
        for cached in (tmp_path / "cache").iterdir():  # the cache forgets it: a read now fetches the new object
            cached.unlink()
        f.seek(HELD)
        assert f.read() == data[HELD:]


#: Units of these tests: large enough that copying one out takes as long as reading the next one ahead.
BIG_CHUNK = 256 * 1024


def _look_at_the_end(f: BinaryIO) -> None:
    """What ``torch.load`` and ``zipfile`` do first: read the end of the file, in two reads."""
    f.seek(-100, os.SEEK_END)
    f.read(50)
    f.read(50)
    f.seek(0)


def test_the_end_then_the_start_returns_each_units_own_bytes(backend: Backend) -> None:
    """Look at the end, then read from the start in pieces: each piece must be the file's bytes
    at its place, run after run, and each unit is read once."""
    data = random.Random(3).randbytes(10 * BIG_CHUNK)
    _sealed_chunks(backend, data)
    for piece in (BIG_CHUNK // 3, BIG_CHUNK, 3 * BIG_CHUNK):
        for _ in range(4):
            with _open(backend) as f:
                _look_at_the_end(f)
                assert b"".join(iter(lambda f=f, piece=piece: f.read(piece), b"")) == data
                assert f.bytes_verified == len(data)  # and each unit was read once, the last one first


def test_a_damaged_unit_is_never_served_after_a_look_at_the_end(backend: Backend) -> None:
    data = random.Random(4).randbytes(10 * BIG_CHUNK)
    _sealed_chunks(backend, data)
    backend.corrupt("w.bin", BIG_CHUNK * 6 + 5)
    for _ in range(6):
        got = bytearray()
        with _open(backend) as f, pytest.raises(IntegrityError, match=r"w\.bin: mismatch in bytes"):
            _look_at_the_end(f)
            while block := f.read(BIG_CHUNK):
                got += block
        assert bytes(got) == data[: BIG_CHUNK * 6]  # every chunk before the damaged one, nothing of it


def test_a_damaged_unit_is_never_served_after_a_read_far_ahead_and_a_seek_back(backend: Backend) -> None:
    data = random.Random(4).randbytes(10 * BIG_CHUNK)
    _sealed_chunks(backend, data)
    backend.corrupt("w.bin", BIG_CHUNK * 2 + 5)
    for _ in range(3):
        with _open(backend) as f:
            f.seek(BIG_CHUNK * 6)
            assert f.read(BIG_CHUNK) == data[BIG_CHUNK * 6 : BIG_CHUNK * 7]  # chunks 7 and 8 are read ahead
            f.seek(BIG_CHUNK)
            assert f.read(BIG_CHUNK) == data[BIG_CHUNK : BIG_CHUNK * 2]
            with pytest.raises(IntegrityError, match=r"w\.bin: mismatch in bytes 524288-786431"):
                f.read()
            f.seek(BIG_CHUNK * 2)
            with pytest.raises(IntegrityError):
                f.read(10)


def _sealed_chunks(backend: Backend, data: bytes) -> None:
    backend.write("w.bin", data)
    ifs.seal(backend.url, storage_options=backend.storage_options, granularity="chunk", chunk_size=BIG_CHUNK)


def test_zip_members_read_in_random_order_are_the_members(tmp_path: Path) -> None:
    import zipfile

    members = {f"m{i}.bin": random.Random(i).randbytes(random.Random(i).randrange(1, 3 * CHUNK)) for i in range(12)}
    with zipfile.ZipFile(tmp_path / "a.zip", "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)
    order = list(members)
    for seed in range(10):
        random.Random(seed).shuffle(order)
        with ifs.open(tmp_path, "a.zip") as f, zipfile.ZipFile(f) as archive:
            for name in order:
                assert archive.read(name) == members[name]


def test_two_threads_sharing_one_file_each_get_whole_pieces_of_it(tmp_path: Path) -> None:
    """One lock serialises the methods, as ``io.BufferedReader``'s does: each read of one thread
    is a whole piece of the file, and the pieces of both threads are the file, once each."""
    piece = 10_000
    data = random.Random(5).randbytes(piece * 40)
    (tmp_path / "w.bin").write_bytes(data)
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)
    for _ in range(5):
        got: list[list[bytes]] = [[], []]
        with ifs.open(tmp_path, "w.bin") as f:

            def reader(out: list[bytes], f: BinaryIO = f) -> None:
                while block := f.read(piece):
                    out.append(block)

            threads = [threading.Thread(target=reader, args=(out,)) for out in got]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
        pieces = sorted(got[0] + got[1], key=data.index)
        assert b"".join(pieces) == data


@pytest.mark.parametrize("how", ["read", "readall", "spooled"])
def test_close_while_another_thread_waits_on_a_read(s3_backend: Backend, how: str) -> None:
    """``close`` stops the reads under way: the waiting thread gets the bytes or ``ValueError``,
    never other bytes, and nothing is left running; also when the file is verified into a spool
    (file granularity, larger than units are held)."""
    data = _large() if how == "spooled" else random.Random(6).randbytes(40 * CHUNK)
    _sealed(s3_backend, "file" if how == "spooled" else "chunk", files={"w.bin": data})
    for _ in range(5):
        outcome: list[object] = []
        f = _open(s3_backend)

        def read_all(f: BinaryIO, outcome: list[object]) -> None:
            try:
                outcome.append(f.read() if how == "readall" else b"".join(iter(lambda: f.read(CHUNK), b"")))
            except ValueError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=read_all, args=(f, outcome))
        thread.start()
        f.close()
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert outcome and (outcome[0] == data or isinstance(outcome[0], ValueError)), outcome
    assert not [t for t in threading.enumerate() if t.name.startswith("integrity_fs-read")]


def test_a_spool_that_cannot_be_made_is_a_storage_error_not_a_file_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's ``TMPDIR`` removed under it: the spool cannot be made. That is an ``OSError`` that
    names the spool, not ``FileNotFoundError`` (which says the checkpoint's own file is gone and
    lets ``latest_verified``/``dcp.load_latest`` skip every checkpoint as vanished)."""
    import tempfile

    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / "w.bin", "wb") as f:
        f.truncate(HELD + 1)  # sparse: too large to hold
    ifs.seal(tmp_path / "ckpt", algorithm="crc32c")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "removed-tmpdir"))
    with ifs.open(tmp_path / "ckpt", "w.bin") as f, pytest.raises(OSError, match="spool") as raised:
        f.read(1)
    assert type(raised.value) is OSError and raised.value.errno == errno.ENOENT
    assert "TMPDIR" in str(raised.value) and "removed-tmpdir" in str(raised.value)


def test_seek_takes_integers_only(tmp_path: Path) -> None:
    """As ``FileIO.seek``: a float is a ``TypeError`` at the call, not a position that fails later."""
    (tmp_path / "w.bin").write_bytes(DATA)
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)
    with ifs.open(tmp_path, "w.bin") as f:
        f.seek(10)
        for offset, whence in ((1.5, os.SEEK_SET), ("3", os.SEEK_SET), (1, 0.0)):
            with pytest.raises(TypeError):
                f.seek(offset, whence)  # type: ignore[arg-type]
        assert f.tell() == 10 and f.read(5) == DATA[10:15]
        f.seek(np_int(2), os.SEEK_CUR)  # an integer of another type (operator.index) is one
        assert f.tell() == 17


def np_int(value: int) -> Any:
    """An integer that is not an ``int`` but has ``__index__`` (as numpy's and torch's have)."""

    class Index:
        def __index__(self) -> int:
            return value

    return Index()


# --- pinned reads: one version of each file ---------------------------------------------------------


class _AfterFirstUnit(Callback):  # type: ignore[misc]
    """Runs ``action`` once, after the first unit's bytes were read (max_workers=1: units in order)."""

    def __init__(self, action: Any) -> None:
        super().__init__()
        self._action = action
        self._done = False

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        if not self._done and self.value >= CHUNK:
            self._done = True
            self._action()


def _replace_by_another_client(backend: Backend, name: str, data: bytes) -> Any:
    """What another writer does: a new object (a new ETag, a new generation), through its own client."""

    def replace() -> None:
        other = fsspec.filesystem(backend.fs.protocol[0], skip_instance_cache=True, **backend.storage_options)
        other.pipe_file(backend.path(name), data)

    return replace


@pytest.mark.parametrize("verb", ["seal", "verify"])
def test_an_object_replaced_between_two_ranged_reads_is_never_judged(
    request: pytest.FixtureRequest, verb: str, store: str
) -> None:
    """S3: every ranged GET carries IfMatch with the listed ETag (moto answers 412 once replaced);
    GCS: ifGenerationMatch with the listed generation. A seal writes no manifest; a verify says
    neither OK nor damaged: FileChangedError, naming the file."""
    backend: Backend = request.getfixturevalue(f"{store}_backend")
    backend.write("w.bin", DATA)
    if verb == "verify":
        ifs.seal(backend.url, storage_options=backend.storage_options, granularity="chunk", chunk_size=CHUNK)
    replaced = bytearray(DATA)
    replaced[CHUNK * 3] ^= 1  # the same size; only a later chunk differs
    hook = _AfterFirstUnit(_replace_by_another_client(backend, "w.bin", bytes(replaced)))
    call = ifs.seal if verb == "seal" else ifs.verify
    kwargs: dict[str, Any] = {"granularity": "chunk", "chunk_size": CHUNK} if verb == "seal" else {}
    with pytest.raises(FileChangedError, match=r"w\.bin changed while it was read") as err:
        call(backend.url, storage_options=backend.storage_options, max_workers=1, callback=hook, **kwargs)
    assert err.value.names and err.value.names[0].endswith("w.bin")
    if verb == "seal":
        assert ifs.MANIFEST_FILENAME not in backend.listdir()
    else:  # once nothing writes, the new content is judged as it is: damaged
        with pytest.raises(IntegrityError, match=r"w\.bin: mismatch in bytes"):
            ifs.verify(backend.url, storage_options=backend.storage_options)


@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_an_unsealed_upload_of_a_file_rewritten_while_it_streams_is_not_sealed(
    tmp_path: Path, s3_backend: Backend
) -> None:
    """A same-size rewrite with the mtime put back: the local identity (ctime) still tells."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(DATA)

    def rewrite() -> None:
        stat = os.stat(src / "w.bin")
        with open(src / "w.bin", "r+b") as raw:
            raw.seek(CHUNK * 4)
            raw.write(b"\1" * 100)
        os.utime(src / "w.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))

    with pytest.raises(FileChangedError, match=r"w\.bin"):
        ifs.upload(
            src,
            s3_backend.url,
            storage_options=s3_backend.storage_options,
            max_workers=1,
            callback=_AfterFirstUnit(rewrite),
            granularity="chunk",
            chunk_size=CHUNK,
        )
    assert ifs.MANIFEST_FILENAME not in s3_backend.listdir()


def test_a_local_rewrite_with_the_mtime_put_back_is_a_file_changed_error(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(DATA)
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)

    def rewrite() -> None:
        stat = os.stat(tmp_path / "w.bin")
        with open(tmp_path / "w.bin", "r+b") as raw:
            raw.seek(CHUNK * 4)
            raw.write(b"\1" * 100)
        os.utime(tmp_path / "w.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))

    with pytest.raises(FileChangedError):
        ifs.verify(tmp_path, max_workers=1, callback=_AfterFirstUnit(rewrite))


def test_the_gcs_fixture_refuses_a_read_pinned_to_a_replaced_generation(gcs_backend: Backend) -> None:
    """The emulator answers ifGenerationMatch as GCS does (the fixture adds it): the pinned reads
    above are tested against a 412, not against an emulator that ignores the pin."""
    gcs_backend.write("w.bin", b"one")
    generation = gcs_backend.fs.info(gcs_backend.path("w.bin"))["generation"]
    url = gcs_backend.fs.url(gcs_backend.path("w.bin"))
    _headers, data = gcs_backend.fs.call("GET", url, ifGenerationMatch=generation)
    assert data == b"one"
    gcs_backend.write("w.bin", b"two")
    with pytest.raises(Exception) as raised:  # 412 Precondition Failed, as each gcsfs names it
        gcs_backend.fs.call("GET", url, ifGenerationMatch=generation)
    assert isinstance(raised.value, FileExistsError) or getattr(raised.value, "code", None) == 412


# --- caches ------------------------------------------------------------------------------------------


def _rot(backend: Backend) -> None:
    """The object in the bucket rots after a reader cached it: a flipped bit in a later chunk."""
    data = bytearray(backend.read("w.bin"))
    data[CHUNK * 3] ^= 1
    other = fsspec.filesystem("s3", skip_instance_cache=True, **backend.storage_options)
    other.pipe_file(backend.path("w.bin"), bytes(data))


@pytest.mark.parametrize("layer", ["simplecache", "filecache", "blockcache"])
def test_verify_through_a_cache_reads_the_store_beneath_it(s3_backend: Backend, tmp_path: Path, layer: str) -> None:
    _sealed(s3_backend)
    url = f"{layer}::{s3_backend.url}"
    options = {"s3": s3_backend.storage_options, layer: {"cache_storage": str(tmp_path / "cache")}}
    with fsspec.open(f"{layer}::s3://{s3_backend.path('w.bin')}", "rb", **options) as f:
        assert f.read() == DATA  # the cache now holds the good bytes
    _rot(s3_backend)
    with pytest.raises(IntegrityError, match=r"w\.bin: mismatch"):
        ifs.verify(url, storage_options=options)
    with pytest.raises(IntegrityError):
        ifs.sign(url, storage_options=options, private_key=_key())
    with pytest.raises(IntegrityError):
        ifs.download(url, tmp_path / "dest", storage_options=options)


def _key() -> Any:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def test_the_cli_verifies_beneath_a_cache_too(s3_backend: Backend, tmp_path: Path) -> None:
    from integrity_fs.cli import main

    _sealed(s3_backend)
    options = {"s3": s3_backend.storage_options, "filecache": {"cache_storage": str(tmp_path / "cache")}}
    url = f"filecache::{s3_backend.url}"
    with fsspec.open(f"filecache::s3://{s3_backend.path('w.bin')}", "rb", **options) as f:
        f.read()
    _rot(s3_backend)
    endpoint = s3_backend.storage_options["client_kwargs"]["endpoint_url"]
    argv = ["verify", url, "-o", f"s3.client_kwargs.endpoint_url={endpoint}", "-o", "s3.key=testing"]
    argv += ["-o", "s3.secret=testing", "-o", f"filecache.cache_storage={tmp_path / 'cache'}", "--no-progress"]
    stdout = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 1
    assert "w.bin: mismatch" in stdout.getvalue()


def test_open_through_a_cache_hashes_the_bytes_as_served(s3_backend: Backend, tmp_path: Path) -> None:
    """A good cache loads (even after the bucket changed, its bytes are the sealed ones); a rotten
    cache fails."""
    _sealed(s3_backend)
    cache = tmp_path / "cache"
    options = {"s3": s3_backend.storage_options, "filecache": {"cache_storage": str(cache)}}
    url = f"filecache::{s3_backend.url}"
    with ifs.open(url, "w.bin", storage_options=options) as f:
        assert f.read() == DATA
    _rot(s3_backend)
    with ifs.open(url, "w.bin", storage_options=options) as f:
        assert f.read() == DATA  # served from the cache, hashed as served: the sealed bytes
    cached = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == len(DATA)]
    assert len(cached) == 1
    data = bytearray(cached[0].read_bytes())
    data[10] ^= 1
    cached[0].write_bytes(bytes(data))
    with ifs.open(url, "w.bin", storage_options=options) as f, pytest.raises(IntegrityError, match="mismatch"):
        f.read()


#: How long the first download into a cache waits for a second one to start beside it.
OVERLAP_WAIT_S = 1.5


@pytest.mark.parametrize("layer", ["filecache", "simplecache"])
def test_a_cache_is_filled_once_by_one_thread(
    s3_backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layer: str
) -> None:
    """fsspec's whole-file caches are not safe to fill from several threads: a thread that opens a
    file not cached yet downloads it in place into the cache file (``filecache`` records it as
    whole before the download even starts), so another thread may open the half-written file, or
    download it again into the same file, truncating it under the first one's reader, which then
    reads a hole of zeros. That is how a good object read through ``filecache::`` looked damaged
    under load ("mismatch in bytes 196608-262143"). So reads through a cache go one at a time.

    The first download here holds until a second one starts beside it: when reads overlap, one
    does (the other threads' reads are already under way, and nothing is cached yet); when they
    are one at a time, none can, and the first goes on after ``OVERLAP_WAIT_S``."""
    _sealed(s3_backend)
    download = s3_backend.fs.get_file  # the store the cache fills from (fsspec's instance cache: the same object)
    started: list[str] = []
    another = threading.Event()
    lock = threading.Lock()

    def held_download(rpath: str, lpath: str, **kwargs: Any) -> Any:
        with lock:
            started.append(lpath)
            first = len(started) == 1
        if first:
            another.wait(OVERLAP_WAIT_S)
        else:
            another.set()
        return download(rpath, lpath, **kwargs)

    monkeypatch.setattr(s3_backend.fs, "get_file", held_download)
    options = {"s3": s3_backend.storage_options, layer: {"cache_storage": str(tmp_path / "cache")}}
    with ifs.open(f"{layer}::{s3_backend.url}", "w.bin", storage_options=options) as f:
        try:
            data = f.read()
        except IntegrityError as exc:  # the false alarm itself, when the overlapping downloads show it
            data = exc
    assert not another.is_set(), f"a second download into the cache started beside the first: {started}"
    assert len(started) == 1 and data == DATA


# --- read-ahead and stops ------------------------------------------------------------------------------


def test_closing_a_file_stops_its_read_ahead(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(DATA * 4)
    ifs.seal(tmp_path, granularity="chunk", chunk_size=CHUNK)
    with ifs.open(tmp_path, "w.bin") as f:
        assert f.read(10) == DATA[:10]
    assert not [t for t in threading.enumerate() if t.name.startswith("integrity_fs-read")]
