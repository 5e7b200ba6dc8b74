"""Recording the stores' own checksums of files integrity_fs read or wrote whole, in the sidecar
beside the manifest (``_integrity_store_checksums.json``), and reading them back.

A :class:`Recording` says which checksums to compute while a whole file is read in order (only
what the store will be asked about, only on S3 and GCS); once the file verified, the checksums
that equal the store's are kept as :class:`~integrity_fs.recorded.Record`\\ s. A
:class:`WriteRecording` does the same for the files a transfer or ``dcp.save`` writes. Writing
the sidecar never fails the operation that recorded: a refusal (a read-only role) is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import fsspec

from ..errors import ManifestError
from ..manifest import Manifest
from ..recorded import CHECKSUMS_FILENAME, ObjectState, Record, Records, StoreChecksum
from ..report import SIGNATURE_FILENAME, printable
from . import gcs, s3
from .checksums import StoreHasher, computable, computed_values, keeps_checksums, listed_states, object_states
from .errors import storage_errors
from .read import Sink, read_file
from .urls import describe, join

__all__ = [
    "Recording",
    "WriteRecording",
    "plan_recording",
    "read_records",
    "record_checksums",
    "record_written",
]

log = logging.getLogger("integrity_fs")


@dataclass(frozen=True)
class _Target:
    size: int
    version: str
    wanted: tuple[StoreChecksum, ...]
    part_size: int | None


class Recording:
    """The store checksums to compute while whole files are read (or written) in order, and what
    they must equal to be recorded. Empty (false) when there is nothing to record."""

    def __init__(self, targets: Mapping[str, _Target] | None = None) -> None:
        self._targets = dict(targets or {})
        self._hashers: dict[str, list[StoreHasher]] = {}

    def __bool__(self) -> bool:
        return bool(self._targets)

    @property
    def names(self) -> list[str]:
        return list(self._targets)

    def hashers(self, name: str) -> list[StoreHasher]:
        """New hashers for one read (or write) of ``name`` from its first byte; the last ones
        made are the ones :meth:`records` judges (a retried read starts again)."""
        target = self._targets.get(name)
        if target is None:
            return []
        made = [StoreHasher(want, target.size, target.part_size) for want in target.wanted]
        self._hashers[name] = made
        return made

    def extra(self) -> dict[str, Callable[[], list[Sink]]]:
        """For ``hash_units``: each file's factory of hashers."""

        def factory(name: str) -> Callable[[], list[Sink]]:
            return lambda: list(self.hashers(name))

        return {name: factory(name) for name in self._targets}

    def records(self, manifest: Manifest) -> dict[str, Record]:
        """The records of the files whose computed checksums equal the store's, bound to the
        manifest's digests (call once the files verified or were sealed)."""
        out: dict[str, Record] = {}
        for name, target in self._targets.items():
            made = self._hashers.get(name)
            if not made or name not in manifest.files:
                continue
            equal = {h.want.algorithm: h.want.value for h in made if h.result() == h.want.value}
            if equal:
                out[name] = Record(manifest.files[name], target.size, target.version, equal)
        return out


def plan_recording(
    fs: fsspec.AbstractFileSystem,
    root: str,
    sizes: Mapping[str, int],
    states: Mapping[str, ObjectState] | None,
    *,
    algorithm: str,
    records: Records | None = None,
    manifest: Manifest | None = None,
) -> Recording:
    """What to compute while reading the whole files of ``sizes`` (name -> size) under ``root``
    on S3 or GCS, from what the listing showed (``states``).

    GCS: its MD5, or for a composite object (no MD5) its CRC32C. S3: the MD5 its ETag is (a
    multipart ETag, over parts of the size its first part has: one HEAD each), and for a
    multipart object or one whose ETag is no MD5, the checksum S3 keeps (one GetObjectAttributes
    each). Objects whose listing shows S3's SHA-256 under a SHA-256 manifest are left out (they
    attest without a record), and so are files that ``records`` already attests for ``manifest``.
    """
    if states is None or not sizes or not keeps_checksums(fs):
        return Recording()
    targets: dict[str, _Target] = {}
    asked: dict[str, ObjectState] = {}
    for name, size in sizes.items():
        state = states.get(name)
        if state is None or state.version is None:
            continue
        if records is not None and manifest is not None and records.attested_by(manifest, name, state, _ALL):
            continue
        if gcs.is_gcs(fs):
            kept = state.checksums.get("md5") or state.checksums.get("crc32c")
            if kept is not None and computable(kept.algorithm):
                targets[name] = _Target(size, state.version, (kept,), None)
            continue
        if algorithm == "sha256" and "sha256" in state.unlisted:
            continue  # written with S3's SHA-256 (by integrity_fs): it attests as it is
        md5 = state.checksums.get("md5")
        if md5 is not None and not md5.composite:
            targets[name] = _Target(size, state.version, (md5,), None)  # one PUT: its ETag is its MD5
        elif md5 is not None or state.unlisted:
            asked[name] = state
    if asked:
        targets.update(_s3_targets(fs, root, sizes, asked))
    return Recording(targets)


_ALL = ("sha256", "sha1", "md5", "crc32c", "crc32", "crc64nvme")


def _s3_targets(
    fs: fsspec.AbstractFileSystem, root: str, sizes: Mapping[str, int], asked: Mapping[str, ObjectState]
) -> dict[str, _Target]:
    """S3 objects whose checksums the listing does not show, or that are composite: what
    GetObjectAttributes says (of the version listed), and the size of their first part."""
    unlisted = [name for name, state in asked.items() if state.unlisted or "md5" not in state.checksums]
    with storage_errors(f"reading the checksums of {len(unlisted)} objects"):
        fetched = object_states(fs, root, unlisted, None) if unlisted else {}
    multipart: dict[str, tuple[StoreChecksum, ...]] = {}
    for name, listed in asked.items():
        now = fetched.get(name)
        kept = dict(listed.checksums)
        if now is not None and now.version == listed.version:
            kept.update(now.checksums)
        wanted = tuple(c for c in kept.values() if computable(c.algorithm) and (not c.composite or c.parts))
        if wanted:
            multipart[name] = wanted
    composite = [name for name, wanted in multipart.items() if any(c.composite for c in wanted)]
    with storage_errors(f"reading the part sizes of {len(composite)} objects"):
        first = s3.first_part_sizes(fs, [join(root, name) for name in composite]) if composite else {}
    out: dict[str, _Target] = {}
    for name, wanted in multipart.items():
        size, version = sizes[name], asked[name].version
        part = first.get(join(root, name))
        usable = tuple(c for c in wanted if not c.composite or _layout_fits(size, c.parts, part))
        if usable and version is not None:
            out[name] = _Target(size, version, usable, part)
    return out


def _layout_fits(size: int, parts: int | None, part_size: int | None) -> bool:
    """Whether ``parts`` parts of ``part_size`` bytes (the last taking the rest) can make ``size`` bytes."""
    if not parts or not part_size:
        return False
    return part_size == size if parts == 1 else (parts - 1) * part_size < size


class WriteRecording:
    """The store checksums of the files a transfer writes to S3 or GCS, computed as they are
    sent, and recorded once the store lists them equal (:func:`record_written`).

    GCS keeps an MD5 of every object a write makes: it is computed. S3 keeps its ETag: for a file
    sent as a plain stream (not with integrity_fs's SHA-256 checksums, which attest as they are),
    its MD5, and the MD5 of its parts' MD5s at s3fs's block size (a multipart upload).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self._fs = fs
        self._gcs, self._s3 = gcs.is_gcs(fs), s3.is_s3(fs)
        self._made: dict[str, list[StoreHasher]] = {}

    def __bool__(self) -> bool:
        return self._gcs or self._s3

    def sinks(self, name: str, size: int | None, *, checksummed: bool) -> list[StoreHasher]:
        """New hashers for one attempt at writing ``name`` (``size`` bytes, ``None``: not known in
        advance); ``checksummed``: the write carries integrity_fs's SHA-256 checksums (nothing
        to record on S3)."""
        md5 = StoreChecksum("", False, None, "md5")
        made: list[StoreHasher] = []
        if self._gcs:
            made = [StoreHasher(md5, size)]
        elif self._s3 and not checksummed:
            block = int(getattr(self._fs, "default_block_size", 0) or 0)
            made = [StoreHasher(md5, size)]
            if block and (size is None or size > block):
                parts = None if size is None else -(-size // block)
                made.append(StoreHasher(StoreChecksum("", True, parts, "md5"), size, block))
        self._made[name] = made
        return made

    def computed(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """What the last attempt at each file computed: (algorithm, value) pairs."""
        return {name: computed_values(made) for name, made in self._made.items()}


def record_written(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    computed: Mapping[str, Iterable[tuple[str, str]]],
    *,
    signed: bool = False,
) -> None:
    """Record the files just written under ``root`` (after the manifest) whose store checksum, in
    a fresh listing, equals one ``computed`` from the bytes sent (name -> (algorithm, value)
    pairs). Never raises for a storage failure (see :func:`record_checksums`). ``signed``: the
    signature there was just made by integrity_fs, and ignores the sidecar."""
    if not computed or not keeps_checksums(fs):
        return
    try:
        states = listed_states(fs, root)
    except OSError as exc:
        log.warning("could not list %s to record its store checksums (%s)", describe(fs, root), printable(str(exc)))
        return
    new: dict[str, Record] = {}
    for name, values in computed.items():
        state = states.get(name)
        if state is None or state.version is None or name not in manifest.files or manifest.sizes is None:
            continue
        equal = {
            algorithm: value
            for algorithm, value in values
            if (kept := state.checksums.get(algorithm)) is not None and kept.value == value
        }
        if equal:
            new[name] = Record(manifest.files[name], manifest.sizes[name], state.version, equal)
    existing = read_records(fs, root) if CHECKSUMS_FILENAME in states else None
    present = [name for name in states if name != SIGNATURE_FILENAME or not signed]
    record_checksums(fs, root, manifest, new, existing=existing, present=present)


# --------------------------------------------------------------------------- the sidecar


def read_records(fs: fsspec.AbstractFileSystem, root: str) -> Records | None:
    """The sidecar at ``root`` (``None`` when there is none). One that cannot be read or parsed is
    logged and ignored: it only spares reads, and every file it would have attested is read."""
    path = join(root, CHECKSUMS_FILENAME)
    try:
        raw = read_file(fs, path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("not using %s (%s): every file is read", printable(describe(fs, path)), printable(str(exc)))
        return None
    try:
        return Records.from_json(raw)
    except ManifestError as exc:
        log.warning("ignoring %s: %s", printable(describe(fs, path)), printable(str(exc)))
        return None


def record_checksums(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    new: Mapping[str, Record],
    *,
    existing: Records | None = None,
    present: Iterable[str] = (),
) -> None:
    """Add ``new`` records to the sidecar at ``root`` (merged with ``existing``, the sidecar read
    before), in one atomic write. ``present``: the names the listing showed at the root beside
    the content; a root that holds ``model.sig`` is left as it is (model_signing's verifier
    refuses files a signature does not ignore, as older signatures do not ignore the sidecar).

    Never raises for a storage failure: the operation that recorded has succeeded, and a role
    allowed to read but not to write is common for audits. It is logged (INFO when refused).
    """
    if not new:
        return
    if SIGNATURE_FILENAME in set(present):
        log.info("not recording store checksums at %s: it is signed (%s)", describe(fs, root), SIGNATURE_FILENAME)
        return
    records = (existing or Records.of(manifest)).merged(manifest, new)
    path = join(root, CHECKSUMS_FILENAME)
    from .write import write_atomic

    try:
        write_atomic(fs, path, records.to_json())
    except PermissionError as exc:
        log.info("could not record store checksums at %s (%s)", printable(describe(fs, path)), printable(str(exc)))
        return
    except Exception as exc:  # storage failures of every kind: the verdict stands
        log.warning(
            "could not record store checksums at %s (%s): attested verifies will read these files",
            printable(describe(fs, path)),
            printable(str(exc)),
        )
        return
    log.info("recorded the store checksums of %d files at %s", len(new), printable(describe(fs, path)))
