"""What the multi-process test scripts share: the quiet CPU ``Trainer`` they all build, and the
save-at-step / resume-from-step wiring of the parity scripts."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.planner.bench_model import STEPS_ONLY


def script_trainer(**kwargs: Any) -> L.Trainer:
    """A ``Trainer`` on CPU with nothing a test does not read (``bench_model.STEPS_ONLY``: no logger,
    checkpoints, progress bar, model summary or validation); ``kwargs`` (devices, strategy,
    max_steps, ...) add to or override these."""
    return L.Trainer(**{"accelerator": "cpu", **STEPS_ONLY, **kwargs})


def step_checkpoints(
    out_dir: str, case: str, saves: dict[str, str], resumes: dict[str, str], step: int = 2
) -> tuple[list, Optional[str]]:
    """``(callbacks, ckpt_path)`` for ``case``: a ``ModelCheckpoint`` every ``step`` steps into
    ``out_dir/ckpts/<saves[case]>`` when ``case`` saves, and the step-``step`` checkpoint of
    ``out_dir/ckpts/<resumes[case]>`` when it resumes (``None`` otherwise)."""
    callbacks: list = []
    if case in saves:
        ckpt_dir = os.path.join(out_dir, "ckpts", saves[case])
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=step, save_top_k=-1))
    ckpt_path = None
    if case in resumes:
        ckpt_path = os.path.join(out_dir, "ckpts", resumes[case], f"epoch=0-step={step}.ckpt")
    return callbacks, ckpt_path


def checkpointed_trainer(
    out_dir: str, case: str, saves: dict[str, str], resumes: dict[str, str], *, step: int = 2, **kwargs: Any
) -> tuple[L.Trainer, Optional[str]]:
    """``(trainer, ckpt_path)`` for one parity case: :func:`script_trainer` without validation,
    saving and resuming as :func:`step_checkpoints` says (its callbacks after ``kwargs``' own)."""
    checkpoints, ckpt_path = step_checkpoints(out_dir, case, saves, resumes, step=step)
    callbacks = [*kwargs.pop("callbacks", []), *checkpoints]
    trainer = script_trainer(enable_checkpointing=case in saves, callbacks=callbacks, **kwargs)
    return trainer, ckpt_path
