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

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_zero.planner.ledger import momenta_by_owner
from lightning_zero.zero.bucketing import bucket_sizes, padded_numel
from lightning_zero.zero.matrix_owners import DEFAULT_NS_STEPS, assign_owners, ns_flops, owner_loads

if TYPE_CHECKING:
    from lightning_zero.planner.plan import Plan
    from lightning_zero.planner.resolved import ResolvedRun

PLANNED_OPTIMIZERS = ("adamw", "muon")  # RunShape.optimizer
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
    flops = owner_loads(costs, assign_owners(costs, ranks), ranks)
    held = momenta_by_owner(shapes, ranks, state_bytes=state_bytes, ns_steps=ns_steps)
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


def owner_exchange_bytes(
    shapes: Sequence[tuple[int, int]],
    ranks: int,
    *,
    bucket_numel: int,
    first_bucket_numel: Optional[int] = None,
    master_bytes: int = 4,
    ns_steps: int = DEFAULT_NS_STEPS,
) -> list[dict[str, int]]:
    """Each rank's bytes per step, ``{"muon_to_owner": ..., "muon_from_owner": ...}``, exactly as
    the engine sends them at stages 1-2 for one Muon param group of 2-D matrices ``shapes`` (in the
    order the module registers them): the flat layout's buckets and chunks (``zero/flat.py``,
    reversed order, ``zero/bucketing.py``'s cut), the owners of [Note: matrix owners], and every
    matrix stepped."""
    numels = [rows * cols for rows, cols in shapes]
    ordered = list(reversed(range(len(shapes))))  # the layout lays the last registered first
    offsets, bucket_of, buckets = {}, {}, []
    offset = taken = 0
    for count in bucket_sizes((numels[i] for i in ordered), bucket_numel=bucket_numel,
                              first_bucket_numel=first_bucket_numel):  # fmt: skip
        start = offset
        for index in ordered[taken : taken + count]:
            offsets[index], bucket_of[index] = offset, len(buckets)
            offset += numels[index]
        taken += count
        buckets.append((start, padded_numel(offset - start, ranks)))
        offset = start + buckets[-1][1]
    owners = assign_owners([float(ns_flops(rows, cols, ns_steps)) for rows, cols in shapes], ranks)
    out = [{"muon_to_owner": 0, "muon_from_owner": 0} for _ in range(ranks)]
    for index, owner in enumerate(owners):
        start, padded = buckets[bucket_of[index]]
        chunk = padded // ranks
        lo, hi = offsets[index], offsets[index] + numels[index]
        for rank in range(ranks):
            held = max(0, min(hi, start + (rank + 1) * chunk) - max(lo, start + rank * chunk))
            if rank != owner:
                out[rank]["muon_to_owner"] += held * master_bytes
                out[owner]["muon_from_owner"] += held * BF16_BYTES
    return out


def llama_matrices(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> list[tuple[int, int]]:
    """The hidden matrices of a Llama decoder (what Muon steps; embeddings and head go to AdamW)."""
    kv = dim // n_heads * n_kv_heads
    layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn_dim, dim), (ffn_dim, dim), (dim, ffn_dim)]
    return layer * n_layers


def muon_cost_on(model_config: Any, ranks: int, hardware: Any = None, *, mfu: Optional[float] = None) -> MuonCost:
    """:func:`muon_cost` of a Llama config's hidden matrices over ``ranks`` dp ranks, with the
    hardware's figures (``planner/hardware.py``: bf16 peak times ``mfu`` (default: the
    hardware's, else the planner's 0.4), its optimizer and memory bandwidth, its intra-node link
    for up to a node of ranks, else the network)."""
    from lightning_zero.planner.hardware import DEFAULT_MFU, load_hardware

    hw = load_hardware(hardware)
    c = model_config
    shapes = llama_matrices(c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim)
    link = hw.intra_node_bytes_per_s if ranks <= hw.devices_per_node else hw.inter_node_bytes_per_s
    return muon_cost(
        shapes,
        ranks,
        flops_per_s=hw.peak_bf16_flops * (mfu or hw.mfu or DEFAULT_MFU),
        memory_bytes_per_s=hw.optimizer_bytes_per_s or hw.memory_bytes_per_s,
        link_bytes_per_s=link,
    )


def with_muon(plan: "Plan", resolved: "ResolvedRun") -> "Plan":
    """``plan`` (planned with AdamW) under ``optimizer="muon"``: Muon for the Llama's hidden
    matrices, AdamW for the rest, owners over the dp shard group ([Note: matrix owners]).

    - memory: the optimizer moments become the busiest owner's momenta (one per element of each
      matrix it owns, half of AdamW's two moments, whole: by ownership, not ``1/dp``) plus AdamW's
      moments of the other parameters' ``1/dp`` share; masters stay ``1/dp``;
    - time: the step changes by :func:`muon_cost`'s Muon step minus its AdamW step (NS on the
      busiest owner, the exchange, the element-wise pass; all exposed: [Note: owner step] runs
      after the clip, which needs every gradient);
    - under tp the owners orthogonalize whole matrices (NS per tp rank is the whole one's), hold
      and exchange their tp shard (``1/tp``), and gather the shards over tp (master dtype).
    """
    from lightning_zero.planner.workload import is_moe

    model = resolved.model
    if is_moe(model) or not all(hasattr(model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")):
        raise ValueError(
            f"plan: optimizer='muon' is planned for Llama-family models (their hidden matrices); {model.name!r}"
            " is not one (a mixture of experts' stacks are GroupedMuon's): plan it with optimizer='adamw'"
        )
    shapes = llama_matrices(model.dim, model.n_layers, model.n_heads, model.n_kv_heads, model.ffn_dim)
    ranks, tp = resolved.topology.shard_size, resolved.tp
    dtype = resolved.dtype
    master = dtype.master or dtype.param
    link = resolved.hw.intra_node_bytes_per_s if ranks * tp <= resolved.hw.devices_per_node else (
        resolved.hw.inter_node_bytes_per_s
    )  # fmt: skip
    cost = muon_cost(
        shapes, ranks, master_bytes=master, state_bytes=dtype.moments // 2,
        flops_per_s=resolved.hw.peak_bf16_flops * resolved.mfu,
        memory_bytes_per_s=resolved.hw.optimizer_bytes_per_s or resolved.hw.memory_bytes_per_s,
        link_bytes_per_s=link,
    )  # fmt: skip
    matrix_numel = sum(rows * cols for rows, cols in shapes) // tp  # this tp rank's shards
    tp_gather = max(cost.state_bytes) // (dtype.moments // 2) // tp * (tp - 1) * master if tp > 1 else 0
    exchange = cost.exchange_bytes / tp + tp_gather
    muon_s = cost.ns_s + exchange / link + cost.elementwise_s / tp
    adamw_s = cost.adamw_s / tp
    rest = max(0, resolved.padded - matrix_numel) // ranks
    memory = dataclasses.replace(
        plan.memory, optimizer_moments=float(max(cost.state_bytes) // tp + rest * dtype.moments)
    )
    traffic = plan.traffic
    if plan.timing is not None:
        traffic = dataclasses.replace(traffic, step_s=traffic.step_s + muon_s - adamw_s)
    return dataclasses.replace(
        plan, memory=memory, traffic=traffic, optimizer="muon", muon_owner_flops=max(cost.owner_flops),
        muon_exchange_bytes=exchange, muon_momentum_bytes=float(max(cost.state_bytes) // tp), muon_step_s=muon_s,
        adamw_step_s=adamw_s,
    )  # fmt: skip
