"""The tensor collectives the engine uses, in one place.

Every call goes through here so that (a) the op name the installed torch offers is picked once
(torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single``), (b) each collective is labelled with
``torch.profiler.record_function("lightning_zero::<kind>")`` so a trace tells the story, and
(c) the logical bytes each rank sends are counted in a :class:`CommCounter`.

[Note: logical bytes] We count what a ring algorithm sends from one rank, not wall time: for a
group of ``n`` ranks, an all-gather whose output holds ``N`` elements sends ``(n-1)/n * N``; a
reduce-scatter whose input holds ``N`` elements sends ``(n-1)/n * N``; an all-reduce of ``N``
elements sends ``2 (n-1)/n * N``. On gloo a reduce-scatter runs as an all-reduce underneath, so
wall time on CPU says little; these counts are what the ZeRO paper's formulas talk about.

A group of one rank (dp=1 under tensor parallelism, a single process) issues no collective at
all: the result is computed locally and a completed work handle is returned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounter:
    """Logical elements and bytes one rank sent, per collective kind (see [Note: logical bytes])."""

    elements: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, elements_sent: float, element_size: int) -> None:
        self.elements[kind] = self.elements.get(kind, 0.0) + elements_sent
        self.bytes[kind] = self.bytes.get(kind, 0.0) + elements_sent * element_size
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total_elements(self) -> float:
        return sum(self.elements.values())

    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict]:
        return {"elements": dict(self.elements), "bytes": dict(self.bytes), "calls": dict(self.calls)}


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


class _Done:
    """The work handle of a collective over one rank: nothing to wait for."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _local(output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """A one-rank group: the result is the input (copied unless it is already in place)."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input.view_as(output))
    return _Done() if async_op else None


def _chunked(
    op,
    output: torch.Tensor,
    input: torch.Tensor,
    full: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
    counter: Optional[CommCounter],
    label: str,
):
    """Run a collective between a full tensor and its per-rank chunk; ``full`` (the group-sized
    side) is what [Note: logical bytes] counts: ``(n-1)/n`` of its elements leave each rank."""
    size = _group_size(group)
    if size == 1:
        return _local(output, input, async_op)
    if counter is not None:
        counter.add(label, full.numel() * (size - 1) / size, full.element_size())
    with record_function(f"lightning_zero::{label}"):
        return op(output, input, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "reduce_scatter",
    op: dist.ReduceOp = dist.ReduceOp.SUM,
):
    """Reduce ``input`` over the group with ``op`` (default: sum) and leave chunk ``rank`` of the
    result in ``output``."""
    run = _reduce_scatter if op == dist.ReduceOp.SUM else functools.partial(_reduce_scatter, op=op)
    return _chunked(run, output, input, input, group, async_op, counter, label)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_gather",
):
    """Concatenate every rank's ``input`` into ``output`` (``output.numel() == size * input.numel()``)."""
    return _chunked(_all_gather, output, input, output, group, async_op, counter, label)


def all_reduce(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_reduce",
):
    """In-place all-reduce of ``tensor`` over the group."""
    size = _group_size(group)
    if size == 1:
        return _Done() if async_op else None
    if counter is not None:
        counter.add(label, 2 * tensor.numel() * (size - 1) / size, tensor.element_size())
    with record_function(f"lightning_zero::{label}"):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
