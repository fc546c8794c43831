"""The planner's output: rich tables, JSON, a stacked bar chart of per-rank memory by stage, the
topology options side by side and the layout search's ranking (``report.py`` composes them).

Memory is shown in GiB (2**30 bytes, as GPU memory is sold and reported); traffic in GB (1e9
bytes, as link bandwidths are quoted). matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_zero.planner.plan import GiB, Plan
from lightning_zero.planner.search import SearchResult

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
    ("recv_buffers", "pp: torch's receive buffers"),
    ("param_grad", "gradients outside the buckets (pp: the schedule's)"),
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
    cp = f" x cp={plan.cp} ({plan.cp_attention} attention)" if plan.cp > 1 else ""
    ep = f", experts over ep={plan.ep} (edp={plan.edp})" if plan.ep > 1 else ""
    pp = f"pp={plan.pp} x " if plan.pp > 1 else ""
    return f"{plan.world_size} ranks ({nodes}): {pp}dp={plan.dp}{cp} x tp={plan.tp}{ep}"


def pipeline_line(plan: Plan) -> str:
    """``pp > 1``: the schedule, the split, the bubble, and per pp rank what it keeps in flight and
    sends to its neighbours (planner/pipeline.py; docs/pipeline.md)."""
    pipeline = plan.pipeline
    ranks = "; ".join(
        f"rank {r.pp_rank}: {r.blocks} blocks, {r.in_flight} micro-batches in flight "
        f"({_gib(r.in_flight_bytes)} GiB), P2P {_gb(r.p2p_sent)} GB sent"
        for r in (pipeline.ranks[0], pipeline.ranks[-1])
    )
    return (
        f"{plan.pp_schedule} over pp={plan.pp} ({plan.pp_virtual_stages} stage(s) per rank), "
        f"{plan.pp_microbatches} micro-batches per pass, blocks per stage {list(plan.pp_layers)}, "
        f"bubble {plan.bubble_fraction:.1%}; {ranks}; memory above is rank {plan.pp_rank}'s"
    )


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
        *([("pipeline", pipeline_line(plan))] if plan.pp > 1 else []),
        (
            "hardware",
            f"{plan.hardware}: {_gib(plan.memory_bytes)} GiB, {_gib(plan.reserved_bytes)} GiB reserved, "
            f"mfu={plan.mfu:g}",
        ),
    ]


def sharding_line(plan: Plan) -> str:
    """How ZeRO shards and what crosses nodes in which wire format (docs/topology.md)."""
    if plan.replicas == 1:
        text = (
            f"ZeRO over all dp={plan.dp} ranks" if plan.cp == 1 else f"ZeRO over all dp x cp={plan.dp * plan.cp} ranks"
        )
    else:
        text = f"hybrid: shard_size={plan.shard_size} x {plan.replicas} replicas"
    if plan.hierarchical_reduce:
        text += ", hierarchical reduce-scatter (in node, then across nodes)"
    if plan.ep > 1:
        text += (
            f"; experts ({plan.expert_params_per_rank:,} params per rank) over their edp={plan.edp} ranks,"
            f" tokens all-to-all over ep={plan.ep} ({plan.traffic.ep_link})"
        )
    wire = {"grads": plan.grad_comm_dtype, "params": plan.param_comm_dtype}
    text += "; cross-node wire: " + ", ".join(f"{k} {v or 'uncompressed'}" for k, v in wire.items())
    return text


def memory_rows(stages: Sequence[Plan]) -> list[list[str]]:
    rows = [
        [label, *(_gib(getattr(p.memory, attr)) for p in stages)]
        for attr, label in MEMORY_ROWS
        if attr != "recv_buffers" or any(p.memory.recv_buffers for p in stages)  # pp only
    ]
    rows.append([STEP_ROW[1], *(_gib(getattr(p.memory, STEP_ROW[0])) for p in stages)])
    rows.append(["total", *(_gib(p.memory.total) for p in stages)])
    rows.append(["usable on the GPU", *(_gib(p.available_bytes) for p in stages)])
    rows.append(["fits", *("yes" if p.fits else "NO" for p in stages)])
    return rows


def traffic_rows(stages: Sequence[Plan]) -> list[list[str]]:
    rows = [
        ["dp bytes sent / step (GB)", *(_gb(p.traffic.dp_bytes) for p in stages)],
        ["dp time on the link", *(f"{_seconds(p.traffic.dp_s)} ({p.traffic.dp_link})" for p in stages)],
        ["intra-node GB / step (dp + tp + cp + ep)", *(_gb(p.traffic.intra_node_bytes) for p in stages)],
        ["inter-node GB / step", *(_gb(p.traffic.inter_node_bytes) for p in stages)],
        [
            "dp time intra / inter-node",
            *(f"{_seconds(p.traffic.intra_node_s)} / {_seconds(p.traffic.inter_node_s)}" for p in stages),
        ],
        ["tp bytes sent / step (GB)", *(_gb(p.traffic.tp_all_reduce_bytes) for p in stages)],
        *(
            [
                [
                    "pp P2P bytes sent / step (GB)",
                    *(f"{_gb(p.traffic.pp_sent_bytes)} ({p.traffic.pp_link})" for p in stages),
                ]
            ]
            if any(p.pp > 1 for p in stages)
            else []
        ),
        ["tp time (NVLink, blocking)", *(_seconds(p.traffic.tp_s) for p in stages)],
        ["compute time (incl. tp)", *(_seconds(p.traffic.compute_s) for p in stages)],
    ]
    if any(p.cp > 1 for p in stages):  # docs/context_parallel.md
        rows[-1:-1] = [
            [
                "cp bytes / step (GB): " + ", ".join(sorted({k for p in stages for k in p.traffic.cp_bytes_by_kind})),
                *(_gb(p.traffic.cp_bytes) for p in stages),
            ],
            [
                "cp time (blocking, in compute)",
                *(f"{_seconds(p.traffic.cp_s)} ({p.traffic.cp_link})" for p in stages),
            ],
        ]
    if any(p.ep > 1 for p in stages):  # docs/moe.md
        rows[-1:-1] = [
            ["ep all-to-all bytes / step (GB)", *(_gb(p.traffic.ep_all_to_all_bytes) for p in stages)],
            [
                "ep time (blocking, in compute)",
                *(f"{_seconds(p.traffic.ep_s)} ({p.traffic.ep_link})" for p in stages),
            ],
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
                [
                    [
                        "pipeline bubble",
                        *(f"{_seconds(p.timing.pipeline_bubble_s)} ({p.bubble_fraction:.1%})" for p in stages),
                    ]
                ]  # type: ignore[union-attr]
                if any(p.pp > 1 for p in stages)
                else []
            ),
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
    if plan.cp_notice:  # what the engine states before launch: a kv repeat, or ring attention
        console.print(f"note: {plan.cp_notice}")
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
                f"{entry.plan.pp} {entry.plan.pp_schedule}" if entry.plan.pp > 1 else "1",
                f"{entry.plan.bubble_fraction:.1%}",
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
    for column in (
        "#",
        "tokens/s",
        "step s",
        "MFU",
        "exposed comm s",
        "GiB/rank",
        "pp",
        "bubble",
        "lossless",
        "overrides",
    ):
        table.add_column(column, justify="left" if column == "overrides" else "right")
    for row in search_rows(result, count):
        table.add_row(*row)
    console.print(table)
