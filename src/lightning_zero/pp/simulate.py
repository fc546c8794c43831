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

[Note: what a split backward frees] Under the zero-bubble schedules torch runs ``I`` as
``stage_backward_input`` (``torch.autograd.grad`` to the stage's inputs with ``retain_graph=True``,
the graph kept for ``W``) and then detaches the stage's outputs (the loss, on the last stage): the
nodes above the first that touches a parameter become unreachable and free what they saved. For
a Llama stage that is the loss's (its log-probabilities, targets and total weight) on the last
stage and nothing elsewhere (a stage ends in the residual add, which saves nothing); ``W``
(``stage_backward_weight``, ``retain_graph=False``) frees the rest. Stage 0 runs no ``I`` (torch
skips it there: the token ids need no gradient) and its whole backward at ``W``. So a micro-batch
holds ``StageBytes.saved[s]`` from ``F`` to ``I``, ``saved[s] - freed_at_input[s]`` from ``I``
to ``W``. The stage's parameter gradients (``StageBytes.grads[s]``: every ``.grad`` a schedule
fills, held until the engine takes them, [Note: gradients handed in] in ``zero/engine.py``) appear
at its first weight-gradient action (``B``, or ``W``) and stay for the step.
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


def schedule_order(layout: PipelineLayout) -> list[list[Action]]:
    """Per pp rank, the compute actions of one step in the order the schedule runs them (memoized
    on what the order depends on: the schedule, pp, micro-batches and stages per rank, not the
    split; do not change the lists)."""
    return _order(layout.schedule, layout.pp, layout.microbatches, layout.local_stages)


@functools.lru_cache(maxsize=256)
def _order(schedule: str, pp: int, microbatches: int, local_stages: int) -> list[list[Action]]:
    if schedule not in MULTI_STAGE:
        return [single_stage_order(schedule, r, pp, microbatches) for r in range(pp)]
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = TORCH_SCHEDULES[schedule].removeprefix("Schedule")
    ops = get_schedule_ops(name, pp, microbatches, local_stages)
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
class StageBytes:
    """What a rank holds per stage ``s`` while a step runs ([Note: what a split backward frees]):
    ``saved[s]`` one micro-batch's saved tensors, ``freed_at_input[s]`` of those freed by its
    input-gradient action ``I``, ``grads[s]`` the stage's parameter gradients (empty: none)."""

    saved: tuple[float, ...]
    freed_at_input: tuple[float, ...] = ()
    grads: tuple[float, ...] = ()

    @classmethod
    def counting(cls, num_stages: int) -> "StageBytes":
        """One unit per micro-batch in flight, no gradients: the peaks count micro-batches."""
        return cls((1.0,) * num_stages)

    def freed_by_input(self, stage: int) -> float:
        return self.freed_at_input[stage] if self.freed_at_input and stage > 0 else 0.0

    def grad_of(self, stage: int) -> float:
        return self.grads[stage] if self.grads else 0.0


@dataclass(frozen=True)
class ScheduleTrace:
    """One step played out: per rank, its busy seconds and what it held at most; the step's makespan."""

    busy: tuple[float, ...]
    makespan: float
    in_flight: tuple[int, ...]
    """Per rank, the most micro-batches whose activations it held at once."""
    peak_held: tuple[float, ...] = ()
    """Per rank, the most saved bytes held at once (:class:`StageBytes`; the count of ``in_flight``
    under ``StageBytes.counting``)."""
    peak_with_grads: tuple[float, ...] = ()
    """Per rank, the most saved bytes plus parameter gradients held at once, between actions."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks over the step: ``1 - busy / (pp * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


KINDS = "FIWB"


@dataclass(frozen=True)
class CompiledOrder:
    """An order made ready to play many times ([Note: the schedule's own order]): every action in
    one sequence that respects each rank's order and every dependency, with the one action it
    waits for on another stage (a forward: the previous stage's forward; ``I`` or ``B``: the next
    stage's ``I`` or ``B``; the rest of its needs run earlier on its own rank), and per rank the
    distinct states of what it holds between actions (:func:`holding_states`)."""

    ranks: int
    stage: tuple[int, ...]
    kind: tuple[int, ...]  # index into KINDS
    rank: tuple[int, ...]
    waits_for: tuple[int, ...]  # index of the action on another stage it waits for, -1: none
    crosses: tuple[bool, ...]  # that action ran on another rank (a transfer between them)
    states: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...]  # per rank: holding_states


def compile_order(order: Sequence[Sequence[Action]], num_stages: int) -> CompiledOrder:
    """:class:`CompiledOrder` of ``order``; ``ValueError`` on an order that cannot run (a deadlock)."""
    split = {action[0] for actions in order for action in actions if action[1] == "I"}
    where = {action: rank for rank, actions in enumerate(order) for action in actions}

    def awaited(action: Action) -> Optional[Action]:
        stage, kind, mb = action
        if kind == "F" and stage > 0:
            return (stage - 1, "F", mb)
        if kind in ("B", "I") and stage < num_stages - 1:
            return (stage + 1, "I", mb) if stage + 1 in split else (stage + 1, "B", mb)
        return None

    index: dict[Action, int] = {}
    sequence: list[Action] = []
    position = [0] * len(order)
    remaining = sum(len(actions) for actions in order)
    while remaining:
        progressed = False
        for rank, actions in enumerate(order):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                need = awaited(action)
                if need is not None and need not in index:
                    break
                index[action] = len(sequence)
                sequence.append(action)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {
                rank: actions[position[rank]] for rank, actions in enumerate(order) if position[rank] < len(actions)
            }
            raise ValueError(f"the schedule cannot run: every rank waits ({stuck})")
    waits = [awaited(action) for action in sequence]
    rank_of = [where[action] for action in sequence]
    return CompiledOrder(
        ranks=len(order),
        stage=tuple(action[0] for action in sequence),
        kind=tuple(KINDS.index(action[1]) for action in sequence),
        rank=tuple(rank_of),
        waits_for=tuple(-1 if need is None else index[need] for need in waits),
        crosses=tuple(need is not None and where[need] != rank for need, rank in zip(waits, rank_of)),
        states=tuple(holding_states(actions) for actions in order),
    )


def holding_states(actions: Sequence[Action]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """A rank's stages and its distinct states between its ``actions`` ([Note: what a split
    backward frees]): per stage of the rank, the micro-batches past ``F`` and not yet at ``I`` or
    ``B``, those past ``I`` and not yet at ``W``, and whether its gradients exist. What it holds in
    any state is linear in these counts, so its peaks are the largest over these few states."""
    stages = tuple(sorted({action[0] for action in actions}))
    slot = {stage: 3 * i for i, stage in enumerate(stages)}
    counts = [0] * (3 * len(stages))
    states = {tuple(counts)}
    for stage, kind, _ in actions:
        at = slot[stage]
        if kind == "F":
            counts[at] += 1
        elif kind == "I":
            counts[at] -= 1
            counts[at + 1] += 1
        else:
            counts[at + (1 if kind == "W" else 0)] -= 1
            counts[at + 2] = 1
        states.add(tuple(counts))
    # every count holds bytes >= 0: a state another one covers count by count is never the peak
    kept = [state for state in states if not any(other != state and _covers(other, state) for other in states)]
    return stages, tuple(sorted(kept))


def _covers(big: tuple[int, ...], small: tuple[int, ...]) -> bool:
    return all(b >= s for b, s in zip(big, small))


def play_compiled(
    compiled: CompiledOrder, costs: StageCosts, p2p_seconds: float = 0.0, held_bytes: Optional[StageBytes] = None
) -> ScheduleTrace:
    """Times of every action of ``compiled`` ([Note: the schedule's own order]), ``p2p_seconds``
    added between ranks, and what each rank holds at most (``held_bytes``; default: one unit per
    micro-batch)."""
    num_stages = len(costs.forward)
    table = (
        costs.forward,
        costs.backward_input,
        costs.backward_weight,
        tuple(i + w for i, w in zip(costs.backward_input, costs.backward_weight)),
    )
    end = [0.0] * len(compiled.stage)
    clock = [0.0] * compiled.ranks
    busy = [0.0] * compiled.ranks
    for i, (stage, kind, rank, need, cross) in enumerate(
        zip(compiled.stage, compiled.kind, compiled.rank, compiled.waits_for, compiled.crosses)
    ):
        start = clock[rank]
        if need >= 0:
            ready = end[need] + p2p_seconds if cross else end[need]
            if ready > start:
                start = ready
        cost = table[kind][stage]
        end[i] = clock[rank] = start + cost
        busy[rank] += cost
    held_bytes = held_bytes or StageBytes.counting(num_stages)
    in_flight, peak_held, peak_with_grads = [], [], []
    for stages, states in compiled.states:
        acts: list[float] = []  # per count of a state: the bytes one unit of it holds
        grads: list[float] = []
        for stage in stages:
            saved = held_bytes.saved[stage]
            acts += [saved, saved - held_bytes.freed_by_input(stage), 0.0]
            grads += [0.0, 0.0, held_bytes.grad_of(stage)]
        in_flight.append(max(sum(state[0::3]) + sum(state[1::3]) for state in states))
        held = [(_dot(state, acts), _dot(state, grads)) for state in states]
        peak_held.append(max(a for a, _ in held))
        peak_with_grads.append(max(a + g for a, g in held))
    return ScheduleTrace(tuple(busy), max(clock), tuple(in_flight), tuple(peak_held), tuple(peak_with_grads))


def _dot(counts: Sequence[int], weights: Sequence[float]) -> float:
    return sum(count * weight for count, weight in zip(counts, weights) if count)


def play(
    order: Sequence[Sequence[Action]],
    costs: StageCosts,
    num_stages: int,
    p2p_seconds: float = 0.0,
    held_bytes: Optional[StageBytes] = None,
) -> ScheduleTrace:
    """Times of every action in ``order`` (per rank, run in that order) from the dependencies of
    [Note: the schedule's own order]; ``p2p_seconds`` is added between ranks (activation or
    gradient transfer); ``held_bytes``: what a micro-batch in flight and a stage's gradients hold
    ([Note: what a split backward frees]; default: one unit per micro-batch). Raises
    ``ValueError`` on an order that cannot run (a deadlock)."""
    return play_compiled(compile_order(order, num_stages), costs, p2p_seconds, held_bytes)


def compiled_order(layout: PipelineLayout) -> CompiledOrder:
    """:func:`compile_order` of ``layout``'s schedule (memoized as :func:`schedule_order`: the
    search plays each many times)."""
    return _compiled(layout.schedule, layout.pp, layout.microbatches, layout.local_stages)


@functools.lru_cache(maxsize=256)
def _compiled(schedule: str, pp: int, microbatches: int, local_stages: int) -> CompiledOrder:
    return compile_order(_order(schedule, pp, microbatches, local_stages), pp * local_stages)


def trace_schedule(
    layout: PipelineLayout,
    costs: Optional[StageCosts] = None,
    p2p_seconds: float = 0.0,
    held_bytes: Optional[StageBytes] = None,
) -> ScheduleTrace:
    """:func:`play` of ``layout``'s schedule; ``costs`` default to forward 1, backward 2 (1 + 1) per stage."""
    costs = costs or StageCosts.uniform(layout.num_stages)
    return play_compiled(compiled_order(layout), costs, p2p_seconds, held_bytes)
