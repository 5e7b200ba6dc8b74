"""The command line as a collective under a launcher: ``torchrun --nproc-per-node 8 -m integrity_fs verify URL``.

When the environment says this process is one rank of several (``WORLD_SIZE`` > 1, with the
``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` that torchrun sets), ``seal``, ``verify``,
``latest``, ``status`` and ``prune`` join a process group (gloo, unless one is already
initialised) and call the :mod:`integrity_fs.distributed` functions: in sharded mode (``--mode sharded``, the default)
the bytes are split over every rank of every node; ``--mode rank0`` lets rank 0 alone read
(node-local storage). ``status`` and ``prune`` agree on the verdicts (the hashing shared); rank 0
makes ``status``'s table, and deletes what ``prune`` plans.

What every rank keeps, whatever one rank meets: the arguments are parsed on every rank and the
outcomes gathered, so a rank given a bad argument fails every rank (exit 2) before any
checkpoint is read; what a command prepares (storage options, key files, the root's existence) is
agreed the same way before the first collective read; the ``distributed`` functions raise the
same exception on every rank; rank 0 alone prints (human or ``--json``); and the exit codes are
gathered at the end, so that every rank exits with the same one (the first rank's that is not 0).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .. import checkpoints, distributed, retention, storage
from ..collectives import Group, all_gather, group_of, torch_distributed
from ..manifest import Manifest
from ..options import SealOptions, VerifyOptions, Work
from ..report import Report
from ..sealing import seal_at
from ..verification import check
from .errors import AgreedError, UsageError, describe_error, exit_code_for

__all__ = ["COLLECTIVE", "Collective", "Local", "Runner", "collective_command", "launched", "run"]

T = TypeVar("T")

#: The commands that run as collectives under a launcher.
COLLECTIVE = ("seal", "verify", "latest", "status", "prune")


def launched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher started this process as one rank of several (``WORLD_SIZE`` > 1)."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def collective_command(argv: Sequence[str], commands: Sequence[str]) -> str | None:
    """The collective command that ``argv`` names (its first word that is a command), if any."""
    named = next((word for word in argv if word in commands), None)
    return named if named in COLLECTIVE else None


class Local:
    """The library's own pipelines: what a command calls outside a launcher. ``options`` is what
    the command checks or writes; ``storage_options``, ``max_workers`` and ``callback`` the rest."""

    def agreed(self, step: Callable[[], T]) -> T:
        """``step()``: with one process there is nothing to agree on."""
        return step()

    def seal(self, url: str, *, mode: str, options: SealOptions, **where: Any) -> Manifest:
        return seal_at(*_place(url, where), options, _work(where))

    def verify(self, url: str, *, mode: str, options: VerifyOptions, **where: Any) -> Report:
        return check(*_place(url, where), options, _work(where))

    def latest_verified(self, root: str, *, mode: str, options: VerifyOptions, **where: Any) -> Latest:
        return checkpoints.newest_verified(*_place(root, where), options, _work(where))

    def status(self, root: str, *, mode: str, options: VerifyOptions, **where: Any) -> Statuses:
        return checkpoints.status_at(*_place(root, where), options, _work(where))

    def prune(self, root: str, *, mode: str, **kw: Any) -> retention.PruneResult:
        return retention.prune(root, **kw)


class Collective(Local):
    """The ``distributed`` functions over ``group``: what a command calls under a launcher (with
    no progress bar: ranks other than 0 print nothing, and rank 0 shares the work)."""

    def __init__(self, group: Group, args: argparse.Namespace) -> None:
        self.group = group
        self.args = args

    def agreed(self, step: Callable[[], T]) -> T:
        """``step()`` on every rank, its outcome gathered: when it failed on any rank, every rank
        raises :class:`AgreedError` with the first failing rank's message, exit code and hint."""
        try:
            value, problem = step(), None
        except Exception as exc:  # this rank's; its exit code and two lines travel as data
            value, problem = None, (exit_code_for(exc), *describe_error(exc, self.args))
        first = _first_problem(all_gather(self.group, problem))
        if first is not None:
            raise AgreedError(*first)
        return value  # type: ignore[return-value]  # None only when step() failed, and then we raised

    def seal(self, url: str, *, mode: str, options: SealOptions, **where: Any) -> Manifest:
        return distributed.seal(url, mode=mode, options=options, **_no_bar(where))  # type: ignore[arg-type]

    def verify(self, url: str, *, mode: str, options: VerifyOptions, **where: Any) -> Report:
        return distributed.verify(url, mode=mode, options=options, **_no_bar(where))  # type: ignore[arg-type]

    def latest_verified(self, root: str, *, mode: str, options: VerifyOptions, **where: Any) -> Latest:
        return distributed.latest_verified(root, mode=mode, options=options, **_no_bar(where))  # type: ignore[arg-type]

    def status(self, root: str, *, mode: str, options: VerifyOptions, **where: Any) -> Statuses:
        """The collective status: each checkpoint judged by every rank (the hashing shared), rank
        0's list (or its exception) every rank's."""
        full = not options.quick
        return distributed.status(root, mode=mode, full=full, options=options, **_no_bar(where))  # type: ignore[arg-type]

    def prune(self, root: str, *, mode: str, **kw: Any) -> retention.PruneResult:
        """The collective prune: verdicts agreed (the hashing shared), rank 0 deletes."""
        return distributed.prune(root, mode=mode, **_no_bar(kw))  # type: ignore[arg-type]


Latest = tuple[str, Report] | None
Statuses = list[checkpoints.CheckpointStatus]


def _place(url: str, where: Mapping[str, Any]) -> tuple[Any, str]:
    return storage.resolve(url, where.get("storage_options"))


def _work(where: Mapping[str, Any]) -> Work:
    return Work(where.get("max_workers"), where.get("callback"))


def _no_bar(where: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in where.items() if key != "callback"}


def _first_problem(gathered: Sequence[tuple[int, str, str] | None]) -> tuple[int, str, str] | None:
    for rank, problem in enumerate(gathered):
        if problem is not None:
            code, what, hint = problem
            return code, f"{what} (rank {rank})" if len(gathered) > 1 else what, hint
    return None


Runner = Callable[[argparse.Namespace], int]


def run(
    argv: Sequence[str],
    parse: Callable[[Sequence[str]], argparse.Namespace],
    execute: Runner,
    report: Callable[[BaseException, argparse.Namespace | None], int],
) -> int:
    """One command as a collective: join the group, agree on the arguments, run ``execute`` on
    every rank (quiet on ranks other than 0), and agree on the exit code."""
    try:
        dist = torch_distributed()
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo")  # from torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    except Exception as error:  # no torch, or no launcher's rendezvous: every rank fails alike
        return report(error, None)
    try:
        group = group_of(None)
        assert group is not None
        try:
            args, problem = parse(argv), None
        except UsageError as exc:
            args, problem = None, (exit_code_for(exc), *describe_error(exc, None))
        first = _first_problem(all_gather(group, problem))
        with _quiet(group.rank != 0):
            if first is not None:
                code = report(AgreedError(*first), args)
            else:
                assert args is not None
                args.launch = Collective(group, args)
                code = execute(args)
        codes = all_gather(group, code)
        return next((c for c in codes if c), 0)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


@contextlib.contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """Ranks other than 0 print nothing: their stdout and stderr go nowhere for the command."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
