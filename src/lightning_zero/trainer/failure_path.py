"""The Trainer door's part of the failure path (Lightning glue); the rest is ``runtime/failure.py``.

[Note: failure path] is written once, in ``runtime/failure.py``. Under the Trainer, Lightning
handles an exception of ``fit``/``validate`` in one place (``_call_and_handle_interrupt``): every
callback's ``on_exception`` (ModelCheckpoint's save-on-exception among them), the strategy's
``on_exception``, the loggers, then the strategy's ``teardown``, and it re-raises. The strategy
learns of the failure first: in ``training_step``/``validation_step`` (the exception passes
through the strategy) and in the ``on_exception`` of :class:`FailureNotice`, the first callback,
before ModelCheckpoint's. :func:`where` names the place in the loop's words.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import Callback

from lightning_zero.runtime import failure
from lightning_zero.runtime.failure import is_collective_error, open_failure_channel, warn_failed
from lightning_zero.zero.waits import FailureChannel

__all__ = [
    "FailureNotice",
    "check_step_output",
    "is_collective_error",
    "note_failure",
    "open_failure_channel",
    "warn_failed",
    "where",
]


def where(trainer: Any) -> str:
    """Where a failure happened, in the loop's words ("training step 3", "validation")."""
    if trainer is None:
        return "setup"
    if trainer.training:
        return f"training step {trainer.global_step + 1}"
    stage = getattr(trainer.state.stage, "value", None)
    return f"{stage} (after training step {trainer.global_step})" if stage else "setup"


def note_failure(channel: Optional[FailureChannel], exception: BaseException, trainer: Any) -> None:
    """Step 1 of [Note: failure path] for ``exception`` raised on this rank under ``trainer``."""
    failure.note_failure(channel, exception, where(trainer))


class FailureNotice(Callback):
    """First in ``trainer.callbacks``: tells the strategy of a failure before any other
    ``on_exception`` hook (ModelCheckpoint's save) runs ([Note: failure path])."""

    def __init__(self, notice: Callable[[BaseException], None]) -> None:
        self.notice = notice

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.notice(exception)


def check_step_output(output: Any, module: Any, *, world_size: int, global_rank: int) -> None:
    """A ``training_step`` that returns no loss makes Lightning skip this rank's backward and
    optimizer step; its peers would wait for this rank's reduce-scatters forever. Raise now
    (the failure path ends every rank within seconds) with the fix."""
    if world_size == 1 or module is None or not module.automatic_optimization:
        return
    loss = output.get("loss") if isinstance(output, dict) else output
    if loss is None:
        raise RuntimeError(
            f"lightning_zero: training_step returned no loss on global rank {global_rank} at step"
            f" {module.trainer.global_step + 1}. Lightning then skips this rank's backward and optimizer"
            " step, while the other ranks wait in that step's gradient collectives. Under ZeroStrategy"
            " every rank must take part in every step: to skip a batch, return a zero loss on every rank"
            " that needs it (e.g. `return loss * 0`)."
        )
