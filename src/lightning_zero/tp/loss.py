"""Cross entropy over vocab-sharded logits, never materializing the full ``[B, T, V]`` on a rank.

Each TP rank holds logits ``[N, V/tp]`` for vocab ids ``[r * V/tp, (r+1) * V/tp)`` (the output of a
column-parallel head). Per token (Megatron-LM's recipe)::

    m      = max over the vocab          local max, all-reduce(MAX)
    s      = sum_v exp(z_v - m)          local sum, all-reduce(SUM)
    z_t    = logit of the target         masked gather (0 off-range), all-reduce(SUM)
    loss   = log(s) - (z_t - m)

``s`` and ``z_t`` travel in one all-reduce (stacked ``[2, N]``), so the loss costs two small
all-reduces of ``N`` and ``2N`` elements. Backward is local: ``dL/dz = softmax(z) - onehot(t)``
on this rank's slice, times the upstream per-token gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_reduce

TP_LOSS_LABEL = "tp_all_reduce_loss"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` from logits ``[N, V/tp]`` and global target ids ``[N]``."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup,
        counter: Optional[CommCounter],
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        vocab_start = dist.get_rank(group) * local_vocab
        logits_f32 = logits.float()  # [N, V/tp]

        global_max = logits_f32.max(dim=-1).values  # [N]
        all_reduce(global_max, group, op=dist.ReduceOp.MAX, counter=counter, label=TP_LOSS_LABEL)
        shifted = logits_f32 - global_max.unsqueeze(-1)  # [N, V/tp]

        outside = (targets < vocab_start) | (targets >= vocab_start + local_vocab)  # [N]
        local_target = (targets - vocab_start).masked_fill(outside, 0)  # [N]
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [N]
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp_shifted = shifted.exp()  # [N, V/tp]
        sums = torch.stack([exp_shifted.sum(dim=-1), target_logit])  # [2, N]: sum exp, target logit
        all_reduce(sums, group, counter=counter, label=TP_LOSS_LABEL)
        sum_exp, target_logit = sums[0], sums[1]

        softmax = exp_shifted.div_(sum_exp.unsqueeze(-1))  # [N, V/tp], this rank's columns
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return torch.log(sum_exp) - target_logit  # [N]

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()  # [N, V/tp]
        hit = (~outside).to(grad_logits.dtype)  # 1 where this rank owns the target
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad_logits.mul_(grad_loss.unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    counter: Optional[CommCounter] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean (``reduction="sum"``: summed) cross entropy of vocab-sharded ``logits [..., V/tp]``
    against ``targets [...]``.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=...,
    reduction=...)`` where ``full_logits`` is the concatenation of every TP rank's slice in rank
    order. Tokens whose target is ``ignore_index`` count neither in the sum nor in the mean.
    Returns an fp32 scalar.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N, V/tp]
    flat_targets = targets.reshape(-1)  # [N]
    per_token = _VocabParallelCrossEntropy.apply(flat_logits, flat_targets, group, counter)  # [N]
    keep = flat_targets != ignore_index
    total = per_token[keep].sum()
    return total if reduction == "sum" else total / keep.sum()
