"""The command line's exit codes, and each exception's two stderr lines: what failed, and a hint.

0 ok, 1 integrity failure, 2 usage error or refusal, 3 manifest missing or invalid, 4 storage or
I/O error. ``--json`` adds one JSON object on stdout; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import errno
import sys
import traceback

from .. import __version__
from ..errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from ..hashing import ALGORITHMS, GRANULARITIES
from ..report import every_file_differs, printable
from ..text import name_problems
from .output import print_json

__all__ = [
    "EXIT_INTEGRITY",
    "EXIT_MANIFEST",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "EXTRAS",
    "FILE_CHANGED_HINT",
    "PROG",
    "AgreedError",
    "KeyFileError",
    "NoneVerifiedError",
    "UsageError",
    "describe_error",
    "exit_code_for",
    "report_error",
]

PROG = "integrity-fs"

EXIT_OK = 0
EXIT_INTEGRITY = 1
EXIT_USAGE = 2
EXIT_MANIFEST = 3
EXIT_STORAGE = 4

#: The hint for a ``FileChangedError``, whichever command met it.
FILE_CHANGED_HINT = "a file changed while it was read: run again once writers are done"

#: Extras that install a missing optional package, by the package's import name.
EXTRAS = {
    "s3fs": "s3",
    "gcsfs": "gcs",
    "tqdm": "progress",
    "torch": "torch",
    "numpy": "torch",
    "moto": "demo",
    "cryptography": "sign",
    "blake3": "blake3",
}


class AgreedError(Exception):
    """A failure that one rank met and every rank of a launched command reports (see
    :mod:`.launch`): its exit code and hint are the failing rank's."""

    def __init__(self, code: int, message: str, hint: str) -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


class UsageError(Exception):
    """The command line asks for something impossible; exit code 2. ``prog``: the command whose
    arguments were wrong (``integrity-fs export``), when argparse knew it."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class KeyFileError(ValueError):
    """A key file given with ``--key``, ``--sign-key`` or ``--public-key`` cannot be used; exit code 2."""


class NoneVerifiedError(Exception):
    """``latest`` found no checkpoint that verifies; exit code 1. ``hint``: what to do, when the
    usual one (the WARNING lines say why each was skipped) does not fit."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def exit_code_for(error: BaseException) -> int:
    """The documented exit code for an exception (order matters: the manifest errors are also
    ``FileNotFoundError`` and ``ValueError``; a refusal is a ``FileExistsError``)."""
    if isinstance(error, AgreedError):
        return error.code
    if isinstance(error, (IntegrityError, NoneVerifiedError)):
        return EXIT_INTEGRITY
    if isinstance(error, (ManifestNotFoundError, ManifestError, NotImplementedError)):
        return EXIT_MANIFEST
    if isinstance(error, (UsageError, FileExistsError, ValueError, TypeError, ImportError)):
        return EXIT_USAGE
    return EXIT_STORAGE


def _urls(args: argparse.Namespace | None) -> list[str]:
    return [str(getattr(args, name)) for name in ("url", "root", "src", "dst", "dest") if getattr(args, name, None)]


def _is_local(error: OSError, args: argparse.Namespace | None) -> bool:
    """Whether an OS error is about a local path: builtin errors name a file; else judge by the URLs."""
    if error.filename is not None and type(error).__module__ == "builtins" and error.__cause__ is None:
        return True
    urls = _urls(args)
    return bool(urls) and all("://" not in url or url.startswith("file://") for url in urls)


def _install_hint(error: ImportError) -> str:
    for text in (error.name or "", str(error)):  # the missing module's name first, then the message
        for package, extra in EXTRAS.items():
            if package in text:
                return f"install it: pip install 'integrity-fs[{extra}]'"
    return "install the missing package; the extras are s3, gcs, torch, progress, sign, blake3, demo and all"


def describe_error(error: BaseException, args: argparse.Namespace | None = None) -> tuple[str, str]:
    """What failed (naming the file or URL) and what to do about it, for the two stderr lines."""
    command = getattr(args, "command", None) or "COMMAND"
    if isinstance(error, AgreedError):
        return str(error), error.hint
    if isinstance(error, SignatureError):
        return str(error), (
            "do not load it: it changed after signing, or was signed by another key (or never signed); "
            "check --public-key, and sign only content you trust"
        )
    if isinstance(error, NoneVerifiedError):
        return str(error), error.hint or "the WARNING lines above say why each checkpoint was skipped"
    if isinstance(error, KeyFileError):
        return (
            str(error),
            "give the PEM file of an unencrypted EC key (P-256, P-384 or P-521): "
            "the private key to sign, the public key to verify",
        )
    if isinstance(error, IntegrityError):
        where = error.location or "the checkpoint"
        what = f"{where} failed verification: {name_problems(error.report.problems)}"
        if all(p.kind == "extra" for p in error.report.problems):
            if getattr(args, "strict", False):
                return what, (
                    "the named files are not in the manifest: remove them, or run without --strict to allow them"
                )
            return what, (
                "the manifest lists no files, so it vouches only for an empty directory: "
                "seal the checkpoint again, once you trust its content"
            )
        if command == "sign":
            return what, "nothing was signed: restore the named files from a good copy, then sign again"
        if args is not None and _maybe_b3sum(error, args):
            return what, (
                f"every file differs from {args.manifest}: if b3sum wrote it (the same layout as sha256sum's, "
                "BLAKE3 digests), verify again with --manifest-format b3sum before restoring anything"
            )
        return what, "do not load it; restore the named files from a good copy, and re-seal only content you trust"
    if isinstance(error, FileChangedError):
        return str(error), FILE_CHANGED_HINT
    if isinstance(error, ManifestNotFoundError):
        if getattr(args, "manifest", None) is not None:
            return str(error), (
                "check --manifest: a bare name is inside URL; ./FILE, ../FILE and absolute paths are local; or a URL"
            )
        return str(error), f"seal it first with `{PROG} seal URL`, once you trust its content"
    if isinstance(error, ManifestError):
        return str(error), "the manifest is damaged or not an integrity-fs manifest; restore it, or re-seal a good copy"
    if isinstance(error, NotImplementedError):
        if "package" in str(error):  # blake3 not installed: the error line names what to install
            return str(error), "install the package as the error line says, then run the command again"
        return str(error), (
            f"integrity-fs {__version__} reads the algorithms {', '.join(sorted(ALGORITHMS))} and the granularities "
            f"{', '.join(GRANULARITIES)}: this manifest was written by another tool or a later integrity-fs; verify "
            "it with that, or update this one (in a source checkout: git pull, then pip install -e .)"
        )
    if isinstance(error, UsageError):
        return str(error), f"see `{error.prog or (f'{PROG} {command}' if args else PROG)} --help`"
    if isinstance(error, ImportError):
        return str(error), _install_hint(error)
    if isinstance(error, FileExistsError):
        hints = {
            "download": "choose a new DEST, or empty that directory first",
            "seal": "pass --force to replace the manifest (only for content you trust)",
        }
        return str(error), hints.get(command, "choose another destination, or pass --force to replace its manifest")
    if isinstance(error, ValueError) and command == "export":
        return str(error), (
            "sha256sum, megatron and seed hold whole-file SHA-256 digests, b3sum whole-file BLAKE3 ones, and "
            f"megatron top-level files only; `{PROG} show URL` says how this checkpoint was sealed"
        )
    if isinstance(error, (ValueError, TypeError)):
        return str(error), f"check the arguments and -o storage options; see `{PROG} {command} --help`"
    if isinstance(error, OSError):
        what = str(error) or type(error).__name__
        if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return what, "the disk is full: free space on the destination, or choose another one"
        if error.errno == errno.EROFS:
            return what, "the destination is on a read-only filesystem: choose another one"
        local = _is_local(error, args)
        if isinstance(error, (FileNotFoundError, NotADirectoryError)):
            where = "check the path" if local else "check the bucket and prefix in the URL"
            if command not in ("status", "latest", "prune"):
                return what, f"{where}: it must name {'an existing' if local else 'a'} checkpoint directory"
            wanted = "ROOT must be the run's directory (the one that holds its checkpoints)"
            there = ", and it must exist" if local else ""
            later = "; a run that has not saved yet has none: create ROOT first" if command == "latest" else ""
            return what, f"{where}: {wanted}{there}{later}"
        if local:
            return what, "check the path and its permissions; --debug shows the full error"
        return (
            what,
            "check the URL, your credentials and the -o storage options, e.g. -o client_kwargs.endpoint_url=...; "
            "--debug shows the full error",
        )
    return f"unexpected {type(error).__name__}: {error}", "run again with --debug and report the traceback"


def _maybe_b3sum(error: IntegrityError, args: argparse.Namespace) -> bool:
    """Whether every file differs from a ``--manifest`` list read by detection (see
    :func:`~integrity_fs.report.every_file_differs`)."""
    if getattr(args, "manifest", None) is None or getattr(args, "manifest_format", "auto") != "auto":
        return False
    return every_file_differs(error.report)


def report_error(error: BaseException, args: argparse.Namespace | None, *, as_json: bool, debug: bool) -> int:
    """Two lines on stderr (and the traceback with ``--debug``); with ``--json``, one object on stdout."""
    code = exit_code_for(error)
    if debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    what, hint = describe_error(error, args)
    # verify --json and latest --json print their own object, failure included
    printed = isinstance(error, NoneVerifiedError) or (
        isinstance(error, IntegrityError) and getattr(args, "command", None) == "verify"
    )
    if as_json and not printed:
        urls: list[str | None] = [*_urls(args), None]
        print_json({"url": urls[0], "ok": False, "exit_code": code, "error": what})
    print(f"{PROG}: error: {printable(what)}", file=sys.stderr)  # a message may quote names (and a backend's newlines)
    print(f"{PROG}: hint: {printable(hint)}", file=sys.stderr)
    return code
