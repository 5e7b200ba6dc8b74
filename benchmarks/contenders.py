"""The contenders: each a factory that does its setup untimed (imports, listing, buffers, state
dicts) and returns the callable a ``benchmarks.runner`` child times, or ``(call, reset)`` where
``reset`` runs untimed before each call (a fresh destination). Everything goes through
integrity_fs's public API; the peers are what a user would write in a few lines.

A missing package raises ``ImportError`` (the runner turns it into a skipped row with the install
line); a missing tool raises ``Skip``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MiB = 1024 * 1024
CONTENDERS: dict[str, Callable[..., Any]] = {}


class Skip(Exception):
    """The contender cannot run here (a tool is missing); the message says what to install."""


def contender(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(factory: Callable[..., Any]) -> Callable[..., Any]:
        CONTENDERS[name] = factory
        return factory

    return register


def list_files(directory: str) -> list[str]:
    """The regular files directly in ``directory``, sorted, hidden and ``_`` names left out."""
    return sorted(e.path for e in os.scandir(directory) if e.is_file() and not e.name.startswith((".", "_")))


def _threads(threads: int, tasks: list[Any], one: Callable[[Any], object]) -> Callable[[], object]:
    if threads == 1:
        return lambda: [one(t) for t in tasks]

    def run() -> object:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, tasks))

    return run


@contender("skip")
def skip(reason: str) -> Callable[[], object]:
    """A row that cannot run here (its sealed copy needs a package that is missing)."""
    raise Skip(reason)


# Local files: integrity_fs and the loops a user would write.


@contender("verify")
def verify(url: str, **options: Any) -> Callable[[], object]:
    """``integrity_fs.verify(url, **options)``: list, compare with the manifest, hash every byte."""
    import integrity_fs

    return lambda: integrity_fs.verify(url, **options)


@contender("seal")
def seal(url: str, signed: bool = False, **options: Any) -> Callable[[], object]:
    """``integrity_fs.seal(url, overwrite=True, **options)``: the same manifest written each call;
    ``signed``: with ``private_key=`` a new EC P-256 key's PEM file (``model.sig`` written too)."""
    import integrity_fs

    if signed:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        options["private_key"] = os.path.join(os.path.dirname(url), "bench-key.pem")
        with open(options["private_key"], "wb") as f:
            f.write(pem)
    return lambda: integrity_fs.seal(url, overwrite=True, **options)


@contender("readinto")
def readinto(directory: str, buffer_mib: int = 4) -> Callable[[], object]:
    """One thread, one ``buffer_mib`` buffer for every file, ``f.readinto(buffer)`` to the end of
    each: the read alone, the floor of a CRC verify."""
    paths = list_files(directory)
    buffer = memoryview(bytearray(buffer_mib * MiB))

    def one(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            n = total = 0
            while n := f.readinto(buffer):
                total += n
            return total

    return lambda: [one(p) for p in paths]


@contender("file_digest")
def file_digest(directory: str, threads: int = 1) -> Callable[[], object]:
    """``hashlib.file_digest(open(path, "rb"), "sha256")`` per file, on ``threads`` threads, one
    file per task: the SHA-256 floor a user would write."""
    paths = list_files(directory)

    def one(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    return _threads(threads, paths, one)


@contender("ranges")
def ranges(directory: str, threads: int, size: int = 64 * MiB) -> Callable[[], object]:
    """SHA-256 of every ``size`` range of every file, ``threads`` at a time: all cores on one file."""
    tasks = [
        (p, o, min(size, os.path.getsize(p) - o))
        for p in list_files(directory)
        for o in range(0, os.path.getsize(p), size)
    ]

    def one(task: tuple[str, int, int]) -> str:
        path, offset, length = task
        hasher, buffer = hashlib.sha256(), memoryview(bytearray(4 * MiB))
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while length > 0 and (n := f.readinto(buffer[: min(length, len(buffer))])):
                hasher.update(buffer[:n])
                length -= n
        return hasher.hexdigest()

    return _threads(threads, tasks, one)


@contender("walk")
def walk(directory: str) -> Callable[[], object]:
    """A bare ``os.walk`` + ``os.stat`` of every file: the floor of ``verify(quick=True)``."""
    return lambda: [os.stat(os.path.join(d, n)).st_size for d, _, names in os.walk(directory) for n in names]


@contender("model_signing")
def model_signing(directory: str) -> Callable[[], object]:
    """``model_signing.hashing.Config().use_file_serialization().hash(dir)`` (PyPI ``model-signing``)."""
    from model_signing import hashing

    config = hashing.Config().use_file_serialization()
    return lambda: config.hash(directory)


@contender("b3sum")
def b3sum(directory: str) -> Callable[[], object]:
    """``b3sum FILE...`` in a subprocess: the BLAKE3 reference tool (maps each file, every core)."""
    if shutil.which("b3sum") is None:
        raise Skip("b3sum is not on PATH: apt-get install b3sum (or cargo install b3sum)")
    command = ["b3sum", *list_files(directory)]
    return lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


# One file read whole into the caller's buffer.


def _into(f: Any, buffer: memoryview) -> int:
    done = 0
    while done < len(buffer) and (n := f.readinto(buffer[done:])):
        done += n
    return done


@contender("buffer_readinto")
def buffer_readinto(path: str, sha256: bool = False) -> Callable[[], object]:
    """``open(path, "rb", buffering=0)``, ``readinto`` the caller's buffer to the end (and
    ``hashlib.sha256`` of it, on one core, with ``sha256``)."""
    buffer = memoryview(bytearray(os.path.getsize(path)))

    def run() -> object:
        with open(path, "rb", buffering=0) as f:
            n = _into(f, buffer)
        return hashlib.sha256(buffer[:n]).hexdigest() if sha256 else n

    return run


@contender("open_readinto")
def open_readinto(url: str, name: str) -> Callable[[], object]:
    """``integrity_fs.open(url, name)``, ``readinto`` the caller's buffer to the end: only verified bytes."""
    import integrity_fs

    buffer = memoryview(bytearray(os.path.getsize(os.path.join(url, name))))

    def run() -> object:
        with integrity_fs.open(url, name) as f:
            return _into(f, buffer)

    return run


# torch.distributed.checkpoint


def state_dict(tensors: int, mib: int, *, random: bool) -> dict[str, Any]:
    """``{"model": {layer<i>.weight: float32 tensor}}`` of ``mib`` MiB in ``tensors`` tensors."""
    import torch

    per = mib * MiB // tensors // 4
    generator = torch.Generator().manual_seed(0)
    make = (lambda: torch.randn(per, generator=generator)) if random else (lambda: torch.empty(per))
    return {"model": {f"layer{i}.weight": make() for i in range(tensors)}}


@contender("dcp_load")
def dcp_load(url: str, tensors: int, mib: int, reader: str = "integrity_fs") -> Callable[[], object]:
    """Load into a state dict allocated once: ``integrity_fs.dcp.load`` (``reader="integrity_fs"``),
    plain ``torch.distributed.checkpoint.load(checkpoint_id=path)`` (``"plain"``), or plain with
    DCP's ``FsspecReader`` (``"fsspec"``, the peer of the earlier figures)."""
    import torch.distributed.checkpoint as dcp

    target = state_dict(tensors, mib, random=False)
    if reader == "integrity_fs":
        from integrity_fs import dcp as verified

        return lambda: verified.load(target, url)
    if reader == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return lambda: dcp.load(target, storage_reader=FsspecReader(url), no_dist=True)
    return lambda: dcp.load(target, checkpoint_id=url, no_dist=True)


@contender("dcp_save")
def dcp_save(url: str, tensors: int, mib: int, **options: Any) -> tuple[Callable[[], object], Callable[[], object]]:
    """Save to ``url`` (removed before each call, untimed): ``integrity_fs.dcp.save(**options)``, or
    plain ``torch.distributed.checkpoint.save(checkpoint_id=url)`` with ``options={"plain": True}``."""
    import torch.distributed.checkpoint as dcp

    from integrity_fs import dcp as sealed

    source, plain = state_dict(tensors, mib, random=True), options.pop("plain", False)

    def run() -> object:
        return dcp.save(source, checkpoint_id=url, no_dist=True) if plain else sealed.save(source, url, **options)

    return run, lambda: shutil.rmtree(url, ignore_errors=True)


@contender("dcp_keep_last")
def dcp_keep_last(root: str, tensors: int, mib: int, keep_last: int, **options: Any) -> Callable[[], object]:
    """Each call saves the next step of a run under ``root`` (emptied first) with
    ``integrity_fs.dcp.save(..., keep_last=keep_last)``: what a training loop does."""
    from integrity_fs import dcp as sealed

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    source, steps = state_dict(tensors, mib, random=True), iter(range(10**9))

    def run() -> object:
        step = next(steps)
        sealed.save(source, os.path.join(root, f"step_{step}"), keep_last=keep_last, **options)
        return {"checkpoints": len(os.listdir(root)), "step": step}

    return run


# safetensors


@contender("load_file")
def load_file(paths: list[str], copy: bool) -> Callable[[], object]:
    """``safetensors.torch.load_file`` of each file (mapped: reads nothing until the tensors are
    used), and with ``copy`` every tensor cloned: every byte read into memory of its own."""
    from safetensors.torch import load_file

    if copy:
        return lambda: [{k: v.clone() for k, v in load_file(p).items()} for p in paths]
    return lambda: [load_file(p) for p in paths]


@contender("load_state_dict")
def load_state_dict(url: str) -> Callable[[], object]:
    """``integrity_fs.integrations.safetensors.load_state_dict(url)``: every byte verified."""
    from integrity_fs.integrations.safetensors import load_state_dict

    return lambda: [load_state_dict(url)]  # a list: a dict result is read as the call's extra figures


# S3 (moto): the server runs in the parent; ``options`` are the storage options that reach it.


def _s3(options: dict[str, Any]) -> Any:
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, **options)


def _fresh(dest: str) -> Callable[[], object]:
    return lambda: shutil.rmtree(dest, ignore_errors=True)


@contender("download")
def download(url: str, options: dict[str, Any], dest: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """``integrity_fs.download(url, dest)`` into a fresh ``dest``: each byte read once and checked."""
    import integrity_fs

    return lambda: integrity_fs.download(url, dest, storage_options=options), _fresh(dest)


@contender("fs_get")
def fs_get(url: str, options: dict[str, Any], dest: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """s3fs ``fs.get(url + "/", dest, recursive=True)`` into a fresh ``dest`` (a fresh listing each call)."""
    fs = _s3(options)

    def reset() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        fs.invalidate_cache()

    return lambda: fs.get(url.rstrip("/") + "/", dest + "/", recursive=True), reset


@contender("upload")
def upload(
    src: str, url: str, options: dict[str, Any], **seal_options: Any
) -> tuple[Callable[[], object], Callable[[], object]]:
    """``integrity_fs.upload(src, url, **seal_options)`` to a fresh prefix: sealed from the bytes sent."""
    import integrity_fs

    fs = _s3(options)
    return lambda: integrity_fs.upload(src, url, storage_options=options, **seal_options), lambda: _rm(fs, url)


@contender("fs_put")
def fs_put(src: str, url: str, options: dict[str, Any]) -> tuple[Callable[[], object], Callable[[], object]]:
    """s3fs ``fs.put(src + "/", url + "/", recursive=True)`` to a fresh prefix."""
    fs = _s3(options)
    return lambda: fs.put(src.rstrip("/") + "/", url.rstrip("/") + "/", recursive=True), lambda: _rm(fs, url)


def _rm(fs: Any, url: str) -> None:
    if fs.exists(url):
        fs.rm(url, recursive=True)
    fs.invalidate_cache()


@contender("s3_read")
def s3_read(url: str, options: dict[str, Any], threads: int) -> Callable[[], object]:
    """Bare s3fs: ``with fs.open(p, "rb") as f: while f.read(1 MiB)`` per object, ``threads`` at a time."""
    fs = _s3(options)
    paths = [p for p in fs.find(url) if not os.path.basename(p).startswith(("_", "."))]

    def one(path: str) -> int:
        with fs.open(path, "rb") as f:
            return sum(len(b) for b in iter(lambda: f.read(MiB), b""))

    return _threads(threads, paths, one)
