"""The Trainer door of [Note: signals as events] (``runtime/signals.py``): Lightning glue.

- :class:`ZeroSignalConnector` replaces the Trainer's ``_SignalConnector``, whose handlers save a
  checkpoint (the SLURM requeue signal) or broadcast (SIGTERM) from inside the handler (Lightning
  issue 21406): ours only record.
- :class:`SchedulerSignals`, a callback, is the boundary: at the end of every training batch (the
  last micro batch of an accumulation) the ranks agree, then act together:

  - the requeue signal (``SLURMEnvironment(auto_requeue=True)``, its ``requeue_signal``, SIGUSR1 by
    default): every rank saves ``<default_root_dir>/hpc_ckpt_<N>.ckpt``, the path Lightning's
    own handler writes and resumes from (``ckpt_path=None`` under SLURM finds the newest), rank 0
    runs ``scontrol requeue <job>``, and training goes on until the scheduler ends the job, as
    under Lightning;
  - SIGTERM: every rank raises :class:`AgreedSigterm` (a ``SIGTERMException``, exit code 143) at
    the same boundary. It is not a failure: every ``on_exception`` hook may still use the other
    ranks, so ``OnExceptionCheckpoint`` / ``ModelCheckpoint(save_on_exception=True)`` save a
    consistent checkpoint before the exit (that is how to ask for a save on SIGTERM).

``ZeroStrategy`` adds the callback itself and lets the flags ride on its phase markers; add it to a
``ddp`` (or any) Trainer to get the same protocol there (one 8-byte all-reduce per batch).
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_zero.config import ZERO_DEFAULTS
from lightning_zero.runtime.signals import AgreedSignals, SignalAgreement, requeue_slurm_job, world_exchange
from lightning_zero.zero.waits import Waiter

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class AgreedSigterm(SIGTERMException):
    """Every rank agreed on a SIGTERM at the same step boundary and exits (code 143)."""

    def __init__(self, detail: str) -> None:
        super().__init__(SIGTERM_EXIT_CODE)
        self.detail = detail


class ZeroSignalConnector(_SignalConnector):
    """Lightning's signal connector with handlers that only record ([Note: signals as events])."""

    def __init__(self, trainer: Any, agreement: SignalAgreement) -> None:
        super().__init__(trainer)
        self.agreement = agreement
        self._forwarded = False

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        environment = self.trainer._accelerator_connector.cluster_environment
        requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self.agreement.requeue_signal = environment.requeue_signal if requeue else None
        self.agreement.on_signal = [self._forward_sigterm]
        self.agreement.install()

    def _forward_sigterm(self, signum: int) -> None:
        """Inside the handler: the processes Lightning's launcher started get it too (``os.kill``)."""
        if signum != signal.SIGTERM or self._forwarded:
            return
        self._forwarded = True
        launcher = self.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signum)

    def teardown(self) -> None:
        self.agreement.uninstall()
        super().teardown()


class SchedulerSignals(Callback):
    """The step boundary of [Note: signals as events] for the Trainer (see the module docstring).

    ``events`` lists what was agreed, in order (:class:`~lightning_zero.runtime.signals.AgreedSignals`);
    ``exchanges`` counts the boundaries that needed an all-reduce of their own (no phase marker
    carried the flags: ddp, ``tp > 1``).
    """

    # Its on_train_batch_end reads flags, not parameters: without this the gather barrier would
    # wait for every overlapped parameter gather after each step ([Note: parameter reads between
    # steps] in trainer/gather_barrier.py). The hpc save it makes goes through save_checkpoint,
    # which waits for the gathers itself.
    reads_parameters_between_steps = False

    def __init__(self) -> None:
        self.agreement = SignalAgreement()
        self.events: list[AgreedSignals] = []
        self.exchanges = 0
        self._markers_cover_world = False
        self._waiter: Optional[Waiter] = None
        self._counter: Any = None

    def attach(self, trainer: Any, *, engine: Any = None, markers_cover_world: bool = False) -> None:
        """Install the connector; with ``engine``, let the flags ride on its phase markers
        (``markers_cover_world``: they run over every rank, i.e. ``tp == 1``)."""
        connector = trainer._signal_connector
        if not (isinstance(connector, ZeroSignalConnector) and connector.agreement is self.agreement):
            trainer._signal_connector = ZeroSignalConnector(trainer, self.agreement)
        if engine is not None:
            engine.ride_phase_markers(self.agreement)
            self._waiter, self._counter = engine.waiter, engine.counter
        self._markers_cover_world = engine is not None and markers_cover_world

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.attach(trainer)  # ZeroStrategy attaches again with its engine (strategy.setup runs later)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        riding = self._markers_cover_world and self.agreement.rode
        if not riding and _accumulating(trainer):
            return  # a non-final micro batch: the boundary is the optimizer step's batch
        exchange = None if riding else self._exchange(trainer)
        self.exchanges += exchange is not None
        agreed = self.agreement.boundary(exchange)
        if agreed is None:
            return
        self.events.append(agreed)
        log.info(f"lightning_zero (global rank {trainer.global_rank}): agreed on {agreed.describe()}")
        if agreed.requeue:
            self._save_and_requeue(trainer)
        if agreed.terminate:
            trainer._signal_connector.received_sigterm = True
            raise AgreedSigterm(f"every rank agreed on {agreed.describe()} after step {trainer.global_step}")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        note = self.agreement.pending()
        if note and not isinstance(exception, AgreedSigterm) and hasattr(exception, "add_note"):
            exception.add_note(f"lightning_zero: this rank was handling {note} (not yet agreed by every rank)")

    def _exchange(self, trainer: Any) -> Any:
        strategy = trainer.strategy
        if self._waiter is None:
            self._waiter = Waiter(ZERO_DEFAULTS.collective_timeout, poll=strategy.root_device.type == "cpu",
                                  failure=getattr(strategy, "failure_channel", None))  # fmt: skip
        return world_exchange(
            self.agreement, strategy.root_device, self._waiter, counter=self._counter,
            where=lambda: f"the end of training batch {trainer.global_step}",
        )  # fmt: skip

    def _save_and_requeue(self, trainer: Any) -> None:
        """Every rank: the hpc checkpoint Lightning would save; rank 0: ``scontrol requeue``."""
        path = None
        if trainer.is_global_zero:
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        path = trainer.strategy.broadcast(path)  # one name, whatever each rank's view of the directory
        for logger in trainer.loggers:
            logger.save()
        trainer.save_checkpoint(path)
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:
            wait()  # a background save is published before the scheduler may end the job
        if trainer.is_global_zero:
            requeue_slurm_job()


def _accumulating(trainer: Any) -> bool:
    """A non-final micro batch of ``accumulate_grad_batches`` (the same answer on every rank)."""
    try:
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())
    except AttributeError:  # another Lightning: agree at every batch
        return False


def attach_scheduler_signals(trainer: Any, *, engine: Any, markers_cover_world: bool) -> SchedulerSignals:
    """``ZeroStrategy.setup``: the :class:`SchedulerSignals` boundary (added if the user did not)."""
    callback = next((cb for cb in trainer.callbacks if isinstance(cb, SchedulerSignals)), None)
    if callback is None:
        callback = SchedulerSignals()
        trainer.callbacks.append(callback)
    callback.attach(trainer, engine=engine, markers_cover_world=markers_cover_world)
    return callback
