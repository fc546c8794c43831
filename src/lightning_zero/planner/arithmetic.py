"""Predict, before launch, what every rank holds, sends and spends per step for a run.

:func:`plan` is pure arithmetic on a model config (formulas in :mod:`lightning_zero.planner.ledger`,
:mod:`lightning_zero.planner.timing`, :mod:`lightning_zero.planner.workload` and docs/planner.md),
given the run whole: the knobs (``ZeroConfig``), the layout (``ParallelDims``), the run's shape
(:class:`RunShape`) and the planner's options (:class:`PlanOptions`). It never builds the model, so
a 70B plan takes milliseconds. :func:`plan_run` is the same plan from keywords (each put in the
object holding it, :func:`plan_inputs`); :func:`compare_stages` lays stages
0-3 side by side for one run.

[Note: what a plan counts] Per rank, at the peak of one training step (the start of backward):
model states (ZeRO paper), the engine's extra buffers (stage 2/3 gradient bucket buffers in
flight, stage 3 gathered blocks), activations saved for backward (or checkpointed block inputs
plus one recomputed block) and the loss. Stages 2-3 copy each gradient autograd produces into a
bucket buffer and drop it, so during backward one full gradient of the largest parameter (a
gathered unit's embedding or head) lives beside the buckets (``param_grad``; stage 1 and
deferred stage 2 let autograd write into the buckets: none), so stage 3's working set is a unit
gathered, the prefetched one, that gradient and the buckets (measured against the plan in
docs/planner.md and docs/benchmarks.md). Not counted: the CUDA context and allocator slack
(``plan.reserved_gib`` is set aside for them), transient activation gradients (a few
``B x T x dim`` tensors), temporaries of the optimizer step, and the data loader.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import POLICY_KNOBS, ZERO_DEFAULTS, LayoutPolicy, ZeroConfig, resolve_bucket_mb
from lightning_zero.cp.layout import RingLayout, check_context_parallel, layout_notice
from lightning_zero.models.checkpointing import checkpointing_mode
from lightning_zero.planner.fit import PlanInputs, suggest_fixes
from lightning_zero.planner.hardware import Hardware, load_hardware
from lightning_zero.planner.ledger import (
    ATTENTION_KERNELS,
    ActivationBytes,
    DpTopology,
    dp_topology,
    grad_bytes_per_param,
    llama_activation_bytes,
    model_state_bytes,
    precision_bytes,
)
from lightning_zero.planner.muon import PLANNED_OPTIMIZERS, with_muon
from lightning_zero.planner.pipeline import (
    LOSS_TOTAL_WEIGHT_BYTES,
    PipelinePlan,
    StageShape,
    plan_pipeline,
    resolve_layout,
    stage_costs,
    stage_workload,
    unit_param_counts,
)
from lightning_zero.planner.plan import GiB, MemoryPerRank, Plan, TrafficPerRank
from lightning_zero.planner.resolved import ResolvedRun, spans_nodes
from lightning_zero.planner.timing import StepTime, step_time
from lightning_zero.planner.traffic import traffic_per_rank
from lightning_zero.planner.workload import engine_buckets, gathered_numel, is_moe, llama_workload, training_flops
from lightning_zero.zero.bucketing import bucket_numel_for_bytes, defer_grad_reduce_at, keeps_full_grads, pool_buffers

STAGES = (0, 1, 2, 3)
DEFAULT_MFU = 0.4


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(where: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive int, got {name}={value!r}")


# --------------------------------------------------------------------------------------------
# Inputs: precision
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


# The plan_run keyword of each ZeroConfig knob the planner reads (its field name, but ``tp``); the
# others (offload_optimizer, monitor, collective_timeout, async_checkpoint and the object-storage
# knobs storage_options, upload_threads, upload_stall_s) change no predicted byte or second.
PLANNED_KNOBS = {
    "stage": "stage",
    "tp": "tensor_parallel_size",
    "sequence_parallel": "sequence_parallel",
    "bucket_mb": "bucket_mb",
    "prefetch_blocks": "prefetch_blocks",
    "defer_grad_reduce": "defer_grad_reduce",
    "overlap_comm": "overlap_comm",
    "max_buckets_in_flight": "max_buckets_in_flight",
    "overlap_param_gather": "overlap_param_gather",
    "shard_size": "shard_size",
    "hierarchical_reduce": "hierarchical_reduce",
    "grad_comm_dtype": "grad_comm_dtype",
    "param_comm_dtype": "param_comm_dtype",
    "reduce_dtype": "reduce_dtype",
    "master_weights": "master_weights",
    "cp": "cp",
    "ep": "ep",
    "mixed_params": "mixed_params",
    "pp": "pp",
    "pp_schedule": "pp_schedule",
    "pp_virtual_stages": "pp_virtual_stages",
    "pp_layers": "pp_layers",
    "pp_microbatches": "pp_microbatches",
}


def _given_knobs(function: Any, arguments: Mapping[str, Any], names: Any) -> list[str]:
    """Which of ``names`` the call set to something other than ``function``'s default."""
    parameters = inspect.signature(function).parameters
    return [name for name in names if arguments[name] != parameters[name].default]


# --------------------------------------------------------------------------------------------
# What a plan takes: the model, the knobs (ZeroConfig), the layout (ParallelDims), the run's
# shape and the planner's options, each passed whole
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunShape:
    """What a planned run is besides its layout (``ParallelDims``) and its knobs (``ZeroConfig``):
    the precision and the batch each rank computes. Construction validates (``ValueError`` naming
    the field).

    Args:
        precision: ``"bf16-mixed"`` (2 + 2 + 12 bytes/param), ``"16-mixed"`` and ``"32-true"``
            (4 + 4 + 8) or ``"bf16-true"`` / ``"16-true"`` (2 + 2 + 4: bf16 optimizer state, no
            master), under ``ZeroConfig.master_weights`` / ``mixed_params``;
            ``ledger.precision_bytes`` is the rule.
        micro_batch: samples per rank per forward (per cp group under context parallelism);
            ``seq_len`` tokens each (``None``: the model's ``max_seq_len``).
        activation_checkpointing: ``False``/``"none"``, ``"selective"`` (recompute attention's
            core) or ``True``/``"full"`` (keep only each block's input and recompute it in
            backward); [Note: checkpointing modes] in ``lightning_zero/models/checkpointing.py``.
            Held as the mode's name.
        accumulate_grad_batches: micro batches per optimizer step.
        attention: ``"fused"`` (SDPA flash kernels, what the model runs) or ``"math"``.
        optimizer: ``"adamw"`` or ``"muon"`` (``torch.optim.Muon`` for a Llama's hidden matrices,
            AdamW for the rest: the owners' Newton-Schulz, their exchange and the momenta by
            ownership, ``planner/muon.py``; docs/optimizers.md).
    """

    precision: str = "bf16-mixed"
    micro_batch: int = 1
    seq_len: Optional[int] = None
    activation_checkpointing: Union[bool, str] = False
    accumulate_grad_batches: int = 1
    attention: str = "fused"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        _check_positive("RunShape", micro_batch=self.micro_batch, accumulate_grad_batches=self.accumulate_grad_batches)
        if self.seq_len is not None:
            _check_positive("RunShape", seq_len=self.seq_len)
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"RunShape: attention must be one of {ATTENTION_KERNELS}, got attention={self.attention!r}"
            )
        if self.optimizer not in PLANNED_OPTIMIZERS:
            raise ValueError(
                f"RunShape: optimizer must be one of {PLANNED_OPTIMIZERS}, got optimizer={self.optimizer!r}"
            )
        mode = checkpointing_mode(self.activation_checkpointing, "RunShape: activation_checkpointing")
        object.__setattr__(self, "activation_checkpointing", mode)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan. Construction validates (``ValueError`` naming the field).

    Args:
        hardware: a name in ``conf/hardware``, a YAML path, a mapping or a ``Hardware`` (default:
            ``conf/config.yaml``'s).
        mfu: model FLOPs utilization assumed for compute, in (0, 1] (``None``: the hardware's
            calibrated ``mfu``, else 0.4).
        reserved_gib: per-GPU memory not available to tensors (CUDA context, allocator slack).
        suggest: when the plan does not fit, search for changes that would make it fit
            (``Plan.suggestions``, ``fit.py``).
        simulate: simulate the step (``False``: bytes only, seconds 0; ``"if_fits"``: only when it
            fits, what the layout search does).
    """

    hardware: Union[str, Hardware, Mapping[str, Any], None] = None
    mfu: Optional[float] = None
    reserved_gib: float = 2.0
    suggest: bool = True
    simulate: Union[bool, str] = True

    def __post_init__(self) -> None:
        if not isinstance(self.simulate, (bool, str)) or self.simulate not in (True, False, "if_fits"):
            raise ValueError(f"PlanOptions: simulate must be True, False or 'if_fits', got simulate={self.simulate!r}")
        if not _is_number(self.reserved_gib) or self.reserved_gib < 0:
            raise ValueError(f"PlanOptions: reserved_gib must be a number >= 0, got reserved_gib={self.reserved_gib!r}")
        if not isinstance(self.suggest, bool):
            raise ValueError(f"PlanOptions: suggest must be True or False, got suggest={self.suggest!r}")
        if self.mfu is not None and (not _is_number(self.mfu) or not 0 < self.mfu <= 1):
            raise ValueError(f"PlanOptions: mfu must be in (0, 1], got mfu={self.mfu!r}")


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunShape))
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def ddp_layout(config: ZeroConfig, dims: ParallelDims) -> tuple[ZeroConfig, ParallelDims]:
    """Lightning's DDP on the ranks of ``dims``: every rank a data-parallel rank (no tensor, context
    or expert parallelism, no hybrid sharding, nothing compressed, no deferred reduction), with the
    knobs DDP shares with ZeRO (``bucket_mb``, ``overlap_comm``, ``reduce_dtype``, the precision
    knobs) as ``config`` has them. What ``plan(..., ddp=True)`` plans."""
    plain_layout = {name: getattr(ZERO_DEFAULTS, name) for name in POLICY_KNOBS[LayoutPolicy]}  # tp = cp = ep = 1
    plain = dataclasses.replace(
        config, stage=1, defer_grad_reduce=False, grad_comm_dtype=None, param_comm_dtype=None, **plain_layout
    )
    return plain, ParallelDims.from_config(plain, world_size=dims.world_size, devices_per_node=dims.devices_per_node)


def resolve_model(model_config: Any) -> Any:
    """A ``LlamaConfig`` or a ``MoEConfig`` (``models/moe/config.py``) from either, a preset name or
    a mapping (a preset ``name`` plus overrides): the planner plans both families."""
    from lightning_zero.models import LlamaConfig, resolve_config
    from lightning_zero.models.moe.config import MoEConfig, moe_preset_names, resolve_moe_config

    if isinstance(model_config, (LlamaConfig, MoEConfig)):
        return model_config
    name = model_config.get("name") if isinstance(model_config, Mapping) else model_config
    if str(name).lower() in moe_preset_names():
        return resolve_moe_config(model_config)
    return resolve_config(model_config)


def check_model_layout(model: Any, dims: ParallelDims, *, seq_len: Optional[int] = None) -> None:
    """The model-dependent layout checks the runtime makes before any process group starts
    (``runtime/parallelize.py``, [Note: layouts a model declares]), on the model's shape: ``tp`` divides
    the heads (``ParallelDims.validate``); a mixture of experts' experts divide by ``ep`` and its
    family's limits (``check_moe_layout``, what ``MoELM.check_parallel_dims`` calls), and under
    ``tp > 1`` its MoE layers' sequence shards split ``seq_len`` evenly; a model without experts
    takes no ``ep``. ``ValueError`` naming the fix."""
    dims.validate(model)
    if is_moe(model):
        from lightning_zero.models.moe.config import check_moe_layout

        check_moe_layout(model, ep=dims.ep, tp=int(dims.tp))
        if seq_len is not None and seq_len % int(dims.tp):
            raise ValueError(
                f"plan: seq_len({seq_len}) does not split over tp({dims.tp}): the MoE layers of {model.name!r} run on"
                " sequence shards of T/tp tokens; pick a seq_len divisible by tp or tensor_parallel_size=1"
            )
    elif dims.ep > 1:
        raise ValueError(
            f"plan: ep={dims.ep} but the model {model.name!r} has no expert layers to split; use ep=1 or a"
            " mixture-of-experts model (models/moe)"
        )


def expert_topology(dims: ParallelDims) -> DpTopology:
    """The edp group as a ZeRO shard group (expert parameters are sharded and reduced over it,
    [Note: expert groups] in ``comm/mesh.py``): ``edp`` ranks, stride ``ep`` inside the dense group,
    so a node holds ``edp / nodes spanned`` of them; no hybrid sharding of experts."""
    ranks = dims.edp_ranks(0)
    nodes = len({rank // dims.devices_per_node for rank in ranks})
    return DpTopology(dp=dims.edp, dp_per_node=dims.edp // nodes, shard_size=dims.edp)


def plan(
    model_config: Any,
    config: ZeroConfig,
    dims: ParallelDims,
    run: RunShape = RunShape(),
    options: PlanOptions = PlanOptions(),
    *,
    ddp: bool = False,
) -> Plan:
    """Predict one rank's bytes (held and sent) and step time for a run; allocates nothing.

    The run is given whole, as the runtime holds it: the model (a ``LlamaConfig`` or a preset
    name such as ``"70b"``), the knobs (``config``: what ``ZeroStrategy`` passes its engine; each
    is read where it is used, as the engine reads it), the layout (``dims``:
    ``ParallelDims.from_config(config, world_size=..., devices_per_node=...)``, what the session
    builds its groups from), the run's shape (:class:`RunShape`) and the planner's options
    (:class:`PlanOptions`). ``ddp=True`` plans Lightning's DDP on the same ranks instead
    (:func:`ddp_layout`: plain data parallelism, stage 0).

    Raises ``ValueError`` when ``dims`` is not the layout ``config`` asks for (its ``tp``,
    ``shard_size``, ``hierarchical_reduce``, ``cp``, ``ep``), for a layout the model does not split
    into (:func:`check_model_layout`, ``cp.layout.check_context_parallel``: a layout whose query
    heads do not split over ``tp * cp`` is planned with ring attention, as the engine runs it), and for a run the model cannot take
    (a ``seq_len`` above its ``max_seq_len``, sequence parallelism whose ``tp`` does not divide it).
    """
    resolved = resolve_run(model_config, config, dims, run, options, ddp=ddp)
    pipelined = pipelined_rank(resolved) if dims.pp > 1 else None
    if pipelined is not None:
        resolved, memory, acts = pipelined.resolved, pipelined.memory, pipelined.acts
    else:
        memory, acts = memory_per_rank(resolved)
    model_flops = (
        resolved.micro_batches
        * training_flops(
            resolved.model, micro_batch=resolved.micro_batch, seq_len=resolved.seq_len, tp=resolved.tp, cp=dims.cp
        )
        / dims.pp
    )
    simulated = None
    fits = memory.total <= resolved.hw.memory_bytes - resolved.reserved_bytes
    if options.simulate is True or (options.simulate == "if_fits" and fits):
        simulated = step_time(
            resolved.workload,
            resolved.schedule(),
            resolved.config.communication,
            resolved.machine(),
            micro_batches=resolved.micro_batches,
            produced=resolved.produced(model_flops),
        )
    if pipelined is None:
        planned = assemble_plan(resolved, memory, acts, traffic_per_rank(resolved, simulated), simulated)
    else:
        planned = pipelined.assemble(simulated, run.accumulate_grad_batches)
    if run.optimizer == "muon":  # planner/muon.py; pp > 1: the matrices of this rank's blocks
        planned = with_muon(planned, resolved if pipelined is None else pipelined.blocks_run())
    if options.suggest and not planned.fits:
        options = dataclasses.replace(options, hardware=resolved.hw)
        fixes = suggest_fixes(
            planned, PlanInputs(plan, resolved.model, resolved.config, resolved.dims, run, options, ddp)
        )
        planned = dataclasses.replace(planned, suggestions=tuple(fixes))
    return planned


def resolve_run(
    model_config: Any, config: ZeroConfig, dims: ParallelDims, run: RunShape, options: PlanOptions, *, ddp: bool
) -> ResolvedRun:
    """:func:`plan`'s first step: check the layout and the run against the model, and resolve what
    every later step reads (:class:`~lightning_zero.planner.resolved.ResolvedRun`)."""
    asked = ParallelDims.from_config(config, world_size=dims.world_size, devices_per_node=dims.devices_per_node)
    if asked != dims:
        raise ValueError(f"plan: {dims} is not the layout the ZeroConfig asks for on its ranks ({asked})")
    if ddp:
        config, dims = ddp_layout(config, dims)
    model = resolve_model(model_config)
    stage = 0 if ddp else config.stage
    seq_len = int(run.seq_len or model.max_seq_len)
    check_model_layout(model, dims, seq_len=seq_len)
    tp, cp = int(dims.tp), dims.cp
    # the engine's rule: Ulysses where tp * cp divides the query heads, else ring attention
    cp_layout = (
        check_context_parallel(
            cp, tp=tp, model_config=model, seq_len=seq_len, sequence_parallel=config.sequence_parallel
        )
        if cp > 1
        else None
    )
    if config.sequence_parallel and seq_len % tp != 0:
        raise ValueError(
            f"plan: sequence_parallel needs tp dividing seq_len, got tp={tp}, seq_len={seq_len}; "
            "set sequence_parallel=False or change tensor_parallel_size / data.seq_len"
        )
    if seq_len > model.max_seq_len:
        raise ValueError(
            f"plan: seq_len({seq_len}) exceeds the model's max_seq_len({model.max_seq_len}); "
            "lower data.seq_len or raise model.max_seq_len"
        )
    hw = load_hardware(options.hardware)
    mfu = options.mfu if options.mfu is not None else hw.mfu if hw.mfu is not None else DEFAULT_MFU
    knobs = config.precision_knobs
    # The gradient bytes per element of the buffers and the reduce-scatter (reduce_dtype).
    dtype = dataclasses.replace(
        precision_bytes(run.precision, knobs.master_weights, knobs.mixed_params),
        grad=grad_bytes_per_param(run.precision, knobs.reduce_dtype, knobs.mixed_params),
    )
    peak = hw.peak_fp32_flops if str(run.precision).startswith("32") else hw.peak_bf16_flops
    workload = llama_workload(
        model,
        micro_batch=run.micro_batch,
        seq_len=seq_len,
        tp=tp,
        activation_checkpointing=str(run.activation_checkpointing),
        flops_per_s=peak * mfu,
        tp_link=hw.link(inter_node=False),
        act_bytes=dtype.activation,
        sequence_parallel=config.sequence_parallel,
        cp=cp,
        cp_link=hw.link(inter_node=spans_nodes(dims, dims.cp_ranks(0))),
        ep=dims.ep,
        ep_link=hw.link(inter_node=spans_nodes(dims, dims.ep_ranks(0))),
    )
    # with ep > 1 the expert parameters are a ZeRO domain of their own over edp ([Note: expert domain])
    expert_params = workload.expert_numel if dims.ep > 1 else 0
    bucket_mb = resolve_bucket_mb(config.bucket_mb, workload.numel * dtype.grad)  # as the engine sizes it
    topology = dp_topology(
        dp=dims.dp_cp,
        devices_per_node=dims.devices_per_node,
        tp=tp,
        shard_size=dims.shard_size,
        hierarchical_reduce=dims.hierarchical_reduce,
    )
    shard_ranks = topology.shard_size
    return ResolvedRun(
        model=model,
        config=config,
        dims=dims,
        run=run,
        tp=tp,
        checkpointing=str(run.activation_checkpointing),
        micro_batch=run.micro_batch,
        micro_batches=run.accumulate_grad_batches,
        stage=stage,
        defer_grad_reduce=defer_grad_reduce_at(stage, config.defer_grad_reduce),  # stage 1 always defers
        seq_len=seq_len,
        dtype=dtype,
        hw=hw,
        mfu=float(mfu),
        peak=peak,
        workload=workload,
        topology=topology,
        experts=expert_topology(dims) if dims.ep > 1 else None,
        padded=math.ceil((workload.numel - expert_params) / shard_ranks) * shard_ranks,  # dense, as the ledger pads
        expert_padded=math.ceil(expert_params / dims.edp) * dims.edp,
        bucket_mb=float(bucket_mb),
        bucket_numel=bucket_numel_for_bytes(bucket_mb, dtype.grad),
        cp_layout=cp_layout,
        reserved_bytes=int(options.reserved_gib * GiB),
    )


@dataclass(frozen=True)
class PipelinedRank:
    """The pp rank a pipelined plan describes (the one holding the most bytes, of the first and
    the last: the middle ranks hold no more blocks and fewer micro-batches than the first), its run
    cut to its stages, its memory, and the pipeline's plan (planner/pipeline.py)."""

    resolved: ResolvedRun
    memory: MemoryPerRank
    acts: ActivationBytes
    pipeline: PipelinePlan
    pp_rank: int
    idle_s: float  # seconds this rank waits per pipeline pass (the trace's makespan - its busy time)
    full: ResolvedRun  # the whole model's run

    def blocks_run(self) -> ResolvedRun:
        """This rank's run with a model of only its blocks (what per-block rules such as Muon's
        matrices read)."""
        blocks = self.pipeline.ranks[self.pp_rank].blocks
        return dataclasses.replace(self.resolved, model=dataclasses.replace(self.resolved.model, n_layers=blocks))

    def assemble(self, simulated: Optional[StepTime], accumulate: int) -> Plan:
        """The :class:`Plan` of this rank: the step time carries the bubble (``accumulate`` passes)."""
        r, full, pipeline = self.resolved, self.full, self.pipeline
        if simulated is not None:
            simulated = dataclasses.replace(simulated, pipeline_bubble_s=accumulate * self.idle_s)
        share = pipeline.ranks[self.pp_rank].blocks / full.model.n_layers
        stage = pipeline.ranks[self.pp_rank]
        traffic = scale_activation_traffic(traffic_per_rank(r, simulated), share)
        traffic = dataclasses.replace(
            traffic, pp_sent_bytes=float(stage.p2p_sent * accumulate),
            pp_received_bytes=float(stage.p2p_received * accumulate), pp_link=r.link_name(r.dims.pp_ranks(0)),
        )  # fmt: skip
        planned = assemble_plan(r, self.memory, self.acts, traffic, simulated)
        return dataclasses.replace(
            planned, num_params=full.model.num_params(), accumulate_grad_batches=accumulate, pp=pipeline.pp,
            pp_schedule=pipeline.schedule, pp_virtual_stages=pipeline.virtual_stages,
            pp_microbatches=pipeline.microbatches, pp_layers=pipeline.layers_per_stage,
            bubble_fraction=pipeline.bubble_fraction, pp_rank=self.pp_rank, pipeline=pipeline,
        )  # fmt: skip


def scale_activation_traffic(traffic: TrafficPerRank, share: float) -> TrafficPerRank:
    """The tp / cp / ep bytes and the FLOPs of a pp rank holding ``share`` of the blocks, from the
    whole model's (every block sends the same; the embeddings' and head's few tp bytes go with them)."""

    def scaled(kinds: dict[str, float]) -> dict[str, float]:
        return {kind: value * share for kind, value in kinds.items()}

    return dataclasses.replace(
        traffic, tp_all_reduce_bytes=traffic.tp_all_reduce_bytes * share, tp_bytes_by_kind=scaled(traffic.tp_bytes_by_kind),
        cp_all_to_all_bytes=traffic.cp_all_to_all_bytes * share, cp_bytes_by_kind=scaled(traffic.cp_bytes_by_kind),
        ep_bytes_by_kind=scaled(traffic.ep_bytes_by_kind), flops_per_rank=traffic.flops_per_rank * share,
    )  # fmt: skip


def with_workload(resolved: ResolvedRun, workload: Any, micro_batches: int) -> ResolvedRun:
    """``resolved`` for another ``workload`` (a pp rank's stages): what ZeRO pads, shards and buckets
    follows it, as :func:`resolve_run` sizes them."""
    r, shard_ranks = resolved, resolved.topology.shard_size
    expert_params = workload.expert_numel if r.dims.ep > 1 else 0
    bucket_mb = resolve_bucket_mb(r.config.bucket_mb, workload.numel * r.dtype.grad)
    return dataclasses.replace(
        r, workload=workload, micro_batches=micro_batches,
        padded=math.ceil((workload.numel - expert_params) / shard_ranks) * shard_ranks,
        expert_padded=math.ceil(expert_params / r.dims.edp) * r.dims.edp,
        bucket_mb=float(bucket_mb), bucket_numel=bucket_numel_for_bytes(bucket_mb, r.dtype.grad),
    )  # fmt: skip


def pipelined_rank(resolved: ResolvedRun) -> PipelinedRank:
    """``pp > 1``: the pipeline's layout and plan (``planner/pipeline.py``), and the pp rank holding
    the most bytes with its run and memory: its stages' model states, the activations its schedule
    keeps in flight (plus one block's recompute; the logits' peak on the last stage)."""
    r, dims, model = resolved, resolved.dims, resolved.model
    if getattr(model, "tie_embeddings", False):
        raise ValueError(
            f"plan: {model.name!r} ties its embedding to its head (tie_embeddings=True) and pp={dims.pp} puts them"
            " on different ranks: plan it with pp=1, or untie the head"
        )
    layout = resolve_layout(r.config, r.workload, model.n_layers)
    _, acts = memory_per_rank(r)  # one micro-batch's per-block ledger
    shape = StageShape(
        micro_batch=r.micro_batch, seq_len=r.seq_len, dim=model.dim, act_bytes=r.dtype.activation, tp=r.tp,
        cp=dims.cp,
    )  # fmt: skip
    costs = stage_costs(r.workload, layout)
    link = r.hw.link(inter_node=spans_nodes(dims, dims.pp_ranks(0)))
    hop_s = link.latency_s + shape.boundary / link.bytes_per_s
    units = unit_param_counts(model, tp=r.tp, ep=dims.ep)
    pipeline = plan_pipeline(layout, acts, shape, units, r.checkpointing, costs, hop_s, r.dtype.grad)
    best: Optional[PipelinedRank] = None
    # the first and last ranks (embeddings, head, the most in flight), and the middle rank holding the
    # most: every middle rank keeps both directions' receive buffers ([Note: receive buffers] in pp/cost.py)
    middle = [pipeline.ranks[r] for r in range(1, layout.pp - 1)]
    fullest = max(middle, key=lambda s: (s.params, s.peak_bytes + s.recv_buffers), default=pipeline.ranks[0])
    for rank in sorted({0, layout.pp - 1, fullest.pp_rank}):
        run = with_workload(r, stage_workload(r.workload, layout, rank), r.micro_batches * layout.microbatches)
        memory, rank_acts = memory_per_rank(run)
        stage = pipeline.ranks[rank]
        loss = (acts.loss_saved + LOSS_TOTAL_WEIGHT_BYTES) if stage.head else 0.0  # the logits' peak counts it
        if r.stage == 3:  # [Note: stage 3 under a pipeline]: the stage's parameters, whole
            memory = dataclasses.replace(memory, prefetch_buffers=float(run.padded * r.dtype.param))
        memory = dataclasses.replace(
            memory,
            # the schedule's gradients, whole at every stage: what they add to the activations' peak
            # ([Note: gradients a schedule holds] in planner/pipeline.py)
            param_grad=stage.peak_bytes - stage.in_flight_bytes,
            activations=stage.in_flight_bytes - loss + acts.recompute_peak(r.checkpointing),
            logits_and_loss=acts.logits_and_loss if stage.head else 0.0,
            recv_buffers=float(stage.recv_buffers),  # [Note: receive buffers] in pp/cost.py
        )
        candidate = PipelinedRank(run, memory, rank_acts, pipeline, rank, stage.idle_s, r)
        if best is None or memory.total > best.memory.total:
            best = candidate
    assert best is not None
    return best


def memory_per_rank(resolved: ResolvedRun) -> tuple[MemoryPerRank, ActivationBytes]:
    """The bytes one rank holds at the peak of a step ([Note: what a plan counts]), and the
    activation detail behind them."""
    r, dtype, config = resolved, resolved.dtype, resolved.config
    stage, dims, workload = r.stage, r.dims, r.workload
    ep, edp, shard_ranks = dims.ep, dims.edp, r.topology.shard_size
    buckets = engine_buckets(
        workload, stage=stage, bucket_numel=r.bucket_numel, dp=shard_ranks, grad_bytes=dtype.grad,
        expert_dp=edp if ep > 1 else None,
    )  # fmt: skip
    states = model_state_bytes(
        r.padded + ep * r.expert_padded,
        stage=stage,
        defer_grad_reduce=r.defer_grad_reduce,  # [Note: deferred gradient reduction] in zero/bucketing.py
        dp=shard_ranks,
        param_bytes=dtype.param,
        grad_bytes=dtype.grad,
        optim_bytes_per_param=dtype.optimizer,
        expert_params=ep * r.expert_padded,
        ep=ep,
    )
    optimizer_numel = r.padded // shard_ranks + r.expert_padded // edp if stage >= 1 else r.padded + r.expert_padded
    pooled = not keeps_full_grads(stage, r.defer_grad_reduce)  # stages 2-3 reduce through the bucket pool
    bucket_buffers = (
        min(pool_buffers(config.max_buckets_in_flight), len(buckets)) * max(b.numel for b in buckets) * dtype.grad
        if pooled and buckets
        else 0.0
    )
    # stage 3: the units in flight and the root ([Note: gathered working set] in zero/stage3/schedule.py)
    prefetch = gathered_numel(workload, config.prefetch_blocks) * dtype.param if stage == 3 else 0.0
    # stages 2-3: autograd's gradient of one parameter, until the hook copies it into its bucket
    param_grad = workload.largest_numel * dtype.grad if pooled else 0.0
    shape = dict(micro_batch=r.micro_batch, seq_len=r.seq_len, tp=r.tp, sequence_parallel=config.sequence_parallel)
    acts = llama_activation_bytes(
        r.model, act_bytes=dtype.activation, attention=r.run.attention, ep=ep, cp=dims.cp, **shape
    )
    memory = MemoryPerRank(
        params=states.params,
        grads=states.grads,
        master_weights=optimizer_numel * dtype.master,
        optimizer_moments=optimizer_numel * dtype.moments,
        bucket_buffers=float(bucket_buffers),
        prefetch_buffers=float(prefetch),
        param_grad=float(param_grad),
        activations=acts.total(r.checkpointing) - acts.logits_and_loss,
        logits_and_loss=acts.logits_and_loss,
        # bf16 gradient chunks are cast to an fp32 copy for the step; fp32 chunks are used as is
        step_grad_shard=float(optimizer_numel * 4) if stage >= 1 and dtype.master and dtype.grad != 4 else 0.0,
    )
    return memory, acts


def assemble_plan(
    resolved: ResolvedRun,
    memory: MemoryPerRank,
    acts: ActivationBytes,
    traffic: TrafficPerRank,
    simulated: Optional[StepTime],
) -> Plan:
    """:func:`plan`'s last step: the :class:`Plan` of a resolved run and what its steps found."""
    r, config, dims, run = resolved, resolved.config, resolved.dims, resolved.run
    comm = config.communication
    wire = {f.name: getattr(comm, f.name) for f in dataclasses.fields(comm) if f.name != "bucket_mb"}
    return Plan(
        model=r.model.name,
        num_params=r.model.num_params(),
        params_per_tp_rank=r.workload.numel,
        padded_params_per_tp_rank=r.padded + r.expert_padded,
        stage=r.stage,
        world_size=dims.world_size,
        num_nodes=max(1, dims.world_size // dims.devices_per_node),
        devices_per_node=dims.devices_per_node,
        dp=dims.dp,
        tp=r.tp,
        precision=str(run.precision),
        micro_batch=r.micro_batch,
        seq_len=r.seq_len,
        accumulate_grad_batches=r.micro_batches,
        tokens_per_step=r.tokens_per_step,
        activation_checkpointing=r.checkpointing == "full",
        checkpointing=r.checkpointing,
        sequence_parallel=config.sequence_parallel,
        attention=run.attention,
        bucket_mb=r.bucket_mb,
        prefetch_blocks=config.prefetch_blocks,
        defer_grad_reduce=r.defer_grad_reduce,
        **wire,  # the communication policy as planned (bucket_mb resolved above)
        shard_size=r.topology.shard_size,
        replicas=r.topology.replicas,
        hierarchical_reduce=r.topology.hierarchical,
        reduce_dtype=str(config.reduce_dtype),
        mixed_params=str(config.mixed_params),
        hardware=r.hw.name,
        memory_bytes=r.hw.memory_bytes,
        reserved_bytes=r.reserved_bytes,
        mfu=r.mfu,
        memory=memory,
        traffic=traffic,
        timing=simulated,
        activation_detail=acts,
        notes=_notes(r.stage, dims.dp_cp, run.attention, r.micro_batches, r.defer_grad_reduce, dims.ep),
        cp=dims.cp,
        cp_attention=_attention_name(r.cp_layout),
        cp_notice=layout_notice(r.cp_layout) or "",
        ep=dims.ep,
        expert_params_per_rank=r.expert_params,
        pp=dims.pp,
        pp_schedule=config.pp_schedule,
        pp_virtual_stages=config.pp_virtual_stages,
        optimizer=run.optimizer,
    )


# --------------------------------------------------------------------------------------------
# plan_run: the same plan from keywords (docs/planner.md)
# --------------------------------------------------------------------------------------------


def plan_inputs(
    zero_config: Optional[ZeroConfig] = None, *, world_size: int, devices_per_node: int, **knobs: Any
) -> tuple[ZeroConfig, ParallelDims, RunShape, PlanOptions, bool]:
    """:func:`plan_run`'s keywords as what :func:`plan` takes: ``(config, dims, run, options,
    ddp)``. Each keyword goes to the object that holds it: the knobs of :data:`PLANNED_KNOBS` to a
    ``ZeroConfig`` (``stage=0``: Lightning's DDP, ``ddp=True``), :data:`RUN_FIELDS` to a
    :class:`RunShape`, :data:`OPTION_FIELDS` to :class:`PlanOptions`; the defaults are those
    objects' own. ``TypeError`` for a keyword none of them takes, for knobs given beside
    ``zero_config`` and for neither ``stage`` nor ``zero_config``; ``ValueError`` (from the
    objects) for a bad value, naming it."""
    unknown = sorted(set(knobs) - set(PLANNED_KNOBS) - set(RUN_FIELDS) - set(OPTION_FIELDS))
    if unknown:
        raise TypeError(
            f"plan_run() got unexpected keyword argument(s) {', '.join(unknown)}; it takes world_size,"
            f" devices_per_node, {', '.join([*PLANNED_KNOBS, *RUN_FIELDS, *OPTION_FIELDS])}"
        )
    # ``None`` beside a config is not a knob given (the 31-keyword signature defaulted ``stage`` to it)
    given = [name for name in PLANNED_KNOBS if knobs.get(name) is not None]
    ddp = False
    if zero_config is not None:
        if given:
            raise TypeError(
                f"plan_run(zero_config=...): the knobs come from the config; set {', '.join(given)} in the"
                f" ZeroConfig (dataclasses.replace(zero_config, {given[0]}=...)) instead of passing them too"
            )
        config = zero_config
    elif knobs.get("stage") is None:
        raise TypeError("plan_run: give stage=... (or the knobs whole, as zero_config=ZeroConfig(...))")
    else:
        values = {PLANNED_KNOBS[name]: knobs[name] for name in PLANNED_KNOBS if name in knobs}
        stage = values["stage"]
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"plan_run: stage must be one of {STAGES} (0 = plain DDP), got stage={stage!r}")
        if stage == 0:  # Lightning's DDP: plain data parallelism; its topology knobs are ignored
            layout = {name: knobs[name] for name in ("tp", "cp", "sequence_parallel") if name in knobs}
            if any(value not in (1, False) for value in layout.values()):
                raise ValueError(
                    f"plan_run(stage=0, {', '.join(f'{k}={v!r}' for k, v in layout.items())}): stage 0 is"
                    " Lightning's DDP, which has no tensor or context parallelism; plan it with tp=1, cp=1,"
                    " sequence_parallel=False, or pick stage 1-3"
                )
            values.update(stage=1, defer_grad_reduce=False)
            ddp = True
        config = ZeroConfig(**values)
    dims = ParallelDims.from_config(config, world_size=world_size, devices_per_node=devices_per_node)
    run = RunShape(**{name: knobs[name] for name in RUN_FIELDS if name in knobs})
    options = PlanOptions(**{name: knobs[name] for name in OPTION_FIELDS if name in knobs})
    return config, dims, run, options, ddp


def plan_run(
    model_config: Any, zero_config: Optional[ZeroConfig] = None, *, world_size: int, devices_per_node: int, **knobs: Any
) -> Plan:
    """:func:`plan` from keywords: ``plan_run(model, stage=3, world_size=64, devices_per_node=8,
    tp=8, micro_batch=1, seq_len=4096, hardware="h100_80gb")``, or the knobs whole as
    ``plan_run(model, ZeroConfig(stage=3, tensor_parallel_size=8), world_size=..., ...)``.

    Each keyword is a field of the object :func:`plan` takes it in (:func:`plan_inputs`): a
    ``ZeroConfig`` knob (:data:`PLANNED_KNOBS`: ``stage`` 0-3, 0 being Lightning's DDP; ``tp``
    for ``tensor_parallel_size``; the others by their own names, documented on ``ZeroConfig``),
    a :class:`RunShape` field (``precision``, ``micro_batch``, ``seq_len``,
    ``activation_checkpointing``, ``accumulate_grad_batches``, ``attention``) or a
    :class:`PlanOptions` field (``hardware``, ``mfu``, ``reserved_gib``, ``suggest``,
    ``simulate``). Same plan as :func:`plan` with those objects (``tests/test_layout.py``)."""
    config, dims, run, options, ddp = plan_inputs(
        zero_config, world_size=world_size, devices_per_node=devices_per_node, **knobs
    )
    return plan(model_config, config, dims, run, options, ddp=ddp)


def compare_stages(model_config: Any, stages: tuple[int, ...] = STAGES, **kwargs: Any) -> list[Plan]:
    """:func:`plan` for each of ``stages`` with everything else equal, from :func:`plan_run`'s
    keywords (no ``stage``; 0: Lightning's DDP on the same ranks, :func:`ddp_layout`); what the
    report's side-by-side columns show."""
    config, dims, run, options, _ = plan_inputs(**{**kwargs, "stage": 1})
    plans = []
    for stage in stages:
        if stage == 0:
            plans.append(plan(model_config, config, dims, run, options, ddp=True))
        else:
            defer = defer_grad_reduce_at(stage, config.defer_grad_reduce)
            staged = dataclasses.replace(config, stage=stage, defer_grad_reduce=defer)
            plans.append(plan(model_config, staged, dims, run, options))
    return plans


def _attention_name(layout: Any) -> str:
    """``"ulysses"`` or ``"ring"`` for a cp layout (``cp.layout.attention_layout``), ``""`` without cp."""
    return "" if layout is None else "ring" if isinstance(layout, RingLayout) else "ulysses"


def _notes(
    stage: int, dp: int, attention: str, micro_batches: int, defer_grad_reduce: bool, ep: int = 1
) -> tuple[str, ...]:
    notes = []
    if ep > 1:
        notes.append(
            f"ep={ep}: a balanced router assumed (every expert gets tokens x top_k / experts of each rank's tokens)"
            " for the experts' rows and the all-to-all bytes"
        )
    if dp == 1 and stage > 0:
        notes.append("dp=1: ZeRO has nothing to shard over; every stage holds full states")
    if attention == "math":
        notes.append("attention=math keeps the (B, heads, T, T) probabilities of every block")
    if micro_batches > 1 and stage >= 2 and not defer_grad_reduce:
        notes.append(f"stage {stage} reduce-scatters gradients on each of the {micro_batches} micro batches")
    return tuple(notes)
