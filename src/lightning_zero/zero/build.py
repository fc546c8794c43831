"""How a ZeroEngine is put together: which optimizers it admits, and its flat groups per stage.

Admission (raised before anything is sharded, naming the optimizer and the fix): every tensor an
optimizer holds must be a parameter of the module, and its update must be element-wise, or one
the engine runs with replicated state (``REPLICATED_STEP_OPTIMIZERS``).

Building: stages 1-2 cut each optimizer param group into :class:`FlatParamGroup` s (one per
compute dtype), every rank keeping full parameters; stage 3 cuts the module into units
(``zero/stage3/``) and keeps one shard per rank. Either way the result is a
:class:`BuiltParams`: the flat groups per optimizer and param group, and the parameter side
(``param_side.py``) the engine talks to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.zero.bucketing import bucket_numel_for_bytes, grad_element_bytes
from lightning_zero.zero.domains import split_by_domain
from lightning_zero.zero.flat import FlatLayout, FlatParamGroup, FlatSpec, first_bucket_numel, fp32_parameter_ids
from lightning_zero.zero.muon import MATRIX_OPTIMIZERS, WHOLE_MATRIX_OPTIMIZERS
from lightning_zero.zero.param_side import ReplicatedParams, ShardedParams

if TYPE_CHECKING:
    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.waits import Waiter


def bucket_numel_for(bucket_mb: float, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a bucket of ``bucket_mb`` MiB (at least 1; the rule in ``zero/bucketing.py``)."""
    return bucket_numel_for_bytes(bucket_mb, dtype.itemsize)


# Optimizers whose update of an element depends on other elements of the same parameter (factored
# second moments, whole-tensor norms): ZeRO's element-range shards cannot run them as they are.
# Muon (orthogonalization) is served by matrix owners (MATRIX_OPTIMIZERS, zero/matrix_optimizer.py);
# other whole-matrix optimizers (WHOLE_MATRIX_OPTIMIZERS) are refused by name.
NON_ELEMENTWISE_OPTIMIZERS = ("Adafactor", "LBFGS", "SparseAdam", *WHOLE_MATRIX_OPTIMIZERS)
# Of those, the ones every stage runs with full fp32 masters and replicated optimizer state
# ([Note: non-element-wise optimizers] in replicated_optimizer.py; stage 3: one unit at a time,
# [Note: replicated step per unit] in stage3/replicated_step.py). LBFGS (closure re-runs backward inside
# step) and SparseAdam (needs sparse gradients) stay refused.
REPLICATED_STEP_OPTIMIZERS = ("Adafactor",)


def check_elementwise(optimizers: list[Optimizer], stage: int = 1) -> None:
    """ValueError for optimizers the engine cannot step exactly at ``stage``.

    Element-wise optimizers are sharded at every stage; ``REPLICATED_STEP_OPTIMIZERS`` run at
    every stage with replicated state (not over tensor-parallel-split parameters);
    ``MATRIX_OPTIMIZERS`` (Muon) step whole matrices on owner ranks ([Note: owner step]); the rest
    of ``NON_ELEMENTWISE_OPTIMIZERS`` (Shampoo, SOAP, Dion among them) are refused.
    """
    for index, optimizer in enumerate(optimizers):
        name = type(optimizer).__name__
        if name in REPLICATED_STEP_OPTIMIZERS:
            from lightning_zero.tp.layers import tp_shard_dim

            split = [p for group in optimizer.param_groups for p in group["params"] if tp_shard_dim(p) is not None]
            if split:
                raise ValueError(
                    f"lightning_zero: optimizer {index} is {name} over {len(split)} tensor-parallel-split"
                    f" parameter(s) (the first of shape {tuple(split[0].shape)}): its factored row/column"
                    " moments would be computed per tp shard, not over the dense weight. Use tp=1 with"
                    f" {name}, or an element-wise optimizer (AdamW, SGD, ...) under tensor parallelism."
                )
            continue
        if name in NON_ELEMENTWISE_OPTIMIZERS:
            why = {
                "LBFGS": "its step(closure) re-runs forward and backward several times per step, and each"
                " backward is a gradient sync the engine's step does not expect",
                "SparseAdam": "it needs sparse gradients, and ZeRO's flat gradient buffers are dense",
            }.get(name, "its update of one element depends on other elements of the same parameter")
            if name in WHOLE_MATRIX_OPTIMIZERS:
                why = (
                    "it preconditions whole matrices (Kronecker factors / low-rank projections), and only"
                    f" {' and '.join(MATRIX_OPTIMIZERS)} are served by matrix owners (docs/optimizers.md)"
                )
            raise ValueError(
                f"lightning_zero: optimizer {index} is {name}, which ZeRO stages cannot run: {why}. Use an"
                " element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, ...),"
                f" {', '.join(REPLICATED_STEP_OPTIMIZERS)} (replicated optimizer state), torch.optim.Muon (matrix"
                " owners), or Lightning's ddp/fsdp"
                " strategies for this optimizer."
            )


def matrix_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` steps whole matrices on owner ranks ([Note: owner step])."""
    return type(optimizer).__name__ in MATRIX_OPTIMIZERS


def replicated_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` steps full replicated masters ([Note: non-element-wise optimizers])."""
    return type(optimizer).__name__ in REPLICATED_STEP_OPTIMIZERS


def check_optimizer_params(module: nn.Module, optimizers: list[Optimizer]) -> dict[int, str]:
    """Names of the module's parameters by id; ValueError if an optimizer holds a foreign tensor."""
    names = {id(param): name for name, param in module.named_parameters()}
    for index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) not in names:
                    raise ValueError(
                        f"lightning_zero: optimizer {index} ({type(optimizer).__name__}) param group"
                        f" {group_index} holds a tensor of shape {tuple(param.shape)} that is not a"
                        " parameter of the LightningModule. Build the optimizer from"
                        " `self.parameters()` (or named submodules) inside `configure_optimizers`."
                    )
    return names


@dataclass
class BuiltParams:
    """What the builders return: the flat groups and the parameter side that drives them."""

    groups: list[FlatParamGroup]  # every flat group, in build order
    per_optimizer: list[list[list[FlatParamGroup]]]  # optimizer -> param group -> flat groups
    params: Union[ReplicatedParams, ShardedParams]
    frozen_params: list[nn.Parameter] = field(default_factory=list)  # stages 1-2: kept as they are
    owned_groups: list[dist.ProcessGroup] = field(default_factory=list)  # created here, destroyed by the engine
    init_peak_param_bytes: Optional[int] = None  # stage 3: the parameter bytes' high-water while sharding


def build_replicated(module: nn.Module, optimizers: list[Optimizer], config: ZeroConfig, spec: FlatSpec) -> BuiltParams:
    """Stages 1-2: one flat group per optimizer param group, compute dtype and domain (norm layers
    with running statistics stay fp32 under bf16-mixed; expert parameters are sharded over
    ``expert``'s group: [Note: expert domain]); parameters no optimizer steps stay as they are."""
    compute_dtype, order, expert = spec.compute_dtype, spec.order, spec.expert
    groups: list[FlatParamGroup] = []
    per_optimizer: list[list[list[FlatParamGroup]]] = []
    managed: set[int] = set()
    fp32_ids = fp32_parameter_ids(module) if compute_dtype != torch.float32 and spec.norms_in_fp32 else set()
    for optimizer in optimizers:
        per_param_group = []
        for param_group in optimizer.param_groups:
            params = sorted((p for p in param_group["params"] if p.requires_grad), key=lambda p: order[id(p)])
            flat = []
            kept_fp32 = [p for p in params if id(p) in fp32_ids]
            rest = [p for p in params if id(p) not in fp32_ids]
            for same_dtype, dtype in ((rest, compute_dtype), (kept_fp32, torch.float32)):
                for members, domain in split_by_domain(same_dtype, expert):
                    # [Note: bucket_mb counts gradient bytes] in zero/bucketing.py
                    grad_bytes = grad_element_bytes(dtype.itemsize, spec.reduce_in_fp32)
                    bucket_numel = bucket_numel_for_bytes(spec.bucket_mb, grad_bytes)
                    layout = FlatLayout(
                        members,
                        [spec.names[id(p)] for p in members],
                        dp=spec.dp_size if domain is None else domain.size,
                        bucket_numel=bucket_numel,
                        first_bucket_numel=first_bucket_numel(bucket_numel, grad_bytes),
                    )
                    group = FlatParamGroup(
                        layout,
                        dp_rank=spec.dp_rank if domain is None else domain.rank,
                        compute_dtype=dtype,
                        device=spec.device,
                        master_dtype=spec.master_dtype if dtype == compute_dtype else torch.float32,
                        offload=config.offload_optimizer,
                        param_comm_dtype=spec.param_comm_dtype,
                    )
                    group.domain = domain
                    flat.append(group)
            managed.update(id(p) for p in params)
            per_param_group.append(flat)
            groups.extend(flat)
        per_optimizer.append(per_param_group)
    return BuiltParams(
        groups,
        per_optimizer,
        ReplicatedParams(module, overlap_gather=config.overlap_param_gather),
        frozen_params=[p for p in module.parameters() if id(p) not in managed],
    )


def build_sharded(
    module: nn.Module,
    optimizers: list[Optimizer],
    config: ZeroConfig,
    spec: FlatSpec,
    *,
    dp_group: Optional[dist.ProcessGroup],
    wrap_policy: Optional[Callable[..., bool]],
    counter: CommCounter,
    waiter: Waiter,
) -> BuiltParams:
    """Stage 3: the module cut into units, each rank keeping its shard of every unit, and the
    runtime that gathers them on demand over a clone of the dp group (expert parameters: of
    ``expert``'s group, [Note: expert domain])."""
    from lightning_zero.zero.stage3 import Stage3Runtime, build_units, clone_dp_group, default_wrap_policy

    units, per_optimizer, init_peak, root_holders = build_units(
        module,
        optimizers,
        spec,
        dp_group=dp_group,
        policy=wrap_policy or default_wrap_policy,
        offload=config.offload_optimizer,
    )
    expert = spec.expert
    groups = [group for unit in units for group in unit.groups]
    ag_group = clone_dp_group(dp_group)
    owned = [ag_group]
    if expert is not None:  # every rank creates every clone, in the same order
        expert.gather_group = clone_dp_group(expert.group)
        owned.append(expert.gather_group)
    runtime = Stage3Runtime(
        units,
        ag_group,
        config,
        counter=counter,
        top=module,
        root_holders=root_holders,
        optimizers=optimizers,
        waiter=waiter,
    )
    return BuiltParams(
        groups, per_optimizer, ShardedParams(runtime, groups), owned_groups=owned, init_peak_param_bytes=init_peak
    )
