"""Sizes and outcomes as people read them: parse ``64MiB``, print ``12.6 MiB``, name problems.

Pure functions shared by the command line and the demo. Sizes print in binary units (KiB, MiB,
GiB, TiB), the units chunk sizes are chosen in.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .report import Problem, printable, shortened

__all__ = [
    "DIGEST_SHOWN",
    "describe_problem",
    "extra_note",
    "format_bytes",
    "format_work",
    "name_problems",
    "parse_size",
    "short_digest",
]

_PREFIXES = "KMGTP"
_SIZE = re.compile(r"(\d+)\s*(?:([KMGTP])(I)?)?(B)?", re.IGNORECASE)
#: Hex digits kept at each end of a digest in human output (``--json`` prints them whole).
DIGEST_SHOWN = 8


def parse_size(text: str) -> int:
    """A byte count from ``67108864``, ``64MiB`` / ``64Mi`` / ``64M`` (2^20 each) or ``64MB`` (10^6).

    A prefix with ``i``, or alone, is binary (as ``dd`` and ``ls -h`` read it); a prefix followed
    by ``B`` is decimal (SI). Raises ``ValueError`` for anything else, and for zero.
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size like 67108864, 64MiB (binary) or 64MB (decimal)")
    digits, prefix, binary, unit = match.groups()
    value = int(digits)
    if prefix:
        power = _PREFIXES.index(prefix.upper()) + 1
        value *= 1024**power if binary or not unit else 1000**power
    if value < 1:
        raise ValueError(f"{text!r} must be at least 1 byte")
    return value


def format_bytes(n: int | float) -> str:
    """``12.6 MiB``; exact below 1 KiB (``512 B``)."""
    if n < 1024:
        return f"{int(n)} B"
    for power, unit in enumerate(("KiB", "MiB", "GiB", "TiB"), start=1):
        if n < 1024 ** (power + 1) or unit == "TiB":
            return f"{n / 1024**power:.1f} {unit}"
    raise AssertionError("unreachable")


def format_work(files: int, nbytes: int, seconds: float) -> str:
    """``3 files, 390.6 KiB in 0.05 s at 7.6 MiB/s``; no rate when the time rounds to 0.00 s."""
    noun = "file" if files == 1 else "files"
    text = f"{files} {noun}, {format_bytes(nbytes)} in {seconds:.2f} s"
    if nbytes and round(seconds, 2) > 0:
        text += f" at {format_bytes(nbytes / seconds)}/s"
    return text


def short_digest(digest: object) -> str:
    """``59ca3f1e…d2b927a9``: enough to tell two digests apart by eye."""
    text = str(digest)
    return text if len(text) <= 2 * DIGEST_SHOWN + 1 else f"{text[:DIGEST_SHOWN]}…{text[-DIGEST_SHOWN:]}"


def describe_problem(problem: Problem) -> str:
    """One line per problem; digests shortened (``Problem.__str__`` keeps them whole)."""
    if problem.kind != "mismatch":
        return str(problem)
    where = ""
    if problem.byte_ranges:
        where = " in bytes " + ", ".join(f"{a}-{b - 1}" for a, b in problem.byte_ranges)
    expected, actual = short_digest(problem.expected), short_digest(problem.actual)
    return f"{printable(problem.path)}: mismatch{where} (expected {expected}, found {actual})"


def name_problems(problems: Sequence[Problem], limit: int = 5) -> str:
    """``a.bin (mismatch), b.bin (missing) and 3 more``: short enough for one error line."""
    return shortened([f"{p.path} ({p.kind})" for p in problems], limit)


def extra_note(extra: Sequence[str], action: str, limit: int = 5) -> str:
    """``note: 1 file is not in the manifest and was not checked: x.bin`` (``action`` is past tense)."""
    shown = shortened(extra, limit)
    if len(extra) == 1:
        return f"note: 1 file is not in the manifest and was {action}: {shown}"
    return f"note: {len(extra)} files are not in the manifest and were {action}: {shown}"
