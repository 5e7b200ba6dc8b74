"""``integrity-fs``: parse the arguments, call one library function, print its result, map its
exception to an exit code (0 ok, 1 integrity failure, 2 usage error or refusal, 3 manifest
missing or invalid, 4 storage or I/O error, 130 interrupted); under torchrun, see :func:`launched`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import integrity_fs

from .. import MANIFEST_FILENAME, __version__, runs, storage
from ..collectives import MODES, agree, check_same, gather, group_of, rank, torch_distributed
from ..hashing import ALGORITHMS
from ..options import MANIFEST_FORMATS, SealOptions, VerifyOptions
from ..report import shortened
from .output import (
    HINTS,
    PROG,
    UsageError,
    cli_logging,
    extra_note,
    format_bytes,
    format_work,
    plural,
    print_failure,
    print_json,
    remember_typed,
    report_error,
    running,
    tidy,
)

COLLECTIVE = ("seal", "verify", "latest", "prune", "status")


def storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """One ``-o key=value``: the dotted key's parts, and the value parsed as JSON where it parses."""
    key, sep, raw = text.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no '=': write -o key=value, e.g. -o anon=true")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty key or key part: write -o key=value or -o a.b=value")
    try:
        return parts, json.loads(raw)
    except (ValueError, RecursionError):
        return parts, raw


def storage_options(*lists: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """Nested fsspec storage options from ``-o`` pairs (dotted keys make nested dicts)."""
    options: dict[str, Any] = {}
    for parts, value in (pair for pairs in lists for pair in pairs):
        node = options
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"-o {'.'.join(parts[: depth + 1])} is set to a value and also used as a group")
        if isinstance(node.get(parts[-1]), dict):
            raise UsageError(f"-o {'.'.join(parts)} is a group of options and cannot also be set to a value")
        node[parts[-1]] = value
        if parts[-1] == "endpoint_url":  # else gcsfs probes each bucket over gRPC first (a minute on an emulator)
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return options


def positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer of at least 1")
    return int(text)


def size(text: str) -> int:
    """Bytes, or a unit: ``64MiB`` = ``64Mi`` = ``64M`` = 64 * 2^20 (as dd reads them), ``64MB`` = 64 * 10^6."""
    match = re.fullmatch(r"(\d+)\s*(?:([kmgtp])(i?))?(b?)", text.strip(), re.IGNORECASE)
    if not match or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 67108864, 64MiB (binary) or 64MB (decimal)")
    power = "kmgtp".index(match[2].lower()) + 1 if match[2] else 0
    return int(match[1]) * int((1000 if match[4] and not match[3] else 1024) ** power)


FLAG: dict[str, Any] = {"action": "store_true"}
EACH: dict[str, Any] = {"action": "append", "default": [], "type": storage_option, "metavar": "KEY=VALUE"}
#: Every argument, once: its help and its other argparse keywords (positionals show their name in capitals).
ARGUMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "url": ("checkpoint directory: local path or fsspec URL", {}),
    "root": ("a run's directory, one directory per checkpoint: local path or fsspec URL", {}),
    "src": ("the checkpoint to copy: local path (upload) or fsspec URL", {}),
    "dst": ("destination: fsspec URL or local path", {}),
    "dest": ("new local directory: absent, or empty", {}),
    "--quick": ("compare names and sizes only; read no content", FLAG),
    "--full": ("hash every file (default: names and sizes only)", FLAG),
    "--strict": ("files not in the manifest are problems too", FLAG),
    "--attested": ("S3, GCS: a file whose store checksum equals its digest is confirmed unread", FLAG),
    "--json": ("print the result as JSON on stdout", FLAG),
    "--force": ("replace a checkpoint sealed at the destination (only with content you trust)", FLAG),
    "--dry-run": ("delete nothing: print what a real run deletes", FLAG),
    "--unsealed": ("delete unsealed checkpoints older than the oldest kept too", FLAG),
    "--keep-last": ("keep the N newest checkpoints that verify", {"type": positive, "metavar": "N", "required": True}),
    "--pattern": ("checkpoint names, {step} for the step, e.g. step_{step} (default: inferred)", {"metavar": "P"}),
    "--public-key": ("EC public key (PEM): model.sig must verify with it", {"metavar": "KEY.pub"}),
    "--key": ("EC private key (PEM, unencrypted; P-256, P-384 or P-521)", {"metavar": "KEY.pem", "required": True}),
    "--sign-key": ("EC private key (PEM): also write model.sig, a model_signing signature", {"metavar": "KEY.pem"}),
    "--algorithm": ("hash algorithm (default sha256, the only one seed-era verifiers read)", {"choices": ALGORITHMS}),
    "--granularity": ("hash whole files (default), or chunks (with --chunk-size)", {"choices": ("file", "chunk")}),
    "--chunk-size": ("chunk length (default 64MiB): 64MiB = 64Mi = 64M; 64MB = 64*10^6", {"type": size}),
    "--manifest": ("verify against this manifest (sha256sum, b3sum, integrity.json, model.sig)", {"metavar": "FILE"}),
    "--manifest-format": (
        "how to read --manifest (default: detected)",
        {"choices": MANIFEST_FORMATS, "default": "auto"},
    ),
    "--format": ("what to write", {"choices": ("sha256sum", "b3sum", "megatron", "seed"), "required": True}),
    "--mode": ("under torchrun: ranks share the bytes, or rank 0 reads", {"choices": MODES, "default": "sharded"}),
    "--src-o": ("storage option KEY=VALUE for SRC only, as -o", EACH),
    "--dst-o": ("storage option KEY=VALUE for DST only, as -o", EACH),
}
SEALING = "--algorithm --granularity --chunk-size --sign-key --force"
CHECKS = "--public-key --json --mode"
VERDICTS = (
    "ok (hashed), sizes ok (names and sizes only, the default), damaged, unsealed, invalid (a manifest\n"
    "this installation cannot read), changing (written to while read), deleting (a prune began deleting\n"
    "it), other (not one of the run's checkpoints), leftover / staging (a dead / live transfer's staging)"
)
#: Each command: its arguments, and what it does.
COMMANDS: dict[str, tuple[str, str]] = {
    "seal": (f"url {SEALING} --mode", "hash a checkpoint directory and write its manifest"),
    "sign": ("url --key", "verify a sealed checkpoint, then sign its digests"),
    "verify": (
        f"url --quick --strict --attested --manifest --manifest-format {CHECKS}",
        "check a checkpoint against its manifest",
    ),
    "show": ("url --json", "summarise a checkpoint's manifest"),
    "export": ("url --format", "write a checkpoint's manifest in another format, on stdout"),
    "status": (f"root --full --pattern {CHECKS}", "list a run's checkpoints, with their verdicts"),
    "latest": (f"root --quick --pattern {CHECKS}", "print the newest checkpoint that verifies"),
    "prune": (
        f"root --keep-last --dry-run --unsealed --quick --attested --pattern {CHECKS}",
        "delete old checkpoints, keeping the N newest that verify",
    ),
    "download": ("url dest --strict", "copy a sealed checkpoint to a local directory, verifying it"),
    "upload": (f"src url {SEALING}", "copy a local checkpoint to a URL, checking or sealing it on the way"),
    "copy": ("src dst --src-o --dst-o --force", "copy a sealed checkpoint between any two URLs, verifying it"),
    "demo": ("", "an end-to-end run on a local S3 server: seal, corrupt, reject, download"),
}
#: More about a command, for its --help.
ABOUT = {
    "seal": "A sealed checkpoint is refused (exit 2) unless --force: sealing again accepts what the files hold now.",
    "export": "Whole-file digests only: a chunk manifest or another algorithm is refused (exit 2).",
    "status": f"Verdicts: {VERDICTS}.\nExit 0 when the listing worked, whatever the verdicts; 4 on a storage error.",
    "latest": "The others are skipped with a WARNING; when none verifies, nothing on stdout, exit 1.",
    "prune": "Deletes only checkpoints older than every kept one, by step and by when they were sealed.\n"
    "Fewer than N verify, or a storage error: nothing is deleted.",
}
EXAMPLES = {
    "seal": "s3://bucket/run/step_1000 --chunk-size 64MiB",
    "sign": "./step_1000 --key key.pem",
    "verify": "s3://bucket/run/step_1000 --quick",
    "show": "./step_1000 --json",
    "export": "./step_1000 --format sha256sum > SHA256SUMS",
    "status": "s3://bucket/run --full",
    "latest": './run   # CKPT="$(integrity-fs latest ./run)"',
    "prune": "s3://bucket/run --keep-last 3 --dry-run",
    "download": "s3://bucket/run/step_1000 ./step_1000",
    "upload": "./step_1000 s3://bucket/run/step_1000",
    "copy": "s3://bucket/run/step_1000 gs://other/run/step_1000",
}
#: Common options a command accepts (a script may pass them to every command) but has no use for.
HIDDEN = {"show": ("--workers", "--no-progress"), "export": ("--workers", "--no-progress"), "demo": ("-o",)}
EPILOG = f"""examples:
  {PROG} seal ./checkpoints/step_1000
  {PROG} verify s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000
  {PROG} prune s3://bucket/run --keep-last 3

exit codes:
  0  verified / ok
  1  integrity failure: content differs from the manifest, or a bad signature; latest: none verifies
  2  usage error: bad arguments or -o options; a refusal to replace existing data
  3  manifest missing or invalid (or an unsupported algorithm or granularity)
  4  storage or I/O error: no such checkpoint, network, credentials, permission, disk full
  130  interrupted (Ctrl-C)
"""


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting: argument errors get the usual two lines (and JSON)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see `{self.prog} --help`")


def common(parser: argparse.ArgumentParser, *, top: bool, hidden: Sequence[str] = ()) -> None:
    """Options taken before or after the command (after it they win; ``-o`` adds up)."""
    helps = {
        "-o": "fsspec storage option KEY=VALUE, repeatable; dotted keys nest, values are JSON where they parse",
        "--workers": "files or chunks read at once (default: CPUs locally, 16 remote)",
        "--no-progress": "no progress bar (there is none when stderr is not a terminal)",
        "--debug": "debug logging, and tracebacks",
    }
    shown = {name: argparse.SUPPRESS if name in hidden else text for name, text in helps.items()}
    unset: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}  # after the command: only what is given
    group = parser.add_argument_group("common options")
    group.add_argument("-o", "--option", dest="o_top" if top else "o_cmd", help=shown["-o"], **EACH)
    group.add_argument("--workers", type=positive, metavar="N", help=shown["--workers"], **unset)
    for flag in ("--no-progress", "--debug"):
        group.add_argument(flag, action="store_true", help=shown[flag], **unset)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    about = "Seal ML checkpoints with manifests and verify them, on local disks, S3, GCS and any fsspec filesystem."
    parser = Parser(prog=PROG, formatter_class=raw, description=about, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (arguments, summary) in COMMANDS.items():
        epilog, about = f"example:\n  {PROG} {name} {EXAMPLES.get(name, '')}".rstrip(), ABOUT.get(name, "")
        c = sub.add_parser(name, help=summary, description=f"{summary}.\n{about}", epilog=epilog, formatter_class=raw)
        either = c.add_mutually_exclusive_group() if "--attested" in arguments else c  # with --quick: exit 2
        for arg in arguments.split():
            text, kw = ARGUMENTS[arg]
            kw = kw if arg[0] == "-" else {"metavar": arg.upper(), **kw}
            (either if arg in ("--quick", "--attested") else c).add_argument(arg, help=text, **kw)
        common(c, top=False, hidden=HIDDEN.get(name, ()))
    return parser


Args = Any  # the parsed arguments (argparse.Namespace), with ``group`` (torchrun's, or None) and ``printed_json``


def options(args: Args, *side: str) -> dict[str, Any]:
    """The storage options of ``-o`` (before and after the command) and of ``side`` (``--src-o``)."""
    return storage_options(args.o_top, args.o_cmd, *(getattr(args, s) for s in side))


def agreed(args: Args, step: Any) -> Any:
    """``step()``; under torchrun on every rank, and a failure on any rank raised on all."""
    return step() if args.group is None else agree(args.group, step)


def keys(args: Args) -> None:
    """``args.private`` and ``args.public``: the keys given (or None), loaded before any checkpoint is read."""
    private, public = getattr(args, "sign_key", getattr(args, "key", None)), getattr(args, "public_key", None)
    try:
        args.private = None if private is None else agreed(args, lambda: SealOptions(private_key=private).private_key)
        args.public = None if public is None else agreed(args, lambda: VerifyOptions(public_key=public).public_key)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(str(exc), HINTS["key"]) from None


def call(args: Args, verb: str, url: str, run: Any, **kw: Any) -> Any:
    """``verb`` of the library on ``url`` with the storage options, workers and progress bar; its
    collective in :mod:`integrity_fs.distributed` under torchrun; checks take the public key."""
    kw.update(storage_options=options(args), **run.kw)
    if verb != "seal":
        kw["public_key"] = args.public
    if args.group is not None:
        from .. import distributed

        return getattr(distributed, verb)(url, group=args.group, mode=args.mode, **kw)
    if verb == "status":
        pattern, where = kw.pop("pattern"), storage.resolve(url, kw.pop("storage_options"))
        return runs.status(*where, pattern, VerifyOptions.of(**kw))
    return getattr(integrity_fs, verb)(url, **kw)


def sealing(args: Args) -> dict[str, Any]:
    """The seal options given (upload sends a sealed source's manifest unchanged: none is implied)."""
    granularity = args.granularity or ("chunk" if args.chunk_size else None)
    if granularity == "file" and args.chunk_size:
        hint = "leave out --granularity file to hash in chunks of that size, or --chunk-size to hash whole files"
        raise UsageError("--chunk-size applies only to --granularity chunk", hint)
    given = {"algorithm": args.algorithm, "granularity": granularity, "chunk_size": args.chunk_size}
    return {name: value for name, value in given.items() if value is not None}


def print_written(head: str, manifest: Any, elapsed: float, key_path: str | None) -> None:
    print(f"{tidy(head)}: {format_work(len(manifest.files), manifest.total_bytes or 0, elapsed)}")
    if not head.startswith("verified"):  # sign writes model.sig alone
        print(f"wrote {MANIFEST_FILENAME}: {manifest.algorithm}, {manifest.granularity} granularity")
    if key_path is not None:
        print(f"wrote model.sig: the manifest's digests, signed with {tidy(key_path)}")


@contextlib.contextmanager
def failing(url: str, tail: str) -> Iterator[None]:
    """On an integrity failure, ``FAILED URL: N problems<tail>`` and the problems first."""
    try:
        yield
    except integrity_fs.IntegrityError as error:
        print_failure(url, error.report.problems, tail)
        raise


def seal(args: Args) -> int:
    given = sealing(args)
    with running(args, "seal") as run:
        manifest = call(args, "seal", args.url, run, overwrite=args.force, private_key=args.private, **given)
    print_written(f"sealed {args.url}", manifest, run.elapsed(), args.sign_key)
    return 0


def sign(args: Args) -> int:
    with running(args, "sign") as run, failing(args.url, "; not signed"):
        manifest = integrity_fs.sign(args.url, private_key=args.private, storage_options=options(args), **run.kw)
    print_written(f"verified {args.url}", manifest, run.elapsed(), args.key)
    return 0


def verify(args: Args) -> int:
    checks = dict(quick=args.quick, strict=args.strict, attested=args.attested, manifest=args.manifest)
    checks["manifest_format"] = args.manifest_format
    with running(args, "verify") as run:
        try:
            report = call(args, "verify", args.url, run, **checks)
        except integrity_fs.IntegrityError as error:
            print_report(args, error.report, run.elapsed(), error)
            raise
    print_report(args, report, run.elapsed())
    return 0


def print_report(args: Args, report: Any, elapsed: float, error: Exception | None = None) -> None:
    """JSON with --json (whole digests), else a summary and one line per problem."""
    if args.json:
        args.printed_json = True
        data = {"url": args.url, **report.to_dict(), "elapsed_s": round(elapsed, 3), "quick": args.quick}
        data.update(attested=args.attested, manifest=args.manifest, signature_checked=args.public_key is not None)
        return print_json({**data, "error": tidy(error)} if error is not None else data)
    notes = "; names and sizes only, no content read (--quick)" if args.quick else ""
    notes += f"; against {tidy(args.manifest)}" if args.manifest else ""
    if report.ok and args.public_key:
        notes += f"; signature checked with {tidy(args.public_key)}"
    elif args.manifest and (args.manifest_format == "model_signing" or os.path.basename(args.manifest) == "model.sig"):
        notes += " (a model_signing bundle: its signature was NOT checked; --public-key checks it)"
    if report.ok and args.attested:
        kinds, n = sorted(report.attested_by.values()), report.files_attested
        by = ": " + ", ".join(f"{kinds.count(k)} by {k}" for k in sorted(set(kinds))) if kinds else ""
        how = f"{plural(n, 'file')} attested by the store unread, the rest hashed"
        if n in (0, report.files_checked):
            how = "every file attested by the store, none read" if n else "no file attested by the store, all hashed"
        notes += f"; {how} (--attested){by}"
    if isinstance(error, integrity_fs.SignatureError):
        print(f"FAILED {tidy(args.url)}: {tidy(error.detail)}", flush=True)
    elif report.ok:
        n = report.files_checked
        work = plural(n, "file") if args.quick else format_work(n, report.bytes_checked, elapsed)
        print(f"verified {tidy(args.url)}: {work}{notes}")
    else:
        print_failure(args.url, report.problems, notes)
    extra_failed = any(p.kind == "extra" for p in report.problems) or isinstance(error, integrity_fs.SignatureError)
    if report.extra and not extra_failed:
        print(extra_note(report.extra, "not checked; --strict rejects such files"))


def show(args: Args) -> int:
    manifest = integrity_fs.read_manifest(args.url, storage_options=options(args))
    sizes, total, chunk = manifest.sizes or {}, manifest.total_bytes, manifest.chunk_size
    largest = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:5]
    if args.json:
        summary = {k: getattr(manifest, k) for k in ("version", "algorithm", "granularity", "chunk_size")}
        files = {name: {"digest": digest, "size": sizes.get(name)} for name, digest in manifest.files.items()}
        top = [{"path": name, "size": n} for name, n in largest]
        summary.update(file_count=len(files), total_bytes=total, largest=top, files=files)
        print_json({"url": args.url, **summary})
        return 0
    print(f"manifest of {tidy(args.url)}\n  version      {manifest.version}\n  algorithm    {manifest.algorithm}")
    each = f", chunks of {format_bytes(chunk)} = {chunk} bytes" if chunk else ""
    print(f"  granularity  {manifest.granularity}{each}")
    held = "unknown: no sizes recorded" if total is None else f"{format_bytes(total)} = {total} bytes"
    print(f"  files        {len(manifest.files)}\n  total size   {held}")
    print("largest files:" * bool(largest) + "".join(f"\n  {format_bytes(n):>10}  {tidy(name)}" for name, n in largest))
    return 0


def export(args: Args) -> int:
    from .. import formats

    data = formats.dump(integrity_fs.read_manifest(args.url, storage_options=options(args)), args.format)
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    out.write(data) if out is not None else sys.stdout.write(data.decode("utf-8"))
    sys.stdout.flush()
    return 0


def status(args: Args) -> int:
    with running(args, "status", bar=args.full) as run:
        rows = call(args, "status", args.root, run, quick=not args.full, pattern=args.pattern)
    if args.json:
        print_json(rows)
    names = [tidy(row["name"]) for row in rows]
    width = max(map(len, names), default=0)
    digits = max((len(str(row["files"])) for row in rows if row["files"] is not None), default=0)
    for name, row in zip(names, [] if args.json else rows, strict=False):
        sealed = {True: "sealed", False: "unsealed", None: ""}[row["sealed"]]
        files = "" if row["files"] is None else f"{row['files']:>{digits}} {'file' if row['files'] == 1 else 'files'}"
        nbytes = "" if row["bytes"] is None else format_bytes(row["bytes"])
        verdict, problems = row["verdict"], row["problems"]
        if verdict == "changing":
            verdict += ": a file changed while it was read; run again once writers are done"
        elif problems and verdict == "damaged":  # each file as the error lines name it: model.bin (mismatch)
            named = [re.sub(r"^(.*): (mismatch|missing|size|extra)\b.*$", r"\1 (\2)", p) for p in problems]
            verdict += f": {tidy(shortened(named, 3))}"
        elif problems:
            verdict += f": {tidy(problems[0])}"
        print(f"{name:<{width}}  {sealed:<8}  {files:<{digits + 6}}  {nbytes:>10}  {verdict}")
    if not rows and not args.json:
        print(f"no checkpoints under {tidy(args.root)}", file=sys.stderr)
    if not any(row["sealed"] for row in rows) and (note := root_is_a_checkpoint(args)):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    return 0


def root_is_a_checkpoint(args: Args) -> str | None:
    """A hint when ROOT holds a manifest: a checkpoint given where its run's directory belongs."""
    try:
        integrity_fs.read_manifest(args.root, storage_options=options(args))
    except (OSError, ValueError):
        return None
    return HINTS["checkpoint"].format(root=tidy(args.root))


def latest(args: Args) -> int:
    # The library answers None for a root that is not there (a run's first resume must not crash);
    # from a shell that is most often a typo: exit 4 with a hint about the path, not "none verifies".
    agreed(args, lambda: storage.check_root(*storage.resolve(args.root, options(args))))
    with running(args, "latest", bar=not args.quick) as run:
        found = call(args, "latest_verified", args.root, run, quick=args.quick, pattern=args.pattern)
    out = {"root": args.root, "url": found and found[0], "ok": bool(found), "quick": args.quick}
    if found is None:
        message, hint = f"no checkpoint under {args.root} verifies", root_is_a_checkpoint(args)
        if not integrity_fs.find_checkpoints(args.root, pattern=args.pattern, storage_options=options(args)):
            message += ": it holds no checkpoint directory"
            hint = hint or HINTS["root"]
        if args.json:
            args.printed_json = True
            print_json({**out, "exit_code": 1, "error": tidy(message)})
        raise UsageError(message, hint or HINTS["skipped"], code=1)
    print_json({**out, "report": found[1].to_dict()}) if args.json else print(tidy(found[0]))
    return 0


def prune(args: Args) -> int:
    with running(args, "prune", bar=not args.quick) as run:
        given = dict(keep_last=args.keep_last, pattern=args.pattern, unsealed=args.unsealed, dry_run=args.dry_run)
        result = call(args, "prune", args.root, run, quick=args.quick, attested=args.attested, **given)
    if args.json:
        print_json({"root": args.root, **result.to_dict()})
        return 0
    names = {url: tidy(url.rstrip("/").rsplit("/", 1)[-1]) for url in result.verdicts}
    width, verdict_width = max(map(len, names.values()), default=0), max(map(len, result.verdicts.values()), default=0)
    for url, verdict in result.verdicts.items():
        deleted = "would delete" if result.dry_run else "deleted"
        action = "kept" if url in result.kept else deleted if url in result.deleted else "left"
        print(f"{names[url]:<{width}}  {verdict:<{verdict_width}}  {action}")
    gone, freed = plural(len(result.deleted), "checkpoint"), format_bytes(result.bytes_freed)
    tail = f"deleted {gone}, freed {freed}"
    if len(result.kept) < args.keep_last and not result.deleted:
        tail = f"{len(result.kept)} verify, fewer than --keep-last {args.keep_last}: nothing deleted"
    elif result.dry_run:
        tail = f"dry run: would delete {gone}, freeing {freed}; nothing deleted"
    print(f"kept {len(result.kept)}, left {len(result.left)}; {tail}")
    return 0


def transferred(what: str, src: str, dst: str, report: Any, elapsed: float, left: str) -> int:
    work = format_work(report.files_checked, report.bytes_checked, elapsed)
    print(f"{what} and verified {tidy(src)} -> {tidy(dst)}: {work}")
    if report.extra:
        print(extra_note(report.extra, left))
    return 0


def download(args: Args) -> int:
    failed = failing(args.url, f"; nothing was written to {args.dest}")
    with running(args, "download", finishing="finalising") as run, failed:
        report = integrity_fs.download(args.url, args.dest, storage_options=options(args), strict=args.strict, **run.kw)
    return transferred("downloaded", args.url, args.dest, report, run.elapsed(), "not downloaded")


def upload(args: Args) -> int:
    given = sealing(args)
    # What the bar says once every byte is sent: the objects still to finish.
    n = sum(len(files) for _, _, files in os.walk(args.src)) - os.path.isfile(os.path.join(args.src, MANIFEST_FILENAME))
    with running(args, "upload", finishing=f"finalising {plural(n, 'object')}") as run:
        where = {"storage_options": options(args), "overwrite": args.force, "private_key": args.private}
        manifest = integrity_fs.upload(args.src, args.url, **where, **given, **run.kw)
    print_written(f"uploaded {args.src} -> {args.url}", manifest, run.elapsed(), args.sign_key)
    return 0


def copy(args: Args) -> int:
    where: dict[str, Any] = {"src_options": options(args, "src_o"), "dst_options": options(args, "dst_o")}
    with (
        running(args, "copy", finishing="finalising") as run,
        failing(args.src, f"; no manifest was written at {args.dst}"),
    ):
        report = integrity_fs.copy(args.src, args.dst, **where, overwrite=args.force, **run.kw)
    return transferred("copied", args.src, args.dst, report, run.elapsed(), "not copied")


def demo(args: Args) -> int:
    from . import demo

    return 0 if demo.run(args) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world = os.environ.get("WORLD_SIZE", "1")
    return launched(argv) if world.isdigit() and int(world) > 1 else run(argv, None)


def run(argv: list[str], group: Any) -> int:
    """Parse and run one command: its exception becomes the exit code and the two stderr lines."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return report_error(error, None, as_json="--json" in argv)
    except SystemExit as exit_:  # --help, --version: printed
        return int(exit_.code or 0)
    args.group, args.printed_json = (group if args.command in COLLECTIVE else None), False
    remember_typed(*(getattr(args, n, None) for n in ("url", "root", "src", "dst", "dest")))
    try:
        with cli_logging(debug=args.debug):
            keys(args)
            code: int = globals()[args.command](args)
        return code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 4
    except Exception as error:
        return report_error(error, args, as_json=getattr(args, "json", False), debug=args.debug)


def launched(argv: list[str]) -> int:
    """One command under torchrun: join the group, agree on the whole command line, then run it (a
    collective on every rank, another command on rank 0 alone); rank 0 alone prints, and every rank
    exits with the same code. Without torch or torchrun's environment no rank can join a group (nor
    wait in one): a collective command fails, another runs on each rank alone."""
    collective = next((w for w in argv if w in COMMANDS), None) in COLLECTIVE
    try:
        dist = torch_distributed()
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo")  # from torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        me = rank(group := group_of(None))
    except Exception as error:
        return report_error(error, None, as_json="--json" in argv) if collective else run(argv, None)
    sink = io.StringIO() if me else None  # ranks other than 0 print nothing
    try:
        with contextlib.redirect_stdout(sink or sys.stdout), contextlib.redirect_stderr(sink or sys.stderr):
            try:
                agree(group, lambda: check_same(group, argv, "the command line"))
            except ValueError as error:  # on every rank alike
                return report_error(
                    UsageError(str(error), "give every rank the same command line"), None, as_json="--json" in argv
                )
            code = run(argv, group) if collective or me == 0 else 0
        return next((c for c in gather(group, code) if c), 0)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
