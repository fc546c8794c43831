"""The planner's pipeline parallelism: per pp rank, the stage's model states, the activations its
schedule keeps in flight, the point-to-point bytes of a step and the bubble (issue 63 item 7).

The rules are ``pp/cost.py``'s (bytes crossing a stage boundary, the in-flight peak played out
in torch's own order by ``pp/simulate.py``) and the ledger's (``llama_activation_bytes``: what one
block keeps); this module adds what one micro-batch of a stage saves, and puts them together.
tests/test_pipeline.py measures each number on 2 gloo ranks (``pp/measure.py``) and holds it equal.

[Note: what a stage saves] One micro-batch on stage ``s`` saves its blocks' kept tensors
(``blocks * kept_per_layer``), plus on the first stage the token ids the embedding keeps for its
backward (int64, ``B x T``), plus on the last stage the final norm's and the head's (``head``), the
loss's log-probabilities and targets (``loss_saved``) and the 4-byte fp32 total weight of the mean
cross entropy. The whole model's count (``saved_after_forward``) leaves the ids and the scalar out:
there they were made before forward began (docs/planner.md).

[Note: held between I and W] Under the zero-bubble schedules (``interleaved_zb``, ``zbv``) a
micro-batch's saved tensors are freed in two parts ([Note: what a split backward frees] in
``pp/simulate.py``): on the last stage its input-gradient pass ``I`` frees the loss's
(``loss_saved`` and the total weight: :func:`freed_at_input`), ``W`` the rest; elsewhere ``W`` frees
all. The plan plays that out in the schedule's own order, so the most held at once is exact for
every schedule (tests/test_pipeline.py). An earlier count saw up to 1.52x more: the measurement's
pack hook kept each saved tensor itself, whose ``grad_fn`` is the node saving it, so the nodes
that ran only in ``I`` (with ``retain_graph=True``) formed a cycle and never freed
(``pp/measure.py`` now packs a detached alias, as torch's ``saved_tensors_hooks`` asks).

[Note: gradients a schedule holds] During a schedule every stage's parameter gradients are
separate ``.grad`` tensors the schedule fills (the engine's hooks off: [Note: gradients handed in]
in ``zero/engine.py``), held whole until the engine takes them, at every ZeRO stage, beside the
engine's own gradient buffers: ``params x grad bytes`` of the rank's stages (``StagePlan.grad_bytes``)
from each stage's first weight-gradient action on. ``StagePlan.peak_bytes`` is the most saved
activations plus those gradients at once (between actions); what the gradients add to the
activations' peak is the plan's ``param_grad`` under pp. torch's receive buffers (and, under the
split backward, their ``.grad``) are held whole from the first step on, beside all of it
(``StagePlan.recv_buffers``, the plan's ``recv_buffers``; [Note: receive buffers] in ``pp/cost.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from lightning_zero.planner.ledger import ActivationBytes
from lightning_zero.planner.workload import Tensor, Workload, model_layers
from lightning_zero.pp.cost import boundary_bytes, p2p_bytes_per_step, recv_buffer_bytes, stage_holds
from lightning_zero.pp.layout import PipelineLayout, balanced_split, stages_per_rank
from lightning_zero.pp.simulate import StageBytes, StageCosts, trace_schedule

TOKEN_ID_BYTES = 8  # int64 token ids the embedding saves
LOSS_TOTAL_WEIGHT_BYTES = 4  # the fp32 scalar cross entropy's mean saves beside its log-probabilities


def stage_saved_bytes(acts: ActivationBytes, layout: PipelineLayout, stage: int, mode: str, tokens: int) -> float:
    """[Note: what a stage saves]: bytes one micro-batch of ``tokens`` tokens keeps on ``stage``."""
    blocks, first, last = stage_holds(layout, stage)
    saved = len(blocks) * acts.kept_per_layer(mode)
    if first:
        saved += tokens * TOKEN_ID_BYTES
    if last:
        saved += acts.head + acts.loss_saved + LOSS_TOTAL_WEIGHT_BYTES
    return saved


def freed_at_input(acts: ActivationBytes, layout: PipelineLayout, stage: int) -> float:
    """[Note: held between I and W]: of :func:`stage_saved_bytes`, what ``stage``'s input-gradient
    pass frees (the loss's saved tensors on the last stage; nothing elsewhere)."""
    return acts.loss_saved + LOSS_TOTAL_WEIGHT_BYTES if stage == layout.num_stages - 1 else 0.0


@dataclass(frozen=True)
class StagePlan:
    """One pp rank of a pipeline: what it holds, keeps and moves in a step."""

    pp_rank: int
    stages: tuple[int, ...]
    blocks: int  # decoder blocks over its stages
    embeddings: bool
    head: bool
    params: int  # parameter elements it holds (of one tp rank)
    saved_per_microbatch: tuple[float, ...]  # per stage of ``stages``, bytes one micro-batch keeps
    in_flight: int  # most micro-batches (stage passes) it holds at once
    in_flight_bytes: float  # most activation bytes it holds at once
    grad_bytes: float  # its stages' parameter gradients the schedule holds ([Note: gradients a schedule holds])
    peak_bytes: float  # most activation and gradient bytes it holds at once
    recv_buffers: int  # torch's receive buffers it keeps, between steps too ([Note: receive buffers] in pp/cost.py)
    p2p_sent: int  # bytes per step
    p2p_received: int
    idle_s: float = 0.0  # seconds it waits per pipeline pass (the step's makespan - its busy time)


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline layout planned: per pp rank (:class:`StagePlan`) and the step's bubble."""

    schedule: str
    pp: int
    virtual_stages: int
    microbatches: int
    layers_per_stage: tuple[int, ...]
    boundary_bytes: int  # one micro-batch's hidden states at a stage boundary, one rank
    bubble_fraction: float
    ranks: tuple[StagePlan, ...]

    def heaviest(self, key: Any) -> StagePlan:
        return max(self.ranks, key=key)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unit_param_counts(config: Any, *, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
    """Parameter elements one tp (and ep) rank holds per unit, in forward order: the embeddings,
    each decoder block (its own count: a mixture of experts' dense and MoE layers differ), the final
    norm, the head (0 when tied): ``workload.model_layers``' tensors."""
    key = (repr(config), tp, ep)
    if key not in _UNIT_PARAMS:
        blocks = tuple(sum(t.numel for t in layer) for layer in model_layers(config, tp=tp, ep=ep))
        head = 0 if getattr(config, "tie_embeddings", False) else config.dim * config.vocab_size // tp
        _UNIT_PARAMS[key] = (config.vocab_size * config.dim // tp, *blocks, config.dim, head)
    return _UNIT_PARAMS[key]


_UNIT_PARAMS: dict[tuple, tuple[int, ...]] = {}  # the layout search asks for the same model many times


def stage_params(layout: PipelineLayout, stage: int, units: Sequence[int]) -> int:
    """Parameter elements of ``stage`` from :func:`unit_param_counts`: its blocks, the embeddings
    on the first stage, the final norm and head on the last."""
    blocks, first, last = stage_holds(layout, stage)
    held = sum(units[1 + block] for block in blocks)
    return held + (units[0] if first else 0) + (units[-2] + units[-1] if last else 0)


@dataclass(frozen=True)
class StageShape:
    """What one micro-batch is on one rank: tokens, hidden width, the activation dtype's bytes and
    how the residual stream is split between stages (``tp``, with or without sequence parallelism: [Note:
    pipeline bytes] in ``pp/cost.py``; ``cp``)."""

    micro_batch: int
    seq_len: int
    dim: int
    act_bytes: int
    tp: int = 1
    cp: int = 1

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.cp

    @property
    def boundary(self) -> int:
        return boundary_bytes(
            micro_batch=self.micro_batch, seq_len=self.seq_len, dim=self.dim, act_bytes=self.act_bytes,
            tp=self.tp, cp=self.cp,
        )  # fmt: skip


SIMULATED_ROUNDS = 2
"""A pass of more than ``SIMULATED_ROUNDS * num_stages`` micro-batches is played out for that many
and extrapolated ([Note: long pipelines extrapolated])."""


@dataclass(frozen=True)
class PassTrace:
    """One pipeline pass: its bubble, each rank's idle seconds, and what each rank holds at most."""

    bubble_fraction: float
    idle_s: tuple[float, ...]
    in_flight: tuple[int, ...]
    peak_held: tuple[float, ...]
    peak_with_grads: tuple[float, ...]


@functools.lru_cache(maxsize=4096)
def trace_pass(layout: PipelineLayout, costs: Optional[StageCosts], hop_s: float, held_bytes: StageBytes) -> PassTrace:
    """[Note: long pipelines extrapolated] A search plans passes of hundreds of micro-batches; past
    ``SIMULATED_ROUNDS`` rounds of ``num_stages`` the schedule is in its steady state: the
    in-flight peaks of every schedule are reached within the first round, and each further round
    of ``num_stages`` micro-batches repeats the one before it (every schedule's order is periodic
    in rounds of ``pp``). So a longer pass is played out for that many and for one round more, and
    each further micro-batch adds every rank's own busy time per micro-batch and a round's growth
    of the makespan over ``num_stages``: whichever bounds the steady state (the slowest stage, or
    the round trip of the transfers between ranks) bounds the step. Equal to playing the whole pass
    for the stage costs the planner gives (blocks of equal cost, heavier first and last stages),
    transfers bounding 1F1B or not (tests/test_planner_pipeline.py); under arbitrary stage costs the
    steady state can take longer to settle (a test with random costs saw up to 0.004 of bubble
    fraction apart). Shorter passes (the measured tests') are played out whole, and
    so is GPipe's, which keeps every micro-batch in flight (its order is two loops, no torch)."""
    cap, round_ = SIMULATED_ROUNDS * layout.num_stages, layout.num_stages
    if layout.microbatches <= cap + round_ or layout.schedule == "gpipe":
        trace = trace_schedule(layout, costs, hop_s, held_bytes)
        makespan, busy = trace.makespan, list(trace.busy)
    else:
        trace = trace_schedule(dataclasses.replace(layout, microbatches=cap), costs, hop_s, held_bytes)
        longer = trace_schedule(dataclasses.replace(layout, microbatches=cap + round_), costs, hop_s, held_bytes)
        extra = layout.microbatches - cap
        makespan = trace.makespan + extra * (longer.makespan - trace.makespan) / round_
        busy = [b + extra * b / cap for b in trace.busy]
    bubble = 1.0 - sum(busy) / (layout.pp * makespan) if makespan > 0 else 0.0
    idle = tuple(makespan - b for b in busy)
    return PassTrace(bubble, idle, trace.in_flight, trace.peak_held, trace.peak_with_grads)


def plan_pipeline(
    layout: PipelineLayout,
    acts: ActivationBytes,
    shape: StageShape,
    units: Sequence[int],
    mode: str = "none",
    costs: Optional[StageCosts] = None,
    hop_s: float = 0.0,
    grad_bytes: int = 0,
) -> PipelinePlan:
    """Every pp rank of ``layout``: ``acts`` is one micro-batch's per-block ledger, ``units`` the
    parameter elements per unit (:func:`unit_param_counts`), ``costs`` each
    stage's seconds (``None``: equal stages, backward two forwards), ``hop_s`` one boundary
    crossing's seconds, ``grad_bytes`` the bytes of one parameter's gradient element."""
    every = range(layout.num_stages)
    saved = [stage_saved_bytes(acts, layout, s, mode, shape.tokens) for s in every]
    held = StageBytes(
        tuple(saved),
        tuple(freed_at_input(acts, layout, s) for s in every),
        tuple(float(stage_params(layout, s, units) * grad_bytes) for s in every),
    )
    trace = trace_pass(layout, costs, hop_s, held)  # in flight: 1F1B at most pp on the first stage, GPipe m
    ranks = []
    for rank in range(layout.pp):
        stages = layout.rank_stages(rank)
        p2p = p2p_bytes_per_step(layout, rank, shape.boundary)
        ranks.append(
            StagePlan(
                pp_rank=rank,
                stages=stages,
                blocks=sum(len(layout.stage_blocks(s)) for s in stages),
                embeddings=0 in stages,
                head=layout.num_stages - 1 in stages,
                params=sum(stage_params(layout, s, units) for s in stages),
                saved_per_microbatch=tuple(saved[s] for s in stages),
                in_flight=trace.in_flight[rank],
                in_flight_bytes=trace.peak_held[rank],
                grad_bytes=sum(held.grads[s] for s in stages),
                peak_bytes=trace.peak_with_grads[rank],
                recv_buffers=recv_buffer_bytes(layout, rank, shape.boundary).total,
                p2p_sent=p2p.sent,
                p2p_received=p2p.received,
                idle_s=trace.idle_s[rank],
            )
        )
    return PipelinePlan(
        schedule=layout.schedule,
        pp=layout.pp,
        virtual_stages=layout.local_stages,
        microbatches=layout.microbatches,
        layers_per_stage=layout.layers_per_stage,
        boundary_bytes=shape.boundary,
        bubble_fraction=trace.bubble_fraction,
        ranks=tuple(ranks),
    )


# -- the planner's pipelined run: one pp rank's workload, the split, each stage's seconds --------


def stage_units(layout: PipelineLayout, stage: int) -> frozenset[int]:
    """The workload units (0 embeddings, ``1 + block``, ``L + 1`` final norm, ``L + 2`` head) of ``stage``."""
    blocks, first, last = stage_holds(layout, stage)
    units = {1 + block for block in blocks}
    units.update({0} if first else set())
    units.update({layout.n_layers + 1, layout.n_layers + 2} if last else set())
    return frozenset(units)


def rank_units(layout: PipelineLayout, pp_rank: int) -> frozenset[int]:
    """The workload units of ``pp_rank``'s stages (:func:`stage_units`)."""
    return frozenset().union(*(stage_units(layout, stage) for stage in layout.rank_stages(pp_rank)))


_PER_WORKLOAD: dict[tuple, tuple[Workload, Any]] = {}
PER_WORKLOAD_ENTRIES = 4096  # then the memo starts over (a search's workloads and splits repeat within it)


def _per_workload(workload: Workload, key: tuple, make: Any) -> Any:
    """``make()`` memoized per workload object and ``key``: the planner memoizes its workloads, so a
    search asks again for the same one; the object itself is kept and checked on a hit."""
    memo_key = (id(workload), *key)
    hit = _PER_WORKLOAD.get(memo_key)
    if hit is not None and hit[0] is workload:
        return hit[1]
    if len(_PER_WORKLOAD) >= PER_WORKLOAD_ENTRIES:
        _PER_WORKLOAD.clear()
    value = make()
    _PER_WORKLOAD[memo_key] = (workload, value)
    return value


def stage_workload(workload: Workload, layout: PipelineLayout, pp_rank: int) -> Workload:
    """``workload`` (the whole model's, one micro-batch) cut to ``pp_rank``'s units: its tensors (in
    registration order, renumbered), their forward seconds, and the blocking tp / cp / ep seconds
    in proportion to its blocks."""
    units = rank_units(layout, pp_rank)
    return _per_workload(workload, ("stage", units), lambda: _cut(workload, units, layout.n_layers))


def _cut(workload: Workload, units: frozenset[int], n_layers: int) -> Workload:
    kept = [t for t in workload.tensors if t.unit in units]
    tensors = [Tensor(t.name, t.numel, i, t.unit, t.group, t.backward_s, t.expert) for i, t in enumerate(kept)]
    forward = tuple(s if unit in units else 0.0 for unit, s in enumerate(workload.unit_forward_s))
    share = len([u for u in units if 1 <= u <= n_layers]) / n_layers
    return dataclasses.replace(
        workload,
        tensors=tuple(tensors),
        unit_forward_s=forward,
        compute_forward_s=sum(forward),
        compute_backward_s=sum(t.backward_s for t in tensors),
        tp_s=workload.tp_s * share,
        cp_s=workload.cp_s * share,
        ep_s=workload.ep_s * share,
        shape_key=(*workload.shape_key, "pp", tuple(sorted(units))),
        root_units=workload.root_units & units,
    )


def resolve_layout(config: Any, workload: Workload, n_layers: int) -> PipelineLayout:
    """The pipeline layout a ``ZeroConfig`` asks for on a model of ``n_layers`` blocks:
    ``pp_microbatches`` (``None``: one per stage), ``pp_layers`` or a split balancing each stage's
    seconds (``pp/layout.py`` ``balanced_split``, the embeddings and head as extra cost on the
    first and last stage). ``ValueError`` naming the fix for one that cannot work."""
    local = stages_per_rank(config.pp_schedule, config.pp_virtual_stages)
    microbatches = config.pp_microbatches or config.pp * local
    layers = tuple(config.pp_layers) if config.pp_layers is not None else None
    if layers is None and config.pp * local <= n_layers:
        forward, backward = unit_seconds(workload)
        cost = [f + b for f, b in zip(forward, backward)]
        layers = _split(tuple(cost[1 : n_layers + 1]), config.pp * local, cost[0], sum(cost[n_layers + 1 :]))
    return PipelineLayout(
        pp=config.pp,
        schedule=config.pp_schedule,
        n_layers=n_layers,
        microbatches=microbatches,
        virtual_stages=local if config.pp_schedule != "zbv" else 2,
        pp_layers=layers,
    )


@functools.lru_cache(maxsize=1024)
def _split(costs: tuple[float, ...], stages: int, first: float, last: float) -> tuple[int, ...]:
    return balanced_split(costs, stages, first, last)  # the search asks for the same split many times


def unit_seconds(workload: Workload) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per workload unit, one micro-batch's forward and backward seconds."""

    def make() -> tuple[tuple[float, ...], tuple[float, ...]]:
        backward = [0.0] * len(workload.unit_forward_s)
        for tensor in workload.tensors:
            backward[tensor.unit] += tensor.backward_s
        return workload.unit_forward_s, tuple(backward)

    return _per_workload(workload, ("seconds",), make)


def stage_costs(workload: Workload, layout: PipelineLayout) -> StageCosts:
    """Each stage's seconds for one micro-batch: forward, and backward split evenly into its input
    and weight gradients (the zero-bubble schedules run them apart)."""
    return _per_workload(
        workload, ("costs", layout.num_stages, layout.layers_per_stage), lambda: _costs(workload, layout)
    )


def _costs(workload: Workload, layout: PipelineLayout) -> StageCosts:
    unit_forward, unit_backward = unit_seconds(workload)
    forward, backward = [], []
    for stage in range(layout.num_stages):
        units = stage_units(layout, stage)
        forward.append(sum(unit_forward[u] for u in units))
        backward.append(sum(unit_backward[u] for u in units) / 2)
    return StageCosts(tuple(forward), tuple(backward), tuple(backward))
