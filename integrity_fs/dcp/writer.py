"""The writer side of ``dcp.save``: DCP's ``FsspecWriter`` whose streams hash what they write, and
a coordinator that seals the checkpoint once every rank's digests are in.

Internal: the public names are re-exported by ``integrity_fs.dcp``.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from .. import manifests, signing, storage
from ..collectives import INSTALL_HINT
from ..hashing import DEFAULT_ALGORITHM, Unit, chunk_range
from ..manifest import Manifest
from ..options import Algorithm, Granularity, Hashing, SealOptions
from ..retention import check_keep_last, prune, same_series
from ..sealing import build_manifest
from ..storage import URL
from .streams import HashingStream, SealingStream

try:
    import torch
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

if TYPE_CHECKING:
    import fsspec

__all__ = ["HashingFsspecWriter", "TensorOwners", "WrittenFile"]


#: ``fqn`` prefix of the write results that carry digests to the coordinator (never in ``.metadata``).
_CARRIER = "__integrity_fs__/"


class WrittenFile(NamedTuple):
    """One file a rank wrote: its name relative to the checkpoint root, size, and unit digests
    (and how they were computed: the writer's :attr:`HashingFsspecWriter.hashing`)."""

    name: str
    size: int
    digests: tuple[str, ...]
    hashing: str = ""
    checksums: tuple[tuple[str, str], ...] = ()  # the store's own checksums, as computed while writing


class HashingFsspecWriter(FsspecWriter):
    """An ``FsspecWriter`` that hashes each file while writing it and seals the checkpoint in ``finish``.

    Every rank hashes what it writes; the digests reach the coordinator as extra write results
    (removed before ``.metadata`` is written, so ``.metadata`` is exactly DCP's). The coordinator
    writes the manifest after ``.metadata``; it is then in :attr:`manifest`. No file is read back.
    The manifest lists the files this save wrote: other files already in the directory are
    reported as extra by ``verify`` (and fail ``strict=True``).

    With ``private_key`` (loaded here, before any I/O), the coordinator writes ``model.sig`` right
    after the manifest, from the same digests. On S3 with SHA-256, each file goes up through a
    :class:`~integrity_fs.storage.SealingWriter` (``growing=True``) with the digests it computes
    as S3 checksums, laid out so that ``verify(attested=True)`` reads nothing; elsewhere the
    stream of the file system is hashed on its way (on helper threads for large writes).

    ``keep_last`` (for DCP's ``async_save``, which runs ``finish`` once every rank's part is
    written): once the manifest is written, the coordinator prunes the run's directory (the
    checkpoint's parent) with :func:`integrity_fs.prune` (``attested=True``), keeping the
    ``keep_last`` newest checkpoints that verify and never deleting the one just written; only
    folders named like this one but for their numbers are candidates, and with ``private_key``
    only checkpoints whose signature verifies with its public key (:attr:`public_key`) count as
    good. A prune that fails fails the save (the checkpoint is sealed by then).
    :func:`integrity_fs.dcp.save` takes ``keep_last`` itself and prunes collectively instead.
    """

    def __init__(
        self,
        path: URL,
        *,
        algorithm: Algorithm = DEFAULT_ALGORITHM,
        granularity: Granularity = "chunk",
        chunk_size: int | None = None,
        private_key: signing.PrivateKey | None = None,
        keep_last: int | None = None,
        **kwargs: Any,
    ) -> None:
        if keep_last is not None:
            check_keep_last("keep_last", keep_last)
        self.keep_last = keep_last
        options = SealOptions(
            algorithm=algorithm, granularity=granularity, chunk_size=chunk_size, private_key=private_key
        )
        hashing = options.hashing
        chunk_size = hashing.chunk_size
        # Kept as PEM bytes: the writer is pickled for DCP's process executor, a key object is not picklable.
        self._signing_pem = None if options.private_key is None else _pem(options.private_key)
        super().__init__(path, **kwargs)
        resolved: fsspec.AbstractFileSystem = self.fs.fs  # type: ignore[attr-defined]  # set by FsspecWriter
        self.hashing_fs = _HashingFileSystem(resolved, hashing)
        self.fs = self.hashing_fs  # type: ignore[assignment]  # DCP annotates its local FileSystem
        self._hashing = hashing
        self.algorithm = algorithm
        self.granularity = granularity
        self.chunk_size = chunk_size
        self.manifest: Manifest | None = None

    @property
    def public_key(self) -> Any:
        """The public key of ``private_key`` (``None`` without one): what this writer's
        signatures verify with, and what its ``keep_last`` prune checks them with."""
        return None if self._signing_pem is None else signing.load_private_key(self._signing_pem).public_key()

    @property
    def hashing(self) -> str:
        """How this writer hashes (algorithm, granularity, chunk size): the same on every rank of a save."""
        return str(self._hashing)

    def reset(self, checkpoint_id: URL | None = None) -> None:
        super().reset(checkpoint_id)
        self.hashing_fs.take_written()
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise NotImplementedError("HashingFsspecWriter seals one checkpoint from every rank: use_collectives=True")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        def with_digests(done: Future[list[WriteResult]]) -> list[WriteResult]:
            results = done.value()
            # FsspecWriter's helper threads (thread_count > 1) drop their exceptions: a file that
            # failed there has no write results, and the save would go on to be sealed without it.
            lost = {item.index for item in plan.items} - {result.index for result in results}
            if lost:
                self.hashing_fs.take_written()
                names = sorted(index.fqn for index in lost)
                raise OSError(
                    f"{len(lost)} item(s) of this rank were not written to {self.path} "
                    f"(a write failed on a writer thread): {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                )
            return results + [_carrier(f) for f in self._written_files()]

        owners = self.hashing_fs.owners
        try:
            holding = cast(SavePlanner, _HoldingPlanner(planner, owners))  # a proxy: DCP only calls resolve_data
            return super().write_data(plan, holding).then(with_digests)
        finally:
            owners.clear()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = [wr.storage_data for wrs in results for wr in wrs if _is_carrier(wr)]
        other = sorted({f.hashing for f in files} - {self.hashing})
        if other:
            raise ValueError(f"ranks hashed their files differently ({'; '.join(other)}; here {self.hashing})")
        super().finish(metadata, [[wr for wr in wrs if not _is_carrier(wr)] for wrs in results])
        files += self._written_files()  # .metadata
        manifest = self._build_manifest(files)
        fs, root = storage.resolve(self.path, fs=self.hashing_fs.fs)
        manifests.write_sealed(fs, root, manifest, key=self._signing_pem)
        self.manifest = manifest
        computed = {f.name: f.checksums for f in files if f.checksums}
        storage.record_written(fs, root, manifest, computed, signed=self._signing_pem is not None)
        if self.keep_last is not None:
            prune(
                storage.parent(root),
                keep_last=self.keep_last,
                attested=True,
                public_key=self.public_key,
                keep=[root],
                match=same_series(root),
                fs=fs,
            )

    def _written_files(self) -> list[WrittenFile]:
        prefix = os.fspath(self.path).rstrip("/") + "/"
        out = []
        for path, (size, digests, checksums) in self.hashing_fs.take_written().items():
            if not path.startswith(prefix):
                raise ValueError(f"{path} was written outside the checkpoint at {self.path}")
            out.append(WrittenFile(path[len(prefix) :], size, digests, self.hashing, checksums))
        return out

    def _build_manifest(self, files: Sequence[WrittenFile]) -> Manifest:
        sizes = {f.name: f.size for f in sorted(files)}
        digests: dict[Unit, str | None] = {}
        for f in files:
            for index, digest in enumerate(f.digests):
                start, end = chunk_range(f.size, self.chunk_size or max(1, f.size), index)
                digests[Unit(f.name, index, start, end - start)] = digest
        return build_manifest(self._hashing, sizes, digests)


class _Teed:
    """A write stream whose bytes also go to ``sinks``, in order (the store's own checksums, on
    S3 and GCS); everything else is the stream's."""

    def __init__(self, raw: Any, sinks: Sequence[storage.Sink]) -> None:
        self._raw, self._sinks = raw, sinks

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(data)
        n = len(view) if written is None else int(written)
        for sink in self._sinks:
            sink.update(view[:n])
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class TensorOwners:
    """The tensors DCP is about to write, by the address and size of their memory (the last few):
    a write of exactly one's memory is hashed there, the tensor held, instead of copied first."""

    KEEP = 8

    def __init__(self) -> None:
        self._held: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        with self._lock:
            self._held[storage.data_ptr()] = (storage.nbytes(), tensor)
            self._held.move_to_end(storage.data_ptr())
            while len(self._held) > self.KEEP:
                self._held.popitem(last=False)

    def owner_of(self, view: memoryview) -> torch.Tensor | None:
        """The tensor whose memory ``view`` is, exactly; forgotten here (the hashing holds it now)."""
        if not self._held:
            return None
        address = _address(view)
        if address is None:
            return None
        with self._lock:
            found = self._held.get(address)
            if found is None or found[0] != len(view):
                return None
            del self._held[address]
            return found[1]

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


def _address(view: memoryview) -> int | None:
    try:
        import numpy
    except ImportError:  # then every write is copied before another thread hashes it
        return None
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


class _HoldingPlanner:
    """``planner`` whose resolved CPU tensors that fill their storage are held by ``owners`` until
    written: DCP's loader writes those as they are (a view into a larger storage it clones first,
    and that copy is not held), so the memory torch.save writes is the memory held."""

    def __init__(self, planner: SavePlanner, owners: TensorOwners) -> None:
        self._planner = planner
        self._owners = owners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, write_item: Any) -> Any:
        data = self._planner.resolve_data(write_item)
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.untyped_storage().size() == data.nbytes
        ):
            self._owners.hold(data)
        return data


def _pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _carrier(file: WrittenFile) -> WriteResult:
    return WriteResult(index=MetadataIndex(_CARRIER + file.name), size_in_bytes=file.size, storage_data=file)


def _is_carrier(result: WriteResult) -> bool:
    return result.index.fqn.startswith(_CARRIER) and isinstance(result.storage_data, WrittenFile)


class _HashingFileSystem(_FsspecFileSystem):
    """DCP's fsspec file system whose write streams hash what they write, recorded by path."""

    def __init__(self, fs: fsspec.AbstractFileSystem, hashing: Hashing) -> None:
        super().__init__()
        self.fs = fs
        self._hashing = hashing
        self._algorithm = hashing.algorithm
        self._chunk_size = hashing.chunk_size
        self._checksums = storage.SealingWriter.carries_checksums(fs, hashing.algorithm)
        self._written: dict[str, tuple[int, tuple[str, ...], tuple[tuple[str, str], ...]]] = {}
        self._lock = threading.Lock()
        self.owners = TensorOwners()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (DCP's process executor sends the writer to its checkpoint process); the
        lock and the tensors held are not."""
        with self._lock:
            state = {**self.__dict__, "_written": dict(self._written)}
        del state["_lock"], state["owners"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.owners = TensorOwners()

    @contextlib.contextmanager
    def create_stream(self, path: URL, mode: str) -> Iterator[io.IOBase]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if "+" in mode or "a" in mode:
            raise ValueError(f"cannot hash a stream opened with mode {mode!r}: only whole writes ('wb') are sealed")
        if self._checksums:
            sealing = SealingStream(
                storage.SealingWriter(
                    self.fs,
                    os.fspath(path),
                    self._hashing,
                    growing=True,
                )
            )
            try:
                yield sealing
            except BaseException:
                sealing.abandon()
                with contextlib.suppress(Exception):
                    if self.exists(path):
                        self.rm_file(path)
                raise
            size, digests = sealing.finish()
            checksums: tuple[tuple[str, str], ...] = ()
        else:
            recording = storage.WriteRecording(self.fs)
            sinks = recording.sinks(os.fspath(path), None, checksummed=False) if recording else []
            with self._new_file(path, mode) as raw:
                stream = HashingStream(
                    _Teed(raw, sinks) if sinks else raw, self._algorithm, self._chunk_size, self.owners.owner_of
                )
                try:
                    yield stream
                except BaseException:
                    stream.abandon()
                    raise
                size, digests = stream.finish()
            checksums = storage.computed_values(sinks)
        with self._lock:
            self._written[os.fspath(path)] = (size, digests, checksums)

    @contextlib.contextmanager
    def _new_file(self, path: URL, mode: str) -> Iterator[Any]:
        """The stream of a file written whole. On a local disk a new file, created without
        following a link at its path (a link planted there is replaced, its target untouched)."""
        if not storage.is_local(self.fs):
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        local = storage.local_path(self.fs, path)
        with os.fdopen(storage.create_beneath(os.path.dirname(local), local), "wb") as raw:
            yield raw

    def rename(self, path: URL, new_path: URL) -> None:
        if storage.is_local(self.fs):  # the entry at new_path replaced, never a link or folder followed
            os.replace(storage.local_path(self.fs, path), storage.local_path(self.fs, new_path))
        elif self._checksums:
            assert self.fs is not None  # DCP renames .metadata.tmp
            storage.rename_object(self.fs, os.fspath(path), os.fspath(new_path))
        else:
            super().rename(path, new_path)
        with self._lock:
            if os.fspath(path) in self._written:
                self._written[os.fspath(new_path)] = self._written.pop(os.fspath(path))

    def rm_file(self, path: URL) -> None:
        if storage.is_local(self.fs):  # a link is unlinked, never followed (nor refused as a folder)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(storage.local_path(self.fs, path))
        else:
            super().rm_file(path)
        with self._lock:
            self._written.pop(os.fspath(path), None)

    def take_written(self) -> dict[str, tuple[int, tuple[str, ...], tuple[tuple[str, str], ...]]]:
        """Size, digests and store checksums (S3 and GCS: as computed while writing, to record
        once the store lists them) of every file written (and closed) since the last call."""
        with self._lock:
            written, self._written = self._written, {}
        return written
