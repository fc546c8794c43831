"""A tensor split over TP in segments: each segment of its split dimension cut into ``tp`` parts.

[Note: segmented TP split] A fused projection holds several outputs stacked on one dimension:
LitGPT's ``qkv`` holds every query head, then every key head, then every value head
(``(n_head + 2 n_query_groups) head_size`` rows). A contiguous ``1/tp`` of its rows would give rank 0
all of its queries and none of its keys. Each TP rank needs whole heads of each kind, so the rows
are cut per *segment* (``segments``: the sizes along the split dimension, here ``(n_head hs,
n_query_groups hs, n_query_groups hs)``): rank ``r`` holds part ``r`` of every segment, in segment
order. In rank order the local tensors are the dense one with its rows permuted
(:func:`segment_permutation`); a dense (full) state dict undoes that permutation on save and
applies it on load, so saved files hold the dense layout whatever the TP size. A plain split is the
case of one segment. The parameter carries its segments as ``_tp_segments`` beside
``_tp_shard_dim``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_gather
from lightning_zero.tp.layers import shard_size

TP_SEGMENTS_ATTR = "_tp_segments"


def tp_segments(param: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The segments a parameter's split dimension is cut in ([Note: segmented TP split]), or None."""
    return getattr(param, TP_SEGMENTS_ATTR, None)


def _parts(segments: Sequence[int], size: int) -> list[int]:
    return [shard_size(segment, size, f"a segment of {tuple(segments)}") for segment in segments]


def segmented_slice(full: torch.Tensor, dim: int, segments: Sequence[int], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of every segment of ``full`` along ``dim``, concatenated (a new tensor).
    Only ``narrow`` and ``cat``: a meta tensor whose ops are recorded for a deferred init records it."""
    if sum(segments) != full.shape[dim]:
        raise ValueError(f"segments {tuple(segments)} do not add up to dim {dim} of a {tuple(full.shape)} tensor")
    pieces, start = [], 0
    for segment, part in zip(segments, _parts(segments, size)):
        pieces.append(full.narrow(dim, start + rank * part, part))
        start += segment
    return torch.cat(pieces, dim)


def segment_permutation(segments: Sequence[int], size: int) -> torch.Tensor:
    """The dense indices of the rows the ranks hold, in rank order: ``dense.index_select(dim, perm)``
    is rank 0's local tensor, then rank 1's, ... (a permutation of ``range(sum(segments))``)."""
    parts = _parts(segments, size)
    starts = [sum(segments[:index]) for index in range(len(segments))]
    order = [start + rank * part + k for rank in range(size) for start, part in zip(starts, parts) for k in range(part)]
    return torch.tensor(order, dtype=torch.long)


def dense_from_ranks(stacked: torch.Tensor, dim: int, segments: Sequence[int], size: int) -> torch.Tensor:
    """The dense tensor from the ranks' local tensors concatenated in rank order along ``dim``."""
    inverse = torch.argsort(segment_permutation(segments, size)).to(stacked.device)
    return stacked.index_select(dim, inverse)


def gather_dense(
    local: torch.Tensor,
    dim: int,
    segments: Optional[Sequence[int]],
    group: dist.ProcessGroup,
    counter: Optional[CommCounter] = None,
) -> torch.Tensor:
    """The dense tensor from every TP rank's ``local`` split along ``dim`` (in ``segments``, or one
    contiguous split when None): an all-gather over ``group``, every rank calls it."""
    size = dist.get_world_size(group)
    rows = local.movedim(dim, 0).contiguous()
    gathered = rows.new_empty((size * rows.shape[0], *rows.shape[1:]))
    all_gather(gathered, rows, group, counter=counter, label="tp_all_gather")
    if segments is not None:
        gathered = dense_from_ranks(gathered, 0, segments, size)
    return gathered.movedim(0, dim).contiguous()


def local_part(dense: torch.Tensor, dim: int, segments: Optional[Sequence[int]], rank: int, size: int) -> torch.Tensor:
    """The inverse of :func:`gather_dense` for one rank (no communication)."""
    return segmented_slice(dense, dim, segments or (dense.shape[dim],), rank, size)
