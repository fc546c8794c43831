"""The planner meets the outside world: the composed Hydra config in (:func:`run_plan`, what
``lightning-zero plan`` calls); rich tables, JSON, a stacked bar chart of per-rank memory by
stage, and the layout search's ranking out (drawn by ``tables.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import ZeroConfig, topology_defaults
from lightning_zero.hydra_config import PlanConf
from lightning_zero.models import LlamaConfig
from lightning_zero.models.checkpointing import checkpointing_mode
from lightning_zero.models.moe.config import MoEConfig, moe_preset_names
from lightning_zero.planner.arithmetic import STAGES, PlanOptions, RunShape, plan, resolve_model
from lightning_zero.planner.fit import plan_or_none
from lightning_zero.planner.hardware import load_hardware
from lightning_zero.planner.ledger import ATTENTION_KERNELS
from lightning_zero.planner.plan import GiB, Plan
from lightning_zero.planner.search import search_layouts, topology_overrides
from lightning_zero.planner.tables import (
    plot_memory,
    print_json,
    print_line,
    print_search,
    print_tables,
    print_topology,
)
from lightning_zero.zero.bucketing import defer_grad_reduce_at

PLAN_DEFAULTS = dataclasses.asdict(PlanConf())  # the plan/ schema's defaults, written once in config.py

# --------------------------------------------------------------------------------------------
# Config in: the composed Hydra config of `lightning-zero plan`
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRun:
    """The run ``lightning-zero plan`` plans, as :func:`~lightning_zero.planner.arithmetic.plan`
    takes it: the model, the strategy's knobs (``config``), their layout on the trainer's ranks
    (``dims``), the run's shape, the planner's options and whether the strategy is Lightning's DDP."""

    model: Any
    config: ZeroConfig
    dims: ParallelDims
    run: RunShape
    options: PlanOptions
    ddp: bool = False

    def plan(self, **knobs: Any) -> Plan:
        """The plan of this run, with ``knobs`` changed in its ``ZeroConfig`` (``stage=0``: DDP)."""
        if not knobs:
            return plan(self.model, self.config, self.dims, self.run, self.options, ddp=self.ddp)
        stage = knobs.get("stage", self.config.stage)
        knobs = {**knobs, "stage": max(stage, 1)}
        knobs["defer_grad_reduce"] = defer_grad_reduce_at(
            stage, knobs.get("defer_grad_reduce", self.config.defer_grad_reduce)
        )
        config = dataclasses.replace(self.config, **knobs)
        dims = ParallelDims.from_config(
            config, world_size=self.dims.world_size, devices_per_node=self.dims.devices_per_node
        )
        return plan(self.model, config, dims, self.run, self.options, ddp=stage == 0)


ZERO_FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))


def plan_inputs_from_config(cfg: Any) -> tuple[PlannedRun, dict[str, Any]]:
    """Read the composed Hydra config: ``(the run, as plan() takes it; the plan options)``.

    Reads ``model`` (preset ``name`` + field overrides, ``activation_checkpointing``),
    ``strategy`` (every ``ZeroConfig`` knob it sets, into one ``ZeroConfig``; Lightning's DDP
    plans ``ddp=True``), ``trainer`` (``devices`` per node, ``num_nodes``, ``precision``,
    ``accumulate_grad_batches``), ``data`` (``batch_size``, ``seq_len``), ``hardware`` (a
    ``conf/hardware`` mapping or name) and ``plan`` (``format``, ``plot``, ``mfu``, ``stages``,
    ``reserved_gib``, ``attention``, ``search``, ``top``, ``overlap_param_gather``; see
    ``conf/plan/default.yaml``). Missing groups take defaults (the hardware: ``conf/config.yaml``'s).
    """

    container = _to_container(cfg)
    model = container.get("model") or "tiny"
    activation_checkpointing: Any = False
    if isinstance(model, Mapping):
        activation_checkpointing = checkpointing_mode(
            model.get("activation_checkpointing"), "model.activation_checkpointing"
        )
        family = MoEConfig if str(model.get("name")).lower() in moe_preset_names() else LlamaConfig
        fields = {f.name for f in dataclasses.fields(family)}
        model = {k: v for k, v in model.items() if k in fields and v is not None}
    model_config = resolve_model(model)

    strategy = container.get("strategy") or {}
    if isinstance(strategy, str):
        strategy = {"stage": int(strategy[-1]) if strategy.startswith("zero") else 0}
    stage = int(strategy.get("stage", 0 if "DDP" in str(strategy.get("_target_", "")) else 2))
    trainer = container.get("trainer") or {}
    data = container.get("data") or {}
    plan_options = {**PLAN_DEFAULTS, **(container.get("plan") or {})}
    hardware = load_hardware(container.get("hardware"))

    devices = trainer.get("devices", hardware.devices_per_node)
    if not isinstance(devices, int) or isinstance(devices, bool):
        devices = len(devices) if isinstance(devices, (list, tuple)) else hardware.devices_per_node
    num_nodes = int(trainer.get("num_nodes") or 1)
    knobs = {name: value for name, value in strategy.items() if name in ZERO_FIELDS}
    knobs.update(topology_knobs(strategy), stage=max(stage, 1))
    knobs["defer_grad_reduce"] = defer_grad_reduce_at(stage, knobs.get("defer_grad_reduce", False))
    if plan_options["overlap_param_gather"] is not None:
        knobs["overlap_param_gather"] = bool(plan_options["overlap_param_gather"])
    config = ZeroConfig(**knobs)
    if str(plan_options["attention"]) not in ATTENTION_KERNELS:
        raise ValueError(f"plan.attention must be one of {ATTENTION_KERNELS}, got {plan_options['attention']!r}")
    run = RunShape(
        precision=str(trainer.get("precision") or "bf16-mixed"),
        micro_batch=pipeline_micro_batch(config, int(data.get("batch_size") or 1)),
        seq_len=int(data.get("seq_len") or model_config.max_seq_len),
        activation_checkpointing=activation_checkpointing,
        accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
        attention=str(plan_options["attention"]),
        optimizer=str(plan_options["optimizer"]),
    )
    options = PlanOptions(
        hardware=hardware,
        mfu=None if plan_options["mfu"] is None else float(plan_options["mfu"]),
        reserved_gib=float(plan_options["reserved_gib"]),
    )
    dims = ParallelDims.from_config(config, world_size=devices * num_nodes, devices_per_node=devices)
    return PlannedRun(model_config, config, dims, run, options, ddp=stage == 0), plan_options


def pipeline_micro_batch(config: ZeroConfig, batch_size: int) -> int:
    """The samples of one forward for ``data.batch_size`` (Lightning's batch): under ``pp > 1`` the
    batch is one pipeline pass, cut into the schedule's micro-batches (``pp_microbatches``, default
    one per stage: [Note: the pipelined step] in ``runtime/pipeline.py``), and the plan's micro
    batch is one of them. Raises ``ValueError`` naming the fix when they do not divide."""
    if config.pp == 1:
        return batch_size
    local = 2 if config.pp_schedule == "zbv" else config.pp_virtual_stages  # stages per rank
    microbatches = config.pp_microbatches or config.pp * local
    if batch_size % microbatches:
        raise ValueError(
            f"data.batch_size={batch_size} does not split into {microbatches} pipeline micro-batches (under pp the"
            " batch is one pass of the schedule); use a data.batch_size that is a multiple of strategy.pp_microbatches"
        )
    return batch_size // microbatches


def topology_knobs(strategy: Mapping[str, Any]) -> dict[str, Any]:
    """``strategy.shard_size`` (None | int | "node"), ``strategy.hierarchical_reduce``,
    ``strategy.grad_comm_dtype`` / ``strategy.param_comm_dtype`` (None | fp32 | bf16 | int8) of the
    composed config, each defaulting as :class:`~lightning_zero.ZeroStrategy` does."""
    knobs = {name: strategy.get(name, default) for name, default in topology_defaults().items()}
    shard = knobs["shard_size"]
    if isinstance(shard, str) and shard not in ("node",):
        if not shard.isdigit():
            raise ValueError(f"strategy.shard_size must be null, 'node' or a positive int, got {shard!r}")
        knobs["shard_size"] = int(shard)
    knobs["hierarchical_reduce"] = bool(knobs["hierarchical_reduce"])
    return knobs


def _to_container(cfg: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(cfg)


# --------------------------------------------------------------------------------------------
# Topology options: the same run with each way of sharding / reducing / compressing (docs/topology.md)
# --------------------------------------------------------------------------------------------

TOPOLOGY_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ZeRO over the world", {}),
    ("hierarchical reduce", {"hierarchical_reduce": True}),
    ("hybrid per node", {"shard_size": "node"}),
    ("hybrid per node + int8", {"shard_size": "node", "grad_comm_dtype": "int8", "param_comm_dtype": "int8"}),
    ("world + int8", {"grad_comm_dtype": "int8", "param_comm_dtype": "int8"}),
)


def topology_plans(planned: PlannedRun) -> list[tuple[str, Plan]]:
    """The configured run under each of :data:`TOPOLOGY_OPTIONS` its layout takes (other knobs as
    configured; expert parallelism has no hybrid sharding of experts)."""
    plans = [
        (label, plan_or_none(lambda change=change: planned.plan(**{**topology_defaults(), **change})))
        for label, change in TOPOLOGY_OPTIONS
    ]
    return [(label, option) for label, option in plans if option is not None]  # ep > 1: no hybrid sharding


# --------------------------------------------------------------------------------------------
# CLI entry: `lightning-zero plan [overrides]`
# --------------------------------------------------------------------------------------------


def run_plan(cfg: Any, *, console: Any = None) -> dict[str, Any]:
    """``lightning-zero plan``: plan the configured run and, side by side, every stage.

    Prints a rich table (``plan.format=table``) or JSON (``plan.format=json``) and, with
    ``plan.plot=PATH.png``, writes the per-rank memory of each stage as a stacked bar chart. With
    ``plan.search=true`` it also ranks every layout that fits (``plan.top`` shown).
    Returns the JSON-ready dict (``{"plan": ..., "stages": [...], "search": {...}}``).
    """
    planned, options = plan_inputs_from_config(cfg)
    output_format = str(options.get("format", "table"))
    if output_format not in ("table", "json"):
        raise ValueError(f"plan.format must be 'table' or 'json', got {output_format!r}")
    plan = planned.plan()
    only = str(options.get("stages", "all")) == "only"
    stages = [plan] if only else [plan if s == plan.stage else planned.plan(stage=s) for s in STAGES]
    result: dict[str, Any] = {"plan": plan.as_dict(), "stages": [p.as_dict() for p in stages]}
    topology = None
    if options.get("topology") and plan.stage > 0 and plan.num_nodes > 1:
        topology = topology_plans(planned)
        result["topology"] = [
            {"option": label, "overrides": _topology_overrides(p), "plan": p.as_dict()} for label, p in topology
        ]
    search = None
    if options.get("search"):
        top = int(options.get("top") or 10)
        search = search_layouts(
            planned.model,
            world_size=planned.dims.world_size,
            devices_per_node=planned.dims.devices_per_node,
            global_batch=plan.dp * plan.micro_batch * plan.accumulate_grad_batches,
            seq_len=plan.seq_len,
            precision=plan.precision,
            hardware=planned.options.hardware,
            mfu=planned.options.mfu,
            attention=plan.attention,
            reserved_gib=planned.options.reserved_gib,
            max_buckets_in_flight=plan.max_buckets_in_flight,
            overlap_param_gather=plan.overlap_param_gather,
            overlap_comm=planned.config.overlap_comm,
            reduce_dtype=planned.config.reduce_dtype,
            master_weights=planned.config.master_weights,
            mixed_params=planned.config.mixed_params,
            lossless=bool(options.get("lossless")),
        )
        result["search"] = {
            "evaluated": search.evaluated,
            "rejected_memory": search.rejected_memory,
            "fit": len(search.ranked),
            "seconds": search.seconds,
            "global_batch": search.global_batch,
            "top": [entry.as_dict() for entry in search.top(top)],
        }
    if options.get("plot"):
        result["plot"] = str(plot_memory(stages, options["plot"]))
    if output_format == "json":
        print_json(result, console=console)
    else:
        print_tables(plan, stages, console=console)
        if plan.optimizer == "muon":
            print_line(muon_line(plan), console=console)
        if topology is not None:
            print_topology(topology, console=console)
        if search is not None:
            print_search(search, int(options.get("top") or 10), plan, console=console)
        if "plot" in result:
            print_line(f"plot: {result['plot']}", console=console)
    return result


def muon_line(plan: Plan) -> str:
    """What Muon's matrix owners cost in ``plan`` (planner/muon.py ``with_muon``), one line."""
    return (
        f"muon: Newton-Schulz {plan.muon_owner_flops:.3g} FLOPs on the busiest owner; owner exchange"
        f" {plan.muon_exchange_bytes / 1e9:.2f} GB/step per rank; momenta {plan.muon_momentum_bytes / GiB:.2f} GiB"
        f" on the busiest owner; optimizer step {plan.muon_step_s * 1e3:.1f} ms vs AdamW's"
        f" {plan.adamw_step_s * 1e3:.1f} ms ({plan.muon_step_s / plan.adamw_step_s:.1f}x), exposed after the clip"
    )


def _topology_overrides(plan: Plan) -> list[str]:
    shard_size = plan.shard_size if plan.replicas > 1 else None
    return topology_overrides(shard_size, plan.hierarchical_reduce, plan.grad_comm_dtype, plan.param_comm_dtype)
