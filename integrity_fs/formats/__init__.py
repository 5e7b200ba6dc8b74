"""Manifests in other formats: Megatron-LM's ``integrity.json``, ``sha256sum`` and ``b3sum``
output and OpenSSF model_signing bundles, read into a :class:`~integrity_fs.Manifest` so that one
verifier checks them all; and this project's manifests written out as ``sha256sum``, ``b3sum``
or Megatron files, or as the seed's manifest (its four keys exactly).

:func:`load` and :func:`dump` are pure (bytes in, bytes out); reading a manifest file from storage is
``integrity_fs.manifests``' job.

What each format proves is the digests it lists, no more: a model_signing bundle's signature is
not checked here (that is ``model_signing verify``), and Megatron lists top-level files only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Literal, get_args

from .. import signing
from ..errors import ManifestError
from ..manifest import MANIFEST_FILENAME, Manifest, parse_json
from ..report import shortened
from .sums import SUM_FORMATS, dump_sums, is_sum_list, read_sums

__all__ = ["B3SUM_NAMES", "B3SUM_SUFFIXES", "DUMP_FORMATS", "FORMATS", "Format", "detect", "dump", "load"]

log = logging.getLogger("integrity_fs")

#: A format :func:`load` reads.
Format = Literal["integrity_fs", "megatron", "sha256sum", "b3sum", "model_signing"]
#: What :func:`load` reads (``"auto"`` detects which by content).
FORMATS: tuple[str, ...] = get_args(Format)
#: What :func:`dump` writes.
DUMP_FORMATS: tuple[str, ...] = ("sha256sum", "b3sum", "megatron", "seed")
#: File names (any case) that say a checksum list is ``b3sum``'s: its content looks like ``sha256sum``'s.
B3SUM_NAMES: tuple[str, ...] = ("b3sums", "b3sum")
#: File name endings (any case) that say the same.
B3SUM_SUFFIXES: tuple[str, ...] = (".b3", ".b3sum", ".b3sums", ".blake3")


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


def detect(data: bytes, *, name: str | None = None) -> str:
    """The format of ``data``, judged by content; ``ManifestError`` when it is none of :data:`FORMATS`.

    ``sha256sum`` and ``b3sum`` lists look alike: a list is ``b3sum``'s only when its file
    ``name`` says so (:data:`B3SUM_NAMES`, :data:`B3SUM_SUFFIXES`), else ``sha256sum``'s.
    """
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
    if is_sum_list(data):  # `sha256sum -c` skips blank lines; so does the reader, and so must detection
        lowered = (name or "").lower()
        return "b3sum" if lowered in B3SUM_NAMES or lowered.endswith(B3SUM_SUFFIXES) else "sha256sum"
    raise ManifestError(f"not a manifest in any known format ({', '.join(FORMATS)})")


def dump(manifest: Manifest, format: str) -> bytes:
    """``manifest`` written as ``format``: ``"sha256sum"`` (what ``sha256sum -c`` reads),
    ``"b3sum"`` (what ``b3sum -c`` reads), ``"megatron"`` (``integrity.json`` byte for byte as
    Megatron-LM writes it) or ``"seed"`` (this project's manifest with the seed's four keys only,
    ``algorithm``, ``files``, ``granularity`` and ``version``, for verifiers that check the key set).

    Each holds whole-file digests only, SHA-256 (BLAKE3 for ``b3sum``): another granularity or
    algorithm is a ``ValueError``; so are files in subdirectories for ``megatron`` (Megatron lists
    top-level files only).
    """
    if format not in DUMP_FORMATS:
        raise ValueError(f"cannot write manifest format {format!r} (writable: {', '.join(DUMP_FORMATS)})")
    algorithm = SUM_FORMATS.get(format, "sha256")
    if manifest.algorithm != algorithm or manifest.granularity != "file":
        raise ValueError(
            f"{format} holds whole-file {_ALGORITHM_NAMES[algorithm]} digests only; this manifest has "
            f"{manifest.algorithm} digests at {manifest.granularity} granularity"
        )
    if format == "megatron":
        nested = [name for name in manifest.files if "/" in name]
        if nested:  # Megatron hashes the files directly in the checkpoint's directory, and checks no others
            raise ValueError(
                f"megatron's integrity.json lists the top-level files of a checkpoint only, and this one has "
                f"files in subdirectories ({shortened(nested, 3)}): sha256sum lists every file"
            )
        # megatron/core/dist_checkpointing/validation.py: json.dump({...}, f, indent=2)
        return json.dumps({"algorithm": "sha256", "files": dict(manifest.files)}, indent=2).encode("utf-8")
    if format == "seed":
        return Manifest(files=manifest.files).to_json()
    return dump_sums(manifest, format)


_ALGORITHM_NAMES = {"sha256": "SHA-256", "blake3": "BLAKE3"}


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
    log.warning("%s lists %s: left out (never content: it is not verified against this manifest)", where, name)
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
    "sha256sum": lambda data: read_sums(data, "sha256sum"),
    "b3sum": lambda data: read_sums(data, "b3sum"),
    "model_signing": _read_model_signing,
}
