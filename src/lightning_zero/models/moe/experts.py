"""Routed experts stacked into three tensors, run as a grouped matmul.

[Note: stacked experts] A layer's routed experts are three Parameters, ``w1`` and ``w3``
``(experts, expert_ffn_dim, dim)`` and ``w2`` ``(experts, dim, expert_ffn_dim)``: row ``e`` is
expert ``e``'s SwiGLU (``w2 (silu(w1 x) * w3 x)``), laid out as Hugging Face's per-expert
``nn.Linear`` weights, so import and export move whole rows. Under expert parallelism
(``lightning_zero/ep``) a rank holds the rows of its ``experts / ep`` consecutive experts; the
Parameters are marked (``zero/domains.mark_expert_param``) as expert parameters (the engine reduces
and shards them over the expert-data-parallel group) stacked along dim 0 (checkpoints place the
rows in the dense tensor).

The input is grouped by expert (rows of expert 0, then expert 1, ...; ``counts`` rows each). On
CUDA with bf16 and ``torch._grouped_mm`` in the installed torch, each projection is one grouped
matmul; elsewhere a loop over experts. Every expert runs, even on zero rows, so each Parameter is
in the autograd graph on every rank (a zero gradient, as ddp gives a stacked expert no token
reached) and the backward of the token exchange around it runs on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.zero.domains import mark_expert_param


def mark_expert_params(module: nn.Module) -> None:
    """Mark ``module``'s parameters as expert parameters stacked along dim 0 ([Note: stacked
    experts]; the marks are the engine's, [Note: expert domain] in ``zero/domains.py``)."""
    for param in module.parameters(recurse=False):
        mark_expert_param(param, shard_dim=0)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_swiglu` takes ``torch._grouped_mm`` for ``x`` (CUDA, bf16)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """``n_local`` SwiGLU experts of width ``ffn_dim`` ([Note: stacked experts]).

    ``expert_offset``: the global id of row 0 (``ep_rank * n_local``), ``n_experts``: all experts of
    the layer; both are set by ``lightning_zero.models.moe.parallelize.parallelize_experts``."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts, self.expert_offset = n_experts, 0
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # down
        mark_expert_params(self)

    @property
    def n_local(self) -> int:
        return self.w1.shape[0]

    tp_grad_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # [Note: experts and tensor parallelism]

    def forward(self, x: torch.Tensor, counts: Sequence[int], counts_device: torch.Tensor) -> torch.Tensor:
        """``x`` ``(M, dim)`` grouped by local expert, ``counts`` rows each (host ints, and the same
        on ``x``'s device as ``counts_device``) -> ``(M, dim)``."""
        weights = (self.w1, self.w3, self.w2)
        if self.tp_grad_sum is not None:
            weights = tuple(self.tp_grad_sum(weight) for weight in weights)
        return grouped_swiglu(x, *weights, counts, counts_device)


def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: Sequence[int],
                   counts_device: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``w2[e] (silu(w1[e] x) * w3[e] x)`` for the rows of each expert ``e`` ([Note: stacked experts])."""
    if grouped_mm_available(x):
        offsets = torch.cumsum(counts_device, dim=0, dtype=torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
    outputs = []
    for expert, rows in enumerate(x.split(list(counts))):
        hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())
        outputs.append(hidden @ w2[expert].t())
    return torch.cat(outputs)
