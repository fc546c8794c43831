"""Save-at-step / resume-from-step wiring shared by the multi-process test scripts."""

from __future__ import annotations

import os
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint


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
