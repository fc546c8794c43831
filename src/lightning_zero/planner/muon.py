"""What Muon's matrix owners cost: Newton-Schulz FLOPs per owner, the owner exchange's bytes, the
momentum bytes each rank holds, and the optimizer step's seconds beside AdamW's (plain Python).

The owners are the engine's (``zero/matrix_owners.py``, [Note: matrix owners]); the bytes are what
``zero/matrix_optimizer.py`` sends ([Note: owner step]): per step a rank sends, on average over the
ranks, ``P (n-1)/n^2`` gradient elements in the master dtype to the owners and receives as many
orthogonalized bf16 elements back (``P``: the matrices' elements, ``n``: the group's ranks). The
exact figure of one rank depends on where the bucket chunks cut each matrix;
``MatrixOwnerOptimizer.planned_bytes`` gives it and the engine's counter measures it (tested equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_zero.zero.matrix_owners import DEFAULT_NS_STEPS, assign_owners, ns_flops, owner_loads

BF16_BYTES = 2
ADAMW_STEP_BYTES = 28.0  # fp32 AdamW: read p, g, m, v; write p, m, v (planner/timing.py's optimizer term)
MUON_STEP_BYTES = 24.0  # fp32 Muon, element-wise part: g, buf read; buf, update written; p read+write


@dataclass(frozen=True)
class MuonCost:
    """One optimizer step of Muon over ``n`` ranks, beside AdamW at the same size.

    ``owner_flops[r]``: Newton-Schulz FLOPs rank ``r`` runs; ``state_bytes[r]``: momentum bytes it
    holds (whole matrices it owns); ``exchange_bytes``: bytes one rank sends per step on average
    (to the owners and back); seconds: the step's parts on the given hardware figures."""

    owner_flops: tuple[float, ...]
    state_bytes: tuple[int, ...]
    exchange_bytes: float
    ns_s: float
    exchange_s: float
    elementwise_s: float
    adamw_s: float

    @property
    def muon_s(self) -> float:
        return self.ns_s + self.exchange_s + self.elementwise_s

    @property
    def ratio(self) -> float:
        """Muon's optimizer-step seconds over AdamW's."""
        return self.muon_s / self.adamw_s if self.adamw_s else float("inf")


def muon_cost(
    shapes: Sequence[tuple[int, int]],
    ranks: int,
    *,
    master_bytes: int = 4,
    state_bytes: int = 4,
    ns_steps: int = DEFAULT_NS_STEPS,
    flops_per_s: float = 989e12 * 0.4,
    memory_bytes_per_s: float = 3.35e12,
    link_bytes_per_s: float = 450e9,
) -> MuonCost:
    """The cost of stepping the matrices ``shapes`` (whole matrices: a tp-split one counts whole)
    with Muon over ``ranks`` ranks. Defaults: an H100 (bf16 at 40 % of peak, HBM3, NVLink)."""
    costs = [float(ns_flops(rows, cols, ns_steps)) for rows, cols in shapes]
    owners = assign_owners(costs, ranks)
    flops = owner_loads(costs, owners, ranks)
    held = [0] * ranks
    for (rows, cols), owner in zip(shapes, owners):
        held[owner] += rows * cols * state_bytes
    numel = sum(rows * cols for rows, cols in shapes)
    exchange = numel * (ranks - 1) / ranks**2 * (master_bytes + BF16_BYTES)
    per_rank = numel / ranks
    return MuonCost(
        owner_flops=tuple(flops),
        state_bytes=tuple(held),
        exchange_bytes=exchange,
        ns_s=max(flops) / flops_per_s,
        exchange_s=exchange / link_bytes_per_s,
        elementwise_s=per_rank * MUON_STEP_BYTES / memory_bytes_per_s,
        adamw_s=per_rank * ADAMW_STEP_BYTES / memory_bytes_per_s,
    )


def llama_matrices(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> list[tuple[int, int]]:
    """The hidden matrices of a Llama decoder (what Muon steps; embeddings and head go to AdamW)."""
    kv = dim // n_heads * n_kv_heads
    layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn_dim, dim), (ffn_dim, dim), (dim, ffn_dim)]
    return layer * n_layers
