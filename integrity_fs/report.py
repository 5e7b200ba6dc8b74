"""What a verification found: :class:`Problem` (one difference) and :class:`Report` (all of them).

Pure data with no I/O, imported by ``errors`` and ``core`` alike (so neither imports the other).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "SIGNATURE_FILENAME",
    "Problem",
    "ProblemKind",
    "Report",
    "every_file_differs",
    "printable",
    "shortened",
]

ProblemKind = Literal["mismatch", "missing", "size", "extra"]
#: The signature file beside the manifest (``signing`` re-exports it); here so that ``errors`` can
#: name it in a problem without importing ``signing``, which imports ``errors``.
SIGNATURE_FILENAME = "model.sig"


def printable(name: str) -> str:
    """``name`` as one line of text: control and other non-printable characters escaped (``\\n``,
    ``\\x1b``), so that a file or directory name cannot add lines (a fake "verified") or escape
    sequences to what people read. Names in ``--json`` and in :class:`Problem` stay as they are."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def shortened(items: Sequence[str], limit: int, *, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` (each :func:`printable`) joined by ``sep``, then
    `` and N more`` when there are more: many names in one line of a message."""
    shown = sep.join(printable(item) for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


@dataclass(frozen=True)
class Problem:
    """One way the checkpoint differs from its manifest.

    ``expected``/``actual`` are digests for ``"mismatch"``, byte counts for ``"size"``, the
    expected digest and ``None`` for ``"missing"``, ``None`` and the size for ``"extra"``.
    ``byte_ranges`` lists the ``[start, end)`` ranges that differ, for chunk manifests.
    """

    path: str
    kind: ProblemKind
    expected: str | int | None = None
    actual: str | int | None = None
    byte_ranges: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        path = printable(self.path)
        if self.kind == "missing":
            return f"{path}: missing"
        if self.kind == "extra":
            return f"{path}: extra (not in the manifest)"
        if self.kind == "size":
            return f"{path}: size (expected {self.expected} bytes, found {self.actual})"
        where = ""
        if self.byte_ranges:
            where = " in bytes " + ", ".join(f"{a}-{b - 1}" for a, b in self.byte_ranges)
        return f"{path}: mismatch{where} (expected {self.expected}, found {self.actual})"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["byte_ranges"] = [list(r) for r in self.byte_ranges]
        return out


@dataclass(frozen=True)
class Report:
    """The outcome of a verification. ``ok`` is True exactly when ``problems`` is empty.

    ``attested_by`` names the store checksum that attested each of the ``files_attested`` files
    (unread): ``"sha256"`` (S3's SHA-256, equal to the manifest's digest), or a checksum the store
    still shows and integrity_fs recorded when it last read or wrote every byte of the file:
    ``"sha1"``, ``"md5"`` (GCS's MD5, or S3's ETag), and with ``attested="crc"`` also
    ``"crc32c"``, ``"crc32"``.
    """

    problems: tuple[Problem, ...] = ()
    extra: tuple[str, ...] = ()
    files_checked: int = 0
    bytes_checked: int = 0
    files_attested: int = 0
    attested_by: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems],
            "extra": list(self.extra),
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "files_attested": self.files_attested,
            "attested_by": dict(self.attested_by),
        }


def every_file_differs(report: Report) -> bool:
    """Whether every file checked differs from its digest, and nothing else is wrong: checked
    against a list read as ``sha256sum`` output, a ``b3sum`` list (the same layout, BLAKE3
    digests) is then likelier than damage to every file."""
    problems = report.problems
    every = bool(problems) and len(problems) == report.files_checked
    return every and all(p.kind == "mismatch" for p in problems)
