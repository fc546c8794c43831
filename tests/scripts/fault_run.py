"""The fault matrix's cells, many per launch (launched by benchmarks/fault_matrix.py; issue 56).

Usage: python tests/scripts/fault_run.py OUT_DIR MODE CELL [CELL ...]

Started as srun starts a job step (``SLURM_*`` variables, ``SLURM_NTASKS`` ranks on one node):
Lightning detects ``SLURMEnvironment`` with auto-requeue (SIGUSR1), and the fake ``scontrol`` the
launcher puts on ``PATH`` logs each requeue. A cell is ``<name>=<door>:<strategy>:<event>@<moment>``:

- door: ``trainer`` (``L.Trainer``) or ``fabric`` (a LitGPT-style ``L.Fabric`` loop that asks
  ``fabric.strategy.scheduler_signals()`` once per step; ZeRO strategies only);
- strategy: ``ddp`` (Lightning's, with ``SchedulerSignals`` for ``trainer``) or ``zero1``..``zero3``;
- event (on rank :data:`FAULT_RANK` only; the others learn of it from the ranks): ``usr1`` (the
  SLURM requeue signal), ``term`` (SIGTERM), ``exc`` (a ``RuntimeError`` raised there), ``kill``
  (SIGKILL), or ``none`` (the uninterrupted run);
- moment: ``accum``: the first micro batch of optimizer step :data:`EVENT_STEP` (of
  :data:`ACCUMULATE` micro batches), before its forward and backward; ``val``: the first batch of
  the validation inside ``fit`` after step ``EVENT_STEP - 1``; ``validate`` / ``test`` /
  ``predict``: batch 1 of that entry point, with no ``fit`` before it; ``fitpredict``: batch 1 of a
  ``predict`` after a complete ``fit``.

Every ``fit`` saves through ``ModelCheckpoint`` every 2 optimizer steps (``last.ckpt`` too) and
``OnExceptionCheckpoint`` (``on_exit.ckpt``: the save on SIGTERM). Hooks to add cells (rt-ckpt's
disk-full, slow-writer, kill-during-publish and async-save cells): :data:`MOMENTS` and
:func:`inject` (what an event does), :data:`EVENTS`.

MODE ``fault`` runs the cells; ``resume`` starts each cell again in its directory, from the newest
checkpoint its run left (an ``hpc_ckpt_N.ckpt``: no ``ckpt_path``, Lightning's SLURM resume finds
it; else ``on_exit.ckpt``; else ``last.ckpt``; Fabric: the newest published ``step-N`` save), and
records the losses; a cell whose event is ``none`` is the uninterrupted run.
A cell that ends with ``SystemExit`` (143, 138) is caught and the next cell runs, unless it is the
last one: then the process exits as a user's script would. Each rank writes
``OUT_DIR/<MODE>.<SLURM_JOB_ID>.rank<r>.json`` after every cell.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.trainer.signals import SchedulerSignals  # noqa: E402

FAULT_RANK = 1
MAX_STEPS = 4
ACCUMULATE = 2
EVENT_STEP = 3  # the optimizer step the training moments land in (1-based)
EVAL_BATCHES = 4
EVENTS = ("none", "usr1", "term", "exc", "kill")
MOMENTS = ("accum", "val", "validate", "test", "predict", "fitpredict")


class Cell:
    def __init__(self, text: str) -> None:
        self.name, _, rest = text.partition("=")
        self.door, self.strategy, what = rest.split(":")
        self.event, _, self.moment = what.partition("@")
        if self.event not in EVENTS or (self.event != "none" and self.moment not in MOMENTS):
            raise ValueError(f"fault_run: unknown cell {text!r} (events {EVENTS}, moments {MOMENTS})")


def inject(event: str) -> None:
    """What an event does, on the rank it lands on."""
    if event == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif event == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif event == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif event == "exc":
        raise RuntimeError(f"fault_run: an exception injected on rank {FAULT_RANK}")


class Fault:
    """Lands the cell's event at its moment, once, on rank FAULT_RANK; notes the time."""

    def __init__(self, cell: Cell, rank: int) -> None:
        self.cell, self.armed, self.sent_at = cell, rank == FAULT_RANK and cell.event != "none", None

    def at(self, moment: str) -> None:
        if self.armed and moment == self.cell.moment:
            self.armed = False
            self.sent_at = time.time()
            inject(self.cell.event)


def batch(step: int, micro: int, rank: int, salt: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a micro batch depends on (step, micro batch, dp rank) only, not on the loader."""
    gen = torch.Generator().manual_seed(10000 * salt + 100 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# -- the Trainer door ------------------------------------------------------------------------------
class Module(L.LightningModule):
    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.fault, self.net = fault, Net()

    def training_step(self, item: Any, batch_idx: int) -> torch.Tensor:
        step, micro = self.trainer.global_step + 1, batch_idx % ACCUMULATE
        if step == EVENT_STEP and micro == 0:
            self.fault.at("accum")
        x, y = batch(step, micro, self.global_rank)
        return nn.functional.cross_entropy(self.net(x), y)

    def _eval(self, batch_idx: int, moments: tuple[str, ...]) -> torch.Tensor:
        if batch_idx == 1 or (batch_idx == 0 and "val" in moments and self.trainer.global_step == EVENT_STEP - 1):
            for moment in moments:
                self.fault.at(moment)
        x, y = batch(batch_idx, 0, self.global_rank, salt=2)
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, item: Any, batch_idx: int) -> None:
        moments = ("val",) if self.trainer.state.fn == "fit" else ("validate",)
        self.log("val_loss", self._eval(batch_idx, moments))

    def test_step(self, item: Any, batch_idx: int) -> None:
        self.log("test_loss", self._eval(batch_idx, ("test",)))

    def predict_step(self, item: Any, batch_idx: int) -> torch.Tensor:
        return self._eval(batch_idx, ("predict", "fitpredict"))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(range(64)), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(range(2 * EVAL_BATCHES)), batch_size=1)

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(list(range(2 * EVAL_BATCHES)), batch_size=1)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, item: Any, batch_idx: int) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.losses[trainer.global_step] = float(outputs["loss"])


def _strategy(name: str) -> Any:
    return "ddp" if name == "ddp" else ZeroStrategy(stage=int(name[-1]), bucket_mb=0.002)


def resume_path(root: Path) -> tuple[Optional[str], str]:
    """Where a resume starts: ``(ckpt_path, what)``; an hpc checkpoint is found by Lightning itself."""
    if sorted(root.glob("hpc_ckpt_*.ckpt")):
        return None, "hpc"
    for name, what in (("on_exit.ckpt", "on_exit"), ("ckpts/last.ckpt", "last")):
        if (root / name).exists():
            return str(root / name), what
    return None, "start"


def run_trainer(cell: Cell, root: Path, mode: str, fault: Fault, result: dict) -> None:
    record, signals = Record(), SchedulerSignals()
    callbacks: list = [record, signals]
    fitting = cell.moment not in ("validate", "test", "predict")
    if fitting:
        callbacks += [
            ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_last=True, save_top_k=-1),
            OnExceptionCheckpoint(dirpath=root, filename="on_exit"),
        ]
    L.seed_everything(0, verbose=False)
    module = Module(fault)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["SLURM_NTASKS"]), strategy=_strategy(cell.strategy),
        max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=fitting, callbacks=callbacks,
        val_check_interval=2 * ACCUMULATE, limit_val_batches=EVAL_BATCHES, num_sanity_val_steps=0,
    )  # fmt: skip
    result.update(resumed_from=None, losses=record.losses)
    try:
        if mode == "resume":
            ckpt_path, result["resumed_from"] = resume_path(root)
            trainer.fit(module, ckpt_path=ckpt_path)
        elif fitting:
            trainer.fit(module)
            if cell.moment == "fitpredict":
                trainer.predict(module)
        else:
            getattr(trainer, cell.moment)(module)
    finally:
        result.update(agreed=_events(signals), exchanges=signals.exchanges)


def _events(signals: Any) -> list[dict]:
    return [{"requeue": e.requeue, "terminate": e.terminate, "at": e.agreed_at} for e in signals.events]


def _requeues() -> int:
    log = Path(os.environ.get("LZ_SCONTROL_LOG", "/nonexistent"))
    return len(log.read_text().splitlines()) if log.exists() else 0


def run_cell(out: Path, mode: str, cell: Cell, rank: int) -> tuple[dict, Optional[BaseException]]:
    root = out / cell.name
    fault = Fault(cell, rank) if mode == "fault" else Fault(Cell(f"{cell.name}={cell.door}:{cell.strategy}:none"), rank)
    started, ended, result = time.time(), None, {}  # filled as the cell goes
    requeues_before = _requeues()
    try:
        if cell.door == "trainer":
            run_trainer(cell, root, mode, fault, result)
        else:
            from tests.scripts.fault_fabric import run_fabric

            run_fabric(cell, root, mode, fault, result)
    except BaseException as exc:  # noqa: BLE001 - SystemExit(143/138); an injected or a peer's error
        ended = exc
    result.update(
        requeues=_requeues() - requeues_before, started=started, sent=fault.sent_at, ended=time.time(),
        exit=None if ended is None else (ended.code if isinstance(ended, SystemExit) else type(ended).__name__),
        error=None if ended is None or isinstance(ended, SystemExit) else str(ended)[:2000],
    )  # fmt: skip
    return result, ended


def main(out: str, mode: str, cells: list[str]) -> None:
    rank = int(os.environ["SLURM_PROCID"])
    results: dict[str, Any] = {}
    path = Path(out) / f"{mode}.{os.environ['SLURM_JOB_ID']}.rank{rank}.json"
    for index, text in enumerate(cells):
        cell = Cell(text)
        result, ended = run_cell(Path(out), mode, cell, rank)
        results[cell.name] = result
        path.with_suffix(".part").write_text(json.dumps(results))
        os.replace(path.with_suffix(".part"), path)
        if ended is not None and (index == len(cells) - 1 or not isinstance(ended, SystemExit)):
            raise ended  # the last cell ends the process as a user's script would


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
