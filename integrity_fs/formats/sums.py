"""Checksum lists: ``sha256sum`` output (GNU coreutils, ``--tag``, ``--zero``, BSD's one space)
and ``b3sum`` output (BLAKE3, the same layout), read into manifests and written from them.

Pure: bytes in, bytes out.
"""

from __future__ import annotations

import logging
import re

from ..errors import ManifestError
from ..manifest import MANIFEST_FILENAME, Manifest, check_name
from ..report import SIGNATURE_FILENAME

__all__ = ["SUM_FORMATS", "dump_sums", "is_sum_list", "read_sums"]

log = logging.getLogger("integrity_fs")

#: Format name -> the algorithm of its digests.
SUM_FORMATS = {"sha256sum": "sha256", "b3sum": "blake3"}

# GNU coreutils: "<hex>  <name>" (text mode) or "<hex> *<name>" (binary mode), which `sha256sum -c` also
# takes as "<hex> <name>" (BSD's `sha256 -r`); --tag: "SHA256 (<name>) = <hex>". b3sum: "<hex>  <name>".
_SUM_LINE = re.compile(r"(?P<hex>[0-9a-fA-F]{64})(?: [ *]| )(?P<name>.+)", re.DOTALL)
_TAG_LINE = re.compile(r"SHA256 \((?P<name>.+)\) = (?P<hex>[0-9a-fA-F]{64})", re.DOTALL)
# What each tool escapes after a leading backslash: GNU `\\`, LF and CR; b3sum `\\` and LF only.
_ESCAPES = {
    "sha256sum": {"\\\\": "\\", "\\n": "\n", "\\r": "\r"},
    "b3sum": {"\\\\": "\\", "\\n": "\n"},
}


def is_sum_list(data: bytes) -> bool:
    """Whether ``data`` has the shape of a checksum list (its first line, or ``--zero`` record)."""
    separator = b"\0" if b"\0" in data else b"\n"
    first = next((line for line in data.split(separator) if line.strip()), b"")
    if separator == b"\n":
        first = first.lstrip(b"\\")
    return bool(_SUM_LINE.fullmatch(first.decode("utf-8", "replace").rstrip("\r"))) or first.startswith(b"SHA256 (")


def read_sums(data: bytes, format: str) -> Manifest:
    """The manifest a ``sha256sum`` or ``b3sum`` list describes (``format``: which tool wrote it).

    Lines end with LF (a CR before it is dropped for ``sha256sum``, as ``sha256sum -c`` does) or,
    for ``sha256sum --zero``, with NUL, whose names are never escaped.
    """
    algorithm = SUM_FORMATS[format]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{format} file is not UTF-8 (names must be UTF-8): {exc}") from exc
    zero = "\0" in text
    files: dict[str, str] = {}
    for number, line in enumerate(text.split("\0" if zero else "\n"), 1):
        if not zero and format == "sha256sum":
            line = line.removesuffix("\r")  # CRLF line ends, which `sha256sum -c` takes too
        if not line:
            continue
        name, digest = _parse_line(line, number, format, zero)
        if name.startswith("./"):
            name = name[2:]
        if name in (MANIFEST_FILENAME, SIGNATURE_FILENAME):  # the tool ran over a sealed directory
            log.warning(
                "%s file lists %s: left out (never content: it is not verified against this manifest)", format, name
            )
            continue
        try:
            check_name(name)
        except ManifestError as exc:
            raise ManifestError(f"{format} line {number}: {exc}") from exc
        if files.setdefault(name, digest) != digest:
            raise ManifestError(f"{format} line {number}: {name!r} is listed twice with different digests")
    if not files:
        raise ManifestError(f"{format} file lists no files")
    return Manifest(files=files, algorithm=algorithm)


def _parse_line(line: str, number: int, format: str, zero: bool) -> tuple[str, str]:
    escaped = line.startswith("\\") and not zero
    body = line[1:] if escaped else line
    match = _SUM_LINE.fullmatch(body) or (_TAG_LINE.fullmatch(body) if format == "sha256sum" else None)
    if match is None:
        tag = " or 'SHA256 (<name>) = <64 hex digits>'" if format == "sha256sum" else ""
        raise ManifestError(
            f"{format} line {number} is not '<64 hex digits>  <name>', '<64 hex digits> *<name>'{tag}: {line[:100]!r}"
        )
    name = match["name"]
    if escaped:
        name = _unescape(name, number, format)
    return name, match["hex"].lower()


def _unescape(name: str, number: int, format: str) -> str:
    escapes = _ESCAPES[format]

    def one(m: re.Match[str]) -> str:
        try:
            return escapes[m[0]]
        except KeyError:
            raise ManifestError(f"{format} line {number}: unknown escape {m[0]!r} in {name!r}") from None

    return re.sub(r"\\.?", one, name, flags=re.DOTALL)


def dump_sums(manifest: Manifest, format: str) -> bytes:
    """``manifest`` as the list ``format`` (``sha256sum`` or ``b3sum``) writes, which its ``-c``
    reads back: names escaped where that tool escapes them."""
    escapes = {value: key for key, value in _ESCAPES[format].items()}
    lines = []
    for name, digest in manifest.files.items():
        if not any(c in name for c in escapes):
            lines.append(f"{digest}  {name}\n")
        else:
            lines.append(f"\\{digest}  {''.join(escapes.get(c, c) for c in name)}\n")
    return "".join(lines).encode("utf-8")
