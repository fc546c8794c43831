"""Render planner output: rich tables, JSON, and a stacked bar chart of per-rank memory by stage.

Memory is shown in GiB (2**30 bytes, as GPU memory is sold and reported); traffic in GB (1e9
bytes, as link bandwidths are quoted). matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_zero.planner import GiB, Plan

MEMORY_ROWS = (  # (MemoryPerRank attribute, label)
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master_weights", "master weights (fp32, in optimizer)"),
    ("optimizer_moments", "Adam moments (in optimizer)"),
    ("bucket_buffers", "gradient buckets in flight"),
    ("prefetch_buffers", "stage-3 gathered blocks"),
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
        ("batch", f"micro_batch={plan.micro_batch} x seq_len={plan.seq_len} x accumulate="
                  f"{plan.accumulate_grad_batches} x dp={plan.dp} = {plan.tokens_per_step:,} tokens/step"),
        ("activations / block", f"{_gib(acts.per_layer)} GiB saved, {_gib(acts.checkpointed_per_layer)} GiB "
                                f"checkpointed (checkpointing={'on' if plan.activation_checkpointing else 'off'}, "
                                f"attention={plan.attention})"),
        ("engine", f"bucket_mb={plan.bucket_mb:g}, prefetch_blocks={plan.prefetch_blocks}"),
        ("hardware", f"{plan.hardware}: {_gib(plan.memory_bytes)} GiB, {_gib(plan.reserved_bytes)} GiB reserved, "
                     f"mfu={plan.mfu:g}"),
    ]


def memory_rows(stages: Sequence[Plan]) -> list[list[str]]:
    rows = [[label, *(_gib(getattr(p.memory, attr)) for p in stages)] for attr, label in MEMORY_ROWS]
    rows.append([STEP_ROW[1], *(_gib(getattr(p.memory, STEP_ROW[0])) for p in stages)])
    rows.append(["total", *(_gib(p.memory.total) for p in stages)])
    rows.append(["usable on the GPU", *(_gib(p.available_bytes) for p in stages)])
    rows.append(["fits", *("yes" if p.fits else "NO" for p in stages)])
    return rows


def traffic_rows(stages: Sequence[Plan]) -> list[list[str]]:
    return [
        ["dp bytes sent / step (GB)", *(_gb(p.traffic.dp_bytes) for p in stages)],
        ["dp time", *(f"{_seconds(p.traffic.dp_s)} ({p.traffic.dp_link})" for p in stages)],
        ["tp bytes sent / step (GB)", *(_gb(p.traffic.tp_all_reduce_bytes) for p in stages)],
        ["tp time (NVLink)", *(_seconds(p.traffic.tp_s) for p in stages)],
        ["compute time", *(_seconds(p.traffic.compute_s) for p in stages)],
        ["step estimate", *(_seconds(p.traffic.step_s) for p in stages)],
    ]


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
    for title, rows in (("memory per rank (GiB)", memory_rows(stages)), ("per optimizer step, per rank",
                                                                           traffic_rows(stages))):
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
    axes.set_title(title or f"{first.model}, {layout_line(first)}, {first.precision}, "
                            f"B={first.micro_batch} T={first.seq_len}", fontsize=9)
    axes.set_ylabel("GiB per rank")
    axes.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
    return path
