"""The one read pass of every transfer: each file streamed from source to destination, hashed as
it passes, and (for a sealed source) compared with its manifest.

Internal: ``download``, ``upload`` and ``copy`` call these.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import storage
from ..errors import IntegrityError
from ..hashing import Unit, plan_units
from ..manifest import Manifest
from ..options import Hashing, Work
from ..report import Problem, Report
from ..verification import VerificationPlan, finish_verification
from ..work import default_workers, run_parallel

if TYPE_CHECKING:
    import fsspec

__all__ = ["Copied", "Outcome", "Resized", "Side", "sent_as_listed", "stream", "unit_digests", "verified_copy"]


@dataclass(frozen=True)
class Side:
    """One end of a transfer: a filesystem, a root inside it, and the root as a URL for messages."""

    fs: fsspec.AbstractFileSystem
    root: str

    @property
    def location(self) -> str:
        return storage.describe(self.fs, self.root)

    def path(self, name: str) -> str:
        if storage.is_local(self.fs):
            return os.path.join(self.root, *name.split("/"))
        return storage.join(self.root, name)


@dataclass(frozen=True)
class Copied:
    """What went through one stream: its byte count and one digest per unit (chunk, or whole file)."""

    size: int
    unit_digests: tuple[str, ...]


@dataclass(frozen=True)
class Resized:
    """The source file does not hold the planned bytes (it changed since the listing): ``size`` now, if known."""

    size: int | None


#: What copying one file gives: what was sent; ``Resized``; ``None`` when the source vanished.
Outcome = Copied | Resized | None


def verified_copy(
    src: Side,
    dst: Side,
    manifest: Manifest,
    plan: VerificationPlan,
    versions: Mapping[str, storage.Version],
    work: Work,
    written: storage.Written,
    recording: storage.WriteRecording | None = None,
) -> Report:
    """Stream the files of ``plan`` from ``src`` to ``dst`` and compare them with ``manifest``;
    ``IntegrityError`` (about ``src``) if any differs, changed size or vanished since the listing."""
    hashing = Hashing.of(manifest)
    outcomes = stream(src, dst, plan.sizes, hashing, versions, work, written, recording)
    problems: list[Problem] = []
    for name, outcome in outcomes.items():
        if outcome is None:
            problems.append(Problem(name, "missing", expected=manifest.files[name]))
        elif isinstance(outcome, Resized):
            problems.append(Problem(name, "size", expected=plan.sizes[name], actual=outcome.size))
    whole = {name: c for name, c in outcomes.items() if isinstance(c, Copied)}
    digests = unit_digests(hashing, whole)
    streamed = dataclasses.replace(
        plan,
        problems=plan.problems + tuple(problems),
        sizes={name: c.size for name, c in whole.items()},
        units=tuple(digests),
    )
    report = finish_verification(manifest, streamed, digests)
    if not report.ok:
        raise IntegrityError(report, src.location)
    return report


def sent_as_listed(src: Side, outcomes: Mapping[str, Outcome]) -> dict[str, Copied]:
    """The files of an unsealed upload, each sent exactly as listed; ``OSError`` otherwise (as ``seal``)."""
    gone = sorted(name for name, outcome in outcomes.items() if outcome is None)
    if gone:
        raise FileNotFoundError(f"files vanished while uploading {src.location}: {', '.join(gone)}")
    resized = sorted(name for name, outcome in outcomes.items() if isinstance(outcome, Resized))
    if resized:
        raise OSError(f"files changed size while uploading {src.location}: {', '.join(resized)}")
    return {name: c for name, c in outcomes.items() if isinstance(c, Copied)}


def stream(
    src: Side,
    dst: Side,
    sizes: Mapping[str, int],
    hashing: Hashing,
    versions: Mapping[str, storage.Version],
    work: Work,
    written: storage.Written,
    recording: storage.WriteRecording | None = None,
) -> dict[str, Outcome]:
    """Copy exactly ``sizes[name]`` bytes of every file, hashing the same bytes as they pass; one
    progress total (file content only).

    Each copy keeps the rules of verify's reads (``storage.copy_file``): the source must end
    there, a stop (Ctrl-C, the first failure) ends every worker within a block or a poll of the
    event loop, transient failures are retried as storage retries reads. Writes go through
    ``storage.SealingWriter``: on S3 they carry the SHA-256 checksums that make the copy
    attestable (``verify(attested=True)``); a copy that fails is aborted, never committed short.
    Every destination path written is recorded in ``written`` (to delete it if the transfer fails).
    ``recording``: computes the destination store's own checksums of what is sent.
    """
    workers = work.max_workers or max(default_workers(src.fs), default_workers(dst.fs))
    progress = storage.progress_fn(work.callback, sum(sizes.values()))
    stop = threading.Event()

    def sinks_of(name: str) -> Callable[[bool], list[storage.StoreHasher]] | None:
        if not recording:
            return None
        return lambda checksummed: recording.sinks(name, sizes[name], checksummed=checksummed)

    def one(name: str) -> Outcome:
        try:
            source = storage.Span(src.fs, src.path(name), 0, sizes[name], sizes[name], versions.get(name))
            digests = storage.copy_file(
                source,
                dst.fs,
                dst.path(name),
                hashing,
                progress=progress,
                stop=stop,
                written=written,
                sinks=sinks_of(name),
            )
        except storage.SizeChangedError as exc:
            return Resized(exc.size)
        return None if digests is None else Copied(sizes[name], digests)

    return run_parallel(one, sorted(sizes, key=lambda n: -sizes[n]), workers, stop=stop)


def unit_digests(hashing: Hashing, copied: Mapping[str, Copied]) -> dict[Unit, str | None]:
    """The digest of every hashing unit (as seal and verify plan them) of the copied files."""
    sizes = {name: c.size for name, c in sorted(copied.items())}
    return {u: copied[u.name].unit_digests[u.index] for u in plan_units(hashing.granularity, sizes, hashing.chunk_size)}
