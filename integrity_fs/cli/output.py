"""What the command line prints: summaries, problem listings, tables, JSON objects, progress bars.

Human output shortens digests (:func:`integrity_fs.text.describe_problem`); ``--json`` keeps them
whole. Nothing here reads a checkpoint: each function formats a result the library returned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..checkpoints import BAD_SIGNATURE, CheckpointStatus
from ..errors import IntegrityError, SignatureError
from ..manifest import MANIFEST_FILENAME, Manifest
from ..report import Report, printable
from ..retention import PruneResult
from ..runs import SKIPPED
from ..signing import SIGNATURE_FILENAME
from ..storage import DEFAULT_CALLBACK, Callback
from ..text import describe_problem, extra_note, format_bytes, format_work, name_problems, short_digest

__all__ = [
    "LARGEST_SHOWN",
    "AboveTheBar",
    "OneLine",
    "Run",
    "attested_kinds",
    "cli_logging",
    "failure",
    "print_failure",
    "print_json",
    "print_latest",
    "print_manifest",
    "print_prune",
    "print_status",
    "print_transferred",
    "print_verify_report",
    "print_written",
    "progress",
    "progress_bar",
    "running",
    "signed_note",
    "skipped_checkpoints",
    "status_verdict",
    "verify_notes",
    "write_bytes",
]

#: How many of the largest files ``show`` lists.
LARGEST_SHOWN = 5


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def write_bytes(data: bytes) -> None:
    """Raw bytes on stdout (``export``), after any text already buffered."""
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # a text stream (main() called with stdout redirected in-process)
        sys.stdout.write(data.decode("utf-8"))
    else:
        out.write(data)
        out.flush()


#: The bars on screen now (see :func:`progress_bar`): while there is one, log lines go through tqdm.
_SHOWN: list[Callback] = []


@contextlib.contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[Callback]:
    """A tqdm bar on stderr (bytes, rate, ETA, in the binary units the summaries use); fsspec's
    no-op callback when disabled or without tqdm. Each ``set_size`` starts the bar afresh (``latest``
    verifies one checkpoint after another). While it is shown, :func:`cli_logging`'s lines are
    written through tqdm, above it."""
    callback = _tqdm_callback(desc) if enabled else None
    if callback is None:  # decided outside any ``except``: the command's own errors chain nothing
        yield DEFAULT_CALLBACK
        return
    _SHOWN.append(callback)
    try:
        yield callback
    finally:
        _SHOWN.remove(callback)
        callback.close()


def _tqdm_callback(desc: str) -> Callback | None:
    try:
        import tqdm  # imported first: a TqdmCallback half-built without it complains at exit

        from ..storage import TqdmCallback
    except ImportError:
        return None

    class BinaryBar(tqdm.tqdm):  # type: ignore[misc]  # tqdm is untyped
        """tqdm's ``unit_scale`` says ``MB`` for MiB (and its rate divides by 1000): these fields
        print what :func:`format_bytes` prints."""

        @property
        def format_dict(self) -> dict[str, Any]:
            d: dict[str, Any] = super().format_dict
            rate = d.get("rate") or (d["n"] / d["elapsed"] if d.get("elapsed") else 0)
            total = d.get("total")
            d.update(
                done=format_bytes(d["n"]),
                size="?" if total is None else format_bytes(total),
                speed=f"{format_bytes(rate)}/s",
            )
            return d

    class Stages(TqdmCallback):  # type: ignore[misc]  # fsspec is untyped
        def set_size(self, size: int) -> None:
            if self.tqdm is not None:
                self.tqdm.reset(total=size)
            self.value = 0
            super().set_size(size)

    kwargs = {
        "desc": desc,
        "file": sys.stderr,
        "leave": False,
        "dynamic_ncols": True,
        "bar_format": "{desc}: {percentage:3.0f}%|{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}]",
    }
    callback: Callback = Stages(tqdm_kwargs=kwargs, tqdm_cls=BinaryBar)
    return callback


def progress(
    args: argparse.Namespace, desc: str, *, enabled: bool = True
) -> contextlib.AbstractContextManager[Callback]:
    """Bars only for a person watching: stderr is a terminal and ``--no-progress`` was not given."""
    return progress_bar(enabled and not getattr(args, "no_progress", True) and sys.stderr.isatty(), desc)


class Run:
    """One command's library call: the progress callback to pass it, and the time it has taken."""

    def __init__(self, workers: int | None = None) -> None:
        self.started = time.perf_counter()
        self.callback: Callback = DEFAULT_CALLBACK
        self.workers = workers

    @property
    def work(self) -> dict[str, Any]:
        """The keywords that say how the call works: ``max_workers`` (``--workers``) and ``callback``."""
        return {"max_workers": self.workers, "callback": self.callback}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def running(
    args: argparse.Namespace,
    desc: str,
    failed: Callable[[IntegrityError, float], None] | None = None,
    *,
    bar: bool = True,
) -> Iterator[Run]:
    """Time the call and show its progress bar; on an integrity failure, ``failed`` prints what was
    found (after the bar is gone) before the exception goes on to become the exit code."""
    run = Run(getattr(args, "workers", None))
    try:
        with progress(args, desc, enabled=bar) as run.callback:
            yield run
    except IntegrityError as error:
        if failed is not None:
            failed(error, run.elapsed())
        raise


def failure(url: str, tail: str) -> Callable[[IntegrityError, float], None]:
    """For :func:`running`: the ``FAILED`` line with ``tail`` and the problems."""
    return lambda error, _elapsed: print_failure(url, error.report, tail)


def print_failure(url: str, report: Report, tail: str = "") -> None:
    """``FAILED URL: 2 problems<tail>``, then one line per problem."""
    noun = "problem" if len(report.problems) == 1 else "problems"
    print(f"FAILED {url}: {len(report.problems)} {noun}{tail}", flush=True)
    for problem in report.problems:
        print(f"  {describe_problem(problem)}")


def print_written(head: str, manifest: Manifest, elapsed: float, *, key_path: str | None, last: str = "") -> None:
    """After ``seal`` or ``upload``: the work done, the manifest written, and the signature if any."""
    print(f"{head}: {format_work(len(manifest.files), manifest.total_bytes or 0, elapsed)}")
    print(f"wrote {MANIFEST_FILENAME}{last}: {manifest.algorithm}, {manifest.granularity} granularity")
    signed_note(key_path)


def signed_note(key_path: str | None) -> None:
    if key_path is not None:
        print(f"wrote {SIGNATURE_FILENAME}: the manifest's digests, signed with {key_path}")


def print_transferred(head: str, report: Report, elapsed: float, *, not_done: str) -> None:
    """After ``download`` or ``copy``: the work done, and the files left behind as not in the manifest."""
    print(f"{head}: {format_work(report.files_checked, report.bytes_checked, elapsed)}")
    if report.extra:
        print(extra_note(report.extra, not_done))


def print_verify_report(
    args: argparse.Namespace,
    report: Report,
    elapsed: float,
    error: IntegrityError | None = None,
    *,
    unchecked_bundle: bool = False,
) -> None:
    """JSON with ``--json`` (full digests), else a summary and one line per problem (short digests).
    ``unchecked_bundle``: ``--manifest`` is a model_signing bundle whose signature was not checked."""
    if args.json:
        data = {"url": args.url, **report.to_dict(), "elapsed_s": round(elapsed, 3), "quick": args.quick}
        data.update(attested=args.attested, manifest=args.manifest, signature_checked=args.public_key is not None)
        if error is not None:
            data["error"] = str(error)
        print_json(data)
        return
    how = "".join(verify_notes(args, report))
    if unchecked_bundle:
        how += f" (a model_signing bundle: its signature was NOT checked; --public-key checks {SIGNATURE_FILENAME})"
    if isinstance(error, SignatureError):
        print(f"FAILED {args.url}: {error.detail}", flush=True)
    elif report.ok:
        noun = "file" if report.files_checked == 1 else "files"
        work = (
            f"{report.files_checked} {noun}"
            if args.quick
            else format_work(report.files_checked, report.bytes_checked, elapsed)
        )
        print(f"verified {args.url}: {work}{how}")
    else:
        print_failure(args.url, report, how)
    extra_failed = any(p.kind == "extra" for p in report.problems)  # --strict, or a manifest that lists no files
    if report.extra and not extra_failed and not isinstance(error, SignatureError):
        print(extra_note(report.extra, "not checked; --strict rejects such files"))


def verify_notes(args: argparse.Namespace, report: Report) -> Iterator[str]:
    """What the summary line adds: how the files were checked, and against what."""
    if args.quick:
        yield "; names and sizes only, no content read (--quick)"
    if args.manifest is not None:
        yield f"; against {args.manifest}"
    if args.public_key is not None and report.ok:
        yield f"; signature checked with {args.public_key}"
    if args.attested and not args.quick and report.ok:
        attested = report.files_attested
        flag = "--attested crc" if args.attested == "crc" else "--attested"
        if attested == report.files_checked and attested:
            yield f"; every file attested by the store, none read ({flag}){attested_kinds(report)}"
        elif attested:
            noun = "file" if attested == 1 else "files"
            yield f"; {attested} {noun} attested by the store unread, the rest hashed ({flag}){attested_kinds(report)}"
        else:
            yield f"; no file attested by the store, all hashed ({flag})"


def attested_kinds(report: Report) -> str:
    """How many files each store checksum attested: ``": 3 by md5, 1 by sha256"``."""
    counts: dict[str, int] = {}
    for kind in report.attested_by.values():
        counts[kind] = counts.get(kind, 0) + 1
    return ": " + ", ".join(f"{n} by {kind}" for kind, n in sorted(counts.items())) if counts else ""


def print_status(root: str, found: Sequence[CheckpointStatus], *, as_json: bool, full: bool) -> None:
    """One aligned line per checkpoint (name, sealed, files, bytes, verdict), or a JSON list;
    ``checked`` says what an ``ok`` rests on: ``"sizes"`` (names and sizes) or ``"content"``."""
    if as_json:
        checked = "content" if full else "sizes"
        print_json([{**checkpoint.to_dict(), "checked": checked} for checkpoint in found])
        return
    if not found:
        print(f"no checkpoints under {root}", file=sys.stderr)
    names = [printable(checkpoint.name) for checkpoint in found]
    width = max(map(len, names), default=0)
    digits = max((len(str(checkpoint.files)) for checkpoint in found), default=0)
    for name, checkpoint in zip(names, found, strict=True):
        noun = "file" if checkpoint.files == 1 else "files"
        sealed = "sealed" if checkpoint.sealed else "unsealed"
        print(
            f"{name:<{width}}  {sealed:<8}  {checkpoint.files:>{digits}} {noun:<5}  "
            f"{format_bytes(checkpoint.bytes):>10}  {status_verdict(checkpoint, full=full)}"
        )


def print_latest(root: str, url: str | None, skipped: Sequence[dict[str, str]], *, quick: bool, **failure: Any) -> None:
    """``latest --json``: the URL found (``null`` when none verifies, with ``failure``'s
    ``exit_code`` and ``error``) and the checkpoints skipped before it, newest first, with why."""
    print_json({"root": root, "url": url, "ok": url is not None, "quick": quick, "skipped": list(skipped), **failure})


@contextlib.contextmanager
def skipped_checkpoints() -> Iterator[list[dict[str, str]]]:
    """The checkpoints the library skips while the block runs (``url``, ``reason``, ``error``),
    from its "skipping" records (:data:`integrity_fs.runs.SKIPPED`)."""
    found: list[dict[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            skipped = getattr(record, SKIPPED, None)
            if skipped is not None:
                found.append(skipped)

    logger, handler = logging.getLogger("integrity_fs"), Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def print_prune(root: str, result: PruneResult, *, keep_last: int, as_json: bool) -> None:
    """One aligned line per checkpoint (name, verdict, what became of it), then what was freed;
    or one JSON object (:meth:`PruneResult.to_dict` and the root)."""
    if as_json:
        print_json({"root": root, **result.to_dict()})
        return
    if not result.verdicts:
        print(f"no checkpoints under {root}", file=sys.stderr)
    names = {url: printable(url.rstrip("/").rsplit("/", 1)[-1]) for url in result.verdicts}
    width = max(map(len, names.values()), default=0)
    verdict_width = max(map(len, result.verdicts.values()), default=0)
    for url, verdict in result.verdicts.items():
        action = result.action(url)
        shown = "would delete" if action == "deleted" and result.dry_run else action
        print(f"{names[url]:<{width}}  {verdict:<{verdict_width}}  {shown}")
    verified = sum(verdict == "ok" for verdict in result.verdicts.values())
    count = len(result.deleted)
    noun = "checkpoint" if count == 1 else "checkpoints"
    if verified < keep_last:
        tail = f"{verified} verify, fewer than --keep-last {keep_last}: nothing deleted"
    elif result.dry_run:
        tail = f"dry run: would delete {count} {noun}, freeing {format_bytes(result.bytes_freed)}; nothing deleted"
    else:
        tail = f"deleted {count} {noun}, freed {format_bytes(result.bytes_freed)}"
    print(f"kept {len(result.kept)}, left {len(result.left)}; {tail}")


def status_verdict(checkpoint: CheckpointStatus, *, full: bool) -> str:
    """The verdict in words: ``sizes ok`` when only names and sizes were compared (as ``verify
    --quick`` says), ``ok`` when every byte was hashed."""
    if checkpoint.verdict == "ok":
        return "ok" if full else "sizes ok"
    if checkpoint.verdict == "damaged" and checkpoint.detail.startswith(BAD_SIGNATURE):
        return f"damaged: {printable(checkpoint.detail)}"
    if checkpoint.verdict == "damaged" and checkpoint.problems:
        return f"damaged: {name_problems(checkpoint.problems, limit=3)}"
    if checkpoint.verdict == "invalid":
        return f"invalid: {printable(checkpoint.detail)}"
    if checkpoint.verdict == "changing":
        return "changing: a file changed while it was read; run again once writers are done"
    return checkpoint.verdict


def print_manifest(url: str, manifest: Manifest, *, as_json: bool) -> None:
    """``show``: what the manifest records, and its largest files."""
    sizes = manifest.sizes
    largest = manifest.largest(LARGEST_SHOWN)
    if as_json:
        print_json(
            {
                "url": url,
                "version": manifest.version,
                "algorithm": manifest.algorithm,
                "granularity": manifest.granularity,
                "chunk_size": manifest.chunk_size,
                "file_count": len(manifest.files),
                "total_bytes": manifest.total_bytes,
                "largest": [{"path": name, "size": size} for name, size in largest],
                "files": {
                    name: {"digest": digest, "size": None if sizes is None else sizes[name]}
                    for name, digest in manifest.files.items()
                },
            }
        )
        return
    granularity = manifest.granularity
    if manifest.chunk_size is not None:
        granularity += f", chunks of {format_bytes(manifest.chunk_size)} = {manifest.chunk_size} bytes"
    total = manifest.total_bytes
    total_text = "unknown: no sizes recorded" if total is None else f"{format_bytes(total)} = {total} bytes"
    print(f"manifest of {url}")
    print(f"  version      {manifest.version}")
    print(f"  algorithm    {manifest.algorithm}")
    print(f"  granularity  {granularity}")
    print(f"  files        {len(manifest.files)}")
    print(f"  total size   {total_text}")
    if largest:
        print("largest files:")
        for name, size in largest:
            print(f"  {format_bytes(size):>10}  {printable(name)}")


class AboveTheBar(logging.StreamHandler):  # type: ignore[type-arg]  # StreamHandler is generic in typeshed only
    """Each line on its own line of the terminal, while a progress bar is drawn too: written
    through ``tqdm.write``, which clears the bar, writes the line and draws the bar again below it
    (a plain write would land at the end of the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _SHOWN:
            super().emit(record)
            return
        try:
            import tqdm  # a bar is shown, so tqdm is there

            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


#: A digest a problem quotes (``expected 5e0a…, found 9b1c…``), to be shortened as FAILED lines do.
_QUOTED_DIGEST = re.compile(r"\b(expected|found) ([0-9a-f]{17,})\b")


class OneLine(logging.Formatter):
    """``integrity-fs: WARNING: …`` on one line: whatever a message quotes (a name, a backend's
    error) is escaped, so no record can print a line of its own (a fake ``verified``). The digests
    a problem quotes are shortened, as on FAILED lines (``--json`` keeps them whole)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = printable(super().formatMessage(record))
        return _QUOTED_DIGEST.sub(lambda m: f"{m[1]} {short_digest(m[2])}", line)


@contextlib.contextmanager
def cli_logging(prog: str, *, debug: bool) -> Iterator[None]:
    """integrity_fs's own warnings (a skipped symlink, a retried read) on this call's stderr; all
    of them with ``--debug``. Only for the call: a program that runs ``main()`` in-process gets its
    logging back as it was (its handlers see integrity_fs's records again).

    Without ``--debug``, what other packages log or warn (gcsfs logs a 50-line traceback for a
    request it gives up on, google-auth warns about credentials) stays off stderr: the error's two
    lines say what failed, and ``--debug`` shows the rest."""
    logger = logging.getLogger("integrity_fs")
    handler = AboveTheBar(sys.stderr)
    handler.setFormatter(OneLine(f"{prog}: %(levelname)s: %(message)s"))
    before = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    quiet = logging.NullHandler()  # a handler on the root: logging's last resort (stderr) stays unused
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
