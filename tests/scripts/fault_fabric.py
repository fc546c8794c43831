"""The Fabric door's cells of the fault matrix (``tests/scripts/fault_run.py``, ``door = fabric``).

A LitGPT-style loop: ``fabric.setup``, micro batches under ``no_backward_sync``, ``optimizer.step()``,
a sharded ``fabric.save`` every 2 steps (``step-N``; in ``publishkill`` cells also ``last``, saved
again over itself), and once per step ``fabric.strategy.scheduler_signals()`` ([Note: signal
boundaries] in ``runtime/signals.py``): on an agreed signal every rank saves ``signal-N``, then
requeues and trains on (SIGUSR1) or exits 143 (SIGTERM). ``asyncsave`` cells run
``ZeroFabricStrategy(async_checkpoint=True)``, ``slow`` cells ``collective_timeout=2``. The resume
loads ``signal-N`` if there is one (what a requeued job would resume from), else ``last`` in a
``publishkill`` cell (a killed publish may have moved it aside: ``fabric.load`` moves it back),
else the newest ``step-N``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.loggers import Logger
from torch import nn

from lightning_zero.fabric.strategy import ZeroFabricStrategy
from lightning_zero.runtime.signals import SIGTERM_EXIT_CODE
from tests.scripts.fault_run import ACCUMULATE, EVENT_STEP, MAX_STEPS, SLOW_TIMEOUT_S, Net, batch


def newest_save(root: Path, publishkill: bool = False) -> Path | None:
    """The save an agreed signal made (``signal-N``), else ``last`` (``publishkill`` cells), else the
    newest periodic one (``step-N``)."""
    if publishkill and not list(root.glob("signal-*")):
        return root / "last"
    for pattern in ("signal-*", "step-*"):
        saves = [p for p in root.glob(pattern) if (p / "meta.json").exists()]
        if saves:
            return max(saves, key=lambda p: int(p.name.rpartition("-")[2]))
    return None


class Captured(Logger):
    """What ``fabric.log_dict`` hands the loggers: (step, metric names, tokens/s x step time)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, list[str], float]] = []

    name = "captured"  # type: ignore[assignment]
    version = 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        tokens = metrics.get("zero/tokens_per_s", 0.0) * metrics.get("zero/step_time_s", 0.0)
        self.logged.append((int(step or 0), sorted(metrics), tokens))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def run_fabric(cell: Any, root: Path, mode: str, fault: Any, result: dict) -> None:
    strategy = ZeroFabricStrategy(stage=int(cell.strategy[-1]), bucket_mb=0.002,
                                  async_checkpoint=cell.moment == "asyncsave",
                                  collective_timeout=SLOW_TIMEOUT_S if cell.event == "slow" else None)  # fmt: skip
    captured = Captured()
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["SLURM_NTASKS"]), strategy=strategy,
                      loggers=[captured])  # fmt: skip
    fabric.launch()
    fabric.strategy.report_to(fabric)  # the monitor's metrics through fabric.log_dict, every step
    result["logged"] = captured.logged
    torch.manual_seed(0)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    result.update(resumed_from=None, losses={}, agreed=[], exchanges=0)
    fault.wait_for_save = fabric.strategy.checkpoints.wait
    if mode == "resume":
        found = newest_save(root, publishkill=cell.event == "publishkill")
        result["resumed_from"] = found.name if found is not None else "start"
        if found is not None:
            fabric.load(found, state)
    saved = {int(p.name.rpartition("-")[2]) for p in root.glob("step-*")}
    try:
        for step in range(state["step"] + 1, MAX_STEPS + 1):
            for micro in range(ACCUMULATE):
                fault.poll(step)
                if step == EVENT_STEP and micro == 0:
                    fault.at("accum")
                x, y = batch(step, micro, fabric.global_rank)
                with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                    loss = nn.functional.cross_entropy(model(x), y)
                    fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            result["losses"][str(step)] = float(loss)
            state["step"] = step
            if step % 2 == 0 and step not in saved:
                fault.save_begins(root / f"step-{step}")
                fabric.save(root / f"step-{step}", state)
                if cell.event == "publishkill":
                    fabric.save(root / "last", state)
                saved.add(step)
            agreed = fabric.strategy.scheduler_signals()
            if agreed is None:
                continue
            result["agreed"].append({"requeue": agreed.requeue, "terminate": agreed.terminate, "at": agreed.agreed_at})
            fabric.save(root / f"signal-{step}", state)  # what the requeued job resumes from
            if agreed.requeue:
                fabric.strategy.requeue()
            if agreed.terminate:
                raise SystemExit(SIGTERM_EXIT_CODE)
    except SystemExit:
        raise
    except BaseException as exception:
        fabric.strategy.note_failure(exception)  # a loop that catches its exceptions posts them
        raise
    finally:
        result["exchanges"] = fabric.strategy.signals.exchanges
        result["comm"] = fabric.strategy.session.comm_counter.snapshot()
        if not fabric.strategy.failed:
            fabric.strategy.teardown()
        if mode == "fault":
            result["published"] = [p.name for p in sorted(root.iterdir()) if (p / "meta.json").exists()]
