"""seal, verify and read_manifest: list, hash, compare. Storage goes through ``storage``,
the rules of digests through ``hashing``, the format through ``manifest``."""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec.callbacks import Callback

from . import formats, signing, storage
from .errors import IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .hashing import (
    DEFAULT_ALGORITHM,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_GRANULARITY,
    Unit,
    check_granularity,
    chunk_range,
    file_digest,
    new_hasher,
    plan_units,
)
from .manifest import MANIFEST_FILENAME, Manifest, check_name
from .report import Problem as Problem  # re-exported: core has always offered them
from .report import Report as Report

if TYPE_CHECKING:
    from ._s3 import StoreChecksum

log = logging.getLogger("integrity_fs")
T = TypeVar("T")
R = TypeVar("R")

URL = str | os.PathLike[str]


@dataclass(frozen=True)
class Grown:
    """What reading a unit found when its file does not hold the planned bytes: more than
    sealed, or (the store confirms) fewer than listed; ``size`` is what it holds, if known."""

    size: int | None


#: What hashing a unit gives: its digest; ``None`` when the file vanished; ``Grown`` when the
#: file turned out longer than sealed or shorter than listed.
UnitOutcome = str | Grown | None

#: Concurrent reads on object stores, where latency, not the CPU, is the limit.
REMOTE_WORKERS = 16


def read_manifest(
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``url``; nothing else is read."""
    fs_, root = storage.resolve(url, storage_options, fs)
    return load_manifest(fs_, root)


def load_manifest(fs: fsspec.AbstractFileSystem, root: str) -> Manifest:
    path = storage.join(root, MANIFEST_FILENAME)
    try:
        raw = storage.read_file(fs, path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        storage.check_root(fs, root)  # a root that is not there, or is a file, is not "never sealed"
        raise ManifestNotFoundError(
            f"no {MANIFEST_FILENAME} at {storage.describe(fs, root)}: the checkpoint was never sealed"
        ) from exc
    except IsADirectoryError as exc:
        raise ManifestError(f"{path} is a directory, not a manifest") from exc
    except storage.NotARegularFileError as exc:  # a FIFO, socket or device: never opened for reading
        raise ManifestError(f"{exc}: not a manifest") from exc
    try:
        return Manifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"{storage.describe(fs, root)}/{MANIFEST_FILENAME}: {exc}") from exc


def seal(
    url: URL,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    granularity: str = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """Hash every file under ``url`` and write the manifest beside them, last and atomically.

    A root that already holds a manifest raises ``FileExistsError`` before any content is read,
    unless ``overwrite=True``: sealing again accepts whatever the files hold now, damage included.
    A seal that fails part-way writes nothing: an earlier manifest stays as it was. With
    ``private_key`` (a PEM path or a ``cryptography`` EC key), ``model.sig`` is written right
    after the manifest, from the same digests.
    """
    chunk_size = check_seal_options(algorithm, granularity, chunk_size)
    key = None if private_key is None else load_signing_key(private_key, algorithm, granularity)
    fs_, root = storage.resolve(url, storage_options, fs)
    if not overwrite:
        refuse_if_sealed(fs_, root)
    started = time.perf_counter()
    identities: dict[str, storage.LocalIdentity] = {}
    sizes = list_for_seal(fs_, root, identities=identities)
    if key is not None:
        signing.check_shard_names(granularity, sizes)
    check_chunk_count(sizes, chunk_size)
    units = plan_units(granularity, sizes, chunk_size)
    digests = hash_units(fs_, root, algorithm, units, max_workers=max_workers, callback=callback)
    if None in digests.values():
        gone = sorted({u.name for u, d in digests.items() if d is None})
        raise FileNotFoundError(f"files vanished while sealing {storage.describe(fs_, root)}: {', '.join(gone)}")
    manifest = build_manifest(algorithm, granularity, chunk_size, sizes, digests)
    del units, digests, sizes  # the manifest holds what is needed: 100k files' worth is ~25 MB less
    refuse_if_changed(fs_, root, identities)
    signature = None if key is None else signing.sign(manifest, key, model_name(root))
    write_manifest(fs_, root, manifest)
    if signature is not None:
        write_signature(fs_, root, signature)
    _log_done("sealed", storage.describe(fs_, root), len(manifest.files), manifest.total_bytes or 0, started)
    return manifest


def list_for_seal(
    fs: fsspec.AbstractFileSystem, root: str, *, identities: dict[str, storage.LocalIdentity] | None = None
) -> dict[str, int]:
    """The files to seal (name -> size), after checking that the root is a directory and that
    the manifest can hold every name; ``ValueError`` naming the files it cannot hold.
    ``identities``: as for ``storage.list_files`` (see :func:`refuse_if_changed`)."""
    sizes = storage.list_files(fs, root, identities=identities)
    if not sizes:  # a root that is a file lists nothing on some stores
        storage.check_root(fs, root)
    bad = [f"{_shown(name)} ({reason})" for name in sizes if (reason := _unholdable(name))]
    if bad:
        shown = "; ".join(bad[:10]) + (f"; ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ValueError(
            f"cannot seal {storage.describe(fs, root)}: a manifest cannot hold these file names, rename them: {shown}"
        )
    return sizes


def refuse_if_changed(fs: fsspec.AbstractFileSystem, root: str, identities: dict[str, storage.LocalIdentity]) -> None:
    """``OSError`` naming the local files written to or replaced since they were listed: a file
    rewritten while it was read (or between its chunks) would be sealed with the digest of bytes
    that never sat on disk together. Nothing to compare on object stores (``identities`` empty)."""
    changed = storage.changed_local_files(root, identities) if identities else []
    if changed:
        shown = ", ".join(map(_shown, changed[:10])) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        raise OSError(
            f"files changed while sealing {storage.describe(fs, root)} (written to or replaced during the read; "
            f"seal again once nothing writes to the checkpoint): {shown}"
        )


def _unholdable(name: str) -> str | None:
    """Why a manifest cannot hold ``name``, or None when it can."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    try:
        check_name(name)
    except ManifestError as exc:
        return str(exc)
    return None


def _shown(name: str) -> str:
    """``name`` for a message: as bytes when it is not valid UTF-8 (surrogate escapes)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return repr(os.fsencode(name))
    return repr(name)


def refuse_if_sealed(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """``FileExistsError`` when ``root`` already holds a manifest."""
    if storage.exists(fs, storage.join(root, MANIFEST_FILENAME)):
        raise FileExistsError(
            f"{storage.describe(fs, root)} is already sealed (it holds {MANIFEST_FILENAME}); sealing again would "
            "accept whatever the files hold now: pass overwrite=True / --force to replace the manifest"
        )


#: Chunks one file may be cut into when sealing: 64 TiB at the default 64 MiB. More means a chunk
#: size given in bytes where MiB were meant (``--chunk-size 64``): millions of digests in the
#: manifest and per-chunk work that never ends, refused before anything is read.
MAX_CHUNKS_PER_FILE = 1_000_000


def check_chunk_count(sizes: Mapping[str, int], chunk_size: int | None) -> None:
    """``ValueError`` when ``chunk_size`` cuts a file of ``sizes`` into more than
    ``MAX_CHUNKS_PER_FILE`` chunks (``chunk_size`` None: file granularity, nothing to check)."""
    if chunk_size is None or not sizes:
        return
    name, size = max(sizes.items(), key=lambda item: item[1])
    chunks = -(-size // chunk_size)
    if chunks > MAX_CHUNKS_PER_FILE:
        raise ValueError(
            f"chunk_size={chunk_size} would cut {_shown(name)} ({size} bytes) into {chunks:,} chunks, more than "
            f"{MAX_CHUNKS_PER_FILE:,}: choose a larger chunk size (in bytes: 64 MiB is 67108864)"
        )


def check_seal_options(algorithm: str, granularity: str, chunk_size: int | None) -> int | None:
    """Validate seal options; returns the chunk size to use (None for file granularity)."""
    new_hasher(algorithm)
    check_granularity(granularity)
    if granularity != "chunk":
        if chunk_size is not None:
            raise ValueError(f"chunk_size applies only to granularity='chunk', not {granularity!r}")
        return None
    if chunk_size is None:
        return DEFAULT_CHUNK_SIZE
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, not {chunk_size!r}")
    return chunk_size


def write_manifest(fs: fsspec.AbstractFileSystem, root: str, manifest: Manifest) -> None:
    storage.write_atomic(fs, storage.join(root, MANIFEST_FILENAME), manifest.to_json())


# --- signatures ----------------------------------------------------------------------------------


def load_signing_key(private_key: signing.PrivateKey, algorithm: str, granularity: str) -> Any:
    """The private key, loaded and checked before any content is read."""
    signing.check_signable(algorithm, granularity)
    return signing.load_private_key(private_key)


def model_name(root: str) -> str:
    """The checkpoint's name as model_signing records it: the root's last component."""
    return root.rstrip("/").rsplit("/", 1)[-1] or "/"


def write_signature(fs: fsspec.AbstractFileSystem, root: str, signature: bytes) -> None:
    storage.write_atomic(fs, storage.join(root, signing.SIGNATURE_FILENAME), signature)


def sign(
    url: URL,
    *,
    private_key: signing.PrivateKey,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
) -> Manifest:
    """Sign the sealed checkpoint at ``url``: verify its content first, then write ``model.sig``.

    A damaged checkpoint is never signed (``IntegrityError``); an unsealed one raises
    ``ManifestNotFoundError``. An existing signature is replaced. Returns the signed manifest.
    """
    fs_, root = storage.resolve(url, storage_options, fs)
    before = load_manifest(fs_, root)
    key = load_signing_key(private_key, before.algorithm, before.granularity)
    verify(root, fs=fs_, max_workers=max_workers, callback=callback)
    manifest = load_manifest(fs_, root)
    if manifest.to_json() != before.to_json():
        raise RuntimeError(f"the manifest at {storage.describe(fs_, root)} changed while it was verified; not signed")
    write_signature(fs_, root, signing.sign(manifest, key, model_name(root)))
    log.info("signed %s", storage.describe(fs_, root))
    return manifest


def load_manifest_if_any(fs: fsspec.AbstractFileSystem, root: str) -> Manifest | None:
    """The root's manifest, or ``None`` when it has none (a signature can stand in for it)."""
    try:
        return load_manifest(fs, root)
    except ManifestNotFoundError:
        return None


def check_signature(
    fs: fsspec.AbstractFileSystem, root: str, manifest: Manifest | None, public_key: signing.PublicKey
) -> Manifest:
    """Check the root's ``model.sig`` with ``public_key`` and against ``manifest``; the manifest
    to verify content against (the signed digests when ``manifest`` is ``None``).

    ``SignatureError`` when the signature is missing, invalid, or covers other digests.
    """
    location = storage.describe(fs, root)
    try:
        data = storage.read_file(fs, storage.join(root, signing.SIGNATURE_FILENAME))
    except (FileNotFoundError, IsADirectoryError) as exc:
        missing = Report(problems=(Problem(signing.SIGNATURE_FILENAME, "missing"),))
        raise SignatureError(
            f"no {signing.SIGNATURE_FILENAME}: the checkpoint is not signed", missing, location
        ) from exc
    signed = signing.open_bundle(data, public_key, location=location)
    if manifest is None:
        return signing.to_manifest(signed, location=location)
    lines, problems = signing.differences(manifest, signed)
    if problems:
        report = Report(problems=tuple(problems))
        raise SignatureError(signing.describe_differences(lines), report, location)
    return manifest


def build_manifest(
    algorithm: str,
    granularity: str,
    chunk_size: int | None,
    sizes: Mapping[str, int],
    digests: Mapping[Unit, UnitOutcome],
) -> Manifest:
    """The manifest for files of ``sizes`` whose units hashed to ``digests``.

    A file that grew while it was read is an ``OSError``: its bytes were never all hashed.
    """
    grown = sorted({u.name for u, d in digests.items() if isinstance(d, Grown)})
    if grown:
        raise OSError(f"files changed size while sealing (not the size listed): {', '.join(grown)}")
    if granularity == "file":  # one unit per file, whose digest is the file's: no lists to build
        by_name = {unit.name: digest for unit, digest in digests.items() if isinstance(digest, str)}
        files = {name: by_name[name] for name in sizes}
        del by_name
        chunks = None
    else:
        by_file = _digests_by_file(digests)
        files = {name: file_digest(algorithm, granularity, by_file[name]) for name in sizes}
        chunks = {name: tuple(by_file[name]) for name in sizes}
    return Manifest(
        files=files,
        sizes=dict(sizes),
        algorithm=algorithm,
        granularity=granularity,
        chunk_size=chunk_size,
        chunks=chunks,
    )


def _digests_by_file(digests: Mapping[Unit, UnitOutcome]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for unit, digest in sorted(digests.items(), key=_by_name_and_index):
        if isinstance(digest, str):
            out.setdefault(unit.name, []).append(digest)
    return out


def _by_name_and_index(item: tuple[Unit, UnitOutcome]) -> tuple[str, int]:
    return item[0].name, item[0].index


def verify(
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    strict: bool = False,
    quick: bool = False,
    manifest: Manifest | URL | None = None,
    attested: bool = False,
    public_key: signing.PublicKey | None = None,
) -> Report:
    """Check the checkpoint at ``url`` against its manifest; raise on any problem.

    Raises ``ManifestNotFoundError`` when there is no manifest, ``ManifestError`` when it is
    invalid, ``IntegrityError`` (with every problem in its report) when content differs, and
    ``OSError`` when storage fails. ``quick`` compares names and sizes from a listing only.
    ``strict`` makes files absent from the manifest problems too, and so does a manifest
    that lists no files (it verifies only a directory with no files). ``manifest``: a
    :class:`Manifest`, or the path or URL of a manifest file in any format :mod:`formats`
    reads (a relative name is inside the root); by default the root's ``_integrity_manifest.json``.
    ``attested`` confirms files whose store-kept SHA-256 equals the manifest's digest without
    reading them (S3 only; the rest are hashed as usual). With ``public_key``, ``model.sig``
    must verify and cover exactly the manifest's digests (``SignatureError``) before content is
    checked; without a manifest, the signed digests are the manifest.
    """
    fs_, root = storage.resolve(url, storage_options, fs)
    started = time.perf_counter()
    manifest_, listing = manifest_and_listing(fs_, root, manifest, public_key)
    plan = plan_verification(manifest_, listing, strict=strict, quick=quick)
    if attested and not quick:
        plan = attest(fs_, root, manifest_, plan)
    digests = hash_units(fs_, root, manifest_.algorithm, plan.units, max_workers=max_workers, callback=callback)
    report = finish_verification(manifest_, plan, digests)
    if not report.ok:
        raise IntegrityError(report, storage.describe(fs_, root))
    _log_done("verified", storage.describe(fs_, root), report.files_checked, report.bytes_checked, started)
    return report


def manifest_and_listing(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
) -> tuple[Manifest, dict[str, int]]:
    """The manifest to verify against (see ``verify``) and the listing to check it with.

    The manifest file in use, like the root's ``_integrity_manifest.json``, is not in the listing.
    With ``public_key`` the signature is checked against that manifest (or stands in for a
    missing default one).
    """
    key = None if public_key is None else signing.load_public_key(public_key)
    in_use = None
    if manifest is None:
        found = load_manifest(fs, root) if key is None else load_manifest_if_any(fs, root)
    elif isinstance(manifest, Manifest):
        found = manifest
    else:
        found, in_use = formats.read_manifest_file(fs, root, manifest)
    listing = storage.list_files(fs, root)
    if in_use is not None:
        listing.pop(in_use, None)
    if key is not None:
        found = check_signature(fs, root, found, key)
    assert found is not None
    return found, listing


def _log_done(what: str, where: str, files: int, nbytes: int, started: float) -> None:
    elapsed = time.perf_counter() - started
    rate = nbytes / elapsed / 1e9 if elapsed > 0 else 0.0
    log.info("%s %s: %d files, %d bytes in %.2f s (%.2f GB/s)", what, where, files, nbytes, elapsed, rate)


@dataclass(frozen=True)
class VerificationPlan:
    """What a listing already shows, and the units left to hash."""

    problems: tuple[Problem, ...]
    extra: tuple[str, ...]
    sizes: Mapping[str, int]  # files to hash: present, and of the manifest's size
    units: tuple[Unit, ...]
    attested: tuple[str, ...] = ()  # files the store's own checksum confirmed: not hashed


def attest(fs: fsspec.AbstractFileSystem, root: str, manifest: Manifest, plan: VerificationPlan) -> VerificationPlan:
    """``plan`` less the files whose store-kept checksum equals their manifest digest.

    A checksum that is absent, not comparable or different attests nothing: the file stays in
    the plan and its read decides (another part layout gives another checksum for the same bytes).
    The two halves, :func:`fetch_checksums` and :func:`attested_names`, are what
    ``distributed.verify`` shares across ranks.
    """
    names = attestable_names(manifest, plan)
    if not names:
        return plan
    return without_attested(plan, attested_names(manifest, fetch_checksums(fs, root, names)))


def attestable_names(manifest: Manifest, plan: VerificationPlan) -> list[str]:
    """The files of ``plan`` whose store checksums are worth asking for, sorted (none for a
    manifest without sizes: a listing has not confirmed their sizes)."""
    if manifest.sizes is None:
        return []
    return sorted(plan.sizes)


def fetch_checksums(fs: fsspec.AbstractFileSystem, root: str, names: Sequence[str]) -> dict[str, StoreChecksum | None]:
    """What the store keeps for each of ``names`` under ``root`` (one request each, no content read)."""
    paths = {storage.join(root, name): name for name in names}
    return {paths[path]: checksum for path, checksum in storage.store_checksums(fs, list(paths)).items()}


def attested_names(manifest: Manifest, checksums: Mapping[str, StoreChecksum | None]) -> set[str]:
    """The names whose store checksum is comparable with, and equal to, their manifest digest."""
    return {
        name
        for name, checksum in checksums.items()
        if checksum is not None
        and attesting_digest(manifest, name, checksum.composite, checksum.parts) == checksum.digest
    }


def without_attested(plan: VerificationPlan, confirmed: Iterable[str]) -> VerificationPlan:
    """``plan`` with the ``confirmed`` files moved from the hashing to ``attested``."""
    confirmed = set(confirmed)
    if not confirmed:
        return plan
    return dataclasses.replace(
        plan,
        sizes={n: s for n, s in plan.sizes.items() if n not in confirmed},
        units=tuple(u for u in plan.units if u.name not in confirmed),
        attested=tuple(sorted(confirmed)),
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
    extra = tuple(name for name in listing if name not in manifest.files)
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
    for unit, outcome in sorted(digests.items(), key=_by_name_and_index):
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
    )


def default_workers(fs: fsspec.AbstractFileSystem) -> int:
    return (os.cpu_count() or 1) if storage.is_local(fs) else REMOTE_WORKERS


#: Local whole files up to this size are hashed in batches (one task per batch, each file read
#: in one call into the task's buffer): their per-file Python work, not the hashing, would
#: otherwise hold the GIL and keep a second thread from helping.
SMALL_FILE = storage.BLOCK_SIZE
#: A batch ends at this many files or this many bytes, whichever comes first.
BATCH_FILES = 64
BATCH_BYTES = 4 * 1024 * 1024


def hash_units(
    fs: fsspec.AbstractFileSystem,
    root: str,
    algorithm: str,
    units: Iterable[Unit],
    *,
    max_workers: int | None = None,
    callback: Callback | None = None,
) -> dict[Unit, UnitOutcome]:
    """Digest of every unit, hashed concurrently, largest first; ``None`` for a vanished file
    (or one that is no longer a regular file), ``Grown`` for a file longer than planned.

    Small local files go in batches, one task each (see ``SMALL_FILE``); the stop flag is
    checked between the files of a batch. The first storage failure stops the rest (within a
    block or a file) and is raised.
    """
    todo = sorted(units, key=_length, reverse=True)
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
        raise ValueError(f"max_workers must be a positive integer, not {max_workers!r}")
    progress = progress_fn(callback, sum(u.length for u in todo))
    stop = threading.Event()
    tasks = _tasks(todo) if storage.is_local(fs) else [[unit] for unit in todo]
    workers = min(max_workers or default_workers(fs), max(1, len(tasks)))
    prefix = root.rstrip("/") + "/"

    def one(unit: Unit, buffer: memoryview | None, report: storage.ProgressFn | None) -> UnitOutcome:
        try:
            return storage.hash_range(
                fs,
                prefix + unit.name,
                algorithm,
                unit.offset,
                unit.length,
                report,
                file_size=unit.file_size,
                stop=stop,
                buffer=buffer,
            )
        except (FileNotFoundError, storage.NotARegularFileError):
            return None
        except storage.SizeChangedError as exc:  # longer than sealed, or shorter now than listed
            return Grown(exc.size)

    def task(index: int) -> list[UnitOutcome]:
        batch = tasks[index]
        if len(batch) == 1 and batch[0].length > SMALL_FILE:
            return [one(batch[0], None, progress)]
        buffer = memoryview(bytearray(batch[0].length + 1))  # the largest first
        outcomes = [one(unit, buffer, None) for unit in batch]
        progress(sum(unit.length for unit in batch))
        return outcomes

    results = run_parallel(task, range(len(tasks)), workers, stop=stop)
    out: dict[Unit, UnitOutcome] = {}
    for index, batch in enumerate(tasks):
        out.update(zip(batch, results.pop(index), strict=True))
    return out


_length = operator.attrgetter("length")


def _tasks(units: Sequence[Unit]) -> list[list[Unit]]:
    """``units`` (largest first) as tasks: one per large unit, batches of small whole files."""
    tasks: list[list[Unit]] = []
    batch: list[Unit] = []
    batch_bytes = 0
    for unit in units:
        if unit.length > SMALL_FILE or unit.offset or unit.file_size != unit.length:
            tasks.append([unit])
            continue
        if len(batch) >= BATCH_FILES or batch_bytes + unit.length > BATCH_BYTES:
            tasks.append(batch)
            batch, batch_bytes = [], 0
        batch.append(unit)
        batch_bytes += unit.length
    if batch:
        tasks.append(batch)
    return tasks


def run_parallel(
    fn: Callable[[T], R], items: Sequence[T], workers: int, *, stop: threading.Event | None = None
) -> dict[T, R]:
    """``fn`` on every item on ``workers`` threads; the first exception is raised.

    On the first exception, or Ctrl-C in the calling thread, ``stop`` is set (``fn`` checks it
    between blocks and raises ``storage.Cancelled``), items not started are dropped, and the call
    returns only once every worker has stopped: no thread goes on reading after it.
    """
    if workers <= 1 or len(items) <= 1:
        return {item: fn(item) for item in items}
    stop = stop if stop is not None else threading.Event()
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="integrity_fs")
    try:
        futures = {pool.submit(fn, item): item for item in items}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # Ctrl-C: stop the running items, start nothing new
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    errors = [error for f in futures if f in done and (error := f.exception()) is not None]
    if errors:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise next((e for e in errors if not isinstance(e, storage.Cancelled)), errors[0])
    pool.shutdown(wait=True)
    return {item: future.result() for future, item in futures.items()}


def progress_fn(callback: Callback | None, total: int) -> storage.ProgressFn:
    """A thread-safe byte counter on ``callback`` (none: fsspec's no-op callback), after telling it the total."""
    cb = Callback.as_callback(callback)
    cb.set_size(total)
    lock = threading.Lock()

    def update(n: int) -> None:
        with lock:
            cb.relative_update(n)

    return update
