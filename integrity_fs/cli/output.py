"""What the command line prints, in one form: paths as the user typed them, digests shortened,
names escaped (no name can add a line), sizes in binary units; each failure's exit code and two
stderr lines; the progress bar on a terminal; integrity_fs's WARNINGs for the call."""

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

from .. import __version__
from ..errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from ..hashing import ALGORITHMS
from ..report import printable, shortened

PROG = "integrity-fs"
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "tqdm": "progress", "torch": "torch", "numpy": "torch", "blake3": "blake3"}
EXTRAS["cryptography"] = "sign"
#: Each local path the user typed, absolute → as typed (see :func:`tidy`); set per command.
TYPED: dict[str, str] = {}
_DIGEST = re.compile(r"\b([0-9a-f]{8})[0-9a-f]{48}([0-9a-f]{8})\b")
_FLAGS = [
    (re.compile(r"overwrite=True \(CLI --force\)"), "--force"),
    (re.compile(r"\bpattern=(?=')"), "--pattern "),
    (re.compile(r"\bpattern=(?=[\s)])"), "--pattern"),
    (re.compile(r"\bkeep_last=(?=\d)"), "--keep-last "),
]
HINTS = {
    "changed": "a file changed while it was read: run again once writers are done",
    "signature": "do not load it: it changed after signing, or was signed by another key (or never signed)",
    "strict": "the named files are not in the manifest: remove them, or run without --strict to allow them",
    "empty": "the manifest lists no files, so it vouches only for an empty directory: seal it again, if you trust it",
    "sign": "nothing was signed: restore the named files from a good copy, then sign again",
    "damaged": "do not load it; restore the named files from a good copy, and re-seal only content you trust",
    "manifest": "check --manifest: a bare name is inside URL; ./FILE, ../FILE and absolute paths are local; or a URL",
    "unsealed": f"seal it first with `{PROG} seal URL`, once you trust its content",
    "invalid": "the manifest is damaged or not an integrity-fs manifest; restore it, or re-seal a good copy",
    "b3sum": "every file differs from {manifest}: if b3sum wrote it, verify again with --manifest-format b3sum",
    "install": "install the package as the error line says, then run the command again",
    "newer": "integrity-fs {version} reads the algorithms {algorithms} and the granularities file, chunk: this "
    "manifest was written by another tool or a later integrity-fs; verify it with that, or update this one "
    "(in a source checkout: git pull, then pip install -e .)",
    "skipped": "the WARNING lines above say why each checkpoint was skipped",
    "key": "give the PEM file of an unencrypted EC key (P-256, P-384 or P-521): private to sign, public to verify",
    "download": "choose a new DEST, or empty that directory first",
    "seal": "pass --force to replace the manifest (only for content you trust)",
    "exists": "choose another destination, or pass --force to replace the checkpoint there (only content you trust)",
    "export": "sha256sum, megatron and seed hold whole-file SHA-256 digests, b3sum BLAKE3 ones, and megatron "
    f"top-level files only; `{PROG} show URL` says how this checkpoint was sealed",
    "full": "the disk is full: free space on the destination, or choose another one",
    "local": "check the path and its permissions; --debug shows the full error",
    "checkpoint": "{root} is itself a sealed checkpoint: ROOT is the run's directory that holds the checkpoints; "
    f"`{PROG} verify {{root}}` checks this one",
    "root": "ROOT is a run's directory, holding one directory per checkpoint (step_1000, ...); names starting with '.' "
    "or '_' are not checkpoints",
    "remote": "check the URL, your credentials and the -o storage options; --debug shows the full error",
}


class UsageError(Exception):
    """The command line asks for something impossible (exit 2; ``code``: 1 when no checkpoint of a
    run verifies); ``hint``: what to do instead."""

    def __init__(self, message: str, hint: str | None = None, code: int = 2) -> None:
        super().__init__(message)
        self.hint, self.code = hint, code

    def __reduce__(self) -> tuple[Any, ...]:  # the hint travels to the other ranks under torchrun too
        return type(self), (str(self), self.hint, self.code)


def remember_typed(*typed: str | None) -> None:
    """Record this command's local paths, so that every message prints them as typed."""
    TYPED.clear()
    for text in typed:
        if text and ("://" not in text or text.startswith("file://")):
            bare = text.removeprefix("file://").rstrip("/") or "/"
            if (full := os.path.abspath(os.path.expanduser(bare))) != bare:
                TYPED[full] = bare


def tidy(text: object) -> str:
    """``text`` on one line, paths as typed, digests shortened, Python keywords as the CLI's flags."""
    line = printable(str(text))
    for full in sorted(TYPED, key=len, reverse=True):
        line = re.sub(re.escape(full) + r"(?=[/\s:,;)'\"]|$)", TYPED[full].replace("\\", "\\\\"), line)
    for pattern, flag in _FLAGS:
        line = pattern.sub(flag, line)
    return _DIGEST.sub(r"\1…\2", line)


def format_bytes(n: float) -> str:
    """``12.6 MiB``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for power, unit in enumerate(("KiB", "MiB", "GiB", "TiB"), start=1):
        if n < 1024 ** (power + 1) or unit == "TiB":
            break
    return f"{n / 1024**power:.1f} {unit}"


def format_work(files: int, nbytes: int, seconds: float) -> str:
    """``3 files, 390.6 KiB in 0.05 s at 7.6 MiB/s``; no rate when the time rounds to 0.00 s."""
    text = f"{plural(files, 'file')}, {format_bytes(nbytes)} in {seconds:.2f} s"
    return text + (f" at {format_bytes(nbytes / seconds)}/s" if nbytes and round(seconds, 2) > 0 else "")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def extra_note(extra: Sequence[str], action: str) -> str:
    n = len(extra)
    were = "1 file is not in the manifest and was" if n == 1 else f"{n} files are not in the manifest and were"
    return f"note: {were} {action}: {tidy(shortened(list(extra), 5))}"


def print_failure(url: str, problems: Sequence[Any], tail: str = "") -> None:
    """``FAILED URL: 2 problems<tail>``, then one line per problem."""
    print(f"FAILED {tidy(url)}: {plural(len(problems), 'problem')}{tail}", flush=True)
    for problem in problems:
        print(f"  {tidy(problem)}")


def classify(error: BaseException, args: Any) -> tuple[int, str, str]:
    """The exit code, what failed, and what to do about it."""
    command = getattr(args, "command", None)
    see = f"see `{PROG} {command} --help`" if command else f"see `{PROG} --help`"
    if isinstance(error, UsageError):
        return error.code, str(error), error.hint or see
    if isinstance(error, SignatureError):
        return 1, str(error), HINTS["signature"]
    if isinstance(error, IntegrityError):
        problems = error.report.problems
        where = error.location or getattr(args, "url", None) or getattr(args, "src", None)
        what = f"{where} failed verification: {shortened([f'{p.path} ({p.kind})' for p in problems], 5)}"
        if problems and all(p.kind == "extra" for p in problems):
            return 1, what, HINTS["strict" if getattr(args, "strict", False) else "empty"]
        every = len(problems) == error.report.files_checked and all(p.kind == "mismatch" for p in problems)
        if every and getattr(args, "manifest", None) and args.manifest_format == "auto":  # b3sum's, read as sha256sum?
            return 1, what, HINTS["b3sum"].format(manifest=args.manifest)
        return 1, what, HINTS["sign" if command == "sign" else "damaged"]
    if isinstance(error, FileChangedError):
        return 4, str(error), HINTS["changed"]
    if isinstance(error, ManifestNotFoundError):
        return 3, str(error), HINTS["manifest" if getattr(args, "manifest", None) else "unsealed"]
    if isinstance(error, ManifestError):
        return 3, str(error), HINTS["invalid"]
    if isinstance(error, (NotImplementedError, ImportError)) and "pip install" in str(error):
        return 3 if isinstance(error, NotImplementedError) else 2, str(error), HINTS["install"]
    if isinstance(error, NotImplementedError):
        return 3, str(error), HINTS["newer"].format(version=__version__, algorithms=", ".join(sorted(ALGORITHMS)))
    if isinstance(error, ImportError):
        extra = next((e for p, e in EXTRAS.items() if p in f"{error.name} {error}"), "")
        extra = "demo" if command == "demo" else extra
        return 2, str(error), f"install it: pip install 'integrity-fs[{extra}]'" if extra else see
    if isinstance(error, FileExistsError):
        return 2, str(error), HINTS.get(command or "", HINTS["exists"])
    if isinstance(error, (ValueError, TypeError)):
        given = "; -o options go to fsspec" if getattr(args, "o_top", None) or getattr(args, "o_cmd", None) else ""
        return 2, str(error), HINTS["export"] if command == "export" else see + given
    if not isinstance(error, OSError):
        return 4, f"unexpected {type(error).__name__}: {error}", "run again with --debug and report the traceback"
    what = str(error) or type(error).__name__
    urls = [getattr(args, n, None) or "" for n in ("url", "root", "src", "dst", "dest")]
    local = all("://" not in u or u.startswith("file://") for u in urls)
    if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EROFS):
        return 4, what, HINTS["full"] if error.errno != errno.EROFS else "the destination is read-only: choose another"
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        where = "check the path" if local else "check the bucket and prefix in the URL"
        if command not in ("status", "latest", "prune"):
            return 4, what, f"{where}: it must name {'an existing' if local else 'a'} checkpoint directory"
        exist = ", and it must exist" if local else ""
        later = "; a run that has not saved yet has none: create ROOT first" if command == "latest" else ""
        return 4, what, f"{where}: ROOT must be the run's directory (the one that holds its checkpoints){exist}{later}"
    return 4, what, HINTS["local" if local else "remote"]


def report_error(error: BaseException, args: Any, *, as_json: bool, debug: bool = False) -> int:
    """Two lines on stderr (and the traceback with --debug); with --json, one object on stdout
    unless the command printed its own."""
    code, what, hint = classify(error, args)
    if debug:
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if as_json and not getattr(args, "printed_json", False):
        url = next((u for n in ("url", "root", "src") if (u := getattr(args, n, None))), None)
        print_json({"url": url, "ok": False, "exit_code": code, "error": tidy(what)})
    print(f"{PROG}: error: {tidy(what)}\n{PROG}: hint: {tidy(hint)}", file=sys.stderr)
    return code


#: The bar drawn now, if any: WARNING lines are written above it.
_SHOWN: list[Any] = []


def progress_bar(desc: str, finishing: str | None) -> Any:
    """A tqdm bar on stderr in binary units that says ``finishing`` once the last byte is counted
    (the writes that remain, if any); each ``set_size`` starts it afresh. ``None`` without tqdm."""
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
            size = "?" if d.get("total") is None else format_bytes(d["total"])
            d.update(done=format_bytes(d["n"]), size=size, speed=f"{format_bytes(rate)}/s")
            return d

    class Bar(TqdmCallback):  # type: ignore[misc]
        def set_size(self, size: int) -> None:
            if self.tqdm is not None:
                self.tqdm.set_description_str(desc, refresh=False)
                self.tqdm.reset(total=size)
            self.value = 0
            super().set_size(size)

        def call(self, *args: Any, **kwargs: Any) -> None:
            super().call(*args, **kwargs)
            if finishing and self.size and self.value >= self.size and self.tqdm is not None:
                self.tqdm.set_description_str(f"{desc}: {finishing}")

    fmt = "{desc}: {percentage:3.0f}%|{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}]"
    kwargs = {"desc": desc, "file": sys.stderr, "leave": False, "dynamic_ncols": True, "bar_format": fmt}
    return Bar(tqdm_kwargs=kwargs, tqdm_cls=BinaryBar)


class Run:
    """One library call: its progress callback (``None``: no bar), keywords of work, and time taken."""

    def __init__(self, callback: Any, workers: int | None) -> None:
        self.callback, self.started = callback, time.perf_counter()
        self.kw = {"max_workers": workers, "callback": callback}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def running(args: Any, desc: str, *, bar: bool = True, finishing: str | None = None) -> Iterator[Run]:
    """Time the call; a bar when a person watches (stderr a terminal, no --no-progress, one process)."""
    watched = bar and not args.no_progress and args.group is None and sys.stderr.isatty()
    run = Run(progress_bar(desc, finishing) if watched else None, args.workers)
    _SHOWN.append(run.callback)
    try:
        yield run
    finally:
        _SHOWN.remove(run.callback)
        run.callback is not None and run.callback.close()


class _AboveTheBar(logging.StreamHandler):  # type: ignore[type-arg]
    """Each line on a line of its own, above a bar being drawn (through ``tqdm.write``); in the CLI's form."""

    def format(self, record: logging.LogRecord) -> str:
        return tidy(f"{PROG}: {record.levelname}: {record.getMessage()}")

    def emit(self, record: logging.LogRecord) -> None:
        if not any(_SHOWN):
            return super().emit(record)
        try:
            import tqdm

            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def cli_logging(*, debug: bool) -> Iterator[None]:
    """integrity_fs's WARNINGs (every record with --debug) on this call's stderr; what other
    packages log or warn stays off stderr unless --debug. The caller's logging is as it was after."""
    logger, handler, quiet = logging.getLogger("integrity_fs"), _AboveTheBar(sys.stderr), logging.NullHandler()
    before = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
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
