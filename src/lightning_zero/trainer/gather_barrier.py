"""Lightning glue: parameters are whole before user code between steps reads them.

[Note: parameter reads between steps] With ``overlap_param_gather`` (stages 1-2) the parameter
all-gather of an optimizer step is still in flight after the step returns; the engine waits for
it in the next forward ([Note: overlapped parameter gather] in ``zero/param_gather.py``). Lightning
runs user code in between: every callback's ``on_train_batch_end`` (an EMA of the weights, a
weight histogram, a sample generated from the model), then the LightningModule's. Reading
parameters there would see other ranks' chunks from before the step, silently.

:class:`ParamGatherBarrier` is put first in ``trainer.callbacks`` by the strategy. At fit start it
decides whether anything can read parameters between steps: a callback or LightningModule that
overrides ``on_train_batch_end`` / ``on_train_batch_start``, unless it is one of Lightning's own
callbacks that only read metrics (progress bars, checkpointing, LR/throughput monitors, ...) or
declares ``reads_parameters_between_steps = False``. If so, it waits for every pending gather in
``on_train_batch_end`` (before any other callback runs): correct values, and the overlap shrinks
to nothing for that run. If not, the gathers stay in flight into the next forward. It also waits
before any callback's ``on_train_end`` and evaluation-loop start hooks, which run before the
strategy's own.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch import callbacks as lightning_callbacks

# Lightning's callbacks that read metrics or save through the strategy (which waits), never raw weights.
METRICS_ONLY_NAMES = (
    "EarlyStopping LearningRateMonitor ModelCheckpoint ModelSummary ProgressBar ThroughputMonitor Timer"
)
METRICS_ONLY_CALLBACKS: tuple[type, ...] = tuple(
    getattr(lightning_callbacks, name) for name in METRICS_ONLY_NAMES.split()
)
BETWEEN_STEP_HOOKS = ("on_train_batch_end", "on_train_batch_start")


def _overrides(obj: Any, base: type) -> bool:
    return any(getattr(type(obj), hook, None) is not getattr(base, hook) for hook in BETWEEN_STEP_HOOKS)


def reads_parameters_between_steps(callback: Callback) -> bool:
    """Whether ``callback`` may read parameters between an optimizer step and the next forward."""
    declared = getattr(callback, "reads_parameters_between_steps", None)
    if declared is not None:
        return bool(declared)
    if isinstance(callback, METRICS_ONLY_CALLBACKS):
        return False
    return _overrides(callback, Callback)


class ParamGatherBarrier(Callback):
    """Waits for in-flight parameter all-gathers before user hooks can read parameters."""

    reads_parameters_between_steps = False

    def __init__(self, wait: Callable[[], None]) -> None:
        self.wait = wait
        self.guards_batch_end = False
        self.readers: list[str] = []

    def on_fit_start(self, trainer: Any, pl_module: LightningModule) -> None:
        self.readers = [
            type(callback).__name__
            for callback in trainer.callbacks
            if callback is not self and reads_parameters_between_steps(callback)
        ]
        if getattr(pl_module, "reads_parameters_between_steps", True) and _overrides(pl_module, LightningModule):
            self.readers.append(type(pl_module).__name__)
        self.guards_batch_end = bool(self.readers)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.guards_batch_end:
            self.wait()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.wait()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.wait()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self.wait()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self.wait()
