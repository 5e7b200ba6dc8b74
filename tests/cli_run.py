"""What the tests of the command line share: ``integrity-fs ARGS`` in this process (``cli``) or as
a real process (``cli_process``, ``run_on_terminal``), a small checkpoint (the ``ckpt``, ``sealed``
and ``s3`` fixtures of conftest.py), signing keys, and ``shifting://``: an fsspec filesystem
registered for the tests whose files change, or fail, while a command reads them."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from integrity_fs import MANIFEST_FILENAME
from integrity_fs.cli import main

TIMEOUT_S = 120

COMMANDS = [
    "seal",
    "sign",
    "verify",
    "show",
    "export",
    "status",
    "latest",
    "prune",
    "download",
    "upload",
    "copy",
    "demo",
]

FILES = {
    "model.bin": random.Random(1).randbytes(300_000),
    "optim.bin": random.Random(2).randbytes(100_000),
    "sub/meta.json": b'{"step": 1000}\n',
}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class Terminal(io.StringIO):
    """Captured text that says it is a terminal: the CLI draws its progress bars there."""

    def isatty(self) -> bool:
        return True


def cli(*args: str, traceback: bool = False, terminal: bool = False) -> Result:
    """``integrity-fs ARGS`` in this process: ``main(argv)`` with stdout and stderr captured (not a
    terminal; ``terminal``: stderr says it is one, so progress bars are drawn on it)."""
    out, err = io.StringIO(), Terminal() if terminal else io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit:  # --help, --version
            code = int(exit.code or 0)
    result = Result(code, out.getvalue(), err.getvalue())
    assert ("Traceback" in result.stderr) == traceback, result.stderr
    return result


def screen_lines(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: each ``\r`` returns to the line's start, and what
    follows overwrites what was there."""
    lines = []
    for raw in text.split("\n"):
        shown = ""
        for part in raw.split("\r"):
            shown = part + shown[len(part) :]
        lines.append(shown)
    return lines


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def cli_process(*args: str, timeout: float = TIMEOUT_S, code: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m integrity_fs ARGS`` as a real process (``code``: Python run first, in the same process)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    run = "import runpy, sys; sys.argv[0] = 'integrity-fs'; runpy.run_module('integrity_fs', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", f"{code}\n{run}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def error_lines(proc: Result | subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: error:")]


def stderr_pair(proc: Result | subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The two stderr lines every error prints: what failed, then the hint."""
    lines = [
        line for line in proc.stderr.splitlines() if line.startswith(("integrity-fs: error: ", "integrity-fs: hint: "))
    ]
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("integrity-fs: error: ") and lines[1].startswith("integrity-fs: hint: ")
    return lines[0], lines[1]


def run_on_terminal(*args: str, code: str = "") -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns the exit code and what the terminal got.

    ``code`` runs first in the same interpreter (to hide a package, say)."""
    pty = pytest.importorskip("pty")
    fcntl = pytest.importorskip("fcntl")
    termios = pytest.importorskip("termios")
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nimport runpy; runpy.run_module('integrity_fs', run_name='__main__')", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError as exc:  # EIO: the child closed the terminal
            assert exc.errno == errno.EIO
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    return proc.wait(timeout=TIMEOUT_S), b"".join(chunks).decode(errors="replace")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_of(root: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((root / MANIFEST_FILENAME).read_text())
    return result


@dataclass
class KeyPair:
    private: Path
    public: Path


def make_keys(directory: Path, name: str = "signing-key") -> KeyPair:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.pub")
    pair.private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pair.public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pair


#: Files read in several blocks.
LARGE = {"model.bin": random.Random(3).randbytes(3 << 20), "optim.bin": random.Random(4).randbytes(2 << 20)}


def write_large(root: Path) -> Path:
    root.mkdir(parents=True)
    for name, data in LARGE.items():
        (root / name).write_bytes(data)
    return root


class Shifting(MemoryFileSystem):
    """``shifting://``: memory:// under its own name and store, whose files carry an ETag (the
    version integrity_fs pins reads to). Reading a file whose path holds one of ``change`` moves
    its ETag on (another writer at work while the command reads); reading one whose path holds one
    of ``fail`` raises EIO; each of ``on_write`` runs (given the path) when a file is opened for writing."""

    protocol = ("shifting",)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    change: tuple[str, ...] = ()
    fail: tuple[str, ...] = ()
    on_write: ClassVar[list[Callable[[str], None]]] = []
    versions: ClassVar[dict[str, int]] = {}

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return str(super()._strip_protocol(str(path).replace("shifting://", "memory://", 1)))

    def _tagged(self, info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "ETag": f"v{self.versions.get(info['name'], 0)}"} if info.get("type") == "file" else info

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = super().ls(path, detail=detail, **kwargs)
        return [self._tagged(info) for info in out] if detail else out

    def find(self, path: str, maxdepth: Any = None, withdirs: bool = False, detail: bool = False, **kwargs: Any) -> Any:
        out = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        return {name: self._tagged(info) for name, info in out.items()} if detail else out

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._tagged(super().info(path, **kwargs))

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        name = self._strip_protocol(path)
        if any(part in name for part in self.fail):
            raise OSError(errno.EIO, "Input/output error", name)
        data: bytes = super().cat_file(path, start=start, end=end, **kwargs)
        if any(part in name for part in self.change):
            self.versions[name] = self.versions.get(name, 0) + 1
        return data

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        for hook in self.on_write if "w" in mode else ():
            hook(path)
        return super()._open(path, mode=mode, **kwargs)


def shifting_store() -> Iterator[type[Shifting]]:
    """For a fixture: ``shifting://`` registered for the test, empty, its files still until told otherwise."""
    fsspec.register_implementation("shifting", Shifting, clobber=True)
    yield Shifting
    Shifting.store.clear()
    Shifting.pseudo_dirs[:] = [""]
    Shifting.versions.clear()
    Shifting.on_write.clear()
    Shifting.change, Shifting.fail = (), ()


def put_tree(fs_cls: type[Shifting], root: str, files: dict[str, bytes]) -> None:
    """``files`` under ``root`` (a path inside shifting://)."""
    fs = fsspec.filesystem("shifting")
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", data)
