"""Whole parameters (or matrices) assembled on one owner rank from ZeRO's element-range runs, and
the gradient norm computed from whole parameters in torch's order.

Shared by the matrix owners' step (``matrix_optimizer.py``, [Note: owner step]) and gradient
clipping (``optimizer.py``). A *piece* is anything with ``param``, ``lo``, ``hi`` (its elements of
``param.reshape(-1)``), ``runs`` (per rank of the group: that rank's run ``[a, b)`` inside
``[lo, hi)``) and ``owner`` (the rank that gets it whole).

[Note: exact gradient norm] ``torch.nn.utils.clip_grad_norm_`` (what Lightning's and Fabric's ddp
call) computes one norm per parameter over its whole gradient (``torch._foreach_norm``, or
``linalg.vector_norm`` where foreach is not supported), then the norm of those norms stacked in
the parameters' order. ZeRO's chunks cut parameters anywhere, and a sum of squares over chunks
rounds differently, so the clip coefficient differed from ddp's in its last bits, and every
clipped gradient with it: AdamW carries that as an ulp, Muon's bf16 Newton-Schulz can turn it
into a whole bf16 ulp of the update (docs/optimizers.md). So clipping computes each parameter's
norm where its whole gradient lives: a Muon matrix on its owner, which gets it anyway for the
step (the exchange moves from the step to the clip and is not repeated: no extra bytes); any
other parameter on the rank holding its longest run, which gets the other ranks' runs of it (one
uneven all-to-all, ``grad_norm_to_owner``: nothing for a parameter inside one chunk, at most
``(n-1)/n`` of the gradient for one cut everywhere) when ``exact_grad_norm`` is on. The norms
travel in one all-reduce of a vector with one entry per parameter, which only its owner fills
(``x + 0`` is exact, so every rank gets every norm's bits), and every rank stacks them in the
optimizer's parameter order as torch does: the total, the clip coefficient and the clipped
gradients are ddp's bit for bit. Expert stacks (whose matrices have several owners), tensor-
parallel shards and replicated (``1/tp``-weighted) chunks keep the summed squares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import _has_foreach_support

from lightning_zero.comm.collectives import all_to_all_v


@dataclass
class Domain:
    """A group pieces are sharded over (dp, or an EDP group), with this rank's place in it."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int


@dataclass(eq=False)
class WholeParam:
    """A parameter gathered whole on ``owner`` (a piece: ``lo = 0``, ``hi = numel``)."""

    param: nn.Parameter
    lo: int
    hi: int
    runs: list[tuple[int, int]]
    owner: int


def param_runs(flat_group: Any, slot: Any) -> list[tuple[int, int]]:
    """Per rank of ``flat_group``'s shard group: its run ``[a, b)`` of the slot's parameter
    (``param.reshape(-1)`` coordinates; empty runs are ``(x, x)``)."""
    bucket = flat_group.layout.buckets[slot.bucket_index]
    runs = []
    for rank in range(flat_group.layout.dp):
        start = bucket.shard_start(rank)
        a = max(start, slot.offset) - slot.offset
        b = min(start + bucket.shard_numel, slot.end) - slot.offset
        runs.append((a, max(a, b)))
    return runs


def run_len(run: tuple[int, int]) -> int:
    return run[1] - run[0]


def longest_run_owner(runs: list[tuple[int, int]]) -> int:
    """The rank holding the most of a parameter (ties: the lower rank)."""
    return max(range(len(runs)), key=lambda rank: (run_len(runs[rank]), -rank))


def param_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One parameter's gradient norm as ``clip_grad_norm_`` computes it ([Note: exact gradient norm])."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


class OwnerExchange:
    """Mixin for a ShardedOptimizer: pieces to their owners and back (uneven all-to-alls)."""

    comm_device: Optional[torch.device]
    counter: Any
    waiter: Any
    optimizer: Any
    _segments: list

    def _device(self) -> torch.device:
        if self.comm_device is not None:
            return torch.device(self.comm_device)
        return self._segments[0][1].device if self._segments else torch.device("cpu")

    def _value_dtype(self) -> torch.dtype:
        return self._segments[0][1].dtype if self._segments else torch.float32

    def _run(self, piece: Any, a: int, b: int, *, grad: bool) -> torch.Tensor:
        """This rank's master run ``[a, b)`` of ``piece.param`` (or its gradient: zeros if none)."""
        owned, tensor = self._segment_of[id(piece.param)]
        values = tensor.detach() if not grad else tensor.grad
        if values is None:
            return torch.zeros(b - a, dtype=tensor.dtype, device=tensor.device)
        return values[a - owned.param_lo : b - owned.param_lo]

    @property
    def _segment_of(self) -> dict:
        """Module parameter id -> (its owned range, the view this rank steps): one run per parameter."""
        if getattr(self, "_segment_cache", None) is None:
            self._segment_cache = {id(owned.param): (owned, tensor) for owned, tensor in self._segments}
        return self._segment_cache

    def _to_owners(
        self, domain: Domain, members: list, run_of: Callable[[Any, int, int], torch.Tensor], label: str
    ) -> dict[int, torch.Tensor]:
        """Each owner gets its pieces whole (flat), assembled from every rank's ``run_of(piece, a,
        b)``; one uneven all-to-all over the domain."""
        me, device, dtype = domain.rank, self._device(), self._value_dtype()
        sends = [[m for m in members if m.owner == rank] for rank in range(domain.size)]
        pieces = [
            run_of(m, *m.runs[me]).to(device) for rank in range(domain.size) for m in sends[rank] if run_len(m.runs[me])
        ]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        input_splits = [sum(run_len(m.runs[me]) for m in sends[rank]) for rank in range(domain.size)]
        mine = sends[me]
        output_splits = [sum(run_len(m.runs[rank]) for m in mine) for rank in range(domain.size)]
        received = torch.empty(sum(output_splits), dtype=send.dtype, device=device)
        self._exchange(received, send, output_splits, input_splits, domain, label)
        whole = {id(m): torch.empty(m.hi - m.lo, dtype=send.dtype, device=device) for m in mine}
        offset = 0
        for rank in range(domain.size):
            for piece in mine:
                a, b = piece.runs[rank]
                whole[id(piece)][a - piece.lo : b - piece.lo].copy_(received[offset : offset + b - a])
                offset += b - a
        return whole

    def _from_owners(
        self, domain: Domain, members: list, whole: dict[int, torch.Tensor], label: str, dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """Every rank gets its runs of each piece from the owner's ``whole[id(piece)]`` (flat)."""
        me, device = domain.rank, self._device()
        mine = [m for m in members if m.owner == me]
        pieces = [
            whole[id(m)][m.runs[rank][0] - m.lo : m.runs[rank][1] - m.lo].to(dtype)
            for rank in range(domain.size)
            for m in mine
            if run_len(m.runs[rank])
        ]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        input_splits = [sum(run_len(m.runs[rank]) for m in mine) for rank in range(domain.size)]
        froms = [[m for m in members if m.owner == rank] for rank in range(domain.size)]
        output_splits = [sum(run_len(m.runs[me]) for m in froms[rank]) for rank in range(domain.size)]
        received = torch.empty(sum(output_splits), dtype=send.dtype, device=device)
        self._exchange(received, send, output_splits, input_splits, domain, label)
        out, offset = {}, 0
        for rank in range(domain.size):
            for piece in froms[rank]:
                length = run_len(piece.runs[me])
                out[id(piece)] = received[offset : offset + length]
                offset += length
        return out

    def _exchange(
        self, received: torch.Tensor, send: torch.Tensor, output_splits: list, input_splits: list, domain: Domain,
        label: str,
    ) -> None:  # fmt: skip
        work = all_to_all_v(
            received, send, output_splits, input_splits, domain.group, async_op=True, counter=self.counter, label=label
        )
        if work is not None:
            name = type(self.optimizer).__name__
            self.waiter.wait(work, lambda: f"the {label} all-to-all of {name} (owner exchange)")
