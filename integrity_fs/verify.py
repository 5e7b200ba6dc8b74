"""seal, verify and sign: one pipeline, list → plan → hash → compare → report.

:func:`prepare` reads the manifest in use (and checks its signature), lists the root and compares
names and sizes before any content is read; :func:`attest` drops the files the store's own
checksums confirm; :func:`hash_units` reads the rest through the pinned reader on a pool of
threads; :func:`finish` compares and reports. ``distributed``, ``dcp`` and the transfers run the
same steps with their own hands in the middle.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import storage
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .hashing import Unit, check_signable, chunk_range, combine, is_crc, plan_units
from .manifest import MANIFEST_FILENAME, Manifest, check_name
from .options import SealOptions, VerifyOptions
from .report import Problem, Report, printable, shortened
from .storage import URL, Stat
from .work import Progress, log_done, run_parallel, workers_for

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import SealKeywords, VerifyKeywords

__all__ = ["Plan", "check", "finish", "hash_units", "prepare", "read_manifest", "seal", "sign", "verify"]

log = logging.getLogger("integrity_fs")

#: Local whole files up to this size are hashed in batches (one task per batch).
_SMALL = 1024 * 1024
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


# ----------------------------------------------------------------------------- the manifest


def read_manifest(url: URL, *, storage_options: dict[str, Any] | None = None, fs: Any = None) -> Manifest:
    """The manifest of the checkpoint at ``url``, read and validated; nothing else is read."""
    return load_manifest(*storage.resolve(url, storage_options, fs))


def load_manifest(fs: Any, root: str) -> Manifest:
    path = storage.join(root, MANIFEST_FILENAME)
    try:
        raw = storage.read_file(fs, path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        storage.check_root(fs, root)  # a root that is not there is not "never sealed"
        raise ManifestNotFoundError(
            f"no {MANIFEST_FILENAME} at {storage.describe(fs, root)}: the checkpoint was never sealed"
        ) from exc
    except (IsADirectoryError, storage.NotARegularFileError) as exc:
        what = f"{storage.describe(fs, path)} is {storage.kind_of(exc)}"
        raise ManifestError(f"{what}, not a regular file: not a manifest") from exc
    try:
        return Manifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"{storage.describe(fs, path)}: {exc}") from exc


def _manifest_file(
    fs: Any, root: str, source: str | os.PathLike[str], kind: str, signed: bool
) -> tuple[Manifest, str | None]:
    """The manifest in the file ``source`` (a bare name is inside the root; ``./x``, ``../x`` and
    absolute paths are local paths; a URL is read through ``fs`` when it names the same protocol),
    and its name inside the root, if it lies there (never content)."""
    text = os.fspath(source)
    if _URL.match(text) or os.path.isabs(text) or text.startswith(("./", "../")):
        same = _URL.match(text) is not None and text.split("://", 1)[0] in storage.urls._protocols(fs)
        mfs, path = storage.resolve(text, fs=fs) if same else storage.resolve(text)
        same_fs = mfs is fs or (storage.is_local(mfs) and storage.is_local(fs))
        inside = same_fs and path.startswith(root + "/")
        name = path[len(root) + 1 :] if inside else None
    else:
        try:
            name = text if text == MANIFEST_FILENAME else check_name(text)
        except ManifestError as exc:
            raise ValueError(
                f"manifest {text!r} is not a name inside the checkpoint ({exc}): pass ./NAME or a URL"
            ) from None
        mfs, path = fs, storage.join(root, name)
    where = storage.describe(mfs, path)
    try:
        raw = storage.read_file(mfs, path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        storage.check_root(fs, root)
        raise ManifestNotFoundError(f"no manifest file at {where}") from exc
    except (IsADirectoryError, storage.NotARegularFileError) as exc:
        raise ManifestError(f"{where} is {storage.kind_of(exc)}, not a regular file: not a manifest") from exc
    from . import formats

    try:
        kind = formats.detect(raw, name=path.rsplit("/", 1)[-1]) if kind == "auto" else kind
        manifest = formats.load(raw, kind)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from exc
    if kind == "model_signing" and not signed:
        why = "the digests of a model_signing bundle, whose signature is NOT checked (pass public_key to check it)"
        log.warning("%s: %s", printable(where), why)
    if name is not None and name in manifest.files:
        log.warning("%s lists itself: that entry is left out (no file holds its own digest)", printable(where))
        manifest = _without(manifest, {name})
    return manifest, name


def _without(manifest: Manifest, names: set[str]) -> Manifest:
    def drop(mapping: Mapping[str, Any] | None) -> Any:
        return None if mapping is None else {k: v for k, v in mapping.items() if k not in names}

    return dataclasses.replace(
        manifest, files=drop(manifest.files), sizes=drop(manifest.sizes), chunks=drop(manifest.chunks)
    )


def manifest_in_use(fs: Any, root: str, options: VerifyOptions) -> tuple[Manifest, str | None, bool]:
    """The manifest to check against (``options.manifest``, else the root's), its signature checked
    with ``options.public_key``; the name of its file inside the root (never content); and whether
    the root's empty files pass while empty (a model_signing shards bundle names none)."""
    wanted, name = options.manifest, None
    if isinstance(wanted, Manifest):
        manifest: Manifest | None = wanted
    elif wanted is not None:
        manifest, name = _manifest_file(fs, root, wanted, options.manifest_format, options.public_key is not None)
    else:
        try:
            manifest = load_manifest(fs, root)
        except ManifestNotFoundError:
            if options.public_key is None:
                raise
            manifest = None  # the signed digests stand in for it
    if options.public_key is None:
        assert manifest is not None
        return manifest, name, False
    from . import signing

    path = storage.join(root, storage.SIGNATURE_FILENAME)
    location = storage.describe(fs, root)
    if manifest is not None:
        signing.check_signed_algorithm(manifest, location)  # a CRC manifest is never vouched for, signed or not
    try:
        data = storage.read_file(fs, path)
    except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError) as exc:
        problems = (Problem(MANIFEST_FILENAME, "missing"),) if manifest is None else ()
        nor = f" (nor sealed: no {MANIFEST_FILENAME})" if manifest is None else ""
        report = Report(problems=(*problems, Problem(storage.SIGNATURE_FILENAME, "missing")))
        what = "no" if isinstance(exc, FileNotFoundError) else f"{storage.kind_of(exc)} named"
        detail = f"{what} {storage.SIGNATURE_FILENAME}: the checkpoint is not signed{nor}"
        raise SignatureError(detail, report, location) from exc
    expected = options.expected_name
    signed, covers_empty = signing.check(data, options.public_key, manifest, expected_name=expected, location=location)
    return signed, name, not covers_empty


# ----------------------------------------------------------------------------- verification


@dataclass
class Plan:
    """A verification before content is read: the manifest, what the listing already shows, and
    the units left to hash."""

    manifest: Manifest
    location: str
    listing: dict[str, Stat]
    problems: list[Problem]
    extra: tuple[str, ...]
    units: list[Unit]
    attested: dict[str, str] = field(default_factory=dict)
    trusted: bool = True  # the root's own manifest, no key: a CRC of the store may attest


def leftovers(meta: Mapping[str, Stat]) -> dict[str, Stat]:
    """The temporary files of interrupted writes among a listing's ``meta``."""
    return {n: s for n, s in meta.items() if n.startswith(storage.TEMP_PREFIX)}


def prepare(fs: Any, root: str, options: VerifyOptions, listing: dict[str, Stat] | None = None) -> Plan:
    """:class:`Plan` for ``root``: the manifest in use (signature checked), the listing compared
    with it by names and sizes. With a key, a file the signature does not cover is a
    ``SignatureError``, ``strict`` or not."""
    manifest, in_root, empty_pass = manifest_in_use(fs, root, options)
    if listing is None:
        meta: dict[str, Stat] = {}
        listing = storage.list_files(fs, root, meta)
        listing = dict(sorted({**listing, **leftovers(meta)}.items()))  # never sealed, but there: extra like any other
    listing = dict(listing)
    if in_root is not None:
        listing.pop(in_root, None)
    location = storage.describe(fs, root)
    if empty_pass:
        from .signing import with_empty_files

        manifest = with_empty_files(manifest, {n: s.size for n, s in listing.items()})
    if options.public_key is not None:
        uncovered = sorted(n for n in listing if n not in manifest.files)
        if uncovered:
            report = Report(problems=tuple(Problem(n, "extra", actual=listing[n].size) for n in uncovered))
            raise SignatureError(f"files the signature does not cover: {shortened(uncovered, 10)}", report, location)
    problems: list[Problem] = []
    sizes = {name: stat.size for name, stat in listing.items()}
    if sizes == manifest.sizes:  # the common case, compared at C speed
        return Plan(
            manifest,
            location,
            listing,
            problems,
            (),
            [] if options.quick else plan_units(sizes, manifest.chunk_size),
            trusted=options.manifest is None and options.public_key is None,
        )
    sizes = {}
    for name, digest in manifest.files.items():
        found = listing.get(name)
        expected = None if manifest.sizes is None else manifest.sizes[name]
        if found is None:
            problems.append(Problem(name, "missing", expected=digest))
        elif expected is not None and found.size != expected:
            problems.append(Problem(name, "size", expected=expected, actual=found.size))
        else:
            sizes[name] = found.size
    extra = tuple(n for n in listing if n not in manifest.files)
    if options.strict or not manifest.files:  # a manifest of no files vouches only for an empty folder
        problems.extend(Problem(n, "extra", actual=listing[n].size) for n in extra)
    units = [] if options.quick else plan_units(sizes, manifest.chunk_size)
    trusted = options.manifest is None and options.public_key is None
    return Plan(manifest, location, listing, problems, extra, units, trusted=trusted)


def attest(fs: Any, root: str, plan: Plan) -> None:
    """Drop from ``plan`` the files whose store checksum equals their manifest digest (no byte
    read): S3's SHA-256 (full object, or composite of the chunks), and, against a trusted
    manifest, the full-object CRC of the manifest's algorithm (S3 CRC-64/NVME or CRC32C, GCS
    CRC32C from the listing). Anything else is read, and the read decides."""
    m = plan.manifest
    names = sorted({u.name for u in plan.units})
    if not names or not (storage.is_s3(fs) or storage.is_gcs(fs)):
        return
    crc = m.algorithm in ("crc64nvme", "crc32c")
    if crc and not plan.trusted:
        return  # anyone can match a CRC: it attests only against the root's own manifest, without a key
    if storage.is_gcs(fs):
        if m.algorithm != "crc32c":
            return
        found = {n: {"crc32c": storage.s3.Checksum(c)} for n in names if (c := plan.listing[n].crc32c)}
    elif m.algorithm == "sha256" or crc:
        paths = {storage.join(root, n): n for n in names}
        found = {paths[p]: sums for p, sums in storage.s3.attributes(fs, paths).items()}
    else:
        return
    for name, sums in found.items():
        kept = sums.get(m.algorithm)
        if kept is None:
            continue
        chunks = m.chunks[name] if m.chunks is not None else ()
        if kept.composite:  # SHA-256 of the parts' digests: the digest of a chunk manifest's file
            parts_fit = bool(chunks) and kept.parts in (None, len(chunks))
            ok = m.algorithm == "sha256" and parts_fit and kept.value == m.files[name]
        elif m.algorithm == "sha256" and chunks:
            ok = len(chunks) == 1 and kept.value == chunks[0]
        else:
            ok = kept.value == m.files[name]
        if ok:
            plan.attested[name] = m.algorithm
    plan.units = [u for u in plan.units if u.name not in plan.attested]


def hash_units(
    fs: Any,
    root: str,
    algorithm: str,
    units: Sequence[Unit],
    listing: Mapping[str, Stat] | None,
    *,
    max_workers: int | None = None,
    callback: Any = None,
) -> dict[Unit, str]:
    """The digest of every unit, read through the pinned reader (``listing``'s versions; ``None``:
    unpinned) on a pool of threads, largest first; small local files in batches."""
    todo = sorted(units, key=lambda u: u.length, reverse=True)
    progress = Progress(callback, sum(u.length for u in todo))
    stop = threading.Event()
    tasks: list[list[Unit]] = []
    room = 0  # bytes the last batch may still take (4 MiB, 64 files at most)
    for unit in todo:
        small = storage.is_local(fs) and unit.length <= _SMALL and unit.length == unit.file_size
        if small and tasks and room >= unit.length and len(tasks[-1]) < 64:
            tasks[-1].append(unit)
            room -= unit.length
        else:
            tasks.append([unit])
            room = 4 * _SMALL - unit.length if small else 0

    def task(batch: list[Unit]) -> list[str]:
        out = []
        for unit in batch:
            version = listing[unit.name].version if listing is not None else None
            path = storage.join(root, unit.name)
            out.append(
                storage.hash_range(
                    fs, path, unit.offset, unit.length, algorithm, version=version, stop=stop, progress=progress
                )
            )
        return out

    workers = workers_for(fs, max_workers)
    if max_workers is None and storage.is_local(fs) and is_crc(algorithm) and all(u.length <= _SMALL for u in todo):
        workers = 1  # a small file's CRC costs less than the Python around it, which a second thread only contends for
    results = run_parallel(task, tasks, workers, stop)
    return {
        unit: digest
        for batch, digests in zip(tasks, results, strict=True)
        for unit, digest in zip(batch, digests, strict=True)
    }


def finish(plan: Plan, digests: Mapping[Unit, str]) -> Report:
    """The report once ``plan.units`` are hashed to ``digests``."""
    m = plan.manifest
    problems = list(plan.problems)
    by_file: dict[str, list[str]] = {}
    for unit in sorted(digests, key=lambda u: (u.name, u.chunk)):
        by_file.setdefault(unit.name, []).append(digests[unit])
    for name, got in by_file.items():
        size = plan.listing[name].size
        actual = got[0] if m.chunk_size is None else combine(m.algorithm, got, size, m.chunk_size)
        if actual != m.files[name]:
            ranges: tuple[tuple[int, int], ...] = ()
            if m.chunks is not None and m.chunk_size is not None:
                pairs = enumerate(zip(m.chunks[name], got, strict=True))
                ranges = tuple(chunk_range(size, m.chunk_size, i) for i, (a, b) in pairs if a != b)
            problems.append(Problem(name, "mismatch", expected=m.files[name], actual=actual, byte_ranges=ranges))
    problems.sort(key=lambda p: (p.path, p.kind))
    missing = sum(1 for p in problems if p.kind == "missing")
    return Report(
        problems=tuple(problems),
        extra=plan.extra,
        files_checked=len(m.files) - missing,
        bytes_checked=sum(u.length for u in digests),
        files_attested=len(plan.attested),
        attested_by=dict(plan.attested),
    )


def check(fs: Any, root: str, options: VerifyOptions) -> Report:
    """The whole pipeline at ``root``; raises as :func:`verify` does."""
    started = time.perf_counter()
    plan = prepare(fs, root, options)
    if options.attested:
        attest(fs, root, plan)
    listing = plan.listing
    digests = hash_units(
        fs,
        root,
        plan.manifest.algorithm,
        plan.units,
        listing,
        max_workers=options.max_workers,
        callback=options.callback,
    )
    report = finish(plan, digests)
    if not report.ok:
        error = IntegrityError(report, plan.location)
        every = len(report.problems) == report.files_checked and all(p.kind == "mismatch" for p in report.problems)
        source, sums = options.manifest, plan.manifest.algorithm == "sha256" and options.manifest_format == "auto"
        if every and sums and isinstance(source, (str, os.PathLike)):  # b3sum's lines look exactly like sha256sum's
            listed = printable(os.fspath(source))
            error.add_note(f"every file differs from {listed}: if b3sum wrote it, pass manifest_format='b3sum'")
        raise error
    log_done("verified", plan.location, report.files_checked, report.bytes_checked, started)
    return report


def verify(
    url: URL, *, storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Unpack[VerifyKeywords]
) -> Report:
    """Check the checkpoint at ``url`` against its manifest; raise on any problem.

    ``ManifestNotFoundError``: no manifest; ``ManifestError``: it is invalid; ``IntegrityError``
    (with every problem in its report): content differs; ``SignatureError``: the signature does
    not hold (with ``public_key``); ``FileChangedError``: a file changed while it was read;
    ``OSError``: storage failed. The options are :class:`~integrity_fs.VerifyOptions`' fields
    (``quick``, ``strict``, ``attested``, ``manifest``, ``public_key``, ...). Caching layers in
    ``url`` are looked beneath: the store is verified, never a cache.
    """
    checked = VerifyOptions.of(**options)
    return check(*storage.resolve(url, storage_options, fs), checked)


# ----------------------------------------------------------------------------- sealing


def check_sealable(fs: Any, root: str, names: Sequence[str], what: str = "seal") -> None:
    """``ValueError`` naming the first file a manifest cannot hold (bad UTF-8, a backslash, ...) or
    a file that is also a folder (an object store holds ``a`` and ``a/b``; a disk cannot)."""
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(name).decode("utf-8", "backslashreplace")  # the bytes as ls -b shows them
            where = storage.describe(fs, root)
            why = f"the file name {printable(shown)} is not UTF-8, which a manifest needs"
            raise ValueError(f"cannot {what} {where}: {why}") from None
        try:
            check_name(name)
        except ManifestError as exc:
            raise ValueError(
                f"cannot {what} {storage.describe(fs, root)}: the file name {printable(name)!r} "
                f"cannot be in a manifest ({exc})"
            ) from None
    files = set(names)
    for name in names:
        parts = name.split("/")
        clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in files), None)
        if clash is not None:
            raise ValueError(
                f"cannot {what} {storage.describe(fs, root)}: {printable(clash)!r} is a file and also "
                f"a folder holding {printable(name)!r}"
            )


def build_manifest(options: SealOptions, sizes: Mapping[str, int], digests: Mapping[str, Sequence[str]]) -> Manifest:
    """The manifest of files of these sizes whose units hashed to ``digests``."""
    chunk = options.chunk_size if options.granularity == "chunk" else None
    files = {n: d[0] if chunk is None else combine(options.algorithm, d, sizes[n], chunk) for n, d in digests.items()}
    chunks = {n: tuple(d) for n, d in digests.items()} if chunk is not None else None
    return Manifest(
        files=files,
        sizes=dict(sizes),
        algorithm=options.algorithm,
        granularity=options.granularity,
        chunk_size=chunk,
        chunks=chunks,
    )


def write_sealed(
    fs: Any, root: str, manifest: Manifest, *, key: Any = None, raw: bytes | None = None, signature: bytes | None = None
) -> None:
    """The manifest at ``root``, atomically, after the content; then its signature (made with
    ``key``, or ``signature`` carried unchanged). A signature of earlier content is removed first."""
    if key is not None:
        from .signing import sign as make_signature

        signature = make_signature(manifest, key, root.rstrip("/").rsplit("/", 1)[-1])
    sig = storage.join(root, storage.SIGNATURE_FILENAME)
    if signature is None and storage.exists(fs, sig) and storage.exists(fs, storage.join(root, MANIFEST_FILENAME)):
        storage.remove(fs, [sig])
        log.warning("removed %s: it signed what the checkpoint held before", printable(storage.describe(fs, sig)))
    storage.write_atomic(fs, storage.join(root, MANIFEST_FILENAME), manifest.to_json() if raw is None else raw)
    if signature is not None:
        storage.write_atomic(fs, sig, signature)


def seal_root(fs: Any, root: str, options: SealOptions) -> Manifest:
    started = time.perf_counter()
    where = storage.describe(fs, root)
    if not options.overwrite and storage.exists(fs, storage.join(root, MANIFEST_FILENAME)):
        raise FileExistsError(f"{where} is already sealed: pass overwrite=True (CLI --force) to seal it again")
    meta: dict[str, Stat] = {}
    listing = storage.list_files(fs, root, meta)
    for name in leftovers(meta):
        log.warning("leaving %s out of the manifest: a temporary file that an interrupted write left", printable(name))
    check_sealable(fs, root, list(listing))
    if options.private_key is not None:
        from .signing import check_names

        check_names({n: s.size for n, s in listing.items()}, options.chunk_size)  # before any byte is read
    units = plan_units({n: s.size for n, s in listing.items()}, options.chunk_size)
    digests = hash_units(
        fs, root, options.algorithm, units, listing, max_workers=options.max_workers, callback=options.callback
    )
    by_file: dict[str, list[str]] = {n: [] for n in listing}
    for unit in sorted(digests, key=lambda u: (u.name, u.chunk)):
        by_file[unit.name].append(digests[unit])
    manifest = build_manifest(options, {n: s.size for n, s in listing.items()}, by_file)
    write_sealed(fs, root, manifest, key=options.private_key)
    log_done("sealed", where, len(listing), sum(s.size for s in listing.values()), started)
    return manifest


def seal(
    url: URL, *, storage_options: dict[str, Any] | None = None, fs: Any = None, **options: Unpack[SealKeywords]
) -> Manifest:
    """Hash every file under ``url`` and write the manifest beside them, last and atomically.

    A root that holds a manifest raises ``FileExistsError`` unless ``overwrite=True`` (sealing
    again accepts whatever the files hold now). A seal that fails writes nothing. A file changed
    while it is read raises ``FileChangedError``. With ``private_key``, ``model.sig`` is written
    right after the manifest, from the same digests. The options are
    :class:`~integrity_fs.SealOptions`' fields.
    """
    checked = SealOptions.of(**options)
    return seal_root(*storage.resolve(url, storage_options, fs), checked)


def sign(
    url: URL,
    *,
    private_key: Any,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    max_workers: int | None = None,
    callback: Any = None,
) -> Manifest:
    """Sign the sealed checkpoint at ``url``: its content is verified first (a damaged checkpoint
    is never signed), then ``model.sig`` is written (replacing one there). Returns the manifest."""
    from . import signing

    fs_, root = storage.resolve(url, storage_options, fs)
    before = load_manifest(fs_, root)
    check_signable(before.algorithm)
    key = signing.load_private_key(private_key)
    check(fs_, root, VerifyOptions.of(manifest=before, max_workers=max_workers, callback=callback))
    if load_manifest(fs_, root).to_json() != before.to_json():
        raise FileChangedError(
            f"{storage.describe(fs_, root)}/{MANIFEST_FILENAME} changed while it was verified; not signed",
            (MANIFEST_FILENAME,),
        )
    storage.write_atomic(
        fs_,
        storage.join(root, storage.SIGNATURE_FILENAME),
        signing.sign(before, key, root.rstrip("/").rsplit("/", 1)[-1]),
    )
    log.info("signed %s", printable(storage.describe(fs_, root)))
    return before
