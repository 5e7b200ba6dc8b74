"""The verification pipeline: list, compare, hash, report.

Internal: ``integrity_fs.verify`` and every other entry point of a verification run it. One
pipeline, in steps that each entry point calls with its own "where and who": :func:`prepare`
(the manifest read and its signature checked, the root listed, names and sizes compared, units
planned, before any content is read), :func:`attest` (files the store's own checksums confirm,
on request), the hashing (:func:`integrity_fs.work.hash_units`, pinned to the listing; each rank
its share in ``distributed.verify``; the copies' streams in ``download`` and ``copy``; DCP's
reads in ``dcp.load``), and :func:`finish_verification` (the report). :func:`check` runs them all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import manifests, signing, storage
from .errors import IntegrityError, SignatureError
from .hashing import Unit, chunk_range, file_digest, plan_units
from .manifest import Manifest
from .options import Attested, VerifyOptions, Work
from .recorded import CHECKSUMS_FILENAME, ObjectState, Records, attesting_kinds
from .report import Problem, Report, every_file_differs, printable, shortened
from .work import Grown, UnitOutcome, hash_units, log_done, whole_files

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "Prepared",
    "VerificationPlan",
    "attest",
    "attestable_names",
    "attested_names",
    "attesting_digest",
    "check",
    "check_covered",
    "fetch_checksums",
    "finish_verification",
    "plan_verification",
    "prepare",
    "trusts_records",
    "without_attested",
]

log = logging.getLogger("integrity_fs")


def check(fs: fsspec.AbstractFileSystem, root: str, options: VerifyOptions, work: Work) -> Report:
    """The verification pipeline at ``root`` of ``fs``: :func:`prepare`, :func:`attest` (on request),
    the hashing, :func:`finish_verification`; raises as :func:`integrity_fs.verify` does."""
    started = time.perf_counter()
    versions: dict[str, storage.Version] = {}
    states: dict[str, ObjectState] | None = None
    if not options.quick and storage.keeps_checksums(fs):
        states = {}
    prepared = prepare(fs, root, options, versions=None if options.quick else versions, states=states)
    plan = prepared.plan
    if options.attested and not options.quick:
        plan = attest(fs, root, prepared.manifest, plan, mode=options.attested, listed=states, records=prepared.records)
    records = prepared.records
    recording = storage.Recording()
    if states is not None and options.manifest is None:  # what a read of every byte may record
        if records is None and CHECKSUMS_FILENAME in states:
            records = storage.read_records(fs, root)
        recording = storage.plan_recording(
            fs,
            root,
            whole_files(plan.units),
            states,
            algorithm=prepared.manifest.algorithm,
            records=records,
            manifest=prepared.manifest,
        )
    extra = recording.extra() if recording else None
    digests = hash_units(fs, root, prepared.manifest.algorithm, plan.units, versions=versions, work=work, extra=extra)
    report = finish_verification(prepared.manifest, plan, digests)
    if not report.ok:
        if prepared.manifest_format == "sha256sum" and options.manifest_format == "auto":
            warn_if_b3sum(report, options.manifest)
        raise IntegrityError(report, prepared.location)
    if recording:
        new = recording.records(prepared.manifest)
        storage.record_checksums(fs, root, prepared.manifest, new, existing=records, present=states or ())
    log_done("verified", prepared.location, report.files_checked, report.bytes_checked, started)
    return report


def warn_if_b3sum(report: Report, source: object) -> None:
    """A WARNING when every file checked against a list read as ``sha256sum`` output differs
    (:func:`~integrity_fs.report.every_file_differs`)."""
    if every_file_differs(report):
        log.warning(
            "every file differs from %s, read as sha256sum output: if b3sum wrote it (the same layout, "
            "BLAKE3 digests), verify with manifest_format='b3sum' (CLI --manifest-format b3sum)",
            printable(str(source)),
        )


@dataclass(frozen=True)
class Prepared:
    """A verification before any content is read: the manifest in use, what the listing already
    shows (and what is left to hash), and the root as a URL for messages."""

    manifest: Manifest
    plan: VerificationPlan
    location: str
    manifest_format: str | None = None  # the format of the manifest file read, if one was
    records: Records | None = None  # the recorded store checksums, read for an attested verification


def prepare(
    fs: fsspec.AbstractFileSystem,
    root: str,
    options: VerifyOptions,
    *,
    sizes: dict[str, int] | None = None,
    versions: dict[str, storage.Version] | None = None,
    states: dict[str, ObjectState] | None = None,
) -> Prepared:
    """The manifest to verify against (see :func:`integrity_fs.verify`), its signature checked with
    ``options.public_key``, and the root's listing compared with it (``sizes``: a listing already made;
    ``versions`` and ``states`` receive the listing's versions and store checksums otherwise).

    The manifest file in use, like the root's ``_integrity_manifest.json``, is not in the listing.
    For an attested verification against the root's own manifest, the recorded store checksums
    are read too. With a key or an external manifest they are not (see :func:`trusts_records`).

    The listing holds every file a verification must account for: temporary files left at the
    root by an interrupted write of ours are files here (extra, unless the manifest lists them),
    so ``strict`` and a signature see them. With a key, a file the signature does not cover is a
    ``SignatureError``, ``strict`` or not (model_signing's verifier refuses such files too), except
    an empty file under model_signing's own shards (no shard can cover it; its verifier accepts it).
    """
    manifest, in_use, kind, empty_unsigned = manifests.manifest_in_use(fs, root, options)
    if sizes is not None:
        listing = dict(sizes)
    else:  # quick: in the store's order (only compared with the manifest; sorting is a sixth of the cost)
        listing = storage.list_files(
            fs, root, versions=versions, leftovers=True, states=states, ordered=not options.quick
        )
    if in_use is not None:
        listing.pop(in_use, None)
    if empty_unsigned:  # model_signing's shards: the root's empty files pass while empty
        manifest = signing.with_empty_files(manifest, listing)
    if options.public_key is not None:
        check_covered(manifest, listing, storage.describe(fs, root))
    plan = plan_verification(manifest, listing, strict=options.strict, quick=options.quick)
    records = None
    listed = states is None or CHECKSUMS_FILENAME in states  # a listing made here shows the sidecar
    if options.attested and not options.quick and trusts_records(options) and storage.keeps_checksums(fs) and listed:
        records = storage.read_records(fs, root)
    return Prepared(manifest, plan, storage.describe(fs, root), kind, records)


def trusts_records(options: VerifyOptions) -> bool:
    """Whether the sidecar of recorded store checksums may attest files: only against the root's
    own manifest without a key. Whoever can write the bucket can write the sidecar, and could
    rewrite that manifest too; a signature or an external manifest is trusted beyond the bucket,
    so there only the store's SHA-256 compared with its digests attests."""
    return options.public_key is None and options.manifest is None


def check_covered(signed: Manifest, listing: Mapping[str, int], location: str) -> None:
    """``SignatureError`` naming the files of ``listing`` that ``signed`` (the digests a verified
    signature covers) does not list."""
    uncovered = sorted(name for name in listing if name not in signed.files)
    if not uncovered:
        return
    shown = shortened(uncovered, 10)
    report = Report(problems=tuple(Problem(name, "extra", actual=listing[name]) for name in uncovered))
    raise SignatureError(f"files the signature does not cover: {shown}", report, location)


@dataclass(frozen=True)
class VerificationPlan:
    """What a listing already shows, and the units left to hash."""

    problems: tuple[Problem, ...]
    extra: tuple[str, ...]
    sizes: Mapping[str, int]  # files to hash: present, and of the manifest's size
    units: tuple[Unit, ...]
    attested: tuple[str, ...] = ()  # files the store's own checksum confirmed: not hashed
    attested_by: Mapping[str, str] = field(default_factory=dict)  # each one's checksum ("sha256", "md5", ...)


def attest(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    plan: VerificationPlan,
    *,
    mode: Attested = True,
    listed: Mapping[str, ObjectState] | None = None,
    records: Records | None = None,
) -> VerificationPlan:
    """``plan`` less the files the store's own checksums confirm: a SHA-256 equal to their
    manifest digest, or (from ``records``, never with a key) a checksum equal to the one recorded
    when integrity_fs last read or wrote every byte of them. ``mode``: ``True`` for checksums a
    forger needs a second preimage to match (SHA-256, SHA-1, MD5), ``"crc"`` for CRCs as well.

    A checksum that is absent, not comparable or different attests nothing: the file stays in
    the plan and its read decides (another part layout gives another checksum for the same bytes).
    The two halves, :func:`fetch_checksums` and :func:`attested_names`, are what
    ``distributed.verify`` shares across ranks.
    """
    names = attestable_names(manifest, plan)
    if not names:
        return plan
    checksums = fetch_checksums(fs, root, names, manifest=manifest, listed=listed, records=records, mode=mode)
    return without_attested(plan, attested_names(manifest, checksums, records=records, mode=mode))


def attestable_names(manifest: Manifest, plan: VerificationPlan) -> list[str]:
    """The files of ``plan`` whose store checksums are worth asking for, sorted (none for a
    manifest without sizes: a listing has not confirmed their sizes)."""
    if manifest.sizes is None:
        return []
    return sorted(plan.sizes)


def fetch_checksums(
    fs: fsspec.AbstractFileSystem,
    root: str,
    names: Sequence[str],
    *,
    manifest: Manifest | None = None,
    listed: Mapping[str, ObjectState] | None = None,
    records: Records | None = None,
    mode: Attested = True,
) -> dict[str, ObjectState | None]:
    """What the store shows for each of ``names`` under ``root``, with the fewest requests it
    allows and no content read: the listing's (``listed``, or a fresh one on GCS) for files it
    already attests from ``records``; on S3 one GetObjectAttributes request for each other file."""
    if not storage.keeps_checksums(fs):
        return dict.fromkeys(names)
    kinds = attesting_kinds(mode)
    done: dict[str, ObjectState | None] = {}
    if records is not None and manifest is not None and listed is not None:
        for name in names:
            state = listed.get(name)
            if records.attested_by(manifest, name, state, kinds):
                done[name] = state
    rest = storage.object_states(fs, root, [n for n in names if n not in done], listed)
    return {name: done[name] if name in done else rest.get(name) for name in names}


def attested_names(
    manifest: Manifest,
    checksums: Mapping[str, ObjectState | None],
    *,
    records: Records | None = None,
    mode: Attested = True,
) -> dict[str, str]:
    """The names the store's checksums attest, each with the checksum that did: ``"sha256"``
    where S3's SHA-256 is comparable with, and equal to, the manifest digest; else the recorded
    checksum (of ``mode``'s kinds, strongest first) the store still shows."""
    kinds = attesting_kinds(mode)
    out: dict[str, str] = {}
    for name, state in checksums.items():
        if state is None:
            continue
        direct = state.checksums.get("sha256")
        if direct is not None and attesting_digest(manifest, name, direct.composite, direct.parts) == direct.digest:
            out[name] = "sha256"
            continue
        kind = records.attested_by(manifest, name, state, kinds) if records is not None else None
        if kind is not None:
            out[name] = kind
    return out


def without_attested(plan: VerificationPlan, confirmed: Mapping[str, str] | Iterable[str]) -> VerificationPlan:
    """``plan`` with the ``confirmed`` files (and, given as a mapping, the checksum that confirmed
    each; S3's SHA-256 otherwise) moved from the hashing to ``attested``."""
    by = dict(confirmed) if isinstance(confirmed, Mapping) else dict.fromkeys(confirmed, "sha256")
    if not by:
        return plan
    return dataclasses.replace(
        plan,
        sizes={n: s for n, s in plan.sizes.items() if n not in by},
        units=tuple(u for u in plan.units if u.name not in by),
        attested=tuple(sorted(by)),
        attested_by=dict(sorted(by.items())),
    )


def attesting_digest(manifest: Manifest, name: str, composite: bool, parts: int | None = None) -> str | None:
    """The manifest digest a store-kept SHA-256 of ``name`` must equal to attest it; ``None``
    when none is comparable.

    A full-object checksum is the SHA-256 of the bytes: ``files[name]`` (file granularity) or
    the only chunk's digest. A composite checksum is the SHA-256 of the parts' raw digests:
    ``files[name]`` of a chunk manifest (equal only if every part is the chunk of the same
    index, byte for byte, so a part count S3 does not report is not needed).
    """
    if manifest.algorithm != "sha256":
        return None
    chunks = manifest.chunks[name] if manifest.chunks is not None else None
    if not composite:
        if manifest.granularity == "file":
            return manifest.files[name]
        return chunks[0] if chunks is not None and len(chunks) == 1 else None
    if chunks is not None and (parts is None or parts == len(chunks)):
        return manifest.files[name]
    return None


def plan_verification(
    manifest: Manifest, listing: Mapping[str, int], *, strict: bool = False, quick: bool = False
) -> VerificationPlan:
    """Compare names and sizes; plan the hashing of every file that passes (none if ``quick``)."""
    if manifest.sizes is not None and manifest.sizes == listing:  # the common case, compared at C speed
        units = () if quick else tuple(plan_units(manifest.granularity, listing, manifest.chunk_size))
        return VerificationPlan((), (), listing, units)
    problems: list[Problem] = []
    sizes: dict[str, int] = {}
    for name, digest in manifest.files.items():
        if name not in listing:
            problems.append(Problem(name, "missing", expected=digest))
            continue
        expected = listing[name] if manifest.sizes is None else manifest.sizes[name]
        if listing[name] != expected:
            problems.append(Problem(name, "size", expected=expected, actual=listing[name]))
            continue
        sizes[name] = expected
    extra = tuple(sorted(name for name in listing if name not in manifest.files))
    # A manifest that lists no files vouches for nothing: it verifies only an empty directory,
    # never whatever happens to sit beside it.
    if strict or not manifest.files:
        problems.extend(Problem(name, "extra", actual=listing[name]) for name in extra)
    units = () if quick else tuple(plan_units(manifest.granularity, sizes, manifest.chunk_size))
    return VerificationPlan(tuple(problems), extra, sizes, units)


def finish_verification(manifest: Manifest, plan: VerificationPlan, digests: Mapping[Unit, UnitOutcome]) -> Report:
    """The report once ``plan.units`` have been hashed to ``digests`` (``None``: file vanished;
    ``Grown``: the file holds more bytes than sealed, a ``"size"`` problem)."""
    problems = list(plan.problems)
    vanished: set[str] = set()
    grown: dict[str, Grown] = {}
    by_file: dict[str, list[str]] = {}
    bytes_checked = 0
    for unit, outcome in sorted(digests.items(), key=lambda item: (item[0].name, item[0].index)):
        if isinstance(outcome, str):
            by_file.setdefault(unit.name, []).append(outcome)
            bytes_checked += unit.length
        elif outcome is None:
            vanished.add(unit.name)
        else:
            grown[unit.name] = outcome
    hashed = dict.fromkeys(sorted(u.name for u in plan.units))
    for name in hashed:
        expected = manifest.files[name]
        if name in vanished:
            problems.append(Problem(name, "missing", expected=expected))
            continue
        if name in grown:
            problems.append(Problem(name, "size", expected=plan.sizes[name], actual=grown[name].size))
            continue
        got = by_file[name]
        file_level = manifest.granularity == "file"
        actual = got[0] if file_level else file_digest(manifest.algorithm, manifest.granularity, got)
        if actual == expected:
            continue
        ranges: tuple[tuple[int, int], ...] = ()
        if manifest.chunks is not None and manifest.chunk_size is not None:
            size = plan.sizes[name]
            ranges = tuple(
                chunk_range(size, manifest.chunk_size, i)
                for i, (want, got) in enumerate(zip(manifest.chunks[name], by_file[name], strict=True))
                if want != got
            )
        problems.append(Problem(name, "mismatch", expected=expected, actual=actual, byte_ranges=ranges))
    problems.sort(key=lambda p: (p.path, p.kind))
    missing = sum(1 for p in problems if p.kind == "missing")
    return Report(
        problems=tuple(problems),
        extra=plan.extra,
        files_checked=len(manifest.files) - missing,
        bytes_checked=bytes_checked,
        files_attested=len(plan.attested),
        attested_by=dict(plan.attested_by) if plan.attested_by else dict.fromkeys(plan.attested, "sha256"),
    )
