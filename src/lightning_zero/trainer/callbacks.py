"""What ``ZeroStrategy.setup`` puts into ``trainer.callbacks``: the Lightning side of the run's events.

Lightning reaches a strategy through its hooks, and reaches everything else through callbacks. The
run (``runtime/run.py``, [Note: one runtime object]) owns the monitor, the signals' boundary, the
failure channel and the checkpoint lifecycle; these callbacks are how the Trainer's loop tells it
when: :class:`~lightning_zero.trainer.failure_path.FailureNotice` first of all (a failure is posted
before any other ``on_exception`` runs), :class:`~lightning_zero.trainer.gather_barrier.ParamGatherBarrier`
first among the rest when parameter gathers overlap the next step, the monitor's
:class:`~lightning_zero.trainer.monitor.ZeroMonitor` (when ``monitor=True``) and the scheduler
signals' :class:`~lightning_zero.trainer.signals.SchedulerSignals` (every entry point).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lightning_zero.trainer.failure_path import FailureNotice
from lightning_zero.trainer.signals import SchedulerSignals, attach_scheduler_signals

if TYPE_CHECKING:
    from lightning_zero.runtime.run import ZeroRun


def _first(trainer: Any, callback: Any) -> None:
    """``callback`` first in ``trainer.callbacks``, any earlier one of its class removed."""
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, type(callback))]
    trainer.callbacks.insert(0, callback)


def install_callbacks(trainer: Any, run: "ZeroRun", note_failure: Callable[[BaseException], None],
                      barrier: Callable[[], None], *, fitting: bool) -> SchedulerSignals:  # fmt: skip
    """The callbacks of one entry point (``fitting``: ``trainer.fit``, which also opens the checkpoint
    lifecycle: leftovers cleaned with ``barrier``, links routed); returns the signals' callback."""
    engine = run.engine
    if fitting and run.monitor is not None:
        from lightning_zero.trainer.monitor import ZeroMonitor

        monitor = next((cb for cb in trainer.callbacks if isinstance(cb, ZeroMonitor)), None)
        if monitor is None:
            monitor = ZeroMonitor()
            monitor.monitor = run.monitor
            trainer.callbacks.append(monitor)
        run.monitor = monitor.monitor  # the user's own (its hardware, its threshold) when given
    if fitting and engine is not None and engine.param_gatherer is not None:
        from lightning_zero.trainer.gather_barrier import ParamGatherBarrier

        # first, so no user hook between steps reads parameters still being gathered
        _first(trainer, ParamGatherBarrier(run.wait_param_gathers))
    _first(trainer, FailureNotice(note_failure))  # first of all: posted before any other on_exception hook
    # [Note: signal boundaries] in runtime/signals.py: every entry point, not only fit
    covers_world = run.session.dense_size(trainer.world_size) == trainer.world_size  # the phase markers' ranks
    signals = attach_scheduler_signals(trainer, engine=engine, markers_cover_world=covers_world, boundary=run.signals)
    run.signals = signals.boundary  # the user's callback's, when given
    signals.closes_eval_loops = True  # after stage 3's ranks served each other (ZeroStrategy._end_eval_loop)
    if fitting:  # [Note: checkpoint lifecycle] in runtime/checkpoints.py
        from lightning_zero.trainer.checkpoints import checkpoint_directories, route_links

        route_links(trainer, run.checkpoints)
        run.open_checkpoints(checkpoint_directories(trainer), barrier)
    return signals
