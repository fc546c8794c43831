"""Predict, before launch, what every rank holds, sends and spends per step for a Llama run.

:func:`plan_run` is pure arithmetic on a :class:`~lightning_zero.models.LlamaConfig` (formulas in
:mod:`lightning_zero.planner.ledger`, :mod:`lightning_zero.planner.timing`, :mod:`lightning_zero.planner.workload` and docs/planner.md):
it never builds the model, so a 70B plan takes milliseconds. :func:`compare_stages` lays stages
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
from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig, resolve_bucket_mb
from lightning_zero.cp.layout import check_context_parallel
from lightning_zero.models.checkpointing import checkpointing_mode
from lightning_zero.planner.fit import suggest_fixes
from lightning_zero.planner.hardware import Hardware, load_hardware
from lightning_zero.planner.ledger import (
    ATTENTION_KERNELS,
    COMM_DTYPES,
    dp_topology,
    grad_bytes_per_param,
    llama_activation_bytes,
    llama_largest_block_param,
    llama_param_counts,
    model_state_bytes,
    precision_bytes,
)
from lightning_zero.planner.plan import GiB, MemoryPerRank, Plan
from lightning_zero.planner.timing import step_time
from lightning_zero.planner.traffic import traffic_per_rank
from lightning_zero.planner.workload import engine_buckets, gathered_numel, llama_workload, training_flops
from lightning_zero.zero.bucketing import bucket_numel_for_bytes, keeps_full_grads, pool_buffers

STAGES = (0, 1, 2, 3)
DEFAULT_MFU = 0.4


# --------------------------------------------------------------------------------------------
# Inputs: precision
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


# plan_run's argument for each ZeroConfig knob the planner models; the others (offload_optimizer,
# monitor, collective_timeout) change no predicted byte or second.
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
    "mixed_params": "mixed_params",
}


UNPLANNED_KNOBS = ("ep",)
"""ZeroConfig knobs that change predicted bytes and seconds but that the planner does not model yet:
a plan with one of them above 1 is refused (:func:`refuse_unplanned`), never silently made without it."""


def refuse_unplanned(knobs: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming each of :data:`UNPLANNED_KNOBS` set above 1 in ``knobs``."""
    asked = [f"{name}={knobs[name]}" for name in UNPLANNED_KNOBS if knobs.get(name, 1) not in (1, None)]
    if asked:
        raise ValueError(
            f"{where}: {', '.join(asked)} is not planned yet (expert parallelism: issue 54);"
            " plan the run with ep=1, or launch it without a plan"
        )


def knob_arguments(config: ZeroConfig) -> dict[str, Any]:
    """``plan_run``'s knob arguments for ``config`` (stage 1 always defers: its
    ``defer_grad_reduce`` changes nothing, as in the engine: ``zero.bucketing.keeps_full_grads``)."""
    refuse_unplanned(config.as_dict(), "plan_run(zero_config=ZeroConfig(...))")
    arguments = {argument: getattr(config, knob) for argument, knob in PLANNED_KNOBS.items()}
    arguments["defer_grad_reduce"] = config.defer_grad_reduce and config.stage >= 2
    return arguments


def _given_knobs(function: Any, arguments: Mapping[str, Any], names: Any) -> list[str]:
    """Which of ``names`` the call set to something other than ``function``'s default."""
    parameters = inspect.signature(function).parameters
    return [name for name in names if arguments[name] != parameters[name].default]


def plan_run(
    model_config: Any,
    zero_config: Optional[ZeroConfig] = None,
    *,
    stage: Optional[int] = None,
    world_size: int,
    devices_per_node: int,
    tp: Union[int, str] = 1,
    precision: str = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    activation_checkpointing: Union[bool, str] = False,
    sequence_parallel: bool = ZERO_DEFAULTS.sequence_parallel,
    bucket_mb: Union[float, str] = ZERO_DEFAULTS.bucket_mb,
    prefetch_blocks: int = ZERO_DEFAULTS.prefetch_blocks,
    defer_grad_reduce: bool = ZERO_DEFAULTS.defer_grad_reduce,
    overlap_comm: bool = ZERO_DEFAULTS.overlap_comm,
    max_buckets_in_flight: int = ZERO_DEFAULTS.max_buckets_in_flight,
    overlap_param_gather: bool = ZERO_DEFAULTS.overlap_param_gather,
    shard_size: Union[None, int, str] = ZERO_DEFAULTS.shard_size,
    hierarchical_reduce: bool = ZERO_DEFAULTS.hierarchical_reduce,
    grad_comm_dtype: Optional[str] = ZERO_DEFAULTS.grad_comm_dtype,
    param_comm_dtype: Optional[str] = ZERO_DEFAULTS.param_comm_dtype,
    hardware: Union[str, Hardware, Mapping[str, Any], None] = None,
    mfu: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    attention: str = "fused",
    reserved_gib: float = 2.0,
    suggest: bool = True,
    simulate: Union[bool, str] = True,
    reduce_dtype: str = ZERO_DEFAULTS.reduce_dtype,
    master_weights: str = ZERO_DEFAULTS.master_weights,
    cp: int = ZERO_DEFAULTS.cp,
    mixed_params: str = ZERO_DEFAULTS.mixed_params,
) -> Plan:
    """Predict one rank's bytes (held and sent) and step time for a Llama run; allocates nothing.

    Args:
        model_config: a ``LlamaConfig`` (or a preset name such as ``"70b"``).
        zero_config: the strategy's knobs as one :class:`~lightning_zero.config.ZeroConfig` (what
            ``ZeroStrategy`` passes its engine); its fields give ``stage``, ``tp`` and the other
            knob arguments below (``PLANNED_KNOBS``), which are then not passed. ``None``: the
            keyword arguments (their defaults are ``ZeroConfig``'s).
        stage: ZeRO stage 1, 2 or 3 (0 = Lightning's DDP, for comparison); required without
            ``zero_config``.
        world_size: total ranks; ``devices_per_node`` ranks per node.
        tp: tensor-parallel size (inside a node) or ``"auto"`` (= devices_per_node); dp = world // tp.
        precision: ``"bf16-mixed"`` (2 + 2 + 12 bytes/param), ``"16-mixed"`` and ``"32-true"``
            (4 + 4 + 8) or ``"bf16-true"`` / ``"16-true"`` (2 + 2 + 4: bf16 optimizer state, no
            master), under the two knobs below; ``ledger.precision_bytes`` is the rule.
        micro_batch: samples per rank per forward; ``seq_len`` tokens each (default: the model's).
        activation_checkpointing: ``False``/``"none"``, ``"selective"`` (recompute attention's
            core) or ``True``/``"full"`` (keep only each block's input and recompute it in
            backward); [Note: checkpointing modes] in ``lightning_zero/models/checkpointing.py``.
        sequence_parallel: the norm/residual activations sharded over the sequence in the TP
            group (needs ``tp > 1`` and ``tp`` dividing ``seq_len``); the TP all-reduces become
            reduce-scatters + all-gathers of the same bytes, plus the norm gains' gradient sums.
        bucket_mb: gradient bucket size (MiB): the reduce-scatter granularity.
        prefetch_blocks: stage 3 holds ``prefetch_blocks + 1`` gathered blocks and gathers that far ahead.
        defer_grad_reduce: stages 2-3: full gradients over micro batches, one reduce-scatter at the last.
        overlap_comm: launch each bucket's collective during backward (else all after backward).
        max_buckets_in_flight: reduce-scatters in flight at once; stage 2/3 pool one bucket buffer
            more (``bucketing.pool_buffers``; backward waits beyond).
        overlap_param_gather: stages 1-2: hide the post-step parameter all-gather behind the next
            forward (``False``: the engine as it is today, exposed).
        shard_size: ZeRO shards over groups of this many consecutive dp ranks (``None``: all dp
            ranks; ``"node"``: the dp ranks of one node) and the ``dp / shard_size`` replicas
            all-reduce the shard; memory follows the ZeRO formulas with ``shard_size`` for dp.
        hierarchical_reduce: when the shard group spans nodes, reduce-scatter inside the node,
            then across nodes on the node's slice (each gradient byte crosses the slow link once).
        grad_comm_dtype, param_comm_dtype: wire format of gradient (reduce-scatter, replica
            all-reduce) and parameter (all-gather) collectives that cross nodes: ``None``
            (uncompressed), ``"fp32"``, ``"bf16"`` or ``"int8"`` (block-wise, one fp32 scale per
            ``INT8_BLOCK_SIZE`` elements). Stage 0 (Lightning DDP) ignores these four.
        hardware: a name in ``conf/hardware`` or a YAML path (default: ``conf/config.yaml``'s).
        mfu: model FLOPs utilization assumed for compute (``None``: the hardware's calibrated
            ``mfu``, else 0.4).
        accumulate_grad_batches: micro batches per optimizer step.
        attention: ``"fused"`` (SDPA flash kernels, what the model runs) or ``"math"``.
        reserved_gib: per-GPU memory not available to tensors (CUDA context, allocator slack).
        suggest: when it does not fit, search for changes that would make it fit.
        simulate: simulate the step (``False``: bytes only, seconds 0; ``"if_fits"``: only when it
            fits, what the layout search does).
        reduce_dtype: ``"fp32"``: gradients held, bucketed and sent in fp32 under bf16-mixed
            (4 bytes per element, ``ledger.grad_bytes_per_param``; no fp32 cast at the step);
            ``"compute"`` (default): the precision's gradient bytes.
        master_weights: ``"fp32"``: fp32 masters and optimizer state under ``bf16-true`` /
            ``16-true`` (the ``-mixed`` bytes); ``"auto"``: the precision's own
            ([Note: master_weights] in ``runtime/precision.py``).
        cp: context-parallel size (docs/context_parallel.md): each sequence split over ``cp``
            ranks (``world = dp * cp * tp``; ``micro_batch`` sequences per cp group), so a rank
            holds ``T/cp`` tokens of activations and ``1/cp`` of the compute, and each attention
            layer adds two blocking all-to-alls over the cp group forward and two backward; ZeRO
            shards over the ``dp * cp`` ranks of one tp rank.
        mixed_params: under the ``-mixed`` precisions, ``"fp32"`` parameters and gradients (4 + 4 +
            8, as ddp) or ``"half"`` ones with fp32 masters in the shards (2 + 2 + 12); ``"auto"``:
            fp32 under 16-mixed, half under bf16-mixed ([Note: mixed_params] there).

    Raises ``ValueError`` naming the argument for a bad value, and (via ``ParallelDims``) for a
    layout whose sizes do not divide, with the numbers; ``TypeError`` for an argument it does not
    take, or a knob given both in ``zero_config`` and as a keyword.
    """
    if zero_config is not None:
        arguments = dict(locals())
        given = _given_knobs(plan_run, arguments, PLANNED_KNOBS)
        if given:
            raise TypeError(
                f"plan_run(zero_config=...): the knobs come from the config; set {', '.join(given)} in the"
                f" ZeroConfig (dataclasses.replace(zero_config, {given[0]}=...)) instead of passing them too"
            )
        run = {name: value for name, value in arguments.items() if name not in ("model_config", "zero_config")}
        return plan_run(model_config, **{**run, **knob_arguments(zero_config)})
    if stage is None:
        raise TypeError("plan_run: give stage=... (or the knobs whole, as zero_config=ZeroConfig(...))")
    from lightning_zero.models import resolve_config

    config = resolve_config(model_config)
    if stage not in STAGES:
        raise ValueError(f"plan_run: stage must be one of {STAGES} (0 = plain DDP), got stage={stage!r}")
    _check_switches(
        sequence_parallel=sequence_parallel,
        defer_grad_reduce=defer_grad_reduce,
        overlap_comm=overlap_comm,
        overlap_param_gather=overlap_param_gather,
        hierarchical_reduce=hierarchical_reduce,
        suggest=suggest,
    )
    if simulate not in (True, False, "if_fits") or not isinstance(simulate, (bool, str)):
        raise ValueError(f"plan_run: simulate must be True, False or 'if_fits', got simulate={simulate!r}")
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"plan_run: attention must be one of {ATTENTION_KERNELS}, got attention={attention!r}")
    if bucket_mb != "auto" and not _is_number(bucket_mb):
        raise ValueError(f"plan_run: bucket_mb must be a number of MiB or 'auto', got bucket_mb={bucket_mb!r}")
    if not _is_number(reserved_gib) or reserved_gib < 0:
        raise ValueError(f"plan_run: reserved_gib must be a number >= 0, got reserved_gib={reserved_gib!r}")
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int):
        raise ValueError(f"plan_run: prefetch_blocks must be an int, got prefetch_blocks={prefetch_blocks!r}")
    dims = ParallelDims(world_size=world_size, devices_per_node=devices_per_node, tp=tp, cp=cp).validate(config)
    tp, dp, dense = int(dims.tp), dims.dp, dims.dp_cp  # dp: ranks with other samples; dense: ZeRO's group
    seq_len = int(seq_len or config.max_seq_len)
    checkpointing = checkpointing_mode(activation_checkpointing, "plan_run: activation_checkpointing")
    if cp > 1:
        check_context_parallel(cp, tp=tp, model_config=config, seq_len=seq_len, sequence_parallel=sequence_parallel)
    if sequence_parallel and (tp == 1 or seq_len % tp != 0):
        raise ValueError(
            f"plan_run: sequence_parallel needs tp > 1 dividing seq_len, got tp={tp}, seq_len={seq_len}; "
            "set sequence_parallel=False or change tensor_parallel_size / data.seq_len"
        )
    _check_positive(
        micro_batch=micro_batch,
        seq_len=seq_len,
        accumulate_grad_batches=accumulate_grad_batches,
        max_buckets_in_flight=max_buckets_in_flight,
    )
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"plan_run: seq_len({seq_len}) exceeds the model's max_seq_len({config.max_seq_len}); "
            "lower data.seq_len or raise model.max_seq_len"
        )
    hw = load_hardware(hardware)
    if mfu is None:
        mfu = hw.mfu if hw.mfu is not None else DEFAULT_MFU
    if not 0 < mfu <= 1:
        raise ValueError(f"plan_run: mfu must be in (0, 1], got mfu={mfu!r}")
    # The gradient bytes per element of the buffers and the reduce-scatter (reduce_dtype).
    dtype = dataclasses.replace(
        precision_bytes(precision, master_weights, mixed_params),
        grad=grad_bytes_per_param(precision, reduce_dtype, mixed_params),
    )
    if bucket_mb == "auto":  # as the engine sizes it (lightning_zero.config.resolve_bucket_mb)
        bucket_mb = resolve_bucket_mb(bucket_mb, llama_param_counts(config, tp=tp).total * dtype.grad)
    if bucket_mb <= 0 or prefetch_blocks < 0:
        raise ValueError(
            f"plan_run: bucket_mb must be > 0 and prefetch_blocks >= 0, got bucket_mb={bucket_mb!r}, "
            f"prefetch_blocks={prefetch_blocks!r}"
        )
    if defer_grad_reduce and stage < 2:
        raise ValueError(
            f"plan_run: defer_grad_reduce applies to stages 2 and 3 (stages 0-1 always defer), got stage={stage};"
            " drop defer_grad_reduce or use stage=2 or 3"
        )
    for name, value in (("grad_comm_dtype", grad_comm_dtype), ("param_comm_dtype", param_comm_dtype)):
        if value not in COMM_DTYPES:
            raise ValueError(f"plan_run: {name} must be one of {COMM_DTYPES}, got {name}={value!r}")
    if stage == 0:  # Lightning's DDP: no sharding knobs
        shard_size, hierarchical_reduce, grad_comm_dtype, param_comm_dtype = None, False, None, None
    topology = dp_topology(
        dp=dense,
        devices_per_node=dims.devices_per_node,
        tp=tp,
        shard_size=shard_size,
        hierarchical_reduce=hierarchical_reduce,
    )
    shard_ranks = topology.shard_size
    counts = llama_param_counts(config, tp=tp)
    local_params = counts.total
    padded = math.ceil(local_params / shard_ranks) * shard_ranks
    shard = padded // shard_ranks

    peak = hw.peak_fp32_flops if str(precision).startswith("32") else hw.peak_bf16_flops
    crosses_nodes = dims.world_size > dims.devices_per_node and dense > 1
    cp_crosses_nodes = len({rank // dims.devices_per_node for rank in dims.cp_ranks(0)}) > 1
    workload = llama_workload(
        config,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=tp,
        activation_checkpointing=checkpointing,
        flops_per_s=peak * mfu,
        tp_link=hw.link(inter_node=False),
        act_bytes=dtype.activation,
        sequence_parallel=bool(sequence_parallel),
        cp=cp,
        cp_link=hw.link(inter_node=cp_crosses_nodes),
    )
    bucket_numel = bucket_numel_for_bytes(bucket_mb, dtype.grad)
    buckets = engine_buckets(workload, stage=stage, bucket_numel=bucket_numel, dp=shard_ranks, grad_bytes=dtype.grad)

    states = model_state_bytes(
        padded,
        stage=stage,
        defer_grad_reduce=defer_grad_reduce,  # [Note: deferred gradient reduction] in zero/bucketing.py
        dp=shard_ranks,
        param_bytes=dtype.param,
        grad_bytes=dtype.grad,
        optim_bytes_per_param=dtype.optimizer,
    )
    optimizer_numel = shard if stage >= 1 else padded
    pooled = not keeps_full_grads(stage, defer_grad_reduce)  # stages 2-3 reduce through the bucket pool
    bucket_buffers = (
        min(pool_buffers(max_buckets_in_flight), len(buckets)) * max(b.numel for b in buckets) * dtype.grad
        if pooled and buckets
        else 0.0
    )
    # stage 3: the units in flight and the root ([Note: gathered working set] in zero/stage3/schedule.py)
    prefetch = gathered_numel(workload, prefetch_blocks) * dtype.param if stage == 3 else 0.0
    # stages 2-3: autograd's gradient of one parameter, until the hook copies it into its bucket
    largest_param = max(counts.embedding, counts.output, llama_largest_block_param(config, tp=tp))
    param_grad = largest_param * dtype.grad if pooled else 0.0

    shape = dict(micro_batch=micro_batch, seq_len=seq_len, tp=tp, sequence_parallel=bool(sequence_parallel), cp=cp)
    acts = llama_activation_bytes(config, act_bytes=dtype.activation, attention=attention, **shape)
    memory = MemoryPerRank(
        params=states.params,
        grads=states.grads,
        master_weights=optimizer_numel * dtype.master,
        optimizer_moments=optimizer_numel * dtype.moments,
        bucket_buffers=float(bucket_buffers),
        prefetch_buffers=float(prefetch),
        param_grad=float(param_grad),
        activations=acts.total(checkpointing) - acts.logits_and_loss,
        logits_and_loss=acts.logits_and_loss,
        # bf16 gradient chunks are cast to an fp32 copy for the step; fp32 chunks are used as is
        step_grad_shard=float(optimizer_numel * 4) if stage >= 1 and dtype.master and dtype.grad != 4 else 0.0,
    )
    tokens_per_step = micro_batch * seq_len * accumulate_grad_batches * dp
    model_flops = accumulate_grad_batches * training_flops(
        config, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp
    )
    simulated = None
    fits = memory.total <= hw.memory_bytes - int(reserved_gib * GiB)
    if simulate is True or (simulate == "if_fits" and fits):
        simulated = step_time(
            workload,
            stage=stage,
            dp=dense,
            micro_batches=accumulate_grad_batches,
            dp_link=hw.link(inter_node=crosses_nodes),
            grad_bytes=dtype.grad,
            param_bytes=dtype.param,
            bucket_numel=bucket_numel,
            overlap_comm=overlap_comm,
            defer_grad_reduce=defer_grad_reduce,
            max_buckets_in_flight=max_buckets_in_flight,
            prefetch_blocks=prefetch_blocks,
            overlap_param_gather=overlap_param_gather,
            efficiency=hw.overlap_efficiency,
            optimizer_bytes_per_param=dtype.optimizer_step_bytes,
            memory_bytes_per_s=hw.memory_bytes_per_s,
            optimizer_bytes_per_s=hw.optimizer_bytes_per_s or hw.memory_bytes_per_s,
            tokens_per_step=tokens_per_step,
            model_flops_per_rank=model_flops,
            peak_flops=peak,
            world_size=world_size,
            grad_hops=topology.grad_hops(stage=stage, grad_bytes=dtype.grad, grad_comm_dtype=grad_comm_dtype),
            gather_hops=topology.gather_hops(param_bytes=dtype.param, param_comm_dtype=param_comm_dtype),
            links={"intra_node": hw.link(inter_node=False), "inter_node": hw.link(inter_node=True)},
            shard_size=shard_ranks,
            overhead_s=hw.step_overhead_s,
        )
    traffic = traffic_per_rank(
        config,
        stage=stage,
        dims=dims,
        padded=padded,
        dtype=dtype,
        micro_batch=micro_batch,
        seq_len=seq_len,
        micro_batches=accumulate_grad_batches,
        defer_grad_reduce=defer_grad_reduce,
        activation_checkpointing=checkpointing,
        sequence_parallel=bool(sequence_parallel),
        hw=hw,
        workload=workload,
        simulated=simulated,
        topology=topology,
        grad_comm_dtype=grad_comm_dtype,
        param_comm_dtype=param_comm_dtype,
        cp_link="inter_node" if cp_crosses_nodes else "intra_node",
    )
    plan = Plan(
        model=config.name,
        num_params=config.num_params(),
        params_per_tp_rank=local_params,
        padded_params_per_tp_rank=padded,
        stage=stage,
        world_size=world_size,
        num_nodes=max(1, world_size // devices_per_node),
        devices_per_node=devices_per_node,
        dp=dp,
        tp=tp,
        precision=str(precision),
        micro_batch=micro_batch,
        seq_len=seq_len,
        accumulate_grad_batches=accumulate_grad_batches,
        tokens_per_step=tokens_per_step,
        activation_checkpointing=checkpointing == "full",
        checkpointing=checkpointing,
        sequence_parallel=bool(sequence_parallel),
        attention=attention,
        bucket_mb=float(bucket_mb),
        prefetch_blocks=prefetch_blocks,
        defer_grad_reduce=bool(defer_grad_reduce),
        overlap_comm=bool(overlap_comm),
        max_buckets_in_flight=max_buckets_in_flight,
        overlap_param_gather=bool(overlap_param_gather),
        shard_size=shard_ranks,
        replicas=topology.replicas,
        hierarchical_reduce=topology.hierarchical,
        grad_comm_dtype=grad_comm_dtype,
        param_comm_dtype=param_comm_dtype,
        reduce_dtype=str(reduce_dtype),
        mixed_params=str(mixed_params),
        hardware=hw.name,
        memory_bytes=hw.memory_bytes,
        reserved_bytes=int(reserved_gib * GiB),
        mfu=float(mfu),
        memory=memory,
        traffic=traffic,
        timing=simulated,
        activation_detail=acts,
        notes=_notes(stage, dense, attention, accumulate_grad_batches, defer_grad_reduce),
        cp=cp,
    )
    if suggest and not plan.fits:
        plan = dataclasses.replace(plan, suggestions=tuple(suggest_fixes(plan, config, hw, plan_run)))
    return plan


@dataclass(frozen=True)
class RunShape:
    """What a planned run is besides its layout (``ParallelDims``) and its knobs (``ZeroConfig``):
    the precision and the batch each rank computes. Fields as in :func:`plan_run`."""

    precision: str = "bf16-mixed"
    micro_batch: int = 1
    seq_len: Optional[int] = None
    activation_checkpointing: Union[bool, str] = False
    accumulate_grad_batches: int = 1
    attention: str = "fused"


@dataclass(frozen=True)
class PlanOptions:
    """How to plan: the hardware and its assumed MFU, memory set aside, whether to suggest fixes
    and simulate the step. Fields as in :func:`plan_run`."""

    hardware: Union[str, Hardware, Mapping[str, Any], None] = None
    mfu: Optional[float] = None
    reserved_gib: float = 2.0
    suggest: bool = True
    simulate: Union[bool, str] = True


def plan(
    model_config: Any,
    config: ZeroConfig,
    dims: ParallelDims,
    run: RunShape = RunShape(),
    options: PlanOptions = PlanOptions(),
    *,
    ddp: bool = False,
) -> Plan:
    """The plan of a run given whole, as the runtime holds it: the model, the knobs (``config``,
    what the strategy passes its engine), the layout (``dims``: ``ParallelDims.from_config(config,
    world_size=..., devices_per_node=...)``, what the session builds its groups from), the run's
    shape and the planner's options. ``ddp=True`` plans Lightning's DDP on the same layout (stage
    0). Same numbers as :func:`plan_run` with the same values as keywords (``tests/test_planner.py``).

    Raises ``ValueError`` when ``dims`` is not the layout ``config`` asks for (its ``tp``,
    ``shard_size``, ``hierarchical_reduce``, ``cp``, ``ep``), and for ``cp``/``ep`` above 1 while
    the planner does not model them (:data:`UNPLANNED_KNOBS`).
    """
    asked = ParallelDims.from_config(config, world_size=dims.world_size, devices_per_node=dims.devices_per_node)
    if asked != dims:
        raise ValueError(f"plan: {dims} is not the layout the ZeroConfig asks for on its ranks ({asked})")
    fields = {f.name: getattr(part, f.name) for part in (run, options) for f in dataclasses.fields(part)}
    layout = dict(world_size=dims.world_size, devices_per_node=dims.devices_per_node)
    if ddp:
        knobs = knob_arguments(dataclasses.replace(config, stage=1))
        return plan_run(model_config, **{**knobs, "stage": 0, "defer_grad_reduce": False}, **layout, **fields)
    return plan_run(model_config, config, **layout, **fields)


def compare_stages(model_config: Any, stages: tuple[int, ...] = STAGES, **kwargs: Any) -> list[Plan]:
    """:func:`plan_run` for each stage with everything else equal (the side-by-side view)."""
    return [plan_run(model_config, stage=stage, **kwargs) for stage in stages]


def _check_switches(**values: bool) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise ValueError(f"plan_run: {name} must be True or False, got {name}={value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_run: {name} must be a positive int, got {name}={value!r}")


def _notes(stage: int, dp: int, attention: str, micro_batches: int, defer_grad_reduce: bool) -> tuple[str, ...]:
    notes = []
    if dp == 1 and stage > 0:
        notes.append("dp=1: ZeRO has nothing to shard over; every stage holds full states")
    if attention == "math":
        notes.append("attention=math keeps the (B, heads, T, T) probabilities of every block")
    if micro_batches > 1 and stage >= 2 and not defer_grad_reduce:
        notes.append(f"stage {stage} reduce-scatters gradients on each of the {micro_batches} micro batches")
    return tuple(notes)
