"""``torch.distributed.checkpoint`` on any fsspec URL, sealed as it is written and verified as it is read.

- :func:`save`: each rank hashes the files it writes while it writes them (no second read); the
  digests are gathered once DCP is done and rank 0 writes the manifest (chunk granularity by
  default). ``keep_last`` then prunes the run folder over this save's own series.
- :func:`load`: the listing is checked against the manifest before any content is read; each
  byte is read once, and DCP gets the bytes of a unit (chunk, or whole file) only once it
  verified (see :func:`integrity_fs.open`). Damage in any file DCP reads raises, whatever DCP
  does with the exception, and on every rank. An unsealed checkpoint loads as before (INFO),
  unless ``require_manifest=True``.
- :func:`load_latest`: the newest checkpoint that loads verified; local, unless ``group=`` is given.
- :class:`VerifyingFsspecReader`: the ``StorageReader`` behind :func:`load`, for DCP flows of your own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import runs, storage
from .collectives import INSTALL_HINT, agree, group_of
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, PartialLoadError
from .manifest import MANIFEST_FILENAME, Manifest
from .options import SealOptions, VerifyOptions, flag
from .read import VerifiedFile
from .report import Report, printable
from .storage import URL
from .verify import Plan, build_manifest, prepare, write_sealed

try:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

__all__ = ["VerifyingFsspecReader", "load", "load_latest", "save"]

log = logging.getLogger("integrity_fs")
_SEAL_KEYS = {"algorithm", "granularity", "chunk_size", "private_key", "max_workers", "callback"}


def _root(fs: Any, path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    return os.path.abspath(fs._strip_protocol(path)) if storage.is_local(fs) else str(fs._strip_protocol(path)).rstrip("/")


class _HashingStream(io.RawIOBase):
    """What DCP writes a file into: hashed as it goes, written by ``storage.Writer``."""

    def __init__(self, writer: storage.Writer) -> None:
        super().__init__()
        self._writer = writer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._writer.write(view)
        return len(view)

    def tell(self) -> int:
        return self._writer.digest.size

    def fileno(self) -> int:
        stream = self._writer._stream
        if stream is None or not hasattr(stream, "fileno"):
            raise io.UnsupportedOperation("fileno")
        return int(stream.fileno())


class _HashingFileSystem(FileSystem):  # type: ignore[misc]
    """DCP's fsspec filesystem whose written files are hashed as they are written; ``written``
    records each one's size and unit digests by name relative to the checkpoint."""

    def __init__(self, fs: Any, root: str, options: SealOptions) -> None:
        super().__init__()
        self.fs, self.root, self._options = fs, root, options
        self.written: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def _name(self, path: str | os.PathLike[str]) -> str:
        return _root(self.fs, path)[len(self.root) + 1 :]

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = self._name(path)
        chunk = self._options.chunk_size if self._options.granularity == "chunk" else None
        tree = storage.LocalTree(self.root, create=True) if storage.is_local(self.fs) else None
        writer = storage.Writer(self.fs, storage.join(self.root, name), self._options.algorithm, chunk, tree=tree, rel=name)
        try:
            yield _HashingStream(writer)
            digests = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            if tree is not None:
                tree.close()
        with self._lock:
            self.written[name] = (writer.digest.size, digests)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            self.written[self._name(new_path)] = self.written.pop(self._name(path))


def _pattern_of(name: str, pattern: str | None) -> str:
    """The series of a saved name: ``pattern``, which must match it, or the name with its one integer as ``{step}``."""
    if pattern is not None:
        if runs.steps_of([name], pattern) == {}:
            raise ValueError(f"pattern {pattern!r} does not match the saved name {name!r}")
        return pattern
    found = re.findall(r"\d+", name)
    if len(found) != 1:
        what = "no integer" if not found else f"{len(found)} integers"
        raise ValueError(f"keep_last needs the step in the saved name, and {name!r} holds {what}: pass pattern= (e.g. pattern='step_{{step}}'), or save to a folder named by its step")
    at = re.search(r"\d+", name)
    assert at is not None
    return name[: at.start()].replace("*", "") + "{step}" + name[at.end() :].replace("*", "")


def save(
    state_dict: dict[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    planner: Any = None,
    keep_last: int | None = None,
    pattern: str | None = None,
    **kw: Any,
) -> Manifest:
    """``torch.distributed.checkpoint.save`` to ``url``, sealed as it is written; every rank returns
    the manifest. ``kw``: seal options (``algorithm``, ``granularity`` (default ``"chunk"``),
    ``chunk_size``, ``private_key`` (rank 0's counts)) and ``FsspecWriter`` options (``thread_count``,
    ``sync_files``, ``single_file_per_rank``, ``overwrite``). ``keep_last``: then prune the run
    folder (``url``'s parent) over this save's series: ``pattern``, or the saved name with its one
    integer as the step (a ``ValueError`` before anything is written when it has none or several)."""
    seal_kw = {k: v for k, v in kw.items() if k in _SEAL_KEYS}
    writer_kw = {k: v for k, v in kw.items() if k not in _SEAL_KEYS}
    options = SealOptions(**{"granularity": "chunk", **seal_kw})
    text = os.fspath(url)
    series = None
    if keep_last is not None:
        from .options import count

        count("keep_last", keep_last, optional=False)
        series = _pattern_of(text.rstrip("/").rsplit("/", 1)[-1], pattern)
    fs, root = storage.resolve(text, storage_options)
    hashing = _HashingFileSystem(fs, root, options)
    writer = FsspecWriter(text, **writer_kw, **(storage_options or {}))
    writer.fs = hashing
    g = group_of(process_group)
    single = g is None
    if g is None or torch_rank() == 0:  # unsealed before a byte is written: a killed save is never "damaged"
        storage.remove(fs, [storage.join(root, n) for n in storage.NOT_CONTENT if storage.exists(fs, storage.join(root, n))])
    with _quiet(single):
        dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=single)
    parts = [hashing.written] if g is None else agree(g, lambda: hashing.written, every=True)
    written: dict[str, tuple[int, tuple[str, ...]]] = {}
    for part in parts:
        written.update(part)
    manifest = build_manifest(options, {n: s for n, (s, _) in written.items()}, {n: d for n, (_, d) in written.items()})

    def seal_and_prune() -> None:
        write_sealed(fs, root, manifest, key=options.private_key)
        runs.remember(fs, root, Report(files_checked=len(written), bytes_checked=sum(s for s, _ in written.values())))
        if keep_last is not None:
            runs.prune_root(fs, storage.parent(root), keep_last=keep_last, pattern=series, unsealed=False, dry_run=False, options=VerifyOptions())

    if g is None:
        seal_and_prune()
    else:
        agree(g, seal_and_prune, only=0)
    return manifest


@contextlib.contextmanager
def _quiet(single: bool) -> Iterator[None]:
    """DCP warns that a single-process call is one; asked for on purpose, that says nothing."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def torch_rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


class _VerifiedFileSystem(FileSystem):  # type: ignore[misc]
    """DCP's fsspec filesystem, reading each file through :class:`~integrity_fs.read.VerifiedFile`
    of the one checked plan. The first failure is kept, whatever DCP does with the exception."""

    def __init__(self, reader: VerifyingFsspecReader) -> None:
        super().__init__()
        self._reader = reader

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        reader = self._reader
        if reader.failure is not None:
            raise reader.failure
        plan, serving = reader.plan()
        name = _root(reader.store, path)[len(reader.root) + 1 :]
        stat = plan.listing.get(name)
        if name not in plan.manifest.files or stat is None:
            raise FileNotFoundError(f"{name} is not in the manifest of {plan.location}")
        version = stat.version if serving is reader.store else None
        with VerifiedFile(serving, reader.root, name, stat.size, version, plan.manifest, plan.location) as f:
            try:
                yield f
            except BaseException as exc:
                if isinstance(exc, (IntegrityError, FileChangedError)) and reader.failure is None:
                    reader.failure = exc
                raise
            finally:
                reader.checked[name] = max(reader.checked.get(name, 0), f.bytes_verified)
                if name != ".metadata" and f.bytes_verified:
                    reader.touched = True


class VerifyingFsspecReader(FsspecReader):  # type: ignore[misc]
    """DCP's ``FsspecReader`` that hands DCP only verified bytes (see the module docstring):
    ``dcp.load(state_dict, storage_reader=VerifyingFsspecReader(url))``. ``report()`` after the load."""

    def __init__(self, path: URL, *, storage_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(os.fspath(path), **(storage_options or {}))
        self.options = VerifyOptions(**options)
        self.serving, self.root = storage.resolve(os.fspath(path), storage_options, through_caches=True)
        self.store = storage.under_cache(self.serving)
        self.fs = _VerifiedFileSystem(self)
        self.failure: BaseException | None = None
        self.touched = False
        self.checked: dict[str, int] = {}
        self._plan: Plan | None = None

    def plan(self) -> tuple[Plan, Any]:
        """The checked plan (listing against manifest, before any content), made once."""
        if self._plan is None:
            try:
                plan = prepare(self.store, self.root, self.options)
            except IntegrityError as exc:
                self.failure = exc
                raise
            if plan.problems:
                self.failure = IntegrityError(Report(problems=tuple(plan.problems), extra=plan.extra), plan.location)
                raise self.failure
            self._plan = plan
        return self._plan, self.serving

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self.fs = _VerifiedFileSystem(self)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:  # DCP's fallback to rank-local metadata must not pass over it
            raise self.failure
        return super().read_metadata(*args, **kwargs)

    def report(self) -> Report:
        plan, _ = self.plan()
        return Report(extra=plan.extra, files_checked=len(self.checked), bytes_checked=sum(self.checked.values()))


def load(
    state_dict: dict[str, Any],
    url: URL,
    *,
    verify: bool = True,
    require_manifest: bool = False,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    planner: Any = None,
    **options: Any,
) -> Report | None:
    """``torch.distributed.checkpoint.load`` from ``url``, every byte verified before DCP uses it
    (see the module docstring); the report, or ``None`` for an unsealed checkpoint loaded as it
    is (``require_manifest=True``: ``ManifestNotFoundError``) or ``verify=False``. A collective
    over ``process_group`` when a process group is initialised, as DCP's own load."""
    return _load(state_dict, url, verify, require_manifest, storage_options, process_group, planner, options, no_dist=False)


def _load(state_dict: Any, url: URL, verify: bool, require: bool, storage_options: Any, group: Any, planner: Any, options: dict[str, Any], *, no_dist: bool) -> Any:
    flag("verify", verify)
    flag("require_manifest", require)
    g = None if no_dist else group_of(group)
    text = os.fspath(url)
    if not verify:
        with _quiet(g is None):
            dcp_load(state_dict, storage_reader=FsspecReader(text, **(storage_options or {})), planner=planner, process_group=group, no_dist=no_dist or g is None)
        return None
    reader = VerifyingFsspecReader(text, storage_options=storage_options, **options)

    def check() -> bool:
        try:
            reader.plan()
            return True
        except ManifestNotFoundError:
            if require:
                raise
            return False

    sealed = check() if g is None else agree(g, check)
    if not sealed:
        log.info("%s has no manifest: loaded without verification", printable(text))
        with _quiet(g is None):
            dcp_load(state_dict, storage_reader=FsspecReader(text, **(storage_options or {})), planner=planner, process_group=group, no_dist=no_dist or g is None)
        return None
    _verified_load(state_dict, reader, g, group, planner)
    return reader.report()


def _verified_load(state_dict: Any, reader: VerifyingFsspecReader, g: Any, group: Any, planner: Any) -> None:
    """DCP's load through ``reader``; the reader's own failure wins over whatever DCP made of it,
    and every rank raises the first one."""
    failure: BaseException | None = None
    try:
        with _quiet(g is None):
            dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=group, no_dist=g is None)
    except BaseException as exc:
        failure = exc
    if reader.failure is not None:
        failure = reader.failure
    if g is not None:
        agree(g, lambda: _raise(failure))
    elif failure is not None:
        raise failure


def _raise(failure: BaseException | None) -> None:
    if failure is not None:
        raise failure


def load_latest(
    state_dict: dict[str, Any],
    root: URL,
    *,
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    group: Any = None,
    planner: Any = None,
    **options: Any,
) -> str | None:
    """Load the newest checkpoint under ``root`` that loads verified; its URL, or ``None`` (and
    ``state_dict`` untouched) when none does. Unsealed, invalid, damaged and changing ones are
    skipped with a WARNING; a storage error is raised. When a checkpoint failed after some of its
    bytes reached ``state_dict`` and nothing verified loaded over them, ``PartialLoadError``
    (chained to what ended the search). A local call unless ``group=`` is given."""
    VerifyOptions(**options)
    fs, root_ = storage.resolve(root, storage_options)
    g = group_of(group) if group is not None else None
    order, _, _ = runs.candidates_of(fs, root_, pattern) if g is None else agree(g, lambda: runs.candidates_of(fs, root_, pattern), only=0)
    left: list[str] = []  # checkpoints whose bytes are in state_dict, unloaded over
    for name in order:
        url = storage.join(root_, name) if storage.is_local(fs) else str(fs.unstrip_protocol(storage.join(root_, name)))
        reader_box: list[VerifyingFsspecReader] = []
        try:
            if VerifyOptions(**options).public_key is not None:
                options = {**options, "expected_name": name}
            _load_latest_one(state_dict, url, storage_options, group if g is not None else None, planner, options, reader_box, no_dist=g is None)
            return url
        except (ManifestNotFoundError, ManifestError, IntegrityError, FileChangedError) as exc:
            if reader_box and reader_box[0].touched:
                left.append(f"{name} ({type(exc).__name__}: {exc})")
            log.warning("skipping %s: %s", printable(url), printable(str(exc)))
        except OSError as exc:
            if left or (reader_box and reader_box[0].touched):
                raise PartialLoadError(f"state_dict holds bytes of {', '.join(left) or name} that nothing loaded over, and the search ended on a storage error: {exc}") from exc
            raise
    if left:
        raise PartialLoadError(f"state_dict holds bytes of {', '.join(left)} that nothing loaded over; no checkpoint under {printable(str(root))} loaded")
    return None


def _load_latest_one(state_dict: Any, url: str, storage_options: Any, group: Any, planner: Any, options: dict[str, Any], box: list[Any], *, no_dist: bool) -> None:
    reader = VerifyingFsspecReader(url, storage_options=storage_options, **options)
    box.append(reader)
    g = None if no_dist else group_of(group)
    if g is None:
        reader.plan()  # ManifestNotFoundError: unsealed, skipped
    else:
        agree(g, reader.plan)
    _verified_load(state_dict, reader, g, group, planner)
