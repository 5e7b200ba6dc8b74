"""The safetensors file(s) of a sealed directory, loaded into a state dict from verified bytes only.

A ``save_pretrained`` directory holds one ``model.safetensors``, or the shards its
``model.safetensors.index.json`` lists. Each file is read once through :func:`integrity_fs.open`
(which returns no byte before the unit holding it verified) into a private file in memory, and only
then opened by safetensors itself (``safe_open``, as ``safetensors.torch.load_file`` does): a file
loads, or is refused, exactly as safetensors loads or refuses it, refusals as ``ValueError``.
Needs torch and safetensors (extra ``hf``).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from typing import TYPE_CHECKING, Any

from integrity_fs import ManifestNotFoundError, read_manifest
from integrity_fs import open as open_verified

try:
    import safetensors
    import torch
except ImportError as exc:
    raise ImportError("this module needs torch and safetensors: pip install 'integrity-fs[hf]'") from exc

if TYPE_CHECKING:
    import fsspec

__all__ = ["load_state_dict"]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def load_state_dict(
    url: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    public_key: Any = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file(s) of the sealed directory at ``url``, on the CPU.

    ``storage_options``, ``fs`` and ``public_key`` are as for :func:`integrity_fs.open`. Raises as
    ``open`` does (``IntegrityError`` before any tensor is returned, ``SignatureError``,
    ``ManifestNotFoundError``, ``OSError``); ``FileNotFoundError`` when the manifest lists neither
    file, or not a shard the index names; ``ValueError`` when safetensors refuses a file or the
    index does not match its shards.
    """
    where = {"storage_options": storage_options, "fs": fs}
    try:
        manifest = read_manifest(url, **where)  # read once, for every file
    except ManifestNotFoundError:
        if public_key is None:
            raise
        manifest = None  # open takes the signed digests as the manifest, or raises SignatureError

    def load(name: str) -> Any:
        with open_verified(url, name, manifest=manifest, public_key=public_key, **where) as f:
            if name != _INDEX:
                return _tensors(f, f"{name} in {url}")
            try:
                return json.loads(f.read())
            except ValueError as exc:
                raise ValueError(f"{name} of {url} is not JSON: {exc}") from exc

    for name in (_WEIGHTS, _INDEX):
        try:
            loaded = load(name)
            break
        except FileNotFoundError as exc:  # not in the manifest
            absent = exc
    else:
        raise FileNotFoundError(f"neither {_WEIGHTS} nor {_INDEX} is in the manifest of {url}") from absent
    if name == _WEIGHTS:
        return loaded  # type: ignore[no-any-return]
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{_INDEX} of {url} has no weight_map of tensor names to shard file names")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors = load(shard)
        elsewhere = sorted(name for name in tensors if weight_map.get(name) != shard)
        if elsewhere:
            raise ValueError(f"{shard} holds tensors that {_INDEX} of {url} does not place there: {_names(elsewhere)}")
        state.update(tensors)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{_INDEX} of {url} lists tensors no shard holds: {_names(missing)}")
    return state


def _tensors(f: Any, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one file, copied whole from ``f`` into a private file (in memory where the
    system has ``memfd_create``) that safetensors then opens, as ``load_file`` opens the file it is
    given: the tensors map the private file, which nothing else can reach."""
    memfd = getattr(os, "memfd_create", None)
    with open(memfd("integrity-fs-safetensors"), "w+b") if memfd else tempfile.TemporaryFile() as private:
        private.truncate(f.size)
        if f.size:  # read in place into the private file's pages, which the tensors then map
            pages = mmap.mmap(private.fileno(), f.size)
            f.readinto(pages)  # whole chunks are read and hashed in place, two at a time
            pages.close()  # not on a failure: the traceback may still hold views of it (freed with them)
        try:
            with safetensors.safe_open(f"/dev/fd/{private.fileno()}", framework="pt") as opened:
                return opened.get_tensors()  # type: ignore[no-any-return]
        except (safetensors.SafetensorError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{where} is not a safetensors file torch can load: {exc}") from exc


def _names(names: list[str], shown: int = 5) -> str:
    listed = ", ".join(names[:shown])
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"
