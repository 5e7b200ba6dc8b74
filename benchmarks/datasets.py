"""Synthetic checkpoints, generated once per shape and cached (default ``/tmp/integrity_fs_bench``)::

    <name>/data/f0000.bin ...          random bytes (SHAKE-128 of the seed): what the bare peers read
    <name>/sha256-file/ ...            hard links to the same inodes + a manifest (one per variant)
    dcp-<shape>-<algorithm>/           a state dict saved by integrity_fs.dcp.save (chunk granularity)
    safetensors-<mib>/<algorithm>/     one model.safetensors, hard-linked, sealed in chunks

Hard links give every sealed variant its own manifest over the very same bytes and page-cache pages.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass

from benchmarks.harness import log

MiB = 1024 * 1024
GiB = 1024 * MiB
DEFAULT_ROOT = "/tmp/integrity_fs_bench"
_PIECE = 16 * MiB


@dataclass(frozen=True)
class Dataset:
    """``count`` files of ``size`` random bytes each."""

    label: str
    count: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.count}x{self.size}-v2"

    @property
    def nbytes(self) -> int:
        return self.count * self.size

    @property
    def title(self) -> str:
        return f"{self.label} ({self.count} x {human(self.size)})"


def human(n: int) -> str:
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def data_dir(root: str, ds: Dataset) -> str:
    """The dataset's files (no manifest), generated now unless a complete copy is cached."""
    base = os.path.join(root, ds.name, "data")
    done = os.path.join(root, ds.name, "complete")
    if not os.path.exists(done):
        shutil.rmtree(os.path.join(root, ds.name), ignore_errors=True)
        os.makedirs(base)
        if shutil.disk_usage(base).free < ds.nbytes + GiB:
            raise SystemExit(f"not enough free disk under {root} for {ds.title}")
        log(f"generating {ds.title} in {base} ...")
        for index in range(ds.count):
            with open(os.path.join(base, f"f{index:05d}.bin"), "wb") as f:
                for piece, offset in enumerate(range(0, ds.size, _PIECE)):
                    f.write(hashlib.shake_128(f"{index}/{piece}".encode()).digest(min(_PIECE, ds.size - offset)))
        open(done, "w").close()
    return base


def sealed(root: str, ds: Dataset, algorithm: str = "sha256", chunk_size: int | None = None) -> str:
    """A hard-linked copy of the data sealed with ``algorithm``, in file granularity or in chunks
    of ``chunk_size``. Raises ``NotImplementedError`` (with the install line) when the algorithm's
    package is missing."""
    source = data_dir(root, ds)
    target = os.path.join(root, ds.name, algorithm + ("-file" if chunk_size is None else f"-chunk{chunk_size // MiB}"))
    return _sealed_links(source, target, algorithm, chunk_size)


def links(root: str, ds: Dataset, tag: str) -> str:
    """A fresh, unsealed hard-linked copy of the data (for the seal rows, which write manifests)."""
    target = os.path.join(root, ds.name, tag)
    shutil.rmtree(target, ignore_errors=True)
    _link(data_dir(root, ds), target)
    return target


def _link(source: str, target: str) -> None:
    os.makedirs(target)
    for name in sorted(os.listdir(source)):
        os.link(os.path.join(source, name), os.path.join(target, name))


def _sealed_links(source: str, target: str, algorithm: str, chunk_size: int | None) -> str:
    import integrity_fs

    if os.path.exists(os.path.join(target, integrity_fs.MANIFEST_FILENAME)):
        return target
    shutil.rmtree(target, ignore_errors=True)
    _link(source, target)
    options = {} if chunk_size is None else {"granularity": "chunk", "chunk_size": chunk_size}
    try:
        integrity_fs.seal(target, algorithm=algorithm, **options)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def warm(directory: str) -> None:
    """One untimed read of every file under ``directory``: every timing is hot-cache."""
    buffer = bytearray(4 * MiB)
    for base, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(base, name), "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def dcp_checkpoint(root: str, tensors: int, mib: int, algorithm: str) -> str:
    """A state dict of ``mib`` MiB in ``tensors`` tensors saved by ``integrity_fs.dcp.save`` with
    ``algorithm`` (chunk granularity, its default)."""
    from benchmarks.contenders import state_dict
    from integrity_fs import MANIFEST_FILENAME, dcp

    path = os.path.join(root, f"dcp-{tensors}x{mib}MiB-{algorithm}")
    if not os.path.exists(os.path.join(path, MANIFEST_FILENAME)):
        shutil.rmtree(path, ignore_errors=True)
        log(f"saving a {mib} MiB state dict in {tensors} tensors ({algorithm}) to {path} ...")
        dcp.save(state_dict(tensors, mib, random=True), path, algorithm=algorithm)
    return path


def safetensors_file(root: str, mib: int, tensors: int, algorithm: str) -> str:
    """A directory holding one ``model.safetensors`` of ``mib`` MiB in ``tensors`` float32 tensors
    (``safetensors.torch.save_file``), sealed with ``algorithm`` in 64 MiB chunks."""
    base = os.path.join(root, f"safetensors-{mib}MiB-{tensors}")
    data = os.path.join(base, "data")
    if not os.path.exists(os.path.join(data, "model.safetensors")):
        from safetensors.torch import save_file

        from benchmarks.contenders import state_dict

        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(data)
        save_file(state_dict(tensors, mib, random=True)["model"], os.path.join(data, "model.tmp"))
        os.rename(os.path.join(data, "model.tmp"), os.path.join(data, "model.safetensors"))
    return _sealed_links(data, os.path.join(base, algorithm), algorithm, 64 * MiB)


def clean(root: str) -> None:
    """Delete every cached dataset under ``root``."""
    if os.path.isdir(root):
        shutil.rmtree(root)
        print(f"removed {root}")
    else:
        print(f"nothing to remove at {root}")
