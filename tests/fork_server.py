"""Processes forked from a warm interpreter: what a test would run as ``python SCRIPT ARGS`` or
``python -c CODE``, without paying for ``import torch`` (~2.5 s) in every process.

Each pytest worker starts one server (this file, run as a script) the first time it needs one.
The server only imports libraries, when a request names them: no thread, no process group, no
store is ever opened there, so a fork of it is a new interpreter that has imported those
libraries. Each request is forked into a child that takes its own working directory,
environment, ``sys.argv``, ``sys.path`` and a fresh ``__main__``, writes its stdout and stderr
to a log file, runs the script or code, and exits as ``python`` would (threads joined, ``atexit``
run, the exit code of ``sys.exit`` or 1 after an uncaught exception), less the teardown of every
module. The server reaps each child and reports its exit code (``-N`` for a signal, as
``subprocess`` does).

A child shares the server's hash seed (string hashes and set order), which a new interpreter
would draw afresh; ``random`` and ``numpy.random`` are reseeded in each child. torch computes on
one thread in a child whose environment does not set ``OMP_NUM_THREADS`` (the server imports it
so): the tensors here are tiny, and on a loaded machine a second thread spins for a core.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BASE", "TRANSFORMERS", "Forked", "run", "start"]

TESTS = Path(__file__).resolve().parent
#: What a rank or a snippet of the docs imports; the server imports them once, before its first fork.
BASE = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "fsspec",
    "s3fs",
    "integrity_fs",
    "integrity_fs.cli",
    "integrity_fs.dcp",
    "integrity_fs.distributed",
)
#: What a Trainer imports, for the processes that train.
TRANSFORMERS = (
    "transformers",
    "transformers.trainer",
    "transformers.models.gpt2.modeling_gpt2",
    "accelerate",
    "safetensors.torch",
)


# --------------------------------------------------------------------------- the test's side


class Forked:
    """A child of the server, as much like ``subprocess.Popen`` as the tests need."""

    def __init__(self, server: _Server, pid: int, log: Path, captured: bool) -> None:
        self._server, self.pid, self.log, self._captured = server, pid, log, captured
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exits.pop(self.pid, None)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait, then what the child wrote (stdout and stderr, in one log)."""
        self.wait(timeout)
        output = self.log.read_text(errors="replace")
        if self._captured:
            self.log.unlink()
        return output, None

    def kill(self) -> None:
        self._server.drain()
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)


class _Server:
    def __init__(self) -> None:
        path = [str(TESTS), str(TESTS.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"},
            cwd=TESTS,
        )
        self.exits: dict[int, int] = {}
        self._pending = b""
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (it ends when its stdin does), and wait for it."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()

    def start(self, request: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            message = self._next(None)
            if "started" in message:
                pid: int = message["started"]
                return pid

    def wait(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked process {pid}", timeout or 0)
            self._next(left)
        return self.exits.pop(pid)

    def drain(self) -> None:
        """Take in the messages already sent (exits), without waiting."""
        while self._next(0):
            pass

    def _next(self, timeout: float | None) -> dict[str, Any]:
        """The server's next message (an exit is recorded as it comes); ``{}`` when none came in time."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], timeout)[0]:
                return {}
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the fork server ended (exit code {self.proc.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        if "exited" in message:
            self.exits[message["exited"]] = message["code"]
        return message


_server: _Server | None = None


def start(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    log: Path | None = None,
    stderr: Path | None = None,
    code: str | None = None,
    warm: Sequence[str] = BASE,
    faulthandler: bool = False,
) -> Forked:
    """``python ARGV`` (``argv[0]`` the script; with ``code``, ``python -c CODE ARGV[1:]``), forked
    from this worker's server once it has imported ``warm``; stdout and stderr go to ``log`` (none:
    to a file of its own that ``communicate`` returns and removes), stderr to ``stderr`` if given."""
    global _server
    captured = log is None
    if log is None:
        fd, name = tempfile.mkstemp(prefix="forked-", suffix=".log")
        os.close(fd)
        log = Path(name)
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    request = {
        "argv": [os.fspath(a) for a in argv],
        "code": code,
        "cwd": os.fspath(cwd),
        "env": env,
        "log": str(log),
        "stderr": None if stderr is None else str(stderr),
        "warm": list(warm),
        "faulthandler": faulthandler,
    }
    return Forked(_server, _server.start(request), log, captured)


def run(
    argv: Sequence[str | os.PathLike[str]], *, cwd: str | os.PathLike[str], timeout: float, warm: Sequence[str] = BASE
) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
    timeout=timeout)`` returns, forked (``start``) with this process's environment."""
    with tempfile.TemporaryDirectory(prefix="forked-") as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        proc = start(argv, cwd=cwd, env=dict(os.environ), log=out, stderr=err, warm=warm)
        try:
            proc.wait(timeout)
        finally:
            proc.kill()
        command = [sys.executable, *map(os.fspath, argv)]
        return subprocess.CompletedProcess(command, proc.wait(), out.read_text(), err.read_text())


# --------------------------------------------------------------------------- the server


def _serve() -> None:
    """Read requests (one JSON object a line) on stdin, fork each, report starts and exits."""
    replies = os.dup(1)
    os.dup2(2, 1)  # what an import prints goes to stderr, not into the replies
    own_path = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base_path = [p for p in sys.path[1:] if p not in own_path]
    children: set[int] = set()
    pending = b""
    while True:
        readable = select.select([0], [], [], 0.02 if children else None)[0]
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the worker is gone
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            for name in request["warm"]:
                with contextlib.suppress(ImportError):  # not installed: the tests that need it are skipped
                    importlib.import_module(name)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(replies)
                _child(request, base_path)  # never returns
            children.add(pid)
            _reply(replies, {"started": pid})


def _reply(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _child(request: dict[str, Any], base_path: list[str]) -> None:
    for fd, path in ((1, request["log"]), (2, request["stderr"])):
        if path is None:  # stderr to the log too
            os.dup2(1, fd)
            continue
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv, code = request["argv"], request["code"]
    script = None if code is not None else os.path.abspath(argv[0])
    sys.argv = ["-c", *argv[1:]] if code is not None else argv
    extra = filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    sys.path[:] = [os.path.dirname(script) if script else "", *extra, *base_path]
    _reseed()
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # read at load time otherwise
    if request["faulthandler"]:
        import faulthandler

        faulthandler.enable()
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __cached__=None, __spec__=None)
    if script is not None:
        main.__file__ = script
    sys.modules["__main__"] = main
    source = code if code is not None else Path(script).read_text()  # type: ignore[arg-type]
    os._exit(_exit_code(lambda: exec(compile(source, script or "<string>", "exec"), main.__dict__), main))


def _exit_code(run: Callable[[], None], main: types.ModuleType) -> int:
    """Run, then end as the interpreter ends: non-daemon threads joined, ``atexit`` run (which
    also runs ``weakref.finalize`` callbacks), the script's namespace cleared, stdout and stderr
    flushed; the exit code of ``sys.exit``, or 1 after an uncaught exception, printed. What is
    left out is the teardown of every module (~1 s for torch's), which nothing here observes."""
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = _system_exit_code(exc.code)
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # from the script's frame on
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    for end in (threading._shutdown, atexit._run_exitfuncs, main.__dict__.clear):  # type: ignore[attr-defined]
        try:
            end()
        except SystemExit as exc:
            code = _system_exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # killed by a signal, as Python ends after an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _system_exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _reseed() -> None:
    """A new interpreter draws its seeds afresh (``random`` reseeds itself in a fork child)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


if __name__ == "__main__":
    _serve()
