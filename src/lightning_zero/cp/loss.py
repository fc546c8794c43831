"""The loss of a context-parallel model: the mean over every token of the sequences, not the slice.

[Note: global token mean] Each cp rank computes the summed per-token loss of its slice and the
number of tokens that count (targets other than ``ignore_index``). One all-reduce over the cp
group of ``[sum, count]`` (fp64: counts exact at any length) gives every cp rank the unsliced
model's loss, ``sum over the group / global count``, whatever each slice's padding. Backward is
the all-reduce's adjoint: every cp rank's loss is the same function of all slices, so the
gradient reaching rank ``c``'s sum is the sum of the cp ranks' upstream gradients over the global
count, i.e. ``cp / count`` per token when each backpropagates 1. The engine then averages
gradients over the ``dp x cp`` ranks (they saw different tokens of the same samples), dividing
the ``cp`` back out: the result is the ``ddp`` gradient of the unsliced batch. Counted under
``cp_all_reduce_loss`` (16 bytes forward, 16 backward).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_reduce

CP_LOSS_LABEL = "cp_all_reduce_loss"
IGNORE_INDEX = -100  # torch's F.cross_entropy default: targets with this id count nowhere


class _SumOverGroup(torch.autograd.Function):
    """All-reduce(SUM) forward and backward: the adjoint when every rank uses the sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        total = x.clone()
        all_reduce(total, group, counter=counter, label=CP_LOSS_LABEL)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone()
        all_reduce(total, ctx.group, counter=ctx.counter, label=CP_LOSS_LABEL)
        return total, None, None


def context_parallel_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    token_loss: Callable[..., torch.Tensor],
    group: dist.ProcessGroup,
    counter: Optional[CommCounter] = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean loss over every counted token of the cp group's slices ([Note: global token mean]).

    ``token_loss(logits, targets, reduction="sum")`` is the model's loss summed over this slice's
    counted tokens (``cross_entropy_loss``, or the vocab-parallel one under TP). Returns an fp32
    scalar, the same on every cp rank: the unsliced model's mean loss.
    """
    local_sum = token_loss(logits, targets, reduction="sum")
    counted = (targets != ignore_index).sum()
    terms = torch.stack([local_sum.double(), counted.to(torch.float64)])  # [sum, count]
    total_sum, total_count = _SumOverGroup.apply(terms, group, counter).unbind()
    return (total_sum / total_count).float()
