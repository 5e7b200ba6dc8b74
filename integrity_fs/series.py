"""How checkpoint names tell age: the order of :func:`integrity_fs.find_checkpoints`, and when
one checkpoint is certainly older than another (what :func:`integrity_fs.prune` deletes by).

A name is cut into its integers (runs of ASCII digits) and the text around them, its *shape*:
``ckpt-1000-bf16`` has the integers (1000, 16) and the shape ``ckpt-#-bf#``. Names of one shape
are one *series*, read as one sequence: the integers that differ between them (the *varying*
places) tell their age, those that are the same in every name (the 16 of ``-bf16``) say nothing.

- **Order** (newest first): by the last varying integer of the name's series, largest first (by
  the last integer for a name alone in its shape), then by its other varying integers, then by
  name; names without an integer last, in name order.
- **Certainly older:** ``a`` is certainly older than ``b`` when both have the same shape, every
  integer of ``a`` is at most the one in the same place in ``b``, and one is smaller
  (``step_900`` than ``step_1000``, ``ckpt-1000-bf16`` than ``ckpt-2000-bf16``). Names of other
  shapes, equal numbers (``step_01``, ``step_1``) and numbers that disagree (``run1_step_9``,
  ``run2_step_5``) give no certain order; names without an integer are older than nothing.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["certainly_older", "has_number", "newest_first", "pattern", "uncertainty"]

_DIGITS = re.compile(r"[0-9]+")


def _split(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``name``'s shape (the text between its integers) and its integers."""
    return tuple(_DIGITS.split(name)), tuple(int(n) for n in _DIGITS.findall(name))


def has_number(name: str) -> bool:
    """Whether ``name`` holds an integer (ASCII digits): names without one have no age."""
    return _DIGITS.search(name) is not None


def newest_first(names: Iterable[str]) -> list[str]:
    """``names`` in the order of :func:`integrity_fs.find_checkpoints`: newest first."""
    names = list(names)
    numbers: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
    for name in names:
        shape, ints = _split(name)
        numbers.setdefault(shape, set()).add(ints)
    varying = {
        shape: [i for i in range(len(shape) - 1) if len({ints[i] for ints in seen}) > 1]
        for shape, seen in numbers.items()
    }

    def key(name: str) -> tuple[int, int, tuple[int, ...], str]:
        shape, ints = _split(name)
        if not ints:
            return (1, 0, (), name)
        places = varying[shape] or [len(ints) - 1]
        return (0, -ints[places[-1]], tuple(-ints[i] for i in places), name)

    return sorted(names, key=key)


def uncertainty(older: str, newer: str) -> str | None:
    """Why ``older`` is not certainly older than ``newer``; ``None`` when it is."""
    shape, ints = _split(older)
    other_shape, other = _split(newer)
    if not ints:
        return f"{older!r} has no number in its name"
    if shape != other_shape:
        return f"{older!r} and {newer!r} are not named alike but for their numbers"
    if ints == other:
        return f"{older!r} and {newer!r} have the same numbers"
    if any(a > b for a, b in zip(ints, other, strict=True)):
        return f"the numbers of {older!r} and {newer!r} disagree on which is newer"
    return None


def certainly_older(older: str, newer: Sequence[str]) -> bool:
    """Whether ``older`` is certainly older than every name of ``newer`` (see the module's rule)."""
    return all(uncertainty(older, name) is None for name in newer)


def pattern(name: str) -> str:
    """A regular expression that names of ``name``'s series match whole (each integer ``[0-9]+``):
    ``ckpt\\-[0-9]+\\-bf[0-9]+`` for ``ckpt-1000-bf16``; the name itself when it has no integer."""
    return "[0-9]+".join(re.escape(part) for part in _split(name)[0])
