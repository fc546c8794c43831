"""The fault matrix's cells, many per launch (launched by benchmarks/fault_matrix.py; issue 56).

Usage: python tests/scripts/fault_run.py OUT_DIR MODE CELL [CELL ...]

Started as srun starts a job step (``SLURM_*`` variables, ``SLURM_NTASKS`` ranks on one node):
Lightning detects ``SLURMEnvironment`` with auto-requeue (SIGUSR1), and the fake ``scontrol`` the
launcher puts on ``PATH`` logs each requeue. A cell is ``<name>=<door>:<strategy>:<event>@<moment>``:

- door: ``trainer`` (``L.Trainer``) or ``fabric`` (a LitGPT-style ``L.Fabric`` loop that asks
  ``fabric.strategy.scheduler_signals()`` once per step; ZeRO strategies only);
- strategy: ``ddp`` (Lightning's, with ``SchedulerSignals`` for ``trainer``) or ``zero1``..``zero3``;
- event (on rank :data:`FAULT_RANK` only, but ``publishkill``: rank 0, the rank that publishes; the
  others learn of it from the ranks): ``usr1`` (the SLURM requeue signal), ``term`` (SIGTERM),
  ``exc`` (a ``RuntimeError`` raised there), ``kill`` (SIGKILL), ``diskfull`` (the rank's file-size
  limit drops to 32 KiB, ``RLIMIT_FSIZE``: its next checkpoint write fails with EFBIG), ``slow``
  (from then on the rank's checkpoint writes go at :data:`SLOW_BYTES_PER_S`, a small piece at a
  time, under ``collective_timeout=``:data:`SLOW_TIMEOUT_S`: a save takes longer than that,
  writing all along),
  ``publishkill`` (the platform's atomic exchange off, rank 0 SIGKILLs itself between the two
  renames of the next publish over an existing checkpoint: ``last.ckpt``, ``save_last=True``), or
  ``none`` (the uninterrupted run);
- moment: ``accum``: the first micro batch of optimizer step :data:`EVENT_STEP` (of
  :data:`ACCUMULATE` micro batches), before its forward and backward; ``val``: the first batch of
  the validation inside ``fit`` after step ``EVENT_STEP - 1``; ``syncsave`` / ``asyncsave``: the
  save of step :data:`SAVE_STEP` (``async_checkpoint=True`` for ``asyncsave``; under Lightning's ddp
  only ``syncsave``): a signal, an exception or a SIGKILL lands once this rank's shards are written,
  before the publish (``asyncsave``: in the writer thread; the exception is raised by the training
  thread at its next micro batch while the writer is held), a full disk or a slow writer starts
  as the save begins; ``validate`` / ``test`` / ``predict``: batch 1 of that entry point, with no
  ``fit`` before it; ``fitpredict``: batch 1 of a ``predict`` after a complete ``fit``. A full disk
  or a slow writer at ``accum`` / ``val`` starts there and meets the next save.

Every ``fit`` saves through ``ModelCheckpoint`` every 2 optimizer steps (``last.ckpt`` too: a copy,
``save_last=True``; ``"link"`` in ``asyncsave`` cells but ``publishkill``) and
``OnExceptionCheckpoint`` (``on_exit.ckpt``: the save on SIGTERM). A new kind of cell is an entry
of :data:`EVENTS` or :data:`MOMENTS`, what :class:`Fault` does for it, and a line in
``expected()`` of ``benchmarks/fault_matrix.py``.

MODE ``fault`` runs the cells; ``resume`` starts each cell again in its directory, from the newest
checkpoint its run left (an ``hpc_ckpt_N.ckpt``: no ``ckpt_path``, Lightning's SLURM resume finds
it; else ``on_exit.ckpt``; else ``ckpt_path="last"``; Fabric: the newest published save), and
records the losses; a cell whose event is ``none`` is the uninterrupted run. A cell that ends with ``SystemExit`` (143, 138) or with a
``CheckpointWriteError`` (agreed on every rank: the process group is sound) is caught and the
next cell runs, unless it is the last one: then the process exits as a user's script would. Each rank writes
``OUT_DIR/<MODE>.<SLURM_JOB_ID>.rank<r>.json`` after every cell.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
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
from lightning_zero.checkpoint import publish as checkpoint_publish  # noqa: E402
from lightning_zero.checkpoint import save as checkpoint_save  # noqa: E402
from lightning_zero.checkpoint.publish import CheckpointWriteError  # noqa: E402
from lightning_zero.trainer.signals import SchedulerSignals  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

FAULT_RANK = 1
MAX_STEPS = 6
ACCUMULATE = 2
EVENT_STEP = 3  # the optimizer step the training moments land in (1-based)
SAVE_STEP = 4  # the save the save moments land in (saves every 2 steps: the step-2 one is published)
EVAL_BATCHES = 4
FSIZE_LIMIT = 32 << 10  # diskfull: the rank's file-size limit (a shard is larger)
SLOW_BYTES_PER_S = 16 << 10  # slow: checkpoint writes go at 16 KiB/s, 2 KiB at a time (a shard: ~5 s) ...
SLOW_CHUNK = 2 << 10
SLOW_TIMEOUT_S = 2.0  # ... under collective_timeout=2 s: a save takes longer, with progress all along
EVENTS = ("none", "usr1", "term", "exc", "kill", "diskfull", "slow", "publishkill")
MOMENTS = ("accum", "val", "syncsave", "asyncsave", "validate", "test", "predict", "fitpredict")
SAVE_MOMENTS = ("syncsave", "asyncsave")
WRITE_EVENTS = ("diskfull", "slow", "publishkill")  # events that change the next write, not the step


class Cell:
    def __init__(self, text: str) -> None:
        self.name, _, rest = text.partition("=")
        self.door, self.strategy, what = rest.split(":")
        self.event, _, self.moment = what.partition("@")
        if self.event not in EVENTS or (self.event != "none" and self.moment not in MOMENTS):
            raise ValueError(f"fault_run: unknown cell {text!r} (events {EVENTS}, moments {MOMENTS})")


def inject(event: str) -> None:
    """What a signal, an exception or a SIGKILL does, on the rank it lands on."""
    if event == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif event == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif event in ("kill", "publishkill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif event == "exc":
        raise RuntimeError(f"fault_run: an exception injected on rank {FAULT_RANK}")


def save_step(target: object) -> Optional[int]:
    """The step of a periodic save's path (Trainer: ``epoch=0-step=4.ckpt``; Fabric: ``step-4``)."""
    name = Path(str(target)).name
    for head, tail in (("step=", ".ckpt"), ("step-", "")):
        number = name.rpartition(head)[2].removesuffix(tail) if head in name else ""
        if number.isdigit():
            return int(number)
    return None


def is_save_step(target: object) -> bool:
    """Whether a checkpoint path is the save of :data:`SAVE_STEP` (the first of that step's saves)."""
    return save_step(target) == SAVE_STEP


class Fault:
    """Lands the cell's event at its moment, once, on its rank (FAULT_RANK; rank 0 for
    ``publishkill``); notes the time. ``install()`` sets the checkpoint hooks a cell needs and
    ``restore()`` puts everything back (cells share a process)."""

    def __init__(self, cell: Cell, rank: int) -> None:
        on = 0 if cell.event == "publishkill" else FAULT_RANK
        self.cell, self.rank, self.sent_at = cell, rank, None
        self.armed = rank == on and cell.event != "none"
        self.deferred = threading.Event()  # asyncsave + exc: the writer thread holds, the training thread raises
        self.raised = threading.Event()
        self.landed = threading.Event()  # the event landed in the writer thread
        self.wait_for_save = lambda: None  # the door's wait for a background save in flight
        self.restore_ddp = lambda: None  # puts back what _ddp_save_hooks replaced

    # -- the checkpoint hooks ----------------------------------------------------------------------
    def install(self) -> None:
        self._limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        self._saved = (checkpoint_publish._Recording.write, checkpoint_publish.exchange)
        checkpoint_save._fault_hook = self._shards_written
        if self.armed and self.cell.event == "publishkill":
            checkpoint_publish.exchange = lambda first, second: False  # the fallback publish: two renames
            checkpoint_publish._publish_hook = lambda stage: self.fire("publishkill")

    def restore(self) -> None:
        checkpoint_save._fault_hook = None
        checkpoint_publish._publish_hook = None
        checkpoint_publish._Recording.write, checkpoint_publish.exchange = self._saved
        resource.setrlimit(resource.RLIMIT_FSIZE, self._limit)
        self.raised.set()  # a writer thread held for the training thread lets go

    def _shards_written(self, stage: str) -> None:
        """``checkpoint/save.py``'s hook, on every rank, in the thread that writes."""
        target = sys._getframe(1).f_locals.get("target")  # write_snapshot's target
        if not (self.armed and self.cell.moment in SAVE_MOMENTS and is_save_step(target)):
            return
        if self.cell.event == "exc" and threading.current_thread() is not threading.main_thread():
            self.armed, self.sent_at = False, time.time()
            self.deferred.set()  # the training thread raises at its next micro batch, this save in flight
            self.landed.set()
            self.raised.wait(30)
        elif self.cell.event not in WRITE_EVENTS:
            self.landed.set()
            self.fire(self.cell.event)

    def save_begins(self, target: object) -> None:
        """A door begins a save (every rank): a full disk or a slow writer of a save moment starts."""
        if self.cell.moment in SAVE_MOMENTS and is_save_step(target):
            self.at(self.cell.moment, begin=True)

    def fire(self, event: str) -> None:
        self.armed, self.sent_at = False, time.time()
        inject(event)

    # -- the moments ---------------------------------------------------------------------------------
    def at(self, moment: str, begin: bool = False) -> None:
        """The training / evaluation thread reached ``moment``."""
        if self.deferred.is_set() and not self.raised.is_set():
            self.raised.set()
            inject("exc")
        if not (self.armed and moment == self.cell.moment):
            return
        event = self.cell.event
        if event in ("diskfull", "slow"):
            if moment in SAVE_MOMENTS and not begin:
                return
            self.armed, self.sent_at = False, time.time()
            self.wait_for_save()  # the save before is published: the condition meets the next one
            if event == "diskfull":
                resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, self._limit[1]))
            else:
                _slow_writes()
        elif event != "publishkill" and moment not in SAVE_MOMENTS:
            self.fire(event)

    def poll(self, step: int) -> None:
        """Every micro batch of optimizer step ``step``: in an ``asyncsave`` cell the training thread
        does not run past the first micro batch after the save began until the event landed in the
        writer thread (so it lands while the save is in flight and is agreed inside the run, however
        far the loop would have run ahead); an exception the writer deferred is raised here."""
        waits = self.armed and self.cell.moment == "asyncsave" and self.cell.event in ("usr1", "term", "exc", "kill")
        if waits and step == SAVE_STEP + 1:
            self.landed.wait(30)
        self.at("")


def _slow_writes() -> None:
    write = checkpoint_publish._Recording.write

    def slow(stream: object, data: Any) -> int:
        view, written = memoryview(data).cast("B"), 0
        for offset in range(0, len(view), SLOW_CHUNK):
            time.sleep(min(SLOW_CHUNK, len(view) - offset) / SLOW_BYTES_PER_S)
            written += write(stream, view[offset : offset + SLOW_CHUNK]) or 0
        return written

    checkpoint_publish._Recording.write = slow


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
        self.fault.poll(step)
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


def _strategy(name: str, cell: Cell) -> Any:
    if name == "ddp":
        if cell.moment == "asyncsave":
            raise ValueError("fault_run: Lightning's ddp has no background save (asyncsave cells are n/a)")
        return "ddp"
    timeout = SLOW_TIMEOUT_S if cell.event == "slow" else None
    return ZeroStrategy(stage=int(name[-1]), bucket_mb=0.002, async_checkpoint=cell.moment == "asyncsave",
                        collective_timeout=timeout)  # fmt: skip


def resume_path(root: Path) -> tuple[Optional[str], str]:
    """Where a resume starts: ``(ckpt_path, what)``; an hpc checkpoint is found by Lightning itself,
    ``last.ckpt`` by ``ckpt_path="last"`` (after a moved-aside one is restored)."""
    if sorted(root.glob("hpc_ckpt_*.ckpt")):
        return None, "hpc"
    if (root / "on_exit.ckpt").exists():
        return str(root / "on_exit.ckpt"), "on_exit"
    if (root / "ckpts").is_dir():
        return "last", "last"
    return None, "start"


def published(root: Path) -> list[str]:
    """The checkpoints a start would find in ``root`` and ``root/ckpts`` (complete ones)."""
    found = []
    for directory in (root, root / "ckpts"):
        for path in sorted(directory.glob("*.ckpt")) if directory.is_dir() else []:
            if path.is_file() or (path / "meta.json").exists():
                found.append(str(path.relative_to(root)))
    return found


def _ddp_save_hooks(trainer: Any, fault: "Fault") -> None:
    """Lightning's ddp: the save moments land as the step's save begins (rank 1 writes nothing), and
    rank 0's kill during a publish lands halfway through writing ``last.ckpt``."""
    from lightning.fabric.plugins.io import torch_io

    save = trainer.strategy.save_checkpoint

    def saving(checkpoint: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        fault.save_begins(filepath)
        if fault.armed and fault.cell.moment in SAVE_MOMENTS and fault.cell.event not in WRITE_EVENTS:
            if is_save_step(filepath):
                fault.fire(fault.cell.event)
        return save(checkpoint, filepath, *args, **kwargs)

    trainer.strategy.save_checkpoint = saving
    if fault.armed and fault.cell.event == "publishkill":
        atomic_save = torch_io._atomic_save

        def dying(checkpoint: Any, filepath: Any) -> None:
            if Path(str(filepath)).name != "last.ckpt" or checkpoint.get("global_step") != SAVE_STEP:
                return atomic_save(checkpoint, filepath)
            import io

            import fsspec

            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            fs, urlpath = fsspec.core.url_to_fs(str(filepath))
            with fs.transaction, fs.open(urlpath, "wb") as handle:
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                handle.flush()
                fault.fire("publishkill")

        torch_io._atomic_save = dying
        fault.restore_ddp = lambda: setattr(torch_io, "_atomic_save", atomic_save)


def run_trainer(cell: Cell, root: Path, mode: str, fault: Fault, result: dict) -> None:
    record, signals = Record(), SchedulerSignals()
    callbacks: list = [record, signals]
    fitting = cell.moment not in ("validate", "test", "predict")
    if fitting:
        save_last: Any = "link" if cell.moment == "asyncsave" and cell.event != "publishkill" else True
        callbacks += [
            ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, save_last=save_last, save_top_k=-1),
            OnExceptionCheckpoint(dirpath=root, filename="on_exit"),
        ]
    L.seed_everything(0, verbose=False)
    module = Module(fault)
    trainer = script_trainer(
        devices=int(os.environ["SLURM_NTASKS"]),
        strategy=_strategy(cell.strategy, cell),
        max_steps=MAX_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        default_root_dir=root,
        enable_checkpointing=fitting,
        callbacks=callbacks,
        val_check_interval=2 * ACCUMULATE,
        limit_val_batches=EVAL_BATCHES,
    )
    result.update(resumed_from=None, losses=record.losses)
    if cell.strategy == "ddp":
        _ddp_save_hooks(trainer, fault)
    else:
        save = trainer.strategy.save_checkpoint

        def saving(checkpoint: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
            fault.save_begins(filepath)
            return save(checkpoint, filepath, *args, **kwargs)

        trainer.strategy.save_checkpoint = saving
        fault.wait_for_save = trainer.strategy.wait_for_checkpoint
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
        if mode == "fault" and fitting:
            result["published"] = published(root)


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
    fault.install()
    try:
        if cell.door == "trainer":
            run_trainer(cell, root, mode, fault, result)
        else:
            from tests.scripts.fault_fabric import run_fabric

            run_fabric(cell, root, mode, fault, result)
    except BaseException as exc:  # noqa: BLE001 - SystemExit(143/138); an injected or a peer's error
        ended = exc
    finally:
        fault.restore()
        fault.restore_ddp()
    result.update(
        requeues=_requeues() - requeues_before, started=started, sent=fault.sent_at, ended=time.time(),
        exit=None if ended is None else (ended.code if isinstance(ended, SystemExit) else type(ended).__name__),
        error=None if ended is None or isinstance(ended, SystemExit) else f"{type(ended).__name__}: {ended}"[:2000],
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
        agreed = isinstance(ended, (SystemExit, CheckpointWriteError))  # every rank ended the cell alike
        if ended is not None and (index == len(cells) - 1 or not agreed):
            raise ended  # the last cell ends the process as a user's script would


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
