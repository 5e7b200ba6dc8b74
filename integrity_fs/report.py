"""What a verification found, and what a prune did: pure data, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Problem", "PruneResult", "Report", "printable", "shortened"]

ProblemKind = Literal["mismatch", "missing", "size", "extra"]


def printable(name: str) -> str:
    """``name`` on one line: control characters escaped, so that a file name cannot forge lines of output."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def shortened(items: Sequence[str], limit: int, *, sep: str = ", ") -> str:
    """The first ``limit`` items, then `` and N more``."""
    shown = sep.join(printable(item) for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


@dataclass(frozen=True)
class Problem:
    """One way a checkpoint differs from its manifest.

    ``expected``/``actual``: digests for ``"mismatch"``, byte counts for ``"size"``, the digest and
    ``None`` for ``"missing"``, ``None`` and the size for ``"extra"``. ``byte_ranges``: the
    ``[start, end)`` ranges that differ (chunk manifests).
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
        where = " in bytes " + ", ".join(f"{a}-{b - 1}" for a, b in self.byte_ranges) if self.byte_ranges else ""
        return f"{path}: mismatch{where} (expected {self.expected}, found {self.actual})"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["byte_ranges"] = [list(r) for r in self.byte_ranges]
        return out


@dataclass(frozen=True)
class Report:
    """The outcome of a verification; ``ok`` exactly when ``problems`` is empty.

    ``files_checked`` counts files confirmed (hashed or attested), ``files_attested`` the attested
    share, ``bytes_checked`` the bytes hashed; ``attested_by`` names the store checksum that
    attested each file (``"sha256"``, ``"crc64nvme"``, ``"crc32c"``).
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


@dataclass(frozen=True)
class PruneResult:
    """What :func:`integrity_fs.prune` kept, deleted and left (URLs, newest first).

    ``verdicts`` maps each checkpoint to the word ``status`` shows for it: ``"ok"``, ``"sizes
    ok"``, ``"damaged"``, ``"unsealed"``, ``"invalid"``, ``"changing"`` or ``"deleting"``.
    """

    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    left: tuple[str, ...]
    verdicts: Mapping[str, str]
    bytes_freed: int
    dry_run: bool

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdicts": dict(self.verdicts)}
