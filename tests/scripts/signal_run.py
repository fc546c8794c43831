"""Scheduler signals at any moment of a step (launched by tests/test_signals.py, issue 43).

Usage: python tests/scripts/signal_run.py OUT_DIR MODE TRIAL [TRIAL ...]

Started as srun starts a job step (``SLURM_*`` variables, ``SLURM_NTASKS`` tasks on one node, the
Trainer's ``devices``): Lightning detects ``SLURMEnvironment`` (auto-requeue on, SIGUSR1) and starts
no process of its own. A trial is ``<name>=<strategy>:<signals>``, e.g.
``z2a=zero2:0.backward@3,1.forward@3``: rank 0 sends itself the signal inside backward of training
step 3, rank 1 in step 3's forward. Strategies: ``ddp``, ``zero<N>`` (a small MLP), and
``tp<T>z<N>``: ``ZeroStrategy(stage=N, tensor_parallel_size=T)`` on a tiny ``LlamaLM`` (e.g.
``tp2z3`` on 4 tasks: tp=2 x dp=2), whose tokens depend on the step and the dp rank only (TP peers
train on the same batch). Moments:

- ``forward``: in ``training_step``, before the forward; ``gather``: a block's forward pre-hook
  (under stage 3, while its parameters are gathered); ``backward``: a tensor hook inside backward
  (buckets of the reduce-scatter in flight); ``optimizer``: an optimizer step pre-hook (inside
  ``optimizer.step``, before the update); ``after_step``: its post-hook; ``validation``: in the
  first validation batch after that step; ``save``: in the checkpoint save at the end of that step
  (a ``ModelCheckpoint``; ZeroStrategy only: after the shards are written).

MODE:
- ``requeue``: SIGUSR1; each trial trains ``MAX_STEPS`` in ``OUT_DIR/<name>`` (the requeue saves
  ``hpc_ckpt_1.ckpt`` there and runs ``scontrol``, which the test puts on PATH; training goes on).
  The test SIGKILLs the last trial's processes once its ``scontrol`` ran.
- ``sigterm``: SIGTERM; each trial ends with ``SystemExit`` (caught; the last one is not, so the
  process exits with its code). A trial name ending in ``_save`` adds ``OnExceptionCheckpoint``.
- ``resume``: every trial is started again in its directory with no ``ckpt_path`` (a trial named
  ``base*`` is a fresh run: the uninterrupted losses); ``last:<name>`` trials resume ``ckpt_path="last"``.
  In any mode a trial with no signals runs uninterrupted, or, where its directory holds an
  ``hpc_ckpt_N.ckpt``, resumes from it as a requeued job does (no ``ckpt_path``).
- ``async``: ``ZeroStrategy(async_checkpoint=True)`` when the trial's name has ``async`` in it;
  ModelCheckpoint as under ``efbig``; ``kill@<R>``: rank ``R`` SIGKILLs itself inside the
  background write of the step-4 checkpoint (after its shards are written, before the publish).
- ``efbig``: at the end of step 3 rank ``R`` (the trial's signals field: ``efbig@<R>``) lowers its
  file-size limit to 32 KiB (above its RNG file, below its shard); the step-4 save (ModelCheckpoint every 2 steps, ``last.ckpt``) fails.

Each rank writes ``OUT_DIR/<MODE>.<SLURM_JOB_ID>.rank<r>.json`` after every trial: per trial the losses by step,
when it sent itself the signal, what was agreed and when, how the fit ended and when.
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
from torch import nn

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.checkpoint import save as checkpoint_save  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from lightning_zero.trainer.signals import SchedulerSignals  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

MAX_STEPS = 6
VAL_EVERY = 2
TP_CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def _parse(trial: str) -> tuple[str, str, dict[int, tuple[str, int]]]:
    name, _, rest = trial.partition("=")
    strategy, _, spec = rest.partition(":")
    moments = {}
    for part in filter(None, spec.split(",")):
        if part.startswith(("efbig@", "kill@")):
            kind, _, rank = part.partition("@")
            moments[int(rank)] = (kind, 3 if kind == "efbig" else 4)
            continue
        rank, _, moment = part.partition(".")
        phase, _, step = moment.partition("@")
        moments[int(rank)] = (phase, int(step))
    return name, strategy, moments


class Moments:
    """Sends this rank its signal at its moment (once), noting the time."""

    def __init__(self, moment: tuple[str, int] | None, signum: int) -> None:
        self.moment, self.signum, self.sent_at = moment, signum, None

    def at(self, phase: str, step: int) -> None:
        if self.moment == (phase, step) and self.sent_at is None:
            self.sent_at = time.time()
            os.kill(os.getpid(), self.signum)


class Signalled:
    """What both models share: the step a moment belongs to, and the moments' hooks."""

    moments: Moments
    trainer: Any

    def _step(self) -> int:
        return self.trainer.global_step + 1

    def _at(self, phase: str) -> None:
        if self.trainer.training:
            self.moments.at(phase, self._step())

    def _backward_hook(self, step: int) -> Any:
        return lambda grad: self.moments.at("backward", step)

    def _watch_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        opt.register_step_pre_hook(lambda *args: self.moments.at("optimizer", self._step()))
        opt.register_step_post_hook(lambda *args: self.moments.at("after_step", self._step()))
        return opt

    def _generator(self, step: int, salt: int, rank: int) -> torch.Generator:
        """The data of a step depends on the step and ``rank`` only (not on the loader's state)."""
        return torch.Generator().manual_seed(1000 * salt + 10 * step + rank)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(range(64)), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(range(2)), batch_size=1)


class Net(Signalled, L.LightningModule):
    def __init__(self, moments: Moments) -> None:
        super().__init__()
        self.moments = moments
        self.inp = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(64, 4)
        self.blocks[1].register_forward_pre_hook(lambda module, args: self._at("gather"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == 1 and x.requires_grad and self.trainer.training:
                x.register_hook(self._backward_hook(self._step()))
        return self.head(x)

    def _batch(self, step: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = self._generator(step, salt, self.global_rank)
        return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._at("forward")
        x, y = self._batch(self._step(), 1)
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.moments.at("validation", self.trainer.global_step)
        x, y = self._batch(batch_idx, 2)
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self._watch_optimizer(torch.optim.AdamW(self.parameters(), lr=1e-2))


class TpNet(Signalled, LlamaLM):
    """A tiny ``LlamaLM`` the TP plan parallelizes (``tp*`` strategies), with the same moments.

    Its tokens depend on the step and the dp rank only: TP peers train on the same batch, dp peers
    on different ones, whatever the loader's state (so a resumed run meets the same data)."""

    def __init__(self, moments: Moments) -> None:
        super().__init__(TP_CONFIG, lr=1e-2, warmup_steps=1, max_steps=MAX_STEPS)
        self.moments = moments
        self._watched = False

    def configure_model(self) -> None:
        super().configure_model()
        if not self._watched:  # block 1's pre-hook: a stage-3 gather; after block 0: inside backward
            self._watched = True
            self.model.layers[1].register_forward_pre_hook(lambda module, args: self._at("gather"))
            self.model.layers[0].register_forward_hook(lambda module, args, out: self._watch_backward(out))

    def _watch_backward(self, out: torch.Tensor) -> None:
        if out.requires_grad and self.trainer.training:
            out.register_hook(self._backward_hook(self._step()))

    def _tokens(self, step: int, salt: int) -> torch.Tensor:
        gen = self._generator(step, salt, getattr(self.trainer.strategy, "dp_rank", self.global_rank))
        return torch.randint(0, TP_CONFIG["vocab_size"], (2, 17), generator=gen)

    def batch_tokens(self, batch: Any) -> tuple[int, int]:  # ZeroMonitor's count: the loader's items are ignored
        return 2, 16

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._at("forward")
        return self._loss(self._tokens(self._step(), 1))[0]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.moments.at("validation", self.trainer.global_step)
        self._evaluate(self._tokens(batch_idx, 2), "val")

    def configure_optimizers(self) -> dict[str, Any]:
        config = super().configure_optimizers()
        self._watch_optimizer(config["optimizer"])
        return config


class Record(Callback):
    def __init__(self, moments: Moments, efbig_rank: int | None) -> None:
        self.moments, self.efbig_rank = moments, efbig_rank
        self.losses: dict[int, float] = {}
        self.host: dict[str, int] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])
        if self.efbig_rank == trainer.global_rank and trainer.global_step == 3:
            resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        saves = getattr(
            getattr(trainer.strategy, "checkpoints", None), "writer", None
        )  # async_checkpoint: its host copies
        if saves is not None:
            self.host = {"prepared": saves.prepared_bytes, "copied": saves.last_host_bytes, "fresh": saves.fresh_bytes}


def _strategy(name: str, background: bool) -> Any:
    if name == "ddp":
        return "ddp"
    if name.startswith("tp"):  # tp<T>z<N>: tensor_parallel_size T x dp (the rest of the ranks), stage N
        tp, _, stage = name[2:].partition("z")
        return ZeroStrategy(stage=int(stage), tensor_parallel_size=int(tp), bucket_mb=0.01)
    return ZeroStrategy(stage=int(name[-1]), bucket_mb=0.002, async_checkpoint=background)


def run_trial(out: str, mode: str, trial: str, rank: int) -> tuple[dict, BaseException | None]:
    name, strategy, moments_of = _parse(trial)
    last = name.startswith("last_")
    root = os.path.join(out, name[5:] if last else name)
    signum = signal.SIGUSR1 if mode == "requeue" else signal.SIGTERM
    moment = moments_of.get(rank) if mode in ("requeue", "sigterm", "async") else None
    moments = Moments(moment, signum)
    if moment is not None and moment[0] == "save":
        checkpoint_save._fault_hook = lambda stage: moments.at("save", moments.moment[1])
    efbig = next((r for r, (phase, _) in moments_of.items() if phase == "efbig"), None) if mode == "efbig" else None
    record = Record(moments, efbig)
    signals = SchedulerSignals()
    callbacks: list = [record, signals]
    if mode == "async" and moment is not None and moment[0] == "kill":  # SIGKILL in the step-4 background write
        calls = iter(range(1, 100))
        checkpoint_save._fault_hook = lambda stage: next(calls) == 3 and os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("efbig", "async"):
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2, save_last=True,
                                         save_top_k=-1))  # fmt: skip
    save_at = [step for phase, step in moments_of.values() if phase == "save"]
    if mode == "sigterm" and save_at:  # every rank saves; one rank sends itself the signal inside
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=save_at[0]))
    if name.endswith("_save"):
        callbacks.append(OnExceptionCheckpoint(dirpath=root, filename="on_sigterm"))
    L.seed_everything(0, verbose=False)
    model = TpNet(moments) if strategy.startswith("tp") else Net(moments)
    trainer = script_trainer(
        devices=int(os.environ["SLURM_NTASKS"]),
        strategy=_strategy(strategy, "async" in name),
        max_steps=MAX_STEPS,
        default_root_dir=root,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        callbacks=callbacks,
        val_check_interval=VAL_EVERY,
        limit_val_batches=2,
    )
    ended: BaseException | None = None
    started = time.time()
    try:
        trainer.fit(model, ckpt_path=os.path.join(root, "ckpts", "last.ckpt") if last else None)
    except BaseException as exc:  # noqa: BLE001 - SystemExit(143) on SIGTERM; a CheckpointWriteError
        ended = exc
    checkpoint_save._fault_hook = None
    agreement = next(cb for cb in trainer.callbacks if isinstance(cb, SchedulerSignals))
    result = {
        "losses": record.losses,
        "host": record.host,
        "started": started,
        "sent": moments.sent_at,
        "agreed": [
            {"requeue": e.requeue, "terminate": e.terminate, "received": e.received_at, "at": e.agreed_at}
            for e in agreement.events
        ],  # fmt: skip
        "exchanges": agreement.exchanges,
        "ended": time.time(),
        "exit": None if ended is None else (ended.code if isinstance(ended, SystemExit) else type(ended).__name__),
        "error": None if ended is None or isinstance(ended, SystemExit) else str(ended),
    }
    return result, ended


def main(out: str, mode: str, trials: list[str]) -> None:
    rank = int(os.environ["SLURM_PROCID"])
    results: dict[str, Any] = {}
    path = os.path.join(out, f"{mode}.{os.environ['SLURM_JOB_ID']}.rank{rank}.json")
    for index, trial in enumerate(trials):
        result, ended = run_trial(out, mode, trial, rank)
        results[_parse(trial)[0]] = result
        with open(path + ".part", "w") as handle:
            json.dump(results, handle)
        os.replace(path + ".part", path)
        if ended is not None and (index == len(trials) - 1 or not isinstance(ended, SystemExit)):
            raise ended  # the last trial ends the process as a user's script would end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
