"""Keeping every rank's stage-3 all-gathers in step: the recorded schedule and the agreements.

[Note: gather schedule] Every rank must issue the same all-gathers in the same order. The first
step of each phase *records* the order units are gathered in, checking before every gather that
all ranks agree (one tiny all-gather of ``(kind, unit index)``): a module run a different number
of times, or skipped, on one rank raises an error naming the module on every rank instead of a
hang. Later steps follow the recorded schedule (and prefetch ``prefetch_blocks`` ahead along it):
a unit skipped on this rank is still gathered (and freed at once) when a later unit is reached,
units left when the step closes are flushed, and a unit run more often than recorded raises --
on this rank at once, and on every other rank within a fraction of a second ([Note: abort
channel] in ``abort.py``). All-gathers run on their own process group (a clone of the dp group,
:func:`clone_dp_group`), so their order never interleaves with the gradient reduce-scatters'.

[Note: dynamic execution] SPMD is a promise about collectives, not about modules: an MoE that
skips idle experts, LayerDrop drawn per rank, a tower run only for some batches make the ranks
run different modules in one step. Two mechanisms keep the collectives agreed:

- *Inside a unit* (experts inside a block unit): the unit is gathered whole on every rank, so
  nothing about gathers changes; when the unit's backward is over, its parameters that got no
  gradient on this rank count as zeros (``on_unit_skipped_in_backward`` -> ``mark_absent``), so
  their bucket launches where it does on the ranks that used them ([Note: skipped units and
  gradient buckets] in ``runtime.py``).
- *Whole units* that differ between ranks: the first step of a phase agrees on every gather
  anyway ([Note: gather schedule]); when that agreement finds the ranks asking for different
  units, the phase turns *dynamic* (on every rank at once: all saw the same exchange) instead of
  raising. In a dynamic phase every gather is a round of agreement: each rank says which unit it
  needs now (``NEED``) or that it is done with the step (``DONE``); every rank gathers the
  lowest-indexed unit asked for (:meth:`Agreement.served`), and a rank that did not ask frees it
  at once; rounds repeat until this rank's unit is gathered. Each round serves some rank, so every
  need is met. A rank done with its backward (before its final reduce-scatter launches) and with
  its step serves rounds until every rank is done, and the gradient reducer launches only once
  backward ended (``on_dynamic``: the reduce-scatters cannot wait on a peer that still gathers).

Cost of a dynamic phase: one tiny all-gather (16 bytes per rank) per gather round, no prefetch,
no overlap of the gradient reduce-scatters with backward, and the units some rank needs gathered
on every rank (a rank skipping an expert still receives it). A phase whose ranks agree in its
first step, and in which every unit ran on some rank, keeps the recorded schedule and pays
nothing; there a unit skipped later is handled as before, and a unit run out of the recorded
order later raises naming it. A unit that ran on no rank in the first step (LayerDrop dropped it
everywhere) has no place in the schedule, so such a phase turns dynamic as well, with a warning
(:meth:`Agreement.warn_idle_units`).

[Note: held into backward] A unit whose backward gather comes right after its forward gather in
the recorded schedule -- nothing is gathered between the end of its forward and the start of its
backward: the LM head of a decoder, the last unit forward runs and the first backward needs --
is not freed after its forward from the second step on: it stays gathered through the loss into
its backward, and that backward entry issues no all-gather. Which entries are held follows from
the recorded schedule alone (:meth:`Schedule.finish_recording`), which every rank shares, so every
rank skips the same all-gather whatever it ran: a rank that skipped the unit's forward gathers and
frees it at the forward entry as before, and consumes the held entry without a collective. This
is torchtitan's ``reshard_after_forward=False`` for the last block, chosen from the schedule. It
saves ``(dp-1)/dp`` of that unit's bytes per forward/backward pair (a 32000 x 4096 fp32 head: 250
MiB per rank at dp=2), and holds the unit only while the loss runs, where the freed unit would be
gathered again at once; the planner counts it (``planner/workload.gathered_once_units``).

What a recorded schedule holds gathered, and which of its entries are held, is plain arithmetic
in ``gather_order.py`` ([Note: gathered working set]), shared with the planner.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.comm.collectives import all_gather, local_only
from lightning_zero.zero.stage3.abort import AbortChannel
from lightning_zero.zero.stage3.gather_order import held_entries

if TYPE_CHECKING:
    from lightning_zero.zero.stage3.units import Unit

# Agreement messages are (kind, value) pairs of int64, all the same size so that no mismatch of
# collectives can pair messages of different lengths.
UNIT = 1  # value: the unit index about to be gathered
EVAL = 2  # value: 1 = starting an evaluation step, 0 = this rank's evaluation loop ended
DEMAND = 3  # value: the unit a no_grad forward in a training step needs, not gathered on this rank
DEMAND_HELD = 4  # value: the unit a no_grad forward in a training step needs, gathered on this rank
NEED = 5  # value: the unit this rank needs now, in a phase whose ranks run different modules
DONE = 6  # value: 0 -- this rank needs no more units in the open step (it serves the others)


@dataclass
class Schedule:
    """The order units were gathered in during the first step of a phase ([Note: gather schedule])."""

    order: list[int] = field(default_factory=list)
    in_backward: list[bool] = field(default_factory=list)  # per entry: gathered for a backward
    recorded: bool = False
    position: int = 0
    dynamic: bool = False  # the ranks ran different modules: every gather is agreed ([Note: dynamic execution])
    # per entry: kept gathered from the forward entry before it, no all-gather ([Note: held into backward])
    held: list[bool] = field(default_factory=list)

    def finish_recording(self) -> None:
        """The first step of the phase closed: mark its held entries ([Note: held into backward])."""
        self.recorded = True
        self.held = held_entries(self.order, self.in_backward)

    def holds(self, unit_index: int) -> bool:
        """The next entry is ``unit_index``'s held backward entry: the unit stays gathered after its
        forward and its backward gathers nothing ([Note: held into backward])."""
        position = self.position
        return (
            self.recorded
            and not self.dynamic
            and position < len(self.order)
            and self.held[position]
            and self.order[position] == unit_index
        )


class Agreement:
    """Exchanges one ``(kind, value)`` message per dp rank over the gather group, and names what
    each rank said when they differ.

    Args:
        units: the runtime's units, root last (a message's unit index points into it).
        ag_group: process group for parameter all-gathers (a clone of the dp group).
        device: where the messages live (the shards' device).
        channel: how the exchange is waited on ([Note: abort channel] in ``abort.py``).
    """

    def __init__(self, units: list[Unit], ag_group: dist.ProcessGroup, device: torch.device, channel: AbortChannel):
        self.units = units
        self.ag_group = ag_group
        self.device = device
        self.channel = channel
        self.dp_size = dist.get_world_size(ag_group)

    def exchange(self, kind: int, value: int) -> list[tuple[int, int]]:
        """Every dp rank's ``(kind, value)``, in dp rank order (collective over the gather group)."""
        if local_only(self.dp_size):
            return [(kind, value)]
        mine = torch.tensor([kind, value], dtype=torch.int64, device=self.device)
        everyone = torch.empty(2 * self.dp_size, dtype=torch.int64, device=self.device)
        with record_function("lightning_zero::stage3_agree"):
            self.channel.wait(all_gather(everyone, mine, self.ag_group, async_op=True))
        pairs = everyone.view(-1, 2).tolist()
        return [(int(k), int(v)) for k, v in pairs]

    def describe(self, pair: tuple[int, int]) -> str:
        kind, value = pair
        if kind == UNIT:
            return self.units[value].name if 0 <= value < len(self.units) else "nothing"
        if kind == EVAL:
            return "starting an evaluation step" if value else "evaluation loop ended"
        if kind == NEED:
            return f"{self.units[value].name if 0 <= value < len(self.units) else 'nothing'} (needed now)"
        if kind == DONE:
            return "done with the step"
        if kind in (DEMAND, DEMAND_HELD):
            name = self.units[value].name if 0 <= value < len(self.units) else "nothing"
            return f"{name} (no_grad forward)"
        return f"unknown message {pair}"

    def describe_all(self, everyone: list[tuple[int, int]]) -> str:
        return ", ".join(f"dp rank {r}: {self.describe(pair)}" for r, pair in enumerate(everyone))

    def agree(self, unit: Unit, what: str, step: int) -> None:
        """Every rank must be about to gather the same unit (first step of a phase, out-of-step)."""
        everyone = self.exchange(UNIT, unit.index)
        if any(pair != (UNIT, unit.index) for pair in everyone):
            self.disagree(everyone, what, step)

    def disagree(self, everyone: list[tuple[int, int]], what: str, step: int) -> NoReturn:
        """Raise (on every rank: each saw the same exchange) naming what each rank was about to gather."""
        raise RuntimeError(
            f"lightning_zero ZeRO-3: ranks disagree on the next module to gather during {what} of step"
            f" {step} ({self.describe_all(everyone)}). Every rank must run the same modules the same number"
            " of times per step; a module skipped or run more often on one rank would deadlock the"
            " all-gathers. Make the control flow identical on all ranks (e.g. run the module with"
            " zero-weight input)."
        )

    def check_dynamic(self, everyone: list[tuple[int, int]], what: str, step: int) -> None:
        """Raise unless every rank's message belongs to a dynamic round ([Note: dynamic execution])."""
        if any(kind not in (UNIT, NEED, DONE) for kind, _ in everyone):
            self.disagree(everyone, what, step)

    def served(self, everyone: list[tuple[int, int]], what: str, step: int) -> Optional[Unit]:
        """The unit every rank gathers in a dynamic round: the lowest-indexed one any rank asked
        for; None when no rank asked for anything."""
        self.check_dynamic(everyone, what, step)
        wanted = [value for kind, value in everyone if kind in (UNIT, NEED)]
        return self.units[min(wanted)] if wanted else None

    def warn_idle_units(self, kind: str, schedule: Schedule) -> bool:
        """A unit with parameters that ran on no rank in a phase's first step (LayerDrop that
        dropped it everywhere, a tower no batch needed yet) may run later, where the recorded
        schedule has no place for it: warn and return True (the phase turns dynamic,
        [Note: dynamic execution]). The first step's gathers were agreed, so every rank finds the
        same units idle."""
        ran = set(schedule.order)
        idle = [unit.name for unit in self.units[:-1] if unit.groups and unit.index not in ran]
        if not idle:
            return False
        warnings.warn(
            f"lightning_zero ZeRO-3: {len(idle)} unit(s) ran on no rank in the first {kind} step"
            f" ({', '.join(idle[:4])}{', ...' if len(idle) > 4 else ''}); they may run later, so every gather"
            " of this phase is agreed among the ranks from now on (no prefetch, gradient reduce-scatters"
            " after backward). A module that never runs in this phase costs that too: leave it out of"
            " the model or freeze and detach it.",
            stacklevel=3,
        )
        return True


def clone_dp_group(dp_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """A new process group with the same ranks as ``dp_group`` (collective over the world).

    The engine that asks for it destroys it in ``close()``.
    """
    mine = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(dist.get_world_size()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unique = sorted({tuple(ranks) for ranks in everyone})
    clone = None
    for ranks in unique:
        group = dist.new_group(list(ranks))
        if tuple(mine) == ranks:
            clone = group
    if clone is None:
        raise RuntimeError(f"clone_dp_group: this rank's dp ranks {mine} are not among {unique}")
    return clone
