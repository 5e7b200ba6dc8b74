"""Manifests in other formats, read into a :class:`Manifest` so that one verifier checks them all:
Megatron-LM's ``integrity.json``, ``sha256sum`` and ``b3sum`` lists, OpenSSF model_signing bundles
(their digests; the signature is not checked here, that is ``verify(public_key=)`` or
``model_signing verify``); and this project's manifests written as ``sha256sum``, ``b3sum``,
Megatron or the seed's four keys. Pure: bytes in, bytes out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import ManifestError
from .manifest import Manifest, check_name, parse_json
from .report import shortened
from .signing import _MALFORMED, _left_out, _read

__all__ = ["dump", "load"]

_FORMATS = ("integrity_fs", "megatron", "sha256sum", "b3sum", "model_signing")
_DUMP_FORMATS = ("sha256sum", "b3sum", "megatron", "seed")
_SUMS = {"sha256sum": "sha256", "b3sum": "blake3"}  # a checksum list's format -> its digests' algorithm
# A list's file name (any case) that says it is b3sum's: its lines look exactly like sha256sum's.
_B3SUM_NAMES, _B3SUM_SUFFIXES = ("b3sums", "b3sum"), (".b3", ".b3sum", ".b3sums", ".blake3")
# GNU: "<hex>  <name>" (text), "<hex> *<name>" (binary), BSD's "<hex> <name>"; --tag: "SHA256 (<name>) = <hex>".
_SUM_LINE = re.compile(r"(?P<hex>[0-9a-fA-F]{64})(?: [ *]| )(?P<name>.+)", re.DOTALL)
_TAG_LINE = re.compile(r"SHA256 \((?P<name>.+)\) = (?P<hex>[0-9a-fA-F]{64})", re.DOTALL)
# What each tool escapes in a name, on a line that then starts with a backslash (never with --zero).
_ESCAPES = {"sha256sum": {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}, "b3sum": {"\\\\": "\\", "\\n": "\n"}}


def detect(data: bytes, *, name: str | None = None) -> str:
    """The format of ``data``, judged by content; ``ManifestError`` when it is in no known format.
    A checksum list is ``b3sum``'s when its file ``name`` says so (``B3SUMS``, ``*.b3``), else
    ``sha256sum``'s: the two look alike."""
    if data.lstrip()[:1] == b"{":
        obj = _object(data, "manifest")
        for key, format in (("dsseEnvelope", "model_signing"), ("version", "integrity_fs"), ("files", "megatron")):
            if key in obj:
                return format
        raise ManifestError(
            "JSON manifest of no known format: not integrity_fs (no 'version'), not Megatron (no 'files'), "
            "not a model_signing bundle (no 'dsseEnvelope')"
        )
    separator = b"\0" if b"\0" in data else b"\n"
    line = next((line for line in data.split(separator) if line.strip()), b"")  # blank lines are skipped
    first = line.decode("utf-8", "replace").rstrip("\r").removeprefix("\\" if separator == b"\n" else "")
    if _SUM_LINE.fullmatch(first) or first.startswith("SHA256 ("):
        lowered = (name or "").lower()
        return "b3sum" if lowered in _B3SUM_NAMES or lowered.endswith(_B3SUM_SUFFIXES) else "sha256sum"
    raise ManifestError(f"not a manifest in any known format ({', '.join(_FORMATS)})")


def load(data: bytes, format: str = "auto") -> Manifest:
    """The manifest that ``data`` (a manifest file's bytes) describes, in ``format``: ``"auto"``
    (detected by content), ``"integrity_fs"``, ``"megatron"``, ``"sha256sum"``, ``"b3sum"`` or
    ``"model_signing"``. An explicit format is checked: data not in it is a ``ManifestError``. Every
    name is checked as a manifest name; this project's manifest and ``model.sig``, listed by a tool
    run over a sealed checkpoint, are left out (never content)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if format == "auto":
        format = detect(data)
    if format == "integrity_fs":
        return Manifest.from_dict(_object(data, "integrity_fs manifest"))
    if format == "megatron":
        obj = _object(data, "Megatron integrity.json")
        if "version" in obj or not isinstance(obj.get("files"), dict):
            why = "it has a 'version' (an integrity_fs manifest?)" if "version" in obj else "no 'files' object"
            raise ManifestError(f"not a Megatron integrity.json: {why}")
        files = {n: d for n, d in obj["files"].items() if not _left_out(n, "Megatron integrity.json")}
        try:  # Megatron's own reader takes a missing algorithm as sha256
            return Manifest(files=files, algorithm=obj.get("algorithm", "sha256"))
        except ManifestError as exc:
            raise ManifestError(f"Megatron integrity.json: {exc}") from exc
    if format in _SUMS:
        return _read_sums(data, format)
    if format == "model_signing":
        try:
            return _read(data)[0]
        except _MALFORMED as exc:  # a ManifestError, or a value of the wrong type
            what = str(exc) if isinstance(exc, ManifestError) else f"malformed ({exc!r})"
            raise ManifestError(f"model_signing bundle: {what}") from exc
    raise ValueError(f"unknown manifest format {format!r} (known: auto, {', '.join(_FORMATS)})")


def _object(data: bytes, what: str) -> dict[str, Any]:
    obj = parse_json(data, what)
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be a JSON object, not {type(obj).__name__}")
    return obj


def _read_sums(data: bytes, format: str) -> Manifest:
    """A ``sha256sum`` or ``b3sum`` list: lines end with LF (``sha256sum -c`` also takes CRLF) or, with
    ``--zero``, NUL (names never escaped); a leading ``./`` is dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{format} file is not UTF-8 (names must be UTF-8): {exc}") from exc
    zero = "\0" in text
    files: dict[str, str] = {}
    for number, line in enumerate(text.split("\0" if zero else "\n"), 1):
        if not zero and format == "sha256sum":
            line = line.removesuffix("\r")
        if not line:
            continue
        escaped = line.startswith("\\") and not zero
        body = line[1:] if escaped else line
        match = _SUM_LINE.fullmatch(body) or (_TAG_LINE.fullmatch(body) if format == "sha256sum" else None)
        if match is None:
            tag = ", 'SHA256 (<name>) = <hex>'" if format == "sha256sum" else ""
            raise ManifestError(f"{format} line {number} is not '<64 hex digits>  <name>'{tag}: {line[:100]!r}")
        parts, escapes = re.split(r"(\\.?)", match["name"], flags=re.DOTALL), _ESCAPES[format]
        unknown = [part for part in parts[1::2] if part not in escapes]  # parts[1::2]: the escapes
        if escaped and unknown:
            raise ManifestError(f"{format} line {number}: unknown escape {unknown[0]!r} in {match['name']!r}")
        name = ("".join(escapes.get(part, part) for part in parts) if escaped else match["name"]).removeprefix("./")
        if _left_out(name, f"{format} file"):
            continue
        try:
            check_name(name)
        except ManifestError as exc:
            raise ManifestError(f"{format} line {number}: {exc}") from exc
        if files.setdefault(name, match["hex"].lower()) != match["hex"].lower():
            raise ManifestError(f"{format} line {number}: {name!r} is listed twice with different digests")
    if not files:
        raise ManifestError(f"{format} file lists no files")
    return Manifest(files=files, algorithm=_SUMS[format])


def dump(manifest: Manifest, format: str) -> bytes:
    """``manifest`` written as ``format``: ``"sha256sum"`` (what ``sha256sum -c`` reads), ``"b3sum"``
    (``b3sum -c``), ``"megatron"`` (``integrity.json`` byte for byte as Megatron-LM writes it) or
    ``"seed"`` (the seed's four keys only, for verifiers that check the key set). Each holds whole-file
    SHA-256 digests (BLAKE3 for ``b3sum``): another granularity or algorithm (a CRC, say) is a
    ``ValueError``, and so are files in subdirectories for ``megatron`` (it lists top-level files)."""
    if format not in _DUMP_FORMATS:
        raise ValueError(f"cannot write manifest format {format!r} (writable: {', '.join(_DUMP_FORMATS)})")
    algorithm = _SUMS.get(format, "sha256")
    if manifest.algorithm != algorithm or manifest.granularity != "file":
        raise ValueError(
            f"{format} holds whole-file {'BLAKE3' if algorithm == 'blake3' else 'SHA-256'} digests only; this "
            f"manifest has {manifest.algorithm} digests at {manifest.granularity} granularity "
            f"(seal with algorithm={algorithm!r} and granularity='file' to write it)"
        )
    if format == "seed":
        return Manifest(files=manifest.files).to_json()
    if format == "megatron":
        nested = [name for name in manifest.files if "/" in name]
        if nested:
            raise ValueError(
                "megatron's integrity.json lists the top-level files of a checkpoint only, and this one has "
                f"files in subdirectories ({shortened(nested, 3)}): sha256sum lists every file"
            )
        # megatron/core/dist_checkpointing/validation.py: json.dump({...}, f, indent=2)
        return json.dumps({"algorithm": "sha256", "files": dict(manifest.files)}, indent=2).encode("utf-8")
    escapes = {value: key for key, value in _ESCAPES[format].items()}
    lines = []
    for name, digest in manifest.files.items():
        escaped = "".join(escapes.get(c, c) for c in name)
        lines.append(f"{digest}  {name}\n" if escaped == name else f"\\{digest}  {escaped}\n")
    return "".join(lines).encode("utf-8")
