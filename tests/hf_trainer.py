"""A real ``transformers.Trainer`` on a tiny GPT-2 built from a config (nothing downloaded), on the
CPU, for the tests of integrity_fs.integrations.transformers (in-process and on gloo ranks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

transformers.logging.set_verbosity_error()

VOCAB = 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences (the same on every run and rank)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Steps(TrainerCallback):
    """Counts the optimizer steps this Trainer ran (a resumed run runs only those left)."""

    def __init__(self) -> None:
        self.count = 0

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1


def trainer(
    output_dir: Path | str, callbacks: list[TrainerCallback], *, max_steps: int = 6, evaluate: bool = False, **args: Any
) -> Trainer:
    """A Trainer that saves every 2 steps; no dropout, a large learning rate: each step moves the
    weights well beyond float noise, and a resumed run ends where an unbroken one does.
    ``evaluate``: an evaluation dataset too (the same tokens), for ``eval_strategy`` and the best model."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    training = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1000,
        seed=0,
        **args,
    )
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=Tokens(),
        eval_dataset=Tokens() if evaluate else None,
        callbacks=callbacks,
    )
