"""Checkpoint lifecycle cells on the Trainer door (launched by tests/test_checkpoint_lifecycle.py, issue 56).

Usage: python tests/scripts/ckpt_lifecycle_run.py OUT_DIR TRIAL [TRIAL ...]   (torchrun-style, 2 ranks)

A trial is ``<name>=<strategy>:<event>``; it trains signal_run.py's ``Net`` (data by step and
rank only) for ``MAX_STEPS`` in ``OUT_DIR/<name>`` with ``ModelCheckpoint(every 2 steps,
save_last="link")`` in ``<name>/ckpts``. Strategies: ``ddp``, ``zero<N>`` (sync saves),
``zero<N>a`` (``async_checkpoint=True``). Events:

- ``base``: uninterrupted; ``base4``: 4 steps, ``save_last=True`` (a copy);
- ``after_fit``: no ModelCheckpoint; after ``fit`` returns, ``trainer.save_checkpoint(<name>/after_fit.ckpt)``
  (the process's exit code and the file are the check);
- ``slow@R``: every 100th checkpoint write call of rank R sleeps 0.5 s (a save: about 7 s),
  ``collective_timeout=3``: a save takes longer than that, with progress all the way;
- ``kill@R``: rank R SIGKILLs itself once its shards of the step-4 save are written (before the publish);
- ``publish_kill``: ``save_last=True`` (a copy, re-published over itself), the platform's atomic
  exchange switched off: rank 0 SIGKILLs itself between the two renames of the step-4 ``last.ckpt``;
- ``efbig@R``: rank R's file-size limit drops to 32 KiB after step 3: the step-4 save fails;
  the error is recorded and the next trial runs (the last trial's error ends the process);
- ``resume``: ``fit(ckpt_path="last")`` in the directory of the trial ``<name>`` minus its ``r_`` prefix.

Each rank writes ``OUT_DIR/<first trial's name>.rank<r>.json`` after every trial: losses by step, the error,
when it ended.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.checkpoint import publish as checkpoint_publish  # noqa: E402
from lightning_zero.checkpoint import save as checkpoint_save  # noqa: E402
from tests.scripts.signal_run import Moments, Net  # noqa: E402

MAX_STEPS = 6


class Record(Callback):
    def __init__(self, efbig_rank: int | None) -> None:
        self.efbig_rank = efbig_rank
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])
        if self.efbig_rank == trainer.global_rank and trainer.global_step == 3:
            trainer.strategy.wait_for_checkpoint()  # the step-2 save is published: only the step-4 one fails
            resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _strategy(name: str, timeout: float | None) -> Any:
    if name == "ddp":
        return "ddp"
    background = name.endswith("a")
    stage = int(name.rstrip("a")[-1])
    return ZeroStrategy(stage=stage, bucket_mb=0.002, async_checkpoint=background, collective_timeout=timeout)


def _slow_writes(seconds: float, every: int) -> None:
    """A slow disk: every ``every``-th write call of a checkpoint file sleeps ``seconds``."""
    write, calls = checkpoint_publish._Recording.write, iter(range(1, 1 << 30))

    def slow(self: Any, data: Any) -> int:
        if next(calls) % every == 0:
            time.sleep(seconds)
        return write(self, data)

    checkpoint_publish._Recording.write = slow


def _die(root: str) -> None:
    """SIGKILL this rank, noting when (``<root>/killed_at``: the fault matrix's seconds to exit)."""
    with open(os.path.join(root, "killed_at"), "w") as handle:
        handle.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def run_trial(out: str, trial: str, rank: int) -> tuple[dict, BaseException | None]:
    name, _, rest = trial.partition("=")
    strategy, _, event = rest.partition(":")
    kind, _, at = event.partition("@")
    event_rank = int(at) if at else None
    root = os.path.join(out, name[2:] if kind == "resume" else name)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    saved_write, saved_exchange = checkpoint_publish._Recording.write, getattr(checkpoint_publish, "exchange", None)
    timeout = 3.0 if kind == "slow" else None
    if kind == "slow" and rank == event_rank:
        _slow_writes(0.5, every=100)  # a save has about 1,500 write calls: 7 s, never 0.5 s without progress
    calls = iter(range(1, 100))
    if kind == "kill" and rank == event_rank:  # the second save's shards (step 4; the link is no save)
        checkpoint_save._fault_hook = lambda stage: next(calls) == 2 and _die(root)
    if kind == "publish_kill":
        checkpoint_publish.exchange = lambda first, second: False
        if rank == 0:
            checkpoint_publish._publish_hook = lambda stage: _die(root)
    record = Record(event_rank if kind == "efbig" else None)
    callbacks: list = [record]
    if kind != "after_fit":
        save_last: Any = True if kind in ("publish_kill", "base4") else "link"
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2,
                                         save_last=save_last, save_top_k=-1))  # fmt: skip
    L.seed_everything(0, verbose=False)
    model = Net(Moments(None, signal.SIGTERM))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(strategy, timeout), max_steps=4 if kind == "base4" else MAX_STEPS,
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=kind != "after_fit", callbacks=callbacks, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    ended: BaseException | None = None
    started = time.time()
    try:
        trainer.fit(model, ckpt_path="last" if kind == "resume" else None)
        if kind == "after_fit":
            trainer.save_checkpoint(os.path.join(root, "after_fit.ckpt"))
    except BaseException as exc:  # noqa: BLE001 - what the rank saw is the result
        ended = exc
    finally:
        checkpoint_save._fault_hook = None
        checkpoint_publish._publish_hook = None
        checkpoint_publish._Recording.write, checkpoint_publish.exchange = saved_write, saved_exchange
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
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
    for index, trial in enumerate(trials):
        result, ended = run_trial(out, trial, rank)
        results[trial.partition("=")[0]] = result
        with open(path + ".part", "w") as handle:
            json.dump(results, handle)
        os.replace(path + ".part", path)
        if ended is not None and (index == len(trials) - 1 or ":efbig" not in trial):
            raise ended  # the process ends as a user's script would end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
