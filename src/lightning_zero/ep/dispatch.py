"""Tokens to their experts and back: the local grouping and, under expert parallelism, the
all-to-all exchange over the ``ep`` group (forward and backward).

[Note: token exchange] One MoE layer's forward on ``N`` tokens routed to ``k`` experts each:

1. *sort*: the ``N k`` assignments are sorted by global expert id (stable: token order within an
   expert). A capacity factor keeps only the first ``capacity`` of each expert (the rest are not
   sent; their tokens pass on the residual).
2. *dispatch* (``ep > 1``): experts are laid out in ``ep`` consecutive blocks, rank ``r`` holding
   experts ``[r E/ep, (r+1) E/ep)``, so the sorted rows are already grouped by destination rank.
   The per-(rank, local expert) counts go first, in one small all-to-all (``moe_counts``, counted
   as control bytes); then the rows, in one ``all_to_all_single`` with uneven split sizes
   (``moe_dispatch``). What arrives is grouped by source rank, then local expert; it is regrouped
   by local expert (an index gather) for the grouped matmul.
3. *experts*: every local expert runs on its rows (zero rows included: see [Note: stacked
   experts] in ``models/moe/experts.py``).
4. *combine*: the inverse regrouping, then the reverse all-to-all (``moe_combine``: the split
   sizes swapped), back in the sorted order of step 1.
5. *weigh and sum*: each row times its combine weight, added into its token's output in the
   sorted order (the same order with and without EP).

Backward mirrors it: the gradient of the combine is a dispatch-shaped all-to-all
(``moe_combine_grad``) and the dispatch's a combine-shaped one (``moe_dispatch_grad``), both
through :class:`_AllToAllV`. A rank whose experts receive no token still issues all four
exchanges with zero-size splits, so no peer waits. Bytes per rank and step, given the counts:
``planner/moe.py`` (``all_to_all_bytes``).

The split sizes are host integers (``all_to_all_single`` takes Python lists), so a layer reads its
counts on the host once in forward: one device sync per MoE layer, as torchtitan's and Megatron's
dropless token dispatchers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_to_all_v

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"


@dataclass
class ExpertParallel:
    """The ``ep`` group a MoE layer exchanges tokens over, and the counter its bytes go to."""

    group: dist.ProcessGroup
    size: int
    rank: int
    counter: Optional[CommCounter] = None


class _AllToAllV(torch.autograd.Function):
    """``rows`` ``(sum(send), ...)`` -> ``(sum(recv), ...)`` by an uneven all-to-all; backward
    sends the gradient back with the splits swapped ([Note: token exchange])."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], ep: ExpertParallel,
                label: str) -> torch.Tensor:  # fmt: skip
        ctx.send, ctx.recv, ctx.ep, ctx.label = send, recv, ep, label
        output = rows.new_empty((sum(recv), *rows.shape[1:]))
        all_to_all_v(output, rows.contiguous(), recv, send, ep.group, counter=ep.counter, label=label)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad_rows = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ep = ctx.ep
        all_to_all_v(grad_rows, grad.contiguous(), ctx.send, ctx.recv, ep.group, counter=ep.counter,
                     label=f"{ctx.label}_grad")  # fmt: skip
        return grad_rows, None, None, None, None


def segments_by_column(counts: torch.Tensor) -> torch.Tensor:
    """For rows laid out in segments ``counts[a, b]`` in row-major ``(a, b)`` order, the row index
    that lists them in column-major ``(b, a)`` order (an index for ``rows[index]``)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().reshape(-1)
    lengths = counts.t().reshape(-1)
    total = int(lengths.sum())
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=counts.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return starts[segment] + torch.arange(total, device=counts.device) - first[segment]


def capacity_of(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Assignments one expert keeps of a rank's micro-batch: ``ceil(cf * tokens * k / E)``."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def route_to_experts(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    experts: torch.nn.Module,
    *,
    capacity_factor: Optional[float] = None,
    ep: Optional[ExpertParallel] = None,
) -> torch.Tensor:
    """The routed experts' output ``(N, dim)`` for ``tokens`` ``(N, dim)`` routed to ``expert_ids``
    ``(N, k)`` with ``weights`` ``(N, k)``; ``counts`` ``(E,)``: assignments per expert
    ([Note: token exchange])."""
    n_tokens, top_k = expert_ids.shape
    n_experts = counts.numel()
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # assignments sorted by expert
    if capacity_factor is not None:
        capacity = capacity_of(n_tokens, top_k, n_experts, capacity_factor)
        sorted_ids = flat_ids[order]
        first_of_expert = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - first_of_expert[sorted_ids]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    token_of = order // top_k
    rows = tokens[token_of]  # (assignments kept, dim), sorted by expert
    if ep is None or ep.size == 1:
        out_rows = experts(rows, counts.tolist(), counts)
    else:
        out_rows = _exchange(rows, counts, experts, ep)
    out_rows = out_rows * weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
    return torch.zeros_like(tokens).index_add_(0, token_of, out_rows)


def _exchange(rows: torch.Tensor, counts: torch.Tensor, experts: torch.nn.Module, ep: ExpertParallel) -> torch.Tensor:
    """Dispatch ``rows`` (sorted by global expert) to their experts' ranks, run the local experts,
    combine back ([Note: token exchange] steps 2-4)."""
    n_local = counts.numel() // ep.size
    send_counts = counts.view(ep.size, n_local).contiguous()  # [r, j]: to rank r's local expert j
    recv_counts = torch.empty_like(send_counts)  # [s, j]: from rank s for my local expert j
    all_to_all_v(recv_counts.view(-1), send_counts.view(-1), [n_local] * ep.size, [n_local] * ep.size, ep.group,
                 counter=ep.counter, label="moe_counts", control=True)  # fmt: skip
    send = send_counts.sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    received = _AllToAllV.apply(rows, send, recv, ep, DISPATCH)  # by source rank, then local expert
    by_expert = segments_by_column(recv_counts)
    per_expert = recv_counts.sum(0)
    out = experts(received[by_expert], per_expert.tolist(), per_expert)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    return _AllToAllV.apply(out[back], recv, send, ep, COMBINE)
