"""The manifest: a pure, immutable value with one canonical JSON form. No I/O here."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from types import MappingProxyType, ModuleType
from typing import Any, TypeGuard

from .errors import ManifestError
from .hashing import (
    DEFAULT_ALGORITHM,
    DEFAULT_GRANULARITY,
    check_granularity,
    chunk_count,
    combine_chunk_digests,
    hex_length,
)

__all__ = [
    "JSON_PARSERS",
    "MANIFEST_FILENAME",
    "VERSION",
    "Manifest",
    "canonical_json",
    "check_name",
    "check_names",
    "json_parser",
    "parse_json",
    "whole_number",
]

MANIFEST_FILENAME = "_integrity_manifest.json"
VERSION = 1

_HEX = re.compile(r"[0-9a-f]+")
#: Matches every name ``check_name`` refuses (and no other non-empty string, the manifest's own
#: name aside): a backslash or NUL, a leading ``/`` or drive letter, an empty, ``.`` or ``..`` segment.
_MAYBE_BAD_NAME = re.compile(r"[\\\x00]|^/|^[A-Za-z]:|//|/$|(?:^|/)\.\.?(?:/|$)")


def check_name(name: object) -> str:
    """Return ``name`` if it is a safe relative POSIX path inside the root, else raise ManifestError.

    Refused: non-strings, empty names, absolute paths, backslashes, NUL, ``.``/``..``/empty
    segments, and the manifest's own name at the root.
    """
    if type(name) is str and name and name != MANIFEST_FILENAME and not _MAYBE_BAD_NAME.search(name):
        return name  # the common case, in one regex search; anything it finds is told apart below
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name {name!r} is not a non-empty string")
    if "\\" in name or "\x00" in name:
        raise ManifestError(f"file name {name!r} contains a backslash or NUL")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise ManifestError(f"file name {name!r} is absolute; names must be relative to the root")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ManifestError(f"file name {name!r} has an empty, '.' or '..' segment")
    if name == MANIFEST_FILENAME:
        raise ManifestError(f"the manifest must not list itself ({name!r})")
    return name


#: ``_MAYBE_BAD_NAME`` over names joined by NUL (which no valid name holds): one search for all.
_MAYBE_BAD_JOINED = re.compile(
    r"^$|^\x00|\x00\x00|\x00$|\\|(?:^|\x00)(?:/|[A-Za-z]:)|//|/(?:\x00|$)|(?:^|[/\x00])\.\.?(?:[/\x00]|$)"
)

#: Substrings every refused name holds one of (those with ``/`` only where a name has one); a
#: search for each is far faster than the regex.
_SUSPECT = ("\\", ":", "\x00\x00", "\x00.")
_SUSPECT_SLASH = ("//", "/\x00", "\x00/", "/.")
_SUSPECT_START = ("/", ".", "\x00")
_SUSPECT_END = ("/", "\x00")


def check_names(names: Iterable[object]) -> None:
    """``check_name`` on every name, at C speed when all of them are fine."""
    listed = list(names)
    if not listed:
        return
    itself = MANIFEST_FILENAME in (names if isinstance(names, Mapping) else listed)
    if not itself and set(map(type, listed)) == {str}:
        joined = "\x00".join(listed)  # type: ignore[arg-type]
        clean = not (joined.startswith(_SUSPECT_START) or joined.endswith(_SUSPECT_END))
        clean = clean and not any(part in joined for part in _SUSPECT)
        clean = clean and ("/" not in joined or not any(part in joined for part in _SUSPECT_SLASH))
        if joined and joined.count("\x00") == len(listed) - 1 and (clean or not _MAYBE_BAD_JOINED.search(joined)):
            return
    for name in listed:
        check_name(name)


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    keys = list(mapping)
    ordered = sorted(keys)  # keys alone: far cheaper to compare than (key, value) pairs
    if ordered == keys:  # as every manifest is written
        return MappingProxyType(dict(mapping))
    return MappingProxyType({key: mapping[key] for key in ordered})


@dataclass(frozen=True)
class Manifest:
    """What a sealed checkpoint contains: a digest (and size) per file, and how they were made.

    ``files`` maps each POSIX name relative to the root to its lowercase hex digest. ``sizes``
    is ``None`` for seed-era manifests. With ``granularity="chunk"``, ``chunks`` holds each
    file's chunk digests and ``chunk_size`` their length in bytes.
    """

    files: Mapping[str, str]
    sizes: Mapping[str, int] | None = None
    algorithm: str = DEFAULT_ALGORITHM
    granularity: str = DEFAULT_GRANULARITY
    version: int = VERSION
    chunk_size: int | None = None
    chunks: Mapping[str, tuple[str, ...]] | None = field(default=None)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "files", _frozen(self.files))
        if self.sizes is not None:
            set_(self, "sizes", _frozen(self.sizes))
        if self.chunks is not None:
            set_(self, "chunks", _frozen({k: tuple(v) for k, v in self.chunks.items()}))
        _validate(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as canonical JSON: the read-only mappings inside do not pickle themselves."""
        return (Manifest.from_json, (self.to_json(),))

    @property
    def total_bytes(self) -> int | None:
        """Sum of ``sizes``, or ``None`` for a manifest without sizes."""
        return None if self.sizes is None else sum(self.sizes.values())

    def largest(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` largest files as ``(name, size)``, largest first, ties by name; ``[]`` without sizes."""
        sizes = self.sizes or {}
        return sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; optional keys appear only when set."""
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "files": dict(self.files),
            "granularity": self.granularity,
            "version": self.version,
        }
        if self.sizes is not None:
            out["sizes"] = dict(self.sizes)
        if self.chunk_size is not None:
            out["chunk_size"] = self.chunk_size
        if self.chunks is not None:
            out["chunks"] = {k: list(v) for k, v in self.chunks.items()}
        return out

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, two-space indent, UTF-8, trailing newline."""
        return (canonical_json(self.to_dict()) + "\n").encode("utf-8")

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        """Build and validate from a parsed JSON value. Unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, not {type(data).__name__}")
        for key in ("version", "algorithm", "granularity", "files"):
            if key not in data:
                raise ManifestError(f"manifest has no {key!r} key")
        files = data["files"]
        if not isinstance(files, dict):
            raise ManifestError("'files' must be an object mapping names to digests")
        sizes = data.get("sizes")
        if sizes is not None and not isinstance(sizes, dict):
            raise ManifestError("'sizes' must be an object mapping names to byte counts")
        chunks = data.get("chunks")
        if chunks is not None and (
            not isinstance(chunks, dict) or not all(isinstance(v, list) for v in chunks.values())
        ):
            raise ManifestError("'chunks' must be an object mapping names to lists of digests")
        return cls(
            files=files,
            sizes=sizes,
            algorithm=data["algorithm"],
            granularity=data["granularity"],
            version=data["version"],
            chunk_size=data.get("chunk_size"),
            chunks=chunks,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        """Parse manifest bytes; ``ManifestError`` says what is wrong with them.

        Strict JSON: a key repeated in any object (which a lenient parser resolves silently,
        last one wins) and the non-standard ``NaN``/``Infinity`` are refused, and so is
        anything else the parser refuses (such as an integer too long to convert).
        """
        return cls.from_dict(parse_json(raw))


msgspec: ModuleType | None
try:  # optional (extra "fast"): parses large manifests in about half the time of the stdlib's
    msgspec = importlib.import_module("msgspec")
except ImportError:  # pragma: no cover - exercised where msgspec is not installed
    msgspec = None

#: The parsers :func:`parse_json` can use, fastest first; ``json`` (the standard library) is always there.
JSON_PARSERS = ("msgspec", "json")
#: The parser in use: ``msgspec`` when it is installed, else ``json``. Strictness does not depend
#: on it: whatever msgspec refuses, or parses otherwise than ``json`` might, the strict stdlib
#: parse decides.
json_parser = "msgspec" if msgspec is not None else "json"


def parse_json(raw: bytes | str, what: str = "manifest") -> Any:
    """``raw`` parsed as strict JSON: a key repeated in an object, ``NaN``/``Infinity``, and
    anything else the parser refuses (an integer too long to convert, deep nesting) are a
    ``ManifestError`` naming ``what``. Every manifest format's JSON goes through here.

    The document is parsed at C speed without a per-object hook; repeated keys are then ruled
    out by counting (:func:`_holds_every_key`). Only a document that count cannot clear (one
    with a repeat, or a ``\\u`` escape) is parsed again with the key-by-key check, which names
    the repeated key.
    """
    try:
        if json_parser == "msgspec" and msgspec is not None and isinstance(raw, (bytes, bytearray)):
            try:
                value = msgspec.json.decode(raw)
            except (ValueError, RecursionError):  # refused, or out of its range: json decides
                pass
            else:
                if _holds_every_key(raw, value):
                    return value
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        value = json.loads(text, parse_constant=_no_constant)
        if _holds_every_key(text, value):
            return value
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ManifestError(f"{what} is not UTF-8: {e}") from e
    except RecursionError as e:
        raise ManifestError(f"{what} JSON is nested too deeply") from e
    except ManifestError as e:
        raise ManifestError(f"{what}: {e}") from e
    except ValueError as e:  # JSONDecodeError, and the int conversion limit ("Exceeds the limit")
        raise ManifestError(f"{what} is not valid JSON: {e}") from e


def _holds_every_key(text: bytes | bytearray | str, value: Any) -> bool:
    """Whether ``value``, parsed from ``text``, kept every key the text holds (no key repeated).

    In JSON text a ``:`` is either inside a string or the separator of one object member. So
    when no escape can write a colon (the text holds no ``\\u``), the text's colons number the
    members plus the colons inside strings; a parsed value that holds as many keys plus colons
    in its strings lost none. A repeated key is dropped by the parser, with its value's strings:
    the count falls short, never over.
    """
    if isinstance(text, str):
        escaped = "\\" in text and "\\u" in text  # one byte searched first: far faster
        return not escaped and text.count(":") == _keys_and_colons(value)
    escaped = b"\\" in text and b"\\u" in text
    return not escaped and text.count(b":") == _keys_and_colons(value)


def _keys_and_colons(value: Any) -> int:
    """How many object keys ``value`` holds at any depth, plus the colons in all its strings
    (keys and values): a few C-speed passes per container, whatever its size."""
    total = 0
    pending: list[list[Any]] = [[value]]
    while pending:
        values = pending.pop()
        kinds = set(map(type, values))
        if str in kinds:
            total += _colons(values if len(kinds) == 1 else [v for v in values if type(v) is str])
        if dict in kinds:
            for obj in values if len(kinds) == 1 else [v for v in values if type(v) is dict]:
                total += len(obj) + _colons(obj)
                pending.append(list(obj.values()))
        if list in kinds:
            lists = values if len(kinds) == 1 else [v for v in values if type(v) is list]
            pending.append(list(chain.from_iterable(lists)))
    return total


def _colons(strings: Iterable[str]) -> int:
    joined = "".join(strings)
    return joined.count(":") if ":" in joined else 0  # the search alone is several times faster


_encode_str = json.encoder.encode_basestring  # what json.dumps uses with ensure_ascii=False
_scalar = int.__repr__  # what json.dumps writes for an int


def canonical_json(value: Any, indent: str = "") -> str:
    """``json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False)``, the same text, for
    what a manifest holds (objects, arrays, strings, integers), made with a few large joins rather
    than json's many small pieces: a manifest of 100,000 files takes a fraction of the time and memory."""
    if type(value) is str:
        return str(_encode_str(value))
    if isinstance(value, dict):
        if not value:
            return "{}"
        inner = indent + "  "
        lines = ",\n".join(
            f"{inner}{_encode_str(k)}: "
            f"{_encode_str(v) if type(v) is str else _scalar(v) if type(v) is int else canonical_json(v, inner)}"
            for k, v in sorted(value.items())
        )
        return f"{{\n{lines}\n{indent}}}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        inner = indent + "  "
        lines = ",\n".join(f"{inner}{canonical_json(v, inner)}" for v in value)
        return f"[\n{lines}\n{indent}]"
    return json.dumps(value)  # integers and the rest: as json writes them


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    out = {}
    for key, value in pairs:
        if key in out:
            raise ManifestError(f"JSON repeats the key {key!r} in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ManifestError(f"JSON holds {name}, which JSON does not allow")


def whole_number(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer: JSON's ``true`` (a ``bool``) is not one, nor is ``1.0``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(m: Manifest) -> None:
    if not whole_number(m.version):
        raise ManifestError(f"'version' must be an integer, not {m.version!r}")
    if m.version != VERSION:
        raise ManifestError(f"manifest version {m.version} is not supported (this reader knows {VERSION})")
    if not isinstance(m.algorithm, str):
        raise ManifestError(f"'algorithm' must be a string, not {m.algorithm!r}")
    if not isinstance(m.granularity, str):
        raise ManifestError(f"'granularity' must be a string, not {m.granularity!r}")
    length = hex_length(m.algorithm)  # NotImplementedError for an unknown algorithm
    check_granularity(m.granularity)

    def check_digest(where: str, digest: object) -> None:
        if not isinstance(digest, str) or len(digest) != length or not _HEX.fullmatch(digest):
            raise ManifestError(
                f"{where}: {digest!r} is not a {m.algorithm} digest ({length} lowercase hex characters)"
            )

    check_names(m.files)
    if not _all_hex(m.files.values(), length):  # checked all at once; one by one for the message
        for name, digest in m.files.items():
            check_digest(f"digest of {name!r}", digest)
    if m.sizes is not None:
        if m.sizes.keys() != m.files.keys():
            raise ManifestError("'sizes' must name exactly the files of 'files'")
        if not (set(map(type, m.sizes.values())) <= {int} and min(m.sizes.values(), default=0) >= 0):
            for name, size in m.sizes.items():
                if not whole_number(size) or size < 0:
                    raise ManifestError(f"size of {name!r} must be a non-negative integer, not {size!r}")
    if m.granularity == "chunk":
        _validate_chunks(m, check_digest)
    elif m.chunks is not None or m.chunk_size is not None:
        raise ManifestError(f"'chunks' and 'chunk_size' belong only to chunk granularity, not {m.granularity!r}")


_HEX_DIGITS = b"0123456789abcdef"


def _all_hex(digests: Any, length: int) -> bool:
    """Whether every one of ``digests`` is a string of ``length`` lowercase hex characters."""
    values = list(digests)
    if not values:
        return True
    if set(map(type, values)) != {str} or set(map(len, values)) != {length}:
        return False
    try:
        joined = "".join(values).encode("ascii")
    except UnicodeEncodeError:
        return False
    return not joined.translate(None, _HEX_DIGITS)  # nothing left once every hex digit is deleted


def _validate_chunks(m: Manifest, check_digest: Any) -> None:
    if not whole_number(m.chunk_size) or m.chunk_size is None or m.chunk_size <= 0:
        raise ManifestError(f"chunk granularity needs a positive integer 'chunk_size', not {m.chunk_size!r}")
    if m.sizes is None or m.chunks is None:
        raise ManifestError("chunk granularity needs 'sizes' and 'chunks'")
    if m.chunks.keys() != m.files.keys():
        raise ManifestError("'chunks' must name exactly the files of 'files'")
    length = hex_length(m.algorithm)
    every_hex = _all_hex(chain.from_iterable(m.chunks.values()), length)  # all at once; one by one for the message
    for name, digests in m.chunks.items():
        expected = chunk_count(m.sizes[name], m.chunk_size)
        if len(digests) != expected:
            raise ManifestError(
                f"{name!r} has {len(digests)} chunk digests; its size and chunk_size call for {expected}"
            )
        if not every_hex:
            for i, digest in enumerate(digests):
                check_digest(f"chunk {i} of {name!r}", digest)
        if combine_chunk_digests(m.algorithm, digests) != m.files[name]:
            raise ManifestError(f"digest of {name!r} does not match its chunk digests")
