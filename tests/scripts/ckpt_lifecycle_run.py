"""Checkpoint lifecycle cells on the Trainer door (launched by tests/test_checkpoint_lifecycle.py, issue 56).

Usage: python tests/scripts/ckpt_lifecycle_run.py OUT_DIR TRIAL [TRIAL ...]   (torchrun-style, 2 ranks)

A trial is ``<name>=<strategy>:after_fit``; it trains signal_run.py's ``Net`` (data by step and
rank only) for ``MAX_STEPS`` in ``OUT_DIR/<name>``, and after ``fit`` returns calls
``trainer.save_checkpoint(<name>/after_fit.ckpt)`` (the process's exit code and the file are the
check). Strategies: ``ddp``, ``zero<N>`` (sync saves), ``zero<N>a`` (``async_checkpoint=True``).
The lifecycle's fault cells (kills, a kill inside a publish, a full disk, a slow writer) are cells
of the fault matrix (tests/scripts/fault_run.py).

Each rank writes ``OUT_DIR/<first trial's name>.rank<r>.json`` after every trial: losses by step, the error,
when it ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402
from tests.scripts.signal_run import Moments, Net  # noqa: E402

MAX_STEPS = 6


class Record(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    background = name.endswith("a")
    stage = int(name.rstrip("a")[-1])
    return ZeroStrategy(stage=stage, bucket_mb=0.002, async_checkpoint=background)


def run_trial(out: str, trial: str, rank: int) -> tuple[dict, BaseException | None]:
    name, _, rest = trial.partition("=")
    strategy, _, event = rest.partition(":")
    if event != "after_fit":
        raise ValueError(f"ckpt_lifecycle_run: unknown event {event!r} (after_fit)")
    root = os.path.join(out, name)
    record = Record()
    L.seed_everything(0, verbose=False)
    model = Net(Moments(None, signal.SIGTERM))
    trainer = script_trainer(
        devices=2, strategy=_strategy(strategy), max_steps=MAX_STEPS, default_root_dir=root, callbacks=[record]
    )
    ended: BaseException | None = None
    started = time.time()
    try:
        trainer.fit(model)
        trainer.save_checkpoint(os.path.join(root, "after_fit.ckpt"))
    except BaseException as exc:  # noqa: BLE001 - what the rank saw is the result
        ended = exc
    result = {
        "losses": record.losses,
        "started": started,
        "ended": time.time(),
        "error": None if ended is None else f"{type(ended).__name__}: {ended}"[:3000],
    }
    return result, ended


def main(out: str, trials: list[str]) -> None:
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    path = os.path.join(out, f"{trials[0].partition('=')[0]}.rank{rank}.json")  # one file per launch
    for trial in trials:
        result, ended = run_trial(out, trial, rank)
        results[trial.partition("=")[0]] = result
        with open(path + ".part", "w") as handle:
            json.dump(results, handle)
        os.replace(path + ".part", path)
        if ended is not None:
            raise ended  # the process ends as a user's script would end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
