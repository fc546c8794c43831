"""The Trainer door of [Note: signals as events] and [Note: signal boundaries] (``runtime/signals.py``).

Lightning glue only; the agreement, the boundaries and what they decide live in ``runtime/``:

- :class:`ZeroSignalConnector` replaces the Trainer's ``_SignalConnector`` in every entry point
  (``fit``, ``validate``, ``test``, ``predict``): Lightning's handlers save a checkpoint (the SLURM
  requeue signal) or broadcast (SIGTERM) from inside the handler (Lightning issue 21406; outside
  ``fit`` that broadcast hung a run); ours only record.
- :class:`SchedulerSignals`, a callback, tells the boundary where the loop is (the end of a
  training batch, of an evaluation batch, of an evaluation loop, of ``fit``) and acts on what the
  ranks agreed:

  - the requeue signal (``SLURMEnvironment(auto_requeue=True)``, its ``requeue_signal``, SIGUSR1 by
    default) in ``fit``: every rank saves ``<default_root_dir>/hpc_ckpt_<N>.ckpt``, the path
    Lightning's own handler writes and resumes from (``ckpt_path=None`` under SLURM finds the
    newest), rank 0 runs ``scontrol requeue <job>``, and training goes on until the scheduler ends
    the job, as under Lightning. Outside ``fit``: rank 0 requeues, every rank exits with 138
    (:class:`AgreedRequeue`, ``128 + signal``);
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
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import distributed as dist

from lightning_zero.runtime.failure import note_failure, open_failure_channel
from lightning_zero.runtime.signals import (
    SIGTERM_EXIT_CODE,
    AgreedSignals,
    AgreedStop,
    SignalAgreement,
    SignalBoundary,
    fewest_exchange,
    requeue_exit_code,
    requeue_slurm_job,
)
from lightning_zero.trainer._lightning_compat import install_signal_connector, is_accumulating, signal_connector
from lightning_zero.zero.waits import PeerFailedError

if TYPE_CHECKING:
    from lightning_zero.zero.waits import FailureChannel

log = logging.getLogger(__name__)

__all__ = ["SIGTERM_EXIT_CODE", "AgreedRequeue", "AgreedSigterm", "SchedulerSignals", "ZeroSignalConnector"]


class AgreedSigterm(AgreedStop, SIGTERMException):
    """Every rank agreed on a SIGTERM at the same boundary and exits (code 143)."""

    def __init__(self, detail: str) -> None:
        AgreedStop.__init__(self, SIGTERM_EXIT_CODE, detail)


class AgreedRequeue(AgreedStop):
    """Outside ``fit``: every rank agreed on the requeue signal, rank 0 requeued the job, and every
    rank exits with ``128 + signal`` (138 for SIGUSR1): nothing to save, and the rest of the loop
    would not end before the scheduler does."""


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
        # a SIGTERM after the last boundary is raised again, not swallowed ([Note: signal boundaries])
        self.agreement.uninstall(deliver_pending=True)
        super().teardown()


class SchedulerSignals(Callback):
    """The Trainer's side of [Note: signal boundaries] (see the module docstring).

    ``events`` lists what was agreed, in order (:class:`~lightning_zero.runtime.signals.AgreedSignals`);
    ``exchanges`` counts the boundaries that needed an all-reduce of their own (no phase marker
    carried the flags: ddp, ``tp > 1``, evaluation batches).
    """

    # Its hooks read flags, not parameters: without this the gather barrier would wait for every
    # overlapped parameter gather after each step ([Note: parameter reads between steps] in
    # trainer/gather_barrier.py). The hpc save it makes goes through save_checkpoint, which waits
    # for the gathers itself.
    reads_parameters_between_steps = False

    def __init__(self, boundary: Optional[SignalBoundary] = None) -> None:
        self.boundary = boundary if boundary is not None else SignalBoundary()
        self.closes_eval_loops = False  # ZeroStrategy closes them (after stage 3's ranks served each other)
        self._channel: Optional["FailureChannel"] = None  # under a strategy without one ([Note: exchanges under ddp])

    @property
    def agreement(self) -> SignalAgreement:
        return self.boundary.agreement

    @property
    def events(self) -> list[AgreedSignals]:
        return self.boundary.events

    @property
    def exchanges(self) -> int:
        return self.boundary.exchanges

    def attach(self, trainer: Any, *, engine: Any = None, markers_cover_world: bool = False) -> None:
        """Install the connector; with ``engine``, let the flags ride on its phase markers
        (``markers_cover_world``: they run over every rank, i.e. ``tp == 1``)."""
        connector = signal_connector(trainer)
        if not (isinstance(connector, ZeroSignalConnector) and connector.agreement is self.agreement):
            install_signal_connector(trainer, ZeroSignalConnector(trainer, self.agreement))
        if engine is not None:
            self.boundary.ride(engine, markers_cover_world=markers_cover_world)
        else:
            self.boundary.forget_engine()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.attach(
            trainer
        )  # every entry point; ZeroStrategy attaches again with its engine (strategy.setup runs later)
        if not hasattr(trainer.strategy, "failure_channel") and dist.is_initialized() and dist.get_world_size() > 1:
            self._channel = open_failure_channel(self._channel)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- training --------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        agreed = self.boundary.at_step(accumulating=_accumulating(trainer), exchange=lambda: self._exchange(trainer))
        if agreed is not None:
            self._act(trainer, agreed, where=f"after step {trainer.global_step}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        agreed = self.boundary.at_end(lambda: self._exchange(trainer, "the end of fit"))
        if agreed is not None:
            self._act(trainer, agreed, where=f"at the end of fit (step {trainer.global_step})", keep_requeue=True)
        self.boundary.release_kept()  # no step left to save at: the next entry point acts on it

    # -- evaluation ([Note: signal boundaries]: each batch every rank has, then the loop's end) --
    def _start_eval(self, trainer: Any, counts: Any) -> None:
        strategy = trainer.strategy
        self._exchange(trainer)  # the waiter, if there is no engine's
        waiter = self.boundary.waiter
        assert waiter is not None
        fewest = fewest_exchange(strategy.root_device, waiter, counter=self.boundary.counter)
        self.boundary.start_eval([float(count) for count in counts], fewest)

    def _eval_batch_end(self, trainer: Any, batch_idx: int, dataloader_idx: int) -> None:
        if trainer.sanity_checking:
            return
        where = f"the end of evaluation batch {batch_idx}"
        agreed = self.boundary.at_eval_batch(batch_idx, dataloader_idx, lambda: self._exchange(trainer, where))
        if agreed is not None:
            self._act(trainer, agreed, where=f"in {where}", keep_requeue=trainer.state.fn == TrainerFn.FITTING)

    def end_eval_loop(self, trainer: Any) -> None:
        """Every rank ended its evaluation loop: one exchange ([Note: signal boundaries])."""
        if trainer.sanity_checking:
            return
        agreed = self.boundary.at_end(lambda: self._exchange(trainer, "the end of an evaluation loop"))
        if agreed is not None:
            self._act(trainer, agreed, where="at the end of an evaluation loop",
                      keep_requeue=trainer.state.fn == TrainerFn.FITTING)  # fmt: skip

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._start_eval(trainer, trainer.num_val_batches)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_eval(trainer, trainer.num_test_batches)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_eval(trainer, trainer.num_predict_batches)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:  # fmt: skip
        self._eval_batch_end(trainer, batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:  # fmt: skip
        self._eval_batch_end(trainer, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:  # fmt: skip
        self._eval_batch_end(trainer, batch_idx, dataloader_idx)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.closes_eval_loops:
            self.end_eval_loop(trainer)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.closes_eval_loops:
            self.end_eval_loop(trainer)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.closes_eval_loops:
            self.end_eval_loop(trainer)

    # -- acting on what was agreed ---------------------------------------------------------------
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """[Note: exchanges under ddp] Under ZeRO a rank that fails tells its peers through the
        strategy's failure channel, and a peer waiting in an exchange of this callback raises
        ``PeerFailedError`` within seconds. Lightning's ``ddp`` has no such channel, and an exception
        on one rank in an evaluation loop (``predict`` / ``validate`` / ``test``, or the validation
        inside ``fit``) left the other rank waiting in that batch's exchange while the failing rank
        sat in ``OnExceptionCheckpoint``'s barrier: a hang until the process group's timeout (the
        fault matrix's ddp ``val`` and ``fitpredict`` cells). So under a strategy without a failure
        channel this callback opens one of its own, and a rank that fails in an evaluation loop
        posts its error, then issues the one exchange its peers wait in (every rank owes exactly
        one: the batch's or the loop's end). A peer reads the channel right after each of its
        exchanges (one store read per evaluation batch, ddp only) and raises ``PeerFailedError``;
        then every rank meets in ``OnExceptionCheckpoint``'s barrier with no collective pending.
        Lightning orders checkpoint callbacks last, so this runs before any of them. An exception
        in training still hangs ddp in DDP's own gradient all-reduce, as without this callback."""
        if self._channel is not None and not isinstance(exception, AgreedStop):
            note_failure(self._channel, exception, f"{trainer.state.fn}")
            evaluating = trainer.validating or trainer.testing or trainer.predicting
            if evaluating and not trainer.sanity_checking and not isinstance(exception, PeerFailedError):
                try:
                    self._exchange(trainer, "a failure in evaluation")([0, 0])
                except Exception:  # noqa: BLE001 - a peer already gone: nothing is owed any more
                    pass
        note = self.agreement.pending()
        if note and not isinstance(exception, AgreedStop) and hasattr(exception, "add_note"):
            exception.add_note(f"lightning_zero: this rank was handling {note} (not yet agreed by every rank)")

    def _act(self, trainer: Any, agreed: AgreedSignals, *, where: str, keep_requeue: bool = False) -> None:
        log.info(f"lightning_zero (global rank {trainer.global_rank}): agreed on {agreed.describe()} {where}")
        detail = f"every rank agreed on {agreed.describe()} {where}"
        fitting = trainer.state.fn == TrainerFn.FITTING
        if agreed.requeue and fitting and keep_requeue:
            self.boundary.keep_requeue(agreed)  # a checkpoint belongs to an optimizer step: the next one
        elif agreed.requeue and fitting:
            self._save_and_requeue(trainer)
        if agreed.terminate:
            trainer._signal_connector.received_sigterm = True
            raise AgreedSigterm(detail)
        if agreed.requeue and not fitting:
            if trainer.is_global_zero:
                requeue_slurm_job()
            raise AgreedRequeue(requeue_exit_code(self.agreement.requeue_signal), detail)

    def _exchange(self, trainer: Any, where: Optional[str] = None) -> Any:
        strategy = trainer.strategy
        text = where or f"the end of training batch {trainer.global_step}"
        failure = getattr(strategy, "failure_channel", None) or self._channel
        exchange = self.boundary.exchange(strategy.root_device, failure=failure, where=lambda: text)
        channel = self._channel
        if channel is None:
            return exchange

        def checked(values: list[int]) -> list[int]:  # [Note: exchanges under ddp]
            agreed = exchange(values)
            error = channel.read_now()
            if error is not None and not channel.posted:
                raise error
            return agreed

        return checked

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
        return is_accumulating(trainer)
    except AttributeError:  # another Lightning: agree at every batch
        return False


def attach_scheduler_signals(
    trainer: Any, *, engine: Any, markers_cover_world: bool, boundary: Optional[SignalBoundary] = None
) -> SchedulerSignals:
    """``ZeroStrategy.setup``: the :class:`SchedulerSignals` boundary (added over ``boundary``, the
    run's, if the user did not add one)."""
    callback = next((cb for cb in trainer.callbacks if isinstance(cb, SchedulerSignals)), None)
    if callback is None:
        callback = SchedulerSignals(boundary)
        trainer.callbacks.append(callback)
    callback.attach(trainer, engine=engine, markers_cover_world=markers_cover_world)
    return callback
