"""Hugging Face ``Trainer``: seal each ``checkpoint-N`` folder once written, resume from the newest
one that verifies. Needs transformers with torch (extra ``hf``).

:class:`IntegrityCallback` seals (and, with a key, signs) the folder the Trainer has just written,
from ``on_save``, after every process wrote its part. It seals only bytes this save wrote: a
folder that already held files the save did not rewrite (a save over a damaged leftover, fewer
ranks than before) is left unsealed, with a WARNING naming them. With ``keep_last`` it prunes by
:func:`integrity_fs.prune`'s rules over ``checkpoint-{step}`` (``state.best_model_checkpoint`` is
kept too), and takes rotation over from the Trainer: ``save_total_limit``, which deletes by name
before the callback runs, is turned off when training starts (an INFO line says so). With
``save_on_each_node`` each node's first process seals and prunes its own disk; otherwise the
ranks seal together (:mod:`integrity_fs.distributed`) and rank 0 prunes, every rank getting the
same outcome. A prune reuses the verdicts it reached before and the one the seal just made: in
steady state it reads nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import distributed, runs, storage
from ..collectives import agree, gather, group_of
from ..manifest import Manifest
from ..options import SealOptions, VerifyOptions, count
from ..report import PruneResult, Report, printable, shortened
from ..storage import URL
from ..verify import seal_root

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:
    raise ImportError(
        f"integrity_fs.integrations.transformers needs transformers: pip install 'integrity-fs[hf]' ({exc})"
    ) from exc

__all__ = ["IntegrityCallback", "latest_verified_checkpoint"]

log = logging.getLogger("integrity_fs")
PATTERN = "checkpoint-{step}"


class IntegrityCallback(TrainerCallback):
    """Seals each ``checkpoint-N`` folder the Trainer writes (see the module docstring).
    ``private_key``: sign it too (a PEM path or a ``cryptography`` EC key). ``algorithm``,
    ``granularity``, ``chunk_size``: as for :func:`integrity_fs.seal`. ``keep_last``: prune."""

    def __init__(
        self,
        private_key: Any = None,
        algorithm: str = "sha256",
        keep_last: int | None = None,
        *,
        granularity: str = "file",
        chunk_size: int | None = None,
    ) -> None:
        self._options = SealOptions(
            algorithm=algorithm, granularity=granularity, chunk_size=chunk_size, overwrite=True, private_key=private_key
        )
        self.keep_last = count("keep_last", keep_last)
        self._before: dict[str, Any] = {}  # what the folder about to be written held before (name → version)
        self.sealed: list[str] = []  # the folders sealed, in order
        self.pruned: list[PruneResult] = []  # what each prune kept, deleted and left

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.keep_last is not None and args.save_total_limit:
            log.info(
                "IntegrityCallback(keep_last=%d) rotates checkpoints: save_total_limit=%s turned off",
                self.keep_last,
                args.save_total_limit,
            )
            object.__setattr__(args, "save_total_limit", None)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = self._folder(args, state)
        self._before = {}
        if args.should_save and os.path.isdir(folder):  # a save over a folder that is already there
            self._before = {n: s.version for n, s in storage.list_files(*storage.resolve(folder)).items()}

    def _folder(self, args: TrainingArguments, state: TrainerState) -> str:
        return os.path.join(str(args.output_dir), PATTERN.format(step=state.global_step))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = self._folder(args, state)
        g = group_of(None) if args.world_size > 1 else None
        if g is not None:
            gather(g, None)  # every process has written its part
        if g is None or args.save_on_each_node:  # each node's first process, on its own disk

            def step() -> None:
                if args.should_save:
                    self._seal_and_prune(args, state, folder)

            agree(g, step) if g is not None else step()
            return
        stale = agree(g, lambda: self._stale(folder) if args.should_save else [], only=0)
        if stale:
            return
        o = self._options
        manifest = distributed.seal(
            folder,
            overwrite=True,
            private_key=o.private_key,
            algorithm=o.algorithm,
            granularity=o.granularity,
            chunk_size=o.chunk_size,
        )
        self.sealed.append(folder)
        if self.keep_last is not None:  # rank 0 prunes (verdicts it reached before are reused), every rank is told
            self.pruned.append(agree(g, lambda: self._prune(args, state, folder, manifest), only=0))

    def _stale(self, folder: str) -> list[str]:
        """The files of ``folder`` this save did not write (same version as before it), with a
        WARNING; the folder is then unsealed."""
        now = storage.list_files(*storage.resolve(folder))
        stale = sorted(n for n, version in self._before.items() if n in now and now[n].version == version)
        if stale:
            fs, root = storage.resolve(folder)
            storage.remove(
                fs, [storage.join(root, n) for n in storage.NOT_CONTENT if storage.exists(fs, storage.join(root, n))]
            )
            log.warning(
                "not sealing %s: it holds files this save did not write (%s); delete them, or save to a new folder",
                printable(folder),
                shortened(stale, 5),
            )
        return stale

    def _seal_and_prune(self, args: TrainingArguments, state: TrainerState, folder: str) -> None:
        manifest = None
        if not self._stale(folder):
            manifest = seal_root(*storage.resolve(folder), self._options)
            self.sealed.append(folder)
        if self.keep_last is not None:
            self.pruned.append(self._prune(args, state, folder, manifest))

    def _prune(
        self, args: TrainingArguments, state: TrainerState, folder: str, manifest: Manifest | None
    ) -> PruneResult:
        """Prune ``output_dir``; the folder just sealed (``manifest``) is known good: the seal hashed it."""
        if manifest is not None and manifest.sizes is not None:
            report = Report(files_checked=len(manifest.files), bytes_checked=sum(manifest.sizes.values()))
            runs.remember(*storage.resolve(folder), report)
        assert self.keep_last is not None
        fs, root = storage.resolve(str(args.output_dir))
        return runs.prune_root(
            fs,
            root,
            keep_last=self.keep_last,
            pattern=PATTERN,
            unsealed=False,
            dry_run=False,
            options=VerifyOptions(public_key=self._public_key()),
            keep=self._best(state),
        )

    @staticmethod
    def _best(state: TrainerState) -> tuple[str, ...]:
        """The Trainer's best model, kept whatever the rule says."""
        return (os.path.basename(str(state.best_model_checkpoint)),) if state.best_model_checkpoint else ()

    def _public_key(self) -> Any:
        key = self._options.private_key
        return None if key is None else key.public_key()


def latest_verified_checkpoint(
    output_dir: URL, *, public_key: Any = None, storage_options: dict[str, Any] | None = None
) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that verifies (every file hashed;
    with ``public_key``, its signature must verify and name it), for
    ``trainer.train(resume_from_checkpoint=...)``; ``None`` when none does. Damaged, unsealed and
    changing folders are skipped with a WARNING; a storage error is raised. A local call."""
    found = runs.latest_verified(output_dir, pattern=PATTERN, storage_options=storage_options, public_key=public_key)
    return None if found is None else found[0]
