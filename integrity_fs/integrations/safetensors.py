"""safetensors files of a sealed directory, loaded into a state dict in one verified read.

A ``save_pretrained`` directory holds one ``model.safetensors`` or several shards listed by
``model.safetensors.index.json``. :func:`load_state_dict` reads each of those files once through
:func:`integrity_fs.open`, whole, into one buffer (each unit, chunk or whole file, hashed where it
lands); only then is its header parsed and its tensors made as views of the buffer. The dict is
returned only once every file was read whole, so a damaged byte raises ``IntegrityError`` before
any tensor is returned.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
``dtype``, ``shape``, ``data_offsets`` relative to the end of the header; an optional
``__metadata__`` of strings), then the tensors' bytes. A header that breaks the format (offsets
that overlap, leave gaps, or disagree with the dtype and shape) is a ``ValueError`` naming the file.

Needs torch (extra ``hf``); the ``safetensors`` package itself is not used.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import signing, storage
from ..manifest import Manifest
from ..manifests import manifest_in_use, read_manifest
from ..options import VerifyOptions
from ..read import VerifiedFile, open
from ..report import printable
from ..storage import URL

try:
    import torch
except ImportError as exc:
    raise ImportError("integrity_fs.integrations.safetensors needs torch: pip install 'integrity-fs[hf]'") from exc

if TYPE_CHECKING:
    import fsspec

__all__ = ["DTYPES", "INDEX_NAME", "MAX_HEADER_SIZE", "WEIGHTS_NAME", "load_state_dict"]


#: The file of a directory with one safetensors file (what ``save_pretrained`` writes).
WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded one: ``{"weight_map": {tensor name: shard file name}, "metadata": {...}}``.
INDEX_NAME = "model.safetensors.index.json"
#: The largest header accepted, as the safetensors library bounds it.
MAX_HEADER_SIZE = 100_000_000

#: safetensors dtype names -> torch dtypes (those this torch has).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }.items()
    if hasattr(torch, attr)
}


@dataclass(frozen=True)
class _Tensor:
    """One tensor as the header describes it: where its bytes lie (from the start of the file)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def load_state_dict(
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    public_key: signing.PublicKey | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file(s) of the sealed directory at ``url``, on the CPU.

    The directory's ``model.safetensors``, or else the shards its ``model.safetensors.index.json``
    lists (the index is read verified too). Each file is read once through
    :func:`integrity_fs.open`; nothing is returned unless every byte verified.

    Parameters
    ----------
    url: the sealed directory (a ``save_pretrained`` or Trainer checkpoint folder), any fsspec URL.
    storage_options, fs: as for :func:`integrity_fs.verify`.
    public_key: as for :func:`integrity_fs.open`: ``model.sig`` must verify with it and cover the
        manifest's digests (checked once, before any file is read; with no manifest, the signed
        digests are the manifest).

    Raises ``IntegrityError`` when a byte differs from the manifest (before any tensor is
    returned), ``SignatureError`` (with ``public_key``) when the signature is missing, made with
    another key or covers other digests, ``ManifestNotFoundError`` when the directory is not
    sealed, ``FileNotFoundError`` when the manifest lists neither file (or not a shard the index
    names), ``ValueError`` when a file is not valid safetensors or the index does not match the
    shards, ``OSError`` on a storage failure.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors files are little-endian: loading them on this machine is not supported")
    manifest = _manifest(url, storage_options, fs, public_key)

    def opened(name: str) -> VerifiedFile:
        return open(url, name, storage_options=storage_options, fs=fs, manifest=manifest)

    if WEIGHTS_NAME in manifest.files:
        with opened(WEIGHTS_NAME) as f:
            return _read_file(f, WEIGHTS_NAME)
    if INDEX_NAME not in manifest.files:
        raise FileNotFoundError(f"neither {WEIGHTS_NAME} nor {INDEX_NAME} is in the manifest of {printable(str(url))}")
    with opened(INDEX_NAME) as f:
        weight_map = _weight_map(f.read(), f.entry.location)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        with opened(shard) as f:
            tensors = _read_file(f, shard)
        _check_shard(weight_map, shard, tensors, f.entry.location)
        state.update(tensors)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{INDEX_NAME} of {f.entry.location} lists tensors no shard holds: {_names(missing)}")
    return state


def _manifest(
    url: URL,
    storage_options: dict[str, Any] | None,
    fs: fsspec.AbstractFileSystem | None,
    public_key: signing.PublicKey | None,
) -> Manifest:
    """The directory's manifest; with ``public_key``, checked against its signature as
    :func:`integrity_fs.open` checks it, once for every file read."""
    if public_key is None:
        return read_manifest(url, storage_options=storage_options, fs=fs)
    store, root = storage.resolve(url, storage_options, fs)
    return manifest_in_use(store, root, VerifyOptions(public_key=public_key)).manifest


def _read_file(f: VerifiedFile, name: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, each byte read once: the whole file lands in one buffer
    (each unit hashed where it lands, all of them at once, see ``VerifiedFile.read_rest_into``), and
    only then is its header parsed; the tensors are views of the buffer, as those of
    ``safetensors.torch.load_file`` are views of its mapping of the file. The buffer is dropped
    unless every unit matched."""
    where = f"{printable(name)} in {f.entry.location}"
    data = torch.empty(f.entry.size, dtype=torch.uint8)
    if len(data):
        f.read_rest_into(data.numpy().data)
    out: dict[str, torch.Tensor] = {}
    for tensor in _header(data.numpy().data, where):
        raw = data[tensor.start : tensor.end]
        if tensor.start % tensor.dtype.itemsize:  # a view needs its elements aligned
            raw = raw.clone()
        out[tensor.name] = raw.view(tensor.dtype).reshape(tensor.shape)
    return out


def _header(data: memoryview, where: str) -> list[_Tensor]:
    """The tensors the header of the file ``data`` describes, in the order of their bytes, checked:
    contiguous from the end of the header to the end of the file, each as long as its dtype and
    shape say."""
    size = len(data)
    prefix = bytes(data[:8])
    if len(prefix) < 8:
        raise ValueError(f"{where} is not a safetensors file: {size} bytes, shorter than its header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_SIZE or 8 + length > size:
        raise ValueError(f"{where} is not a safetensors file: a header of {length} bytes in a file of {size}")
    try:
        header = json.loads(bytes(data[8 : 8 + length]), object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where} is not a safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{where} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + length
    tensors = sorted((_tensor(name, info, data_start, where) for name, info in header.items()), key=_order)
    at = data_start
    for tensor in tensors:
        if tensor.start != at:
            raise ValueError(
                f"{where} is not a valid safetensors file: tensor {printable(tensor.name)} starts at byte "
                f"{tensor.start - data_start} of the data, where the previous one ends at {at - data_start}"
            )
        at = tensor.end
    if at != size:
        raise ValueError(
            f"{where} is not a valid safetensors file: its tensors end at byte {at} of a file of {size} bytes"
        )
    return tensors


def _order(tensor: _Tensor) -> tuple[int, int]:
    return (tensor.start, tensor.end)


def _tensor(name: str, info: Any, data_start: int, where: str) -> _Tensor:
    bad = f"{where} is not a valid safetensors file: tensor {printable(name)}"
    if not isinstance(info, dict):
        raise ValueError(f"{bad} is not described by a JSON object")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ValueError(f"{bad} has a dtype this loader cannot make a torch tensor of: {dtype_name!r}")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise ValueError(f"{bad} has an invalid shape: {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))):
        raise ValueError(f"{bad} has invalid data_offsets: {offsets!r}")
    dtype = DTYPES[dtype_name]
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    if end - begin != numel * dtype.itemsize:
        raise ValueError(
            f"{bad} holds {end - begin} bytes, not the {numel * dtype.itemsize} of its dtype {dtype_name} "
            f"and shape {shape}"
        )
    return _Tensor(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {printable(key)} appears twice")
        out[key] = value
    return out


def _weight_map(raw: bytes, location: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name), checked."""
    where = f"{INDEX_NAME} in {location}"
    try:
        index = json.loads(raw, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{where} has no weight_map of tensor names to shard file names")
    return weight_map


def _check_shard(weight_map: dict[str, str], shard: str, tensors: dict[str, torch.Tensor], location: str) -> None:
    """Every tensor of ``shard`` is one the index places there (so none is loaded twice)."""
    elsewhere = sorted(name for name in tensors if weight_map.get(name) != shard)
    if elsewhere:
        where = f"{INDEX_NAME} of {location}"
        raise ValueError(f"{printable(shard)} holds tensors that {where} does not place there: {_names(elsewhere)}")


def _names(names: list[str], shown: int = 5) -> str:
    listed = ", ".join(printable(n) for n in names[:shown])
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"
