"""Hazards that used to hang ZeroStrategy, on 2 CPU ranks: each must finish or fail on every rank.

Usage: python tests/scripts/hang_cases.py OUT_DIR [RUN ...]     (RUN = "<hazard>-<strategy>")

Started by tests/test_hangs.py through ``conformance_check.run_matrix`` (both ranks started as
torchrun would; Lightning opens the process group with its default 30-minute timeout, so only the
engine can turn a stuck collective into an error). Each rank writes ``OUT_DIR/<run>.rank<r>.pt``:
``{"ok", "error", "error_after_s" (seconds from the hazard to the error), "losses", "val_losses",
"params"}``. A run that ends in an error ends the launch, as it would end a user's script; a run
still going after ``HANG_RUN_TIMEOUT_S`` (default 45 s) is recorded as a hang.

Hazards (issue 11):
- ``no_trainable``: at step 2 rank 1's loss reaches no trainable parameter (expected: finishes,
  rank 1 contributing zero gradients; ddp itself hangs on this, so its reference run adds the
  model's output times zero to the loss: same loss, same zero gradients).
- ``uneven_val``: rank 0 has 3 validation batches, rank 1 has 2 (expected: works, like ddp).
- ``divergence_extra``: from step 2 on, rank 1 runs the block ``extra.0`` twice (expected: an
  error on both ranks naming the module, the step and the rank).
- ``divergence_skip``: from step 2 on, rank 1 skips ``extra.0`` (expected: no hang -- it trains
  as if the block were unused on that rank, or errors on both ranks naming the module).
- ``stuck_collective``: at step 2 rank 1 is stuck in user code for 10 s while rank 0 waits in a
  collective; ``collective_timeout=3`` (expected: rank 0 raises within seconds naming what it
  waited on; rank 1 then fails too).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conformance import _RANK, _peer_verdict, _status, _wait_for, _watchdog, _write  # noqa: F401

from tests.scripts.harness import script_trainer

WORLD = 2
STEPS = 4
RUN_TIMEOUT_S = float(os.environ.get("HANG_RUN_TIMEOUT_S", "45"))
STUCK_S = 10.0
COLLECTIVE_TIMEOUT_S = 3.0
HAZARD_AT: list[float] = []  # monotonic time the hazard began on this rank

RUNS = [
    *(f"no_trainable-{s}" for s in ("ddp", "zero1", "zero2", "zero3")),
    *(f"uneven_val-{s}" for s in ("ddp", "zero1", "zero2", "zero3")),
    "divergence_skip-zero3",
    "divergence_extra-zero3",
    "stuck_collective-zero2",
    "stuck_collective-zero3",
]


class HazardNet(L.LightningModule):
    """Input layer, three blocks and an ``extra`` block (ModuleLists: ZeRO-3 units), a head."""

    def __init__(self, hazard: str, reference: bool = False) -> None:
        super().__init__()
        self.hazard = hazard
        self.reference = reference
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.extra = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 4)
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor, extra_runs: int = 1) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        for _ in range(extra_runs):
            x = self.extra[0](x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hazard_step = batch_idx == 1  # the second step
        if hazard_step and not HAZARD_AT:
            HAZARD_AT.append(time.monotonic())
        if self.hazard == "no_trainable" and hazard_step and self.global_rank == 1:
            # The forward runs as usual, but the loss reaches no trainable parameter.
            start = x.clone().requires_grad_(True)
            out = self(x)
            # ddp hangs here itself (no gradient hook fires on rank 1), so its reference run keeps
            # the graph connected with a zero weight: the same loss, exactly zero gradients.
            connect = 0.0 * out.mean() if self.reference else 0.0
            loss = (out.detach().mean() + start + connect).pow(2).mean()
        elif self.hazard.startswith("divergence"):
            extra_runs = 1
            if batch_idx >= 1 and self.global_rank == 1:
                extra_runs = 2 if self.hazard == "divergence_extra" else 0
            loss = nn.functional.cross_entropy(self(x, extra_runs=extra_runs), y)
        else:
            if self.hazard == "stuck_collective" and hazard_step and self.global_rank == 1:
                time.sleep(STUCK_S)  # stuck in user code (a slow loader, a debugger) while rank 0 waits
            loss = nn.functional.cross_entropy(self(x), y)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.cross_entropy(self(x), y).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=gen)
    return TensorDataset(x, x[:, :4].argmax(1))


def make_strategy(hazard: str, strategy: str):
    if strategy == "ddp":
        return DDPStrategy()
    kwargs = {"collective_timeout": COLLECTIVE_TIMEOUT_S} if hazard == "stuck_collective" else {}
    return ZeroStrategy(stage=int(strategy[-1]), bucket_mb=0.001, **kwargs)


def run_one(run: str) -> dict[str, Any]:
    hazard, strategy = run.rsplit("-", 1)
    L.seed_everything(42, verbose=False)
    module = HazardNet(hazard, reference=strategy == "ddp")
    uneven = hazard == "uneven_val"
    trainer = script_trainer(
        devices=WORLD,
        strategy=make_strategy(hazard, strategy),
        max_steps=STEPS,
        limit_val_batches=None if uneven else 0,
        use_distributed_sampler=not uneven,
    )
    train = data(STEPS * 2 * WORLD, seed=1)
    if uneven:  # this rank's own shards: the same train batches as ddp's sampler, uneven validation
        rank = _RANK[0]
        train = torch.utils.data.Subset(train, list(range(rank, len(train), WORLD)))
        val = DataLoader(data(2 * (3 - rank), seed=2 + rank), batch_size=2)  # rank 0: 3 batches, rank 1: 2
        trainer.fit(module, DataLoader(train, batch_size=2), val)
        trainer.validate(module, val, verbose=False)
    else:
        trainer.fit(module, DataLoader(train, batch_size=2))
    params = {name: p.detach().float().clone() for name, p in module.named_parameters()}
    return {"ok": True, "losses": module.train_losses, "val_losses": module.val_losses, "params": params}


def main(out: str, runs: list[str]) -> None:
    os.makedirs(os.path.join(out, ".status"), exist_ok=True)
    for run in runs:
        if _RANK[0] == 0:
            open(os.path.join(out, ".status", f"{run}.started"), "w").close()
        HAZARD_AT.clear()
        done = threading.Event()
        threading.Thread(target=_watchdog, args=(out, run, done, RUN_TIMEOUT_S), daemon=True).start()
        try:
            record = run_one(run)
        except BaseException:  # noqa: BLE001
            failed_at = time.monotonic()
            record = {"ok": False, "error": traceback.format_exc()}
            record["error_after_s"] = failed_at - HAZARD_AT[0] if HAZARD_AT else None
        done.set()
        _write(out, run, record)
        with open(_status(out, run, _RANK[0]), "w") as status:
            status.write("ok" if record["ok"] else "fail")
        print(f"[hangs] rank {_RANK[0]} {run}: {'ok' if record['ok'] else 'FAILED'}", flush=True)
        if not record["ok"]:
            sys.stdout.flush()
            os._exit(1)  # as the exception would end a user's script
        if _peer_verdict(out, run, RUN_TIMEOUT_S + 15) != "ok":
            os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or RUNS)
