"""The ``integrity-fs`` command: parse arguments, call one library function, print its result, and
map its exception to an exit code (0 ok, 1 integrity failure, 2 usage error or refusal,
3 manifest missing or invalid, 4 storage or I/O error).

A command is one entry in :data:`COMMANDS`: its help, its arguments (:mod:`.cli_args`) and a
``run(args) -> exit code`` function that calls the library and prints through :mod:`.cli_output`;
:mod:`.cli_errors` turns an exception into two stderr lines and an exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import __version__, checkpoints, formats, signing, storage, transfer
from ..manifest import MANIFEST_FILENAME
from ..manifests import read_manifest, read_manifest_file
from ..options import SealOptions, VerifyOptions
from ..seal import sign
from ..text import format_work
from . import demo, launch
from .args import (
    add_common_options,
    attested_argv,
    build_storage_options,
    copy_arguments,
    download_arguments,
    export_arguments,
    granularity_of,
    latest_arguments,
    options_of,
    parse_option,
    private_key_of,
    prune_arguments,
    public_key_of,
    seal_arguments,
    show_arguments,
    sign_arguments,
    status_arguments,
    upload_arguments,
    verify_arguments,
)
from .errors import EXIT_INTEGRITY, EXIT_OK, EXIT_STORAGE, PROG, NoneVerifiedError, UsageError, report_error
from .output import (
    Run,
    cli_logging,
    failure,
    print_latest,
    print_manifest,
    print_prune,
    print_status,
    print_transferred,
    print_verify_report,
    print_written,
    progress,
    running,
    signed_note,
    skipped_checkpoints,
    write_bytes,
)

__all__ = ["COMMANDS", "Command", "build_parser", "build_storage_options", "execute", "main", "parse_option"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so argument errors get the usual
    two stderr lines and, with ``--json``, a JSON object."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.prog)  # this parser's command: `integrity-fs export`


# --------------------------------------------------------------------------- commands


def launched(args: argparse.Namespace, run: Run, verb: str, url: str, options: object, storage: dict[str, Any]) -> Any:
    """``verb`` of ``args.launch`` (the library's pipeline, or its collective under a launcher)
    on ``url`` with ``options``, the storage options, the workers and the progress bar."""
    call = getattr(args.launch, verb)
    return call(url, mode=args.mode, options=options, storage_options=storage, **run.work)


def cmd_seal(args: argparse.Namespace) -> int:
    options, key = args.launch.agreed(lambda: (options_of(args), private_key_of(args.sign_key)))
    with running(args, "seal") as run:
        sealing = SealOptions(
            algorithm=args.algorithm,
            granularity=granularity_of(args),
            chunk_size=args.chunk_size,
            overwrite=args.force,
            private_key=key,
        )
        manifest = launched(args, run, "seal", args.url, sealing, options)
    print_written(f"sealed {args.url}", manifest, run.elapsed(), key_path=args.sign_key)
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    key = private_key_of(args.key)
    with running(args, "sign", failure(args.url, "; not signed")) as run:
        manifest = sign(args.url, private_key=key, storage_options=options_of(args), **run.work)
    print(f"verified {args.url}: {format_work(len(manifest.files), manifest.total_bytes or 0, run.elapsed())}")
    signed_note(args.key)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    options, key = args.launch.agreed(lambda: (options_of(args), public_key_of(args.public_key)))
    with running(args, "verify", lambda err, elapsed: print_verify_report(args, err.report, elapsed, err)) as run:
        checks = VerifyOptions(
            strict=args.strict,
            quick=args.quick,
            attested=args.attested,
            manifest=args.manifest,
            manifest_format=args.manifest_format,
            public_key=key,
        )
        report = launched(args, run, "verify", args.url, checks, options)
    print_verify_report(args, report, run.elapsed(), unchecked_bundle=key is None and manifest_is_a_bundle(args))
    return EXIT_OK


def manifest_is_a_bundle(args: argparse.Namespace) -> bool:
    """Whether ``--manifest`` names a model_signing bundle, whose signature ``verify`` did not check."""
    if args.manifest is None:
        return False
    try:
        fs, root = storage.resolve(args.url, options_of(args))
        _manifest, _name, kind = read_manifest_file(fs, root, args.manifest, format=args.manifest_format)
    except (OSError, ValueError):
        return False
    return kind == "model_signing"


def cmd_export(args: argparse.Namespace) -> int:
    write_bytes(formats.dump(read_manifest(args.url, storage_options=options_of(args)), args.format))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    options = args.launch.agreed(lambda: options_of(args))
    with running(args, "status", bar=args.full) as run:  # only hashing takes long
        checks = VerifyOptions(strict=args.strict, quick=not args.full, public_key=public_key_of(args.public_key))
        found = launched(args, run, "status", args.root, checks, options)
    print_status(args.root, found, as_json=args.json, full=args.full)
    if not any(checkpoint.sealed for checkpoint in found) and (note := root_is_a_checkpoint(args)):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    def prepare() -> tuple[dict[str, Any], Any]:
        options = options_of(args)
        # The library answers None for a root that is not there (a run's first resume must not
        # crash); from a shell that is most often a typo: exit 4 with a path hint, not "none verifies".
        storage.check_root(*storage.resolve(args.root, options))
        return options, public_key_of(args.public_key)

    options, key = args.launch.agreed(prepare)
    # A bar unless --quick: only hashing takes long.
    with running(args, "latest", bar=not args.quick) as run, skipped_checkpoints() as skipped:
        checks = VerifyOptions(quick=args.quick, strict=args.strict, public_key=key)
        found = launched(args, run, "latest_verified", args.root, checks, options)
    if found is None:
        error = none_verified(args)
        if args.json:
            print_latest(args.root, None, skipped, quick=args.quick, exit_code=EXIT_INTEGRITY, error=str(error))
        raise error
    if args.json:
        print_latest(args.root, found[0], skipped, quick=args.quick)
    else:
        print(found[0])
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    options, key = args.launch.agreed(lambda: (options_of(args), public_key_of(args.public_key)))
    with running(args, "prune", bar=not args.quick) as run:  # only hashing takes long
        result = args.launch.prune(
            args.root,
            mode=args.mode,
            keep_last=args.keep_last,
            quick=args.quick,
            attested=args.attested,
            unsealed=args.unsealed,
            dry_run=args.dry_run,
            public_key=key,
            keep=args.keep,
            match=args.match,
            storage_options=options,
            **run.work,
        )
    print_prune(args.root, result, keep_last=args.keep_last, as_json=args.json)
    return EXIT_OK


def none_verified(args: argparse.Namespace) -> NoneVerifiedError:
    """``latest`` found nothing: say why when the WARNING lines do not (ROOT holds no checkpoint
    directory, or is itself a checkpoint rather than the run's directory that holds them)."""
    message = f"no checkpoint under {args.root} verifies"
    try:
        if checkpoints.find_checkpoints(args.root, storage_options=options_of(args)):
            return NoneVerifiedError(message, root_is_a_checkpoint(args))
    except OSError:  # ROOT removed since it was checked, or a listing that failed this time
        return NoneVerifiedError(message)
    hint = root_is_a_checkpoint(args) or (
        "ROOT is a run's directory, holding one directory per checkpoint (step_1000, ...); "
        "names starting with '.' or '_' are not checkpoints"
    )
    return NoneVerifiedError(f"{message}: it holds no checkpoint directory", hint)


def root_is_a_checkpoint(args: argparse.Namespace) -> str | None:
    """A hint when ROOT holds a manifest: a checkpoint given where its run's directory belongs."""
    try:
        fs, root = storage.resolve(args.root, options_of(args))
        if not storage.exists(fs, storage.join(root, MANIFEST_FILENAME)):
            return None
    except OSError:
        return None
    return (
        f"{args.root} is itself a sealed checkpoint: ROOT is the run's directory that holds the checkpoints; "
        f"`{PROG} verify {args.root}` checks this one"
    )


def cmd_show(args: argparse.Namespace) -> int:
    print_manifest(args.url, read_manifest(args.url, storage_options=options_of(args)), as_json=args.json)
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    with running(args, "download", failure(args.url, f"; nothing was written to {args.dest}")) as run:
        report = transfer.download(
            args.url, args.dest, storage_options=options_of(args), strict=args.strict, **run.work
        )
    head = f"downloaded and verified {args.url} -> {args.dest}"
    print_transferred(head, report, run.elapsed(), not_done="not downloaded")
    return EXIT_OK


def cmd_upload(args: argparse.Namespace) -> int:
    with running(args, "upload") as run:
        manifest = transfer.upload(
            args.src,
            args.url,
            storage_options=options_of(args),
            granularity=granularity_of(args),
            chunk_size=args.chunk_size,
            **run.work,
            overwrite=args.force,
            algorithm=args.algorithm,
            private_key=private_key_of(args.sign_key),
        )
    head = f"uploaded {args.src} -> {args.url}"
    print_written(head, manifest, run.elapsed(), key_path=args.sign_key, last=" last")
    return EXIT_OK


def cmd_copy(args: argparse.Namespace) -> int:
    with running(args, "copy", failure(args.src, f"; no manifest was written at {args.dst}")) as run:
        report = transfer.copy(
            args.src,
            args.dst,
            src_options=options_of(args, "src_options"),
            dst_options=options_of(args, "dst_options"),
            **run.work,
            overwrite=args.force,
        )
    print_transferred(f"copied and verified {args.src} -> {args.dst}", report, run.elapsed(), not_done="not copied")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    ok = demo.run(max_workers=args.workers, progress=lambda desc: progress(args, desc))
    return EXIT_OK if ok else EXIT_INTEGRITY


# --------------------------------------------------------------------------- the command table


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, arguments, which common options apply, and what runs it."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    epilog: str
    arguments: Callable[[argparse.ArgumentParser], None]
    common: tuple[str, ...] = ("workers", "progress", "options")
    #: Common options accepted (a script may pass them to every command) but of no use here.
    unused: tuple[str, ...] = ()


def _examples(*lines: str) -> str:
    return "examples:\n" + "".join(f"  {PROG} {line}\n" for line in lines)


COMMANDS: list[Command] = [
    Command(
        "seal",
        cmd_seal,
        "hash a checkpoint directory and write its manifest",
        f"Hashes every file under URL and writes {MANIFEST_FILENAME} beside them, last.\n"
        "A checkpoint that is already sealed is refused (exit 2) unless --force: sealing\n"
        "again would accept whatever the files hold now, damage included.\n\n"
        + _examples(
            "seal ./checkpoints/step_1000",
            "seal s3://bucket/run/step_1000 --chunk-size 64MiB",
            "seal ./step_1000 --algorithm blake3",
            "seal ./step_1000 --sign-key signing-key.pem      # and write model.sig",
        ),
        seal_arguments,
    ),
    Command(
        "sign",
        cmd_sign,
        "verify a sealed checkpoint, then sign its manifest's digests",
        f"Verifies the content against the manifest (a damaged checkpoint is never signed, exit 1),\n"
        f"then writes {signing.SIGNATURE_FILENAME}: the model_signing bundle an elliptic-curve key makes,\n"
        "replacing any earlier signature. An unsealed checkpoint is refused (exit 3).\n\n"
        + _examples("sign s3://bucket/run/step_1000 --key signing-key.pem"),
        sign_arguments,
    ),
    Command(
        "verify",
        cmd_verify,
        "check a checkpoint against its manifest",
        "Rehashes every file listed in the manifest and exits 1 if any byte differs.\n"
        f"With --public-key, {signing.SIGNATURE_FILENAME} must verify first (exit 1 if it does not).\n\n"
        + _examples(
            "verify s3://bucket/run/step_1000",
            "verify s3://bucket/run/step_1000 --quick        # names and sizes only",
            "verify ./step_1000 --strict --json              # extra files fail too; JSON report",
            "verify s3://bucket/run/step_1000 --attested     # the store's checksums instead of reads",
            "verify gs://bucket/run/step_1000 --attested crc # CRCs too (rot only, not a forger)",
            "verify ./iter_0001000 --manifest integrity.json # Megatron's manifest, inside the root",
            "verify ./step_1000 --public-key signing-key.pub # signature, then content",
        ),
        verify_arguments,
    ),
    Command(
        "show",
        cmd_show,
        "summarise a checkpoint's manifest",
        "Prints what the manifest records, without reading the checkpoint's files.\n\n"
        + _examples("show s3://bucket/run/step_1000", "show ./step_1000 --json"),
        show_arguments,
        common=("options",),
        unused=("workers", "progress"),
    ),
    Command(
        "export",
        cmd_export,
        "write a checkpoint's manifest in another format, on stdout",
        "Reads the manifest (nothing else) and writes it as sha256sum text (what `sha256sum -c` reads),\n"
        "b3sum text (what `b3sum -c` reads, for a BLAKE3 manifest), Megatron-LM's integrity.json, or\n"
        "the seed's manifest (its four keys only, no sizes). Each holds whole-file digests: a chunk\n"
        "manifest, or another algorithm, is refused (exit 2); so are files in subdirectories for\n"
        "megatron, which lists top-level files only.\n\n"
        + _examples(
            "export ./step_1000 --format sha256sum > SHA256SUMS",
            "export s3://bucket/run/iter_0001000 --format megatron > integrity.json",
            "export ./step_1000 --format seed > seed-manifest.json",
        ),
        export_arguments,
        common=("options",),
        unused=("workers", "progress"),
    ),
    Command(
        "status",
        cmd_status,
        "list a run's checkpoints, newest first, with their verdicts",
        "One line per checkpoint directory under ROOT: name, sealed or not, files, bytes, verdict\n"
        "(ok, damaged, unsealed, invalid). Names and sizes only, unless --full hashes every file.\n"
        "Exits 0 when the listing worked, whatever the verdicts; 4 on a storage error.\n\n"
        + _examples("status s3://bucket/run", "status ./run --full --json"),
        status_arguments,
    ),
    Command(
        "latest",
        cmd_latest,
        "print the URL of the newest checkpoint that verifies",
        "Verifies the checkpoints under ROOT newest first (hashing, unless --quick) and prints the URL\n"
        "of the first that passes. Unsealed, invalid and damaged ones are skipped with a WARNING line\n"
        "on stderr; with none left, nothing is printed on stdout and the exit code is 1.\n\n"
        + _examples("latest s3://bucket/run", 'latest ./run --quick   # CKPT="$(integrity-fs latest ./run)"'),
        latest_arguments,
    ),
    Command(
        "prune",
        cmd_prune,
        "delete old checkpoints, keeping the N newest that verify",
        "Verifies the checkpoints under ROOT newest first (hashing, unless --quick or --attested) until N\n"
        "have verified, keeps those, and deletes only checkpoints certainly older than each of them\n"
        "(named alike but for their numbers, each number at most the kept one's): sealed ones (verified\n"
        "or damaged), and unsealed ones with --unsealed. Nothing newer than the oldest kept checkpoint\n"
        "is deleted, whatever its state, nor a name without a number; with fewer than N that verify,\n"
        "nothing is. --match limits the candidates to one series of names, --keep protects one.\n"
        "Each is deleted manifest first, so an interrupted prune leaves unsealed folders. Exits 0 when\n"
        "done (also when nothing was deleted), 4 on a storage error (nothing deleted when it came\n"
        "while judging).\n\n"
        + _examples(
            "prune s3://bucket/run --keep-last 3 --dry-run   # what it would delete",
            "prune s3://bucket/run --keep-last 3 --attested  # the store's checksums instead of reads",
            "prune ./run --keep-last 2 --unsealed --json",
            "prune ./out --keep-last 2 --match 'step_[0-9]+' --keep step_5000   # one run's; step_5000 stays",
        ),
        prune_arguments,
    ),
    Command(
        "download",
        cmd_download,
        "copy a sealed checkpoint to a local directory, verifying it",
        "Streams each file once, hashing it on the way, into a staging directory beside DEST that\n"
        "becomes DEST only when every file matches: DEST gets the verified checkpoint or stays as it was.\n"
        "Files not in the manifest are not downloaded. -o options apply to URL.\n\n"
        + _examples("download s3://bucket/run/step_1000 ./step_1000"),
        download_arguments,
    ),
    Command(
        "upload",
        cmd_upload,
        "copy a local checkpoint to a URL, checking or sealing it on the way",
        "Streams each local file once to URL, hashing it on the way, and writes the manifest last.\n"
        "A sealed SRC is checked against its manifest, which is sent unchanged; an unsealed SRC is\n"
        "sealed from the bytes sent. -o options apply to URL.\n\n"
        + _examples(
            "upload ./step_1000 s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
            "upload ./step_1000 s3://bucket/run/step_1000 --granularity chunk --sign-key signing-key.pem",
        ),
        upload_arguments,
    ),
    Command(
        "copy",
        cmd_copy,
        "copy a sealed checkpoint between any two URLs, verifying it",
        "Streams each file once from SRC to DST, verifying it on the way; the manifest is written at\n"
        "DST last, only when every file matched. -o applies to both sides, --src-o and --dst-o to one.\n\n"
        + _examples("copy s3://bucket/run/step_1000 gs://other/run/step_1000"),
        copy_arguments,
    ),
    Command(
        "demo",
        cmd_demo,
        "end-to-end run on a local S3 server: seal, corrupt, reject, download",
        "Starts a local S3 server (moto) in this process, uploads and seals a small checkpoint,\n"
        "flips one bit in the bucket and shows verification reject it, then a verified download.\n"
        "Needs no cloud account: pip install 'integrity-fs[demo]'.\n\n" + _examples("demo"),
        lambda parser: None,
        common=("workers", "progress"),
    ),
]

MAIN_EPILOG = (
    _examples(
        "seal ./checkpoints/step_1000",
        "verify s3://bucket/run/step_1000",
        "verify s3://bucket/run/step_1000 -o client_kwargs.endpoint_url=http://127.0.0.1:9000",
        "status s3://bucket/run",
        "prune s3://bucket/run --keep-last 3",
        "download gs://bucket/run/step_1000 ./step_1000",
        "demo",
    )
    + """
exit codes:
  0  verified / ok
  1  integrity failure: content differs from the manifest, or a bad signature; latest: none verifies
  2  usage error: bad arguments or -o options; a refusal to replace existing data
  3  manifest missing or invalid (or an unsupported algorithm or granularity)
  4  storage or I/O error: no such checkpoint, network, credentials, permission, disk full
  130  interrupted (Ctrl-C)
"""
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Seal ML checkpoints with SHA-256 manifests and verify them, on local disks, S3, GCS "
        "and any fsspec filesystem.",
        epilog=MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_common_options(parser, ("workers", "progress", "options"), top_level=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=command.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=command.run)
        command.arguments(sub)
        add_common_options(sub, command.common, top_level=False, unused=command.unused)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring). Under a launcher
    (``WORLD_SIZE`` > 1), ``seal``, ``verify``, ``latest``, ``status`` and ``prune`` run as collectives
    (:mod:`.launch`)."""
    argv = attested_argv(sys.argv[1:] if argv is None else argv)

    def report(error: BaseException, args: argparse.Namespace | None) -> int:
        return report_error(error, args, as_json="--json" in argv, debug=False)

    if launch.launched() and launch.collective_command(argv, [command.name for command in COMMANDS]):
        return launch.run(argv, build_parser().parse_args, execute, report)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return report(error, None)
    args.launch = launch.Local()
    return execute(args)


def execute(args: argparse.Namespace) -> int:
    """Run the parsed command: its exception becomes the exit code and the two stderr lines."""
    try:
        with cli_logging(PROG, debug=args.debug):
            code: int = args.run(args)
        return code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_STORAGE
    except Exception as error:
        return report_error(error, args, as_json=getattr(args, "json", False), debug=args.debug)
