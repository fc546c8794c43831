"""What would make a plan that does not fit fit: ``Plan.suggestions`` (``PlanOptions(suggest=True)``).

:func:`suggest_fixes` tries single changes to the planned run (a higher stage, activation
checkpointing, a larger tp, a smaller micro batch), then combinations, and keeps the first few
that fit; when none does, it says on how many nodes, or on which other GPU, stage 3 with
checkpointing would. Each candidate is the planned run's objects with one field changed
(``dataclasses.replace`` of its ``ZeroConfig`` or ``RunShape``, the layout rebuilt by
``ParallelDims.from_config``), planned bytes-only through :func:`plan_or_none`, the evaluation
``search.search_layouts`` uses too. The planner (``arithmetic.plan``) is passed in (this module
sits below ``arithmetic``, which calls it), so the planner's imports keep flowing one way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.planner.hardware import available_hardware
from lightning_zero.planner.plan import GiB, Plan
from lightning_zero.zero.bucketing import defer_grad_reduce_at

Planner = Callable[..., Plan]  # lightning_zero.planner.arithmetic.plan


def plan_or_none(make: Callable[[], Plan]) -> Optional[Plan]:
    """``make()``, the plan of one candidate layout; ``None`` where the layout is invalid
    (``ValueError``: a tp that does not divide the heads, experts that do not divide by ep, ...).
    Every layout search plans its candidates through it (:func:`suggest_fixes` here,
    ``search.search_layouts``)."""
    try:
        return make()
    except ValueError:
        return None


@dataclass(frozen=True)
class PlanInputs:
    """A planned run whole, as ``planner`` (``arithmetic.plan``) takes it: the model, its
    ``ZeroConfig``, ``ParallelDims``, ``RunShape``, ``PlanOptions`` and whether it is Lightning's DDP."""

    planner: Planner
    model: Any
    config: Any
    dims: ParallelDims
    run: Any
    options: Any
    ddp: bool = False


def changed_plan(
    inputs: PlanInputs,
    *,
    knobs: Optional[dict[str, Any]] = None,
    shape: Optional[dict[str, Any]] = None,
    world_size: Optional[int] = None,
) -> Optional[Plan]:
    """The run with ``knobs`` changed in its ``ZeroConfig`` (``stage`` among them: ZeRO instead of
    ``ddp``), ``shape`` in its ``RunShape`` and optionally another ``world_size``, planned bytes-only
    (``None`` where that layout is invalid)."""
    config, dims = inputs.config, inputs.dims
    knobs = dict(knobs or {})
    stage = knobs.get("stage", config.stage)
    knobs["defer_grad_reduce"] = defer_grad_reduce_at(stage, knobs.get("defer_grad_reduce", config.defer_grad_reduce))

    def make() -> Plan:
        changed = dataclasses.replace(config, **knobs)
        layout = ParallelDims.from_config(
            changed, world_size=world_size or dims.world_size, devices_per_node=dims.devices_per_node
        )
        quick = dataclasses.replace(inputs.options, suggest=False, simulate=False)
        return inputs.planner(inputs.model, changed, layout, dataclasses.replace(inputs.run, **(shape or {})), quick,
                              ddp=inputs.ddp and "stage" not in knobs)  # fmt: skip

    return plan_or_none(make)


def _candidates(plan: Plan, n_experts: int = 0) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(label, ZeroConfig changes, RunShape changes)``: single changes first, in the order a user
    would try them, then combinations. DDP (stage 0) takes no tensor parallelism of its own; a
    mixture of experts (``n_experts``) may split its experts over more ranks (``ep``)."""
    out: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    full = {"activation_checkpointing": "full"}
    for stage in range(plan.stage + 1, 4):
        out.append((f"stage={stage}", {"stage": stage}, {}))
    splits = []  # a mixture of experts' experts over more ranks
    ep = plan.ep * 2
    while plan.stage > 0 and ep <= n_experts and n_experts % ep == 0:
        splits.append(ep)
        ep *= 2
    out += [(f"ep={ep}", {"ep": ep}, {}) for ep in splits]
    if not plan.activation_checkpointing:
        out.append(("activation_checkpointing=true", {}, full))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node and plan.stage > 0:
        out.append((f"tensor_parallel_size={tp}", {"tensor_parallel_size": tp}, {}))
        tp *= 2
    micro_batch = plan.micro_batch // 2
    while micro_batch >= 1:
        accumulate = plan.accumulate_grad_batches * plan.micro_batch // micro_batch
        out.append(
            (
                f"micro_batch={micro_batch} (accumulate_grad_batches={accumulate})",
                {},
                {"micro_batch": micro_batch, "accumulate_grad_batches": accumulate},
            )
        )
        micro_batch //= 2
    if not plan.activation_checkpointing:
        out += [(f"ep={ep} + activation_checkpointing=true", {"ep": ep}, full) for ep in splits]
    out.append(("stage=3 + activation_checkpointing=true", {"stage": 3}, full))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node:
        label = f"stage=3 + activation_checkpointing=true + tensor_parallel_size={tp}"
        out.append((label, {"stage": 3, "tensor_parallel_size": tp}, full))
        tp *= 2
    if plan.micro_batch > 1:
        out.append(
            (
                f"stage=3 + activation_checkpointing=true + tensor_parallel_size={plan.devices_per_node} + "
                f"micro_batch=1",
                {"stage": 3, "tensor_parallel_size": plan.devices_per_node},
                {**full, "micro_batch": 1},
            )
        )
    return out


def suggest_fixes(plan: Plan, inputs: PlanInputs, limit: int = 4) -> list[str]:
    """Up to ``limit`` single changes (then combinations) that would make ``plan`` (the plan of
    ``inputs``) fit, each with its memory, in the order
    :func:`_candidates` tries them; when none fits on this cluster, where it would
    (:func:`_no_single_fix`). What ``plan`` puts in ``Plan.suggestions``."""
    found: list[str] = []
    for label, knobs, shape in _candidates(plan, getattr(inputs.model, "n_experts", 0)):
        other = changed_plan(inputs, knobs=knobs, shape=shape)
        if other is None:  # e.g. a tp that does not divide the heads
            continue
        if other.fits:
            found.append(f"{label} ({other.memory.total / GiB:.1f} GiB)")
            if len(found) >= limit:
                break
    if not found:
        found.append(_no_single_fix(plan, dataclasses.replace(inputs, ddp=False)))
    return found


def _no_single_fix(plan: Plan, inputs: PlanInputs, max_nodes: int = 512) -> str:
    """When no change on this cluster fits: the fewest nodes, or another GPU, where stage 3 with
    checkpointing at this layout would."""
    knobs, shape = {"stage": 3}, {"activation_checkpointing": "full"}
    nodes = plan.world_size // plan.devices_per_node
    found = [f"nothing on {nodes} node(s) of {plan.hardware} fits"]
    while nodes < max_nodes:
        nodes *= 2
        bigger = changed_plan(inputs, knobs=knobs, shape=shape, world_size=nodes * plan.devices_per_node)
        if bigger is not None and bigger.fits:
            found.append(
                f"stage=3 + activation_checkpointing=true on {nodes} nodes ({bigger.memory.total / GiB:.1f} GiB)"
            )
            break
    for name in available_hardware():
        if name != plan.hardware:
            elsewhere = dataclasses.replace(inputs, options=dataclasses.replace(inputs.options, hardware=name))
            other = changed_plan(elsewhere, knobs=knobs, shape=shape)
            if other is not None and other.fits:
                found.append(
                    f"stage=3 + activation_checkpointing=true on hardware={name} ({other.memory.total / GiB:.1f} GiB)"
                )
    return "; ".join(found)
