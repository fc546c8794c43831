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
    (``runtime/parallelize.check_layout``), sequence parallelism against TP and the data module's sequence
    length."""
    from lightning_zero.comm.mesh import ParallelDims

    dims = ParallelDims.from_config(config, world_size=num_nodes * num_processes, devices_per_node=num_processes)
    model_config = getattr(lightning_module, "config", None)
    dims.validate(model_config if hasattr(model_config, "n_heads") else None)
    if lightning_module is not None:  # the Fabric door checks its model at setup_module
        from lightning_zero.runtime.parallelize import check_layout

        check_layout(dims, lightning_module)  # [Note: the parallelize registry]
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
            if dims.cp > 1:  # each cp slice splits over tp too
                from lightning_zero.cp.layout import context_shard_len

                context_shard_len(seq_len, dims.cp, dims.tp, sequence_parallel=True)
    return dims


def build_groups(dims: ParallelDims, device_type: str) -> MeshGroups:
    """Once the process group is up: every group of the layout (``comm/mesh.py`` :func:`build_groups`)."""
    from lightning_zero.comm.mesh import build_groups as build

    return build(dims, device_type)


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
