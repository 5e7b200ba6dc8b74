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
import io
import logging
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from . import core, distributed, signing, storage
from .core import URL, Report
from .errors import IntegrityError, ManifestNotFoundError
from .hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY, Hasher, StreamDigest, Unit, chunk_range, new_hasher
from .manifest import Manifest
from .report import Problem

try:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {distributed.INSTALL_HINT}") from exc

if TYPE_CHECKING:
    import fsspec
    from torch.distributed import ProcessGroup

__all__ = ["HashingFsspecWriter", "VerifyingFsspecReader", "WrittenFile", "load", "load_latest", "save"]

log = logging.getLogger("integrity_fs")

#: Writes at least this large are hashed on a helper thread, overlapping the write that follows.
BACKGROUND_MIN_BYTES = 1024 * 1024
#: The helper thread hashes copies of this size, from at most ``BUFFERS`` buffers per open file.
PIECE_BYTES = 8 * 1024 * 1024
BUFFERS = 4
#: Threads per open file that hash its chunks (granularity "chunk"), each with ``BUFFERS`` buffers:
#: up to 128 MiB per file being written, so that several 64 MiB chunks are in flight at once.
HASH_THREADS = min(4, os.cpu_count() or 1)

#: ``fqn`` prefix of the write results that carry digests to the coordinator (never in ``.metadata``).
_CARRIER = "__integrity_fs__/"


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
    g = distributed._group(process_group)

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
        call = distributed._Call(g)
        made = call.attempt(make_writer)
        # Each rank hashes what it writes: the digests only fit one manifest when every rank hashes alike.
        gathered = distributed._all_gather(g, made if isinstance(made, distributed.Failure) else made.hashing)
        call.raise_first(gathered)
        assert isinstance(made, HashingFsspecWriter)
        distributed._check_agreed(cast(list[str], gathered), "hashing options to dcp.save")
        writer = made
    with _single_process_quietly(g is None):
        dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=g is None)
    if g is None:
        assert writer.manifest is not None
        return writer.manifest
    manifest_json = distributed._broadcast(g, writer.manifest.to_json() if writer.manifest is not None else None)
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
    g = distributed._group(process_group)
    if g is not None:
        # Whether a rank verifies, and skips an unsealed checkpoint, decides which collectives it
        # runs next: ranks that differ would wait for each other in different ones.
        choice = f"verify={verify!r}" + (f", require_manifest={require_manifest!r}" if verify else "")
        distributed._check_agreed(distributed._all_gather(g, choice), "arguments to dcp.load")
    report = None
    if verify:
        # What each file is (size, version stamp) before it is verified: the reads below must find
        # it so, or they would load bytes that no verification saw (a file rewritten meanwhile).
        stamps = _stamps(url, storage_options)
        report = _verify_or_skip(
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
        reader.fs = _VerifiedFileSystem(resolved, os.fspath(reader.path), stamps, report)  # type: ignore[assignment]
    no_dist = g is None
    with _single_process_quietly(no_dist):
        dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    return report


def _stamps(url: URL, storage_options: dict[str, Any] | None) -> dict[str, tuple[int, str]] | Exception:
    """Each file's size and version stamp (mtime, ETag) as listed now; the failure to list, kept
    to be raised inside DCP's read step (where every rank learns of it) rather than before a collective."""
    try:
        fs, root = storage.resolve(url, storage_options)
        stamps: dict[str, str] = {}
        sizes = storage.list_files(fs, root, stamps=stamps)
    except Exception as exc:
        return exc
    return {name: (size, stamps.get(name, "")) for name, size in sizes.items()}


class _VerifiedFileSystem(_FsspecFileSystem):
    """DCP's fsspec file system for reading a verified checkpoint: each file is read only if it is
    one the manifest covers and its size and version stamp are still those listed before it was
    verified (checked when it is opened, and again when it is closed)."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        stamps: dict[str, tuple[int, str]] | Exception,
        report: Report,
    ) -> None:
        super().__init__()
        self.fs = fs
        self._root = root.rstrip("/") + "/"
        self._stamps = stamps
        self._extra = set(report.extra)

    @contextlib.contextmanager
    def create_stream(self, path: URL, mode: str) -> Iterator[io.IOBase]:
        self._check(path, "before it was read")
        with super().create_stream(path, mode) as stream:
            yield stream
        self._check(path, "while it was read")

    def _check(self, path: URL, when: str) -> None:
        if isinstance(self._stamps, Exception):
            raise self._stamps
        full = os.fspath(path)
        name = full[len(self._root) :] if full.startswith(self._root) else full
        if name in self._extra or name not in self._stamps:
            raise IntegrityError(Report(problems=(Problem(name, "extra"),)), self._root.rstrip("/"))
        assert self.fs is not None
        self.fs.invalidate_cache(full)
        info = self.fs.info(full)
        if (int(info["size"]), storage._stamp(info)) != self._stamps[name]:
            raise OSError(
                f"{self._root}{name} changed after it was verified ({when}: its size or modification "
                "time differs): something is rewriting the checkpoint; not loaded from it"
            )


# --- writing -----------------------------------------------------------------------------------


class WrittenFile(NamedTuple):
    """One file a rank wrote: its name relative to the checkpoint root, size, and unit digests
    (and how they were computed: the writer's :attr:`HashingFsspecWriter.hashing`)."""

    name: str
    size: int
    digests: tuple[str, ...]
    hashing: str = ""


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
    """

    def __init__(
        self,
        path: URL,
        *,
        algorithm: str = DEFAULT_ALGORITHM,
        granularity: str = DEFAULT_GRANULARITY,
        chunk_size: int | None = None,
        private_key: signing.PrivateKey | None = None,
        **kwargs: Any,
    ) -> None:
        chunk_size = core.check_seal_options(algorithm, granularity, chunk_size)
        # Kept as PEM bytes: the writer is pickled for DCP's process executor, a key object is not picklable.
        self._signing_pem: bytes | None = None
        if private_key is not None:
            self._signing_pem = _pem(core.load_signing_key(private_key, algorithm, granularity))
        super().__init__(path, **kwargs)
        resolved: fsspec.AbstractFileSystem = self.fs.fs  # type: ignore[attr-defined]  # set by FsspecWriter
        self.hashing_fs = _HashingFileSystem(resolved, algorithm, chunk_size)
        self.fs = self.hashing_fs  # type: ignore[assignment]  # DCP annotates its local FileSystem
        self.algorithm = algorithm
        self.granularity = granularity
        self.chunk_size = chunk_size
        self.manifest: Manifest | None = None

    @property
    def hashing(self) -> str:
        """How this writer hashes (algorithm, granularity, chunk size): the same on every rank of a save."""
        chunks = "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        return f"algorithm={self.algorithm!r}, granularity={self.granularity!r}{chunks}"

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

        return super().write_data(plan, planner).then(with_digests)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = [wr.storage_data for wrs in results for wr in wrs if _is_carrier(wr)]
        other = sorted({f.hashing for f in files} - {self.hashing})
        if other:
            raise ValueError(f"ranks hashed their files differently ({'; '.join(other)}; here {self.hashing})")
        super().finish(metadata, [[wr for wr in wrs if not _is_carrier(wr)] for wrs in results])
        files += self._written_files()  # .metadata
        manifest = self._build_manifest(files)
        fs, root = storage.resolve(self.path, fs=self.hashing_fs.fs)
        signature = None
        if self._signing_pem is not None:
            signature = signing.sign(manifest, self._signing_pem, core.model_name(root))
        core.write_manifest(fs, root, manifest)
        if signature is not None:
            core.write_signature(fs, root, signature)
        self.manifest = manifest

    def _written_files(self) -> list[WrittenFile]:
        prefix = os.fspath(self.path).rstrip("/") + "/"
        out = []
        for path, (size, digests) in self.hashing_fs.take_written().items():
            if not path.startswith(prefix):
                raise ValueError(f"{path} was written outside the checkpoint at {self.path}")
            out.append(WrittenFile(path[len(prefix) :], size, digests, self.hashing))
        return out

    def _build_manifest(self, files: Sequence[WrittenFile]) -> Manifest:
        sizes = {f.name: f.size for f in sorted(files)}
        digests: dict[Unit, str | None] = {}
        for f in files:
            for index, digest in enumerate(f.digests):
                start, end = chunk_range(f.size, self.chunk_size or max(1, f.size), index)
                digests[Unit(f.name, index, start, end - start)] = digest
        return core.build_manifest(self.algorithm, self.granularity, self.chunk_size, sizes, digests)


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

    def __init__(self, fs: fsspec.AbstractFileSystem, algorithm: str, chunk_size: int | None) -> None:
        super().__init__()
        self.fs = fs
        self._algorithm = algorithm
        self._chunk_size = chunk_size
        self._checksums = storage.SealingWriter.carries_checksums(fs, algorithm)
        self._written: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (DCP's process executor sends the writer to its checkpoint process); the lock is not."""
        with self._lock:
            state = {**self.__dict__, "_written": dict(self._written)}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: URL, mode: str) -> Iterator[io.IOBase]:
        if "r" in mode and "+" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if "+" in mode or "a" in mode:
            raise ValueError(f"cannot hash a stream opened with mode {mode!r}: only whole writes ('wb') are sealed")
        if self._checksums:
            sealing = _SealingStream(
                storage.SealingWriter(
                    self.fs,
                    os.fspath(path),
                    algorithm=self._algorithm,
                    granularity="file" if self._chunk_size is None else "chunk",
                    chunk_size=self._chunk_size,
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
        else:
            with super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw, self._algorithm, self._chunk_size)
                try:
                    yield stream
                except BaseException:
                    stream.abandon()
                    raise
                size, digests = stream.finish()
        with self._lock:
            self._written[os.fspath(path)] = (size, digests)

    def rename(self, path: URL, new_path: URL) -> None:
        if self._checksums:
            # S3 has no rename but a copy (DCP renames .metadata.tmp): ask S3 for the copy's SHA-256,
            # so that a file written in one PUT stays attestable whatever the store's copy default.
            fs = self.fs
            assert fs is not None
            fs.copy(os.fspath(path), os.fspath(new_path), ChecksumAlgorithm="SHA256")
            fs.rm(os.fspath(path))
        else:
            super().rename(path, new_path)
        with self._lock:
            if os.fspath(path) in self._written:
                self._written[os.fspath(new_path)] = self._written.pop(os.fspath(path))

    def rm_file(self, path: URL) -> None:
        super().rm_file(path)
        with self._lock:
            self._written.pop(os.fspath(path), None)

    def take_written(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Size and digests of every file written (and closed) since the last call."""
        with self._lock:
            written, self._written = self._written, {}
        return written


class _HashingStream(io.IOBase):
    """A write stream that passes bytes to ``raw`` and hashes them on their way.

    Whole files: small writes are hashed at once; from the first large one on, hashing moves to a
    :class:`_BackgroundDigest`, so it overlaps the writes that follow (bytes stay in order).
    Chunks: a :class:`_ParallelChunkDigest` hashes several chunks at once on ``HASH_THREADS``.
    """

    def __init__(self, raw: Any, algorithm: str, chunk_size: int | None) -> None:
        super().__init__()
        self._raw = raw
        self._digest = StreamDigest(algorithm, chunk_size)
        self._background: _BackgroundDigest | None = None
        self._parallel = None
        if chunk_size is not None and HASH_THREADS > 1:
            self._parallel = _ParallelChunkDigest(algorithm, chunk_size, HASH_THREADS)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(data)
        n = len(view) if written is None else written
        if self._parallel is not None:
            self._parallel.update(view[:n])
        elif self._background is None and n < BACKGROUND_MIN_BYTES:
            self._digest.update(view[:n])
        else:
            if self._background is None:
                self._background = _BackgroundDigest(self._digest)
            self._background.update(view[:n])
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        if not getattr(self._raw, "closed", False):
            self._raw.flush()

    def finish(self) -> tuple[int, tuple[str, ...]]:
        """The stream's size and unit digests, once every byte is hashed."""
        digest: StreamDigest | _ParallelChunkDigest = self._digest
        if self._parallel is not None:
            self._parallel.close()
            digest = self._parallel
        if self._background is not None:
            self._background.close()
        position = self._raw.tell()
        if position != digest.size:
            raise OSError(f"hashed {digest.size} bytes but the stream is at {position}: it was seeked")
        return digest.size, digest.digests()

    def abandon(self) -> None:
        """Stop hashing (the write failed); errors of hashing no longer matter."""
        for hashing in (self._background, self._parallel):
            if hashing is not None:
                with contextlib.suppress(Exception):
                    hashing.close()


class _SealingStream(io.IOBase):
    """A write stream into a :class:`~integrity_fs.storage.SealingWriter` (S3 with checksums).

    The writer hashes what it sends (once) and uses the digests as S3 checksums. Writes are fed
    ``PIECE_BYTES`` at a time, so that it holds at most a part plus a piece.
    """

    def __init__(self, writer: storage.SealingWriter) -> None:
        super().__init__()
        self._writer = writer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            self._writer.write(view[start : start + PIECE_BYTES])
        return len(view)

    def tell(self) -> int:
        return self._writer.size

    def finish(self) -> tuple[int, tuple[str, ...]]:
        """Complete the object; its size and unit digests."""
        digests = self._writer.close()
        return self._writer.size, digests

    def abandon(self) -> None:
        """Drop what was sent, as far as the store allows."""
        self._writer.abort()


class _BackgroundDigest:
    """Feeds a :class:`StreamDigest` on a helper thread, in order, from a few reused buffers.

    The writer copies each write into the current buffer (its own may change once ``write``
    returns) and goes on; a full buffer goes to the helper thread. With every buffer taken the
    writer waits, so hashing lags by at most ``BUFFERS * PIECE_BYTES``. Reused buffers spare the
    page faults of fresh allocations.
    """

    def __init__(self, digest: StreamDigest) -> None:
        self._digest = digest
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="integrity_fs-hash", daemon=True)
        self._thread.start()

    def update(self, view: memoryview) -> None:
        while view:
            if self._current is None:
                self._current, self._filled = self._take_buffer(), 0
            take = min(len(view), PIECE_BYTES - self._filled)
            self._current[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == PIECE_BYTES:
                self._submit()

    def close(self) -> None:
        """Wait until every byte is hashed; raise what hashing raised."""
        if self._current is not None:
            self._submit()
        self._work.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _submit(self) -> None:
        assert self._current is not None
        self._work.put((self._current, self._filled))
        self._current = None

    def _take_buffer(self) -> bytearray:
        if self._allocated < BUFFERS:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._allocated += 1
                return bytearray(PIECE_BYTES)
        return self._free.get()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            buffer, length = item
            if self._error is None:
                try:
                    self._digest.update(memoryview(buffer)[:length])
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            self._free.put(buffer)


class _ParallelChunkDigest:
    """The chunk digests of a stream fed in order, several chunks hashed at once while it is written.

    Chunks are independent: chunk ``i`` goes to thread ``i % threads``, which hashes its pieces in
    order as they arrive (the chunk's hasher travels with each piece). The writer copies each write
    into reused ``PIECE_BYTES`` buffers (pieces end at chunk boundaries) and waits when all
    ``BUFFERS * threads`` are taken, so memory stays bounded and hashing lags by at most that much.
    Until ``BACKGROUND_MIN_BYTES`` the writer hashes inline (small files start no thread).
    """

    def __init__(self, algorithm: str, chunk_size: int, threads: int) -> None:
        self._algorithm = algorithm
        self._chunk_size = chunk_size
        self._threads_wanted = threads
        self.size = 0
        self._chunk = 0  # the chunk being written
        self._in_chunk = 0  # its bytes so far
        self._hasher = new_hasher(algorithm)  # of the chunk being written
        self._digests: dict[int, str] = {}
        self._queues: list[queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None]] = []
        self._threads: list[threading.Thread] = []
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._allocated = 0
        self._current: bytearray | None = None
        self._filled = 0
        self._error: BaseException | None = None
        self._closed = False

    def update(self, view: memoryview) -> None:
        if not self._threads:
            if self.size + len(view) < BACKGROUND_MIN_BYTES:
                self._inline(view)
                return
            self._start()
        while view:
            if self._current is None:
                self._current, self._filled = self._take_buffer(), 0
            take = min(len(view), len(self._current) - self._filled, self._chunk_size - self._in_chunk)
            self._current[self._filled : self._filled + take] = view[:take]
            self._filled += take
            self._in_chunk += take
            self.size += take
            view = view[take:]
            if self._in_chunk == self._chunk_size:
                self._submit(last=True)
            elif self._filled == len(self._current):
                self._submit(last=False)

    def close(self) -> None:
        """Wait until every byte is hashed; raise what hashing raised."""
        if self._closed:
            return
        self._closed = True
        if not self._threads:
            if self._in_chunk or self._chunk == 0:
                self._digests[self._chunk] = self._hasher.hexdigest()
            return
        if self._in_chunk or self._chunk == 0:
            self._submit(last=True)
        for work in self._queues:
            work.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error

    def digests(self) -> tuple[str, ...]:
        return tuple(self._digests[i] for i in range(len(self._digests)))

    def _inline(self, view: memoryview) -> None:
        while view:
            take = min(len(view), self._chunk_size - self._in_chunk)
            self._hasher.update(view[:take])
            self._in_chunk += take
            self.size += take
            view = view[take:]
            if self._in_chunk == self._chunk_size:
                self._digests[self._chunk] = self._hasher.hexdigest()
                self._next_chunk()

    def _next_chunk(self) -> None:
        self._chunk += 1
        self._in_chunk = 0
        self._hasher = new_hasher(self._algorithm)

    def _start(self) -> None:
        for index in range(self._threads_wanted):
            work: queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(work,), name=f"integrity_fs-hash-{index}", daemon=True)
            self._queues.append(work)
            self._threads.append(thread)
            thread.start()

    def _submit(self, *, last: bool) -> None:
        self._queues[self._chunk % len(self._queues)].put(
            (self._chunk, self._hasher, self._current, self._filled if self._current is not None else 0, last)
        )
        self._current = None
        if last:
            self._next_chunk()

    def _take_buffer(self) -> bytearray:
        if self._allocated < BUFFERS * len(self._threads):
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._allocated += 1
                return bytearray(PIECE_BYTES)
        return self._free.get()

    def _run(self, work: queue.SimpleQueue[tuple[int, Hasher, bytearray | None, int, bool] | None]) -> None:
        while (item := work.get()) is not None:
            chunk, hasher, buffer, length, last = item
            if self._error is None:
                try:
                    if buffer is not None:
                        hasher.update(memoryview(buffer)[:length])
                    if last:
                        self._digests[chunk] = hasher.hexdigest()
                except BaseException as exc:  # raised by close(), in the writer's thread
                    self._error = exc
            if buffer is not None:
                self._free.put(buffer)


# --- reading -----------------------------------------------------------------------------------


class VerifyingFsspecReader(FsspecReader):
    """An ``FsspecReader`` that verifies the checkpoint before it reads ``.metadata``.

    ``read_metadata`` is the first thing ``dcp.load`` calls on every rank; with ``collective=True``
    (the default) it runs :func:`integrity_fs.distributed.verify` over ``process_group``, so every
    rank of that group must call it, as ``dcp.load`` does. With ``collective=False`` each process
    verifies on its own (for ``no_dist`` loads). ``dcp.load`` wraps the verdict in its
    ``CheckpointException``; :func:`integrity_fs.dcp.load` raises it as it is.
    ``_extension_registry`` (DCP's experimental ``ExtensionRegistry``, as ``FileSystemReader``
    takes it) resolves the stream extensions the checkpoint was saved with.
    """

    def __init__(
        self,
        path: URL,
        *,
        require_manifest: bool = False,
        process_group: ProcessGroup | None = None,
        collective: bool = True,
        mode: distributed.Mode = "sharded",
        max_workers: int | None = None,
        strict: bool = False,
        _extension_registry: ExtensionRegistry | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__(path, **storage_options)
        # FsspecReader drops the registry that FileSystemReader takes: without it, streams saved
        # with custom extensions (the writer's ``_extensions``) cannot be read back.
        self.transforms = _StorageReaderTransforms(_extension_registry)
        self._storage_options = storage_options
        self._options: dict[str, Any] = {
            "require_manifest": require_manifest,
            "mode": mode,
            "max_workers": max_workers,
            "strict": strict,
        }
        self._process_group = process_group
        self._collective = collective
        self.report: Report | None = None
        self._verdict: Exception | None = None
        self._verified = False

    def reset(self, checkpoint_id: URL | None = None) -> None:
        super().reset(checkpoint_id)
        self.report, self._verdict, self._verified = None, None, False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._verify_once()
        return super().read_metadata(*args, **kwargs)

    def _verify_once(self) -> None:
        """Verify on the first call; later calls (DCP retries) repeat the verdict without collectives."""
        if not self._verified:
            self._verified = True
            try:
                self.report = _verify_or_skip(
                    self.path,
                    process_group=self._process_group,
                    storage_options=self._storage_options,
                    local=not self._collective,
                    **self._options,
                )
            except Exception as exc:
                self._verdict = exc
        if self._verdict is not None:
            raise self._verdict


def _verify_or_skip(
    url: URL,
    *,
    process_group: ProcessGroup | None,
    storage_options: dict[str, Any] | None,
    require_manifest: bool,
    mode: distributed.Mode,
    max_workers: int | None,
    strict: bool,
    local: bool = False,
    manifest: Manifest | URL | None = None,
) -> Report | None:
    """Verify (collectively unless ``local``); a missing manifest is logged and skipped unless required."""
    try:
        if local:
            return core.verify(
                url, storage_options=storage_options, max_workers=max_workers, strict=strict, manifest=manifest
            )
        return distributed.verify(
            url,
            group=process_group,
            mode=mode,
            storage_options=storage_options,
            max_workers=max_workers,
            strict=strict,
            manifest=manifest,
        )
    except ManifestNotFoundError:
        if require_manifest:
            raise
        log.info("%s has no %s: loading it unverified", url, "manifest")
        return None


@contextlib.contextmanager
def _single_process_quietly(single: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is documented, so quiet."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# --- resuming ----------------------------------------------------------------------------------


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
