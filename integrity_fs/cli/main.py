"""``integrity-fs``: parse the arguments, call one library function, print its result, map its
exception to an exit code (0 ok, 1 integrity failure, 2 usage error or refusal, 3 manifest
missing or invalid, 4 storage or I/O error, 130 interrupted).

Under torchrun (``WORLD_SIZE`` > 1) ``seal``, ``verify``, ``latest``, ``prune`` and ``status`` run
as collectives of :mod:`integrity_fs.distributed`: the ranks join a gloo group (unless one exists),
agree on the whole command line first, rank 0 alone prints, and every rank exits with one code.
"""

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

from .. import MANIFEST_FILENAME
from ..hashing import ALGORITHMS
from ..options import MANIFEST_FORMATS, SealOptions, VerifyOptions
from .output import (
    PROG,
    KeyFileError,
    NoneVerified,
    UsageError,
    cli_logging,
    extra_note,
    format_bytes,
    format_work,
    print_failure,
    print_json,
    remember_typed,
    report_error,
    running,
    skipped_checkpoints,
    tidy,
)

COLLECTIVE = ("seal", "verify", "latest", "prune", "status")
VERDICTS = (
    "ok (every byte hashed), sizes ok (names and sizes only: the default), damaged, unsealed, invalid (a manifest "
    "this installation cannot read), changing (a file changed while it was read), deleting (a prune was deleting "
    "it), other (a folder that is not one of the run's checkpoints), leftover / staging (the staging folder of a "
    "dead / live forced transfer)"
)

# ----------------------------------------------------------------------------- argument values


def storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """One ``-o key=value``: the dotted key's parts, and the value parsed as JSON where it parses."""
    key, sep, raw = text.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no '=': write -o key=value, e.g. -o anon=true")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty key or key part: write -o key=value or -o outer.inner=value")
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
        if parts[-1] == "endpoint_url":  # gcsfs probes each bucket over gRPC first (a minute against an emulator)
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return options


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


_SIZE = re.compile(r"(\d+)\s*(?:([kmgtp])(i?))?(b?)", re.IGNORECASE)


def size(text: str) -> int:
    """Bytes, or a unit: ``64MiB`` = ``64Mi`` = ``64M`` = 64 × 2^20 (as dd reads them), ``64MB`` = 64 × 10^6."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least 1 byte like 67108864, 64MiB (binary) or 64MB (decimal)")
    power = "kmgtp".index(match[2].lower()) + 1 if match[2] else 0
    return int(match[1]) * (1000 if match[4] and not match[3] else 1024) ** power


# ----------------------------------------------------------------------------- the parser


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting: argument errors get the usual two lines (and JSON)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see `{self.prog} --help`")


def common(parser: argparse.ArgumentParser, *, top: bool, hidden: Sequence[str] = ()) -> None:
    """Options taken before or after the command (after it they win; ``-o`` adds up). ``hidden``:
    accepted, so that a script may pass them to every command, but of no use to this one."""
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    shown = lambda name, text: argparse.SUPPRESS if name in hidden else text  # noqa: E731
    group = parser.add_argument_group("common options")
    group.add_argument("-o", "--option", type=storage_option, action="append", default=[], dest="o_top" if top else "o_cmd", metavar="KEY=VALUE",
                       help=shown("-o", "fsspec storage option, repeatable; dotted keys nest, values are JSON where they parse (-o anon=true -o client_kwargs.endpoint_url=http://127.0.0.1:9000)"))
    group.add_argument("--workers", type=positive, metavar="N", default=default(None), help=shown("--workers", "files or chunks read at once (default: CPUs locally, 16 remote)"))
    group.add_argument("--no-progress", action="store_true", default=default(False), help=shown("--no-progress", "no progress bar (there is none when stderr is not a terminal)"))
    group.add_argument("--debug", action="store_true", default=default(False), help="debug logging, and a traceback with any error")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog=PROG, formatter_class=raw, description="Seal ML checkpoints with manifests and verify them, on local disks, S3, GCS and any fsspec filesystem.", epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {integrity_fs.__version__}")
    common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, run: Any, summary: str, text: str, examples: Sequence[str], hidden: Sequence[str] = ()) -> argparse.ArgumentParser:
        epilog = "examples:\n" + "".join(f"  {PROG} {name} {line}\n" for line in examples)
        c = sub.add_parser(name, help=summary, description=f"{summary}.\n\n{text}", epilog=epilog, formatter_class=raw)
        c.set_defaults(run=run)
        common(c, top=False, hidden=hidden)
        return c

    def arg(c: argparse.ArgumentParser, *names: str, **kw: Any) -> None:
        c.add_argument(*names, **kw)

    flag = lambda c, name, text: arg(c, name, action="store_true", help=text)  # noqa: E731
    url = lambda c, name="url", text="checkpoint directory: local path or fsspec URL": arg(c, name, metavar=name.upper(), help=text)  # noqa: E731
    mode = lambda c: arg(c, "--mode", choices=("sharded", "rank0"), default="sharded", help="under torchrun: split the bytes over the ranks (sharded), or rank 0 reads them all (rank0)")  # noqa: E731
    public = lambda c, what: arg(c, "--public-key", metavar="KEY.pub", help=f"EC public key (PEM): model.sig must verify with it; {what}")  # noqa: E731
    pattern = lambda c: arg(c, "--pattern", metavar="P", help="the checkpoints' names with {step} for the step, e.g. 'step_{step}' (default: inferred when certain)")  # noqa: E731
    root = lambda c: url(c, "root", "a run's directory, holding one directory per checkpoint: local path or fsspec URL")  # noqa: E731

    def seal_args(c: argparse.ArgumentParser, where: str) -> None:
        arg(c, "--algorithm", choices=ALGORITHMS, help="hash algorithm (default sha256, the only one seed-era verifiers read; blake3: pip install 'integrity-fs[blake3]'; the CRCs: [crc])")
        arg(c, "--granularity", choices=("file", "chunk"), help="hash whole files, or fixed-size chunks (default: file; chunk with --chunk-size)")
        arg(c, "--chunk-size", type=size, metavar="SIZE", help="chunk length (default 64MiB): bytes, or 64MiB = 64Mi = 64M = 64*2^20, 64MB = 64*10^6")
        arg(c, "--sign-key", metavar="KEY.pem", help="EC private key (PEM, unencrypted): also write model.sig, a model_signing signature (sha256 only)")
        flag(c, "--force", f"replace a checkpoint already sealed at {where} (only with content you trust)")

    c = command("seal", cmd_seal, "hash a checkpoint directory and write its manifest", f"Hashes every file under URL and writes {MANIFEST_FILENAME} beside them, last. A sealed checkpoint\nis refused (exit 2) unless --force: sealing again accepts whatever the files hold now.", ["./checkpoints/step_1000", "s3://bucket/run/step_1000 --chunk-size 64MiB", "./step_1000 --sign-key signing-key.pem"])
    url(c), seal_args(c, "URL"), mode(c)
    c = command("sign", cmd_sign, "verify a sealed checkpoint, then sign its digests", "Verifies the content first (a damaged checkpoint is never signed, exit 1), then writes model.sig,\nreplacing any earlier one. An unsealed checkpoint is refused (exit 3).", ["s3://bucket/run/step_1000 --key signing-key.pem"])
    url(c), arg(c, "--key", metavar="KEY.pem", required=True, help="EC private key (PEM, unencrypted; P-256, P-384 or P-521)")
    c = command("verify", cmd_verify, "check a checkpoint against its manifest", "Rehashes every file the manifest lists; exit 1 if any byte differs. With --public-key, model.sig\nmust verify first.", ["s3://bucket/run/step_1000", "s3://bucket/run/step_1000 --quick        # names and sizes only", "s3://bucket/run/step_1000 --attested     # the store's checksums instead of reads", "./iter_0001000 --manifest integrity.json # Megatron's manifest", "./step_1000 --public-key signing-key.pub --json"])
    url(c), flag(c, "--quick", "compare names and sizes only; read no content"), flag(c, "--strict", "files not in the manifest are problems too")
    flag(c, "--attested", "S3, GCS: files whose store checksum equals the manifest's digest are confirmed unread (the store's hashing is trusted); the rest are hashed")
    arg(c, "--manifest", metavar="FILE", help=f"verify against this manifest instead of {MANIFEST_FILENAME} (sha256sum, b3sum, Megatron's integrity.json, model.sig); a bare name is inside URL")
    arg(c, "--manifest-format", choices=MANIFEST_FORMATS, default="auto", help="how to read --manifest (default: detected)")
    public(c, "then the content is verified"), flag(c, "--json", "print the report as JSON on stdout"), mode(c)
    c = command("show", cmd_show, "summarise a checkpoint's manifest", "Prints what the manifest records; reads nothing else.", ["s3://bucket/run/step_1000", "./step_1000 --json"], hidden=("--workers", "--no-progress"))
    url(c), flag(c, "--json", "print the summary and every file as JSON")
    c = command("export", cmd_export, "write a checkpoint's manifest in another format, on stdout", "sha256sum (what `sha256sum -c` reads), b3sum, Megatron-LM's integrity.json, or the seed's four keys.\nEach holds whole-file digests: a chunk manifest or another algorithm is refused (exit 2).", ["./step_1000 --format sha256sum > SHA256SUMS", "s3://bucket/run/iter_0001000 --format megatron > integrity.json"], hidden=("--workers", "--no-progress"))
    url(c), arg(c, "--format", required=True, choices=("sha256sum", "b3sum", "megatron", "seed"), help="what to write")
    c = command("status", cmd_status, "list a run's checkpoints, newest first, with their verdicts", f"One line per folder under ROOT: name, sealed or not, files, bytes, verdict. Verdicts: {VERDICTS}.\nNames and sizes only unless --full. Exit 0 when the listing worked, whatever the verdicts; 4 on a storage error.", ["s3://bucket/run", "./run --full --json"])
    root(c), flag(c, "--full", "hash every file (default: names and sizes only)"), pattern(c)
    public(c, "a checkpoint without such a signature, or signed as another, is damaged"), flag(c, "--json", "print a list of objects on stdout"), mode(c)
    c = command("latest", cmd_latest, "print the URL of the newest checkpoint that verifies", "Verifies the checkpoints under ROOT newest first (hashed unless --quick) and prints the first that\npasses; the others are skipped with a WARNING. None: nothing on stdout, exit 1.", ["s3://bucket/run", './run --quick   # CKPT="$(integrity-fs latest ./run)"'])
    root(c), flag(c, "--quick", "compare names and sizes only; read no content"), pattern(c)
    public(c, "checkpoints without such a signature, or signed as another, are skipped"), flag(c, "--json", "print the URL and the report as JSON"), mode(c)
    c = command("prune", cmd_prune, "delete old checkpoints, keeping the N newest that verify", "Keeps the N newest checkpoints under ROOT that verify (hashed unless --quick or --attested) and\ndeletes only checkpoints older than all of them, by step and by when they were sealed: sealed ones,\nand unsealed ones with --unsealed. Fewer than N verify, or a storage error: nothing is deleted.", ["s3://bucket/run --keep-last 3 --dry-run", "./run --keep-last 2 --unsealed --json"])
    root(c), arg(c, "--keep-last", type=positive, required=True, metavar="N", help="keep the N newest checkpoints that verify")
    flag(c, "--dry-run", "delete nothing: print what a real run deletes"), flag(c, "--unsealed", "delete unsealed checkpoints older than the oldest kept too")
    flag(c, "--quick", "judge by names and sizes only"), flag(c, "--attested", "as verify --attested"), pattern(c)
    public(c, "a checkpoint without such a signature does not verify"), flag(c, "--json", "print the result as JSON"), mode(c)
    c = command("download", cmd_download, "copy a sealed checkpoint to a local directory, verifying it", "Each byte is read once and hashed on the way; DEST gets the verified checkpoint, or stays as it was.\nFiles not in the manifest are not downloaded.", ["s3://bucket/run/step_1000 ./step_1000"])
    url(c), url(c, "dest", "new local directory: absent, or empty"), flag(c, "--strict", "files not in the manifest fail the download")
    c = command("upload", cmd_upload, "copy a local checkpoint to a URL, checking or sealing it on the way", "A sealed SRC is checked against its manifest, which is sent unchanged; an unsealed one is sealed\nfrom the bytes sent. The manifest is written last.", ["./step_1000 s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000"])
    url(c, "src", "local checkpoint directory, sealed or not"), url(c, "url", "destination: fsspec URL or local path"), seal_args(c, "URL")
    c = command("copy", cmd_copy, "copy a sealed checkpoint between any two URLs, verifying it", "Each file is verified as it streams; the manifest is written at DST last, only when every file\nmatched. -o applies to both sides, --src-o and --dst-o to one.", ["s3://bucket/run/step_1000 gs://other/run/step_1000"])
    url(c, "src", "sealed checkpoint: fsspec URL or local path"), url(c, "dst", "destination: fsspec URL or local path")
    for side in ("src", "dst"):
        arg(c, f"--{side}-o", type=storage_option, action="append", default=[], dest=f"{side}_o", metavar="KEY=VALUE", help=f"storage option for {side.upper()} only, as -o")
    flag(c, "--force", "replace a checkpoint already sealed at DST")
    command("demo", cmd_demo, "an end-to-end run on a local S3 server: seal, corrupt, reject, download", "Starts a private S3 server (moto) in this process; needs no cloud account:\npip install 'integrity-fs[demo]'.", [""], hidden=("-o",))
    return parser


EPILOG = f"""examples:
  {PROG} seal ./checkpoints/step_1000
  {PROG} verify s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000
  {PROG} status s3://bucket/run
  {PROG} prune s3://bucket/run --keep-last 3
  {PROG} demo

exit codes:
  0  verified / ok
  1  integrity failure: content differs from the manifest, or a bad signature; latest: none verifies
  2  usage error: bad arguments or -o options; a refusal to replace existing data
  3  manifest missing or invalid (or an unsupported algorithm or granularity)
  4  storage or I/O error: no such checkpoint, network, credentials, permission, disk full
  130  interrupted (Ctrl-C)
"""

# ----------------------------------------------------------------------------- helpers of the commands


def options(args: argparse.Namespace, *side: str) -> dict[str, Any]:
    return storage_options(args.o_top, args.o_cmd, *(getattr(args, s) for s in side))


def agreed(args: argparse.Namespace, step: Any) -> Any:
    """``step()``; under torchrun on every rank, a failure on any rank raised on all."""
    if args.group is None:
        return step()
    from ..collectives import agree

    return agree(args.group, step)


def key(args: argparse.Namespace, path: str | None, *, private: bool) -> Any:
    """The key in ``path`` (None: none), loaded before any checkpoint is read."""
    if path is None:
        return None

    def load() -> Any:
        try:
            return SealOptions(private_key=path).private_key if private else VerifyOptions(public_key=path).public_key
        except (OSError, ValueError, TypeError) as exc:
            raise KeyFileError(str(exc)) from None

    return agreed(args, load)


def collective(args: argparse.Namespace, verb: str, url: str, run: Any, **kw: Any) -> Any:
    """``verb`` of the library on ``url`` with the storage options, workers and progress bar; its
    collective in :mod:`integrity_fs.distributed` under torchrun."""
    kw.update(storage_options=options(args), max_workers=args.workers)
    if args.group is not None:
        from .. import distributed

        return getattr(distributed, verb)(url, group=args.group, mode=args.mode, **kw)
    if verb == "status":
        from .. import runs, storage

        pattern = kw.pop("pattern")
        fs, root = storage.resolve(url, kw.pop("storage_options"))
        return runs.status(fs, root, pattern, VerifyOptions(callback=run.callback, **kw))
    return getattr(integrity_fs, verb)(url, callback=run.callback, **kw)


def sealing(args: argparse.Namespace) -> dict[str, Any]:
    """The seal options given (upload sends a sealed source's manifest unchanged: none are implied)."""
    granularity = args.granularity or ("chunk" if args.chunk_size else None)
    if granularity == "file" and args.chunk_size:
        raise UsageError("--chunk-size applies only to --granularity chunk", "leave out --granularity file to hash in chunks of that size, or --chunk-size to hash whole files")
    given = {"algorithm": args.algorithm, "granularity": granularity, "chunk_size": args.chunk_size}
    return {name: value for name, value in given.items() if value is not None}


def print_written(head: str, manifest: Any, elapsed: float, key_path: str | None) -> None:
    print(f"{tidy(head)}: {format_work(len(manifest.files), manifest.total_bytes or 0, elapsed)}")
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


# ----------------------------------------------------------------------------- the commands


def cmd_seal(args: argparse.Namespace) -> int:
    given, private = sealing(args), key(args, args.sign_key, private=True)
    with running(args, "seal") as run:
        manifest = collective(args, "seal", args.url, run, overwrite=args.force, private_key=private, **given)
    print_written(f"sealed {args.url}", manifest, run.elapsed(), args.sign_key)
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    private = key(args, args.key, private=True)
    with running(args, "sign") as run, failing(args.url, "; not signed"):
        manifest = integrity_fs.sign(args.url, private_key=private, storage_options=options(args), max_workers=args.workers, callback=run.callback)
    print(f"verified {tidy(args.url)}: {format_work(len(manifest.files), manifest.total_bytes or 0, run.elapsed())}")
    print(f"wrote model.sig: the manifest's digests, signed with {tidy(args.key)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    public = key(args, args.public_key, private=False)
    checks = dict(quick=args.quick, strict=args.strict, attested=args.attested, manifest=args.manifest, manifest_format=args.manifest_format, public_key=public)
    with running(args, "verify") as run:
        try:
            report = collective(args, "verify", args.url, run, **checks)
        except integrity_fs.IntegrityError as error:
            print_report(args, error.report, run.elapsed(), error)
            raise
    print_report(args, report, run.elapsed())
    return 0


def print_report(args: argparse.Namespace, report: Any, elapsed: float, error: Exception | None = None) -> None:
    """JSON with --json (whole digests), else a summary and one line per problem."""
    if args.json:
        data = {"url": args.url, **report.to_dict(), "elapsed_s": round(elapsed, 3), "quick": args.quick, "attested": args.attested}
        data.update(manifest=args.manifest, signature_checked=args.public_key is not None)
        args.printed_json = True
        return print_json({**data, "error": tidy(error)} if error is not None else data)
    notes = "; names and sizes only, no content read (--quick)" if args.quick else ""
    notes += f"; against {tidy(args.manifest)}" if args.manifest else ""
    if report.ok and args.public_key:
        notes += f"; signature checked with {tidy(args.public_key)}"
    elif args.manifest and (args.manifest_format == "model_signing" or os.path.basename(args.manifest) == "model.sig"):
        notes += " (a model_signing bundle: its signature was NOT checked; --public-key checks it)"
    if report.ok and args.attested and not args.quick:
        counts: dict[str, int] = {}
        for kind in report.attested_by.values():
            counts[kind] = counts.get(kind, 0) + 1
        kinds = ": " + ", ".join(f"{n} by {kind}" for kind, n in sorted(counts.items())) if counts else ""
        n = report.files_attested
        if n and n == report.files_checked:
            notes += f"; every file attested by the store, none read (--attested){kinds}"
        elif n:
            notes += f"; {n} {'file' if n == 1 else 'files'} attested by the store unread, the rest hashed (--attested){kinds}"
        else:
            notes += "; no file attested by the store, all hashed (--attested)"
    if isinstance(error, integrity_fs.SignatureError):
        print(f"FAILED {tidy(args.url)}: {tidy(error.detail)}", flush=True)
    elif report.ok:
        n = report.files_checked
        work = f"{n} {'file' if n == 1 else 'files'}" if args.quick else format_work(n, report.bytes_checked, elapsed)
        print(f"verified {tidy(args.url)}: {work}{notes}")
    else:
        print_failure(args.url, report.problems, notes)
    if report.extra and not any(p.kind == "extra" for p in report.problems) and not isinstance(error, integrity_fs.SignatureError):
        print(extra_note(report.extra, "not checked; --strict rejects such files"))


def cmd_show(args: argparse.Namespace) -> int:
    manifest = integrity_fs.read_manifest(args.url, storage_options=options(args))
    sizes = manifest.sizes or {}
    largest = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:5]
    if args.json:
        files = {name: {"digest": digest, "size": sizes.get(name)} for name, digest in manifest.files.items()}
        print_json({"url": args.url, "version": manifest.version, "algorithm": manifest.algorithm, "granularity": manifest.granularity, "chunk_size": manifest.chunk_size,
                    "file_count": len(manifest.files), "total_bytes": manifest.total_bytes, "largest": [{"path": n, "size": s} for n, s in largest], "files": files})
        return 0
    chunks = f", chunks of {format_bytes(manifest.chunk_size)} = {manifest.chunk_size} bytes" if manifest.chunk_size else ""
    total = manifest.total_bytes
    print(f"manifest of {tidy(args.url)}\n  version      {manifest.version}\n  algorithm    {manifest.algorithm}\n  granularity  {manifest.granularity}{chunks}")
    print(f"  files        {len(manifest.files)}\n  total size   {'unknown: no sizes recorded' if total is None else f'{format_bytes(total)} = {total} bytes'}")
    if largest:
        print("largest files:")
        for name, n in largest:
            print(f"  {format_bytes(n):>10}  {tidy(name)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .. import formats

    data = formats.dump(integrity_fs.read_manifest(args.url, storage_options=options(args)), args.format)
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    out.write(data) if out is not None else sys.stdout.write(data.decode("utf-8"))
    sys.stdout.flush()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    public = key(args, args.public_key, private=False)
    with running(args, "status", bar=args.full) as run:
        rows = collective(args, "status", args.root, run, quick=not args.full, pattern=args.pattern, public_key=public)
    if args.json:
        print_json(rows)
    names = [tidy(row["name"]) for row in rows]
    width, digits = max(map(len, names), default=0), max((len(str(row["files"])) for row in rows if row["files"] is not None), default=0)
    for name, row in zip(names, [] if args.json else rows):
        sealed = {True: "sealed", False: "unsealed", None: ""}[row["sealed"]]
        files = "" if row["files"] is None else f"{row['files']:>{digits}} {'file' if row['files'] == 1 else 'files'}"
        nbytes = "" if row["bytes"] is None else format_bytes(row["bytes"])
        verdict, problems = row["verdict"], row["problems"]
        if verdict == "changing":
            verdict += ": a file changed while it was read; run again once writers are done"
        elif problems and verdict in ("damaged", "invalid"):
            verdict += ": " + tidy("; ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else ""))
        print(f"{name:<{width}}  {sealed:<8}  {files:<{digits + 6}}  {nbytes:>10}  {verdict}")
    if not rows and not args.json:
        print(f"no checkpoints under {tidy(args.root)}", file=sys.stderr)
    if not any(row["sealed"] for row in rows) and (note := root_is_a_checkpoint(args)):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    return 0


def root_is_a_checkpoint(args: argparse.Namespace) -> str | None:
    """A hint when ROOT holds a manifest: a checkpoint given where its run's directory belongs."""
    try:
        integrity_fs.read_manifest(args.root, storage_options=options(args))
    except (OSError, ValueError):
        return None
    return f"{tidy(args.root)} is itself a sealed checkpoint: ROOT is the run's directory that holds the checkpoints; `{PROG} verify {tidy(args.root)}` checks this one"


def cmd_latest(args: argparse.Namespace) -> int:
    public = key(args, args.public_key, private=False)
    with running(args, "latest", bar=not args.quick) as run, skipped_checkpoints() as skipped:
        found = collective(args, "latest_verified", args.root, run, quick=args.quick, pattern=args.pattern, public_key=public)
    if found is None:
        message, hint = f"no checkpoint under {args.root} verifies", root_is_a_checkpoint(args)
        if not skipped:
            message += ": it holds no checkpoint directory"
            hint = hint or "ROOT is a run's directory, holding one directory per checkpoint (step_1000, ...); names starting with '.' or '_' are not checkpoints"
        if args.json:
            args.printed_json = True
            print_json({"root": args.root, "url": None, "ok": False, "quick": args.quick, "skipped": skipped, "exit_code": 1, "error": tidy(message)})
        raise NoneVerified(message, hint)
    url, report = found
    if args.json:
        print_json({"root": args.root, "url": url, "ok": True, "quick": args.quick, "skipped": skipped, "report": report.to_dict()})
    else:
        print(tidy(url))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    public = key(args, args.public_key, private=False)
    with running(args, "prune", bar=not args.quick) as run:
        result = collective(args, "prune", args.root, run, keep_last=args.keep_last, pattern=args.pattern, unsealed=args.unsealed, dry_run=args.dry_run, quick=args.quick, attested=args.attested, public_key=public)
    if args.json:
        print_json({"root": args.root, **result.to_dict()})
        return 0
    names = {url: tidy(url.rstrip("/").rsplit("/", 1)[-1]) for url in result.verdicts}
    width, verdict_width = max(map(len, names.values()), default=0), max(map(len, result.verdicts.values()), default=0)
    for url, verdict in result.verdicts.items():
        action = "kept" if url in result.kept else ("would delete" if result.dry_run else "deleted") if url in result.deleted else "left"
        print(f"{names[url]:<{width}}  {verdict:<{verdict_width}}  {action}")
    count = len(result.deleted)
    noun = "checkpoint" if count == 1 else "checkpoints"
    if len(result.kept) < args.keep_last:
        tail = f"{len(result.kept)} verify, fewer than --keep-last {args.keep_last}: nothing deleted"
    elif result.dry_run:
        tail = f"dry run: would delete {count} {noun}, freeing {format_bytes(result.bytes_freed)}; nothing deleted"
    else:
        tail = f"deleted {count} {noun}, freed {format_bytes(result.bytes_freed)}"
    print(f"kept {len(result.kept)}, left {len(result.left)}; {tail}")
    return 0


def objects(url: str, args: argparse.Namespace, side: str = "") -> str:
    """What the bar says after the last byte: the writes that remain, counted when that is cheap."""
    with contextlib.suppress(Exception):
        if "://" not in url or url.startswith("file://"):
            n = sum(len(files) for _, _, files in os.walk(url.removeprefix("file://")))
            n -= os.path.exists(os.path.join(url.removeprefix("file://"), MANIFEST_FILENAME))
        else:
            n = len(integrity_fs.read_manifest(url, storage_options=options(args, *side)).files)
        return f"finalising {n} {'object' if n == 1 else 'objects'}"
    return "finalising"


def cmd_download(args: argparse.Namespace) -> int:
    with running(args, "download", finishing="finalising") as run, failing(args.url, f"; nothing was written to {args.dest}"):
        report = integrity_fs.download(args.url, args.dest, storage_options=options(args), max_workers=args.workers, callback=run.callback, strict=args.strict)
    print(f"downloaded and verified {tidy(args.url)} -> {tidy(args.dest)}: {format_work(report.files_checked, report.bytes_checked, run.elapsed())}")
    if report.extra:
        print(extra_note(report.extra, "not downloaded"))
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    given, private = sealing(args), key(args, args.sign_key, private=True)
    with running(args, "upload", finishing=objects(args.src, args)) as run:
        manifest = integrity_fs.upload(args.src, args.url, storage_options=options(args), max_workers=args.workers, callback=run.callback, overwrite=args.force, private_key=private, **given)
    print_written(f"uploaded {args.src} -> {args.url}", manifest, run.elapsed(), args.sign_key)
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    src_o, dst_o = options(args, "src_o"), options(args, "dst_o")
    finishing = objects(args.src, args, "src_o") if sys.stderr.isatty() and not args.no_progress else ""
    with running(args, "copy", finishing=finishing) as run, failing(args.src, f"; no manifest was written at {args.dst}"):
        report = integrity_fs.copy(args.src, args.dst, src_options=src_o, dst_options=dst_o, max_workers=args.workers, callback=run.callback, overwrite=args.force)
    print(f"copied and verified {tidy(args.src)} -> {tidy(args.dst)}: {format_work(report.files_checked, report.bytes_checked, run.elapsed())}")
    if report.extra:
        print(extra_note(report.extra, "not copied"))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return 0 if demo.run(args) else 1


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world > 1 and next((word for word in argv if not word.startswith("-") and word in (*COLLECTIVE, "sign", "show", "export", "download", "upload", "copy", "demo")), None) in COLLECTIVE:
        return launched(argv)
    return run(argv, None)


def run(argv: list[str], group: Any) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return report_error(error, None, as_json="--json" in argv)
    args.group, args.printed_json = group, False
    remember_typed(*(getattr(args, n, None) for n in ("url", "root", "src", "dst", "dest")))
    try:
        with cli_logging(debug=args.debug):
            code: int = args.run(args)
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
    """One command as a collective: join the group, agree on the command line, run it on every
    rank (quiet but on rank 0), and agree on the exit code."""
    try:
        from ..collectives import agree, check_same, gather, group_of, rank, torch_distributed

        dist = torch_distributed()
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo")  # from torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    except Exception as error:
        return report_error(error, None, as_json="--json" in argv)
    try:
        group = group_of(None)
        with quiet(rank(group) != 0):
            try:
                agree(group, lambda: check_same(group, argv, "the command line"))
            except ValueError as error:
                code = report_error(UsageError(str(error), "give every rank the same command line"), None, as_json="--json" in argv)
            else:
                code = run(argv, group)
        return next((c for c in gather(group, code) if c), 0)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


@contextlib.contextmanager
def quiet(silent: bool) -> Iterator[None]:
    """Ranks other than 0 print nothing."""
    if not silent:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
