"""Calls a script makes on global rank 0 only, inside a running 2-rank job (issue 61).

Usage: python tests/scripts/one_rank_calls.py OUT_DIR CASE      (torchrun-style, 2 ranks; one case per launch)
Launched by tests/test_one_rank_calls.py. Cases:

- ``statedict_trainer``: Trainer, stage 3: after training step 1, ``if trainer.is_global_zero:
  pl_module.state_dict()``; the other rank goes on training. Expected: rank 0 refuses by name
  within seconds ([Note: one rank's state_dict] in runtime/session.py), every rank exits non-zero.
- ``statedict_fabric``: Fabric, stage 2 under bf16-mixed (the module holds bf16 copies, ddp fp32
  weights): the same after step 1 of a Fabric loop.
- ``export``: Trainer, stage 2: fit 2 steps, ``trainer.save_checkpoint``, then ``if
  trainer.is_global_zero: export(...)`` and ``trainer.strategy.barrier()``. Expected: the export
  is written on rank 0 alone, every rank exits 0.

Rank 0 writes OUT_DIR/<case>.rank0.json when the call returns or raises (``called_at``: wall clock
before the call; ``seconds`` in it; ``error``); the test times every rank's exit from ``called_at``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from tests.scripts.after_loop_saves import Recorder, train_loader  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def _record(out: str, case: str, **result) -> None:
    with open(os.path.join(out, f"{case}.rank{RANK}.json"), "w") as handle:
        json.dump(result, handle)


def _on_rank_zero(out: str, case: str, call) -> None:
    """``call()`` on global rank 0 only, recorded; its error propagates as the user's would."""
    if RANK != 0:
        return
    started = time.time()
    try:
        call()
    except BaseException as exc:
        _record(out, case, called_at=started, seconds=time.time() - started, error=f"{type(exc).__name__}: {exc}")
        raise
    _record(out, case, called_at=started, seconds=time.time() - started, error=None)


class StateDictOnRankZero(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            _on_rank_zero(self.out, "statedict_trainer", pl_module.state_dict)


def statedict_trainer(out: str) -> None:
    from lightning_zero import ZeroStrategy

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=4, strategy=ZeroStrategy(stage=3, bucket_mb=0.01), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[StateDictOnRankZero(out)],
    )  # fmt: skip
    trainer.fit(Recorder(), train_loader())


def statedict_fabric(out: str) -> None:
    from tests.scripts.fabric_run import build, make_fabric, train_steps

    fabric = make_fabric("zero2bf16", "llama")
    model, optimizer, scheduler = build(fabric, "llama")
    for step in range(4):
        train_steps(fabric, model, optimizer, scheduler, range(step, step + 1), "llama", [fabric.global_rank])
        if step == 1:
            _on_rank_zero(out, "statedict_fabric", model.state_dict)


def export_on_rank_zero(out: str) -> None:
    from lightning_zero import ZeroStrategy
    from lightning_zero.checkpoint import export

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, strategy=ZeroStrategy(stage=2, bucket_mb=0.01), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Recorder(), train_loader())
    ckpt = os.path.join(out, "export.ckpt")
    trainer.save_checkpoint(ckpt)
    _on_rank_zero(out, "export", lambda: export(ckpt, os.path.join(out, "export.safetensors")))
    trainer.strategy.barrier()


if __name__ == "__main__":
    out_dir, case = sys.argv[1], sys.argv[2]
    cases = {
        "statedict_trainer": statedict_trainer,
        "statedict_fabric": statedict_fabric,
        "export": export_on_rank_zero,
    }
    cases[case](out_dir)
