"""Ulysses attention: an all-to-all over the cp group swaps sequence shards for head shards.

[Note: Ulysses attention] (DeepSpeed-Ulysses, Jacobs et al. 2023; Snowflake's ALST) Outside
attention every cp rank holds ``T/cp`` tokens of each sequence ([Note: context-parallel layout]
in ``cp/layout.py``). Attention needs every token of a sequence but each head alone, so::

    q, k, v  (B, T/cp, heads, head_dim)  --all-to-all-->  (B, T, heads/cp, head_dim)
    causal attention over the whole sequence, rotary at global positions 0..T-1
    y        (B, T, heads/cp * head_dim) --all-to-all-->  (B, T/cp, heads * head_dim)

Rank ``c`` sends head group ``g`` of its slice to rank ``g`` and receives slice ``s`` of head
group ``c`` from rank ``s``; received chunks are laid out in rank order, so the sequence comes
back in order and the causal mask and the rotary tables are those of the unsliced model. q, k
and v travel in one all-to-all (each rank's chunk holds its q, k and v heads side by side); the
output travels back in a second. Backward runs the reverse exchanges on the gradients (an
all-to-all's adjoint is the inverse all-to-all). Under tensor parallelism the heads are a TP
rank's ``heads/tp`` (heads split by tp, then by cp); kv heads that do not split over cp are
repeated first (:func:`~lightning_zero.cp.layout.kv_head_repeats`) and the repeat's backward sums
their gradients.

Bytes: each all-to-all sends ``(cp-1)/cp`` of its input from each rank (``comm/ring.py``); per
attention layer, forward, ``(cp-1)/cp * B * T/cp * head_dim * (q + 2 kv + q)`` elements of a TP
rank's heads, and the same again in backward (``planner/workload.py`` states it as the formula).
Counted under ``cp_all_to_all`` in ``comm/collectives.py``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_to_all
from lightning_zero.cp.layout import kv_head_repeats

CP_ALL_TO_ALL_LABEL = "cp_all_to_all"


def _exchange(tensors: tuple, group: dist.ProcessGroup, counter: Optional[CommCounter], to_heads: bool) -> tuple:
    """One all-to-all for several tensors. ``to_heads``: each ``(B, T/cp, H_i, D)`` ->
    ``(B, T, H_i/cp, D)`` (this rank's head group, every token); else each ``(B, T, h_i, D)`` ->
    ``(B, T/cp, cp h_i, D)`` (every head, this rank's slice). Each result is a tensor of its own
    (not a view of the receive buffer), so autograd keeps exactly what it keeps without cp."""
    cp = dist.get_world_size(group)
    batch, dim = tensors[0].shape[0], tensors[0].shape[-1]
    if to_heads:  # chunk g (to rank g): head group g of this slice
        shard = tensors[0].shape[1]
        heads = [t.shape[2] // cp for t in tensors]
        chunks = [t.reshape(batch, shard, cp, h, dim).permute(2, 0, 1, 3, 4) for t, h in zip(tensors, heads)]
    else:  # chunk s (to rank s): slice s of this head group
        shard = tensors[0].shape[1] // cp
        heads = [t.shape[2] for t in tensors]
        chunks = [t.reshape(batch, cp, shard, h, dim).permute(1, 0, 2, 3, 4) for t, h in zip(tensors, heads)]
    send = torch.cat(chunks, dim=3)  # (cp, B, T/cp, sum h_i, D), contiguous
    received = torch.empty_like(send)  # chunk s: what rank s sent this rank
    all_to_all(received, send, group, counter=counter, label=CP_ALL_TO_ALL_LABEL)
    out, first = [], 0
    for h in heads:
        part = received[:, :, :, first : first + h]  # (cp, B, T/cp, h, D)
        first += h
        if to_heads:  # rank order is sequence order
            out.append(part.permute(1, 0, 2, 3, 4).reshape(batch, cp * shard, h, dim).contiguous())
        else:  # rank order is head-group order
            out.append(part.permute(1, 2, 0, 3, 4).reshape(batch, shard, cp * h, dim).contiguous())
    return tuple(out)


class _Exchange(torch.autograd.Function):
    """Forward :func:`_exchange` one way; backward the other way on the gradients (an
    all-to-all's adjoint is the inverse all-to-all)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, counter: Optional[CommCounter], to_heads: bool, *tensors: torch.Tensor):
        ctx.group, ctx.counter, ctx.to_heads = group, counter, to_heads
        return _exchange(tensors, group, counter, to_heads)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return None, None, None, *_exchange(grads, ctx.group, ctx.counter, not ctx.to_heads)


class UlyssesExchange:
    """The two exchanges of [Note: Ulysses attention] on one cp group; ``Attention`` calls them
    around its core when ``parallelize_context`` set one (``Attention.sequence_exchange``).

    Holds no head count: the numbers of query and kv heads come from the tensors' shapes, as
    everywhere in ``Attention`` ([Note: tensor-parallel friendly] in ``models/llama/model.py``).
    """

    def __init__(self, group: dist.ProcessGroup, counter: Optional[CommCounter] = None) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.counter = counter

    def heads_from_sequence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``(B, T/cp, q_heads, D)``, k and v ``(B, T/cp, kv_heads, D)`` -> this rank's
        ``q_heads/cp`` query heads and their kv heads over the whole sequence, in one all-to-all."""
        q_heads, kv_heads = q.size(2), k.size(2)
        repeats = kv_head_repeats(q_heads, kv_heads, self.cp)
        if repeats > 1:  # ALST: kv head j becomes heads j*r .. j*r + r-1; backward sums them
            k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        return _Exchange.apply(self.group, self.counter, True, q, k, v)

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
        """``core`` (rotary + causal attention over whole sequences) between the two exchanges:
        q ``(B, T/cp, q_heads, D)``, k and v ``(B, T/cp, kv_heads, D)`` -> ``(B, T/cp, q_heads * D)``.
        ``rope`` is ``core``'s business here (it sees every position)."""
        head_dim = q.size(-1)
        q, k, v = self.heads_from_sequence(q, k, v)  # (B, T, heads/cp, D)
        return self.sequence_from_heads(core(q, k, v, cos, sin), head_dim)

    def sequence_from_heads(self, y: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Attention's output ``(B, T, q_heads/cp * D)`` -> ``(B, T/cp, q_heads * D)``."""
        heads = y.unflatten(-1, (-1, head_dim))  # (B, T, q_heads/cp, D)
        (sequence,) = _Exchange.apply(self.group, self.counter, False, heads)
        return sequence.flatten(2)
