"""The ``integrity-fs`` command: parse arguments, call one library function, print its result, and
map its exception to an exit code (0 ok, 1 integrity failure, 2 usage error or refusal,
3 manifest missing or invalid, 4 storage or I/O error).

Every error is two lines on stderr (what failed, then a hint); ``--json`` adds one JSON object on
stdout; ``--debug`` adds the traceback. A command is one entry in :data:`COMMANDS`: its
arguments and a ``run(args) -> exit code`` function.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from . import __version__, checkpoints, demo, formats, signing, transfer
from .core import read_manifest, seal, sign, verify
from .errors import IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .hashing import ALGORITHMS, DEFAULT_ALGORITHM, GRANULARITIES
from .manifest import MANIFEST_FILENAME
from .report import Report
from .text import describe_problem, extra_note, format_bytes, format_work, name_problems, parse_size

PROG = "integrity-fs"

EXIT_OK = 0
EXIT_INTEGRITY = 1
EXIT_USAGE = 2
EXIT_MANIFEST = 3
EXIT_STORAGE = 4

#: How many of the largest files ``show`` lists.
LARGEST_SHOWN = 5
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


class UsageError(Exception):
    """The command line asks for something impossible; exit code 2."""


class KeyFileError(ValueError):
    """A key file given with ``--key``, ``--sign-key`` or ``--public-key`` cannot be used; exit code 2."""


class NoneVerifiedError(Exception):
    """``latest`` found no checkpoint that verifies; exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so argument errors get the usual
    two stderr lines and, with ``--json``, a JSON object."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# --------------------------------------------------------------------------- argument types


def parse_option(text: str) -> tuple[tuple[str, ...], Any]:
    """One ``-o key=value``: the dotted key split into parts, and the value parsed as JSON if it parses."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} has no '=': write -o key=value, e.g. -o anon=true")
    parts = tuple(part.strip() for part in key.split("."))
    if not key or not all(parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} has an empty key or key part: write -o key=value or -o outer.inner=value"
        )
    try:
        value: Any = json.loads(raw)
    except (ValueError, RecursionError):
        value = raw
    return parts, value


def build_storage_options(pairs: Iterable[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """Nested fsspec storage options from parsed ``-o`` pairs (dotted keys make nested dicts)."""
    options: dict[str, Any] = {}
    for parts, value in pairs:
        node = options
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"-o {'.'.join(parts[: depth + 1])} is set to a value and also used as a group")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise UsageError(f"-o {'.'.join(parts)} is a group of options and cannot also be set to a value")
        node[parts[-1]] = value
    if any(parts[-1] == "endpoint_url" for parts, _ in pairs):
        # gcsfs probes the bucket type over gRPC first unless told not to (read at import): against
        # an emulator or proxy that stalls every call for a minute.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return options


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def byte_size(text: str) -> int:
    """argparse type: see :func:`integrity_fs.text.parse_size`."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --------------------------------------------------------------------------- output


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


@contextlib.contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[Callback]:
    """A tqdm bar on stderr (bytes, rate, ETA); fsspec's no-op callback when disabled or without tqdm."""
    try:
        if not enabled:
            raise ImportError
        import tqdm  # noqa: F401  (imported first: a TqdmCallback half-built without it complains at exit)
        from fsspec.callbacks import TqdmCallback
    except ImportError:
        yield DEFAULT_CALLBACK
        return
    kwargs = {"desc": desc, "unit": "B", "unit_scale": True, "unit_divisor": 1024, "file": sys.stderr, "leave": False}
    callback = TqdmCallback(tqdm_kwargs={**kwargs, "dynamic_ncols": True})
    try:
        yield callback
    finally:
        callback.close()


def progress(args: argparse.Namespace, desc: str) -> contextlib.AbstractContextManager[Callback]:
    """Bars only for a person watching: stderr is a terminal and ``--no-progress`` was not given."""
    return progress_bar(not getattr(args, "no_progress", True) and sys.stderr.isatty(), desc)


def options_of(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """Storage options from ``-o`` (before and after the command) plus the named extra lists."""
    pairs = [*args.global_options, *getattr(args, "command_options", [])]
    for name in extra:
        pairs += getattr(args, name, [])
    return build_storage_options(pairs)


def granularity_of(args: argparse.Namespace) -> str:
    return str(args.granularity or ("chunk" if args.chunk_size else "file"))


def print_problems(report: Report) -> None:
    for problem in report.problems:
        print(f"  {describe_problem(problem)}")


def private_key_of(path: str | None) -> Any:
    """The EC private key in ``path`` (None: no signing), loaded before any checkpoint is read."""
    return None if path is None else _load_key(path, signing.load_private_key)


def public_key_of(path: str | None) -> Any:
    return None if path is None else _load_key(path, signing.load_public_key)


def _load_key(path: str, load: Callable[[str], Any]) -> Any:
    try:
        return load(path)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(str(exc)) from exc


def signed_note(key_path: str | None) -> None:
    if key_path is not None:
        print(f"wrote {signing.SIGNATURE_FILENAME}: the manifest's digests, signed with {key_path}")


# --------------------------------------------------------------------------- commands


def cmd_seal(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with progress(args, "seal") as callback:
        manifest = seal(
            args.url,
            algorithm=args.algorithm,
            granularity=granularity_of(args),
            chunk_size=args.chunk_size,
            storage_options=options_of(args),
            max_workers=args.workers,
            callback=callback,
            overwrite=args.force,
            private_key=private_key_of(args.sign_key),
        )
    work = format_work(len(manifest.files), manifest.total_bytes or 0, time.perf_counter() - started)
    print(f"sealed {args.url}: {work}")
    print(f"wrote {MANIFEST_FILENAME}: {manifest.algorithm}, {manifest.granularity} granularity")
    signed_note(args.sign_key)
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    key = private_key_of(args.key)
    started = time.perf_counter()
    try:
        with progress(args, "sign") as callback:
            manifest = sign(
                args.url, private_key=key, storage_options=options_of(args), max_workers=args.workers, callback=callback
            )
    except IntegrityError as err:
        noun = "problem" if len(err.report.problems) == 1 else "problems"
        print(f"FAILED {args.url}: {len(err.report.problems)} {noun}; not signed", flush=True)
        print_problems(err.report)
        raise
    work = format_work(len(manifest.files), manifest.total_bytes or 0, time.perf_counter() - started)
    print(f"verified {args.url}: {work}")
    signed_note(args.key)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    key = public_key_of(args.public_key)
    started = time.perf_counter()
    try:
        with progress(args, "verify") as callback:
            report = verify(
                args.url,
                storage_options=options_of(args),
                max_workers=args.workers,
                callback=callback,
                strict=args.strict,
                quick=args.quick,
                attested=args.attested,
                manifest=args.manifest,
                public_key=key,
            )
    except IntegrityError as err:
        print_verify_report(args, err.report, time.perf_counter() - started, err)
        raise
    print_verify_report(args, report, time.perf_counter() - started)
    return EXIT_OK


def print_verify_report(
    args: argparse.Namespace, report: Report, elapsed: float, error: IntegrityError | None = None
) -> None:
    """JSON with ``--json`` (full digests), else a summary and one line per problem (short digests)."""
    if args.json:
        data = {"url": args.url, **report.to_dict(), "elapsed_s": round(elapsed, 3), "quick": args.quick}
        data.update(attested=args.attested, manifest=args.manifest, signature_checked=args.public_key is not None)
        if error is not None:
            data["error"] = str(error)
        print_json(data)
        return
    how = "".join(verify_notes(args, report))
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
        noun = "problem" if len(report.problems) == 1 else "problems"
        print(f"FAILED {args.url}: {len(report.problems)} {noun}{how}", flush=True)
        print_problems(report)
    if report.extra and not args.strict and not isinstance(error, SignatureError):
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
        if attested == report.files_checked and attested:
            yield "; every file attested by the store, none read (--attested)"
        elif attested:
            noun = "file" if attested == 1 else "files"
            yield f"; {attested} {noun} attested by the store unread, the rest hashed (--attested)"
        else:
            yield "; no file attested by the store, all hashed (--attested)"


def cmd_export(args: argparse.Namespace) -> int:
    data = formats.dump(read_manifest(args.url, storage_options=options_of(args)), args.format)
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # a text stream (main() called with stdout redirected in-process)
        sys.stdout.write(data.decode("utf-8"))
    else:
        out.write(data)
        out.flush()
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    bar = progress(args, "status") if args.full else contextlib.nullcontext(DEFAULT_CALLBACK)
    with bar as callback:  # only hashing takes long
        found = checkpoints.status(
            args.root,
            full=args.full,
            strict=args.strict,
            storage_options=options_of(args),
            max_workers=args.workers,
            callback=callback,
        )
    if args.json:
        print_json([checkpoint.to_dict() for checkpoint in found])
        return EXIT_OK
    if not found:
        print(f"no checkpoints under {args.root}", file=sys.stderr)
    width = max((len(checkpoint.name) for checkpoint in found), default=0)
    digits = max((len(str(checkpoint.files)) for checkpoint in found), default=0)
    for checkpoint in found:
        noun = "file" if checkpoint.files == 1 else "files"
        sealed = "sealed" if checkpoint.sealed else "unsealed"
        print(
            f"{checkpoint.name:<{width}}  {sealed:<8}  {checkpoint.files:>{digits}} {noun:<5}  "
            f"{format_bytes(checkpoint.bytes):>10}  {status_verdict(checkpoint)}"
        )
    return EXIT_OK


def status_verdict(checkpoint: checkpoints.CheckpointStatus) -> str:
    if checkpoint.verdict == "damaged" and checkpoint.problems:
        return f"damaged: {name_problems(checkpoint.problems, limit=3)}"
    if checkpoint.verdict == "invalid":
        return f"invalid: {checkpoint.detail}"
    return checkpoint.verdict


def cmd_latest(args: argparse.Namespace) -> int:
    found = checkpoints.latest_verified(
        args.root,
        quick=args.quick,
        strict=args.strict,
        storage_options=options_of(args),
        max_workers=args.workers,
        public_key=public_key_of(args.public_key),
    )
    if found is None:
        raise NoneVerifiedError(f"no checkpoint under {args.root} verifies")
    print(found[0])
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    manifest = read_manifest(args.url, storage_options=options_of(args))
    sizes = dict(manifest.sizes) if manifest.sizes is not None else None
    largest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_SHOWN] if sizes else []
    if args.json:
        print_json(
            {
                "url": args.url,
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
        return EXIT_OK
    granularity = manifest.granularity
    if manifest.chunk_size is not None:
        granularity += f", chunks of {format_bytes(manifest.chunk_size)} = {manifest.chunk_size} bytes"
    total = manifest.total_bytes
    total_text = "unknown: no sizes recorded" if total is None else f"{format_bytes(total)} = {total} bytes"
    print(f"manifest of {args.url}")
    print(f"  version      {manifest.version}")
    print(f"  algorithm    {manifest.algorithm}")
    print(f"  granularity  {granularity}")
    print(f"  files        {len(manifest.files)}")
    print(f"  total size   {total_text}")
    if largest:
        print("largest files:")
        for name, size in largest:
            print(f"  {format_bytes(size):>10}  {name}")
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        with progress(args, "download") as callback:
            report = transfer.download(
                args.url,
                args.dest,
                storage_options=options_of(args),
                max_workers=args.workers,
                callback=callback,
                strict=args.strict,
            )
    except IntegrityError as err:
        noun = "problem" if len(err.report.problems) == 1 else "problems"
        print(f"FAILED {args.url}: {len(err.report.problems)} {noun}; nothing was written to {args.dest}", flush=True)
        print_problems(err.report)
        raise
    work = format_work(report.files_checked, report.bytes_checked, time.perf_counter() - started)
    print(f"downloaded and verified {args.url} -> {args.dest}: {work}")
    if report.extra:
        print(extra_note(report.extra, "not downloaded"))
    return EXIT_OK


def cmd_upload(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with progress(args, "upload") as callback:
        manifest = transfer.upload(
            args.src,
            args.url,
            storage_options=options_of(args),
            granularity=granularity_of(args),
            chunk_size=args.chunk_size,
            max_workers=args.workers,
            callback=callback,
            overwrite=args.force,
            algorithm=args.algorithm,
            private_key=private_key_of(args.sign_key),
        )
    work = format_work(len(manifest.files), manifest.total_bytes or 0, time.perf_counter() - started)
    print(f"uploaded {args.src} -> {args.url}: {work}")
    print(f"wrote {MANIFEST_FILENAME} last: {manifest.algorithm}, {manifest.granularity} granularity")
    signed_note(args.sign_key)
    return EXIT_OK


def cmd_copy(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        with progress(args, "copy") as callback:
            report = transfer.copy(
                args.src,
                args.dst,
                src_options=options_of(args, "src_options"),
                dst_options=options_of(args, "dst_options"),
                max_workers=args.workers,
                callback=callback,
                overwrite=args.force,
            )
    except IntegrityError as err:
        noun = "problem" if len(err.report.problems) == 1 else "problems"
        print(f"FAILED {args.src}: {len(err.report.problems)} {noun}; no manifest was written at {args.dst}")
        print_problems(err.report)
        raise
    work = format_work(report.files_checked, report.bytes_checked, time.perf_counter() - started)
    print(f"copied and verified {args.src} -> {args.dst}: {work}")
    if report.extra:
        print(extra_note(report.extra, "not copied"))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    ok = demo.run(max_workers=args.workers, progress=lambda desc: progress(args, desc))
    return EXIT_OK if ok else EXIT_INTEGRITY


# --------------------------------------------------------------------------- the command table


def url_argument(
    name: str = "url", help_text: str = "checkpoint directory: local path or fsspec URL"
) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(name, metavar=name.upper(), help=help_text)

    return add


def add_granularity_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        default=None,
        help="hash whole files, or fixed-size chunks (default: file; chunk if --chunk-size is given)",
    )
    parser.add_argument(
        "--chunk-size",
        type=byte_size,
        metavar="SIZE",
        default=None,
        help="chunk length for --granularity chunk (default 64MiB): bytes, or 64MiB = 64Mi = 64M = 64*2^20, "
        "64MB = 64*10^6",
    )


def add_algorithm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default=DEFAULT_ALGORITHM,
        help=f"hash algorithm (default {DEFAULT_ALGORITHM}, the only one seed-era verifiers read; "
        "blake3 needs pip install 'integrity-fs[blake3]')",
    )


def add_sign_key(parser: argparse.ArgumentParser, flag: str = "--sign-key", *, required: bool = False) -> None:
    parser.add_argument(
        flag,
        metavar="KEY.pem",
        required=required,
        default=None,
        help=f"EC private key (PEM, unencrypted; P-256, P-384 or P-521): write {signing.SIGNATURE_FILENAME}, "
        "a model_signing signature of the digests (sha256 only)",
    )


def add_public_key(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--public-key",
        metavar="KEY.pub",
        default=None,
        help=f"EC public key (PEM): {signing.SIGNATURE_FILENAME} must verify with it and cover exactly the "
        f"manifest's digests; {what}",
    )


def add_json(parser: argparse.ArgumentParser, what: str = "the report") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


def add_force(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument("--force", action="store_true", help=f"replace a manifest already at {where}")


def seal_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument()(parser)
    add_force(parser, "URL; only for content you trust")
    add_algorithm(parser)
    add_granularity_options(parser)
    add_sign_key(parser)


def sign_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument(help_text="sealed checkpoint: local path or fsspec URL")(parser)
    add_sign_key(parser, "--key", required=True)


def verify_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument()(parser)
    parser.add_argument("--quick", action="store_true", help="compare names and sizes only; read no content")
    parser.add_argument("--strict", action="store_true", help="files not in the manifest are problems too")
    parser.add_argument(
        "--attested",
        action="store_true",
        help="S3: confirm files whose S3-kept SHA-256 equals the manifest's without reading them "
        "(trusts S3's own hashing); the rest are hashed",
    )
    parser.add_argument(
        "--manifest",
        metavar="FILE",
        default=None,
        help=f"verify against this manifest instead of {MANIFEST_FILENAME}: any format integrity-fs reads "
        "(sha256sum, Megatron integrity.json, model_signing model.sig); a relative name is inside URL",
    )
    add_public_key(parser, "then the content is verified")
    add_json(parser)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument(help_text="sealed checkpoint: local path or fsspec URL")(parser)
    parser.add_argument("--format", required=True, choices=formats.DUMP_FORMATS, help="what to write on stdout")


def root_argument(parser: argparse.ArgumentParser) -> None:
    url_argument("root", "a run's directory, holding one directory per checkpoint: local path or fsspec URL")(parser)


def status_arguments(parser: argparse.ArgumentParser) -> None:
    root_argument(parser)
    parser.add_argument("--full", action="store_true", help="hash every file (default: names and sizes only)")
    parser.add_argument("--strict", action="store_true", help="files not in a manifest make it damaged")
    add_json(parser, "a list of checkpoints")


def latest_arguments(parser: argparse.ArgumentParser) -> None:
    root_argument(parser)
    parser.add_argument("--quick", action="store_true", help="compare names and sizes only; read no content")
    parser.add_argument("--strict", action="store_true", help="skip checkpoints with files not in their manifest")
    add_public_key(parser, "checkpoints without such a signature are skipped")


def show_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument()(parser)
    add_json(parser, "the summary and every file")


def download_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument(help_text="sealed checkpoint: fsspec URL or local path")(parser)
    url_argument("dest", "new local directory: must not exist, or be an empty directory")(parser)
    parser.add_argument("--strict", action="store_true", help="files not in the manifest fail the download")


def upload_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument("src", "local checkpoint directory, sealed or not")(parser)
    url_argument(help_text="destination: fsspec URL or local path")(parser)
    add_algorithm(parser)
    add_granularity_options(parser)
    add_force(parser, "URL")
    add_sign_key(parser)


def copy_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument("src", "sealed checkpoint: fsspec URL or local path")(parser)
    url_argument("dst", "destination: fsspec URL or local path")(parser)
    for side in ("src", "dst"):
        parser.add_argument(
            f"--{side}-o",
            type=parse_option,
            action="append",
            default=[],
            dest=f"{side}_options",
            metavar="KEY=VALUE",
            help=f"storage option for {side.upper()} only, as -o",
        )
    add_force(parser, "DST")


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, arguments, which common options apply, and what runs it."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    epilog: str
    arguments: Callable[[argparse.ArgumentParser], None]
    common: tuple[str, ...] = ("workers", "progress", "options")


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
            "verify s3://bucket/run/step_1000 --attested     # S3 checksums instead of reads",
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
    ),
    Command(
        "export",
        cmd_export,
        "write a checkpoint's manifest in another format, on stdout",
        "Reads the manifest (nothing else) and writes it as sha256sum text (what `sha256sum -c` reads)\n"
        "or Megatron-LM's integrity.json. Both hold whole-file SHA-256 digests: a chunk or BLAKE3\n"
        "manifest is refused (exit 2).\n\n"
        + _examples(
            "export ./step_1000 --format sha256sum > SHA256SUMS",
            "export s3://bucket/run/iter_0001000 --format megatron > integrity.json",
        ),
        export_arguments,
        common=("options",),
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
        common=("workers", "options"),
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
"""
)


def add_common_options(parser: argparse.ArgumentParser, common: Sequence[str], *, top_level: bool) -> None:
    """Options accepted before or after the command; after it they override (``-o`` adds up)."""

    def default(value: Any) -> Any:
        return value if top_level else argparse.SUPPRESS

    group = parser.add_argument_group("common options")
    if "workers" in common:
        group.add_argument(
            "--workers",
            type=positive_int,
            metavar="N",
            default=default(None),
            help="files or chunks transferred or hashed at once (default: CPUs locally, 16 remote)",
        )
    if "progress" in common:
        group.add_argument(
            "--no-progress",
            action="store_true",
            default=default(False),
            help="no progress bar; there is none anyway when stderr is not a terminal",
        )
    group.add_argument(
        "--debug", action="store_true", default=default(False), help="debug logging, and a traceback with any error"
    )
    if "options" in common:
        group.add_argument(
            "-o",
            "--option",
            type=parse_option,
            action="append",
            metavar="KEY=VALUE",
            dest="global_options" if top_level else "command_options",
            default=[],
            help="fsspec storage option, repeatable; dotted keys nest, values are JSON if they parse "
            "(-o anon=true -o client_kwargs.endpoint_url=http://127.0.0.1:9000)",
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
        add_common_options(sub, command.common, top_level=False)
    return parser


# --------------------------------------------------------------------------- errors and exit codes


def exit_code_for(error: BaseException) -> int:
    """The documented exit code for an exception (order matters: the manifest errors are also
    ``FileNotFoundError`` and ``ValueError``; a refusal is a ``FileExistsError``)."""
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
    if isinstance(error, SignatureError):
        return str(error), (
            "do not load it: it changed after signing, or was signed by another key (or never signed); "
            "check --public-key, and sign only content you trust"
        )
    if isinstance(error, NoneVerifiedError):
        return str(error), "the WARNING lines above say why each checkpoint was skipped"
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
            return what, "the named files are not in the manifest: remove them, or run without --strict to allow them"
        if command == "sign":
            return what, "nothing was signed: restore the named files from a good copy, then sign again"
        return what, "do not load it; restore the named files from a good copy, and re-seal only content you trust"
    if isinstance(error, ManifestNotFoundError):
        if getattr(args, "manifest", None) is not None:
            return str(error), "check --manifest: a relative name is inside URL; give a path or URL otherwise"
        return str(error), f"seal it first with `{PROG} seal URL`, once you trust its content"
    if isinstance(error, ManifestError):
        return str(error), "the manifest is damaged or not an integrity-fs manifest; restore it, or re-seal a good copy"
    if isinstance(error, NotImplementedError):
        if "package" in str(error):  # an optional algorithm (blake3) that is not installed
            return str(error), _install_hint(ImportError(str(error)))
        return str(error), "this manifest needs a newer integrity-fs: pip install -U integrity-fs"
    if isinstance(error, UsageError):
        return str(error), f"see `{PROG} {command} --help`" if args else f"see `{PROG} --help`"
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
            "sha256sum and megatron hold whole-file SHA-256 digests; "
            f"`{PROG} show URL` says how this checkpoint was sealed"
        )
    if isinstance(error, (ValueError, TypeError)):
        return str(error), f"check the arguments and -o storage options; see `{PROG} {command} --help`"
    if isinstance(error, OSError):
        what = str(error) or type(error).__name__
        if error.errno == errno.ENOSPC:
            return what, "the disk is full: free space on the destination, or choose another one"
        local = _is_local(error, args)
        if isinstance(error, (FileNotFoundError, NotADirectoryError)):
            if local:
                return what, "check the path: it must name an existing checkpoint directory"
            return what, "check the bucket and prefix in the URL: it must name a checkpoint directory"
        if local:
            return what, "check the path and its permissions; --debug shows the full error"
        return (
            what,
            "check the URL, your credentials and the -o storage options, e.g. -o client_kwargs.endpoint_url=...; "
            "--debug shows the full error",
        )
    return f"unexpected {type(error).__name__}: {error}", "run again with --debug and report the traceback"


def report_error(error: BaseException, args: argparse.Namespace | None, *, as_json: bool, debug: bool) -> int:
    """Two lines on stderr (and the traceback with ``--debug``); with ``--json``, one object on stdout."""
    code = exit_code_for(error)
    if debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    what, hint = describe_error(error, args)
    if as_json and not (isinstance(error, IntegrityError) and getattr(args, "command", None) == "verify"):
        urls: list[str | None] = [*_urls(args), None]
        print_json({"url": urls[0], "ok": False, "exit_code": code, "error": what})
    print(f"{PROG}: error: {what}", file=sys.stderr)
    print(f"{PROG}: hint: {hint}", file=sys.stderr)
    return code


_LOG_HANDLER = logging.StreamHandler()
_LOG_HANDLER.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))


def configure_logging(*, debug: bool) -> None:
    """integrity_fs's own warnings (a skipped symlink, a retried read) on stderr; all of them with ``--debug``."""
    _LOG_HANDLER.setStream(sys.stderr)  # the stderr of this call, also when main() runs in-process
    logger = logging.getLogger("integrity_fs")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return report_error(error, None, as_json="--json" in argv, debug=False)
    configure_logging(debug=args.debug)
    try:
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
