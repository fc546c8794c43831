"""The planner meets the outside world: the composed Hydra config in (:func:`run_plan`, what
``lightning-zero plan`` calls); rich tables, JSON, a stacked bar chart of per-rank memory by
stage, and the layout search's ranking out.

Memory is shown in GiB (2**30 bytes, as GPU memory is sold and reported); traffic in GB (1e9
bytes, as link bandwidths are quoted). matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_zero.checkpointing import checkpointing_mode
from lightning_zero.config import ZERO_DEFAULTS
from lightning_zero.hydra_config import PlanConf
from lightning_zero.models import LlamaConfig, resolve_config
from lightning_zero.planner.arithmetic import STAGES, plan_run
from lightning_zero.planner.hardware import load_hardware
from lightning_zero.planner.ledger import ATTENTION_KERNELS
from lightning_zero.planner.plan import GiB, Plan
from lightning_zero.planner.search import SearchResult, search_layouts, topology_overrides

PLAN_DEFAULTS = dataclasses.asdict(PlanConf())  # the plan/ schema's defaults, written once in config.py

# --------------------------------------------------------------------------------------------
# Config in: the composed Hydra config of `lightning-zero plan`
# --------------------------------------------------------------------------------------------


def plan_kwargs_from_config(cfg: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Read the composed Hydra config: ``(model_config, plan_run kwargs, plan options)``.

    Reads ``model`` (preset ``name`` + field overrides, ``activation_checkpointing``),
    ``strategy`` (``stage``, ``tensor_parallel_size``, ``bucket_mb``, ``prefetch_blocks``;
    Lightning's DDP counts as stage 0), ``trainer`` (``devices`` per node, ``num_nodes``,
    ``precision``, ``accumulate_grad_batches``), ``data`` (``batch_size``, ``seq_len``),
    ``hardware`` (a ``conf/hardware`` mapping or name) and ``plan`` (``format``, ``plot``,
    ``mfu``, ``stages``, ``reserved_gib``, ``attention``, ``search``, ``top``,
    ``overlap_param_gather``; see ``conf/plan/default.yaml``). Missing groups take defaults (the
    hardware: ``conf/config.yaml``'s).
    """

    container = _to_container(cfg)
    model = container.get("model") or "tiny"
    activation_checkpointing: Any = False
    if isinstance(model, Mapping):
        activation_checkpointing = checkpointing_mode(
            model.get("activation_checkpointing"), "model.activation_checkpointing"
        )
        llama_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        model = {k: v for k, v in model.items() if k in llama_fields and v is not None}
    model_config = resolve_config(model)

    strategy = container.get("strategy") or {}
    if isinstance(strategy, str):
        strategy = {"stage": int(strategy[-1]) if strategy.startswith("zero") else 0}
    stage = strategy.get("stage", 0 if "DDP" in str(strategy.get("_target_", "")) else 2)
    trainer = container.get("trainer") or {}
    data = container.get("data") or {}
    plan_options = {**PLAN_DEFAULTS, **(container.get("plan") or {})}
    hardware = load_hardware(container.get("hardware"))

    devices = trainer.get("devices", hardware.devices_per_node)
    if not isinstance(devices, int) or isinstance(devices, bool):
        devices = len(devices) if isinstance(devices, (list, tuple)) else hardware.devices_per_node
    num_nodes = int(trainer.get("num_nodes") or 1)
    kwargs = dict(
        stage=int(stage),
        world_size=devices * num_nodes,
        devices_per_node=devices,
        tp=strategy.get("tensor_parallel_size", ZERO_DEFAULTS.tensor_parallel_size),
        precision=str(trainer.get("precision") or "bf16-mixed"),
        micro_batch=int(data.get("batch_size") or 1),
        seq_len=int(data.get("seq_len") or model_config.max_seq_len),
        activation_checkpointing=activation_checkpointing,
        sequence_parallel=bool(strategy.get("sequence_parallel", ZERO_DEFAULTS.sequence_parallel)),
        bucket_mb=strategy.get("bucket_mb", ZERO_DEFAULTS.bucket_mb),  # "auto" resolved by plan_run
        prefetch_blocks=int(strategy.get("prefetch_blocks", ZERO_DEFAULTS.prefetch_blocks)),
        defer_grad_reduce=bool(strategy.get("defer_grad_reduce", ZERO_DEFAULTS.defer_grad_reduce)) and int(stage) == 2,
        overlap_comm=bool(strategy.get("overlap_comm", ZERO_DEFAULTS.overlap_comm)),
        max_buckets_in_flight=int(strategy.get("max_buckets_in_flight", ZERO_DEFAULTS.max_buckets_in_flight)),
        overlap_param_gather=bool(
            strategy.get("overlap_param_gather", ZERO_DEFAULTS.overlap_param_gather)
            if plan_options["overlap_param_gather"] is None
            else plan_options["overlap_param_gather"]
        ),
        **topology_knobs(strategy),
        hardware=hardware,
        mfu=None if plan_options["mfu"] is None else float(plan_options["mfu"]),
        accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
        attention=str(plan_options["attention"]),
        reserved_gib=float(plan_options["reserved_gib"]),
        reduce_dtype=str(strategy.get("reduce_dtype", ZERO_DEFAULTS.reduce_dtype)),
    )
    if kwargs["attention"] not in ATTENTION_KERNELS:
        raise ValueError(f"plan.attention must be one of {ATTENTION_KERNELS}, got {kwargs['attention']!r}")
    return model_config, kwargs, plan_options


TOPOLOGY_KNOBS = ("shard_size", "hierarchical_reduce", "grad_comm_dtype", "param_comm_dtype")  # docs/topology.md


def topology_knobs(strategy: Mapping[str, Any]) -> dict[str, Any]:
    """``strategy.shard_size`` (None | int | "node"), ``strategy.hierarchical_reduce``,
    ``strategy.grad_comm_dtype`` / ``strategy.param_comm_dtype`` (None | fp32 | bf16 | int8) of the
    composed config, each defaulting as :class:`~lightning_zero.ZeroStrategy` does."""
    knobs = {name: strategy.get(name, getattr(ZERO_DEFAULTS, name)) for name in TOPOLOGY_KNOBS}
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
# Out: tables, JSON, plot
# --------------------------------------------------------------------------------------------

MEMORY_ROWS = (  # (MemoryPerRank attribute, label)
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master_weights", "master weights (fp32, in optimizer)"),
    ("optimizer_moments", "Adam moments (in optimizer)"),
    ("bucket_buffers", "gradient buckets in flight"),
    ("prefetch_buffers", "stage-3 gathered blocks"),
    ("param_grad", "one parameter's gradient before its bucket"),
    ("activations", "activations"),
    ("logits_and_loss", "logits + loss"),
)
STEP_ROW = ("step_grad_shard", "fp32 grad shard at step (peaks apart)")
STAGE_NAMES = {0: "DDP (0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _gib(value: float) -> str:
    return f"{value / GiB:,.2f}"


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f}"


def _seconds(value: float) -> str:
    return f"{value * 1e3:,.1f} ms"


def layout_line(plan: Plan) -> str:
    nodes = f"{plan.num_nodes} node{'s' if plan.num_nodes > 1 else ''} x {plan.devices_per_node}"
    return f"{plan.world_size} ranks ({nodes}): dp={plan.dp} x tp={plan.tp}"


def header_rows(plan: Plan) -> list[tuple[str, str]]:
    acts = plan.activation_detail
    return [
        ("model", f"{plan.model}: {plan.num_params:,} parameters ({plan.params_per_tp_rank:,} per tp rank)"),
        ("layout", layout_line(plan)),
        ("precision", plan.precision),
        (
            "batch",
            f"micro_batch={plan.micro_batch} x seq_len={plan.seq_len} x accumulate="
            f"{plan.accumulate_grad_batches} x dp={plan.dp} = {plan.tokens_per_step:,} tokens/step",
        ),
        (
            "activations / block",
            f"{_gib(acts.per_layer)} GiB saved, {_gib(acts.checkpointed_per_layer)} GiB "
            f"checkpointed (checkpointing={'on' if plan.activation_checkpointing else 'off'}, "
            f"attention={plan.attention})",
        ),
        (
            "engine",
            f"bucket_mb={plan.bucket_mb:g}, prefetch_blocks={plan.prefetch_blocks}, "
            f"defer_grad_reduce={plan.defer_grad_reduce}, max_buckets_in_flight={plan.max_buckets_in_flight}, "
            f"overlap_param_gather={plan.overlap_param_gather}",
        ),
        ("sharding", sharding_line(plan)),
        (
            "hardware",
            f"{plan.hardware}: {_gib(plan.memory_bytes)} GiB, {_gib(plan.reserved_bytes)} GiB reserved, "
            f"mfu={plan.mfu:g}",
        ),
    ]


def sharding_line(plan: Plan) -> str:
    """How ZeRO shards and what crosses nodes in which wire format (docs/topology.md)."""
    if plan.replicas == 1:
        text = f"ZeRO over all dp={plan.dp} ranks"
    else:
        text = f"hybrid: shard_size={plan.shard_size} x {plan.replicas} replicas"
    if plan.hierarchical_reduce:
        text += ", hierarchical reduce-scatter (in node, then across nodes)"
    wire = {"grads": plan.grad_comm_dtype, "params": plan.param_comm_dtype}
    text += "; cross-node wire: " + ", ".join(f"{k} {v or 'uncompressed'}" for k, v in wire.items())
    return text


def memory_rows(stages: Sequence[Plan]) -> list[list[str]]:
    rows = [[label, *(_gib(getattr(p.memory, attr)) for p in stages)] for attr, label in MEMORY_ROWS]
    rows.append([STEP_ROW[1], *(_gib(getattr(p.memory, STEP_ROW[0])) for p in stages)])
    rows.append(["total", *(_gib(p.memory.total) for p in stages)])
    rows.append(["usable on the GPU", *(_gib(p.available_bytes) for p in stages)])
    rows.append(["fits", *("yes" if p.fits else "NO" for p in stages)])
    return rows


def traffic_rows(stages: Sequence[Plan]) -> list[list[str]]:
    rows = [
        ["dp bytes sent / step (GB)", *(_gb(p.traffic.dp_bytes) for p in stages)],
        ["dp time on the link", *(f"{_seconds(p.traffic.dp_s)} ({p.traffic.dp_link})" for p in stages)],
        ["intra-node GB / step (dp + tp)", *(_gb(p.traffic.intra_node_bytes) for p in stages)],
        ["inter-node GB / step", *(_gb(p.traffic.inter_node_bytes) for p in stages)],
        [
            "dp time intra / inter-node",
            *(f"{_seconds(p.traffic.intra_node_s)} / {_seconds(p.traffic.inter_node_s)}" for p in stages),
        ],
        ["tp bytes sent / step (GB)", *(_gb(p.traffic.tp_all_reduce_bytes) for p in stages)],
        ["tp time (NVLink, blocking)", *(_seconds(p.traffic.tp_s) for p in stages)],
        ["compute time (incl. tp)", *(_seconds(p.traffic.compute_s) for p in stages)],
    ]
    if all(p.timing is not None for p in stages):
        rows += [
            [
                "optimizer + grad copies",
                *(
                    _seconds(p.timing.optimizer_s + p.timing.grad_copy_s)  # type: ignore[union-attr]
                    for p in stages
                ),
            ],
            ["exposed comm", *(_seconds(p.traffic.exposed_comm_s) for p in stages)],
            *(
                [["step overhead (hardware)", *(_seconds(p.timing.overhead_s) for p in stages)]]  # type: ignore[union-attr]
                if any(p.timing.overhead_s for p in stages)  # type: ignore[union-attr]
                else []
            ),
            ["predicted step", *(_seconds(p.traffic.step_s) for p in stages)],
            ["tokens/s (all ranks)", *(f"{p.tokens_per_s:,.0f}" for p in stages)],
            ["MFU", *(f"{p.timing.mfu:.1%}" for p in stages)],  # type: ignore[union-attr]
        ]
    return rows


def print_tables(plan: Plan, stages: Sequence[Plan], console: Any = None) -> None:
    """The run, the per-rank memory and traffic of every stage, and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    header = Table(title=f"lightning-zero plan: ZeRO stage {plan.stage}", show_header=False)
    header.add_column(style="bold")
    header.add_column()
    for key, value in header_rows(plan):
        header.add_row(key, value)
    console.print(header)

    columns = [STAGE_NAMES[p.stage] + (" *" if p.stage == plan.stage else "") for p in stages]
    for title, rows in (
        ("memory per rank (GiB)", memory_rows(stages)),
        ("per optimizer step, per rank", traffic_rows(stages)),
    ):
        table = Table(title=title)
        table.add_column("")
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(f"verdict (stage {plan.stage}): {plan.verdict}")
    for note in plan.notes:
        console.print(f"note: {note}")


def print_line(text: str, console: Any = None) -> None:
    from rich.console import Console

    (console or Console()).print(text)


def print_json(result: dict[str, Any], console: Any = None) -> None:
    """One JSON document on stdout (not through rich, so it is never wrapped)."""
    text = json.dumps(result, indent=2)
    if console is not None and hasattr(console, "file"):
        console.file.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


def plot_memory(stages: Sequence[Plan], path: Union[str, Path], title: Optional[str] = None) -> Path:
    """Stacked bars of each stage's per-rank memory (GiB), with the GPU's usable memory as a line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [STAGE_NAMES[p.stage] for p in stages]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    bottoms = [0.0] * len(stages)
    for attr, label in MEMORY_ROWS:
        heights = [getattr(p.memory, attr) / GiB for p in stages]
        if not any(heights):
            continue
        axes.bar(labels, heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    totals = [p.memory.total / GiB for p in stages]  # above the bars when the step's peak is larger
    axes.scatter(labels, totals, marker="_", s=400, color="black", label="total (peak)")
    usable = stages[0].available_bytes / GiB
    axes.axhline(usable, color="black", linestyle="--", linewidth=1, label=f"usable on {stages[0].hardware}")
    first = stages[0]
    axes.set_title(
        title or f"{first.model}, {layout_line(first)}, {first.precision}, B={first.micro_batch} T={first.seq_len}",
        fontsize=9,
    )
    axes.set_ylabel("GiB per rank")
    axes.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
    return path


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


def topology_plans(model_config: Any, kwargs: Mapping[str, Any]) -> list[tuple[str, Plan]]:
    """The configured run under each of :data:`TOPOLOGY_OPTIONS` (other knobs as configured)."""
    plain = {
        **kwargs,
        **dict.fromkeys(("shard_size", "grad_comm_dtype", "param_comm_dtype")),
        "hierarchical_reduce": False,
    }
    return [(label, plan_run(model_config, **{**plain, **change})) for label, change in TOPOLOGY_OPTIONS]


def topology_rows(options: Sequence[tuple[str, Plan]]) -> list[list[str]]:
    rows = []
    for label, p in options:
        t = p.traffic
        rows.append(
            [
                label,
                _gb(t.intra_node_bytes),
                _gb(t.inter_node_bytes),
                _seconds(t.intra_node_s),
                _seconds(t.inter_node_s),
                _seconds(t.exposed_comm_s),
                _seconds(t.step_s),
                _gib(p.memory.total),
                "yes" if p.fits else "NO",
            ]
        )
    return rows


TOPOLOGY_COLUMNS = (
    "option",
    "intra-node GB",
    "inter-node GB",
    "dp time intra",
    "dp time inter",
    "exposed comm",
    "step",
    "GiB/rank",
    "fits",
)


def print_topology(options: Sequence[tuple[str, Plan]], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    first = options[0][1]
    table = Table(
        title=f"topology options, ZeRO stage {first.stage}, per rank per optimizer step (intra-node includes tp "
        f"{_gb(first.traffic.tp_all_reduce_bytes)} GB; int8 = one fp32 scale per 256 elements)"
    )
    for column in TOPOLOGY_COLUMNS:
        table.add_column(column, justify="left" if column == "option" else "right")
    for row in topology_rows(options):
        table.add_row(*row)
    console.print(table)


# --------------------------------------------------------------------------------------------
# The layout search
# --------------------------------------------------------------------------------------------


def search_rows(result: SearchResult, count: int) -> list[list[str]]:
    rows = []
    for rank, entry in enumerate(result.top(count), start=1):
        timing = entry.plan.timing
        assert timing is not None
        rows.append(
            [
                str(rank),
                f"{entry.plan.tokens_per_s:,.0f}",
                f"{timing.step_s:.2f}",
                f"{timing.mfu:.1%}",
                f"{(timing.exposed_comm_s + timing.post_step_gather_s):.2f}",
                f"{entry.plan.memory.total / GiB:.1f}",
                "yes" if entry.plan.lossless else "LOSSY",
                " ".join(entry.layout.overrides()),
            ]
        )
    return rows


def print_search(result: SearchResult, count: int, plan: Plan, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"layout search: top {min(count, len(result.ranked))} of {len(result.ranked)} that fit "
        f"({result.evaluated} planned, {result.rejected_memory} over memory, {result.seconds:.1f} s); "
        f"{plan.model} on {layout_line(plan).split(':')[0]}, {result.global_batch} samples x "
        f"{plan.seq_len} tokens per step, {plan.hardware}"
    )
    for column in ("#", "tokens/s", "step s", "MFU", "exposed comm s", "GiB/rank", "lossless", "overrides"):
        table.add_column(column, justify="left" if column == "overrides" else "right")
    for row in search_rows(result, count):
        table.add_row(*row)
    console.print(table)


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
    model_config, kwargs, options = plan_kwargs_from_config(cfg)
    output_format = str(options.get("format", "table"))
    if output_format not in ("table", "json"):
        raise ValueError(f"plan.format must be 'table' or 'json', got {output_format!r}")
    plan = plan_run(model_config, **kwargs)
    only = str(options.get("stages", "all")) == "only"
    stage_kwargs = {k: v for k, v in kwargs.items() if k != "stage"}
    stages = (
        [plan]
        if only
        else [
            plan
            if s == plan.stage
            else plan_run(
                model_config,
                stage=s,
                **{**stage_kwargs, "defer_grad_reduce": stage_kwargs["defer_grad_reduce"] and s == 2},
            )
            for s in STAGES
        ]
    )
    result: dict[str, Any] = {"plan": plan.as_dict(), "stages": [p.as_dict() for p in stages]}
    topology = None
    if options.get("topology") and plan.stage > 0 and plan.num_nodes > 1:
        topology = topology_plans(model_config, kwargs)
        result["topology"] = [
            {"option": label, "overrides": _topology_overrides(p), "plan": p.as_dict()} for label, p in topology
        ]
    search = None
    if options.get("search"):
        top = int(options.get("top") or 10)
        search = search_layouts(
            model_config,
            world_size=kwargs["world_size"],
            devices_per_node=kwargs["devices_per_node"],
            global_batch=plan.dp * plan.micro_batch * plan.accumulate_grad_batches,
            seq_len=plan.seq_len,
            precision=plan.precision,
            hardware=kwargs["hardware"],
            mfu=kwargs["mfu"],
            attention=plan.attention,
            reserved_gib=kwargs["reserved_gib"],
            max_buckets_in_flight=plan.max_buckets_in_flight,
            overlap_param_gather=plan.overlap_param_gather,
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
        if topology is not None:
            print_topology(topology, console=console)
        if search is not None:
            print_search(search, int(options.get("top") or 10), plan, console=console)
        if "plot" in result:
            print_line(f"plot: {result['plot']}", console=console)
    return result


def _topology_overrides(plan: Plan) -> list[str]:
    shard_size = plan.shard_size if plan.replicas > 1 else None
    return topology_overrides(shard_size, plan.hierarchical_reduce, plan.grad_comm_dtype, plan.param_comm_dtype)
