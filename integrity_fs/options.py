"""The options that travel together, as frozen, checked values.

The public functions keep their keyword arguments (see SPEC); each builds these once and hands
them on, so that a check made here (an algorithm that exists, a chunk size that makes sense, a
worker count that is a count) is made once for every entry point: local, distributed, transfer
and DCP alike. Internal: not part of the public API.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from .hashing import DEFAULT_ALGORITHM, DEFAULT_CHUNK_SIZE, DEFAULT_GRANULARITY, check_granularity, new_hasher
from .manifest import Manifest

__all__ = ["Algorithm", "Attested", "Granularity", "Hashing", "SealOptions", "VerifyOptions", "Work"]

Algorithm = Literal["sha256", "blake3"]
Granularity = Literal["file", "chunk"]
#: ``True``: checksums that need a second preimage to forge; ``"crc"``: CRCs too (rot, not a forger).
Attested = bool | Literal["crc"]


@dataclass(frozen=True)
class Hashing:
    """How digests are made; a manifest records each of these. ``chunk_size`` is ``None`` for file
    granularity and always set for chunk granularity (the default filled in)."""

    algorithm: str = DEFAULT_ALGORITHM
    granularity: str = DEFAULT_GRANULARITY
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        new_hasher(self.algorithm)  # NotImplementedError for an unknown algorithm (or a missing package)
        check_granularity(self.granularity)
        if self.granularity != "chunk":
            if self.chunk_size is not None:
                raise ValueError(f"chunk_size applies only to granularity='chunk', not {self.granularity!r}")
            return
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", DEFAULT_CHUNK_SIZE)
        elif not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, not {self.chunk_size!r}")

    @classmethod
    def of(cls, manifest: Manifest) -> Hashing:
        """How ``manifest``'s digests were made."""
        return cls(manifest.algorithm, manifest.granularity, manifest.chunk_size)

    def __str__(self) -> str:
        chunks = "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        return f"algorithm={self.algorithm!r}, granularity={self.granularity!r}{chunks}"


@dataclass(frozen=True)
class Work:
    """Each caller's own (each rank's own, in a collective): how many files or chunks are read at
    once (``None``: the CPU count locally, more on object stores) and where progress goes (an
    fsspec ``Callback``, or ``None``)."""

    max_workers: int | None = None
    callback: Any = None

    def __post_init__(self) -> None:
        workers = self.max_workers
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
            raise ValueError(f"max_workers must be a positive integer, not {workers!r}")


@dataclass(frozen=True)
class SealOptions:
    """What a seal writes: the hashing, whether it may replace a manifest, and the private key
    (loaded and checked against the hashing) that signs it, if any."""

    hashing: Hashing = Hashing()
    overwrite: bool = False
    key: Any = None


@dataclass(frozen=True)
class VerifyOptions:
    """What a verification checks: extra files (``strict``), names and sizes only (``quick``),
    store checksums instead of reads (``attested``), against which manifest (``manifest``: a
    :class:`Manifest`, a path or URL, or ``None`` for the root's own; ``manifest_format``: how to
    read that file), the public key (loaded) that must have signed it, if any, and the name the
    signature must give the checkpoint (``expected_name``)."""

    strict: bool = False
    quick: bool = False
    attested: Attested = False
    manifest: Manifest | str | os.PathLike[str] | None = None
    key: Any = None
    expected_name: str | None = None
    manifest_format: str = "auto"

    def __post_init__(self) -> None:
        if self.attested not in (True, False, "crc"):
            raise ValueError(f"attested must be True, False or 'crc', not {self.attested!r}")
        if self.expected_name is not None and self.key is None:
            raise ValueError("expected_name is the name a signature gives the checkpoint: pass public_key too")
        if self.expected_name is not None and not isinstance(self.expected_name, str):
            raise TypeError(f"expected_name must be a string, not {type(self.expected_name).__name__}")
