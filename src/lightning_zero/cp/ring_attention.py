"""Ring attention: key/value blocks pass around the cp ring; every rank keeps its query slice.

[Note: ring attention] (Liu et al. 2023; torchtitan's and Megatron's context parallelism) The
fallback for layouts whose query heads do not split over ``tp * cp`` (Ulysses needs that,
[Note: Ulysses attention] in ``cp/ulysses.py``). Cp rank ``c`` keeps its ``T/cp`` slice of q, k, v
([Note: context-parallel layout] in ``cp/layout.py``), rotated at its global positions
``[c T/cp, (c+1) T/cp)``, and all of its TP rank's heads. Its key/value block travels around the
ring: after ``t`` hops rank ``c`` holds rank ``(c - t) mod cp``'s block and attends to it, causal
on its own block, fully on earlier ones, not at all on later ones. The per-block results merge by
their log-sum-exp (the online softmax), so the output equals causal attention over the whole
sequence. Backward runs the ring again: each block's key/value gradient travels with the block,
accumulating every rank's share, and one more hop brings it home; the query gradient stays.
Saved for backward: q, k, v, the output and the log-sum-exp (as a fused kernel keeps).

Bytes per attention layer, one rank: forward ``(cp-1)`` hops of its k and v block (its TP rank's
kv heads, not repeated: grouped-query heads are repeated per block, locally), backward ``(cp-1)``
hops of the block and ``cp`` of its gradient (and the forward's again under full recompute),
counted under ``cp_ring_kv`` (``RingLayout.kv_hops``, what the planner plans).

Not load-balanced: under the causal mask rank ``c`` attends to ``c + 1`` blocks (the zigzag layout
that balances it would change which tokens each rank holds, in the data path too); the last cp
rank attends to all ``cp`` blocks, as many score FLOPs as a Ulysses rank, and the step waits for
it. Selective checkpointing recomputes nothing here (the ring replaces the core it would
recompute). The planner plans these layouts (``planner.traffic.cp_bytes_by_kind``,
``planner.ledger.llama_activation_bytes``; docs/context_parallel.md).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, ring_shift
from lightning_zero.cp.layout import CP_RING_LABEL


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``(B, H, S, S)`` scaled scores of q against one block's keys (repeated to q's heads), the
    future masked out on the diagonal block."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _repeat(block: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, kv_heads, S, D)`` -> ``(B, heads, S, D)``: query head ``h`` reads kv head ``h // r``."""
    repeats = heads // block.size(1)
    return block.repeat_interleave(repeats, dim=1) if repeats > 1 else block


def _unrepeat(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of :func:`_repeat`: each kv head's gradient sums its query heads'."""
    batch, heads, seq, dim = grad.shape
    return grad.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2) if heads != kv_heads else grad


class _RingAttention(torch.autograd.Function):
    """q ``(B, H, S, D)``, k and v ``(B, H_kv, S, D)`` (rotated; this rank's slice) -> the causal
    attention output ``(B, H, S, D)`` of this rank's queries over the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = q.size(-1) ** -0.5
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (B, H, S)
        block = torch.stack([k, v])  # (2, B, H_kv, S, D): what travels
        for hop in range(cp):
            source = (rank - hop) % cp
            if source <= rank:  # a later rank's keys are all in this slice's future
                scores = _scores(q, _repeat(block[0], q.size(1)), scale, causal=source == rank)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), _repeat(block[1], q.size(1)))
                merged = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(
                    -1
                )
                lse = merged
            if hop < cp - 1:
                block = ring_shift(block, group, counter=counter, label=CP_RING_LABEL)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.counter = group, counter
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, counter = ctx.group, ctx.counter
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = q.size(-1) ** -0.5
        heads, kv_heads = q.size(1), k.size(1)
        row_dot = (grad_out * out).sum(-1, keepdim=True)  # (B, H, S, 1): softmax backward's D
        grad_q = torch.zeros_like(q)
        block = torch.stack([k, v])
        grad_block = torch.zeros_like(block)  # travels with its block, back home after cp hops
        for hop in range(cp):
            source = (rank - hop) % cp
            if source <= rank:
                key, value = _repeat(block[0], heads), _repeat(block[1], heads)
                probs = torch.exp(_scores(q, key, scale, causal=source == rank) - lse.unsqueeze(-1))
                grad_value = torch.matmul(probs.transpose(-1, -2), grad_out)
                grad_scores = probs * (torch.matmul(grad_out, value.transpose(-1, -2)) - row_dot)
                grad_q += torch.matmul(grad_scores, key) * scale
                grad_key = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
                grad_block[0] += _unrepeat(grad_key, kv_heads)
                grad_block[1] += _unrepeat(grad_value, kv_heads)
            if hop < cp - 1:
                block = ring_shift(block, group, counter=counter, label=CP_RING_LABEL)
            grad_block = ring_shift(grad_block, group, counter=counter, label=CP_RING_LABEL)
        return grad_q, grad_block[0], grad_block[1], None, None


class RingAttention:
    """[Note: ring attention] on one cp group; ``Attention`` calls :meth:`attend` in place of its
    core when ``parallelize_context`` chose it (``Attention.sequence_exchange``)."""

    def __init__(self, group: dist.ProcessGroup, counter: Optional[CommCounter] = None) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.counter = counter

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        core: Callable[..., torch.Tensor],
        rope: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """q ``(B, T/cp, q_heads, D)``, k and v ``(B, T/cp, kv_heads, D)`` of this rank's slice;
        ``cos``/``sin`` cover all ``T`` positions; ``rope(x, cos, sin)`` rotates -> ``(B, T/cp,
        q_heads * D)``. ``core`` (attention over whole sequences) is not used: the ring is the core."""
        batch, shard = q.shape[:2]
        first = dist.get_rank(self.group) * shard
        cos, sin = cos[first : first + shard], sin[first : first + shard]  # this slice's global positions
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T/cp, D)
        y = _RingAttention.apply(q, k, v, self.group, self.counter)
        return y.transpose(1, 2).reshape(batch, shard, -1)
