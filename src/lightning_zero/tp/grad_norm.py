"""Gradient norm over a TP model: count each parameter once.

[Note: TP grad norm] A TP-split parameter (``_tp_shard_dim`` 0 or 1) holds a different slice on
each TP rank: its squared norm is the *sum* over the TP group. A replicated one (``None``: norm
weights) holds the same full gradient on every TP rank: counted once, not ``tp`` times.

The one-number rule for any sharding on top (ZeRO over dp): weight each parameter's local squared
gradient by :func:`tp_grad_norm_weight` (``1`` split, ``1/tp`` replicated), sum what this rank
holds, and all-reduce(SUM) over *all* ranks (dp and tp)::

    total_sq = all_reduce_world( sum_p  w_p * ||grad_p on this rank||^2 )

Under ZeRO-2/3 "on this rank" is the rank's dp shard of each parameter's gradient; ZeRO-1 keeps
full gradients, so reduce over tp only (or divide by dp as well). :func:`tp_grad_norm` does the
plain case (full local gradients, TP only).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import all_reduce
from lightning_zero.tp.layers import tp_shard_dim


def is_tp_sharded(param: torch.Tensor) -> bool:
    """True if ``param`` holds one TP rank's slice of a larger dense tensor."""
    return tp_shard_dim(param) is not None


def tp_grad_norm_weight(param: torch.Tensor, tp_size: int) -> float:
    """Weight of ``param``'s squared gradient in a world-wide sum (see [Note: TP grad norm])."""
    return 1.0 if is_tp_sharded(param) else 1.0 / tp_size


def grad_norm_sq_contributions(params: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Local fp32 sums of squared gradients ``(sharded_sq, replicated_sq)`` of ``params``.

    ``sharded_sq`` must be summed over the TP group; ``replicated_sq`` must not.
    """
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    device = None
    for param in params:
        if param.grad is None:
            continue
        device = param.grad.device
        sq = param.grad.detach().float().pow(2).sum()
        (sharded if is_tp_sharded(param) else replicated).append(sq)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sharded_sq = torch.stack(sharded).sum() if sharded else zero
    replicated_sq = torch.stack(replicated).sum() if replicated else zero.clone()
    return sharded_sq, replicated_sq


def tp_grad_norm(params: Iterable[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm of the dense model's gradient, from full local gradients of a TP model.

    A collective over ``group`` (one all-reduce of one element). Returns an fp32 scalar on the gradients' device.
    """
    sharded_sq, replicated_sq = grad_norm_sq_contributions(params)
    all_reduce(sharded_sq, group, label="tp_all_reduce_norm")
    return (sharded_sq + replicated_sq).sqrt()
