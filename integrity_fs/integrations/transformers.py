"""Hugging Face ``Trainer``: seal each ``checkpoint-N`` folder once written, resume from the newest
one that verifies.

:class:`IntegrityCallback` seals (and, given a key, signs) the folder the Trainer has just written,
from ``on_save``, which the Trainer calls right after it wrote the model, optimizer, scheduler, RNG
and trainer state (and after its rotation deleted older checkpoints). Under a distributed Trainer
every process writes part of a checkpoint (its own ``rng_state_N.pth``), and ``on_save`` runs on
each one when its own part is written; so the processes first wait for one another, then the
process that saves (rank 0; each node's first process with ``save_on_each_node``) seals, and every
process gets the same outcome: a failed seal raises on every rank, never leaving the others waiting.

With ``keep_last=N`` the callback also prunes: after sealing each checkpoint it deletes old
``checkpoint-N`` folders by :func:`integrity_fs.prune`'s rule (keep the ``N`` newest that verify,
delete only what is older than the oldest of them; ``state.best_model_checkpoint`` and the folder
just written are never deleted), which the Trainer's own rotation (``save_total_limit``, by name
alone) cannot do: set ``save_total_limit=None`` with it (the callback warns when both are set).

:func:`latest_verified_checkpoint` is the folder to pass to
``trainer.train(resume_from_checkpoint=...)``: the newest ``checkpoint-N`` that verifies, skipping
damaged, unsealed (still being written, or written before sealing) and vanished (rotated away)
ones. Under an initialised process group it is a collective: every rank gets the same answer.

Needs transformers with torch (extra ``hf``).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from .. import signing, storage
from ..collectives import Call, all_gather, group_of
from ..distributed import agreed_candidates
from ..distributed import prune as collective_prune
from ..distributed import verify as collective_verify
from ..hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY
from ..manifest import Manifest
from ..options import Algorithm, Granularity, SealOptions, Work
from ..retention import PruneResult, check_keep_last
from ..runs import newest_that, signed_name
from ..sealing import seal_at
from ..storage import URL

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:
    raise ImportError(
        f"integrity_fs.integrations.transformers needs transformers: pip install 'integrity-fs[hf]' ({exc})"
    ) from exc

__all__ = ["CHECKPOINT_NAME", "IntegrityCallback", "latest_verified_checkpoint"]


#: The folders the Trainer writes (``checkpoint-500``); the number is the global step.
CHECKPOINT_NAME = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-([0-9]+)")


class IntegrityCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that seals each ``checkpoint-N`` folder once the Trainer
    has written it, and signs it with ``private_key`` (a PEM path or a ``cryptography`` EC key).

    ``algorithm``, ``granularity`` and ``chunk_size`` are :func:`integrity_fs.seal`'s; they and the
    key are checked (and the key loaded) when the callback is made, before any training. A folder
    the Trainer writes again (the same step, after resuming from an earlier checkpoint) is sealed
    again: its manifest then describes what the Trainer has just written. ``sealed`` lists the
    folders this callback sealed, in order.

    ``keep_last``: after each seal, prune ``output_dir``'s ``checkpoint-N`` folders, keeping the
    ``keep_last`` newest that verify (every file hashed; with ``private_key``, only those whose
    signature verifies with its public key and names them) and ``state.best_model_checkpoint``;
    other folders are never touched. ``pruned`` lists what each prune did. Under a distributed
    Trainer every process takes part (the hashing is shared) and the process that saves deletes.
    """

    def __init__(
        self,
        private_key: signing.PrivateKey | None = None,
        *,
        keep_last: int | None = None,
        algorithm: Algorithm = DEFAULT_ALGORITHM,
        granularity: Granularity = DEFAULT_GRANULARITY,
        chunk_size: int | None = None,
    ) -> None:
        self._options = SealOptions(
            algorithm=algorithm, granularity=granularity, chunk_size=chunk_size, overwrite=True, private_key=private_key
        )
        if keep_last is not None:
            check_keep_last("keep_last", keep_last)
        self.keep_last = keep_last
        self.sealed: list[str] = []
        self.pruned: list[PruneResult] = []

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.keep_last is not None and args.save_total_limit:
            warnings.warn(
                f"IntegrityCallback(keep_last={self.keep_last}) and save_total_limit={args.save_total_limit} both "
                "delete checkpoints: the Trainer's rotation goes by name alone and may delete the last one that "
                "verifies; set save_total_limit=None",
                UserWarning,
                stacklevel=2,
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        g = group_of(None) if args.world_size > 1 else None
        if g is None:  # one process (or processes that share no torch.distributed group)
            if args.should_save:
                self._seal(folder)
                self._prune(args, state, folder)
            return
        call = Call(g)
        all_gather(g, None)  # every process has written its part of the checkpoint
        outcome = call.attempt(lambda: self._seal(folder).to_json()) if args.should_save else None
        call.raise_first(all_gather(g, outcome))
        self._prune(args, state, folder)

    def _prune(self, args: TrainingArguments, state: TrainerState, folder: str) -> None:
        if self.keep_last is None:
            return
        keep = [folder] + ([state.best_model_checkpoint] if state.best_model_checkpoint else [])
        key = self._options.private_key
        result = collective_prune(
            str(args.output_dir),
            keep_last=self.keep_last,
            public_key=None if key is None else signing.load_private_key(key).public_key(),
            keep=keep,
            match=CHECKPOINT_NAME.pattern,
        )
        self.pruned.append(result)

    def _seal(self, folder: str) -> Manifest:
        manifest = seal_at(*storage.resolve(folder), self._options, Work())
        self.sealed.append(folder)
        return manifest


def latest_verified_checkpoint(
    output_dir: URL,
    *,
    public_key: signing.PublicKey | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that verifies (by ``N``), for
    ``trainer.train(resume_from_checkpoint=...)``; ``None`` when none does (or there is none yet).

    Every file of each candidate is hashed, newest first, until one passes; damaged, unsealed,
    invalid and vanished ones (deleted by the Trainer's rotation since the listing) are skipped,
    each with a WARNING on the ``integrity_fs`` logger. With ``public_key``, the signature must
    verify and name that folder. Other folders (``runs``, a final model) are not candidates. A
    storage error is raised, never skipped. Under an initialised process group call it on every
    rank: the hashing is shared and every rank gets the same answer (the ranks must see the same
    storage at ``output_dir``).
    """
    g = group_of(None)
    candidates = [
        (url, url)
        for url in agreed_candidates(output_dir, storage_options=storage_options)
        if CHECKPOINT_NAME.fullmatch(url.rstrip("/").rsplit("/", 1)[-1])
    ]

    def attempt(url: str) -> object:
        return collective_verify(
            url,
            storage_options=storage_options,
            public_key=public_key,
            expected_name=signed_name(url, public_key),
        )

    found = newest_that(candidates, attempt, warn=g is None or g.rank == 0)
    return None if found is None else found[0]
