"""One rank fails in the middle of a step; every rank must exit within seconds (issue 25).

Usage: python tests/scripts/rank_failure.py OUT_DIR CASE       (CASE = "<hazard>-<strategy>")

Started by tests/test_rank_failure.py as torchrun would start it (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT set: Lightning starts no processes, and no launcher kills a survivor for us), one
launch per case: a failure ends the launch, as it ends a user's script. Lightning opens the
process group with its default 30-minute timeout and ``collective_timeout`` is the default 300 s,
so only the failure path can end the ranks quickly. At step 3 (``HAZARD_STEP``) rank 1:

- ``train_step``: raises ``ValueError`` in ``training_step`` (after its forward);
- ``callback``: raises in a callback's ``on_train_batch_end``;
- ``backward``: raises inside backward (a tensor hook on a block's output);
- ``validation``: raises in ``validation_step`` (validation every 2 steps, so its second run);
- ``optimizer``: raises in ``on_before_optimizer_step`` (inside the optimizer step, after backward);
- ``kill``: SIGKILLs itself in ``training_step`` (after its forward): no message, no teardown;
- ``no_loss``: ``training_step`` returns ``None`` (Lightning would skip only this rank's backward
  and optimizer step): the strategy raises, naming the fix.
- ``skip_backward`` (manual optimization): skips its ``manual_backward`` but steps the optimizer;
- ``extra_backward`` (manual optimization): runs a second ``manual_backward`` before the step.
- ``skip_step`` (manual optimization): skips a whole training step (no backward, no step).

Every case also has ``ModelCheckpoint(save_on_exception=True)`` and a callback whose
``on_exception`` records that it ran. Each rank writes ``OUT_DIR/<case>.hazard`` (rank 1: the wall
time of the hazard) and ``OUT_DIR/<case>.rank<r>.on_exception`` (the exception it saw).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from tests.scripts.harness import script_trainer

HAZARD_STEP = 3  # 1-based: the third training step
FAILING_RANK = 1
MESSAGE = "a bad batch on rank 1"


def _hazard(out: str, case: str, rank: int, hazard: str, now: str) -> bool:
    """Whether this rank meets ``hazard`` now; if so, note the time first."""
    kind = case.rsplit("-", 1)[0]
    if kind != hazard or now != "now" or rank != FAILING_RANK:
        return False
    with open(os.path.join(out, f"{case}.hazard"), "w") as marker:
        marker.write(repr(time.time()))
    return True


class Net(L.LightningModule):
    def __init__(self, out: str, case: str) -> None:
        super().__init__()
        self.out, self.case = out, case
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.val_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for index, block in enumerate(self.blocks):
            x = block(x)
            step_now = "now" if self.trainer.training and self.global_step + 1 == HAZARD_STEP else ""
            if index == 1 and x.requires_grad and _hazard(self.out, self.case, self.global_rank, "backward", step_now):

                def fail(grad: torch.Tensor) -> None:
                    raise ValueError(MESSAGE)

                x.register_hook(fail)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        now = "now" if self.global_step + 1 == HAZARD_STEP else ""
        if _hazard(self.out, self.case, self.global_rank, "train_step", now):
            raise ValueError(MESSAGE)
        if _hazard(self.out, self.case, self.global_rank, "kill", now):
            os.kill(os.getpid(), signal.SIGKILL)
        if _hazard(self.out, self.case, self.global_rank, "no_loss", now):
            return None
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        now = "now" if self.global_step + 1 == HAZARD_STEP else ""
        if _hazard(self.out, self.case, self.global_rank, "optimizer", now):
            raise ValueError(MESSAGE)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_batches += 1
        now = "now" if self.val_batches == 3 else ""  # the second validation run's first batch
        if _hazard(self.out, self.case, self.global_rank, "validation", now):
            raise ValueError(MESSAGE)
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Hazards(Callback):
    """Raises in ``on_train_batch_end`` (the ``callback`` case); records ``on_exception``."""

    def __init__(self, out: str, case: str) -> None:
        self.out, self.case = out, case

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = "now" if trainer.global_step == HAZARD_STEP else ""
        if _hazard(self.out, self.case, trainer.global_rank, "callback", now):
            raise ValueError(MESSAGE)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        with open(os.path.join(self.out, f"{self.case}.rank{trainer.global_rank}.on_exception"), "w") as note:
            note.write(f"{type(exception).__name__}: {exception}")


class ManualNet(Net):
    """Manual optimization: one ``manual_backward`` and one step per training step, except the
    hazard on rank 1 (no backward, or two, before the step)."""

    def __init__(self, out: str, case: str) -> None:
        super().__init__(out, case)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        now = "now" if batch_idx + 1 == HAZARD_STEP else ""  # once (this rank's global_step lags now)
        if _hazard(self.out, self.case, self.global_rank, "skip_step", now):
            return None
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if not _hazard(self.out, self.case, self.global_rank, "skip_backward", now):
            self.manual_backward(loss)
        if _hazard(self.out, self.case, self.global_rank, "extra_backward", now):
            self.manual_backward(nn.functional.cross_entropy(self(x), y))
        opt.step()


MANUAL = ("skip_backward", "extra_backward", "skip_step")


def data(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=gen)
    return TensorDataset(x, x[:, :4].argmax(1))


def main(out: str, case: str) -> None:
    stage = int(case.rsplit("-", 1)[1][-1])
    L.seed_everything(0, verbose=False)
    trainer = script_trainer(
        devices=2,
        strategy=ZeroStrategy(stage=stage, bucket_mb=0.002, monitor=False),
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=[Hazards(out, case), ModelCheckpoint(dirpath=os.path.join(out, case), save_on_exception=True)],
        enable_checkpointing=True,
    )
    net = (ManualNet if case.rsplit("-", 1)[0] in MANUAL else Net)(out, case)
    trainer.fit(net, DataLoader(data(64, 1), batch_size=4), DataLoader(data(16, 2), batch_size=4))
    print(f"[rank_failure] {case}: rank {trainer.global_rank} finished without an error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
