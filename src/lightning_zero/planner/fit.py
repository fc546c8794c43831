"""What would make a plan that does not fit fit: ``Plan.suggestions`` (``plan_run(suggest=True)``).

:func:`suggest_fixes` tries single changes to the planned layout (a higher stage, activation
checkpointing, a larger tp, a smaller micro batch), then combinations, and keeps the first few
that fit; when none does, it says on how many nodes, or on which other GPU, stage 3 with
checkpointing would. Candidates are planned bytes-only through :func:`plan_or_none`, the same
evaluation ``search.search_layouts`` uses. ``plan_run`` is passed in (this module sits below
``arithmetic``, which calls it), so the planner's imports keep flowing one way.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from lightning_zero.planner.hardware import Hardware, available_hardware
from lightning_zero.planner.plan import GiB, Plan

PlanRun = Callable[..., Plan]  # lightning_zero.planner.arithmetic.plan_run


def plan_or_none(plan_run: PlanRun, config: Any, **knobs: Any) -> Optional[Plan]:
    """``plan_run(config, **knobs)`` of one candidate layout; ``None`` where the layout is invalid
    (``ValueError``: a tp that does not divide the heads, ...). Every layout search plans its
    candidates through it (:func:`suggest_fixes` here, ``search.search_layouts``)."""
    try:
        return plan_run(config, **knobs)
    except ValueError:
        return None


def _knobs(plan: Plan, plan_run: PlanRun) -> dict[str, Any]:
    """The :func:`plan_run` arguments that produced ``plan`` (but the model and the hardware)."""
    arguments = inspect.signature(plan_run).parameters
    knobs = {
        name: getattr(plan, name) for name in arguments if name not in ("hardware", "timing") and hasattr(plan, name)
    }
    knobs["reserved_gib"] = plan.reserved_bytes / GiB
    # the option, not its resolved size, so a change of tp or nodes re-resolves it
    node = min(plan.dp, plan.devices_per_node // plan.tp)
    knobs["shard_size"] = None if plan.replicas == 1 else "node" if plan.shard_size == node else plan.shard_size
    return knobs


def _candidates(plan: Plan) -> list[tuple[str, dict[str, Any]]]:
    """Single changes first, in the order a user would try them, then combinations."""
    out: list[tuple[str, dict[str, Any]]] = []
    for stage in range(plan.stage + 1, 4):
        out.append((f"stage={stage}", {"stage": stage}))
    if not plan.activation_checkpointing:
        out.append(("activation_checkpointing=true", {"activation_checkpointing": True}))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node:
        out.append((f"tensor_parallel_size={tp}", {"tp": tp}))
        tp *= 2
    micro_batch = plan.micro_batch // 2
    while micro_batch >= 1:
        accumulate = plan.accumulate_grad_batches * plan.micro_batch // micro_batch
        out.append(
            (
                f"micro_batch={micro_batch} (accumulate_grad_batches={accumulate})",
                {"micro_batch": micro_batch, "accumulate_grad_batches": accumulate},
            )
        )
        micro_batch //= 2
    combined = {"stage": 3, "activation_checkpointing": True}
    out.append(("stage=3 + activation_checkpointing=true", combined))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node:
        out.append((f"stage=3 + activation_checkpointing=true + tensor_parallel_size={tp}", {**combined, "tp": tp}))
        tp *= 2
    if plan.micro_batch > 1:
        out.append(
            (
                f"stage=3 + activation_checkpointing=true + tensor_parallel_size={plan.devices_per_node} + "
                f"micro_batch=1",
                {**combined, "tp": plan.devices_per_node, "micro_batch": 1},
            )
        )
    return out


def suggest_fixes(plan: Plan, config: Any, hardware: Hardware, plan_run: PlanRun, limit: int = 4) -> list[str]:
    """Up to ``limit`` single changes (then combinations) that would make ``plan`` fit, each with its
    memory, in the order :func:`_candidates` tries them; when none fits on this cluster, where it would
    (:func:`_no_single_fix`). What ``plan_run(suggest=True)`` puts in ``Plan.suggestions``."""
    found: list[str] = []
    knobs = _knobs(plan, plan_run)
    for label, change in _candidates(plan):
        merged = {**knobs, **change}
        if merged["stage"] != 2:
            merged["defer_grad_reduce"] = False
        other = plan_or_none(plan_run, config, hardware=hardware, suggest=False, simulate=False, **merged)
        if other is None:  # e.g. a tp that does not divide the heads
            continue
        if other.fits:
            found.append(f"{label} ({other.memory.total / GiB:.1f} GiB)")
            if len(found) >= limit:
                break
    if not found:
        found.append(_no_single_fix(plan, config, hardware, plan_run))
    return found


def _no_single_fix(plan: Plan, config: Any, hardware: Hardware, plan_run: PlanRun, max_nodes: int = 512) -> str:
    """When no change on this cluster fits: the fewest nodes, or another GPU, where stage 3 with
    checkpointing at this tp would."""
    knobs = {**_knobs(plan, plan_run), "stage": 3, "activation_checkpointing": True, "defer_grad_reduce": False}
    nodes = plan.world_size // plan.devices_per_node
    options = [f"nothing on {nodes} node(s) of {plan.hardware} fits"]
    while nodes < max_nodes:
        nodes *= 2
        bigger = plan_run(
            config,
            hardware=hardware,
            suggest=False,
            simulate=False,
            **{**knobs, "world_size": nodes * plan.devices_per_node},
        )
        if bigger.fits:
            options.append(
                f"stage=3 + activation_checkpointing=true on {nodes} nodes ({bigger.memory.total / GiB:.1f} GiB)"
            )
            break
    for name in available_hardware():
        if name != plan.hardware:
            other = plan_run(config, hardware=name, suggest=False, simulate=False, **knobs)
            if other.fits:
                options.append(
                    f"stage=3 + activation_checkpointing=true on hardware={name} ({other.memory.total / GiB:.1f} GiB)"
                )
    return "; ".join(options)
