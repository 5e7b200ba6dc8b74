"""The options that travel together, as frozen values checked once, when they are made.

:class:`VerifyOptions` (what a verification checks) and :class:`SealOptions` (what a seal
writes) are public: ``integrity_fs.distributed`` takes them as ``options=``, and every entry
point (``verify``, ``seal``, the collectives, ``dcp``, the command line) builds one and hands it
on, so that a check made here (an algorithm that exists, a chunk size that makes sense, a key
that loads) is made once for all of them. Each field declares its own check (:func:`checked`).
:class:`Hashing` and :class:`Work` are internal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from . import signing
from .formats import FORMATS, Format
from .hashing import DEFAULT_ALGORITHM, DEFAULT_CHUNK_SIZE, DEFAULT_GRANULARITY, check_granularity, new_hasher
from .manifest import Manifest, whole_number
from .recorded import ATTESTED, Attested

__all__ = [
    "Algorithm",
    "Attested",
    "Checked",
    "Granularity",
    "Hashing",
    "ManifestFormat",
    "SealOptions",
    "VerifyOptions",
    "Work",
    "attested_mode",
    "checked",
    "optional",
    "positive",
    "signing_key",
]

Algorithm = Literal["sha256", "blake3"]
Granularity = Literal["file", "chunk"]
#: How a manifest file named by ``manifest=`` is read: one of ``formats.FORMATS``, or detected.
ManifestFormat = Literal["auto", Format]

Options = TypeVar("Options", bound="Checked")


def checked(check: Callable[[str, Any], Any], default: Any = dataclasses.MISSING) -> Any:
    """A field whose value ``check(name, value)`` checks when the object is made: it raises for a
    bad one, and returns the value to keep (a key file's path becomes the loaded key)."""
    return field(default=default, metadata={"check": check})


def positive(name: str, value: object) -> int:
    """``value``, an integer of at least 1 (a ``bool`` is not one): ``ValueError`` otherwise."""
    if not whole_number(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``check``, with ``None`` let through."""
    return lambda name, value: None if value is None else check(name, value)


def _algorithm(name: str, value: Any) -> Any:
    new_hasher(value)  # NotImplementedError for an unknown algorithm (or a missing package)
    return value


def _granularity(name: str, value: Any) -> Any:
    check_granularity(value)  # NotImplementedError
    return value


def attested_mode(name: str, value: Any) -> Any:
    """``value``, one of ``True``, ``False`` and ``"crc"``: ``ValueError`` otherwise."""
    if value not in ATTESTED:
        raise ValueError(f"{name} must be True, False or 'crc', not {value!r}")
    return value


def _manifest_format(name: str, value: Any) -> Any:
    if value != "auto" and value not in FORMATS:
        raise ValueError(f"unknown manifest format {value!r} (known: auto, {', '.join(FORMATS)})")
    return value


def _manifest(name: str, value: Any) -> Any:
    if value is None or isinstance(value, Manifest):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a Manifest, a path or a URL, not {type(value).__name__}")
    if not os.fspath(value):
        raise ValueError(f"{name} path is empty")
    return value


def _name(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _public_key(name: str, value: Any) -> Any:
    return signing.load_public_key(value)


def _private_key(name: str, value: Any) -> Any:
    return signing.load_private_key(value)


class Checked:
    """A frozen dataclass whose fields' checks (:func:`checked`) run when it is made."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # every subclass is a dataclass
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))

    @classmethod
    def build(cls: type[Options], options: Options | None = None, **kw: Any) -> Options:
        """``options``, or one made of the keywords ``kw`` (``TypeError`` when both are given):
        what a function that takes either does first."""
        if options is None:
            return cls(**kw)
        if kw:
            raise TypeError(f"pass options= or the keywords {', '.join(sorted(kw))}, not both")
        if not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__}, not {type(options).__name__}")
        return options


@dataclass(frozen=True)
class Hashing(Checked):
    """How digests are made; a manifest records each of these. ``chunk_size`` is ``None`` for file
    granularity and always set for chunk granularity (the default filled in)."""

    algorithm: Algorithm = checked(_algorithm, DEFAULT_ALGORITHM)
    granularity: Granularity = checked(_granularity, DEFAULT_GRANULARITY)
    chunk_size: int | None = checked(optional(positive), None)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.granularity != "chunk":
            if self.chunk_size is not None:
                raise ValueError(f"chunk_size applies only to granularity='chunk', not {self.granularity!r}")
        elif self.chunk_size is None:
            object.__setattr__(self, "chunk_size", DEFAULT_CHUNK_SIZE)

    @classmethod
    def of(cls, manifest: Manifest) -> Hashing:
        """How ``manifest``'s digests were made."""
        return cls(manifest.algorithm, manifest.granularity, manifest.chunk_size)  # type: ignore[arg-type]

    def __str__(self) -> str:
        chunks = "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        return f"algorithm={self.algorithm!r}, granularity={self.granularity!r}{chunks}"


def signing_key(private_key: signing.PrivateKey, hashing: Hashing) -> Any:
    """``private_key``, loaded and checked against ``hashing`` (model_signing signs SHA-256
    manifests only), before any content is read."""
    signing.check_signable(hashing.algorithm, hashing.granularity)
    return signing.load_private_key(private_key)


@dataclass(frozen=True)
class Work(Checked):
    """Each caller's own (each rank's own, in a collective): how many files or chunks are read at
    once (``None``: the CPU count locally, more on object stores) and where progress goes (an
    fsspec ``Callback``, or ``None``)."""

    max_workers: int | None = checked(optional(positive), None)
    callback: Any = None


@dataclass(frozen=True, kw_only=True)
class SealOptions(Checked):
    """What a seal writes, checked when made (before anything is read).

    Parameters
    ----------
    algorithm: ``"sha256"`` or ``"blake3"`` (``NotImplementedError`` for another, or without the package).
    granularity: ``"file"`` or ``"chunk"`` (``NotImplementedError`` for another).
    chunk_size: bytes per chunk, chunk granularity only (``ValueError`` otherwise, or when not a
        positive integer); with chunk granularity ``None`` becomes the default, 64 MiB.
    overwrite: replace a manifest already there.
    private_key: sign the manifest (a PEM path, PEM bytes or a ``cryptography`` EC key); loaded
        here, and checked against the hashing (``ValueError``: only SHA-256 manifests are signed).
    """

    algorithm: Algorithm = DEFAULT_ALGORITHM
    granularity: Granularity = DEFAULT_GRANULARITY
    chunk_size: int | None = None
    overwrite: bool = False
    private_key: signing.PrivateKey | None = checked(optional(_private_key), None)
    hashing: Hashing = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hashing = Hashing(self.algorithm, self.granularity, self.chunk_size)  # checks all three
        object.__setattr__(self, "hashing", hashing)
        object.__setattr__(self, "chunk_size", hashing.chunk_size)
        super().__post_init__()
        if self.private_key is not None:
            signing.check_signable(hashing.algorithm, hashing.granularity)


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(Checked):
    """What a verification checks, checked when made (before anything is read).

    Parameters
    ----------
    strict: files present but not in the manifest are problems too.
    quick: compare names and sizes with a listing; read no content.
    attested: ``True``: store checksums that vouch for a file confirm it unread; ``"crc"``: CRCs too.
    manifest: check against this :class:`~integrity_fs.Manifest`, or the manifest file at this
        path or URL (``None``: the root's own).
    manifest_format: how to read that file: ``"auto"`` (detected) or one of ``formats.FORMATS``.
    public_key: ``model.sig`` must verify with this key (a PEM path, PEM bytes or a
        ``cryptography`` EC key; loaded here) and cover the manifest's digests.
    expected_name: (with ``public_key``) the name the signature must give the checkpoint.
    """

    strict: bool = False
    quick: bool = False
    attested: Attested = checked(attested_mode, False)
    manifest: Manifest | str | os.PathLike[str] | None = checked(_manifest, None)
    manifest_format: ManifestFormat = checked(_manifest_format, "auto")
    public_key: signing.PublicKey | None = checked(optional(_public_key), None)
    expected_name: str | None = checked(optional(_name), None)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.expected_name is not None and self.public_key is None:
            raise ValueError("expected_name is the name a signature gives the checkpoint: pass public_key too")
