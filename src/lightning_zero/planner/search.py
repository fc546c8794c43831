"""Layout search: every layout the engine offers for a fixed cluster and global batch, ranked by
predicted tokens/s, keeping only what fits (``lightning-zero plan plan.search=true``).

Enumerated (the knobs that exist in the engine today): ZeRO stage (0 = Lightning DDP, tp 1 only),
tensor-parallel size (powers of two up to the devices per node that divide the model), micro batch
with ``accumulate_grad_batches`` chosen so ``dp x micro_batch x accumulate`` stays the configured
global batch, ``defer_grad_reduce`` (stage 2), activation checkpointing (``"none"``,
``"selective"``, ``"full"``), ``sequence_parallel`` (tp > 1 dividing the sequence), context parallelism
``cp`` (powers of two leaving each rank at least ``MIN_CP_SLICE`` tokens of a sequence: long
sequences only, docs/context_parallel.md), expert parallelism ``ep`` for a mixture of experts
(:func:`ep_sizes_for`, docs/moe.md), ``bucket_mb`` and, for
stage 3, ``prefetch_blocks``; on more than one node also the topology knobs (docs/topology.md):
``shard_size`` (``None``, ``"node"``), ``hierarchical_reduce`` (when the shard group spans nodes)
and the cross-node wire format (``grad_comm_dtype`` = ``param_comm_dtype`` in ``None``, ``"bf16"``
unless that is the native format, ``"int8"``), each only where it changes something. Each layout is first planned for bytes only (no simulation); only those
that fit are simulated (:mod:`lightning_zero.planner.timing`; ``PlanOptions(simulate="if_fits")``). Each
layout is one ``ZeroConfig`` (the fixed knobs of ``FIXED_KNOBS`` and the layout's own) with its
``ParallelDims.from_config`` and a ``RunShape``, planned by ``arithmetic.plan`` whole.
A layout whose wire format drops bits (``Plan.lossless`` false: int8, or bf16 of fp32 tensors)
is marked ``lossy``; ``lossless=True`` (``plan.lossless=true``) leaves those out.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from itertools import product
from typing import Any, Optional, Sequence, Union

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig, topology_defaults
from lightning_zero.models.checkpointing import CHECKPOINTING_MODES, checkpointing_mode
from lightning_zero.planner.arithmetic import PlanOptions, RunShape, _given_knobs, plan, resolve_model
from lightning_zero.planner.fit import plan_or_none
from lightning_zero.planner.hardware import load_hardware
from lightning_zero.planner.ledger import precision_bytes
from lightning_zero.planner.plan import GiB, Plan

MICRO_BATCHES = (1, 2, 4, 8, 16)
BUCKET_MBS = (25.0, 100.0, 400.0)
PREFETCH = (1, 2)
SHARD_SIZES: tuple[Union[None, int, str], ...] = (None, "node")
HIERARCHICAL = (False, True)
CHECKPOINTING_OVERRIDES = {"none": "false", "selective": "selective", "full": "full"}  # model.activation_checkpointing=
COMM_DTYPE_PAIRS: tuple[tuple[Optional[str], Optional[str]], ...] = ((None, None), ("bf16", "bf16"), ("int8", "int8"))
MIN_CP_SLICE = 8192  # tokens of a sequence one cp rank keeps at least: shorter sequences need no cp
PP_SCHEDULES_SEARCHED = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2))
"""Every schedule (pp_schedule, pp_virtual_stages) the search plans with pp > 1: the interleaved ones at v=2."""
MIN_PP_NODES = 32  # nodes from which the search plans pipeline parallelism by default (pp_sizes_for)
PP_STAGES = (1, 2, 3)  # ZeRO stages planned with pp > 1: DeepSpeed's ZeRO-1 + PP, ZeRO-2 (gradients sharded
# between passes: [Note: pipeline passes]), torchtitan's FSDP + PP
PP_PASSES_SEARCHED = (1, 4, 16, 64)
"""Pipeline passes per optimizer step the search plans with pp > 1 (those dividing the step's micro-batches)."""

# Note [pipeline passes]
# ~~~~~~~~~~~~~~~~~~~~~~
# torch keeps a receive buffer per micro-batch of a pass for each stage and direction (pp/cost.py
# [Note: receive buffers]), so one pass of every micro-batch of a step can hold more than a GPU
# where a few passes (Lightning's gradient accumulation over pipeline passes) fit. Each pass pays
# the schedule's fill and drain, so the fewest passes that fit run fastest (ZeRO-2 keeps only a
# shard of the gradients between passes, where ZeRO-1 holds them whole): the search plans the
# counts of PP_PASSES_SEARCHED in order and stops at the first that fits (a count leaving too few
# micro-batches per pass for the schedule cannot be planned: pp/layout.py refuses it).


def pipeline_passes(accumulate: int) -> tuple[int, ...]:
    """The pass counts of ``PP_PASSES_SEARCHED`` that split ``accumulate`` micro-batches evenly."""
    return tuple(p for p in PP_PASSES_SEARCHED if accumulate % p == 0)


def topology_overrides(
    shard_size: Union[None, int, str],
    hierarchical_reduce: bool,
    grad_comm_dtype: Optional[str],
    param_comm_dtype: Optional[str],
) -> list[str]:
    """The Hydra overrides of the topology knobs that differ from their defaults (docs/topology.md)."""
    out = [] if shard_size is None else [f"strategy.shard_size={shard_size}"]
    if hierarchical_reduce:
        out.append("strategy.hierarchical_reduce=true")
    for name, value in (("grad_comm_dtype", grad_comm_dtype), ("param_comm_dtype", param_comm_dtype)):
        if value is not None:
            out.append(f"strategy.{name}={value}")
    return out


@dataclass(frozen=True)
class Layout:
    """One choice of every searched knob."""

    stage: int
    tp: int
    micro_batch: int
    accumulate_grad_batches: int
    defer_grad_reduce: bool
    activation_checkpointing: str  # "none" | "selective" | "full"
    bucket_mb: float
    prefetch_blocks: int
    shard_size: Union[None, int, str] = None
    hierarchical_reduce: bool = False
    grad_comm_dtype: Optional[str] = None
    param_comm_dtype: Optional[str] = None
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_microbatches: Optional[int] = None

    def overrides(self) -> list[str]:
        """The Hydra overrides that select this layout (on top of the model / trainer / data config)."""
        out = (
            ["strategy=ddp"]
            if self.stage == 0
            else [
                f"strategy=zero{self.stage}",
                f"strategy.tensor_parallel_size={self.tp}",
                f"strategy.bucket_mb={self.bucket_mb:g}",
            ]
        )
        if self.stage == 2:
            out.append(f"strategy.defer_grad_reduce={str(self.defer_grad_reduce).lower()}")
        if self.stage == 3:
            out.append(f"strategy.prefetch_blocks={self.prefetch_blocks}")
        if self.sequence_parallel:
            out.append("strategy.sequence_parallel=true")
        if self.cp > 1:
            out.append(f"strategy.cp={self.cp}")
        if self.ep > 1:
            out.append(f"strategy.ep={self.ep}")
        if self.pp > 1:
            out += [f"strategy.pp={self.pp}", f"strategy.pp_schedule={self.pp_schedule}",
                    f"strategy.pp_virtual_stages={self.pp_virtual_stages}",
                    f"strategy.pp_microbatches={self.pp_microbatches}"]  # fmt: skip
        out += topology_overrides(
            self.shard_size, self.hierarchical_reduce, self.grad_comm_dtype, self.param_comm_dtype
        )
        # under pp Lightning's batch is one pass of the schedule, all its micro-batches (report.pipeline_micro_batch)
        batch = self.micro_batch * (self.pp_microbatches or 1) if self.pp > 1 else self.micro_batch
        out += [
            f"data.batch_size={batch}",
            f"trainer.accumulate_grad_batches={self.accumulate_grad_batches}",
            f"model.activation_checkpointing={CHECKPOINTING_OVERRIDES[self.activation_checkpointing]}",
        ]
        return out


@dataclass(frozen=True)
class Ranked:
    layout: Layout
    plan: Plan

    def as_dict(self) -> dict[str, Any]:
        timing = self.plan.timing
        assert timing is not None
        return {
            "layout": asdict(self.layout),
            "overrides": self.layout.overrides(),
            "cp_attention": self.plan.cp_attention,
            "tokens_per_s": timing.tokens_per_s,
            "step_s": timing.step_s,
            "exposed_comm_s": timing.exposed_comm_s + timing.post_step_gather_s,
            "dp_comm_s": timing.dp_comm_s,
            "mfu": timing.mfu,
            "memory_gib": self.plan.memory.total / GiB,
            "activation_gib": (self.plan.memory.activations + self.plan.memory.logits_and_loss) / GiB,
            "lossless": self.plan.lossless,
            "available_gib": self.plan.available_bytes / GiB,
            "timing": timing.as_dict(),
        }


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Ranked, ...]  # every layout that fits, fastest first
    evaluated: int  # layouts planned
    rejected_memory: int  # planned but did not fit
    seconds: float
    global_batch: int  # samples per optimizer step (all dp ranks)

    def top(self, count: int) -> list[Ranked]:
        return list(self.ranked[:count])


def cp_sizes_for(seq_len: int, world_size: int) -> list[int]:
    """The context-parallel sizes the search plans by default: 1, and powers of two up to
    ``world_size`` that leave each cp rank at least ``MIN_CP_SLICE`` tokens of the sequence."""
    sizes, cp = [1], 2
    while cp <= world_size and seq_len // cp >= MIN_CP_SLICE:
        sizes.append(cp)
        cp *= 2
    return sizes


def ep_sizes_for(model: Any) -> list[int]:
    """The expert-parallel sizes the search plans by default: 1, and for a mixture of experts the
    powers of two that divide its ``n_experts`` (the ep group must also divide the dense group's
    ranks: the search skips those that do not)."""
    experts = getattr(model, "n_experts", 0) or 1
    sizes, ep = [1], 2
    while ep <= experts and experts % ep == 0:
        sizes.append(ep)
        ep *= 2
    return sizes


def pp_sizes_for(model: Any, world_size: int, devices_per_node: int) -> list[int]:
    """The pipeline-parallel sizes the search plans by default: 1, and from ``MIN_PP_NODES`` nodes
    up the powers of two that leave each pp rank at least one node (``world_size / pp >=
    devices_per_node``: stages cross nodes, tp and the rest stay inside them) and every stage two
    blocks at least. Below that many nodes ZeRO with tp keeps up (issue 63: "for 70B on a few hundred
    GPUs, ZeRO-3 + TP is enough"), and the search stays as fast as it was; ``pp_sizes=`` plans
    pipelines on any cluster."""
    if world_size < MIN_PP_NODES * devices_per_node:
        return [1]
    sizes, pp = [1], 2
    while world_size // pp >= devices_per_node and world_size % pp == 0 and 2 * pp <= model.n_layers:
        sizes.append(pp)
        pp *= 2
    return sizes


def _tp_sizes(devices_per_node: int) -> list[int]:
    sizes, tp = [], 1
    while tp <= devices_per_node:
        sizes.append(tp)
        tp *= 2
    return sizes


# The ZeroConfig knobs the search keeps fixed (the others are its axes: stage, tp, bucket_mb, ...).
FIXED_KNOBS = (
    "max_buckets_in_flight",
    "overlap_param_gather",
    "overlap_comm",
    "reduce_dtype",
    "master_weights",
    "mixed_params",
)


def search_layouts(
    model_config: Any,
    zero_config: Optional[ZeroConfig] = None,
    *,
    world_size: int,
    devices_per_node: int,
    global_batch: int,
    seq_len: Optional[int] = None,
    precision: str = "bf16-mixed",
    hardware: Any = None,
    mfu: Optional[float] = None,
    attention: str = "fused",
    reserved_gib: float = 2.0,
    stages: Sequence[int] = (0, 1, 2, 3),
    tp_sizes: Optional[Sequence[int]] = None,
    cp_sizes: Optional[Sequence[int]] = None,
    ep_sizes: Optional[Sequence[int]] = None,
    pp_sizes: Optional[Sequence[int]] = None,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    bucket_mbs: Sequence[float] = BUCKET_MBS,
    prefetch: Sequence[int] = PREFETCH,
    checkpointing: Sequence[str] = CHECKPOINTING_MODES,
    sequence_parallel: Sequence[bool] = (False, True),
    lossless: bool = False,
    max_buckets_in_flight: int = ZERO_DEFAULTS.max_buckets_in_flight,
    overlap_param_gather: bool = ZERO_DEFAULTS.overlap_param_gather,
    overlap_comm: bool = ZERO_DEFAULTS.overlap_comm,
    reduce_dtype: str = ZERO_DEFAULTS.reduce_dtype,
    master_weights: str = ZERO_DEFAULTS.master_weights,
    mixed_params: str = ZERO_DEFAULTS.mixed_params,
    shard_sizes: Sequence[Union[None, int, str]] = SHARD_SIZES,
    hierarchical: Sequence[bool] = HIERARCHICAL,
    comm_dtypes: Sequence[tuple[Optional[str], Optional[str]]] = COMM_DTYPE_PAIRS,
    topology: bool = True,
) -> SearchResult:
    """Plan every layout (module docstring) with ``global_batch`` samples per optimizer step; return
    those that fit, ranked by predicted tokens/s (ties: less memory first). ``topology=False``
    leaves the topology knobs at their defaults (what an engine without them runs);
    ``lossless=True`` plans no layout with a lossy wire format (``Plan.lossless``).
    ``cp_sizes``: the context-parallel sizes to plan (default :func:`cp_sizes_for` the sequence);
    ``global_batch`` counts sequences, each split over a cp group. ``ep_sizes``: the expert-parallel
    sizes to plan (default :func:`ep_sizes_for` the model: 1 for a model without experts); a size
    the model refuses (its family's ``check_moe_layout``: experts not divisible, tensor parallelism
    of experts) is left out, as a tp that does not divide the heads is. ``pp_sizes``: the pipeline
    sizes (default :func:`pp_sizes_for`); a layout with ``pp > 1`` runs every sample of a dp rank's
    step as the fewest pipeline passes of ``PP_PASSES_SEARCHED`` that fit (``accumulate_grad_batches
    = passes``, ``pp_microbatches = global_batch / dp / micro_batch / passes``: [Note: pipeline
    passes]), under each schedule of ``PP_SCHEDULES_SEARCHED`` at the stages ``PP_STAGES``, the
    split balanced by the planner, without the topology knobs.

    ``zero_config``: a :class:`~lightning_zero.config.ZeroConfig` whose ``FIXED_KNOBS`` every
    layout keeps (then not passed as keywords); its searched knobs (stage, tp, bucket_mb,
    prefetch_blocks, defer_grad_reduce, sequence_parallel and the topology ones) are the search's
    axes, so they are ignored."""
    if zero_config is not None:
        given = _given_knobs(search_layouts, locals(), FIXED_KNOBS)
        if given:
            raise TypeError(
                f"search_layouts(zero_config=...): {', '.join(given)} come from the config; set them in"
                " the ZeroConfig instead of passing them too"
            )
        fixed = ZeroConfig(**{name: getattr(zero_config, name) for name in FIXED_KNOBS})
    else:
        arguments = locals()
        fixed = ZeroConfig(**{name: arguments[name] for name in FIXED_KNOBS})
    if not topology:
        shard_sizes, hierarchical, comm_dtypes = (None,), (False,), ((None, None),)
    space = SearchSpace(
        stages, tp_sizes, cp_sizes, ep_sizes, micro_batches, bucket_mbs, prefetch, checkpointing, sequence_parallel,
        shard_sizes, hierarchical, comm_dtypes, lossless, pp_sizes,
    )  # fmt: skip
    run = RunShape(precision, seq_len=seq_len, attention=attention)
    options = PlanOptions(hardware=hardware, mfu=mfu, reserved_gib=reserved_gib, suggest=False, simulate="if_fits")
    return search(model_config, fixed, SearchCluster(world_size, devices_per_node, global_batch), space, run, options)


@dataclass(frozen=True)
class SearchCluster:
    """The fixed frame of a search: the ranks, their nodes, and the samples per optimizer step."""

    world_size: int
    devices_per_node: int
    global_batch: int


@dataclass(frozen=True)
class SearchSpace:
    """The values the search tries for each axis (``search_layouts``' keywords of the same names;
    ``None``: the defaults for the model and cluster), and whether lossy wire formats are left out."""

    stages: Sequence[int] = (0, 1, 2, 3)
    tp_sizes: Optional[Sequence[int]] = None
    cp_sizes: Optional[Sequence[int]] = None
    ep_sizes: Optional[Sequence[int]] = None
    micro_batches: Sequence[int] = MICRO_BATCHES
    bucket_mbs: Sequence[float] = BUCKET_MBS
    prefetch: Sequence[int] = PREFETCH
    checkpointing: Sequence[str] = CHECKPOINTING_MODES
    sequence_parallel: Sequence[bool] = (False, True)
    shard_sizes: Sequence[Union[None, int, str]] = SHARD_SIZES
    hierarchical: Sequence[bool] = HIERARCHICAL
    comm_dtypes: Sequence[tuple[Optional[str], Optional[str]]] = COMM_DTYPE_PAIRS
    lossless: bool = False
    pp_sizes: Optional[Sequence[int]] = None


def _layout_config(fixed: ZeroConfig, layout: Layout) -> ZeroConfig:
    """``fixed``'s knobs with ``layout``'s (stage 0, Lightning's DDP, is planned from stage 1)."""
    return dataclasses.replace(
        fixed,
        stage=max(layout.stage, 1),
        tensor_parallel_size=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        cp=layout.cp,
        ep=layout.ep,
        bucket_mb=layout.bucket_mb,
        prefetch_blocks=layout.prefetch_blocks,
        defer_grad_reduce=layout.defer_grad_reduce,
        shard_size=layout.shard_size,
        hierarchical_reduce=layout.hierarchical_reduce,
        grad_comm_dtype=layout.grad_comm_dtype,
        param_comm_dtype=layout.param_comm_dtype,
        pp=layout.pp,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
        pp_microbatches=layout.pp_microbatches,
    )


def search(
    model_config: Any,
    fixed: ZeroConfig,
    cluster: SearchCluster,
    space: SearchSpace,
    run: RunShape,
    options: PlanOptions,
) -> SearchResult:
    """:func:`search_layouts` on its objects: every layout of ``space`` on ``cluster``, each with
    ``fixed``'s ``FIXED_KNOBS``, planned whole with ``run``'s precision, sequence and attention
    (its batch is the layout's) and ``options``."""
    start = time.perf_counter()
    # the wire format that sends the tensors as they are (bf16 under bf16-mixed's bf16 parameters)
    precision = run.precision
    bf16_params = precision_bytes(precision, fixed.master_weights, fixed.mixed_params).param == 2
    native = "bf16" if str(precision) == "bf16-mixed" and bf16_params else "fp32"
    model = resolve_model(model_config)
    options = dataclasses.replace(options, hardware=load_hardware(options.hardware))
    world_size, devices_per_node, global_batch = cluster.world_size, cluster.devices_per_node, cluster.global_batch

    def planned(layout: Layout) -> Optional[Plan]:
        """``layout`` planned whole (``None`` where the model does not split that way)."""

        def make() -> Plan:
            config = _layout_config(fixed, layout)
            dims = ParallelDims.from_config(config, world_size=world_size, devices_per_node=devices_per_node)
            shape = dataclasses.replace(
                run, micro_batch=layout.micro_batch, activation_checkpointing=layout.activation_checkpointing,
                accumulate_grad_batches=layout.accumulate_grad_batches,
            )  # fmt: skip
            return plan(model, config, dims, shape, options, ddp=layout.stage == 0)

        return plan_or_none(make)

    ranked: list[Ranked] = []
    evaluated = rejected = 0
    seq = run.seq_len or model.max_seq_len
    layouts = product(
        space.pp_sizes or pp_sizes_for(model, world_size, devices_per_node),
        space.tp_sizes or _tp_sizes(devices_per_node),
        space.cp_sizes or cp_sizes_for(seq, world_size),
        space.ep_sizes or ep_sizes_for(model),
    )
    for pp, tp, cp, ep in layouts:
        if world_size % (pp * tp * cp) or (world_size // pp // tp) % ep:
            continue
        dp = world_size // (pp * tp * cp)  # ranks with other sequences
        if global_batch % dp:
            continue
        for stage in space.stages:
            if stage == 0 and (tp > 1 or cp > 1 or ep > 1 or pp > 1):
                continue  # Lightning's DDP has no tensor, context, expert or pipeline parallelism
            if pp > 1 and stage not in PP_STAGES:
                continue
            defers = (False, True) if stage == 2 and pp == 1 else (False,)  # pp: deferred is ZeRO-1's memory
            prefetches = tuple(space.prefetch) if stage == 3 else (1,)
            buckets = tuple(space.bucket_mbs) if stage > 0 else (25.0,)
            if pp > 1:  # a stage's few buckets reduce once a step: their size and prefetch barely count
                prefetches, buckets = prefetches[:1], buckets[-1:]
            topologies = _topologies(stage, tp, ep, cluster, space, native) if pp == 1 else [topology_defaults()]
            sequence_splits = [sp for sp in space.sequence_parallel if not sp or (tp > 1 and seq // cp % tp == 0)]
            schedules = PP_SCHEDULES_SEARCHED if pp > 1 else (("1f1b", 1),)
            for micro_batch in space.micro_batches:
                if (global_batch // dp) % micro_batch:
                    continue
                accumulate = global_batch // dp // micro_batch
                for checkpoint, split, defer, bucket_mb, ahead, (schedule, virtual) in product(
                    space.checkpointing, sequence_splits, defers, buckets, prefetches, schedules
                ):
                    # pp: the fewest passes that fit (more are slower: each pays the bubble) [Note: pipeline passes]
                    for passes in pipeline_passes(accumulate) if pp > 1 else (accumulate,):
                        pipeline = dict(pp=pp, pp_microbatches=accumulate // passes if pp > 1 else None)
                        unfit: set = set()  # shard sizes whose memory does not fit
                        fitted = len(ranked)
                        for topo in topologies:
                            if topo["shard_size"] in unfit:  # wire formats and hierarchy hold the same bytes
                                evaluated += 1
                                rejected += 1
                                continue
                            mode = checkpointing_mode(checkpoint)
                            layout = Layout(
                                stage,
                                tp,
                                micro_batch,
                                passes,
                                defer,
                                mode,
                                float(bucket_mb),
                                ahead,
                                **topo,
                                sequence_parallel=split,
                                cp=cp,
                                ep=ep,
                                pp_schedule=schedule,
                                pp_virtual_stages=virtual,
                                **pipeline,
                            )
                            candidate = planned(layout)
                            if candidate is None:  # a tp that does not divide the model's heads, ...
                                continue
                            if space.lossless and not candidate.lossless:
                                continue  # not planned: lossy communication was ruled out
                            evaluated += 1
                            if not candidate.fits:
                                rejected += 1
                                unfit.add(topo["shard_size"])
                                continue
                            ranked.append(Ranked(layout, candidate))
                        if len(ranked) > fitted:  # more passes only add bubble
                            break
    ranked.sort(key=lambda r: (-r.plan.tokens_per_s, r.plan.memory.total))
    return SearchResult(tuple(ranked), evaluated, rejected, time.perf_counter() - start, global_batch)


def _topologies(
    stage: int, tp: int, ep: int, cluster: SearchCluster, space: SearchSpace, native: str
) -> list[dict[str, Any]]:
    """The topology knobs worth planning for one layout: none for DDP or one node (nothing crosses
    nodes); ``"node"`` only when it differs from sharding over every dp rank; hierarchical only
    when the shard group spans nodes and a node holds more than one dp rank; a wire format only
    when it differs from the native one (bf16 under bf16-mixed is a no-op). For each shard size the
    plain option comes first: the others hold the same memory, so the search skips them when it
    does not fit. With ``ep > 1`` no hybrid sharding (experts have none: ``ZeroConfig``)."""
    from lightning_zero.planner.ledger import dp_topology

    plain = topology_defaults()
    world_size, devices_per_node = cluster.world_size, cluster.devices_per_node
    if stage == 0 or world_size <= devices_per_node:
        return [plain]
    shard_sizes, hierarchical = (space.shard_sizes, space.hierarchical) if ep == 1 else ((None,), (False,))
    dp = world_size // tp
    out: list[dict[str, Any]] = []
    for shard_size in shard_sizes:
        try:
            topology = dp_topology(dp=dp, devices_per_node=devices_per_node, tp=tp, shard_size=shard_size)
        except ValueError:
            continue
        if shard_size is not None and topology.shard_size == dp:
            continue  # the same as sharding over every dp rank
        for hier in hierarchical:
            if hier and not (topology.shard_spans_nodes and topology.dp_per_node > 1):
                continue
            for grad_dtype, param_dtype in space.comm_dtypes:
                if (grad_dtype, param_dtype) != (None, None) and native in (grad_dtype, param_dtype):
                    continue
                out.append(
                    {
                        "shard_size": shard_size,
                        "hierarchical_reduce": hier,
                        "grad_comm_dtype": grad_dtype,
                        "param_comm_dtype": param_dtype,
                    }
                )
    return out or [plain]
