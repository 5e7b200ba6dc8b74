"""Manifests in other formats: Megatron-LM's ``integrity.json``, ``sha256sum`` output and
OpenSSF model_signing bundles, read into a :class:`~integrity_fs.Manifest` so that one verifier
checks them all; and this project's manifests written out as ``sha256sum`` or Megatron files.

:func:`load` and :func:`dump` are pure (bytes in, bytes out); reading a manifest file from storage is
``integrity_fs.manifests``' job.

What each format proves is the digests it lists, no more: a model_signing bundle's signature is
not checked here (that is ``model_signing verify``), and Megatron lists top-level files only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from .. import signing
from ..errors import ManifestError
from ..manifest import MANIFEST_FILENAME, Manifest, check_name, parse_json
from ..report import printable

__all__ = ["DUMP_FORMATS", "FORMATS", "detect", "dump", "load"]

log = logging.getLogger("integrity_fs")

#: What :func:`load` reads (``"auto"`` detects which by content).
FORMATS: tuple[str, ...] = ("integrity_fs", "megatron", "sha256sum", "model_signing")
#: What :func:`dump` writes.
DUMP_FORMATS: tuple[str, ...] = ("sha256sum", "megatron")

# GNU coreutils: "<hex>  <name>" (text mode) or "<hex> *<name>" (binary mode), which `sha256sum -c` also
# takes as "<hex> <name>" (BSD's `sha256 -r`); --tag: "SHA256 (<name>) = <hex>".
_SUM_LINE = re.compile(r"(?P<hex>[0-9a-fA-F]{64})(?: [ *]| )(?P<name>.+)", re.DOTALL)
_TAG_LINE = re.compile(r"SHA256 \((?P<name>.+)\) = (?P<hex>[0-9a-fA-F]{64})", re.DOTALL)
_SUM_ESCAPES = {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}


def load(data: bytes, format: str = "auto") -> Manifest:
    """The manifest that ``data`` (a manifest file's bytes) describes.

    ``format`` is one of :data:`FORMATS` or ``"auto"`` (detected by content); an explicit format
    is checked, and data not in it is a ``ManifestError``. Every name is checked as this
    project's manifest names are (relative, no ``..``, no backslash, ...).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if format == "auto":
        format = detect(data)
    try:
        reader = _READERS[format]
    except (KeyError, TypeError):
        raise ValueError(f"unknown manifest format {format!r} (known: auto, {', '.join(FORMATS)})") from None
    return reader(data)


def detect(data: bytes) -> str:
    """The format of ``data``, judged by content; ``ManifestError`` when it is none of :data:`FORMATS`."""
    if data.lstrip()[:1] == b"{":
        obj = _json_object(data, "manifest")
        if "dsseEnvelope" in obj:
            return "model_signing"
        if "version" in obj:
            return "integrity_fs"
        if "files" in obj:
            return "megatron"
        raise ManifestError(
            "JSON manifest of no known format: not integrity_fs (no 'version'), not Megatron (no 'files'), "
            "not a model_signing bundle (no 'dsseEnvelope')"
        )
    # `sha256sum -c` skips blank lines; so does the reader, and so must detection.
    first = next((line for line in data.splitlines() if line.strip()), b"").lstrip(b"\\")
    if _SUM_LINE.fullmatch(first.decode("utf-8", "replace")) or first.startswith(b"SHA256 ("):
        return "sha256sum"
    raise ManifestError(f"not a manifest in any known format ({', '.join(FORMATS)})")


def dump(manifest: Manifest, format: str) -> bytes:
    """``manifest`` written as ``format``: ``"sha256sum"`` (what ``sha256sum -c`` reads) or
    ``"megatron"`` (``integrity.json`` byte for byte as Megatron-LM writes it).

    Both hold whole-file SHA-256 digests only: a chunk or non-SHA-256 manifest is a ``ValueError``.
    """
    if format not in DUMP_FORMATS:
        raise ValueError(f"cannot write manifest format {format!r} (writable: {', '.join(DUMP_FORMATS)})")
    if manifest.algorithm != "sha256" or manifest.granularity != "file":
        raise ValueError(
            f"{format} holds whole-file SHA-256 digests only; this manifest has {manifest.algorithm} "
            f"digests at {manifest.granularity} granularity"
        )
    if format == "megatron":
        # megatron/core/dist_checkpointing/validation.py: json.dump({...}, f, indent=2)
        return json.dumps({"algorithm": "sha256", "files": dict(manifest.files)}, indent=2).encode("utf-8")
    return b"".join(_sum_line(name, digest).encode("utf-8") for name, digest in manifest.files.items())


def _sum_line(name: str, digest: str) -> str:
    """One ``sha256sum`` line; GNU escaping (a leading backslash) for names with ``\\``, LF or CR."""
    if not any(c in name for c in "\\\n\r"):
        return f"{digest}  {name}\n"
    escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return f"\\{digest}  {escaped}\n"


# --- readers -----------------------------------------------------------------------------------


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    obj = parse_json(data, what)
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be a JSON object, not {type(obj).__name__}")
    return obj


def _is_ours(name: object, where: str) -> bool:
    """Whether ``name`` is this project's manifest or signature at the root, which another format
    may list (they were there when that format's tool ran) but which are never content: a manifest
    is not verified against another, and ``model.sig`` is checked with ``public_key=``."""
    if name not in (MANIFEST_FILENAME, signing.SIGNATURE_FILENAME):
        return False
    log.warning(
        "%s lists %s: left out (never content: it is not verified against this manifest)", printable(where), name
    )
    return True


def _read_integrity_fs(data: bytes) -> Manifest:
    obj = _json_object(data, "integrity_fs manifest")
    return Manifest.from_dict(obj)


def _read_megatron(data: bytes) -> Manifest:
    obj = _json_object(data, "Megatron integrity.json")
    if "version" in obj:
        raise ManifestError("not a Megatron integrity.json: it has a 'version' (an integrity_fs manifest?)")
    files = obj.get("files")
    if not isinstance(files, dict):
        raise ManifestError("not a Megatron integrity.json: no 'files' object mapping names to digests")
    # Megatron's own reader takes a missing algorithm as sha256.
    algorithm = obj.get("algorithm", "sha256")
    files = {name: digest for name, digest in files.items() if not _is_ours(name, "Megatron integrity.json")}
    try:
        return Manifest(files=files, algorithm=algorithm)
    except ManifestError as exc:
        raise ManifestError(f"Megatron integrity.json: {exc}") from exc


def _read_sha256sum(data: bytes) -> Manifest:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"sha256sum file is not UTF-8 (names must be UTF-8): {exc}") from exc
    files: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")  # CRLF line ends, which `sha256sum -c` takes too
        if not line:
            continue
        name, digest = _parse_sum_line(line, number)
        if name.startswith("./"):
            name = name[2:]
        if _is_ours(name, "sha256sum file"):
            continue
        try:
            check_name(name)
        except ManifestError as exc:
            raise ManifestError(f"sha256sum line {number}: {exc}") from exc
        if files.setdefault(name, digest) != digest:
            raise ManifestError(f"sha256sum line {number}: {name!r} is listed twice with different digests")
    if not files:
        raise ManifestError("sha256sum file lists no files")
    return Manifest(files=files)


def _parse_sum_line(line: str, number: int) -> tuple[str, str]:
    escaped = line.startswith("\\")
    body = line[1:] if escaped else line
    match = _SUM_LINE.fullmatch(body) or _TAG_LINE.fullmatch(body)
    if match is None:
        raise ManifestError(
            f"sha256sum line {number} is not '<64 hex digits>  <name>', '<64 hex digits> *<name>' "
            f"or 'SHA256 (<name>) = <64 hex digits>': {line[:100]!r}"
        )
    name = match["name"]
    if escaped:
        name = _unescape(name, number)
    return name, match["hex"].lower()


def _unescape(name: str, number: int) -> str:
    def one(m: re.Match[str]) -> str:
        try:
            return _SUM_ESCAPES[m[0]]
        except KeyError:
            raise ManifestError(f"sha256sum line {number}: unknown escape {m[0]!r} in {name!r}") from None

    return re.sub(r"\\.?", one, name, flags=re.DOTALL)


def _read_model_signing(data: bytes) -> Manifest:
    """The digests a model_signing bundle lists, read by the parser that ``signing`` checks
    signatures with; the signature itself is not checked here."""
    try:
        _bundle, payload = signing.read_envelope(data)
        return signing.signed_manifest(signing.read_statement(payload))
    except ManifestError as exc:
        raise ManifestError(f"model_signing bundle: {exc}") from exc


_READERS: dict[str, Callable[[bytes], Manifest]] = {
    "integrity_fs": _read_integrity_fs,
    "megatron": _read_megatron,
    "sha256sum": _read_sha256sum,
    "model_signing": _read_model_signing,
}
