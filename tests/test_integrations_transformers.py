"""integrity_fs.integrations.transformers with a real ``transformers.Trainer`` on a tiny GPT-2 built
from a config, on the CPU (nothing downloaded): every checkpoint-N sealed once written, and the run
resumed from the newest one that verifies. tests/dist_trainer_worker.py runs a distributed Trainer
(DDP over gloo, two ranks).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None:
    pytest.skip("transformers and accelerate are not installed", allow_module_level=True)

import torch
from dist_launch import run_ranks
from fork_server import BASE, TRANSFORMERS
from safetensors.torch import load_file

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more

# Bound by _import_the_trainer, in the process that runs these tests.
Steps: Any
trainer: Any
IntegrityCallback: Any
latest_verified_checkpoint: Any
_DamageOnSave: Any


@pytest.fixture(scope="module", autouse=True)
def _import_the_trainer() -> None:
    """transformers' Trainer takes seconds to import: the pytest process that runs these tests
    (one xdist group, as this is a fixture of the file) imports it, not each one at collection."""
    global Steps, trainer, IntegrityCallback, latest_verified_checkpoint, _DamageOnSave
    from hf_trainer import Steps, trainer
    from transformers import TrainerCallback

    from integrity_fs.integrations.transformers import IntegrityCallback, latest_verified_checkpoint

    class DamageOnSave(TrainerCallback):  # type: ignore[misc]
        """Flips a bit of ``checkpoint-<step>``'s weights once the callbacks before it have sealed
        (and pruned) it: a checkpoint damaged on disk during the run."""

        def __init__(self, out: Path, step: int) -> None:
            self.out, self.step = out, step

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == self.step:
                _flip(self.out / f"checkpoint-{self.step}" / "model.safetensors")

    _DamageOnSave = DamageOnSave


#: What the Trainer writes into each checkpoint-N (with one process).
TRAINER_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
}


def _flip(path: Path, offset: int = -100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, 2 if offset < 0 else 0)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def test_a_run_resumes_from_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    out = tmp_path / "out"
    callback = IntegrityCallback()
    trainer(out, [callback], save_total_limit=2).train()  # saves 2, 4, 6; the rotation keeps 4 and 6
    assert callback.sealed == [str(out / f"checkpoint-{n}") for n in (2, 4, 6)]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        assert set(ifs.read_manifest(out / name).files) == TRAINER_FILES
        assert ifs.verify(out / name, strict=True).ok
    unbroken = _weights(out / "checkpoint-6")
    assert not _close(unbroken, _weights(out / "checkpoint-4"), atol=1e-4)  # two steps apart

    _flip(out / "checkpoint-6" / "model.safetensors")
    resume = latest_verified_checkpoint(out)
    assert resume == str(out / "checkpoint-4")

    steps, again = Steps(), IntegrityCallback()
    resumed = trainer(out, [again, steps], save_total_limit=2)
    resumed.train(resume_from_checkpoint=resume)
    assert (steps.count, resumed.state.global_step) == (2, 6)  # steps 5 and 6: it started from step 4
    assert again.sealed == [str(out / "checkpoint-6")]  # written again over the damaged one, sealed again
    assert ifs.verify(out / "checkpoint-6", strict=True).ok
    assert _close(_weights(out / "checkpoint-6"), unbroken, atol=1e-6)  # where the unbroken run ended
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-6")


def test_unsealed_half_written_and_other_folders_are_passed_over(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert latest_verified_checkpoint(out) is None  # a run that never saved: start afresh
    trainer(out, [IntegrityCallback()], max_steps=10).train()  # 2, 4, 6, 8, 10
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-10")  # by number: 10 after 8

    half = out / "checkpoint-12"  # what a Trainer still writing it (or one killed meanwhile) leaves
    half.mkdir()
    shutil.copy(out / "checkpoint-10" / "config.json", half)
    unsealed = out / "checkpoint-11"  # written before the callback was there
    shutil.copytree(out / "checkpoint-10", unsealed)
    (unsealed / MANIFEST_FILENAME).unlink()
    other = out / "final-99"  # sealed, newer by its number, but not a checkpoint-N
    shutil.copytree(out / "checkpoint-2", other)
    (out / "runs").mkdir()
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-10")

    for n in (10, 8):
        _flip(out / f"checkpoint-{n}" / "trainer_state.json", 5)
    (out / "checkpoint-6" / "optimizer.pt").write_bytes(b"")  # truncated
    (out / "checkpoint-4" / "scheduler.pt").unlink()
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-2")
    _flip(out / "checkpoint-2" / "rng_state.pth", 10)
    assert latest_verified_checkpoint(out) is None


class _RotateOnSkip(logging.Handler):
    """Deletes ``victim`` (as the Trainer's rotation does, from another process) once the newest
    checkpoint is reported skipped: after the listing, before its turn comes."""

    def __init__(self, skipped: str, victim: Path) -> None:
        super().__init__(logging.WARNING)
        self.skipped, self.victim, self.messages = skipped, victim, []  # type: ignore[var-annotated]

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.skipped in message and self.victim.exists():
            shutil.rmtree(self.victim)


def test_a_checkpoint_rotated_away_meanwhile_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer(out, [IntegrityCallback()]).train()
    _flip(out / "checkpoint-6" / "model.safetensors")
    handler = _RotateOnSkip("checkpoint-6", out / "checkpoint-4")
    logger = logging.getLogger("integrity_fs")
    logger.addHandler(handler)
    try:
        assert latest_verified_checkpoint(out) == str(out / "checkpoint-2")
    finally:
        logger.removeHandler(handler)
    assert not (out / "checkpoint-4").exists()
    assert [m.split(" (")[1].split(")")[0] for m in handler.messages if m.startswith("skipping")] == [
        "damaged",
        "changing",  # gone while it was read
    ]


def _keys(tmp_path: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    key, pub = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub"
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pub.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return key, pub


def test_signed_checkpoints_and_a_replayed_one(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    key, pub = _keys(tmp_path, "run")
    _other, other_pub = _keys(tmp_path, "other")
    out = tmp_path / "out"
    trainer(out, [IntegrityCallback(key, granularity="chunk", chunk_size=1 << 16)]).train()
    for n in (2, 4, 6):
        assert (out / f"checkpoint-{n}" / SIGNATURE).is_file()
        assert ifs.verify(out / f"checkpoint-{n}", public_key=pub, strict=True).ok
    assert latest_verified_checkpoint(out, public_key=pub) == str(out / "checkpoint-6")
    assert latest_verified_checkpoint(out, public_key=other_pub) is None  # signed by another key

    # checkpoint-4, signature and all, copied over checkpoint-6: a consistent folder, signed as checkpoint-4.
    shutil.rmtree(out / "checkpoint-6")
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-6")
    assert ifs.verify(out / "checkpoint-6").ok
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-6")
    assert latest_verified_checkpoint(out, public_key=pub) == str(out / "checkpoint-4")


def test_bad_callback_options_fail_before_any_training(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="granularity"):
        IntegrityCallback(granularity="blocks")
    with pytest.raises(ValueError, match="chunk_size"):
        IntegrityCallback(chunk_size=1024)  # file granularity
    with pytest.raises(ValueError, match="cannot read the key file"):
        IntegrityCallback(tmp_path / "missing.pem")


def test_a_failed_seal_stops_the_run(tmp_path: Path) -> None:
    """Damage the seal cannot accept (a name no manifest holds) raises out of ``train``."""
    out = tmp_path / "out"

    class LeaveABadName(Steps):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            (out / f"checkpoint-{state.global_step}" / "bad\\name").write_bytes(b"x")

    with pytest.raises(ValueError, match="cannot be in a manifest"):
        trainer(out, [LeaveABadName(), IntegrityCallback()]).train()
    assert not (out / "checkpoint-2" / MANIFEST_FILENAME).exists()


def test_a_distributed_trainer_seals_once_every_rank_has_written(tmp_path: Path) -> None:
    """Two DDP ranks over gloo: rank 1 writes rng_state_1.pth only once rank 0 is in on_save, rank 0
    seals after it; both agree on where to resume; a failed seal raises the same error on both ranks."""
    results = run_ranks(
        "dist_trainer_worker.py", 2, {"root": str(tmp_path)}, tmp_path, timeout=240, warm=[*BASE, *TRANSFORMERS]
    )
    assert results["world_size"] == [2, 2]
    run = tmp_path / "run"
    assert results["sealed"] == [[str(run / "checkpoint-2"), str(run / "checkpoint-4")]] * 2  # sealed together
    for files in results["files"]:
        for names in files.values():
            assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(names)
    assert results["strict"] == [[True, True], [True, True]]
    assert results["latest"] == [str(run / "checkpoint-2")] * 2  # checkpoint-4 damaged by rank 0
    [failing] = set(results["failing"])
    assert failing.startswith("ValueError: cannot seal") and "failing/checkpoint-2" in failing
    assert "cannot be in a manifest" in failing


# --- retention: IntegrityCallback(keep_last=N) ------------------------------------------------------


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir() if p.name.startswith("checkpoint-")), key=lambda n: int(n[11:]))


def test_keep_last_keeps_two_verified_checkpoints_and_resumes_from_the_newest_good_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    callback = IntegrityCallback(keep_last=2)
    trainer(out, [callback, _DamageOnSave(out, 6)], max_steps=8).train()  # saves 2, 4, 6 (damaged), 8
    assert _checkpoints(out) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert [ifs.verify(out / f"checkpoint-{n}", strict=True).ok for n in (4, 8)] == [True, True]
    with pytest.raises(ifs.IntegrityError):
        ifs.verify(out / "checkpoint-6")
    last = callback.pruned[-1]  # at step 8: 8 and 4 verify; 6, newer than 4, is left
    assert last.kept == (str(out / "checkpoint-8"), str(out / "checkpoint-4")) and last.deleted == ()
    assert last.left == (str(out / "checkpoint-6"),) and last.verdicts[str(out / "checkpoint-6")] == "damaged"
    assert latest_verified_checkpoint(out) == str(out / "checkpoint-8")

    _flip(out / "checkpoint-8" / "model.safetensors")  # the newest is damaged too, later on
    resume = latest_verified_checkpoint(out)
    assert resume == str(out / "checkpoint-4")  # the good one the rule kept
    steps, again = Steps(), IntegrityCallback(keep_last=2)
    resumed = trainer(out, [again, steps], max_steps=8)
    resumed.train(resume_from_checkpoint=resume)
    assert (steps.count, resumed.state.global_step) == (4, 8)  # steps 5 to 8: it started from step 4
    assert _checkpoints(out) == ["checkpoint-6", "checkpoint-8"]  # written again, sealed; 4 pruned at step 8
    assert [ifs.verify(out / f"checkpoint-{n}", strict=True).ok for n in (6, 8)] == [True, True]


def test_the_trainers_own_rotation_keeps_the_damaged_one_and_deletes_a_good_one(tmp_path: Path) -> None:
    """The same run with save_total_limit=2 and no pruning callback (sealing only, to tell good from bad)."""
    out = tmp_path / "out"
    trainer(out, [IntegrityCallback(), _DamageOnSave(out, 6)], max_steps=8, save_total_limit=2).train()
    assert _checkpoints(out) == ["checkpoint-6", "checkpoint-8"]  # checkpoint-4, a good one, is gone
    with pytest.raises(ifs.IntegrityError):
        ifs.verify(out / "checkpoint-6")  # the damaged one is kept
    _flip(out / "checkpoint-8" / "model.safetensors")
    assert latest_verified_checkpoint(out) is None  # nothing left to resume from


def test_keep_last_keeps_the_best_model_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    callback = IntegrityCallback(keep_last=1)
    run = trainer(
        out,
        [callback],
        max_steps=8,
        evaluate=True,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="loss",
        greater_is_better=True,  # the "best" is the worst loss: not the last checkpoint
    )
    run.train()
    best = run.state.best_model_checkpoint
    assert best is not None and best != str(out / "checkpoint-8")
    assert _checkpoints(out) == sorted([Path(best).name, "checkpoint-8"], key=lambda n: int(n[11:]))
    assert ifs.verify(best).ok


def test_keep_last_with_a_key_counts_only_the_checkpoints_it_signed(tmp_path: Path) -> None:
    """Two sealed, unsigned checkpoint-N folders dropped into a signing run's output directory
    (by someone without the key) do not count as good ones: the run's own stay."""
    pytest.importorskip("cryptography")
    key, pub = _keys(tmp_path, "run")
    out = tmp_path / "out"
    for step in (100, 200):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"not a checkpoint")
        ifs.seal(out / f"checkpoint-{step}")
    callback = IntegrityCallback(key, keep_last=2)
    trainer(out, [callback]).train()  # saves 2, 4, 6
    assert _checkpoints(out) == ["checkpoint-4", "checkpoint-6", "checkpoint-100", "checkpoint-200"]
    assert [ifs.verify(out / f"checkpoint-{n}", public_key=pub).ok for n in (4, 6)] == [True, True]
    last = callback.pruned[-1]
    assert last.verdicts[str(out / "checkpoint-200")] == "damaged"  # unsigned: no model.sig
    assert last.kept == (str(out / "checkpoint-6"), str(out / "checkpoint-4"))
