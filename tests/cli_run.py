"""What the tests of the command line share: ``integrity-fs ARGS`` in this process (``cli``) or as
a real process (``cli_process``, ``run_on_terminal``), a small checkpoint (the ``ckpt``, ``sealed``
and ``s3`` fixtures), signing keys, and another writer at work while a command reads."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
    command = ["-c", f"{code}\n{run}"]
    return subprocess.run(
        [sys.executable, *command, *args],
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
    lines = [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: ")]
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


class RewriteOnFirstBytes:
    """A progress callback that, when the first bytes are counted, replaces ``victims`` with new
    files (their bytes, or ``data``): another writer at work while the command reads. The CLI
    passes its progress callback to the library, so this is the CLI's own read that sees it."""

    def __init__(self, victims: list[Path], data: bytes | None = None) -> None:
        self.victims, self.data, self.done = victims, data, False

    def set_size(self, size: int) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        if self.done:
            return
        self.done = True
        for victim in self.victims:
            fresh = victim.with_name(victim.name + ".new")
            fresh.write_bytes(victim.read_bytes() if self.data is None else self.data)
            os.replace(fresh, victim)  # a new inode: seen however fine the clock


def rewrite_while_read(monkeypatch: pytest.MonkeyPatch, victims: list[Path], data: bytes | None = None) -> None:
    from integrity_fs.cli import output

    @contextlib.contextmanager
    def progress(args: Any, desc: str, *, enabled: bool = True) -> Any:
        yield RewriteOnFirstBytes(victims, data)

    monkeypatch.setattr(output, "progress", progress)


#: Files read in several blocks: progress is counted, and another writer can act, mid-read.
LARGE = {"model.bin": random.Random(3).randbytes(3 << 20), "optim.bin": random.Random(4).randbytes(2 << 20)}


def write_large(root: Path) -> Path:
    root.mkdir(parents=True)
    for name, data in LARGE.items():
        (root / name).write_bytes(data)
    return root
