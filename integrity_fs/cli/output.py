"""What the command line prints, in one form: paths as the user typed them, digests shortened,
names escaped (no name can add a line), sizes in binary units; the two stderr lines and the exit
code of each failure; the progress bar on a terminal; integrity_fs's WARNINGs for this call."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from ..hashing import ALGORITHMS
from ..report import printable, shortened

PROG = "integrity-fs"
FILE_CHANGED_HINT = "a file changed while it was read: run again once writers are done"
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "tqdm": "progress", "torch": "torch", "numpy": "torch", "moto": "demo", "cryptography": "sign", "blake3": "blake3"}

#: Each local path the user typed, absolute → as typed (see :func:`tidy`); set per command.
TYPED: dict[str, str] = {}
_DIGEST = re.compile(r"\b([0-9a-f]{8})[0-9a-f]{48}([0-9a-f]{8})\b")
_FLAGS = [(re.compile(r"overwrite=True \(CLI --force\)"), "--force"), (re.compile(r"\bpattern=(?=')"), "--pattern "), (re.compile(r"\bpattern=(?=[\s)])"), "--pattern")]


class UsageError(Exception):
    """The command line asks for something impossible (exit 2); ``hint``: what to do instead."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class KeyFileError(ValueError):
    """A key given with --key, --sign-key or --public-key cannot be used (exit 2)."""


class NoneVerified(Exception):
    """``latest`` found no checkpoint that verifies (exit 1)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def remember_typed(*typed: str | None) -> None:
    """Record the local paths of this command, so that messages print them as typed."""
    TYPED.clear()
    for text in typed:
        if text and ("://" not in text or text.startswith("file://")):
            bare = text.removeprefix("file://").rstrip("/") or "/"
            full = os.path.abspath(os.path.expanduser(bare))
            if full != bare:
                TYPED[full] = bare


def tidy(text: object) -> str:
    """``text`` on one line, paths as typed, digests shortened, Python keywords as the CLI's flags."""
    line = printable(str(text))
    for full in sorted(TYPED, key=len, reverse=True):
        line = re.sub(re.escape(full) + r"(?=[/\s:,;)'\"]|$)", lambda _m, typed=TYPED[full]: typed, line)
    for pattern, flag in _FLAGS:
        line = pattern.sub(flag, line)
    return _DIGEST.sub(r"\1…\2", line)


def format_bytes(n: float) -> str:
    """``12.6 MiB``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for power, unit in enumerate(("KiB", "MiB", "GiB", "TiB"), start=1):
        if n < 1024 ** (power + 1) or unit == "TiB":
            return f"{n / 1024**power:.1f} {unit}"
    raise AssertionError("unreachable")


def format_work(files: int, nbytes: int, seconds: float) -> str:
    """``3 files, 390.6 KiB in 0.05 s at 7.6 MiB/s``; no rate when the time rounds to 0.00 s."""
    text = f"{files} {'file' if files == 1 else 'files'}, {format_bytes(nbytes)} in {seconds:.2f} s"
    return text + (f" at {format_bytes(nbytes / seconds)}/s" if nbytes and round(seconds, 2) > 0 else "")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def extra_note(extra: Sequence[str], action: str) -> str:
    if len(extra) == 1:
        return f"note: 1 file is not in the manifest and was {action}: {tidy(extra[0])}"
    return f"note: {len(extra)} files are not in the manifest and were {action}: {tidy(shortened(list(extra), 5))}"


def print_failure(url: str, problems: Sequence[Any], tail: str = "") -> None:
    """``FAILED URL: 2 problems<tail>``, then one line per problem."""
    print(f"FAILED {tidy(url)}: {len(problems)} {'problem' if len(problems) == 1 else 'problems'}{tail}", flush=True)
    for problem in problems:
        print(f"  {tidy(problem)}")


# ----------------------------------------------------------------------------- failures


def _is_local(args: Any) -> bool:
    urls = [getattr(args, n, None) for n in ("url", "root", "src", "dst", "dest")]
    return all("://" not in u or u.startswith("file://") for u in urls if u)


def classify(error: BaseException, args: Any) -> tuple[int, str, str]:
    """The exit code, what failed, and what to do about it."""
    command = getattr(args, "command", None) or "COMMAND"
    see = f"see `{PROG} {command} --help`" if args is not None else f"see `{PROG} --help`"
    if isinstance(error, UsageError):
        return 2, str(error), error.hint or see
    if isinstance(error, NoneVerified):
        return 1, str(error), error.hint or "the WARNING lines above say why each checkpoint was skipped"
    if isinstance(error, SignatureError):
        return 1, str(error), "do not load it: it changed after signing, or was signed by another key (or never signed); check --public-key, and sign only content you trust"
    if isinstance(error, IntegrityError):
        where = error.location or getattr(args, "url", None) or getattr(args, "src", None) or "the checkpoint"
        problems = error.report.problems
        what = f"{where} failed verification: {shortened([f'{p.path} ({p.kind})' for p in problems], 5)}"
        if problems and all(p.kind == "extra" for p in problems):
            if getattr(args, "strict", False):
                return 1, what, "the named files are not in the manifest: remove them, or run without --strict to allow them"
            return 1, what, "the manifest lists no files, so it vouches only for an empty directory: seal the checkpoint again, once you trust its content"
        if command == "sign":
            return 1, what, "nothing was signed: restore the named files from a good copy, then sign again"
        if getattr(args, "manifest", None) and args.manifest_format == "auto" and all(p.kind == "mismatch" for p in problems) and len(problems) == error.report.files_checked:
            return 1, what, f"every file differs from {args.manifest}: if b3sum wrote it (the layout of sha256sum's, BLAKE3 digests), verify again with --manifest-format b3sum before restoring anything"
        return 1, what, "do not load it; restore the named files from a good copy, and re-seal only content you trust"
    if isinstance(error, FileChangedError):
        return 4, str(error), FILE_CHANGED_HINT
    if isinstance(error, ManifestNotFoundError):
        if getattr(args, "manifest", None) is not None:
            return 3, str(error), "check --manifest: a bare name is inside URL; ./FILE, ../FILE and absolute paths are local; or a URL"
        return 3, str(error), f"seal it first with `{PROG} seal URL`, once you trust its content"
    if isinstance(error, ManifestError):
        return 3, str(error), "the manifest is damaged or not an integrity-fs manifest; restore it, or re-seal a good copy"
    if isinstance(error, NotImplementedError):
        if "pip install" in str(error):
            return 3, str(error), "install the package as the error line says, then run the command again"
        from .. import __version__

        return 3, str(error), (
            f"integrity-fs {__version__} reads the algorithms {', '.join(sorted(ALGORITHMS))} and the granularities file, chunk: "
            "this manifest was written by another tool or a later integrity-fs; verify it with that, or update this one "
            "(in a source checkout: git pull, then pip install -e .)"
        )
    if isinstance(error, KeyFileError):
        return 2, str(error), "give the PEM file of an unencrypted EC key (P-256, P-384 or P-521): the private key to sign, the public key to verify"
    if isinstance(error, ImportError):
        if "pip install" in str(error):
            return 2, str(error), "install the package as the error line says, then run the command again"
        extra = "demo" if command == "demo" else next((e for p, e in EXTRAS.items() if p in f"{error.name} {error}"), None)
        return 2, str(error), f"install it: pip install 'integrity-fs[{extra}]'" if extra else "install the missing package; the extras are s3, gcs, torch, progress, sign, blake3, demo and all"
    if isinstance(error, FileExistsError):
        hints = {"download": "choose a new DEST, or empty that directory first", "seal": "pass --force to replace the manifest (only for content you trust)"}
        return 2, str(error), hints.get(command, "choose another destination, or pass --force to replace the checkpoint there (only with content you trust)")
    if isinstance(error, ValueError) and command == "export":
        return 2, str(error), f"sha256sum, megatron and seed hold whole-file SHA-256 digests, b3sum whole-file BLAKE3 ones, and megatron top-level files only; `{PROG} show URL` says how this checkpoint was sealed"
    if isinstance(error, (ValueError, TypeError)):
        options = "; -o storage options go to fsspec as given" if getattr(args, "o_top", None) or getattr(args, "o_cmd", None) else ""
        return 2, str(error), see + options
    if isinstance(error, OSError):
        what, local = str(error) or type(error).__name__, _is_local(args)
        if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return 4, what, "the disk is full: free space on the destination, or choose another one"
        if error.errno == errno.EROFS:
            return 4, what, "the destination is on a read-only filesystem: choose another one"
        if isinstance(error, (FileNotFoundError, NotADirectoryError)):
            where = "check the path" if local else "check the bucket and prefix in the URL"
            if command not in ("status", "latest", "prune"):
                return 4, what, f"{where}: it must name {'an existing' if local else 'a'} checkpoint directory"
            later = "; a run that has not saved yet has none: create ROOT first" if command == "latest" else ""
            return 4, what, f"{where}: ROOT must be the run's directory (the one that holds its checkpoints){', and it must exist' if local else ''}{later}"
        if local:
            return 4, what, "check the path and its permissions; --debug shows the full error"
        return 4, what, "check the URL, your credentials and the -o storage options, e.g. -o client_kwargs.endpoint_url=...; --debug shows the full error"
    return 4, f"unexpected {type(error).__name__}: {error}", "run again with --debug and report the traceback"


def report_error(error: BaseException, args: Any, *, as_json: bool, debug: bool = False) -> int:
    """Two lines on stderr (and the traceback with --debug); with --json, one object on stdout
    unless the command printed its own."""
    code, what, hint = classify(error, args)
    if debug:
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if as_json and not getattr(args, "printed_json", False):
        urls = [getattr(args, n, None) for n in ("url", "root", "src")]
        print_json({"url": next((u for u in urls if u), None), "ok": False, "exit_code": code, "error": tidy(what)})
    print(f"{PROG}: error: {tidy(what)}", file=sys.stderr)
    print(f"{PROG}: hint: {tidy(hint)}", file=sys.stderr)
    return code


# ----------------------------------------------------------------------------- progress and logging

#: The bar drawn now, if any: WARNING lines are written above it.
_SHOWN: list[Any] = []


def progress_bar(desc: str, finishing: str) -> Any:
    """A tqdm bar on stderr in binary units; after the last byte it says ``finishing`` (the
    writes that remain). Each ``set_size`` starts it afresh (one checkpoint after another).
    ``None`` without tqdm."""
    try:
        import tqdm
        from fsspec.callbacks import TqdmCallback
    except ImportError:
        return None

    class BinaryBar(tqdm.tqdm):  # type: ignore[misc]
        @property
        def format_dict(self) -> dict[str, Any]:
            d: dict[str, Any] = super().format_dict
            rate = d.get("rate") or (d["n"] / d["elapsed"] if d.get("elapsed") else 0)
            d.update(done=format_bytes(d["n"]), size="?" if d.get("total") is None else format_bytes(d["total"]), speed=f"{format_bytes(rate)}/s")
            return d

    class Bar(TqdmCallback):  # type: ignore[misc]
        def set_size(self, size: int) -> None:
            if self.tqdm is not None:
                self.tqdm.reset(total=size)
                self.tqdm.set_description_str(desc, refresh=False)
            self.value = 0
            super().set_size(size)

        def call(self, *args: Any, **kwargs: Any) -> None:
            super().call(*args, **kwargs)
            if self.size and self.value >= self.size and self.tqdm is not None:
                self.tqdm.set_description_str(f"{desc}: {finishing}")

    fmt = "{desc}: {percentage:3.0f}%|{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}]"
    kwargs = {"desc": desc, "file": sys.stderr, "leave": False, "dynamic_ncols": True, "bar_format": fmt}
    return Bar(tqdm_kwargs=kwargs, tqdm_cls=BinaryBar)


class Run:
    """One library call: its progress callback (``None``: no bar) and the time it has taken."""

    def __init__(self) -> None:
        self.callback: Any = None
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def running(args: Any, desc: str, *, bar: bool = True, finishing: str = "finishing") -> Iterator[Run]:
    """Time the call; a bar when a person watches (stderr a terminal, no --no-progress, one process)."""
    run = Run()
    watched = bar and not args.no_progress and args.group is None and sys.stderr.isatty()
    run.callback = progress_bar(desc, finishing) if watched else None
    if run.callback is None:
        yield run
        return
    _SHOWN.append(run.callback)
    try:
        yield run
    finally:
        _SHOWN.remove(run.callback)
        run.callback.close()


class _AboveTheBar(logging.StreamHandler):  # type: ignore[type-arg]
    """Each line on a line of its own, above a bar being drawn (through ``tqdm.write``)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _SHOWN:
            return super().emit(record)
        try:
            import tqdm

            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _OneLine(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        return tidy(super().formatMessage(record))


@contextlib.contextmanager
def cli_logging(*, debug: bool) -> Iterator[None]:
    """integrity_fs's WARNINGs (all its records with --debug) on this call's stderr, in the CLI's
    form; what other packages log or warn stays off stderr unless --debug. The caller's logging
    is as it was afterwards."""
    logger = logging.getLogger("integrity_fs")
    handler = _AboveTheBar(sys.stderr)
    handler.setFormatter(_OneLine(f"{PROG}: %(levelname)s: %(message)s"))
    before = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    quiet = logging.NullHandler()
    with contextlib.ExitStack() as stack:
        if not debug:
            logging.getLogger().addHandler(quiet)
            stack.callback(logging.getLogger().removeHandler, quiet)
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate, logger.level = before


@contextlib.contextmanager
def skipped_checkpoints() -> Iterator[list[dict[str, str]]]:
    """The checkpoints ``latest`` skips while the block runs (from the library's WARNINGs)."""
    found: list[dict[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == "skipping %s (%s): %s" and isinstance(record.args, tuple):
                url, verdict, why = record.args
                found.append({"url": str(url), "reason": str(verdict), "error": str(why)})

    logger, handler = logging.getLogger("integrity_fs"), Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
