"""Scheduler signals as events: a handler that only records, an agreement at a step boundary.

[Note: signals as events] A Python signal handler runs between two bytecodes of whatever the main
thread is doing: inside backward, inside a collective's wait, inside a checkpoint save. Anything
that talks to other ranks from there (Lightning's ``_SignalConnector`` saves, or broadcasts, from
inside its handler: Lightning issue 21406) meets the other ranks' step collectives and hangs. So:

1. The handler (:meth:`SignalAgreement._on_signal`) records the signal and the time, nothing more
   (and forwards SIGTERM to the processes this one started, as Lightning does: ``os.kill`` only).
2. The ranks learn of it together at a step boundary every rank reaches in the same order. The
   flags ride on the phase markers the step exchanges anyway ([Note: marker riders] in
   ``zero/agreements.py``): two int32 slots on each marker, MAX over dp, so ``2 * 8 = 16`` bytes
   per optimizer step and no latency of their own. Where no marker covers every rank in a batch
   (plain ``ddp``, ``tp > 1`` where the markers run over dp only, an engine-less run), one 8-byte
   all-reduce (MAX) over the world per training batch does it (:func:`world_exchange`), waited on
   under ``collective_timeout`` and the failure channel like every engine wait: a rank that never
   reaches the boundary ends the others with an error that says which signal was being handled.
3. Then every rank acts on the same agreed flags at the same boundary: the requeue signal saves a
   checkpoint (collectively) and rank 0 requeues the job; SIGTERM exits every rank (the Trainer
   door: ``trainer/signals.py``).

A signal that arrives after this rank's contribution to a batch's exchange rides the next one: the
agreement is at most one step late, never inconsistent.

[Note: signal boundaries] Where the ranks agree (:class:`SignalBoundary`, the one owner of the
agreement for both doors; the Trainer's callback and the Fabric strategy only feed it):

- training: the end of an optimizer step, never a micro batch that only accumulates. The flags
  that rode on the markers of the step's micro batches are kept until that boundary (under
  stages 2-3 every micro batch's backward has a marker: acting on them mid-step saved a
  checkpoint in the middle of an optimizer step, and the resume skipped the micro batches
  already run). Under Fabric the boundary is the first ``scheduler_signals()`` call after an
  optimizer step ([Note: Fabric step boundaries]).
- evaluation (``validate``, ``test``, ``predict``, and the validation inside ``fit``): the end of
  each evaluation batch, through one 8-byte all-reduce (MAX) over the world: an evaluation batch
  has no phase marker to ride on (stage 3's evaluation gathers agree among the dp ranks, but a
  rank whose loop ended serves them from the engine, where no callback runs). Ranks may have
  different numbers of batches (``predict`` does not pad): the loop's start agrees on the
  fewest any rank has (one all-reduce), only those batches end with an exchange, and one more
  exchange closes the loop once every rank ended it (after stage 3's ranks served the others).
- the end of ``fit`` (after its last validation): one exchange, so a signal that came after the
  last optimizer step is not lost.

What every rank then does, on the same agreed flags: SIGTERM exits with
:data:`SIGTERM_EXIT_CODE` (143) from any boundary; the requeue signal inside ``fit`` saves and
requeues (training goes on until the scheduler ends the job; agreed during ``fit``'s
validation it is kept for the next optimizer step, a checkpoint belongs to a step); outside
``fit`` (nothing to save) rank 0 requeues and every rank exits with ``128 + signal``
(:func:`requeue_exit_code`, 138 for SIGUSR1). A signal still unagreed when the handlers are
removed (it came after the last boundary) is raised again under the handler that was there
before, so the process ends as SIGTERM says instead of exiting 0; a pending requeue signal is
kept for the next entry point (a ``test`` after ``fit``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_reduce
from lightning_zero.zero.waits import Waiter

log = logging.getLogger(__name__)

REQUEUE, TERMINATE = 0, 1  # slots of the agreed flags
NAMES = ("the requeue signal", "SIGTERM")
SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


def requeue_exit_code(requeue_signal: Optional[int]) -> int:
    """The exit code of every rank after an agreed requeue outside ``fit``: ``128 + signal`` (138
    for SIGUSR1), as a shell reports a process that signal ended ([Note: signal boundaries])."""
    return 128 + int(requeue_signal if requeue_signal is not None else signal.SIGUSR1)


class AgreedStop(SystemExit):
    """Every rank agreed to stop at the same boundary ([Note: signal boundaries]): not a failure
    (no failure-channel post; every rank may still use the others on the way out)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code)
        self.detail = detail

    def __str__(self) -> str:
        return f"lightning_zero: exit {self.code}: {self.detail}"


@dataclass(frozen=True)
class AgreedSignals:
    """What every rank agreed on at one boundary, and when this rank had received each signal."""

    requeue: bool
    terminate: bool
    received_at: tuple[float, float]  # wall-clock time this rank received each (0.0: it had not)
    agreed_at: float  # wall-clock time of the agreement on this rank

    def describe(self) -> str:
        kinds = [name for name, on in zip(NAMES, (self.requeue, self.terminate)) if on]
        mine = [f"{NAMES[kind]} {self.agreed_at - at:.2f} s before" for kind, at in enumerate(self.received_at) if at]
        local = f" (this rank received {', '.join(mine)})" if mine else " (this rank had not received it)"
        return " and ".join(kinds) + local


class SignalAgreement:
    """[Note: signals as events]: records the requeue signal and SIGTERM, agrees on them at boundaries.

    Also a :class:`~lightning_zero.zero.agreements.MarkerRider` (``width``, ``values``,
    ``agreed``): hand it to ``ZeroEngine.ride_phase_markers`` and the flags ride on the markers.

    Args:
        requeue_signal: the scheduler's requeue signal (SLURM: SIGUSR1), or ``None``: not handled.
    """

    width = 2  # int32 slots on each phase marker: (requeue, terminate)

    def __init__(self, requeue_signal: Optional[int] = None) -> None:
        self.requeue_signal = requeue_signal
        self.received_at = [0.0, 0.0]  # wall-clock time of the first signal not yet acted on
        self.on_signal: list[Callable[[int], None]] = []  # run inside the handler: os.kill-like only
        self._agreed = [0, 0]  # MAX over the ranks of the markers since the last boundary
        self._rode = False  # a marker carried the flags since the last boundary
        self._previous: dict[int, Any] = {}  # signal -> the handler before ours

    # -- the handler -----------------------------------------------------------------------------
    def install(self) -> None:
        """Put the handler on the requeue signal (if any) and SIGTERM; the handlers there before
        are restored by :meth:`uninstall` (SIGTERM's is also still called, as Lightning does)."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python runs handlers on the main thread only; a run elsewhere keeps the defaults
        for signum in {s for s in (self.requeue_signal, signal.SIGTERM) if s is not None}:
            previous = signal.getsignal(signum)
            if previous is not self._on_signal:
                self._previous[signum] = previous
            signal.signal(signum, self._on_signal)

    def uninstall(self, *, deliver_pending: bool = False) -> None:
        """Put back the handlers that were there before. ``deliver_pending``: a SIGTERM received and
        never agreed (it came after the last boundary) is raised again under them, so the process
        ends (or its earlier handler runs) as SIGTERM says ([Note: signal boundaries]). A pending
        requeue signal stays recorded for the next entry point that installs the handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        installed = dict(self._previous)
        for signum, previous in installed.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if not deliver_pending:
            return
        if signal.SIGTERM in installed and self.received_at[TERMINATE]:
            self.received_at[TERMINATE] = 0.0
            log.warning("lightning_zero: SIGTERM came after the last boundary every rank reaches; raised again"
                        " under the handler from before")  # fmt: skip
            signal.raise_signal(signal.SIGTERM)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Record; never a collective, a save or a log line here ([Note: signals as events])."""
        kind = TERMINATE if signum == signal.SIGTERM else REQUEUE
        if not self.received_at[kind]:
            self.received_at[kind] = time.time()
        for hook in self.on_signal:
            hook(signum)
        previous = self._previous.get(signum) if signum == signal.SIGTERM else None
        if callable(previous):
            previous(signum, frame)

    def pending(self) -> Optional[str]:
        """What this rank received and has not yet acted on, in words (``None``: nothing)."""
        now = time.time()
        mine = [f"{NAMES[kind]} {now - at:.1f} s ago" for kind, at in enumerate(self.received_at) if at]
        return ", ".join(mine) or None

    # -- riding on the phase markers ([Note: marker riders] in zero/agreements.py) --------------
    def values(self) -> list[int]:
        return [1 if at else 0 for at in self.received_at]

    def agreed(self, values: list[int]) -> None:
        self._agreed = [max(mine, theirs) for mine, theirs in zip(self._agreed, values)]
        self._rode = True

    @property
    def rode(self) -> bool:
        """A phase marker carried the flags since the last boundary (the same on every rank)."""
        return self._rode

    # -- the boundary ----------------------------------------------------------------------------
    def boundary(self, exchange: Optional[Callable[[list[int]], list[int]]]) -> Optional[AgreedSignals]:
        """At a step boundary every rank reaches in the same order: the flags the markers agreed
        since the last boundary, or, with ``exchange`` (the markers did not cover every rank: see
        :func:`world_exchange`), an exchange now. Returns what every rank acts on, or ``None``.
        A signal agreed on is cleared on every rank (one scheduler signal, one action)."""
        flags = exchange(self.values()) if exchange is not None else list(self._agreed)
        self._agreed, self._rode = [0, 0], False
        if not any(flags):
            return None
        received = tuple(self.received_at)
        for kind, flag in enumerate(flags):
            if flag:
                self.received_at[kind] = 0.0
        return AgreedSignals(bool(flags[REQUEUE]), bool(flags[TERMINATE]), received, time.time())  # type: ignore[arg-type]


def world_exchange(
    agreement: SignalAgreement,
    device: torch.device,
    waiter: Waiter,
    *,
    counter: Optional[CommCounter] = None,
    where: Callable[[], str] = lambda: "a step boundary",
) -> Callable[[list[int]], list[int]]:
    """The fallback of [Note: signals as events]: one all-reduce (MAX) of the flags over the world,
    waited on by ``waiter`` (``collective_timeout``, the failure channel)."""

    def exchange(values: list[int]) -> list[int]:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return values
        flags = torch.tensor(values, dtype=torch.int32, device=device)
        work = all_reduce(
            flags, None, op=dist.ReduceOp.MAX, async_op=True, counter=counter, label="agree_signals", control=True
        )

        def describe() -> str:
            note = agreement.pending()
            handling = f"; this rank was handling {note}" if note else ""
            return f"the signal agreement at {where()} (an 8-byte all-reduce over every rank){handling}"

        waiter.wait(work, describe)
        return flags.tolist()

    return exchange


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes (an array task: ``<array job>_<task>``), as Lightning reads it."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> int:
    """``scontrol requeue <job>`` (rank 0 only), as Lightning's handler runs it; its exit code."""
    job_id = slurm_job_id()
    if job_id is None or not re.fullmatch(r"[0-9_-]+", job_id):
        log.warning(f"lightning_zero: cannot requeue: no usable SLURM job id ({job_id!r})")
        return 1
    command = ["scontrol", "requeue", job_id]
    try:
        result = subprocess.call(command)
    except FileNotFoundError:  # outside a shell context (as Lightning retries)
        result = subprocess.call(" ".join(command), shell=True)
    if result == 0:
        log.info(f"lightning_zero: requeued SLURM job {job_id}")
    else:
        log.warning(f"lightning_zero: requeuing SLURM job {job_id} failed with exit code {result}")
    return result


ALL_BATCHES = 2**30  # a loader without a length (or with more batches than this): every batch is a boundary


class SignalBoundary:
    """[Note: signal boundaries]: the one owner of the agreement, for both doors.

    The door says where it is (the end of a training batch and whether it only accumulated, the
    end of an evaluation batch, the end of an evaluation loop or of ``fit``); the boundary agrees
    there and returns what every rank acts on (:class:`AgreedSignals`), or ``None``.

    ``events`` lists what was agreed, in order; ``exchanges`` counts the optimizer-step boundaries
    that needed an all-reduce of their own (no phase marker carried the flags: ddp, ``tp > 1``);
    ``other_exchanges`` the all-reduces of the other boundaries (evaluation batches and loops, the
    end of ``fit``).
    """

    def __init__(self, agreement: Optional[SignalAgreement] = None) -> None:
        self.agreement = agreement if agreement is not None else SignalAgreement()
        self.events: list[AgreedSignals] = []
        self.exchanges = 0
        self.other_exchanges = 0
        self.waiter: Optional[Waiter] = None
        self.counter: Optional[CommCounter] = None
        self._markers_cover_world = False
        self._eval_batches: dict[int, int] = {}  # dataloader index -> batches every rank has
        self._kept_requeue: Optional[AgreedSignals] = None  # agreed in fit's validation: for the next step

    def ride(self, engine: Any, *, markers_cover_world: bool) -> None:
        """Let the flags ride on ``engine``'s phase markers ([Note: marker riders]); they stand for
        an agreement of the world when ``markers_cover_world`` (``tp == 1``)."""
        engine.ride_phase_markers(self.agreement)
        self.waiter, self.counter = engine.waiter, engine.counter
        self._markers_cover_world = markers_cover_world

    def forget_engine(self) -> None:
        self.waiter, self.counter, self._markers_cover_world = None, None, False

    def exchange(
        self, device: torch.device, *, failure: Any = None, where: Callable[[], str]
    ) -> Callable[[list[int]], list[int]]:
        """The world all-reduce of the flags (:func:`world_exchange`), waited on under the engine's
        waiter, or one with ``collective_timeout``'s default and ``failure`` (the failure channel)."""
        if self.waiter is None:
            from lightning_zero.config import ZERO_DEFAULTS

            self.waiter = Waiter(ZERO_DEFAULTS.collective_timeout, poll=device.type == "cpu", failure=failure)
        return world_exchange(self.agreement, device, self.waiter, counter=self.counter, where=where)

    # -- the boundaries --------------------------------------------------------------------------
    def at_step(
        self, *, accumulating: bool, exchange: Callable[[], Callable[[list[int]], list[int]]]
    ) -> Optional[AgreedSignals]:
        """The end of a training batch. A micro batch that only accumulates is no boundary, whatever
        its markers carried: they are kept for the step's last micro batch (issue 56, fault 1)."""
        if accumulating:
            return None
        riding = self._markers_cover_world and self.agreement.rode
        agreed = self._agree(None if riding else exchange())
        kept, self._kept_requeue = self._kept_requeue, None
        if kept is None:
            return agreed
        if agreed is None:  # the requeue kept from an evaluation boundary: every rank holds it
            agreed = AgreedSignals(True, False, kept.received_at, time.time())
            self.events.append(agreed)
            return agreed
        merged = dataclasses.replace(agreed, requeue=True)
        self.events[-1] = merged  # one event for what this boundary acts on
        return merged

    def start_eval(self, batches: list[float], fewest: Callable[[list[int]], list[int]]) -> None:
        """An evaluation loop starts with ``batches`` per dataloader on this rank; ``fewest`` (a
        collective) returns the fewest any rank has. Only those batches end with an exchange."""
        mine = [int(min(count, ALL_BATCHES)) for count in batches]
        self._eval_batches = dict(enumerate(fewest(mine))) if mine else {}

    def at_eval_batch(
        self, batch_idx: int, dataloader_idx: int, exchange: Callable[[], Callable[[list[int]], list[int]]]
    ) -> Optional[AgreedSignals]:
        """The end of an evaluation batch every rank has (see :meth:`start_eval`)."""
        if batch_idx >= self._eval_batches.get(dataloader_idx, ALL_BATCHES):
            return None
        return self._agree(exchange(), step=False)

    def at_end(self, exchange: Callable[[], Callable[[list[int]], list[int]]]) -> Optional[AgreedSignals]:
        """The end of an evaluation loop (every rank ended it) or of ``fit``: one exchange."""
        self._eval_batches = {}
        return self._agree(exchange(), step=False)

    def keep_requeue(self, agreed: AgreedSignals) -> None:
        """An agreed requeue that cannot be acted on here (``fit``'s validation: a checkpoint belongs
        to an optimizer step) is kept on every rank for the next optimizer step's boundary (or, at
        the end of ``fit``, recorded again for the next entry point: :meth:`release_kept`)."""
        if not agreed.requeue:
            return
        if self._kept_requeue is None:
            self._kept_requeue = agreed
        if self.events and self.events[-1] is agreed and not agreed.terminate:
            self.events.pop()  # listed where it is acted on

    def release_kept(self) -> None:
        """A kept requeue with no optimizer step left (``fit`` ended): recorded again as received,
        so the next entry point's first boundary agrees on it."""
        kept, self._kept_requeue = self._kept_requeue, None
        if kept is not None and not self.agreement.received_at[REQUEUE]:
            self.agreement.received_at[REQUEUE] = kept.received_at[REQUEUE] or kept.agreed_at

    def _agree(
        self, exchange: Optional[Callable[[list[int]], list[int]]], *, step: bool = True
    ) -> Optional[AgreedSignals]:
        if step:
            self.exchanges += exchange is not None
        else:
            self.other_exchanges += 1
        agreed = self.agreement.boundary(exchange)
        if agreed is not None:
            self.events.append(agreed)
        return agreed


def fewest_exchange(
    device: torch.device, waiter: Waiter, *, counter: Optional[CommCounter] = None
) -> Callable[[list[int]], list[int]]:
    """The fewest of each count over the world: one all-reduce (MAX of the negated counts)."""

    def fewest(counts: list[int]) -> list[int]:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return counts
        negated = torch.tensor([-count for count in counts], dtype=torch.int64, device=device)
        work = all_reduce(negated, None, op=dist.ReduceOp.MAX, async_op=True, counter=counter,
                          label="agree_eval_batches", control=True)  # fmt: skip
        waiter.wait(work, lambda: "the agreement on the evaluation batches every rank has (an all-reduce)")
        return [-value for value in negated.tolist()]

    return fewest
