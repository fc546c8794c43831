"""What every model family's tensor-parallel plan shares: the TP group from a mesh, the forward hooks
that enter the TP region after a replicated module (or all-gather a sequence shard), and a TP
model's state dict gathered to dense tensors or a dense one cut into this rank's slices.

A family's plan, which layers become which TP layers, lives beside its model
(``models/llama/parallelize.py``: ``parallelize_llama``), importing this package, never the
reverse (docs/architecture.md, "Package order").
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_zero.comm.collectives import CommCounter, all_gather
from lightning_zero.tp.layers import copy_to_tp_region, gather_from_sequence_region, local_slice, tp_shard_dims

TPGroupLike = Union[DeviceMesh, dist.ProcessGroup]


def resolve_tp_group(tp: TPGroupLike) -> dist.ProcessGroup:
    """The TP process group from a 1-D TP mesh, a 2-D ``("dp", "tp")`` mesh or a group."""
    if isinstance(tp, DeviceMesh):
        if tp.ndim == 1:
            return tp.get_group()
        return tp.get_group("tp")
    return tp


class EnterTPRegion:
    """Forward hook: route a module's (replicated) output through ``copy_to_tp_region``."""

    def __init__(self, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> None:
        self.group, self.counter = group, counter

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return copy_to_tp_region(output, self.group, self.counter)


class GatherSequence(EnterTPRegion):
    """Forward hook: all-gather a module's sequence-sharded ``(B, T/tp, dim)`` output to ``(B, T, dim)``."""

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_region(output, self.group, self.counter)


def gather_tp_state_dict(
    model: nn.Module, group: dist.ProcessGroup, *, counter: Optional[CommCounter] = None
) -> dict[str, torch.Tensor]:
    """The plain (dense) state dict of a TP model, full tensors on every rank of ``group``.

    Keys and shapes are those of the un-parallelized model, so the result loads into ``Llama``.
    A collective: every rank of ``group`` must call it.
    """
    shard_dims = tp_shard_dims(model)
    tp_size = dist.get_world_size(group)
    full: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        dim = shard_dims.get(name)  # buffers: replicated
        if dim is None or tp_size == 1:
            full[name] = tensor.detach().clone()
            continue
        local = tensor.detach().movedim(dim, 0).contiguous()  # split dim first
        gathered = torch.empty((tp_size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        all_gather(gathered, local, group, counter=counter, label="tp_all_gather")
        full[name] = gathered.movedim(0, dim).contiguous()
    return full


def shard_dense_state_dict(
    model: nn.Module, dense_state_dict: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """This rank's slices of a dense state dict, ready for ``model.load_state_dict`` on a TP model."""
    shard_dims = tp_shard_dims(model)
    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    local: dict[str, torch.Tensor] = {}
    for name, tensor in dense_state_dict.items():
        dim = shard_dims.get(name)
        local[name] = tensor if dim is None else local_slice(tensor, dim, tp_rank, tp_size)
    return local
