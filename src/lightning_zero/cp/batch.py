"""A whole batch -> this cp rank's slice of it, for loops that hold whole batches (the Fabric door).

[Note: slicing a whole batch] The Trainer's data path hands each cp rank its slice already
(``TokenDataModule``: ``T/cp + 1`` tokens of each stored window, [Note: context-parallel layout] in
``cp/layout.py``). A Fabric loop holds whole batches: its model's inputs and labels, both ``T``
long and already shifted by one (``inputs = window[:, :-1]``, ``targets = window[:, 1:]``), and
perhaps other tensors aligned with them (a loss mask, position ids). Cutting every such tensor at
the same ``[c T/cp, (c+1) T/cp)`` gives cp rank ``c`` exactly what the Trainer's data path gives
it: its inputs, and its labels, whose last one is the next slice's first input (the labels were
shifted across the slice border before the cut). The slices are views: nothing is copied.
"""

from __future__ import annotations

import torch

from lightning_zero.cp.layout import context_shard_len


def context_slices(tensors: tuple[torch.Tensor, ...], cp: int, cp_rank: int, dim: int = 1) -> tuple[torch.Tensor, ...]:
    """Cp rank ``cp_rank``'s ``[c T/cp, (c+1) T/cp)`` of each tensor along ``dim`` (the sequence),
    as views ([Note: slicing a whole batch]). Every tensor must be ``T`` long there, with ``cp``
    dividing ``T``; else a ``ValueError`` naming the numbers and the fix. ``cp == 1``: unchanged."""
    if not tensors:
        raise ValueError("context_slice: pass the batch's tensors (input ids, labels, ...), got none")
    lengths = [tensor.size(dim) for tensor in tensors]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"context_slice: the tensors must be equally long along dim {dim} (the sequence), got {lengths}: pass"
            " inputs and labels already shifted (inputs = window[:, :-1], targets = window[:, 1:])"
        )
    shard = context_shard_len(lengths[0], cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context_slice: cp_rank must be in [0, {cp}), got {cp_rank}")
    if cp == 1:
        return tensors
    return tuple(tensor.narrow(dim, cp_rank * shard, shard) for tensor in tensors)
