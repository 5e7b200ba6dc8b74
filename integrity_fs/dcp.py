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
- :class:`VerifyingFsspecReader` is the ``StorageReader`` behind :func:`load`. It is not public:
  DCP may swallow a reader's exception (its fallback from ``.metadata`` to ``__0.metadata``), so
  the guarantee that damage raises holds only through :func:`load`, which checks the reader after DCP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import runs, storage
from .collectives import INSTALL_HINT, agree, check_same, fingerprint, gather, group_of, logged_once
from .distributed import candidates
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, PartialLoadError
from .manifest import Manifest
from .options import SealOptions, VerifyOptions, count, flag
from .read import VerifiedFile
from .report import Problem, Report, printable
from .storage import URL
from .verify import Plan, build_manifest, prepare, write_sealed

try:
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

__all__ = ["load", "load_latest", "save"]  # VerifyingFsspecReader: see the module docstring

log = logging.getLogger("integrity_fs")
_SEAL_KEYS = {"algorithm", "granularity", "chunk_size", "private_key", "max_workers", "callback"}


def _name(base: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """The name, relative to the checkpoint, of a path DCP made from its own ``base`` (DCP joins
    ``base`` and the name with ``os.path.join``, whatever the URL's protocols)."""
    base_, path_ = os.fspath(base).rstrip("/"), os.fspath(path)
    if not path_.startswith(base_ + "/"):
        raise ValueError(f"{path_} is not inside the checkpoint at {base_}")
    return path_[len(base_) + 1 :]


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
        return self._writer.size

    def fileno(self) -> int:
        stream = self._writer._stream
        if stream is None or not hasattr(stream, "fileno"):
            raise io.UnsupportedOperation("fileno")
        return int(stream.fileno())


class _HashingFileSystem(FileSystem):
    """DCP's fsspec filesystem whose written files are hashed as they are written; ``written``
    records each one's size and unit digests by name relative to the checkpoint."""

    def __init__(self, fs: Any, root: str, options: SealOptions, base: str) -> None:
        super().__init__()
        self.fs, self.root, self._options, self._base = fs, root, options, base
        self.written: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.failure: BaseException | None = None  # DCP's writer threads swallow theirs: the first is kept
        self._lock = threading.Lock()

    def _name(self, path: str | os.PathLike[str]) -> str:
        return _name(self._base, path)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self._hashed(path) as stream:
                yield stream
        except BaseException as exc:
            with self._lock:
                self.failure = self.failure or exc
            raise

    @contextlib.contextmanager
    def _hashed(self, path: str | os.PathLike[str]) -> Iterator[io.IOBase]:
        name = self._name(path)
        chunk = self._options.chunk_size if self._options.granularity == "chunk" else None
        tree = storage.LocalTree(self.root, create=True) if storage.is_local(self.fs) else None
        try:
            writer = storage.Writer(
                self.fs, storage.join(self.root, name), self._options.algorithm, chunk, tree=tree, rel=name, beside=True
            )
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
            self.written[name] = (writer.size, digests)

    def result(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """What this rank wrote, or the first failure of any of its writes (on whichever thread)."""
        if self.failure is not None:
            raise self.failure
        return self.written

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        if storage.is_local(self.fs) and os.path.islink(path):  # the link itself (older fsspec follows it)
            os.unlink(path)
        else:
            super().rm_file(path)

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
        raise ValueError(
            f"keep_last needs the step in the saved name, and {name!r} holds {what}: pass pattern= "
            "(e.g. pattern='step_{step}'), or save to a folder named by its step"
        )
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
    text = os.fspath(url)
    g = group_of(process_group)

    def arguments() -> tuple[SealOptions, str | None, Any, str, Any]:
        options = SealOptions.of(**{"granularity": "chunk", **{k: v for k, v in kw.items() if k in _SEAL_KEYS}})
        series = None
        if keep_last is not None:
            count("keep_last", keep_last, optional=False)
            series = _pattern_of(text.rstrip("/").rsplit("/", 1)[-1], pattern)
        fs, root = storage.resolve(text, storage_options)
        writer = FsspecWriter(text, **{k: v for k, v in kw.items() if k not in _SEAL_KEYS}, **(storage_options or {}))
        return options, series, fs, root, writer

    if g is None:
        options, series, fs, root, writer = arguments()
    else:  # every rank checks its arguments, then all hash alike (rank 0 seals every rank's digests)
        options, series, fs, root, writer = agree(g, arguments)
        check_same(
            g, {**dict(fingerprint(options)), "keep_last": keep_last, "series": series}, "the arguments of dcp.save"
        )
    hashing = _HashingFileSystem(fs, root, options, text)
    writer.fs = hashing

    def unseal() -> None:  # before a byte is written: a killed save is never "damaged"
        storage.remove(
            fs, [storage.join(root, n) for n in storage.NOT_CONTENT if storage.exists(fs, storage.join(root, n))]
        )

    unseal() if g is None else agree(g, unseal, only=0)
    with _quiet(g is None):
        dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=g is None)
    parts = [hashing.result()] if g is None else agree(g, hashing.result, every=True)
    written: dict[str, tuple[int, tuple[str, ...]]] = {}
    for part in parts:
        written.update(part)
    manifest = build_manifest(options, {n: s for n, (s, _) in written.items()}, {n: d for n, (_, d) in written.items()})

    def seal_and_prune() -> None:
        write_sealed(fs, root, manifest, key=options.private_key)
        runs.remember(fs, root, Report(files_checked=len(written), bytes_checked=sum(s for s, _ in written.values())))
        if keep_last is not None:
            key = options.private_key  # a signing run counts only what it signed
            judged = VerifyOptions(public_key=None if key is None else key.public_key())
            runs.prune_root(
                fs,
                storage.parent(root),
                keep_last=keep_last,
                pattern=series,
                unsealed=False,
                dry_run=False,
                options=judged,
            )

    if g is None:
        seal_and_prune()
    else:
        agree(g, seal_and_prune, only=0)
    return manifest


@contextlib.contextmanager
def _quiet(single: bool) -> Iterator[None]:
    """DCP's warnings about what integrity_fs does on purpose: a single-process call, and a save
    over a folder that holds a checkpoint (unsealed first; the manifest lists what this save wrote)."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


class _VerifiedFileSystem(FileSystem):
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
        name = _name(reader.path, path)
        stat = plan.listing.get(name)
        if stat is not None and name not in plan.manifest.files:  # there, but nothing can vouch for its bytes
            reader.failure = reader.failure or IntegrityError(Report(problems=(Problem(name, "extra"),)), plan.location)
            raise reader.failure
        if stat is None:  # not there: DCP may fall back (from .metadata to __0.metadata)
            raise FileNotFoundError(f"{name} is not in the checkpoint at {plan.location}")
        version = stat.version if serving is reader.store else None
        try:
            with VerifiedFile(serving, reader.root, name, stat.size, version, plan.manifest, plan.location) as f:
                try:
                    yield f
                finally:
                    if name != ".metadata" and f.bytes_verified:
                        reader.touched = True
        except BaseException as exc:  # damage, a change, a storage error: kept, whatever DCP makes of it
            if reader.failure is None:
                reader.failure = exc
            raise
        reader.checked[name] = max(reader.checked.get(name, 0), f.bytes_verified)  # a damaged file is never "checked"
        if reader.options.callback is not None and f.bytes_verified:
            reader.options.callback.relative_update(f.bytes_verified)  # progress: the bytes of each file read


class VerifyingFsspecReader(FsspecReader):
    """DCP's ``FsspecReader`` that hands DCP only verified bytes (see the module docstring):
    ``dcp.load(state_dict, storage_reader=VerifyingFsspecReader(url))``. ``report()`` after the load."""

    def __init__(self, path: URL, *, storage_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(os.fspath(path), **(storage_options or {}))
        self.options = VerifyOptions.of(**options)
        self.serving, self.root = storage.resolve(os.fspath(path), storage_options, through_caches=True)
        self.store = storage.under_cache(self.serving)
        self.fs = _VerifiedFileSystem(self)  # type: ignore[assignment]  # DCP types it as its local FileSystem
        self.failure: BaseException | None = None
        self.touched = False  # verified bytes of this checkpoint may have reached the state dict
        self.planned: set[str] = set()  # the keys DCP was to load from it
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
        self.fs = _VerifiedFileSystem(self)  # type: ignore[assignment]  # DCP types it as its local FileSystem

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:  # DCP's fallback to rank-local metadata must not pass over it
            raise self.failure
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's reads, each file's in the order of their offsets (DCP's own order jumps back and
        forth): the verified units are then read once, each in turn."""
        self.planned.update(str(item.dest_index.fqn) for item in plan.items)
        where = self.storage_data
        items = sorted(plan.items, key=lambda i: (where[i.storage_index].relative_path, where[i.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

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
    report: Report | None = _load(
        state_dict, url, verify, require_manifest, storage_options, process_group, planner, options
    )
    return report


def _load(
    state_dict: Any,
    url: URL,
    verify: bool,
    require: bool,
    storage_options: Any,
    group: Any,
    planner: Any,
    options: dict[str, Any],
) -> Any:
    g = group_of(group)
    text = os.fspath(url)

    def arguments() -> VerifyingFsspecReader | None:
        flag("verify", verify)
        flag("require_manifest", require)
        checked = VerifyingFsspecReader(text, storage_options=storage_options, **options)
        return checked if verify else None

    if g is None:
        reader = arguments()
    else:  # a rank that skips verifying would wait in DCP's collectives for ranks that raise
        reader = agree(g, arguments)
        check_same(
            g,
            {"verify": verify, "require_manifest": require, **dict(fingerprint(VerifyOptions.of(**options)))},
            "the arguments of dcp.load",
        )
    if reader is None:
        _plain_load(state_dict, text, storage_options, planner, group, g)
        return None

    def check() -> bool:
        try:
            reader.plan()
            return True
        except ManifestNotFoundError:
            if require:
                raise
            return False

    if g is None:
        sealed = check()
    else:  # a rank that loads unverified would wait in DCP's collectives for ranks that verify
        sealed = agree(g, check)
        check_same(g, sealed, "whether the checkpoint is sealed (every rank must see the same storage)")
    if not sealed:
        log.info("%s has no manifest: loaded without verification", printable(text))
        _plain_load(state_dict, text, storage_options, planner, group, g)
        return None
    _verified_load(state_dict, reader, g, group, planner)
    return reader.report()


def _plain_load(state_dict: Any, text: str, storage_options: Any, planner: Any, group: Any, g: Any) -> None:
    with _quiet(g is None):
        dcp_load(
            state_dict,
            storage_reader=FsspecReader(text, **(storage_options or {})),
            planner=planner,
            process_group=group,
            no_dist=g is None,
        )


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
    (chained to what ended the search). A local call unless ``group=`` is given (then a collective
    over it: every rank loads the same checkpoint, or raises the same error)."""
    g = group_of(group) if group is not None else None

    def arguments() -> tuple[VerifyOptions, Any, str]:
        return (VerifyOptions.of(**options), *storage.resolve(root, storage_options))

    if g is None:
        checked, fs, root_ = arguments()
        order = runs.candidates_of(fs, root_, pattern)[0]
    else:
        checked, fs, root_ = agree(g, arguments)
        check_same(g, {"pattern": pattern, **dict(fingerprint(checked))}, "the arguments of dcp.load_latest")
        order = candidates(g, fs, root_, pattern, "sharded")[0]  # every rank loads from its own view
    with logged_once(g):
        if not order:
            log.warning("no checkpoints under %s", printable(storage.describe(fs, root_)))
        partial = _Partial(root)
        for name in order:
            url = (
                storage.join(root_, name)
                if storage.is_local(fs)
                else str(fs.unstrip_protocol(storage.join(root_, name)))
            )
            named = {**options, "expected_name": name} if checked.public_key is not None else options
            readers: list[VerifyingFsspecReader] = []
            try:
                reader = _load_one(state_dict, url, storage_options, group, planner, named, g, readers)
            except (ManifestNotFoundError, ManifestError, IntegrityError, FileChangedError) as exc:
                partial.failed(readers, url, exc, g)
                log.warning("skipping %s (%s): %s", printable(url), _verdict(exc), printable(str(exc)))
                continue
            except OSError as exc:
                partial.failed(readers, url, exc, g)
                partial.raise_if_left(f"the search ended on a storage error at {printable(url)}: {exc}", exc)
                raise
            left = partial.uncovered(reader.planned, g)
            if left:
                partial.raise_if_left(
                    f"{printable(url)}, loaded after it, did not write every key "
                    f"({', '.join(sorted(left)[:5])} keep bytes of the other)",
                    None,
                )
            return url
        partial.raise_if_left(f"no checkpoint under {printable(str(root))} loaded over it", None)
        return None


def _verdict(exc: BaseException) -> str:
    """The word ``status`` and ``latest_verified`` use for a checkpoint skipped for ``exc``."""
    kinds = (
        (ManifestNotFoundError, "unsealed"),
        (ManifestError, "invalid"),
        (FileChangedError, "changing"),
        (IntegrityError, "damaged"),
        (OSError, "storage error"),
    )
    return next((word for kind, word in kinds if isinstance(exc, kind)), type(exc).__name__)


class _Partial:
    """The candidates of ``load_latest`` whose verified bytes reached the state dict, and the keys
    they were loading: what a later load must cover, or ``PartialLoadError``."""

    def __init__(self, root: URL) -> None:
        self.root = root
        self.left: list[tuple[str, BaseException]] = []
        self.keys: set[str] = set()

    def failed(self, readers: list[VerifyingFsspecReader], url: str, exc: BaseException, g: Any) -> None:
        reader = readers[0] if readers else None
        touched = reader is not None and reader.touched
        if g is not None:  # what one rank loaded is in every rank's state (the same error everywhere)
            touched = any(gather(g, touched))
        if touched:
            self.left.append((url, exc))
            self.keys |= reader.planned if reader is not None else set()

    def uncovered(self, loaded: set[str], g: Any) -> set[str]:
        left = self.keys - loaded
        if g is not None:
            left = set().union(*gather(g, sorted(left)))
        return left

    def raise_if_left(self, why: str, cause: BaseException | None) -> None:
        if not self.left:
            return
        first_url, first = self.left[0]
        report = first.report if isinstance(first, IntegrityError) else None
        where = "; ".join(f"{printable(u)} ({_verdict(e)}: {printable(str(e))})" for u, e in self.left)
        error = PartialLoadError(f"state_dict holds partial data of {where}: {why}", report, first_url)
        raise error from (cause if cause is not None else self.left[-1][1])


def _load_one(
    state_dict: Any,
    url: str,
    storage_options: Any,
    group: Any,
    planner: Any,
    options: dict[str, Any],
    g: Any,
    box: list[VerifyingFsspecReader],
) -> VerifyingFsspecReader:
    """One candidate of ``load_latest``, loaded verified (its reader put in ``box`` first)."""

    def checked() -> VerifyingFsspecReader:
        reader = VerifyingFsspecReader(url, storage_options=storage_options, **options)
        box.append(reader)
        reader.plan()  # ManifestNotFoundError: unsealed, skipped
        return reader

    reader = checked() if g is None else agree(g, checked)
    _verified_load(state_dict, reader, g, group, planner)
    return reader
