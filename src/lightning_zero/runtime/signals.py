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
"""

from __future__ import annotations

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

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

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
