"""Agreements that keep every rank's collectives paired, or end them with a named error.

Collectives pair up one for one, in order: a rank that issues a different one (an extra
backward's reduce-scatter where the others all-gather after their step) or none (a skipped
backward, a skipped step) makes every rank wait until ``collective_timeout``. Two cheap checks
turn that into a named error on every rank within seconds:

- :class:`PhaseMarkers`: a tiny all-reduce at the start of each phase that issues collectives,
  which also carries the used-parameter flags ([Note: parameters nobody used] in ``reducer.py``);
- :class:`StepChecks`: what a rank can tell locally (a step without a backward since the last
  one, a manual training step with neither), checked with the other ranks through the store.

[Note: phase markers] A rank that runs an extra backward in a step issues that backward's
reduce-scatters where the others issue the parameter all-gathers after their step: the ops no
longer pair up and every rank waits until ``collective_timeout``. So each phase that issues
collectives on the dp group starts with a marker, and markers are all the same all-reduce (MAX)
of ``(phase, -phase, optimizer steps, -steps, overflow, one used flag per parameter)``: markers always pair
with markers, so ranks at different phases or optimizer steps see it in the marker itself and
all raise, naming both. Two phases, two markers per optimizer step:

- a synchronizing backward launches its marker with its first bucket and waits for it before any
  bucket wait (the flags are zeros: usage is not known yet);
- each optimizer step waits for its marker right before the update, and the marker carries the
  used flags ([Note: parameters nobody used]) and, under a loss scale, this rank's overflow flag
  ([Note: global overflow] in ``optimizer.py``); whatever the step then issues (stages 1-2: the
  parameter all-gather) follows the agreed marker.

Cost: ``2 (20 + 4 R + 4 P)`` bytes and one exposed latency (the step's marker) per step, counted
in ``CommCounter.control_bytes`` (``R``: the riders' slots, [Note: marker riders]; ``P``: parameter
tensors, an expert parameter counting ``ep``: [Note: expert domain] in ``zero/domains.py``). A rank that
steps without its backward, or skips a whole manual
training step, is caught before it issues anything ([Note: a step without a backward]); ``training_step`` returning no loss is refused by the strategy.

[Note: a step without a backward] A rank that steps an optimizer with no backward since that
optimizer's last step (its manual_backward skipped) issues the post-step collectives while the
others are still in their backward's reduce-scatters: the ops no longer pair up, a hang until
collective_timeout. A rank whose manual training step returns with neither a backward nor a step
in it skipped the step: the others wait in that step's collectives while it waits in the next
step's (Lightning broadcasts one tensor at the start of every batch), and no marker is ever
exchanged. Either rank is told apart locally for free; it then checks through the store (no
collective can be trusted now) whether every rank does the same (then it is consistent and goes
on) and otherwise raises within ``STEP_AGREEMENT_S``, posting on the failure channel, so the
ranks waiting in their collectives raise within one poll.

[Note: marker riders] Something else the ranks must agree on once per step (a scheduler's signal:
[Note: signals as events] in ``runtime/signals.py``) rides on the markers instead of paying a
collective of its own: a :class:`MarkerRider` adds ``width`` int32 slots to every marker (both
phases, so markers still pair), each rank puts its values in, and the rider gets the MAX over dp
once the marker is checked. Riders must be the same, in the same order, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.comm.collectives import CommCounter, all_reduce
from lightning_zero.zero.waits import Waiter

if TYPE_CHECKING:
    from lightning_zero.zero.flat import ParamSlot

PHASE_BACKWARD, PHASE_STEP = 1, 2  # [Note: phase markers]
PHASES = {
    PHASE_BACKWARD: "the gradient sync of a backward",
    PHASE_STEP: "an optimizer step",
}
STEP_AGREEMENT_S = 2.0  # [Note: a step without a backward]: how long a rank waits for the others


@dataclass
class PendingMarker:
    """A phase marker in flight ([Note: phase markers]): what this rank sent, and the work."""

    agreed: torch.Tensor  # after the wait: MAX over dp of every rank's marker
    work: Any
    phase: int
    steps: int  # optimizer steps this rank had taken
    host: Optional[torch.Tensor] = None  # on CUDA: the agreed marker, copied to pinned memory
    ready: Any = None  # on CUDA: an event recorded after that copy ([Note: markers off the host path])


class MarkerRider(Protocol):
    """Values that ride on every phase marker ([Note: marker riders])."""

    width: int  # int32 slots on every marker

    def values(self) -> list[int]:
        """This rank's values, read when a marker launches (``width`` ints, >= 0)."""
        ...

    def agreed(self, values: list[int]) -> None:
        """The MAX over every rank of the group, once a marker was checked."""
        ...


class PhaseMarkers:
    """[Note: phase markers] over ``group`` (every dp rank of every replica).

    Args:
        slots: every reduced parameter's slot, in the same order on every rank (layout order).
        used: ids of the parameters that got a gradient on this rank since their optimizer last
            dropped its gradients (the reducer keeps it; [Note: parameters nobody used]).
        expert_positions: ``{param id: (ep_size, ep_rank)}`` of the expert parameters: each gets
            ``ep_size`` flags and this rank raises the one at ``ep_rank``, so the agreed flag is
            whether any rank holding the same expert used it ([Note: expert domain] in
            ``zero/domains.py``).
    """

    def __init__(
        self,
        slots: list[ParamSlot],
        used: set[int],
        *,
        expert_positions: Optional[dict[int, tuple[int, int]]] = None,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        counter: Optional[CommCounter],
        waiter: Waiter,
    ) -> None:
        self.slots = slots
        self.used = used
        self.expert_positions = expert_positions or {}
        self.group = group
        self.dp_rank = dist.get_rank(group)
        self.device = device
        self.counter = counter
        self.waiter = waiter
        self.optimizer_steps = 0  # optimizer steps taken so far (StepChecks counts them)
        self.unused_by_all: set[int] = set()  # agreed at the last optimizer step's marker
        self.overflow_anywhere = False  # agreed at the last optimizer step's marker ([Note: global overflow])
        self.riders: list[MarkerRider] = []  # [Note: marker riders]

    def start(self, phase: int, overflow: bool = False) -> PendingMarker:
        """Launch this rank's marker of ``phase``: an all-reduce (MAX) over all of dp. ``overflow``:
        this rank's gradient shard holds an inf/NaN ([Note: global overflow] in optimizer.py)."""
        steps = self.optimizer_steps
        flags = []
        for slot in self.slots:
            width, position = self.expert_positions.get(id(slot.param), (1, 0))
            slot_flags = [0] * width
            if phase == PHASE_STEP and id(slot.param) in self.used:  # [Note: parameters nobody used] in reducer.py
                slot_flags[position] = 1
            flags += slot_flags
        riding = [value for rider in self.riders for value in rider.values()]  # [Note: marker riders]
        mark = torch.tensor([phase, -phase, steps, -steps, int(overflow), *riding, *flags], dtype=torch.int32)
        mark = mark.to(self.device)
        work = all_reduce(
            mark, self.group, op=dist.ReduceOp.MAX, async_op=True, counter=self.counter,
            label="agree_phase", control=True,
        )  # fmt: skip
        pending = PendingMarker(mark, work, phase, steps)
        if self.device.type == "cuda":
            self._copy_to_host(pending)
        return pending

    def _copy_to_host(self, pending: PendingMarker) -> None:
        """Queue the agreed marker's copy to pinned host memory on a side stream that waits for the
        collective only, not for the compute stream's later kernels, so reading it later waits for
        the marker alone ([Note: markers off the host path] in reducer.py)."""
        if getattr(self, "_copy_stream", None) is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the marker was written on it
        with torch.cuda.stream(stream):
            pending.work.wait()  # NCCL: this stream waits for the all-reduce
            pending.host = torch.empty(pending.agreed.shape, dtype=pending.agreed.dtype, pin_memory=True)
            pending.host.copy_(pending.agreed, non_blocking=True)
            pending.ready = torch.cuda.Event()
            pending.ready.record(stream)
        pending.agreed.record_stream(stream)

    def check(self, pending: PendingMarker, describe: Optional[Callable[[], str]] = None) -> None:
        """Wait for a phase marker; raise on every rank if the ranks are not at the same phase and
        optimizer step. ``describe()`` names what the marker precedes (for a time-out message)."""
        phase = pending.phase
        what = describe or (lambda: f"the phase marker of {PHASES.get(phase, phase)} on dp rank {self.dp_rank}")
        with record_function("lightning_zero::agree_phase"):
            if pending.ready is not None:  # CUDA: wait for the marker's copy only
                if self.waiter.failure is not None:
                    self.waiter.failure.check()
                pending.ready.synchronize()
                agreed = pending.host.tolist()
            else:
                self.waiter.wait(pending.work, what)
                agreed = pending.agreed.tolist()
        high, low = agreed[0:4:2], [-value for value in agreed[1:4:2]]
        if high == low:
            start = 5
            for rider in self.riders:  # [Note: marker riders]
                rider.agreed(agreed[start : start + rider.width])
                start += rider.width
            if phase == PHASE_STEP:
                self.overflow_anywhere = bool(agreed[4])
                self.unused_by_all = set()
                for slot in self.slots:
                    width, position = self.expert_positions.get(id(slot.param), (1, 0))
                    if not agreed[start + position]:
                        self.unused_by_all.add(id(slot.param))
                    start += width
            return
        mine = (phase, pending.steps)
        other = tuple(lo if hi == own else hi for hi, lo, own in zip(high, low, mine))

        def where(phase_: int, steps: int) -> str:
            return f"{PHASES.get(phase_, phase_)} after {steps} optimizer steps"

        raise RuntimeError(
            f"lightning_zero: dp rank {self.dp_rank} is at {where(*mine)}, another rank at {where(*other)}:"
            " the ranks ran different numbers of backward calls in a step (one ran an extra backward, or"
            " skipped one), so their collectives no longer pair up. Every rank must call backward"
            " (manual_backward) the same number of times in each step, e.g. on a zero loss (`loss * 0`)"
            " where it has nothing to learn from."
        )

    def at_step(self, describe: Callable[[], str], overflow: bool = False) -> set[int]:
        """The marker of an optimizer step, right before its update: check that every rank is at
        this step, and return the ids of the parameters no dp rank gave a gradient since their
        optimizer last dropped its gradients ([Note: parameters nobody used] in reducer.py).
        Afterwards ``overflow_anywhere`` says whether any rank passed ``overflow=True``."""
        self.check(self.start(PHASE_STEP, overflow), describe)
        return self.unused_by_all


class Progress(Protocol):
    """What :class:`StepChecks` reads of the gradient reducer (``reducer.GradReducer``)."""

    finished_backwards: int  # backwards ended so far
    markers: PhaseMarkers  # whose ``optimizer_steps`` StepChecks counts


class StepChecks:
    """[Note: a step without a backward]: the local checks, agreed through the store."""

    def __init__(self, reducer: Progress, waiter: Waiter) -> None:
        self.reducer = reducer
        self.waiter = waiter
        self._backwards_at_step: dict[int, int] = {}  # optimizer id -> backwards ended at its last step
        self._steps_of: dict[int, int] = {}  # optimizer id -> its steps so far
        self._train_steps = 0  # training steps begun
        self._at_train_step_start = (0, 0)  # (backwards ended, optimizer steps) when the last one began

    def _progress(self) -> tuple[int, int]:
        return self.reducer.finished_backwards, self.reducer.markers.optimizer_steps

    def count_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer step post-hook: one more step ([Note: phase markers] carry the count)."""
        self.reducer.markers.optimizer_steps += 1
        self._backwards_at_step[id(optimizer)] = self.reducer.finished_backwards
        self._steps_of[id(optimizer)] = self._steps_of.get(id(optimizer), 0) + 1

    def begin_train_step(self) -> None:
        self._train_steps += 1
        self._at_train_step_start = self._progress()

    def before_update(self, index: int, optimizer: Optimizer) -> None:
        """Right before optimizer ``index`` updates: raise if it steps without a backward since its
        last step on this rank while other ranks ran one."""
        if self.reducer.finished_backwards != self._backwards_at_step.get(id(optimizer), 0):
            return
        steps = self._steps_of.get(id(optimizer), 0)
        if self._all_ranks_reach(f"step_without_backward/{index}/{steps}"):
            return
        raise RuntimeError(
            f"lightning_zero: optimizer {index} ({type(optimizer).__name__}) steps on this rank without a"
            f" backward since its last step (step {steps + 1}), while other ranks ran one: their gradient"
            " collectives would wait for this rank forever. Every rank must call backward (manual_backward)"
            " before each step, e.g. on a zero loss (`loss * 0`) where it has nothing to learn from."
        )

    def after_manual_train_step(self) -> None:
        """A manual-optimization training step returned: raise if it ran no backward and no step
        on this rank while other ranks did."""
        if self._progress() != self._at_train_step_start:
            return
        if self._all_ranks_reach(f"train_step_without_backward/{self._train_steps}"):
            return
        raise RuntimeError(
            f"lightning_zero: training step {self._train_steps} ran neither a backward nor an optimizer step on this"
            " rank, while other ranks ran them: their gradient collectives would wait for this rank forever."
            " Every rank must take part in every step: call manual_backward (on a zero loss, `loss * 0`, where a"
            " rank has nothing to learn from) and step on every rank."
        )

    def _all_ranks_reach(self, tag: str) -> bool:
        channel = self.waiter.failure
        return channel is None or channel.all_ranks_reach(tag, STEP_AGREEMENT_S)
