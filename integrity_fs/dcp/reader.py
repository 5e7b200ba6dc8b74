"""The reader side of ``dcp.load``: DCP's ``FsspecReader`` whose streams return only verified bytes.

Before anything is read, the checkpoint's listing is checked against its manifest (names, sizes):
a missing or truncated file fails at once. Then DCP reads each file through a
:class:`~integrity_fs.read.VerifiedFile`: every unit (chunk, or whole file) is read once, pinned to
the version listed, hashed as it lands, and handed to DCP only once it matched. The items of a
file are read in offset order, so each unit is read once and dropped once DCP has passed it.

Internal: the public names are re-exported by ``integrity_fs.dcp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

from .. import signing, storage
from ..collectives import INSTALL_HINT
from ..errors import IntegrityError, ManifestNotFoundError
from ..manifest import Manifest
from ..manifests import manifest_in_use
from ..options import VerifyOptions
from ..read import Entry, VerifiedFile
from ..report import Problem, Report, printable
from ..storage import URL
from ..verification import Prepared, check_covered, plan_verification

try:
    import torch
    from torch import _weights_only_unpickler
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
    from torch.distributed.checkpoint.utils import _create_file_view
    from torch.futures import Future
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

if TYPE_CHECKING:
    import fsspec
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["Checkpoint", "VerifiedFileSystem", "VerifyingFsspecReader", "copy_tensor", "tensor_in", "warn_unused"]

log = logging.getLogger("integrity_fs")

#: A manifest to load against: the manifest, the name of its file inside the root (if it is
#: there), whether a signature vouches for it, and whether that signature leaves the root's
#: empty files to the listing (model_signing's own shards: see ``signing.with_empty_files``).
Found = tuple[Manifest, str | None, bool, bool]


@dataclass
class Checkpoint:
    """What a verified load reads against: the manifest (``None``: unsealed, read unverified),
    this rank's listing of the root (sizes and versions), and what this rank has verified."""

    manifest: Manifest | None
    prepared: Prepared | None = None
    versions: dict[str, storage.Version] = field(default_factory=dict)
    files_read: set[str] = field(default_factory=set)
    bytes_verified: int = 0
    #: The keys of ``state_dict`` (DCP's flattened names) that verified bytes were handed to.
    keys_loaded: set[str] = field(default_factory=set)
    failure: BaseException | None = None  # the first thing a verified read raised on this rank

    def report(self) -> Report:
        extra = self.prepared.plan.extra if self.prepared is not None else ()
        return Report(extra=extra, files_checked=len(self.files_read), bytes_checked=self.bytes_verified)


def load_manifest(
    url: URL,
    storage_options: dict[str, Any] | None,
    *,
    manifest: Manifest | URL | None,
    public_key: Any,
    require_manifest: bool,
    expected_name: str | None = None,
) -> Found | None:
    """The manifest a load reads against (its signature checked with ``public_key``, and the
    name it was signed as with ``expected_name``), the name of its file when it is inside the
    root, and whether a signature vouches for it; ``None`` for a checkpoint that has none, when
    that is allowed (:func:`check_listing` logs it)."""
    fs, root = storage.resolve(url, storage_options)
    options = VerifyOptions(manifest=manifest, public_key=public_key, expected_name=expected_name)
    try:
        found = manifest_in_use(fs, root, options)
        return found.manifest, found.file, options.public_key is not None, found.empty_unsigned
    except ManifestNotFoundError:
        if require_manifest:
            raise
        return None


def check_listing(url: URL, storage_options: dict[str, Any] | None, found: Found | None, *, strict: bool) -> Checkpoint:
    """This rank's listing of the checkpoint, checked against the manifest ``found`` (the name of
    its file left out of the listing) before anything is read: a missing, resized or (``strict``)
    extra file is an ``IntegrityError`` at once; with a signature, a file it does not cover is a
    ``SignatureError``."""
    fs, root = storage.resolve(url, storage_options)
    if found is None:
        log.info("%s has no manifest: loading it unverified", printable(storage.describe(fs, root)))
        return Checkpoint(None)
    manifest, in_use, signed, empty_unsigned = found
    checkpoint = Checkpoint(manifest)
    sizes = storage.list_files(fs, root, versions=checkpoint.versions, leftovers=True)
    if in_use is not None:
        sizes.pop(in_use, None)
    if empty_unsigned:
        manifest = checkpoint.manifest = signing.with_empty_files(manifest, sizes)
    if signed:
        check_covered(manifest, sizes, storage.describe(fs, root))
    plan = plan_verification(manifest, sizes, strict=strict, quick=True)
    location = storage.describe(fs, root)
    if plan.problems:
        raise IntegrityError(Report(problems=plan.problems, extra=plan.extra), location)
    checkpoint.prepared = Prepared(manifest, plan, location)
    return checkpoint


#: What a deprecated option of ``dcp.load``, ``dcp.load_latest`` and the reader says to do instead.
_UNUSED = {
    "mode": "each rank verifies the bytes it reads, as it loads them",
    "max_workers": "each file's units are hashed on the loader's own threads while DCP copies",
    "quick": "each candidate is verified as it loads, every byte read once",
}


def warn_unused(call: str, **given: object) -> None:
    """A ``DeprecationWarning`` for each option given (not ``None``) that no longer does anything."""
    for name, value in given.items():
        if value is not None:
            warnings.warn(
                f"{call}({name}=...) does nothing and will be removed: {_UNUSED[name]}; leave it out",
                DeprecationWarning,
                stacklevel=3,
            )


class VerifiedFileSystem(_FsspecFileSystem):
    """DCP's fsspec file system for reading a sealed checkpoint: a file opened for reading is a
    :class:`~integrity_fs.read.VerifiedFile` of that file (a file the manifest does not cover is
    an ``IntegrityError``, never read)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, url: str, root: str, checkpoint: Checkpoint) -> None:
        super().__init__()
        assert checkpoint.prepared is not None
        self.fs = fs
        self._url = url.rstrip("/") + "/"  # what DCP joins names to (a URL, a relative path, ...)
        self._root = root  # the same directory as a path inside ``fs``
        self._checkpoint = checkpoint
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: URL, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode or "a" in mode or "+" in mode:
            raise ValueError(f"a verified checkpoint is read-only, not opened with mode {mode!r}")
        checkpoint = self._checkpoint
        prepared = checkpoint.prepared
        assert prepared is not None and self.fs is not None
        full = os.fspath(path)
        name = full[len(self._url) :] if full.startswith(self._url) else full
        try:
            if name not in prepared.manifest.files:
                raise IntegrityError(Report(problems=(Problem(name, "extra"),)), prepared.location)
            size = prepared.plan.sizes[name]
            entry = Entry(
                self.fs,
                storage.join(self._root, name),
                name,
                size,
                checkpoint.versions.get(name),
                prepared.manifest,
                prepared.location,
            )
            with VerifiedFile(entry) as stream:
                try:
                    yield stream
                finally:
                    with self._lock:
                        checkpoint.files_read.add(name)
                        checkpoint.bytes_verified += stream.bytes_verified
        except BaseException as exc:
            if checkpoint.failure is None and isinstance(exc, Exception):
                checkpoint.failure = exc
            raise


class VerifyingFsspecReader(FsspecReader):
    """An ``FsspecReader`` that hands DCP only verified bytes, each read once.

    On ``read_metadata`` (the first thing ``dcp.load`` calls on every rank) the manifest is read
    (and its signature checked with ``public_key``) and the listing compared with it; then every
    file, ``.metadata`` first, is read through a verified stream. It starts no collective of its
    own: DCP gathers each rank's failure in its read step and raises it on every rank (in its
    ``CheckpointException``); :func:`integrity_fs.dcp.load` raises the merged verdict as it is. A
    checkpoint without a manifest is read unverified (logged at INFO) unless ``require_manifest``.
    ``_extension_registry`` (DCP's experimental ``ExtensionRegistry``) resolves the stream
    extensions the checkpoint was saved with. ``process_group`` and ``collective`` are accepted for
    compatibility and not used: each rank verifies what it reads. ``mode`` and ``max_workers`` are
    deprecated (a ``DeprecationWarning``): they do nothing.
    """

    def __init__(  # noqa: PLR0913  # the public reader's keywords
        self,
        path: URL,
        *,
        require_manifest: bool = False,
        strict: bool = False,
        manifest: Manifest | URL | None = None,
        public_key: Any = None,
        process_group: ProcessGroup | None = None,
        collective: bool = True,
        mode: str | None = None,
        max_workers: int | None = None,
        _extension_registry: ExtensionRegistry | None = None,
        **storage_options: Any,
    ) -> None:
        warn_unused("dcp.VerifyingFsspecReader", mode=mode, max_workers=max_workers)
        super().__init__(path, **storage_options)
        # FsspecReader drops the registry that FileSystemReader takes: without it, streams saved
        # with custom extensions (the writer's ``_extensions``) cannot be read back.
        self.transforms = _StorageReaderTransforms(_extension_registry)
        self._storage_options = storage_options
        self._require_manifest = require_manifest
        self._strict = strict
        self._manifest_arg = manifest
        self._public_key = public_key
        self._store, self._root = storage.resolve(path, storage_options, through_caches=True)
        self.checkpoint: Checkpoint | None = None
        self._verdict: BaseException | None = None

    @property
    def report(self) -> Report | None:
        """What this rank verified (``None`` when nothing was: an unsealed checkpoint)."""
        if self.checkpoint is None or self.checkpoint.manifest is None:
            return None
        return self.checkpoint.report()

    @property
    def failure(self) -> BaseException | None:
        """The first verdict raised on this rank: before reading, or by a verified read."""
        return self._verdict or (self.checkpoint.failure if self.checkpoint is not None else None)

    def reset(self, checkpoint_id: URL | None = None) -> None:
        super().reset(checkpoint_id)
        self._store, self._root = storage.resolve(self.path, self._storage_options, through_caches=True)
        self.checkpoint, self._verdict = None, None

    def use(self, checkpoint: Checkpoint) -> None:
        """Read against ``checkpoint`` (a manifest and listing prepared by the caller, as
        ``dcp.load`` does collectively) instead of preparing one in ``read_metadata``."""
        self.checkpoint = checkpoint
        if checkpoint.manifest is not None:
            self.fs = VerifiedFileSystem(  # type: ignore[assignment]  # DCP annotates its local FileSystem
                self._store, os.fspath(self.path), self._root, checkpoint
            )

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._verdict is not None:
            raise self._verdict
        if self.checkpoint is None:
            try:
                found = load_manifest(
                    self.path,
                    self._storage_options,
                    manifest=self._manifest_arg,
                    public_key=self._public_key,
                    require_manifest=self._require_manifest,
                )
                self.use(check_listing(self.path, self._storage_options, found, strict=self._strict))
            except Exception as exc:
                self._verdict = exc
                raise
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reads, in offset order within each file, so that every unit is read once; a tensor
        is made over the verified bytes of its unit (no copy) and copied into its target."""
        if self.checkpoint is None:
            return super().read_data(plan, planner)
        # Each key of state_dict is noted before bytes are written into it (for load_latest).
        planner = cast(LoadPlanner, _Noting(planner, self.checkpoint.keys_loaded))
        if self.checkpoint.manifest is None:
            return super().read_data(plan, planner)  # unsealed: read as DCP reads
        per_file: dict[str, list[ReadItem]] = {}
        for item in sorted(plan.items, key=self._where):
            per_file.setdefault(self._where(item)[0], []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                assert isinstance(stream, VerifiedFile)
                for item in items:
                    self._read_item(stream, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _where(self, item: ReadItem) -> tuple[str, int]:
        info = self.storage_data[item.storage_index]
        return str(info.relative_path), int(info.offset)

    def _read_item(self, stream: VerifiedFile, item: ReadItem, planner: LoadPlanner) -> None:
        """One item, as DCP's ``FileSystemReader.read_data`` reads it, from verified bytes."""
        info = self.storage_data[item.storage_index]
        stream.release_before(info.offset)  # items come in offset order: what lies before is done
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            raw = cast(IO[bytes], _create_file_view(stream, info.offset, info.length))
            source = self.transforms.transform_load_stream(item, info.transform_descriptors or (), raw)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(source.read(-1)))
                return
            seekable = source if source.seekable() else io.BytesIO(source.read(-1))
            tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        else:
            tensor = tensor_in(stream.region(info.offset, info.length))
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        copy_tensor(target, tensor)
        planner.commit_tensor(item, target)


class _Noting:
    """``planner`` as DCP's read loop uses it, noting each key of ``state_dict`` before bytes are
    written into it (``load_bytes``; ``resolve_tensor``, whose tensor DCP then copies into)."""

    def __init__(self, planner: LoadPlanner, keys: set[str]) -> None:
        self._planner = planner
        self._keys = keys

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._keys.add(read_item.dest_index.fqn)
        self._planner.load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self._keys.add(read_item.dest_index.fqn)
        return self._planner.resolve_tensor(read_item)


def copy_tensor(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``; between contiguous CPU tensors of one dtype, one ``memmove`` on this
    thread (without the GIL) instead: torch spreads a copy over its intra-op threads, which wait
    for the cores that the read-ahead threads keep busy hashing (a 1 MiB copy measured 5-10x slower)."""
    if (
        type(target) is torch.Tensor
        and type(source) is torch.Tensor
        and target.device.type == source.device.type == "cpu"
        and target.layout == source.layout == torch.strided
        and target.dtype == source.dtype
        and target.shape == source.shape
        and target.is_contiguous()
        and source.is_contiguous()
        and not (target.is_conj() or source.is_conj() or target.is_neg() or source.is_neg())
        and not target.requires_grad
    ):
        ctypes.memmove(target.data_ptr(), source.data_ptr(), target.nbytes)
    else:
        target.copy_(source)


#: How ``torch.save`` starts what it writes (a zip archive), and the byte order this machine reads.
_ZIP_MAGIC = b"PK\x03\x04"
_BYTE_ORDER = sys.byteorder.encode()


def tensor_in(memory: memoryview) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``memory`` (as ``torch.load(..., weights_only=True)``
    reads it), its elements a view of ``memory``: what ``torch.load(path, mmap=True)`` does over a
    mapped file, over verified memory instead. An archive in another byte order (which torch swaps
    in place) or in torch's legacy format is read into memory of its own."""
    if bytes(memory[:4]) == _ZIP_MAGIC:
        archive = torch._C.PyTorchFileReader(cast(IO[bytes], _MemoryFile(memory)))
        if "byteorder" in archive.get_all_records() and archive.get_record("byteorder") == _BYTE_ORDER:
            with warnings.catch_warnings():  # read-only memory: torch never writes to it here
                warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
                storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
            tensor: torch.Tensor = torch.serialization._load(  # type: ignore[no-untyped-call]
                archive, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8"
            )
            return tensor
    return torch.load(io.BytesIO(memory), map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


class _MemoryFile:
    """The seekable file over ``memory`` that torch's archive reader reads the archive's directory
    and small records through (``readinto``, ``seek``, ``tell``); the tensors' bytes are not read."""

    def __init__(self, memory: memoryview) -> None:
        self._memory = memory
        self._position = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: len(self._memory)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        piece = self._memory[self._position : self._position + len(view)]
        view[: len(piece)] = piece
        self._position += len(piece)
        return len(piece)

    def read(self, size: int = -1) -> bytes:
        end = len(self._memory) if size < 0 else self._position + size
        piece = bytes(self._memory[self._position : end])
        self._position += len(piece)
        return piece
