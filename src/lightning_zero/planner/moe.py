"""Expert parallelism's all-to-all bytes, from routing counts (measured) or from a balanced
router (planned). Plain Python: the planner imports no torch.

[Note: all-to-all bytes] One MoE layer's exchanges on an ``ep`` group ([Note: token exchange] in
``ep/dispatch.py``), for ep rank ``r`` holding experts ``L(r)``, with ``count[s][e]`` the
assignments rank ``s`` routed to expert ``e`` and ``row`` the bytes of one token row
(``dim x`` the compute dtype's bytes):

- ``moe_dispatch`` (forward) and ``moe_combine_grad`` (backward, its mirror): rank ``r`` sends
  ``sum over e not in L(r) of count[r][e]`` rows (its tokens for other ranks' experts);
- ``moe_combine`` (forward) and ``moe_dispatch_grad`` (backward): rank ``r`` sends back
  ``sum over s != r, e in L(r) of count[s][e]`` rows (the other ranks' tokens its experts ran).

What stays on the rank is not sent (the own split). The per-(rank, expert) counts go first in
a small all-to-all (``moe_counts``: ``(ep - 1) x E/ep`` int64 a layer, a control exchange).
Under "full" activation checkpointing a block's forward runs again in backward, exchanges included:
forward labels count twice. Balanced routing (the planner's assumption): every expert gets
``tokens x top_k / E`` of a rank's assignments, so a rank sends ``(ep - 1) / ep`` of its
``tokens x top_k`` rows in each of the four exchanges.

A mixture of experts is planned by the planner every model goes through (``arithmetic.plan``):
expert parameters as their own ZeRO domain over the edp group, buckets simulated per domain, the
exchanges of :func:`balanced_exchange_bytes` on the ep group's link (``traffic.ep_bytes_by_kind``,
``workload.layer_tensors``; docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MOE_EXCHANGES = ("moe_dispatch", "moe_combine", "moe_dispatch_grad", "moe_combine_grad")


def _flat_layers(counts: Any) -> list[list[float]]:
    """``counts`` ``(layers, E)`` (nested lists or a tensor) as a list of rows."""
    rows = counts.tolist() if hasattr(counts, "tolist") else counts
    return [list(map(float, row)) for row in rows]


def all_to_all_bytes(counts_by_rank: Sequence[Any], *, rank: int, ep: int, row_bytes: float,
                     recomputed: bool = False) -> dict[str, float]:  # fmt: skip
    """Bytes ep rank ``rank`` sends per exchange label for one forward + backward, given every ep
    rank's counts ``(moe layers, E)`` ([Note: all-to-all bytes]). ``recomputed``: "full"
    activation checkpointing (forward exchanges twice)."""
    layers = [_flat_layers(counts) for counts in counts_by_rank]
    n_experts = len(layers[rank][0])
    n_local = n_experts // ep
    mine = range(rank * n_local, (rank + 1) * n_local)
    out_rows = sum(c for layer in layers[rank] for e, c in enumerate(layer) if e not in mine)
    back_rows = sum(
        layer[e] for source, per_layer in enumerate(layers) if source != rank for layer in per_layer for e in mine
    )
    forward = 2.0 if recomputed else 1.0
    sent = {
        "moe_dispatch": forward * out_rows * row_bytes,
        "moe_combine": forward * back_rows * row_bytes,
        "moe_dispatch_grad": back_rows * row_bytes,
        "moe_combine_grad": out_rows * row_bytes,
    }
    return {label: value for label, value in sent.items() if value or ep > 1}


def balanced_exchange_bytes(tokens: float, *, top_k: int, ep: int, moe_layers: int, row_bytes: float,
                            recomputed: bool = False) -> dict[str, float]:  # fmt: skip
    """Bytes one rank sends per exchange label for one forward + backward of ``moe_layers`` layers
    when the router balances perfectly (every expert gets ``tokens x top_k / E`` of each rank's
    assignments): :func:`all_to_all_bytes` of those counts, in closed form, ``(ep-1)/ep x tokens x
    k x row`` per layer and exchange (the forward ones twice with ``recomputed``). What the planner
    counts (``traffic.ep_bytes_by_kind``)."""
    if ep == 1:
        return {}
    per_exchange = moe_layers * tokens * top_k * row_bytes * (ep - 1) / ep
    forward = 2.0 if recomputed else 1.0
    return {
        "moe_dispatch": forward * per_exchange,
        "moe_combine": forward * per_exchange,
        "moe_dispatch_grad": per_exchange,
        "moe_combine_grad": per_exchange,
    }


def balanced_all_to_all_bytes(tokens: int, *, top_k: int, ep: int, moe_layers: int, row_bytes: float,
                              recomputed: bool = False) -> float:  # fmt: skip
    """The four exchanges of :func:`balanced_exchange_bytes` summed:
    ``(2 + 2 or 4 with recompute) x (ep-1)/ep x tokens x k x row``."""
    return sum(balanced_exchange_bytes(tokens, top_k=top_k, ep=ep, moe_layers=moe_layers, row_bytes=row_bytes,
                                       recomputed=recomputed).values())  # fmt: skip
