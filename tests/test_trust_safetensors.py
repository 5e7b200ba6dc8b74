"""The safetensors loader accepts exactly what safetensors accepts, and refuses what it refuses as
``ValueError`` (files built byte by byte and compared with safetensors' own parser)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import integrity_fs as ifs
from integrity_fs import IntegrityError


def _safetensors_file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _tensor_header(dtype: str, shape: list[int], end: int, extra: bytes = b"") -> bytes:
    return extra + json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, end]}}).encode()


REFUSED = {
    "utf-16": _safetensors_file(_tensor_header("U8", [4], 4).decode().encode("utf-16"), b"abcd"),
    "utf-8-bom": _safetensors_file(_tensor_header("U8", [4], 4, extra=b"\xef\xbb\xbf"), b"abcd"),
    "nan": _safetensors_file(b'{"__metadata__": {"a": NaN}, ' + _tensor_header("U8", [4], 4)[1:], b"abcd"),
    "metadata-5": _safetensors_file(b'{"__metadata__": 5, ' + _tensor_header("U8", [4], 4)[1:], b"abcd"),
    "shape-2**64": _safetensors_file(_tensor_header("U8", [2**64, 0], 0)),
    "unknown-dtype": _safetensors_file(_tensor_header("F7", [4], 4), b"abcd"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_safetensors_loader_refuses_what_safetensors_refuses_as_a_value_error(tmp_path: Path, case: str) -> None:
    safetensors = pytest.importorskip("safetensors")
    pytest.importorskip("torch")
    from integrity_fs.integrations.safetensors import load_state_dict

    raw = REFUSED[case]
    with pytest.raises(safetensors.SafetensorError):  # safetensors refuses it itself
        safetensors.deserialize(raw)
    (tmp_path / "model.safetensors").write_bytes(raw)
    ifs.seal(tmp_path)
    with pytest.raises(ValueError, match="model.safetensors") as err:
        load_state_dict(tmp_path)
    assert not isinstance(err.value, IntegrityError)


def test_a_shape_torch_cannot_hold_is_a_value_error_not_a_type_error(tmp_path: Path) -> None:
    """safetensors' parser takes [2**63, 0] (an empty tensor), torch cannot make that shape:
    safetensors.torch raises TypeError; a loader refuses the file, with ValueError."""
    pytest.importorskip("torch")
    from integrity_fs.integrations.safetensors import load_state_dict

    (tmp_path / "model.safetensors").write_bytes(_safetensors_file(_tensor_header("U8", [2**63, 0], 0)))
    ifs.seal(tmp_path)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_state_dict(tmp_path)


ACCEPTED = {
    "F8_E8M0": ([3], b"\x7f\x80\x01"),
    "F4": ([2, 4], b"\x12\x34\x56\x78"),  # two elements a byte: a torch shape of [2, 2]
}


@pytest.mark.parametrize("dtype", list(ACCEPTED))
def test_the_safetensors_loader_loads_new_dtypes_as_safetensors_does(tmp_path: Path, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from integrity_fs.integrations.safetensors import load_state_dict

    shape, data = ACCEPTED[dtype]
    raw = _safetensors_file(_tensor_header(dtype, shape, len(data)), data)
    (tmp_path / "model.safetensors").write_bytes(raw)
    ifs.seal(tmp_path)
    got = load_state_dict(tmp_path)
    expected = st.load_file(tmp_path / "model.safetensors")
    assert sorted(got) == ["t"]
    assert (got["t"].dtype, got["t"].shape) == (expected["t"].dtype, expected["t"].shape)
    assert bytes(got["t"].contiguous().view(torch.uint8).reshape(-1).tolist()) == data
