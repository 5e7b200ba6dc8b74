"""``torch.distributed.checkpoint`` on any fsspec URL, sealed as it is written and verified before it is read.

- :func:`save`: each rank hashes the files it writes while it writes them (no second read); the
  digests travel to the coordinator with DCP's write results, and the coordinator writes the
  manifest after ``.metadata`` (which it hashes too), once every rank has finished.
- :func:`load`: verifies first (:func:`integrity_fs.distributed.verify`, sharded over the ranks),
  then loads; a corrupt checkpoint raises :class:`~integrity_fs.IntegrityError` on every rank and
  leaves ``state_dict`` untouched. A checkpoint without a manifest loads as before, with an INFO
  log line, unless ``require_manifest=True``.
- The pieces, for DCP flows of your own: :class:`HashingFsspecWriter` (a ``StorageWriter``) and
  :class:`VerifyingFsspecReader` (a ``StorageReader``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from .. import distributed, signing
from ..collectives import INSTALL_HINT, Call, Failure, all_gather, broadcast, check_agreed, group_of
from ..hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY
from ..manifest import Manifest
from ..report import Report
from .reader import VerifiedFileSystem, VerifyingFsspecReader, listed_stamps, verify_or_skip
from .writer import HashingFsspecWriter, WrittenFile

try:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

if TYPE_CHECKING:
    import fsspec
    from torch.distributed import ProcessGroup

__all__ = ["HashingFsspecWriter", "VerifyingFsspecReader", "WrittenFile", "load", "load_latest", "save"]

log = logging.getLogger("integrity_fs")

URL = str | os.PathLike[str]


def save(
    state_dict: dict[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    granularity: str = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    planner: SavePlanner | None = None,
    private_key: signing.PrivateKey | None = None,
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
    """
    g = group_of(process_group)

    def make_writer() -> HashingFsspecWriter:
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
        gathered = all_gather(g, made if isinstance(made, Failure) else made.hashing)
        call.raise_first(gathered)
        assert isinstance(made, HashingFsspecWriter)
        check_agreed(cast(list[str], gathered), "hashing options to dcp.save")
        writer = made
    with _single_process_quietly(g is None):
        dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=g is None)
    if g is None:
        assert writer.manifest is not None
        return writer.manifest
    manifest_json = broadcast(g, writer.manifest.to_json() if writer.manifest is not None else None)
    assert manifest_json is not None  # rank 0 is DCP's coordinator: it wrote the manifest
    return Manifest.from_json(manifest_json)


def load(
    state_dict: dict[str, Any],
    url: URL,
    *,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    require_manifest: bool = False,
    mode: distributed.Mode = "sharded",
    max_workers: int | None = None,
    strict: bool = False,
    planner: LoadPlanner | None = None,
    manifest: Manifest | URL | None = None,
    _extension_registry: ExtensionRegistry | None = None,
) -> Report | None:
    """Verify the checkpoint at ``url``, then ``dcp.load`` it into ``state_dict`` (in place).

    A collective over ``process_group``, like ``dcp.load``. Raises what
    :func:`integrity_fs.distributed.verify` raises (the same on every rank) before any tensor is
    read. Returns the verification report, or ``None`` when nothing was verified (``verify=False``,
    or no manifest and ``require_manifest=False``). ``manifest`` is as for :func:`integrity_fs.verify`.
    ``_extension_registry`` resolves custom stream extensions the checkpoint was saved with
    (``save(..., _extensions=[...])``), as in DCP.
    """
    g = group_of(process_group)
    if g is not None:
        # Whether a rank verifies, and skips an unsealed checkpoint, decides which collectives it
        # runs next: ranks that differ would wait for each other in different ones.
        choice = f"verify={verify!r}" + (f", require_manifest={require_manifest!r}" if verify else "")
        check_agreed(all_gather(g, choice), "arguments to dcp.load")
    report = None
    if verify:
        # What each file is (size, version stamp) before it is verified: the reads below must find
        # it so, or they would load bytes that no verification saw (a file rewritten meanwhile).
        stamps = listed_stamps(url, storage_options)
        report = verify_or_skip(
            url,
            process_group=process_group,
            storage_options=storage_options,
            require_manifest=require_manifest,
            mode=mode,
            max_workers=max_workers,
            strict=strict,
            manifest=manifest,
        )
    reader = FsspecReader(url, **(storage_options or {}))
    reader.transforms = _StorageReaderTransforms(_extension_registry)
    if report is not None:
        resolved: fsspec.AbstractFileSystem = reader.fs.fs  # type: ignore[attr-defined]  # set by FsspecReader
        reader.fs = VerifiedFileSystem(resolved, os.fspath(reader.path), stamps, report)  # type: ignore[assignment]
    no_dist = g is None
    with _single_process_quietly(no_dist):
        dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    return report


@contextlib.contextmanager
def _single_process_quietly(single: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is documented, so quiet."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def load_latest(
    state_dict: dict[str, Any],
    root: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    mode: distributed.Mode = "sharded",
    max_workers: int | None = None,
    strict: bool = False,
    quick: bool = False,
    planner: LoadPlanner | None = None,
    public_key: signing.PublicKey | None = None,
) -> str | None:
    """Load the newest checkpoint under ``root`` that verifies into ``state_dict``; its URL, or ``None``.

    A collective over ``process_group``, like :func:`load`: every rank makes the same choice
    (:func:`integrity_fs.distributed.latest_verified`, which skips unsealed, invalid and damaged
    checkpoints with a WARNING each and raises storage errors), then loads it without verifying a
    second time. With no checkpoint that verifies (or no ``root`` yet), ``state_dict`` is untouched.
    With ``public_key``, only a checkpoint whose signature verifies is loaded.
    """
    found = distributed.latest_verified(
        root,
        group=process_group,
        mode=mode,
        quick=quick,
        strict=strict,
        storage_options=storage_options,
        max_workers=max_workers,
        public_key=public_key,
    )
    if found is None:
        return None
    url, _ = found
    load(state_dict, url, verify=False, storage_options=storage_options, process_group=process_group, planner=planner)
    return url
