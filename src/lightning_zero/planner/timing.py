"""Step time: compute from FLOPs, collectives from latency + bytes / bandwidth, and the overlap
the engine really achieves, simulated bucket by bucket. What a micro batch computes and how the
engine buckets it are ``workload.py``; a collective's cost on a link is ``hardware.py``.

[Note: step-time model] One optimizer step of one rank is

    A micro batches x (forward + backward)  +  optimizer step  +  post-step all-gather

- **Compute**: matmul FLOPs (per tp rank) at ``peak x mfu`` (bf16 peak for bf16-mixed, fp32 for
  32-true): forward ``2 N w`` per weight matrix of ``w`` elements and ``N`` tokens, backward
  ``4 N w``; causal attention ``2 B T^2 d / tp`` forward, twice that backward; activation
  checkpointing repeats each block's forward inside its backward. Embedding lookups and RMSNorm
  gains add no matmul FLOPs; element-wise work is inside the ``mfu`` assumption (calibrated on CPU).
- **Collectives**: ``factor(kind) x (steps x latency + logical_bytes / bandwidth)`` with ring
  ``steps = n - 1`` (twice for all-reduce) and ``logical_bytes`` as ``CommCounter`` counts them
  (both from ``lightning_zero/comm/ring.py``, [Note: ring bytes]);
  dp collectives use the inter-node link when the dp group spans nodes, tp collectives the
  intra-node one. ``factor`` is 1 unless a calibration measured otherwise.
- **Overlap, as the engine does it** (``zero/reducer.py``, ``zero/stage3/``): backward runs
  parameter by parameter in reverse registration order; a bucket's reduce-scatter (all-reduce for
  DDP) launches when its last gradient is ready, strictly in the reducer's launch order, one at a
  time on the link; stage 2/3 stall backward when ``pool_buffers(max_buckets_in_flight)`` bucket
  buffers (one more than may be in flight) are out (the oldest reduce-scatter must finish
  first), and every stage waits before launching a bucket while ``max_buckets_in_flight``
  reduce-scatters are in flight; everything still in flight when backward's
  compute ends is exposed (the last bucket at least). Stage 1 and stages 2-3 with
  ``defer_grad_reduce`` communicate on the last micro batch only; stages 2-3 without it on every
  micro batch (``zero.bucketing.keeps_full_grads``). Stage 3 all-gathers a unit (embedding, each block, final norm, head)
  before its forward and again before its backward, ``prefetch_blocks`` units ahead, on the same
  link. Tensor-parallel all-reduces block compute. After the optimizer step, stages 1-2
  all-gather the updated parameters: exposed (``overlap_param_gather=False``, today's engine) or
  hidden behind the next forward (``True``).
- **Overlap efficiency** ``e`` (hardware): what fraction of the time the simulation hides really
  is hidden. 1 on GPUs (collectives on their own streams and copy engines); measured on CPU,
  where gloo's threads share the core with compute. ``exposed = simulated_exposed + (1 - e) x
  simulated_hidden``.
- **Memory-bound work**: the optimizer step touches ``bytes_per_param`` (28 for fp32 AdamW, 40
  for bf16-mixed with its casts) per parameter it steps, at ``optimizer_gb_per_s`` (default: the
  memory bandwidth), and the gradient path moves :func:`gradient_path_bytes` per parameter per
  step at ``memory_gb_per_s``: what each stage does to a gradient between autograd and the
  optimizer (DDP's copies into its bucket and back, stage 1's zero-fill and accumulation in
  place, stage 2/3's copy into a pool buffer), which is where the stages differ.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

from lightning_zero.config import ZERO_DEFAULTS, CommPolicy
from lightning_zero.planner.hardware import Link, collective_seconds
from lightning_zero.planner.ledger import Hop
from lightning_zero.planner.workload import PlannedBucket, Workload, engine_buckets, gathered_once_units
from lightning_zero.zero.bucketing import keeps_full_grads, pool_buffers

# --------------------------------------------------------------------------------------------
# Simulating one micro batch
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One forward or backward: compute, collective time on the link, and what compute could not hide."""

    compute_s: float
    comm_s: float
    exposed_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.exposed_s


def _with_efficiency(compute_s: float, comm_s: float, simulated_exposed: float, efficiency: float) -> Phase:
    hidden = max(0.0, comm_s - simulated_exposed)
    return Phase(compute_s, comm_s, simulated_exposed + (1.0 - efficiency) * hidden)


def simulate_forward(
    workload: Workload, *, gather_s: Optional[Sequence[float]], prefetch: int, efficiency: float
) -> Phase:
    """Forward of one micro batch. ``gather_s`` (stage 3): each unit's all-gather time; unit ``u``'s
    pre-hook starts the gathers of ``u .. u + prefetch`` and waits for ``u``'s."""
    compute = workload.compute_forward_s
    if not gather_s:
        return Phase(compute, 0.0, 0.0)
    units = len(workload.unit_forward_s)
    t = link_free = 0.0
    gather_end: dict[int, float] = {}
    for unit in range(units):
        for ahead in range(unit, min(units, unit + prefetch + 1)):
            if ahead not in gather_end:
                link_free = max(t, link_free) + gather_s[ahead]
                gather_end[ahead] = link_free
        t = max(t, gather_end[unit]) + workload.unit_forward_s[unit]
    return _with_efficiency(compute, sum(gather_s), t - compute, efficiency)


def simulate_backward(
    workload: Workload,
    buckets: Sequence[PlannedBucket],
    bucket_s: Sequence[float],
    *,
    sync: bool,
    overlap_comm: bool,
    pool: Optional[int],
    gather_s: Optional[Sequence[float]],
    prefetch: int,
    efficiency: float,
    launch_cap: Optional[int] = None,
) -> Phase:
    """Backward of one micro batch (see [Note: step-time model]).

    ``buckets`` in launch order with their collective times ``bucket_s``; ``sync=False`` (a
    micro batch inside ``no_sync``) launches nothing. ``pool``: stage 2/3's bucket buffers,
    ``pool_buffers(max_buckets_in_flight)`` (``None``: full-size gradients, no pool). ``launch_cap``: the
    engine's limit on reduce-scatters in flight (every ZeRO stage: a launch first waits for the
    oldest; ``None``: no limit, DDP). ``gather_s`` (stage 3): per-unit all-gather time; units are
    reached in reverse, ``prefetch`` ahead; those gathered once a micro batch (:func:`gathered_once_units`)
    are gathered already.
    """
    tensors = workload.tensors
    compute = workload.compute_backward_s
    n_units = len(workload.unit_forward_s)
    t = link_free = 0.0
    comm = 0.0
    # stage 3: gathers in backward, units reached in reverse forward order
    gather_end: dict[int, float] = dict.fromkeys(gathered_once_units(workload), 0.0) if gather_s else {}
    reverse_units = list(range(n_units - 1, -1, -1))

    def reach(unit: int) -> None:
        nonlocal t, link_free, comm
        position = reverse_units.index(unit)
        for ahead in reverse_units[position : position + prefetch + 1]:
            if ahead not in gather_end:
                link_free = max(t, link_free) + gather_s[ahead]  # type: ignore[index]
                comm += gather_s[ahead]  # type: ignore[index]
                gather_end[ahead] = link_free
        t = max(t, gather_end[unit])

    bucket_of = {index: b for b, bucket in enumerate(buckets) for index in bucket.tensors}
    remaining = [len(bucket.tensors) for bucket in buckets]
    started = [False] * len(buckets)
    end: list[Optional[float]] = [None] * len(buckets)
    next_launch = 0
    in_flight: list[int] = []  # launched, not yet waited on (their buffers are still out)
    allocated = 0

    def launch(b: int) -> None:
        nonlocal link_free, comm, t, allocated
        while launch_cap is not None and len(in_flight) >= launch_cap:  # wait for the oldest first
            oldest = in_flight.pop(0)
            t = max(t, end[oldest])  # type: ignore[arg-type]
            if pool is not None:
                allocated -= 1
        link_free = max(t, link_free) + bucket_s[b]
        comm += bucket_s[b]
        end[b] = link_free
        in_flight.append(b)

    current_unit = None
    for index in range(len(tensors) - 1, -1, -1):  # gradients arrive in reverse registration order
        tensor = tensors[index]
        if gather_s and tensor.unit != current_unit:
            current_unit = tensor.unit
            reach(tensor.unit)
        t += tensor.backward_s
        if not sync:
            continue
        b = bucket_of[index]
        if pool is not None and not started[b]:
            while allocated >= pool and in_flight:  # _acquire: wait for the oldest reduce-scatter
                oldest = in_flight.pop(0)
                t = max(t, end[oldest])  # type: ignore[arg-type]
                allocated -= 1
            allocated += 1
        started[b] = True
        remaining[b] -= 1
        if overlap_comm:
            while next_launch < len(buckets) and remaining[next_launch] == 0:
                launch(next_launch)
                next_launch += 1
    if sync:  # finish_grad_sync: launch the rest in order, wait for everything
        while next_launch < len(buckets):
            launch(next_launch)
            next_launch += 1
        t = max([t, *(e for e in end if e is not None)])
    return _with_efficiency(compute, comm, t - compute, efficiency)


# --------------------------------------------------------------------------------------------
# The whole step
# --------------------------------------------------------------------------------------------


def gradient_path_bytes(stage: int, *, grad_bytes: int, dp: int, micro_batches: int, full_grads: bool) -> float:
    """Memory traffic per parameter per optimizer step between autograd's gradient and the
    optimizer (``grad_bytes`` = ``g`` per element; ``A`` micro batches):

    - DDP (stage 0; Lightning's default ``gradient_as_bucket_view=False``): micro batches after
      the first accumulate in ``param.grad`` (``3g`` each: read, read, write); the syncing one
      copies each gradient into its bucket and back after the all-reduce (``4g``) and divides the
      bucket by the world size (``2g``): ``3g (A - 1) + 6g``.
    - ``full_grads`` (stage 1, stages 2-3 with ``defer_grad_reduce``): the full buffer is zeroed once
      (``g``), every micro batch accumulates into its slot (``3g``), the owned chunk is divided
      in place (``2g / dp``): ``g + 3g A + 2g / dp``.
    - stage 2/3: every micro batch copies into a pool buffer (``2g``) and the owned chunk takes
      the reduced values (first: divided into it, ``2g / dp``; later: added, ``3g / dp``):
      ``2g A + (2 + 3 (A - 1)) g / dp``.
    """
    g, a = float(grad_bytes), micro_batches
    if stage == 0:
        return 3 * g * (a - 1) + 6 * g
    if full_grads:
        return g + 3 * g * a + 2 * g / dp
    return 2 * g * a + (2 + 3 * (a - 1)) * g / dp


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one rank, and where they go."""

    compute_s: float  # forward + backward FLOPs at peak x mfu (and blocking tp all-reduces), all micro batches
    tp_s: float  # the tp all-reduce part of compute_s
    dp_comm_s: float  # every dp collective's time on the link
    exposed_comm_s: float  # the part of it compute did not hide (incl. stalls on bucket buffers)
    optimizer_s: float  # the optimizer step (memory-bound)
    grad_copy_s: float  # the gradient path's memory traffic (gradient_path_bytes; memory-bound)
    post_step_gather_s: float  # stages 1-2: the parameter all-gather after the step (exposed part)
    tokens_per_step: int  # over all dp ranks
    model_flops_per_rank: float  # 6 P N + attention per rank per step, recompute excluded (for MFU)
    peak_flops: float
    world_size: int
    forward: Phase = field(default_factory=lambda: Phase(0.0, 0.0, 0.0))
    backward_sync: Phase = field(default_factory=lambda: Phase(0.0, 0.0, 0.0))
    backward_no_sync: Phase = field(default_factory=lambda: Phase(0.0, 0.0, 0.0))
    # seconds each link class carries dp collectives per step (their sum is dp_comm_s; "dp" when
    # the caller gave one link without a class)
    comm_s_by_link: tuple[tuple[str, float], ...] = ()
    overhead_s: float = 0.0  # fixed per-step work the model does not count (hardware.step_overhead_s)
    # pp > 1: the seconds this rank waits in the pipeline's bubble per step (planner/pipeline.py)
    pipeline_bubble_s: float = 0.0

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.exposed_comm_s
            + self.optimizer_s
            + self.grad_copy_s
            + self.post_step_gather_s
            + self.overhead_s
            + self.pipeline_bubble_s
        )

    def link_s(self, link: str) -> float:
        """Seconds of dp collectives on ``link`` (``"intra_node"`` / ``"inter_node"``) per step."""
        return dict(self.comm_s_by_link).get(link, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second per rank over the peak."""
        return self.model_flops_per_rank / self.step_s / self.peak_flops

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.update(step_s=self.step_s, tokens_per_s=self.tokens_per_s, mfu=self.mfu)
        return values


@dataclass(frozen=True)
class DomainHops:
    """How one ZeRO domain's buckets travel: the ranks it shards over and the hops that reduce its
    gradients and gather its parameters, each on its own link class
    (:meth:`~lightning_zero.planner.ledger.DpTopology.grad_hops`: hybrid sharding, hierarchical
    reduction, compressed wire formats)."""

    shard: int
    grad_hops: Sequence[Hop]
    gather_hops: Sequence[Hop]


@dataclass(frozen=True)
class ZeroSchedule:
    """What the engine does with one step's gradients and parameters: ZeRO ``stage`` (0 =
    Lightning DDP) over ``dp`` ranks, the wire bytes per element, the bucket size, the resolved
    ``defer_grad_reduce`` and stage 3's ``prefetch_blocks``, the optimizer's bytes touched per
    parameter it steps. ``dense``: the dense domain's hops (``None``: one ring over ``dp`` on the
    machine's ``dp_link``); ``experts``: the expert domain's ([Note: expert domain] in
    ``zero/domains.py``; ``None``: no expert domain)."""

    stage: int
    dp: int
    grad_bytes: int
    param_bytes: int
    bucket_numel: int
    defer_grad_reduce: bool = False
    prefetch_blocks: int = ZERO_DEFAULTS.prefetch_blocks
    optimizer_bytes_per_param: float = 28.0
    dense: Optional[DomainHops] = None
    experts: Optional[DomainHops] = None

    def dense_hops(self) -> DomainHops:
        """``dense``, or one ring over ``dp`` ranks on the ``"dp"`` link."""
        if self.dense is not None:
            return self.dense
        if self.dp == 1:
            return DomainHops(1, [], [])
        kind = "all_reduce" if self.stage == 0 else "reduce_scatter"
        grads = [Hop(kind, self.dp, 1.0, "dp", None, self.grad_bytes)]
        return DomainHops(self.dp, grads, [Hop("all_gather", self.dp, 1.0, "dp", None, self.param_bytes)])


@dataclass(frozen=True)
class MachineCosts:
    """What the machine charges: ``dp_link`` (the ``"dp"`` link of a one-ring schedule), the link
    classes the hops name, the overlap ``efficiency``, memory and optimizer bandwidth, the fixed
    ``overhead_s`` once per step and the ``peak_flops`` MFU is measured against."""

    dp_link: Link
    links: Mapping[str, Link] = field(default_factory=dict)
    efficiency: float = 1.0
    memory_bytes_per_s: float = math.inf
    optimizer_bytes_per_s: Optional[float] = None
    overhead_s: float = 0.0
    peak_flops: float = 1.0


@dataclass(frozen=True)
class StepCount:
    """What a step produces, for tokens/s and MFU: tokens over all dp ranks, model FLOPs per rank."""

    tokens_per_step: int = 0
    model_flops_per_rank: float = 0.0
    world_size: int = 1


def step_time(
    workload: Workload,
    schedule: ZeroSchedule,
    comm: CommPolicy,
    machine: MachineCosts,
    *,
    micro_batches: int,
    produced: StepCount = StepCount(),
) -> StepTime:
    """Simulate one optimizer step of ``workload`` under ``schedule`` with ``comm``'s overlap
    (``overlap_comm``, ``max_buckets_in_flight``, ``overlap_param_gather``: a
    ``ZeroConfig.communication``) on ``machine``.

    Every bucket's reduction is its domain's hops run one after another, each on
    ``machine.links[hop.link]``, and ZeRO shards each domain over its ``shard`` ranks.
    ``machine.overhead_s`` is added once per optimizer step.
    """
    stage, grad_bytes = schedule.stage, schedule.grad_bytes
    dense = schedule.dense_hops()
    experts = schedule.experts or dense
    shard, expert_shard = dense.shard, schedule.experts.shard if schedule.experts else None
    grad_hops, gather_hops = dense.grad_hops, dense.gather_hops
    prefetch_blocks, defer_grad_reduce = schedule.prefetch_blocks, schedule.defer_grad_reduce
    overlap_comm, max_buckets_in_flight = comm.overlap_comm, comm.max_buckets_in_flight
    efficiency, memory_bytes_per_s = machine.efficiency, machine.memory_bytes_per_s
    buckets = engine_buckets(
        workload, stage=stage, bucket_numel=schedule.bucket_numel, dp=shard, grad_bytes=grad_bytes,
        expert_dp=expert_shard,
    )  # fmt: skip
    link_of = dict(machine.links)
    link_of.setdefault("dp", machine.dp_link)
    seconds: dict[tuple[int, int], tuple[float, dict[str, float]]] = {}  # buckets repeat their sizes

    def hops_seconds(hops: Sequence[Hop], numel: int) -> tuple[float, dict[str, float]]:
        key = (id(hops), numel)
        if key not in seconds:
            per_link: dict[str, float] = {}
            for hop in hops:
                spent = collective_seconds(hop.kind, hop.payload_bytes(numel), hop.ranks, link_of[hop.link])
                per_link[hop.link] = per_link.get(hop.link, 0.0) + spent
            seconds[key] = (sum(per_link.values()), per_link)
        return seconds[key]

    by_link: dict[str, float] = {}

    def tally(per_link: Mapping[str, float], times: float) -> None:
        for link, spent in per_link.items():
            by_link[link] = by_link.get(link, 0.0) + times * spent

    grads_of = {False: grad_hops, True: experts.grad_hops}
    gathers_of = {False: gather_hops, True: experts.gather_hops}
    bucket_s = [hops_seconds(grads_of[b.expert], b.numel)[0] for b in buckets]
    gather_s = None
    if stage == 3:
        per_unit = [0.0] * len(workload.unit_forward_s)
        for bucket in buckets:
            unit = workload.tensors[bucket.tensors[0]].unit
            per_unit[unit] += hops_seconds(gathers_of[bucket.expert], bucket.numel)[0]
        gather_s = per_unit
    full_grads = keeps_full_grads(stage, defer_grad_reduce)  # [Note: deferred gradient reduction]
    pool = None if full_grads else pool_buffers(max_buckets_in_flight)
    common = dict(
        overlap_comm=overlap_comm,
        pool=pool,
        gather_s=gather_s,
        prefetch=prefetch_blocks,
        efficiency=efficiency,
        launch_cap=max_buckets_in_flight if stage >= 1 else None,
    )
    forward = simulate_forward(workload, gather_s=gather_s, prefetch=prefetch_blocks, efficiency=efficiency)
    backward_sync = simulate_backward(workload, buckets, bucket_s, sync=bool(grad_hops), **common)
    every_micro_batch = not full_grads
    backward_no_sync = (
        backward_sync if every_micro_batch else simulate_backward(workload, buckets, bucket_s, sync=False, **common)
    )
    syncing = micro_batches if every_micro_batch else 1
    quiet = micro_batches - syncing
    compute = micro_batches * (forward.compute_s + backward_sync.compute_s)
    exposed = micro_batches * forward.exposed_s + syncing * backward_sync.exposed_s + quiet * backward_no_sync.exposed_s
    dp_comm = micro_batches * forward.comm_s + syncing * backward_sync.comm_s + quiet * backward_no_sync.comm_s
    sizes = Counter((bucket.numel, bucket.expert) for bucket in buckets)  # few distinct sizes: tally each once
    if grad_hops:
        for (numel, expert), count in sizes.items():
            tally(hops_seconds(grads_of[expert], numel)[1], count * syncing)
    if stage == 3 and gather_hops:
        once = gathered_once_units(workload)  # gathered before each forward, again before each backward but these
        gathers = Counter((b.numel, b.expert, 1 if workload.tensors[b.tensors[0]].unit in once else 2) for b in buckets)
        for (numel, expert, times), count in gathers.items():
            tally(hops_seconds(gathers_of[expert], numel)[1], count * times * micro_batches)
    post = 0.0
    if stage in (1, 2) and gather_hops:
        gather = sum(count * hops_seconds(gathers_of[expert], numel)[0] for (numel, expert), count in sizes.items())
        for (numel, expert), count in sizes.items():
            tally(hops_seconds(gathers_of[expert], numel)[1], count)
        dp_comm += gather
        hidden = efficiency * min(gather, forward.compute_s) if comm.overlap_param_gather else 0.0
        post = gather - hidden
    local_numel = sum(t.numel for t in workload.tensors)
    expert_numel = sum(t.numel for t in workload.tensors if t.expert) if expert_shard else 0
    stepped = (local_numel - expert_numel) / shard + expert_numel / (expert_shard or 1) if stage >= 1 else local_numel
    return StepTime(
        compute_s=compute,
        tp_s=micro_batches * workload.tp_s,
        dp_comm_s=dp_comm,
        exposed_comm_s=exposed,
        optimizer_s=schedule.optimizer_bytes_per_param
        * stepped
        / (machine.optimizer_bytes_per_s or memory_bytes_per_s),
        grad_copy_s=gradient_path_bytes(
            stage,
            grad_bytes=grad_bytes,
            dp=shard,
            micro_batches=micro_batches,
            full_grads=full_grads,
        )
        * local_numel
        / memory_bytes_per_s,
        post_step_gather_s=post,
        tokens_per_step=produced.tokens_per_step,
        model_flops_per_rank=produced.model_flops_per_rank,
        peak_flops=machine.peak_flops,
        world_size=produced.world_size,
        forward=forward,
        backward_sync=backward_sync,
        backward_no_sync=backward_no_sync,
        comm_s_by_link=tuple(sorted(by_link.items())),
        overhead_s=float(machine.overhead_s),
    )
