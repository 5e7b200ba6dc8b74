"""The command line's arguments: value types (``-o key=value``, sizes, counts), each command's
arguments and the options common to all, and what parsed arguments become in a library call
(storage options, granularity, loaded keys)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from .. import formats, signing
from ..hashing import ALGORITHMS, DEFAULT_ALGORITHM, GRANULARITIES
from ..manifest import MANIFEST_FILENAME
from ..options import Granularity
from ..text import parse_size
from .errors import KeyFileError, UsageError

__all__ = [
    "add_algorithm",
    "add_common_options",
    "add_force",
    "add_granularity_options",
    "add_json",
    "add_mode",
    "add_public_key",
    "add_sign_key",
    "attested_argv",
    "attested_value",
    "build_storage_options",
    "byte_size",
    "copy_arguments",
    "download_arguments",
    "export_arguments",
    "granularity_of",
    "latest_arguments",
    "options_of",
    "parse_option",
    "positive_int",
    "private_key_of",
    "prune_arguments",
    "public_key_of",
    "root_argument",
    "seal_arguments",
    "show_arguments",
    "sign_arguments",
    "status_arguments",
    "upload_arguments",
    "url_argument",
    "verify_arguments",
]


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


def options_of(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """Storage options from ``-o`` (before and after the command) plus the named extra lists."""
    pairs = [*args.global_options, *getattr(args, "command_options", [])]
    for name in extra:
        pairs += getattr(args, name, [])
    return build_storage_options(pairs)


def granularity_of(args: argparse.Namespace) -> Granularity:
    return cast(Granularity, args.granularity or ("chunk" if args.chunk_size else "file"))


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


# --------------------------------------------------------------------------- each command's arguments


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


def add_attested(parser: argparse._ActionsContainer, more: str) -> None:
    """``--attested`` (``--attested crc``: CRCs too); ``more`` ends its help."""
    parser.add_argument(
        "--attested",
        nargs="?",
        const=True,
        default=False,
        type=attested_value,
        metavar="crc",
        help=f"S3, GCS: confirm files unread whose store-kept checksum vouches for them{more}",
    )


def add_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=("sharded", "rank0"),
        default="sharded",
        help="under torchrun (WORLD_SIZE > 1): split the bytes over every rank (sharded, the default; "
        "shared storage), or let rank 0 alone read them (rank0; node-local storage). No effect otherwise",
    )


def seal_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument()(parser)
    add_force(parser, "URL; only for content you trust")
    add_algorithm(parser)
    add_granularity_options(parser)
    add_sign_key(parser)
    add_mode(parser)


def sign_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument(help_text="sealed checkpoint: local path or fsspec URL")(parser)
    add_sign_key(parser, "--key", required=True)


def regex(text: str) -> str:
    """argparse type: a regular expression (checked here, so that a bad one is exit 2 at once)."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc}") from None
    return text


def attested_value(text: str) -> bool | str:
    """``--attested``'s value: none (``True``), or ``crc``."""
    if text in ("crc", "CRC"):
        return "crc"
    if text == "true":
        return True
    raise argparse.ArgumentTypeError(f"{text!r}: write --attested, or --attested crc (CRCs attest too)")


def attested_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--attested`` given its value in the same token (``--attested=crc`` when
    ``crc`` follows it, else ``--attested=true``), so that the URL after a bare ``--attested`` is
    never taken for its value."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            out += args[i:]
            break
        if token == "--attested":
            crc = i + 1 < len(args) and args[i + 1] in ("crc", "CRC")
            out.append("--attested=crc" if crc else "--attested=true")
            i += 2 if crc else 1
            continue
        out.append(token)
        i += 1
    return out


def verify_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument()(parser)
    parser.add_argument("--quick", action="store_true", help="compare names and sizes only; read no content")
    parser.add_argument("--strict", action="store_true", help="files not in the manifest are problems too")
    add_attested(
        parser,
        ": S3's SHA-256 equal to the manifest's, or the MD5/SHA-1 recorded when integrity-fs last read or "
        "wrote them (trusts the store's own hashing); the rest are hashed. '--attested crc': CRCs too "
        "(accidental change only, not a forger)",
    )
    parser.add_argument(
        "--manifest",
        metavar="FILE",
        default=None,
        help=f"verify against this manifest instead of {MANIFEST_FILENAME}: any format integrity-fs reads "
        "(sha256sum, b3sum, Megatron integrity.json, model_signing model.sig); a bare name is inside URL, "
        "./FILE and ../FILE are local paths",
    )
    parser.add_argument(
        "--manifest-format",
        choices=("auto", *formats.FORMATS),
        default="auto",
        help="how to read --manifest (default: detected; a sha256sum-like list is b3sum's when named B3SUMS or *.b3)",
    )
    add_public_key(parser, "then the content is verified")
    add_json(parser)
    add_mode(parser)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    url_argument(help_text="sealed checkpoint: local path or fsspec URL")(parser)
    parser.add_argument("--format", required=True, choices=formats.DUMP_FORMATS, help="what to write on stdout")


def root_argument(parser: argparse.ArgumentParser) -> None:
    url_argument("root", "a run's directory, holding one directory per checkpoint: local path or fsspec URL")(parser)


def status_arguments(parser: argparse.ArgumentParser) -> None:
    judged_arguments(
        parser,
        ("--full", "hash every file (default: names and sizes only)"),
        strict="files not in a manifest make it damaged",
        key="a sealed checkpoint without such a signature, or signed as another, is damaged",
        json_of="a list of checkpoints",
    )


def latest_arguments(parser: argparse.ArgumentParser) -> None:
    judged_arguments(
        parser,
        ("--quick", "compare names and sizes only; read no content"),
        strict="skip checkpoints with files not in their manifest",
        key="checkpoints without such a signature, or signed as another, are skipped",
        json_of="the URL and the checkpoints skipped, with why",
    )


def judged_arguments(
    parser: argparse.ArgumentParser, depth: tuple[str, str], *, strict: str, key: str, json_of: str
) -> None:
    """A run's root and how its checkpoints are judged (``status``, ``latest``): ``depth``, the flag
    that says how much is read, and its help; the other helps say what each check makes of one."""
    root_argument(parser)
    parser.add_argument(depth[0], action="store_true", help=depth[1])
    parser.add_argument("--strict", action="store_true", help=strict)
    add_public_key(parser, key)
    add_json(parser, json_of)
    add_mode(parser)


def prune_arguments(parser: argparse.ArgumentParser) -> None:
    root_argument(parser)
    parser.add_argument(
        "--keep-last",
        type=positive_int,
        required=True,
        metavar="N",
        help="keep the N newest checkpoints that verify; delete only checkpoints older than the oldest of them",
    )
    parser.add_argument("--dry-run", action="store_true", help="delete nothing: print what a real run deletes")
    parser.add_argument(
        "--unsealed",
        action="store_true",
        help="delete unsealed checkpoints older than the oldest kept too (default: leave them)",
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--quick", action="store_true", help="judge by names and sizes only; read no content")
    add_attested(how, " (as verify --attested); the rest are hashed")
    parser.add_argument(
        "--match",
        type=regex,
        metavar="REGEX",
        help="only folders whose whole name matches REGEX are candidates (e.g. 'step_[0-9]+'); others are not touched",
    )
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="NAME",
        help="never delete this checkpoint (a name, path or URL; kept when it verifies); repeatable",
    )
    add_public_key(parser, "a checkpoint without such a signature, or signed as another, does not verify")
    add_json(parser, "the result")
    add_mode(parser)


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


def add_common_options(
    parser: argparse.ArgumentParser, common: Sequence[str], *, top_level: bool, unused: Sequence[str] = ()
) -> None:
    """Options accepted before or after the command; after it they override (``-o`` adds up).

    ``unused``: common options this command accepts, so that a script may pass them to every
    command, but has no use for (``show`` hashes nothing): left out of its ``--help``."""

    def default(value: Any) -> Any:
        return value if top_level else argparse.SUPPRESS

    def described(name: str, text: str) -> str:
        return argparse.SUPPRESS if name in unused else text

    group = parser.add_argument_group("common options")
    if "workers" in common or "workers" in unused:
        group.add_argument(
            "--workers",
            type=positive_int,
            metavar="N",
            default=default(None),
            help=described(
                "workers", "files or chunks transferred or hashed at once (default: CPUs locally, 16 remote)"
            ),
        )
    if "progress" in common or "progress" in unused:
        group.add_argument(
            "--no-progress",
            action="store_true",
            default=default(False),
            help=described("progress", "no progress bar; there is none anyway when stderr is not a terminal"),
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
