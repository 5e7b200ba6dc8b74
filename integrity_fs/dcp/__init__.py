"""``torch.distributed.checkpoint`` on any fsspec URL, sealed as it is written and verified before it is read.

- :func:`save`: each rank hashes the files it writes while it writes them (no second read); the
  digests travel to the coordinator with DCP's write results, and the coordinator writes the
  manifest after ``.metadata`` (which it hashes too), once every rank has finished. Chunk
  granularity by default, so that any default save loads in one pass.
- :func:`load`: one pass: each byte is read once, hashed as it is read, and handed to DCP only
  once the unit holding it verified; damage raises :class:`~integrity_fs.IntegrityError` on every
  rank before any damaged byte reaches ``state_dict``. A checkpoint without a manifest loads as
  before, with an INFO log line, unless ``require_manifest=True``.
- :func:`load_latest`: the newest checkpoint that loads verified, the same choice on every rank.
- The pieces, for DCP flows of your own: :class:`HashingFsspecWriter` (a ``StorageWriter``) and
  :class:`VerifyingFsspecReader` (a ``StorageReader``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from .. import signing, storage
from ..collectives import INSTALL_HINT, Call, Failure, Group, all_gather, broadcast, check_agreed, group_of, name_ranks
from ..distributed import agreed_candidates
from ..distributed import prune as collective_prune
from ..errors import IntegrityError, PartialLoadError
from ..hashing import DEFAULT_ALGORITHM
from ..manifest import Manifest
from ..options import Algorithm, Granularity
from ..report import Problem, Report
from ..retention import check_keep_last, same_series
from ..runs import newest_that, signed_name, skip_reason
from ..storage import URL
from .reader import Checkpoint, Found, VerifyingFsspecReader, check_listing, load_manifest, warn_unused
from .writer import HashingFsspecWriter, WrittenFile

try:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HashingFsspecWriter", "VerifyingFsspecReader", "WrittenFile", "load", "load_latest", "save"]

log = logging.getLogger("integrity_fs")


def save(  # noqa: PLR0913  # SPEC's signature
    state_dict: dict[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    granularity: Granularity = "chunk",
    chunk_size: int | None = None,
    planner: SavePlanner | None = None,
    private_key: signing.PrivateKey | None = None,
    keep_last: int | None = None,
    **writer_options: Any,
) -> Manifest:
    """``dcp.save`` to ``url`` (any fsspec URL), sealed while it is written; every rank returns the manifest.

    A collective over ``process_group`` (default: the world, or a single process without an
    initialised process group). ``writer_options`` go to ``FsspecWriter`` (``thread_count``,
    ``sync_files``, ``single_file_per_rank``, ``overwrite``, ...). A failure on any rank raises
    DCP's ``CheckpointException`` on every rank, and no new manifest is written.
    With ``private_key`` (a PEM path or a ``cryptography`` EC key; needed on rank 0, the
    coordinator, and other ranks may pass ``None``), ``model.sig`` is written right after the
    manifest, from the same digests. The key is loaded before anything is written: a bad one,
    like any bad option, raises the same exception on every rank. On ``s3://`` the files go up
    with S3 SHA-256 checksums from the digests computed while writing (see :class:`HashingFsspecWriter`).

    ``keep_last``: once the checkpoint is sealed, prune the run's directory (``url``'s parent) in
    the same collective (:func:`integrity_fs.distributed.prune`, ``attested=True``: on S3 the
    checkpoints ``save`` wrote are confirmed from their store checksums, elsewhere hashed, shared
    across the ranks), keeping the ``keep_last`` newest checkpoints that verify and never deleting
    the one just written. Only folders named like ``url``'s, but for their numbers, are candidates
    (``step_[0-9]+`` for ``run/step_100``): a base model, a ``final`` export or another run's
    checkpoints beside them are never touched. With ``private_key``, a checkpoint verifies only
    when its signature verifies with the key's public key and names it: unsigned folders dropped
    into the run never count as good ones. It is checked (at least 1, the same on every rank)
    before anything is written. A prune that fails raises on every rank, the new checkpoint
    sealed all the same.
    """
    g = group_of(process_group)

    def make_writer() -> HashingFsspecWriter:
        if keep_last is not None:
            check_keep_last("keep_last", keep_last)
        return HashingFsspecWriter(
            url,
            algorithm=algorithm,
            granularity=granularity,
            chunk_size=chunk_size,
            private_key=private_key,
            **writer_options,
            **(storage_options or {}),
        )

    if g is None:
        writer = make_writer()
    else:
        call = Call(g)
        made = call.attempt(make_writer)
        # Each rank hashes what it writes: the digests only fit one manifest when every rank hashes alike.
        gathered = all_gather(g, made if isinstance(made, Failure) else (made.hashing, repr(keep_last)))
        call.raise_first(gathered)
        assert isinstance(made, HashingFsspecWriter)
        pairs = cast(list[tuple[str, str]], gathered)
        check_agreed([hashing for hashing, _ in pairs], "hashing options to dcp.save")
        check_agreed([keep for _, keep in pairs], "keep_last to dcp.save")
        writer = made
    with _single_process_quietly(g is None):
        dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=g is None)
    if g is None:
        assert writer.manifest is not None
        manifest = writer.manifest
    else:
        manifest_json = broadcast(g, writer.manifest.to_json() if writer.manifest is not None else None)
        assert manifest_json is not None  # rank 0 is DCP's coordinator: it wrote the manifest
        manifest = Manifest.from_json(manifest_json)
    if keep_last is not None:
        fs, path = storage.resolve(url, storage_options)
        collective_prune(
            storage.parent(path),
            keep_last=keep_last,
            group=process_group,
            attested=True,
            public_key=writer.public_key,
            keep=[path],
            match=same_series(path),
            fs=fs,
        )
    return manifest


def load(  # noqa: PLR0913  # SPEC's signature
    state_dict: dict[str, Any],
    url: URL,
    *,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    require_manifest: bool = False,
    mode: str | None = None,
    max_workers: int | None = None,
    strict: bool = False,
    planner: LoadPlanner | None = None,
    manifest: Manifest | URL | None = None,
    public_key: signing.PublicKey | None = None,
    expected_name: str | None = None,
    _extension_registry: ExtensionRegistry | None = None,
    _loaded: set[str] | None = None,
) -> Report | None:
    """``dcp.load`` of the checkpoint at ``url`` into ``state_dict`` (in place), hashing each byte
    as it is read: DCP receives the bytes of a unit (chunk, or whole file) only once it verified.

    A collective over ``process_group``, like ``dcp.load``. Before anything is read, rank 0's
    manifest (its signature checked with ``public_key``) is shared and every rank checks its
    listing against it: a missing, resized or (``strict``) extra file raises ``IntegrityError`` on
    every rank, and ``state_dict`` is untouched. A unit that does not match raises
    ``IntegrityError`` before any of its bytes reaches ``state_dict``, on every rank, with every
    rank's problems; a file rewritten while it is read raises ``FileChangedError``. The other
    ranks' ``state_dict`` then hold only verified bytes of this checkpoint (what they had read).

    Returns what was verified: ``files_checked`` the files some rank read, ``bytes_checked`` the
    bytes hashed (in a partial load, files no rank reads are covered by the listing check only);
    ``None`` when nothing was verified (``verify=False``, or no manifest and
    ``require_manifest=False``). ``manifest``, ``public_key`` and ``expected_name`` (the name the
    signature must give the checkpoint) are as for :func:`integrity_fs.verify`.
    ``_extension_registry`` resolves custom stream extensions the checkpoint was saved with
    (``save(..., _extensions=[...])``), as in DCP. ``mode`` and ``max_workers`` are deprecated
    (a ``DeprecationWarning``): they do nothing, each rank verifies what it reads as it loads it.
    ``_loaded`` (for :func:`load_latest`) receives the keys of ``state_dict`` that this rank wrote
    into, also when the load fails.
    """
    warn_unused("dcp.load", mode=mode, max_workers=max_workers)
    g = group_of(process_group)
    if g is not None:
        # Whether a rank verifies, and skips an unsealed checkpoint, decides which collectives it
        # runs next: ranks that differ would wait for each other in different ones.
        choice = f"verify={verify!r}" + (f", require_manifest={require_manifest!r}" if verify else "")
        check_agreed(all_gather(g, choice), "arguments to dcp.load")
    if not verify:
        plain = FsspecReader(url, **(storage_options or {}))
        plain.transforms = _StorageReaderTransforms(_extension_registry)
        _run(state_dict, plain, planner, process_group)
        return None
    reader = VerifyingFsspecReader(
        url,
        require_manifest=require_manifest,
        strict=strict,
        manifest=manifest,
        public_key=public_key,
        _extension_registry=_extension_registry,
        **(storage_options or {}),
    )
    checkpoint = _prepare(g, url, storage_options, manifest, public_key, expected_name, require_manifest, strict)
    reader.use(checkpoint)
    try:
        _run(state_dict, reader, planner, process_group)
    except CheckpointException as exc:
        verdict = _verdict(g, reader.failure)
        if verdict is None:
            raise
        raise verdict from exc
    finally:
        if _loaded is not None:
            _loaded.update(checkpoint.keys_loaded)
    return _report(g, reader)


def _run(state_dict: dict[str, Any], reader: Any, planner: LoadPlanner | None, process_group: Any) -> None:
    no_dist = group_of(process_group) is None
    with _single_process_quietly(no_dist):
        dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)


def _prepare(
    g: Group | None,
    url: URL,
    storage_options: dict[str, Any] | None,
    manifest: Manifest | URL | None,
    public_key: Any,
    expected_name: str | None,
    require_manifest: bool,
    strict: bool,
) -> Checkpoint:
    """Rank 0's manifest for every rank, each rank's listing checked against it; the merged
    verdict on every rank when any rank's check fails."""

    def manifest_here() -> Found | None:
        return load_manifest(
            url,
            storage_options,
            manifest=manifest,
            public_key=public_key,
            require_manifest=require_manifest,
            expected_name=expected_name,
        )

    if g is None:
        return check_listing(url, storage_options, manifest_here(), strict=strict)
    call = Call(g)
    shared = broadcast(g, call.attempt(manifest_here) if g.rank == 0 else None)
    mine = (
        shared
        if isinstance(shared, Failure)
        else call.attempt(lambda: check_listing(url, storage_options, shared, strict=strict))
    )
    outcomes = all_gather(g, mine if isinstance(mine, Failure) else None)
    if call.interrupt is not None:
        raise call.interrupt
    merged = _merged(outcomes)
    if merged is not None:
        raise merged
    call.raise_first(outcomes)
    assert isinstance(mine, Checkpoint)
    return mine


def _verdict(g: Group | None, failure: BaseException | None) -> BaseException | None:
    """What a failed load raises on this rank: every rank's integrity problems merged, else the
    first rank's verdict; ``None`` when no rank's verified read failed (DCP's own error stands)."""
    if g is None:
        return failure
    outcomes = all_gather(g, None if failure is None else Failure.from_exception(failure, g.rank))
    merged = _merged(outcomes)
    if merged is not None:
        return merged
    first = next((o for o in outcomes if isinstance(o, Failure)), None)
    return None if first is None else first.to_exception()


def _merged(outcomes: Sequence[Failure | None]) -> IntegrityError | None:
    """One ``IntegrityError`` holding every rank's problems (each once), when any rank found damage."""
    found = [o for o in outcomes if isinstance(o, Failure) and o.type_name == "IntegrityError" and o.report]
    if not found:
        return None
    problems: dict[tuple[str, str, tuple[tuple[int, int], ...]], Problem] = {}
    for failure in found:
        assert failure.report is not None
        for problem in failure.report.problems:
            problems.setdefault((problem.path, problem.kind, problem.byte_ranges), problem)
    first = found[0].report
    assert first is not None
    report = Report(problems=tuple(sorted(problems.values(), key=lambda p: (p.path, p.kind))), extra=first.extra)
    return IntegrityError(report, found[0].location)


def _report(g: Group | None, reader: VerifyingFsspecReader) -> Report | None:
    """What every rank verified, together (``None``: an unsealed checkpoint, read unverified)."""
    mine = reader.report
    if g is None or mine is None:
        return mine
    checkpoint = reader.checkpoint
    assert checkpoint is not None
    gathered = all_gather(g, (sorted(checkpoint.files_read), checkpoint.bytes_verified))
    files = {name for names, _ in gathered for name in names}
    return Report(extra=mine.extra, files_checked=len(files), bytes_checked=sum(n for _, n in gathered))


@contextlib.contextmanager
def _single_process_quietly(single: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is documented, so quiet."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def load_latest(  # noqa: PLR0913  # SPEC's signature
    state_dict: dict[str, Any],
    root: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    mode: str | None = None,
    max_workers: int | None = None,
    strict: bool = False,
    quick: bool | None = None,
    planner: LoadPlanner | None = None,
    public_key: signing.PublicKey | None = None,
) -> str | None:
    """Load the newest checkpoint under ``root`` that loads verified into ``state_dict``; its URL,
    or ``None``.

    A collective over ``process_group``, like :func:`load`: the ranks first agree on the candidates
    (a rank that cannot list ``root``, or lists other checkpoints, is an ``OSError`` on every
    rank), then load them newest first with :func:`load` (one pass, every byte verified as it is
    read), skipping unsealed, invalid, damaged, badly signed and changing ones with a WARNING
    each, the same on every rank; a storage error is raised. With ``public_key``, only a
    checkpoint whose signature verifies is loaded. ``mode``, ``max_workers`` and ``quick`` are
    deprecated (a ``DeprecationWarning``): they do nothing.

    ``None`` when none loads (or there is no ``root`` yet), and ``state_dict`` holds what it held.
    A candidate rejected before any of its bytes reached ``state_dict`` (its listing, manifest,
    signature or ``.metadata`` failed, or its first unit) leaves it as it was. One found damaged
    or changing part-way leaves verified bytes of it; a later candidate that loads is returned
    only when it wrote every key that those bytes went to (as the default planner does: it
    loads every key), else, and when none loads, :class:`~integrity_fs.errors.PartialLoadError`
    (an ``IntegrityError``) says that ``state_dict`` holds partial data, on every rank.
    """
    warn_unused("dcp.load_latest", mode=mode, max_workers=max_workers, quick=quick)
    g = group_of(process_group)
    candidates = agreed_candidates(root, group=process_group, storage_options=storage_options)
    failed: dict[str, tuple[Exception, set[str]]] = {}  # URL -> why, and the keys it wrote into here

    def attempt(url: str) -> Report | None:
        keys: set[str] = set()
        try:
            report = load(
                state_dict,
                url,
                storage_options=storage_options,
                process_group=process_group,
                require_manifest=True,
                strict=strict,
                planner=planner,
                public_key=public_key,
                expected_name=signed_name(url, public_key),
                _loaded=keys,
            )
        except Exception as exc:
            failed[url] = (exc, keys)
            raise
        for _exc, written in failed.values():
            written -= keys  # loaded over
        return report

    found = newest_that([(url, url) for url in candidates], attempt, warn=g is None or g.rank == 0)
    _check_nothing_left(g, root, None if found is None else found[0], failed)
    return None if found is None else found[0]


def _check_nothing_left(
    g: Group | None, root: URL, found: str | None, failed: dict[str, tuple[Exception, set[str]]]
) -> None:
    """``PartialLoadError`` on every rank when, on any rank, a candidate that failed part-way left
    bytes in ``state_dict`` that ``found`` (the candidate loaded, if any) did not load over."""
    mine = [url for url, (_exc, keys) in failed.items() if keys]
    per_rank = [mine] if g is None else all_gather(g, mine)
    ranks: dict[str, list[int]] = {}
    for rank, urls in enumerate(per_rank):
        for url in urls:
            ranks.setdefault(url, []).append(rank)
    if not ranks:
        return
    left = [url for url in failed if url in ranks]  # newest first, as they were tried
    parts = []
    for url in left:
        on = "" if g is None else f" on {name_ranks(ranks[url])}"
        parts.append(f"{url}{on} ({skip_reason(failed[url][0])}: {failed[url][0]})")
    after = (
        f"no checkpoint under {os.fspath(root)} loaded over it"
        if found is None
        else f"{found}, loaded after it, did not write every key that data went to"
    )
    first = failed[left[0]][0]
    report, location = (first.report, first.location) if isinstance(first, IntegrityError) else (None, "")
    raise PartialLoadError(f"state_dict holds partial data of {'; '.join(parts)}, and {after}", report, location)
