"""The reader side of ``dcp.load``: DCP's ``FsspecReader`` that reads only what the manifest covers.

Internal: the public names are re-exported by ``integrity_fs.dcp``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import distributed, storage
from ..collectives import INSTALL_HINT
from ..errors import IntegrityError, ManifestNotFoundError
from ..manifest import Manifest
from ..report import Problem, Report
from ..verify import verify as local_verify

try:
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import Metadata
except ImportError as exc:
    raise ImportError(f"integrity_fs.dcp needs torch: {INSTALL_HINT}") from exc

if TYPE_CHECKING:
    import fsspec
    from torch.distributed import ProcessGroup

__all__ = ["VerifyingFsspecReader"]

log = logging.getLogger("integrity_fs")

URL = str | os.PathLike[str]


def listed_stamps(url: URL, storage_options: dict[str, Any] | None) -> dict[str, tuple[int, str]] | Exception:
    """Each file's size and version stamp (mtime, ETag) as listed now; the failure to list, kept
    to be raised inside DCP's read step (where every rank learns of it) rather than before a collective."""
    try:
        fs, root = storage.resolve(url, storage_options)
        stamps: dict[str, str] = {}
        sizes = storage.list_files(fs, root, stamps=stamps)
    except Exception as exc:
        return exc
    return {name: (size, stamps.get(name, "")) for name, size in sizes.items()}


class VerifiedFileSystem(_FsspecFileSystem):
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
        self.listed_stamps = stamps
        self._extra = set(report.extra)

    @contextlib.contextmanager
    def create_stream(self, path: URL, mode: str) -> Iterator[io.IOBase]:
        self._check(path, "before it was read")
        with super().create_stream(path, mode) as stream:
            yield stream
        self._check(path, "while it was read")

    def _check(self, path: URL, when: str) -> None:
        if isinstance(self.listed_stamps, Exception):
            raise self.listed_stamps
        full = os.fspath(path)
        name = full[len(self._root) :] if full.startswith(self._root) else full
        if name in self._extra or name not in self.listed_stamps:
            raise IntegrityError(Report(problems=(Problem(name, "extra"),)), self._root.rstrip("/"))
        assert self.fs is not None
        self.fs.invalidate_cache(full)
        info = self.fs.info(full)
        if (int(info["size"]), storage.stamp_of(info)) != self.listed_stamps[name]:
            raise OSError(
                f"{self._root}{name} changed after it was verified ({when}: its size or modification "
                "time differs): something is rewriting the checkpoint; not loaded from it"
            )


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
                self.report = verify_or_skip(
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


def verify_or_skip(
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
            return local_verify(
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
