"""A step of a pipeline schedule played out on paper: when each rank computes, its bubble, and how
many micro-batches' activations each rank keeps in flight.

[Note: the schedule's own order] The order of actions is torch's, not a formula of ours: the
multi-stage schedules' ``pipeline_order`` (what their runtime executes) is read through
:func:`torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`; the single-stage ones
(``ScheduleGPipe``, ``Schedule1F1B``) run a loop instead of a table, which :func:`single_stage_order`
writes out exactly as their ``_step_microbatches`` runs it (1F1B: ``min(m, num_stages - stage)``
warm-up forwards, then one backward and one forward in turn). The times then follow from the
dependencies alone: a forward waits for the previous stage's forward of the same micro-batch, a
backward for the next stage's backward (an input-gradient ``I`` as a full ``B``), a weight-gradient
``W`` for its own ``I``. Each action takes its stage's cost; no rank reorders. The bubble is the
idle share of ``pp`` ranks over the step; a micro-batch is *in flight* on a rank from its forward
until its last backward action there (``B``, or ``W`` when the backward is split: the weight
gradient needs the saved inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_zero.pp.layout import MULTI_STAGE, TORCH_SCHEDULES, PipelineLayout

Action = tuple[int, str, int]
"""``(stage, kind, microbatch)`` with kind ``"F"``, ``"B"`` (full backward), ``"I"`` (input
gradient) or ``"W"`` (weight gradient)."""


def single_stage_order(schedule: str, pp_rank: int, num_stages: int, microbatches: int) -> list[Action]:
    """The compute actions of ``ScheduleGPipe`` / ``Schedule1F1B`` on ``pp_rank`` (its stage)."""
    stage, m = pp_rank, microbatches
    if schedule == "gpipe":
        return [(stage, "F", i) for i in range(m)] + [(stage, "B", i) for i in range(m)]
    warmup = min(m, num_stages - stage)
    order: list[Action] = [(stage, "F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append((stage, "B", backward))
        backward += 1
        if forward < m:
            order.append((stage, "F", forward))
            forward += 1
    return order


@functools.lru_cache(maxsize=256)
def schedule_order(layout: PipelineLayout) -> list[list[Action]]:
    """Per pp rank, the compute actions of one step in the order the schedule runs them (memoized:
    the layout search plans the same layout many times; do not change the lists)."""
    if layout.schedule not in MULTI_STAGE:
        return [
            single_stage_order(layout.schedule, r, layout.num_stages, layout.microbatches) for r in range(layout.pp)
        ]
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = TORCH_SCHEDULES[layout.schedule].removeprefix("Schedule")
    ops = get_schedule_ops(name, layout.pp, layout.microbatches, layout.local_stages)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    order = []
    for rank_ops in ops:
        actions = []
        for action in rank_ops:
            kind = None if action is None else kinds.get(action.computation_type.value)
            if kind is not None:
                actions.append((action.stage_index, kind, action.microbatch_index))
        order.append(actions)
    return order


@dataclass(frozen=True)
class StageCosts:
    """Seconds (or any one unit) one micro-batch takes in each stage: ``forward[s]``, and the
    backward split into its input-gradient and weight-gradient parts (a full backward is their sum)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]

    @classmethod
    def uniform(
        cls, num_stages: int, forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0
    ) -> "StageCosts":
        return cls((forward,) * num_stages, (backward_input,) * num_stages, (backward_weight,) * num_stages)

    def of(self, stage: int, kind: str) -> float:
        if kind == "F":
            return self.forward[stage]
        if kind == "I":
            return self.backward_input[stage]
        if kind == "W":
            return self.backward_weight[stage]
        return self.backward_input[stage] + self.backward_weight[stage]


@dataclass(frozen=True)
class ScheduleTrace:
    """One step played out: per rank, ``(start, end, action)`` of each compute action."""

    spans: tuple[tuple[tuple[float, float, Action], ...], ...]
    in_flight: tuple[int, ...]
    """Per rank, the most micro-batches whose activations it held at once."""
    peak_held: tuple[float, ...] = ()
    """Per rank, the most held weight at once, a micro-batch on stage ``s`` weighing ``weights[s]``
    (:func:`play`; the count of ``in_flight`` when every weight is 1)."""

    @property
    def makespan(self) -> float:
        return max(span[-1][1] for span in self.spans if span)

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(end - start for start, end, _ in rank) for rank in self.spans)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks over the step: ``1 - busy / (pp * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.spans) * self.makespan)


def play(
    order: Sequence[Sequence[Action]],
    costs: StageCosts,
    num_stages: int,
    p2p_seconds: float = 0.0,
    weights: Optional[Sequence[float]] = None,
) -> ScheduleTrace:
    """Times of every action in ``order`` (per rank, run in that order) from the dependencies of
    [Note: the schedule's own order]; ``p2p_seconds`` is added between ranks (activation or
    gradient transfer); ``weights[s]`` is what one micro-batch in flight on stage ``s`` holds
    (default 1). Raises ``ValueError`` on an order that cannot run (a deadlock)."""
    weight = list(weights) if weights is not None else [1.0] * num_stages
    held = [0.0] * len(order)
    peak_held = [0.0] * len(order)
    done: dict[Action, float] = {}
    where: dict[Action, int] = {action: rank for rank, actions in enumerate(order) for action in actions}
    position = [0] * len(order)
    clock = [0.0] * len(order)
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in order]
    live = [0] * len(order)
    peak = [0] * len(order)
    split = {action[0] for actions in order for action in actions if action[1] == "I"}

    def ready(action: Action, rank: int) -> Optional[float]:
        stage, kind, mb = action
        needs: list[Action] = []
        if kind == "F" and stage > 0:
            needs.append((stage - 1, "F", mb))
        if kind in ("B", "I"):
            needs.append((stage, "F", mb))
            if stage < num_stages - 1:
                later = (stage + 1, "I", mb) if stage + 1 in split else (stage + 1, "B", mb)
                needs.append(later)
        if kind == "W":
            needs.append((stage, "I", mb))
        start = clock[rank]
        for need in needs:
            if need not in done:
                return None
            hop = p2p_seconds if where.get(need, rank) != rank else 0.0
            start = max(start, done[need] + hop)
        return start

    remaining = sum(len(actions) for actions in order)
    while remaining:
        progressed = False
        for rank, actions in enumerate(order):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                start = ready(action, rank)
                if start is None:
                    break
                end = start + costs.of(action[0], action[1])
                done[action], clock[rank] = end, end
                spans[rank].append((start, end, action))
                position[rank] += 1
                remaining -= 1
                progressed = True
                if action[1] == "F":
                    live[rank] += 1
                    peak[rank] = max(peak[rank], live[rank])
                    held[rank] += weight[action[0]]
                    peak_held[rank] = max(peak_held[rank], held[rank])
                elif action[1] == "W" or (action[1] == "B"):
                    live[rank] -= 1
                    held[rank] -= weight[action[0]]
        if not progressed:
            stuck = {
                rank: actions[position[rank]] for rank, actions in enumerate(order) if position[rank] < len(actions)
            }
            raise ValueError(f"the schedule cannot run: every rank waits ({stuck})")
    return ScheduleTrace(tuple(tuple(s) for s in spans), tuple(peak), tuple(peak_held))


def trace_schedule(
    layout: PipelineLayout,
    costs: Optional[StageCosts] = None,
    p2p_seconds: float = 0.0,
    weights: Optional[Sequence[float]] = None,
) -> ScheduleTrace:
    """:func:`play` of ``layout``'s schedule; ``costs`` default to forward 1, backward 2 (1 + 1) per stage."""
    costs = costs or StageCosts.uniform(layout.num_stages)
    return play(schedule_order(layout), costs, layout.num_stages, p2p_seconds, weights)
