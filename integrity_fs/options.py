"""The options that travel together, checked by type when given: :class:`VerifyOptions` (what a
verification checks) and :class:`SealOptions` (what a seal writes). Public functions take their
fields as keywords (``verify(url, quick=True)``) and build one first, so a bad option is refused
before anything is read. A flag is a ``bool``, a count an ``int``: ``quick="false"`` is a
``TypeError``, never a truthy string.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .hashing import ALGORITHMS, DEFAULT_CHUNK_SIZE, check_granularity, check_signable, new_hasher
from .manifest import Manifest

__all__ = ["SealKeywords", "SealOptions", "VerifyKeywords", "VerifyOptions", "count", "flag"]

MANIFEST_FORMATS = ("auto", "integrity_fs", "megatron", "sha256sum", "b3sum", "model_signing")


def flag(name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError``."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def count(name: str, value: object, *, minimum: int = 1, optional: bool = True) -> Any:
    """``value`` if it is an ``int`` of at least ``minimum`` (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")
    return value


def _callback(value: object) -> Any:
    if value is not None and not callable(getattr(value, "relative_update", None)):
        raise TypeError(f"callback must be an fsspec Callback (with set_size and relative_update), not {value!r}")
    return value


class VerifyKeywords(TypedDict, total=False):
    """The keywords of :class:`VerifyOptions`, as verbs take them."""

    max_workers: int | None
    callback: Any
    strict: bool
    quick: bool
    attested: bool
    manifest: Manifest | str | os.PathLike[str] | None
    manifest_format: str
    public_key: Any
    expected_name: str | None


class SealKeywords(TypedDict, total=False):
    """The keywords of :class:`SealOptions`, as verbs take them."""

    max_workers: int | None
    callback: Any
    algorithm: str
    granularity: str
    chunk_size: int | None
    overwrite: bool
    private_key: Any


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """What a verification checks.

    Parameters
    ----------
    max_workers: files or chunks read at once (default: the CPU count locally, 16 on object stores).
    strict: files present but not in the manifest are problems too.
    quick: compare names and sizes with a listing; read no content.
    attested: store checksums equal to the manifest's digests confirm files unread (not with ``quick``).
    manifest: a :class:`~integrity_fs.Manifest`, or the path or URL of a manifest file (a relative
        name is inside the root); default: the root's ``_integrity_manifest.json``.
    manifest_format: how to read that file: ``"auto"`` or one of ``formats.load``'s formats.
    public_key: ``model.sig`` must verify with this key (PEM path, PEM bytes or a ``cryptography``
        EC key) and cover the manifest's digests.
    expected_name: (with ``public_key``) the name the signature must give the checkpoint.

    A verb's ``callback`` keyword (an fsspec ``Callback``, for progress in bytes of content) is
    each call's own, not an option of what is checked: :meth:`of` attaches it.
    """

    max_workers: int | None = None
    strict: bool = False
    quick: bool = False
    attested: bool = False
    manifest: Manifest | str | os.PathLike[str] | None = None
    manifest_format: str = "auto"
    public_key: Any = None
    expected_name: str | None = None
    callback: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, callback: Any = None, **fields: Any) -> VerifyOptions:
        """The options of one call: ``fields``, and the call's progress ``callback``."""
        options = cls(**fields)
        object.__setattr__(options, "callback", _callback(callback))
        return options

    def but(self, **changes: Any) -> VerifyOptions:
        """These options with ``changes`` (the callback kept)."""
        options = dataclasses.replace(self, **changes)
        object.__setattr__(options, "callback", self.callback)
        return options

    def __post_init__(self) -> None:
        count("max_workers", self.max_workers)
        for name in ("strict", "quick", "attested"):
            flag(name, getattr(self, name))
        if self.quick and self.attested:
            raise ValueError("quick and attested exclude each other: quick reads nothing, attested asks the store")
        if self.manifest is not None and not isinstance(self.manifest, (Manifest, str, os.PathLike)):
            raise TypeError(f"manifest must be a Manifest, a path or a URL, not {type(self.manifest).__name__}")
        if isinstance(self.manifest, (str, os.PathLike)) and not os.fspath(self.manifest):
            raise ValueError("manifest path is empty")
        if self.manifest_format not in MANIFEST_FORMATS:
            raise ValueError(f"unknown manifest format {self.manifest_format!r} (known: {', '.join(MANIFEST_FORMATS)})")
        if self.expected_name is not None:
            if not isinstance(self.expected_name, str):
                raise TypeError(f"expected_name must be a string, not {self.expected_name!r}")
            if self.public_key is None:
                raise ValueError("expected_name is the name a signature gives the checkpoint: pass public_key too")
        if self.public_key is not None:
            from .signing import load_public_key

            object.__setattr__(self, "public_key", load_public_key(self.public_key))


@dataclass(frozen=True, kw_only=True)
class SealOptions:
    """What a seal writes.

    Parameters
    ----------
    max_workers, and the verb's ``callback`` (attached by :meth:`of`): as for :class:`VerifyOptions`.
    algorithm: ``"sha256"`` (default), ``"blake3"``, ``"crc64nvme"`` or ``"crc32c"``
        (``NotImplementedError`` for another, or without its package).
    granularity: ``"file"`` or ``"chunk"``.
    chunk_size: bytes per chunk, chunk granularity only (default 64 MiB).
    overwrite: replace a manifest already there (CLI ``--force``).
    private_key: sign the manifest (a PEM path, PEM bytes or a ``cryptography`` EC key); SHA-256 only.
    """

    max_workers: int | None = None
    algorithm: str = "sha256"
    granularity: str = "file"
    chunk_size: int | None = None
    overwrite: bool = False
    private_key: Any = None
    callback: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, callback: Any = None, **fields: Any) -> SealOptions:
        """The options of one call: ``fields``, and the call's progress ``callback``."""
        options = cls(**fields)
        object.__setattr__(options, "callback", _callback(callback))
        return options

    def __post_init__(self) -> None:
        count("max_workers", self.max_workers)
        flag("overwrite", self.overwrite)
        if self.algorithm not in ALGORITHMS:
            raise NotImplementedError(
                f"unsupported hash algorithm {self.algorithm!r} (supported: {', '.join(ALGORITHMS)})"
            )
        new_hasher(self.algorithm)  # NotImplementedError with the install hint when its package is missing
        check_granularity(self.granularity)
        count("chunk_size", self.chunk_size)
        if self.granularity == "file" and self.chunk_size is not None:
            raise ValueError("chunk_size applies only to granularity='chunk'")
        if self.granularity == "chunk" and self.chunk_size is None:
            object.__setattr__(self, "chunk_size", DEFAULT_CHUNK_SIZE)
        if self.private_key is not None:
            check_signable(self.algorithm)
            from .signing import load_private_key

            object.__setattr__(self, "private_key", load_private_key(self.private_key))
