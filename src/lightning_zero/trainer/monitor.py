"""ZeroMonitor: the Trainer door of the run's monitor ([Note: the monitor] in ``runtime/monitor.py``).

On by default with :class:`~lightning_zero.ZeroStrategy` (``ZeroStrategy(monitor=False)`` turns it
off). Per optimizer step it logs the runtime monitor's metrics (listed in ``runtime/monitor.py``)
to the Trainer's loggers (rank 0's values; every rank computes its own; with
``Trainer(logger=False)`` it keeps them in ``history`` only), warns once (on global rank 0,
through Lightning's ``rank_zero_warn``) when the gradient collectives cannot or did not overlap,
and logs a summary table when fit ends (``rank_zero_info``). Lightning glue only: what is
measured, and how, lives in ``runtime/monitor.py``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_zero.runtime.monitor import Monitor, peak_memory_bytes, predicted_bytes
from lightning_zero.runtime.throughput import ThroughputMeter
from lightning_zero.trainer._lightning_compat import is_accumulating

__all__ = ["ZeroMonitor", "peak_memory_bytes", "predicted_bytes"]


class ZeroMonitor(Callback):
    """Logs measured vs predicted bytes, bytes sent, overlap and throughput per optimizer step.

    Args:
        warn_overlap_below: warn once when overlap was requested and the hidden fraction of
            collective time is below this.
        summary: print a table at the end of fit (rank 0).
        hardware: the ``conf/hardware`` config name (or YAML path, or mapping) whose peak FLOP/s
            MFU is measured against; ``None``: detected from the CUDA device's name (H100, H200,
            A100), no MFU on CPU.
    """

    reads_parameters_between_steps = False  # bytes and timings only ([Note: parameter reads between steps])

    def __init__(self, warn_overlap_below: float = 0.5, summary: bool = True, hardware: Optional[Any] = None) -> None:
        self.monitor = Monitor(warn_overlap_below=warn_overlap_below, hardware=hardware)
        self.summary = summary

    @property
    def history(self) -> list[dict[str, float]]:
        return self.monitor.history

    @history.setter
    def history(self, history: list[dict[str, float]]) -> None:
        self.monitor.history = history

    @property
    def throughput(self) -> Optional[ThroughputMeter]:
        return self.monitor.throughput

    @throughput.setter
    def throughput(self, meter: Optional[ThroughputMeter]) -> None:
        self.monitor.throughput = meter

    def _engine(self, trainer: Any) -> Optional[Any]:
        return getattr(trainer.strategy, "engine", None)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine(trainer)
        if engine is not None:
            dims = getattr(getattr(trainer.strategy, "session", None), "dims", None)  # the layout: dp, cp, tp
            self.monitor.micro_batch(engine, pl_module, batch, dims=dims)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine(trainer)
        if engine is None or is_accumulating(trainer):
            return
        metrics = self.monitor.step_end(engine, pl_module)
        if trainer.loggers:  # Trainer(logger=False): history only (Lightning warns once per metric otherwise)
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True, logger=True)
        self._maybe_warn_overlap(engine, metrics, metrics["zero/comm_s"], trainer.global_step)

    def _maybe_warn_overlap(self, engine: Any, metrics: dict[str, float], comm: float, step: int) -> None:
        message = self.monitor.overlap_warning(engine, metrics, comm, step)
        if message is not None:
            rank_zero_warn(message)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        lines = self.monitor.summary_lines() if self.summary else []
        if lines:
            rank_zero_info("\n".join(lines))
