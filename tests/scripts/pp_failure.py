"""A pp rank fails in the middle of the schedule; every rank must exit within seconds.

Usage: python tests/scripts/pp_failure.py OUT_DIR CASE      (CASE = "raise" or "kill")

Started by tests/test_pipeline_checkpoints.py as torchrun would start it (2 ranks, ``ZeroStrategy(stage=2,
pp=2, pp_schedule="1f1b")``, Lightning's 30-minute process-group timeout, ``collective_timeout``
300 s: only the failure path can end the ranks quickly), training as tests/scripts/pp_parity.py's
pp=2 cases do (the same model, data, accumulation, clipping and validation), saving every 2 steps
into ``OUT_DIR/ckpts/<case>`` (``last.ckpt`` too). At the third training step rank 1 (the last
stage) meets the hazard inside its first block's forward, mid-schedule, while rank 0 waits for the
gradients it sends back: ``raise`` raises ``ValueError``, ``kill`` SIGKILLs itself. Rank 1 writes
``OUT_DIR/<case>.hazard`` (the wall time of the hazard) first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402
from tests.scripts.pp_parity import CONFIG, STEPS, TRAINER, data_module, zero  # noqa: E402

MESSAGE = "a bad micro-batch on pp rank 1"


class Hazard(L.Callback):
    """Arms a forward hook on rank 1's first block at the third step."""

    def __init__(self, out: str, case: str) -> None:
        self.out, self.case = out, case

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 != 3 or trainer.global_rank != 1:
            return
        block = pl_module.model.layers[2]  # rank 1 holds blocks 2 and 3

        def fail(module, inputs, output) -> None:
            with open(os.path.join(self.out, f"{self.case}.hazard"), "w") as marker:
                marker.write(repr(time.time()))
            if self.case == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(MESSAGE)

        block.register_forward_hook(fail)


def main(out: str, case: str) -> None:
    L.seed_everything(42, verbose=False)
    saves = ModelCheckpoint(dirpath=os.path.join(out, "ckpts", case), every_n_train_steps=2, save_top_k=-1,
                            save_last=True)  # fmt: skip
    trainer = script_trainer(devices=2, strategy=zero(2, pp=2, pp_schedule="1f1b")(), max_steps=STEPS,
                             enable_checkpointing=True, callbacks=[Hazard(out, case), saves], **TRAINER)  # fmt: skip
    trainer.fit(LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS), data_module(1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
