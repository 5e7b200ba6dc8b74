"""Synthetic checkpoints: random bytes generated once per (shape, seed), cached on disk, reused.

Layout under the cache root (default ``/tmp/integrity_fs_bench``)::

    <name>/data/f0000.bin ...         the bytes, no manifest: what the bare contenders read
    <name>/sealed-file/...            hard links to the same inodes + a file-granularity manifest
    <name>/sealed-chunk-64MiB/...     hard links + a chunk-granularity manifest (one per chunk size)

Hard links give every variant its own manifest over the very same bytes (and page-cache pages).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from dataclasses import dataclass

import integrity_fs

MiB = 1024 * 1024
GiB = 1024 * MiB
DEFAULT_ROOT = "/tmp/integrity_fs_bench"
#: Bumped when the generator changes, so stale caches are not reused.
_GENERATOR = "v1"
_PIECE = 16 * MiB
_DONE = ".complete"


@dataclass(frozen=True)
class Dataset:
    """``count`` files of ``size`` random bytes each."""

    key: str
    label: str
    count: int
    size: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.key}-{self.count}x{self.size}-s{self.seed}-{_GENERATOR}"

    @property
    def total_bytes(self) -> int:
        return self.count * self.size

    def file_names(self) -> list[str]:
        return [f"f{i:04d}.bin" for i in range(self.count)]


def human_size(n: int) -> str:
    """``512 MiB``, ``1 GiB``, ``64 KiB``."""
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def shape(ds: Dataset) -> str:
    """``4 x 512 MiB``."""
    return f"{ds.count} x {human_size(ds.size)}"


def data_dir(root: str, ds: Dataset) -> str:
    return os.path.join(root, ds.name, "data")


def data_files(root: str, ds: Dataset) -> list[str]:
    base = data_dir(root, ds)
    return [os.path.join(base, name) for name in ds.file_names()]


def ensure_files(root: str, ds: Dataset) -> list[str]:
    """The dataset's data files, generated now unless a complete copy is cached."""
    ensure_data(root, ds)
    return data_files(root, ds)


def ensure_data(root: str, ds: Dataset) -> str:
    """The dataset's data directory, generated now unless a complete copy is cached."""
    base = data_dir(root, ds)
    if os.path.exists(os.path.join(base, _DONE)):
        return base
    shutil.rmtree(os.path.join(root, ds.name), ignore_errors=True)
    os.makedirs(base)
    needed = ds.total_bytes + GiB
    free = shutil.disk_usage(base).free
    if free < needed:
        raise SystemExit(f"not enough disk for {ds.name}: {free / GiB:.1f} GiB free, {needed / GiB:.1f} GiB needed")
    print(f"generating {ds.label} ({shape(ds)}) in {base} ...", file=sys.stderr, flush=True)
    for index, name in enumerate(ds.file_names()):
        with open(os.path.join(base, name), "wb") as f:
            for piece, offset in enumerate(range(0, ds.size, _PIECE)):
                n = min(_PIECE, ds.size - offset)
                f.write(hashlib.shake_128(f"{ds.seed}/{index}/{piece}".encode()).digest(n))
    open(os.path.join(base, _DONE), "w").close()
    return base


def sealed_dir(root: str, ds: Dataset, chunk_size: int | None = None, algorithm: str = "sha256") -> str:
    """A hard-linked copy of the data sealed with file granularity, or chunks of ``chunk_size``,
    with ``algorithm``."""
    variant = "sealed-file" if chunk_size is None else f"sealed-chunk-{human_size(chunk_size).replace(' ', '')}"
    variant += "" if algorithm == "sha256" else f"-{algorithm}"
    target = os.path.join(root, ds.name, variant)
    manifest = os.path.join(target, integrity_fs.MANIFEST_FILENAME)
    source = ensure_data(root, ds)
    if os.path.exists(manifest):
        return target
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for name in ds.file_names():
        os.link(os.path.join(source, name), os.path.join(target, name))
    if chunk_size is None:
        integrity_fs.seal(target, algorithm=algorithm)
    else:
        integrity_fs.seal(target, algorithm=algorithm, granularity="chunk", chunk_size=chunk_size)
    return target


def warm(paths: list[str]) -> None:
    """One untimed read of every file, so that all timings below are hot-cache."""
    buf = bytearray(MiB)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def clean(root: str) -> None:
    """Delete every cached dataset under ``root``."""
    if os.path.isdir(root):
        shutil.rmtree(root)
        print(f"removed {root}")
    else:
        print(f"nothing to remove at {root}")
