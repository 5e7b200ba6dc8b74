"""integrity_fs.integrations.safetensors: a sealed directory's safetensors file(s) loaded into a state
dict through integrity_fs.open, each byte read once, nothing returned unless every byte verified.

The files are written by their real producers (``safetensors.torch.save_file`` and transformers'
``save_pretrained`` with shards) and the tensors compared with ``safetensors.torch.load_file``'s, on
every backend (local, memory, S3 on moto, GCS on the emulator).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch
from conftest import BUCKET, Backend
from read_counting import CountingS3Server
from safetensors import SafetensorError, deserialize
from safetensors.torch import load_file, save_file

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, ManifestNotFoundError, SignatureError
from integrity_fs.integrations.safetensors import load_state_dict

#: The file of a directory with one safetensors file, and the index of a sharded one.
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: Small chunks, so that tensors start and end inside chunks and span several.
CHUNK = 4096
GRANULARITIES = {"file": {}, "chunk": {"granularity": "chunk", "chunk_size": CHUNK}}


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of each kind a checkpoint holds: every common dtype, a scalar, an empty one."""
    gen = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(64, 33, generator=gen),
        "h.0.attn.bias": torch.randn(17, generator=gen).to(torch.bfloat16),
        "h.0.mlp.weight": torch.randn(40, 40, generator=gen).to(torch.float16),
        "h.0.mlp.f64": torch.randn(9, generator=gen).to(torch.float64),
        "position_ids": torch.arange(300, dtype=torch.int64).reshape(1, 300),
        "i32": torch.arange(-50, 50, dtype=torch.int32),
        "i16": torch.arange(11, dtype=torch.int16),
        "i8": torch.arange(-7, 7, dtype=torch.int8),
        "u8": torch.arange(200, dtype=torch.uint8),
        "mask": torch.rand(37, generator=gen) > 0.5,
        "f8": torch.randn(31, generator=gen).to(torch.float8_e4m3fn),
        "f8b": torch.randn(31, generator=gen).to(torch.float8_e5m2),
        "scale": torch.tensor(0.125),
        "empty": torch.zeros(0, 4),
    }


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def _upload(local: Path, backend: Backend) -> None:
    for path in sorted(local.iterdir()):
        backend.write(path.name, path.read_bytes())


def _sharded_model(tmp_path: Path) -> Path:
    """A tiny GPT-2 (built from a config) written by ``save_pretrained`` in several shards."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    out = tmp_path / "pretrained"
    model.save_pretrained(out, max_shard_size="40KB")
    assert (out / INDEX_NAME).is_file() and not (out / WEIGHTS_NAME).exists()
    return out


def _shard_tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / shard))
    return out


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_one_file_loads_as_load_file_loads_it_on_every_backend(
    backend: Backend, tmp_path: Path, granularity: str
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    save_file(_tensors(), local / WEIGHTS_NAME, metadata={"format": "pt"})
    (local / "config.json").write_text("{}")
    _upload(local, backend)
    ifs.seal(backend.url, storage_options=backend.storage_options, **GRANULARITIES[granularity])
    got = load_state_dict(backend.url, storage_options=backend.storage_options)
    _same(got, load_file(local / WEIGHTS_NAME))
    # Each tensor holds its own bytes: nothing keeps the whole file in memory beside them.
    assert sum(t.untyped_storage().nbytes() for t in got.values()) < (local / WEIGHTS_NAME).stat().st_size


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_the_shards_of_save_pretrained_load_as_load_file_loads_them_on_every_backend(
    backend: Backend, tmp_path: Path, granularity: str
) -> None:
    local = _sharded_model(tmp_path)
    assert len(set(json.loads((local / INDEX_NAME).read_text())["weight_map"].values())) >= 3
    _upload(local, backend)
    ifs.seal(backend.url, storage_options=backend.storage_options, **GRANULARITIES[granularity])
    _same(load_state_dict(backend.url, storage_options=backend.storage_options), _shard_tensors(local))


def test_the_state_dict_loads_into_the_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    local = _sharded_model(tmp_path)
    ifs.seal(local)
    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(local))
    missing, unexpected = fresh.load_state_dict(load_state_dict(local), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding, not saved
    saved = _shard_tensors(local)
    assert all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in saved.items())


def test_a_fs_instance_works_as_a_url_does(backend: Backend, tmp_path: Path) -> None:
    save_file(_tensors(), tmp_path / WEIGHTS_NAME)
    backend.write(WEIGHTS_NAME, (tmp_path / WEIGHTS_NAME).read_bytes())
    ifs.seal(backend.root, fs=backend.fs, granularity="chunk", chunk_size=CHUNK)
    _same(load_state_dict(backend.root, fs=backend.fs), load_file(tmp_path / WEIGHTS_NAME))


def _damage_offsets(path: Path) -> dict[str, int]:
    """Where to flip a byte: in the header, in the first tensor's bytes, in the last one's."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    spans = sorted(tuple(info["data_offsets"]) for info in header.values() if info["data_offsets"][1])
    return {"header": 8 + length // 2, "first tensor": 8 + length + spans[0][0], "last tensor": len(raw) - 1}


@pytest.mark.parametrize("where", ["header", "first tensor", "last tensor"])
@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_a_flipped_byte_raises_integrity_error_and_returns_nothing(
    backend: Backend, tmp_path: Path, granularity: str, where: str
) -> None:
    save_file(_tensors(), tmp_path / WEIGHTS_NAME)
    backend.write(WEIGHTS_NAME, (tmp_path / WEIGHTS_NAME).read_bytes())
    ifs.seal(backend.url, storage_options=backend.storage_options, **GRANULARITIES[granularity])
    backend.corrupt(WEIGHTS_NAME, _damage_offsets(tmp_path / WEIGHTS_NAME)[where])
    with pytest.raises(IntegrityError) as err:
        load_state_dict(backend.url, storage_options=backend.storage_options)
    [problem] = err.value.report.problems
    assert (problem.path, problem.kind) == (WEIGHTS_NAME, "mismatch")


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_a_flipped_byte_in_the_last_shard_or_the_index_raises(tmp_path: Path, granularity: str) -> None:
    local = _sharded_model(tmp_path)
    last = sorted(set(json.loads((local / INDEX_NAME).read_text())["weight_map"].values()))[-1]
    ifs.seal(local, **GRANULARITIES[granularity])
    for name in (last, INDEX_NAME):
        data = bytearray((local / name).read_bytes())
        data[-2] ^= 1
        (local / name).write_bytes(bytes(data))
        with pytest.raises(IntegrityError) as err:
            load_state_dict(local)
        assert [p.path for p in err.value.report.problems] == [name]
        data[-2] ^= 1
        (local / name).write_bytes(bytes(data))
    assert sorted(load_state_dict(local)) == sorted(_shard_tensors(local))


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_a_signed_directory_loads_with_its_key_and_is_refused_with_another_or_a_rewritten_manifest(
    tmp_path: Path, granularity: str
) -> None:
    """``public_key`` checks ``model.sig`` as ``integrity_fs.open`` does: a shard changed and the
    manifest rewritten to match loads without a key, and never with one."""
    ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    local = _sharded_model(tmp_path)
    ifs.seal(local, private_key=key, **GRANULARITIES[granularity])
    _same(load_state_dict(local, public_key=key.public_key()), _shard_tensors(local))
    with pytest.raises(SignatureError, match="another key"):
        load_state_dict(local, public_key=other.public_key())
    first = sorted(set(json.loads((local / INDEX_NAME).read_text())["weight_map"].values()))[0]
    data = bytearray((local / first).read_bytes())
    data[-2] ^= 1
    (local / first).write_bytes(bytes(data))
    (local / MANIFEST_FILENAME).unlink()
    ifs.seal(local, **GRANULARITIES[granularity])  # rewritten without the key: model.sig is left as it was
    assert sorted(load_state_dict(local)) == sorted(_shard_tensors(local))  # no key: the manifest is believed
    with pytest.raises(SignatureError, match=f"{first}: signed digest differs") as refused:
        load_state_dict(local, public_key=key.public_key())
    assert [p.path for p in refused.value.report.problems] == [first]


def test_a_directory_sealed_by_its_signature_alone_loads_with_the_key_only(tmp_path: Path) -> None:
    """No manifest, only ``model.sig``: with the key, the signed digests are the manifest; without
    one, the directory is not sealed; with a key and no signature, SignatureError."""
    ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
    key = ec.generate_private_key(ec.SECP256R1())
    save_file(_tensors(), tmp_path / WEIGHTS_NAME)
    ifs.seal(tmp_path, private_key=key)
    (tmp_path / MANIFEST_FILENAME).unlink()
    _same(load_state_dict(tmp_path, public_key=key.public_key()), load_file(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ManifestNotFoundError):
        load_state_dict(tmp_path)
    data = bytearray((tmp_path / WEIGHTS_NAME).read_bytes())
    data[-1] ^= 1
    (tmp_path / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=WEIGHTS_NAME):
        load_state_dict(tmp_path, public_key=key.public_key())
    (tmp_path / "model.sig").unlink()
    with pytest.raises(SignatureError):
        load_state_dict(tmp_path, public_key=key.public_key())


def test_a_truncated_or_missing_shard_raises_integrity_error(tmp_path: Path) -> None:
    local = _sharded_model(tmp_path)
    shards = sorted(set(json.loads((local / INDEX_NAME).read_text())["weight_map"].values()))
    ifs.seal(local)
    (local / shards[1]).write_bytes((local / shards[1]).read_bytes()[:-10])
    with pytest.raises(IntegrityError, match="size"):
        load_state_dict(local)
    (local / shards[1]).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        load_state_dict(local)


@pytest.fixture(scope="module")
def counting_s3(s3_endpoint: str) -> Iterator[tuple[CountingS3Server, dict[str, Any]]]:
    """A second front to the session's moto S3 that counts the bytes of content it serves."""
    server = CountingS3Server()
    yield server, {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": server.endpoint}}
    server.stop()


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_each_byte_is_read_once(
    tmp_path: Path, counting_s3: tuple[CountingS3Server, dict[str, Any]], granularity: str
) -> None:
    server, options = counting_s3
    local = _sharded_model(tmp_path)
    url = f"s3://{BUCKET}/safetensors-{uuid.uuid4().hex}"
    manifest = ifs.upload(local, url, storage_options=options, **GRANULARITIES[granularity])
    before = server.served_under(url)
    load_state_dict(url, storage_options=options)
    served = server.served_under(url) - before
    names = [INDEX_NAME, *(p.name for p in local.glob("*.safetensors"))]
    assert served == len(manifest.to_json()) + sum(os.path.getsize(local / name) for name in names)


def _raw_file(header: dict[str, Any], data: bytes, *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _one(dtype: str, shape: list[int], offsets: list[int]) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


TWO = {"a": _one("F32", [2], [0, 8])}  # a first tensor; the cases add a second "b"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x01\x00", "header too small"),
        (_raw_file({}, b"", length=10_000), "invalid header length"),
        (struct.pack("<Q", 4) + b"{no}", "invalid JSON"),
        (struct.pack("<Q", 2) + b"[]", "invalid JSON"),
        (_raw_file({**TWO, "b": _one("F32", [2], [12, 20])}, bytes(20)), "invalid offset for tensor `b`"),
        (_raw_file({**TWO, "b": _one("F32", [2], [4, 12])}, bytes(12)), "invalid offset for tensor `b`"),
        (_raw_file(TWO, bytes(9)), "not fully covered"),
        (_raw_file({"a": _one("F32", [3], [0, 8])}, bytes(8)), "invalid shape, data type, or offset"),
        (_raw_file({"a": _one("F7", [2], [0, 1])}, bytes(1)), "unknown variant `F7`"),
        (_raw_file({"a": _one("F32", [-1], [0, 4])}, bytes(4)), "expected usize"),
        (_raw_file({"a": _one("F32", [1], [4, 0])}, bytes(4)), "invalid offset for tensor `a`"),
        (_raw_file({"a": _one("F32", [1], [0])}, bytes(4)), "expected a tuple of size 2"),
        (_raw_file({"a": [1, 2]}, b""), "invalid JSON"),
        (struct.pack("<Q", 18) + b'{"a": {}, "a": {}}', "missing field `dtype`"),
    ],
    ids=[
        "short", "header-too-long", "not-json", "not-an-object", "gap", "overlap", "trailing-bytes",
        "size-vs-shape", "unknown-dtype", "negative-shape", "reversed-offsets", "one-offset", "not-a-dict",
        "empty-descriptions",
    ],
)  # fmt: skip
def test_a_malformed_file_is_a_value_error_naming_it(tmp_path: Path, content: bytes, reason: str) -> None:
    """Refused as safetensors itself refuses it, with its reason."""
    with pytest.raises(SafetensorError, match=reason):
        deserialize(content)
    (tmp_path / WEIGHTS_NAME).write_bytes(content)
    ifs.seal(tmp_path)
    with pytest.raises(ValueError, match=reason) as err:
        load_state_dict(tmp_path)
    assert WEIGHTS_NAME in str(err.value) and not isinstance(err.value, IntegrityError)


def test_a_tensor_at_an_offset_its_dtype_cannot_be_viewed_at_loads_as_load_file_loads_it(tmp_path: Path) -> None:
    """The tensors are views of the buffer that holds the file; one whose offset is not a multiple
    of its element size (an odd-length U8 tensor before an F32 one) is copied out instead."""
    header = {"a": _one("U8", [3], [0, 3]), "b": _one("F32", [2], [3, 11])}
    data = b"\x01\x02\x03" + struct.pack("<2f", 1.5, -2.0)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data from an offset of 8 bytes: only "b" is misaligned
    (tmp_path / WEIGHTS_NAME).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    ifs.seal(tmp_path)
    got = load_state_dict(tmp_path)
    _same(got, load_file(tmp_path / WEIGHTS_NAME))
    assert got["b"].tolist() == [1.5, -2.0] and got["a"].tolist() == [1, 2, 3]


def test_the_safetensors_library_refuses_those_files_too(tmp_path: Path) -> None:
    """The format as its own library reads it: a gap between tensors, and trailing bytes."""
    for header, data in [({**TWO, "b": _one("F32", [2], [12, 20])}, bytes(20)), (TWO, bytes(9))]:
        (tmp_path / "x.safetensors").write_bytes(_raw_file(header, data))
        with pytest.raises(Exception, match="(?i)invalid|incomplete|offset"):
            load_file(tmp_path / "x.safetensors")


def _index(directory: Path, weight_map: Any) -> None:
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_index_that_does_not_match_its_shards_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "model-1.safetensors")
    _index(tmp_path, {"a": "model-1.safetensors"})  # b is there, but not placed there
    ifs.seal(tmp_path)
    with pytest.raises(ValueError, match="holds tensors that .* does not place there: b"):
        load_state_dict(tmp_path)
    _index(tmp_path, {"a": "model-1.safetensors", "b": "model-1.safetensors", "c": "model-1.safetensors"})
    ifs.seal(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="lists tensors no shard holds: c"):
        load_state_dict(tmp_path)
    save_file({"a": torch.ones(2)}, tmp_path / "model-1.safetensors")
    _index(tmp_path, {"a": "model-1.safetensors", "b": "model-2.safetensors"})  # model-2 was never written
    ifs.seal(tmp_path, overwrite=True)
    with pytest.raises(FileNotFoundError, match="model-2.safetensors is not in the manifest"):
        load_state_dict(tmp_path)
    for bad in (b"[]", b'{"weight_map": {"a": 1}}', b"{"):
        (tmp_path / INDEX_NAME).write_bytes(bad)
        ifs.seal(tmp_path, overwrite=True)
        with pytest.raises(ValueError, match=INDEX_NAME):
            load_state_dict(tmp_path)


def test_a_directory_without_weights_or_without_a_manifest(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ManifestNotFoundError):
        load_state_dict(tmp_path)
    ifs.seal(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"neither {WEIGHTS_NAME} nor {INDEX_NAME}"):
        load_state_dict(tmp_path)
    save_file({"a": torch.ones(2)}, tmp_path / WEIGHTS_NAME)  # there, but never sealed: not loaded
    with pytest.raises(FileNotFoundError, match="neither"):
        load_state_dict(tmp_path)
    assert (tmp_path / MANIFEST_FILENAME).is_file()
