"""The seal pipeline: list, hash, write the manifest last (and the signature after it).

Internal: ``integrity_fs.seal`` and every other entry point of a seal run it. One pipeline, in
three steps that each entry point calls with its own "where and who": :func:`plan_seal` (a
sealed root refused, names checked, units planned, before any content is read), the hashing
(:func:`integrity_fs.work.hash_units`, pinned to the listing; each rank its share in
``distributed.seal``), and :func:`finish_seal` (the manifest built from the digests and written,
signed with the key). ``upload`` and ``dcp.save`` build on the same pieces: their digests come
from the bytes they send or write. :func:`seal_at` runs them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import manifests, signing, storage
from .errors import FileChangedError, ManifestError
from .hashing import Unit, file_digest, plan_units
from .manifest import MANIFEST_FILENAME, Manifest, check_name
from .options import Hashing, SealOptions, Work
from .recorded import CHECKSUMS_FILENAME, ObjectState
from .report import SIGNATURE_FILENAME, shortened
from .work import Grown, UnitOutcome, hash_units, log_done, whole_files

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "MAX_CHUNKS_PER_FILE",
    "SealPlan",
    "build_manifest",
    "finish_seal",
    "plan_seal",
    "record_after_seal",
    "seal_at",
]


def seal_at(fs: fsspec.AbstractFileSystem, root: str, options: SealOptions, work: Work) -> Manifest:
    """The seal pipeline at ``root`` of ``fs``: :func:`plan_seal`, the hashing, :func:`finish_seal`."""
    started = time.perf_counter()
    versions: dict[str, storage.Version] = {}
    states: dict[str, ObjectState] | None = {} if storage.keeps_checksums(fs) else None
    plan = plan_seal(fs, root, options, versions=versions, states=states)
    algorithm = options.hashing.algorithm
    recording = storage.plan_recording(fs, root, whole_files(plan.units), states, algorithm=algorithm)
    extra = recording.extra() if recording else None
    digests = hash_units(fs, root, algorithm, plan.units, versions=versions, work=work, extra=extra)
    del versions
    manifest = finish_seal(fs, root, options, plan, digests)
    if recording and states is not None:
        record_after_seal(fs, root, manifest, recording, states, signed=options.private_key is not None)
    log_done("sealed", plan.location, len(manifest.files), manifest.total_bytes or 0, started)
    return manifest


def record_after_seal(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    recording: storage.Recording,
    states: Mapping[str, ObjectState],
    *,
    signed: bool = False,
) -> None:
    """Record the store checksums that the seal's reads confirmed (merged with a sidecar already
    there); ``signed``: the seal has just written the signature, which ignores the sidecar."""
    existing = storage.read_records(fs, root) if CHECKSUMS_FILENAME in states else None
    present = [name for name in states if name != SIGNATURE_FILENAME or not signed]
    storage.record_checksums(fs, root, manifest, recording.records(manifest), existing=existing, present=present)


@dataclass(frozen=True)
class SealPlan:
    """What a seal will hash: the files listed (name -> size) and their units."""

    location: str
    sizes: dict[str, int]
    units: tuple[Unit, ...]


def plan_seal(
    fs: fsspec.AbstractFileSystem,
    root: str,
    options: SealOptions,
    *,
    sizes: dict[str, int] | None = None,
    versions: dict[str, storage.Version] | None = None,
    states: dict[str, ObjectState] | None = None,
) -> SealPlan:
    """Everything a seal checks before it reads content: a sealed root is refused (unless
    ``options.overwrite``), the root is listed (``sizes``: a listing already made; ``versions``
    and ``states`` receive the listing's versions and store checksums otherwise), every name must
    fit a manifest (and, with a key, a signature), and no file may be cut into more than
    :data:`MAX_CHUNKS_PER_FILE` chunks."""
    if not options.overwrite:
        refuse_if_sealed(fs, root)
    if sizes is None:
        sizes = storage.list_files(fs, root, versions=versions, states=states)
    if not sizes:  # a root that is a file lists nothing on some stores
        storage.check_root(fs, root)
    check_names(fs, root, sizes)
    storage.check_no_clashes(fs, root, sizes, "seal")
    hashing = options.hashing
    if options.private_key is not None:
        signing.check_shard_names(hashing.granularity, sizes)
    check_chunk_count(sizes, hashing.chunk_size)
    units = tuple(plan_units(hashing.granularity, sizes, hashing.chunk_size))
    return SealPlan(storage.describe(fs, root), sizes, units)


def finish_seal(
    fs: fsspec.AbstractFileSystem,
    root: str,
    options: SealOptions,
    plan: SealPlan,
    digests: Mapping[Unit, UnitOutcome],
) -> Manifest:
    """The manifest of ``plan``'s files from their units' ``digests``, written at ``root`` (and
    signed with ``options.private_key``); a file that vanished or changed size meanwhile is an error and
    nothing is written."""
    gone = sorted({u.name for u, d in digests.items() if d is None})
    if gone:
        raise FileNotFoundError(f"files vanished while sealing {plan.location}: {shortened(gone, 10)}")
    manifest = build_manifest(options.hashing, plan.sizes, digests)
    manifests.write_sealed(fs, root, manifest, key=options.private_key)
    return manifest


def refuse_if_sealed(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """``FileExistsError`` when ``root`` already holds a manifest (the remedy, ``overwrite=True`` or
    ``--force``, is the caller's to name)."""
    if storage.exists(fs, storage.join(root, MANIFEST_FILENAME)):
        raise FileExistsError(
            f"{storage.describe(fs, root)} is already sealed (it holds {MANIFEST_FILENAME}): sealing again would "
            "accept whatever the files hold now, damage included"
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


def check_names(fs: fsspec.AbstractFileSystem, root: str, sizes: Mapping[str, int]) -> None:
    """``ValueError`` naming the files whose names a manifest cannot hold (rename them)."""
    bad = [f"{_shown(name)} ({reason})" for name in sizes if (reason := _unholdable(name))]
    if bad:
        shown = shortened(bad, 10, sep="; ")
        raise ValueError(
            f"cannot seal {storage.describe(fs, root)}: a manifest cannot hold these file names, rename them: {shown}"
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


def build_manifest(hashing: Hashing, sizes: Mapping[str, int], digests: Mapping[Unit, UnitOutcome]) -> Manifest:
    """The manifest for files of ``sizes`` whose units hashed to ``digests``.

    A file that changed size while it was read is a ``FileChangedError``: its bytes were never
    all hashed as one version.
    """
    algorithm, granularity, chunk_size = hashing.algorithm, hashing.granularity, hashing.chunk_size
    grown = sorted({u.name for u, d in digests.items() if isinstance(d, Grown)})
    if grown:
        raise FileChangedError(
            f"files changed size while they were sealed (not the size listed; seal again once nothing writes to "
            f"the checkpoint): {shortened(grown, 10)}",
            grown,
        )
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
