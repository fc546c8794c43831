"""ZeroStrategy's setup steps that need no Lightning object of their own (Lightning glue).

Before any process group starts, :func:`parallel_dims` turns the knobs and the cluster into the
``(dp, cp, tp)`` layout (ep inside dp*cp, hybrid ``(replicate, shard)`` splits of it) and checks it
against the model and the data; once the process group is up, :func:`build_groups` makes the groups
that layout needs. After it,
:func:`move_real_tensors` and :func:`broadcast_module_states` give every dp rank the same module on
its device before the engine flattens it; :func:`find_tp_counter` finds the counter the TP layers
already count into, so dp and tp traffic land in one :class:`CommCounter`; :func:`weigh_tp_norm`
tells the engine's clipping how TP-replicated elements count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.config import ZeroConfig

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import MeshGroups, ParallelDims
    from lightning_zero.zero.engine import ZeroEngine


def parallel_dims(config: ZeroConfig, *, num_nodes: int, num_processes: int, lightning_module: Any) -> ParallelDims:
    """The layout for ``num_nodes * num_processes`` ranks; raises on a bad one (before any process
    group starts): TP against the model's heads, cp and ep against the model
    (:func:`check_model_layout`), sequence parallelism against TP and the data module's sequence
    length."""
    from lightning_zero.comm.mesh import ParallelDims

    dims = ParallelDims.from_config(config, world_size=num_nodes * num_processes, devices_per_node=num_processes)
    model_config = getattr(lightning_module, "config", None)
    dims.validate(model_config if hasattr(model_config, "n_heads") else None)
    if lightning_module is not None:  # the Fabric door checks its model at setup_module
        check_model_layout(dims, lightning_module)
    if config.sequence_parallel and dims.tp == 1:
        raise ValueError(
            f"ZeroStrategy(sequence_parallel=True): tensor_parallel_size={config.tensor_parallel_size!r} resolved"
            " to 1 rank per TP group; sequence parallelism needs tp > 1 (more devices per node, or"
            " sequence_parallel=False)."
        )
    if config.sequence_parallel:  # a data module's sequence length must split over TP (checked before launch)
        from lightning_zero.tp.layers import sequence_shard_len

        trainer = lightning_module._trainer if lightning_module is not None else None
        seq_len = getattr(getattr(trainer, "datamodule", None), "seq_len", None)
        if isinstance(seq_len, int):
            sequence_shard_len(seq_len, dims.tp)
    return dims


def build_groups(dims: ParallelDims, device_type: str) -> MeshGroups:
    """Once the process group is up: every group of the layout (``comm/mesh.py`` :func:`build_groups`)."""
    from lightning_zero.comm.mesh import build_groups as build

    return build(dims, device_type)


def check_model_layout(dims: ParallelDims, lightning_module: Any) -> None:
    """[Note: layouts a model declares] ``cp > 1`` and ``ep > 1`` change what the model itself
    computes (its sequence slice and attention, its experts and token dispatch), so the runtime
    cannot honour them for any module: a model that can declares it by a method
    ``check_parallel_dims(dims: ParallelDims) -> None`` on the LightningModule (or on its
    ``config``), which raises ``ValueError`` for a layout it cannot run (heads not divisible by
    ``tp * cp``, experts not divisible by ``ep``, a sequence length not divisible by ``cp``), naming
    the fix. A module without it is refused with ``cp > 1`` or ``ep > 1`` before any process group
    starts; with ``tp > 1`` alone it is not (TP splits Llama-style layers,
    ``models/llama/parallelize.parallelize_llama``), but a module that declares the method is asked
    (the MoE family needs sequence parallelism)."""
    if dims.cp == 1 and dims.ep == 1 and dims.tp == 1:
        return
    owner = next(
        (
            candidate
            for candidate in (lightning_module, getattr(lightning_module, "config", None))
            if callable(getattr(candidate, "check_parallel_dims", None))
        ),
        None,
    )
    if owner is None:
        if dims.cp == 1 and dims.ep == 1:
            return
        asked = [name for name in ("cp", "ep") if getattr(dims, name) > 1]
        what = {"cp": "splits its sequences over cp", "ep": "splits its experts over ep"}
        raise ValueError(
            f"ZeroStrategy({', '.join(f'{name}={getattr(dims, name)}' for name in asked)}):"
            f" {type(lightning_module).__name__} does not declare that it {' and '.join(what[n] for n in asked)}"
            " (no check_parallel_dims(dims) method on the LightningModule or its config); use a model family"
            f" that does, or {' and '.join(f'{name}=1' for name in asked)}."
        )
    owner.check_parallel_dims(dims)


def weigh_tp_norm(engine: ZeroEngine, tp: int) -> None:
    """[Note: TP grad norm] in ``tp/grad_norm.py``: in the global gradient norm of a tensor-parallel
    model, elements replicated over the TP group count ``1/tp``."""
    from lightning_zero.tp.grad_norm import tp_grad_norm_weight

    weights = engine.master_chunk_weights(lambda param: tp_grad_norm_weight(param, tp))
    for sharded in engine.optimizers:
        sharded.replicated_weight = weights


def find_tp_counter(module: nn.Module) -> Optional[CommCounter]:
    """The counter a model's own collectives count into (TP layers' ``tp_comm_counter``, see
    ``models/llama/parallelize.parallelize_llama``; expert parallelism's ``ep_comm_counter``,
    ``models/moe/parallelize.parallelize_experts``, which is the TP one when both exist), or ``None``."""
    for child in module.modules():
        for name in ("tp_comm_counter", "ep_comm_counter"):
            counter = getattr(child, name, None)
            if isinstance(counter, CommCounter):
                return counter
    return None


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``model_to_device`` for everything not on the meta device (stage 3 materializes those)."""
    with torch.no_grad():
        for child in module.modules():
            for param in child._parameters.values():
                if param is not None and not param.is_meta and param.device != device:
                    param.data = param.data.to(device)
            for key, buffer in child._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    child._buffers[key] = buffer.to(device)


def broadcast_module_states(
    module: nn.Module, group: Optional[dist.ProcessGroup], expert_group: Optional[dist.ProcessGroup] = None
) -> None:
    """Every dp rank starts from the weights of dp rank 0 of ``group`` (as DDP does at construction);
    with ``expert_group`` (``ep > 1``), expert parameters from rank 0 of that group (the EDP ranks
    holding the same experts: [Note: expert domain] in ``zero/domains.py``)."""
    from lightning_zero.zero.domains import is_expert_param

    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not tensor.is_meta:
                over = expert_group if expert_group is not None and is_expert_param(tensor) else group
                src = dist.get_global_rank(over, 0) if over is not None else 0
                dist.broadcast(tensor.data, src=src, group=over)
