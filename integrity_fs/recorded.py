"""Store checksums recorded for a checkpoint's files: which checksums prove what, what a store
shows for an object, and the sidecar file that keeps what integrity_fs checked.

A record says: when integrity_fs read or wrote every byte of the file ``name``, those bytes gave
``digest`` (the manifest's digest of the file, under the sidecar's hashing) and also gave the
values in ``checksums``, which equalled the store's own checksums of that object. A record is a
fact about bytes: it attests a file only while the manifest still gives the file that digest and
the store still shows that version of the object with that checksum, so a stale record (an object
replaced, a manifest sealed again, a sidecar copied to another store) simply matches nothing.

The sidecar (``_integrity_store_checksums.json`` at the root) is never content, never part of
the manifest and never signed: anyone who can write to the bucket can write it. So it is used only
with the root's own manifest, which such a writer could rewrite as well; with a public key or an
external manifest only the store's SHA-256 compared with the trusted digests attests (see
``verify``). Pure: no fsspec, no I/O (``storage.checksums`` reads and writes it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ManifestError
from .manifest import Manifest, canonical_json, parse_json, whole_number

__all__ = [
    "ATTESTED",
    "CHECKSUMS_FILENAME",
    "DIGEST_SIZES",
    "KINDS",
    "ROT_ONLY",
    "SECOND_PREIMAGE",
    "Attested",
    "ObjectState",
    "Record",
    "Records",
    "StoreChecksum",
    "attesting_kinds",
]

#: The sidecar at the root of a checkpoint: never content, never listed, never signed.
CHECKSUMS_FILENAME = "_integrity_store_checksums.json"
#: What the sidecar says it is, so that a file of that name written by anything else is not taken for one.
FORMAT = "integrity_fs store checksums"
VERSION = 1

#: Checksums a forger would need a second preimage to match: they attest a file.
SECOND_PREIMAGE = ("sha256", "sha1", "md5")
#: Checksums that catch accidental change only (anyone can make other bytes with the same CRC):
#: they attest only with ``attested="crc"``.
ROT_ONLY = ("crc32c", "crc32", "crc64nvme")
KINDS = SECOND_PREIMAGE + ROT_ONLY
#: Raw length of each checksum, in bytes.
DIGEST_SIZES = {"sha256": 32, "sha1": 20, "md5": 16, "crc32c": 4, "crc32": 4, "crc64nvme": 8}

#: ``attested=``: ``True`` for checksums that need a second preimage to forge; ``"crc"``: CRCs too
#: (rot, not a forger); ``False``: nothing attests.
Attested = bool | Literal["crc"]
ATTESTED: tuple[Attested, ...] = (True, False, "crc")

_VALUE = re.compile(r"[0-9a-f]+(?:-[1-9][0-9]{0,4})?")


def attesting_kinds(mode: Attested) -> tuple[str, ...]:
    """The checksums that may attest a file under ``attested=mode``, strongest first."""
    if mode == "crc":
        return KINDS
    return SECOND_PREIMAGE if mode else ()


@dataclass(frozen=True)
class StoreChecksum:
    """A checksum a store keeps for an object: of its bytes (full-object), or composite over its
    parts (the checksum of the parts' raw checksums, S3's ``-N`` suffix).

    ``parts`` is the part count of a composite checksum when the store says it (``None`` otherwise).
    """

    digest: str  # lowercase hex
    composite: bool
    parts: int | None = None
    algorithm: str = "sha256"

    @property
    def value(self) -> str:
        """How records keep it: the hex digest, with ``-N`` for a composite of N parts (``-?``
        when the store did not say how many, which no record holds)."""
        if not self.composite:
            return self.digest
        return f"{self.digest}-{self.parts if self.parts is not None else '?'}"


@dataclass(frozen=True)
class ObjectState:
    """What a store shows for one object now: its version (S3's ETag without quotes, GCS's
    generation), the checksums it keeps, by algorithm, and the algorithms of checksums it keeps
    whose values it did not show (an S3 listing names them; a request gives them)."""

    version: str | None
    checksums: Mapping[str, StoreChecksum] = field(default_factory=dict)
    unlisted: tuple[str, ...] = ()


@dataclass(frozen=True)
class Record:
    """What integrity_fs checked of one file: the bytes it read or wrote (``size`` of them) gave
    ``digest`` under the sidecar's hashing and the store's checksums ``checksums`` (algorithm ->
    :attr:`StoreChecksum.value`) of the object's version ``version``."""

    digest: str
    size: int
    version: str
    checksums: Mapping[str, str]

    def attests(self, digest: str, size: int, state: ObjectState | None, kinds: tuple[str, ...]) -> str | None:
        """The checksum (strongest first, among ``kinds``) that shows the object is still the
        one recorded, for a file the manifest gives ``digest`` and ``size``; ``None`` if none does.

        The object must still be the version recorded (S3's ETag, GCS's generation): a replaced
        object attests nothing even when its checksum matches (a CRC is easy to match on purpose)."""
        if state is None or state.version is None or state.version != self.version:
            return None
        if digest != self.digest or size != self.size:
            return None
        for kind in kinds:
            want, now = self.checksums.get(kind), state.checksums.get(kind)
            if want is not None and now is not None and now.value == want:
                return kind
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"checksums": dict(self.checksums), "digest": self.digest, "size": self.size, "version": self.version}


@dataclass(frozen=True)
class Records:
    """The sidecar: records of one hashing (algorithm, granularity, chunk size), by file name."""

    algorithm: str
    granularity: str
    chunk_size: int | None
    files: Mapping[str, Record] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest) -> Records:
        """No records yet, for ``manifest``'s hashing."""
        return cls(manifest.algorithm, manifest.granularity, manifest.chunk_size)

    def fits(self, manifest: Manifest) -> bool:
        """Whether these digests are comparable with ``manifest``'s (the same hashing)."""
        return (self.algorithm, self.granularity, self.chunk_size) == (
            manifest.algorithm,
            manifest.granularity,
            manifest.chunk_size,
        )

    def attested_by(
        self, manifest: Manifest, name: str, state: ObjectState | None, kinds: tuple[str, ...]
    ) -> str | None:
        """The checksum that attests ``name`` (see :meth:`Record.attests`), or ``None``."""
        record = self.files.get(name)
        if record is None or manifest.sizes is None or not self.fits(manifest):
            return None
        return record.attests(manifest.files[name], manifest.sizes[name], state, kinds)

    def merged(self, manifest: Manifest, new: Mapping[str, Record]) -> Records:
        """These records with ``new`` ones, for ``manifest``: records of another hashing, or of
        files it does not list with that digest, are dropped (they could attest nothing)."""
        kept = self.files if self.fits(manifest) else {}
        files = {n: r for n, r in kept.items() if manifest.files.get(n) == r.digest}
        files.update(new)
        return Records(manifest.algorithm, manifest.granularity, manifest.chunk_size, dict(sorted(files.items())))

    def to_json(self) -> bytes:
        """Canonical bytes, as the manifest's (sorted keys, two-space indent, trailing newline)."""
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "files": {name: record.to_dict() for name, record in self.files.items()},
            "format": FORMAT,
            "granularity": self.granularity,
            "version": VERSION,
        }
        if self.chunk_size is not None:
            out["chunk_size"] = self.chunk_size
        return (canonical_json(out) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> Records:
        """Parse sidecar bytes; ``ManifestError`` says what is wrong with them."""
        data = parse_json(raw, "store checksums")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ManifestError(f"not a sidecar of integrity_fs store checksums (no 'format': {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ManifestError(
                f"store checksums version {data.get('version')!r} is not supported (expected {VERSION})"
            )
        algorithm, granularity, chunk_size = data.get("algorithm"), data.get("granularity"), data.get("chunk_size")
        if not isinstance(algorithm, str) or not isinstance(granularity, str):
            raise ManifestError("store checksums without an 'algorithm' and a 'granularity'")
        if chunk_size is not None and not whole_number(chunk_size):
            raise ManifestError(f"store checksums 'chunk_size' {chunk_size!r} is not a whole number")
        files = data.get("files")
        if not isinstance(files, dict):
            raise ManifestError("store checksums 'files' is not an object")
        return cls(algorithm, granularity, chunk_size, {str(n): _record(n, r) for n, r in files.items()})


def _record(name: object, data: object) -> Record:
    if not isinstance(data, dict):
        raise ManifestError(f"store checksums of {name!r} are not an object")
    digest, size, version, checksums = (data.get(k) for k in ("digest", "size", "version", "checksums"))
    if not isinstance(digest, str) or not isinstance(version, str):
        raise ManifestError(f"store checksums of {name!r}: no 'digest' or 'version'")
    if not whole_number(size) or size < 0:
        raise ManifestError(f"store checksums of {name!r}: 'size' {size!r} is not a byte count")
    if not isinstance(checksums, dict) or not all(
        kind in KINDS and isinstance(value, str) and _VALUE.fullmatch(value) for kind, value in checksums.items()
    ):
        raise ManifestError(f"store checksums of {name!r}: 'checksums' are not known checksums in hex")
    return Record(digest, size, version, dict(checksums))
