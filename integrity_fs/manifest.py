"""The manifest: an immutable value with one canonical JSON form (the stdlib's ``json``). No I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import ManifestError
from .hashing import check_granularity, chunk_count, combine, digest_length

__all__ = ["MANIFEST_FILENAME", "Manifest", "check_name", "parse_json"]

MANIFEST_FILENAME = "_integrity_manifest.json"
VERSION = 1

_HEX = re.compile(r"[0-9a-f]*")
#: Every name a manifest cannot hold: a backslash or NUL, absolute (``/``, a drive letter), an
#: empty, ``.`` or ``..`` segment.
_BAD_NAME = re.compile(r"[\\\x00]|^/|^[A-Za-z]:|//|/$|(?:^|/)\.\.?(?:/|$)")


def check_name(name: object) -> str:
    """``name`` if it is a safe relative POSIX path inside the root, else ``ManifestError``."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name {name!r} is not a non-empty string")
    if _BAD_NAME.search(name):
        raise ManifestError(f"file name {name!r} is not a relative path inside the root (no '..', '\\' or NUL)")
    if name == MANIFEST_FILENAME:
        raise ManifestError(f"the manifest must not list itself ({name!r})")
    return name


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ManifestError(f"JSON repeats the key {repeated!r} in one object")
    return out


def _no_constant(name: str) -> Any:
    raise ManifestError(f"JSON holds {name}, which JSON does not allow")


def parse_json(raw: bytes | str, what: str = "manifest") -> Any:
    """Strict JSON: repeated keys, ``NaN``/``Infinity``, bad UTF-8 and anything ``json`` refuses
    are a ``ManifestError`` naming ``what``."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, object_pairs_hook=_no_repeats, parse_constant=_no_constant)
    except ManifestError as e:
        raise ManifestError(f"{what}: {e}") from e
    except UnicodeDecodeError as e:
        raise ManifestError(f"{what} is not UTF-8: {e}") from e
    except RecursionError as e:
        raise ManifestError(f"{what} JSON is nested too deeply") from e
    except ValueError as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from e


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Manifest:
    """What a sealed checkpoint holds: a digest (and size) per file, and how they were made.

    ``files``: POSIX name relative to the root → lowercase hex digest. ``sizes``: ``None`` in
    seed-era manifests. Chunk granularity: ``chunks`` (each file's chunk digests) and ``chunk_size``.
    """

    files: Mapping[str, str]
    sizes: Mapping[str, int] | None = None
    algorithm: str = "sha256"
    granularity: str = "file"
    version: int = VERSION
    chunk_size: int | None = None
    chunks: Mapping[str, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
            keys = list(mapping)
            ordered = sorted(keys)  # keys alone: as written, they are sorted already
            return MappingProxyType(dict(mapping) if keys == ordered else {k: mapping[k] for k in ordered})

        object.__setattr__(self, "files", frozen(self.files))
        if self.sizes is not None:
            object.__setattr__(self, "sizes", frozen(self.sizes))
        if self.chunks is not None:
            object.__setattr__(self, "chunks", frozen({k: tuple(v) for k, v in self.chunks.items()}))
        self._validate()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Manifest.from_json, (self.to_json(),))

    @property
    def total_bytes(self) -> int | None:
        return None if self.sizes is None else sum(self.sizes.values())

    def to_dict(self) -> dict[str, Any]:
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
        """Canonical bytes: sorted keys, two-space indent, UTF-8, a trailing newline."""
        return (json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        """Build and validate from parsed JSON; unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, not {type(data).__name__}")
        for key in ("version", "algorithm", "granularity", "files"):
            if key not in data:
                raise ManifestError(f"manifest has no {key!r} key")
        for key, kind in (
            ("files", "names to digests"),
            ("sizes", "names to byte counts"),
            ("chunks", "names to lists"),
        ):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise ManifestError(f"{key!r} must be an object mapping {kind}")
        chunks = data.get("chunks")
        if chunks is not None and not all(isinstance(v, list) for v in chunks.values()):
            raise ManifestError("'chunks' must be an object mapping names to lists of digests")
        return cls(
            files=data["files"],
            sizes=data.get("sizes"),
            algorithm=data["algorithm"],
            granularity=data["granularity"],
            version=data["version"],
            chunk_size=data.get("chunk_size"),
            chunks=chunks,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        return cls.from_dict(parse_json(raw))

    def _validate(self) -> None:
        if not _integer(self.version) or self.version != VERSION:
            raise ManifestError(f"manifest version {self.version!r} is not supported (this reader knows {VERSION})")
        for key in ("algorithm", "granularity"):
            if not isinstance(getattr(self, key), str):
                raise ManifestError(f"{key!r} must be a string, not {getattr(self, key)!r}")
        length = digest_length(self.algorithm)  # NotImplementedError for an unknown algorithm
        check_granularity(self.granularity)

        def check_digest(where: str, digest: object) -> None:
            if not isinstance(digest, str) or len(digest) != length or not _HEX.fullmatch(digest):
                raise ManifestError(f"{where}: {digest!r} is not a {self.algorithm} digest ({length} lowercase hex)")

        names, values = list(self.files), list(self.files.values())
        well_formed = all(type(n) is str and n for n in names) and not any(map(_BAD_NAME.search, names))
        hex_digests = all(type(d) is str and len(d) == length for d in values) and _HEX.fullmatch("".join(values))
        if not (well_formed and hex_digests and MANIFEST_FILENAME not in self.files):  # one by one, to say which
            for name, digest in self.files.items():
                check_name(name)
                check_digest(f"digest of {name!r}", digest)
        if self.sizes is not None:
            if self.sizes.keys() != self.files.keys():
                raise ManifestError("'sizes' must name exactly the files of 'files'")
            if not all(type(size) is int and size >= 0 for size in self.sizes.values()):
                name, size = next((n, v) for n, v in self.sizes.items() if not _integer(v) or v < 0)
                raise ManifestError(f"size of {name!r} must be a non-negative integer, not {size!r}")
        if self.granularity == "file":
            if self.chunks is not None or self.chunk_size is not None:
                raise ManifestError("'chunks' and 'chunk_size' belong only to chunk granularity")
            return
        if not _integer(self.chunk_size) or self.chunk_size is None or self.chunk_size <= 0:
            raise ManifestError(f"chunk granularity needs a positive integer 'chunk_size', not {self.chunk_size!r}")
        if self.sizes is None or self.chunks is None or self.chunks.keys() != self.files.keys():
            raise ManifestError("chunk granularity needs 'sizes', and 'chunks' naming exactly the files of 'files'")
        for name, digests in self.chunks.items():
            expected = chunk_count(self.sizes[name], self.chunk_size)
            if len(digests) != expected:
                raise ManifestError(
                    f"{name!r} has {len(digests)} chunk digests; its size and chunk_size call for {expected}"
                )
            for i, digest in enumerate(digests):
                check_digest(f"chunk {i} of {name!r}", digest)
            if combine(self.algorithm, digests, self.sizes[name], self.chunk_size) != self.files[name]:
                raise ManifestError(f"digest of {name!r} does not match its chunk digests")
