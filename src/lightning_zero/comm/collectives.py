"""The tensor collectives the engine uses, in one place.

Every call goes through here so that (a) the op name the installed torch offers is picked once
(torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single``), (b) each collective is labelled with
``torch.profiler.record_function("lightning_zero::<kind>")`` so a trace tells the story, and
(c) the logical bytes each rank sends are counted in a :class:`CommCounter`.

[Note: logical bytes] We count what a ring algorithm sends from one rank, not wall time: for a
group of ``n`` ranks, an all-gather whose output holds ``N`` elements sends ``(n-1)/n * N``; a
reduce-scatter whose input holds ``N`` elements sends ``(n-1)/n * N``; an all-reduce of ``N``
elements sends ``2 (n-1)/n * N`` (``lightning_zero/comm/ring.py``, [Note: ring bytes]: the one formula the
planner, calibration and benchmarks use too). These counts are what the ZeRO paper's formulas talk
about; wall time on CPU says little about a GPU cluster.

[Note: reduce-scatter on gloo] gloo's own ``reduce_scatter`` copies the whole input, all-reduces it
and keeps one chunk: it sends an all-reduce's bytes (twice a reduce-scatter's) and takes longer
than an all-reduce (measurements: docs/performance.md). Its async form also completes only inside
``wait()``, so a wait with a time limit cannot poll it. On a gloo group
:func:`reduce_scatter` therefore runs an ``all_to_all_single`` (each rank sends chunk ``r`` of its
input to rank ``r``: exactly ``(n-1)/n`` of the input, the logical bytes), and the handle's
``wait()`` adds what arrived to this rank's own chunk (the all-to-all completes without
``wait()``, so it can be polled). Where the other ranks' chunks lie next to each other in the
input (dp rank 0, and both ranks of a pair) the all-to-all sends only those and receives only
the ``n-1`` foreign versions of this rank's chunk; nothing goes to this rank itself, and the sum
is ``own + received`` in rank order (for a pair ``a + b == b + a`` exactly), in place when
``output`` is that chunk. Elsewhere the input's own chunk travels to this rank too (gloo copies it
locally) and the ``n`` received versions are summed in rank order. The receive buffer lives until
``wait()``. NCCL keeps its native reduce-scatter.

[Note: all-gather on gloo] gloo's ``all_gather_into_tensor`` costs about twice what an all-to-all
moving the same bytes costs (docs/performance.md). Over a pair of ranks :func:`all_gather`
therefore is one all-to-all of the rank's own chunk into the peer's slot of ``output`` (the own
slot is written in place, or copied from ``input``): the same bytes, pollable as well. Larger
gloo groups and NCCL keep the native all-gather.

A group of one rank (dp=1 under tensor parallelism, a single process) issues no collective at
all: the result is computed locally and a completed work handle is returned, unless the wire is
forced ([Note: one rank on the wire]).

[Note: one rank on the wire] The GPU a session may borrow is one device, and NCCL refuses two
ranks on one device; at dp=1 every collective above short-circuits, so the engine's NCCL path
(the in-place reduce-scatter with its averaging op, the all-gathers, ``work.wait()``'s stream
semantics, the phase markers, compression, stage 3's exchanges) would never run there. With the
environment variable ``LIGHTNING_ZERO_WIRE_ONE_RANK=1`` (:data:`WIRE_ONE_RANK_ENV`) a group of
one rank issues the real collective anyway, through the same code a larger group runs
(:func:`local_only` is the one test, read at each call). A one-rank collective's result equals the
local one, so losses must not move: ``benchmarks/gpu_check.py`` compares the two runs, and
``tests/test_collectives.py`` does on a one-rank gloo group. A test and device-check switch, not
a knob: it only adds launches.

[Note: link classes] Each collective's bytes are also counted by the link they cross:
``"intra_node"`` when every rank of its group sits on one node, ``"inter_node"`` when the group
spans more than one node; then *all* its bytes count as ``"inter_node"``. A ring over a group that
spans nodes passes every chunk through the ring's node-crossing hops once per ring step, so each
step runs at the slow link's speed: the collective is bound by the inter-node link as a whole,
even though some of its hops stay inside a node. (Hierarchical reduction in ``zero/hybrid.py``
exists to split such a collective into an in-node one and a smaller cross-node one.) A rank's
node is ``global_rank // ranks_per_node``; :attr:`CommCounter.ranks_per_node` comes from the launch
(``LOCAL_WORLD_SIZE`` / Lightning's devices per node) and is set once by the strategy or engine;
``None`` means one node (everything is ``"intra_node"``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.comm.ring import ring_sent

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


INTRA_NODE = "intra_node"
INTER_NODE = "inter_node"
LINK_CLASSES = (INTRA_NODE, INTER_NODE)


@dataclass
class CommCounter:
    """Logical elements and bytes one rank sent, per collective kind (see [Note: logical bytes]),
    and bytes per link class (``bytes_by_link``: ``"intra_node"`` / ``"inter_node"``, see
    [Note: link classes]). ``ranks_per_node``: ranks of one node, set once from the launch."""

    elements: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    bytes_by_link: dict[str, float] = field(default_factory=dict)
    ranks_per_node: Optional[int] = None
    # Control exchanges (agreements on bucket order, used parameters, phases): counted apart from
    # the data bytes the ZeRO formulas describe ([Note: logical bytes]).
    control_bytes: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, elements_sent: float, element_size: int, link: str = INTRA_NODE) -> None:
        self.elements[kind] = self.elements.get(kind, 0.0) + elements_sent
        self.bytes[kind] = self.bytes.get(kind, 0.0) + elements_sent * element_size
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes_by_link[link] = self.bytes_by_link.get(link, 0.0) + elements_sent * element_size

    def add_control(self, kind: str, elements_sent: float, element_size: int) -> None:
        self.control_bytes[kind] = self.control_bytes.get(kind, 0.0) + elements_sent * element_size

    def link_of(self, group: Optional[dist.ProcessGroup]) -> str:
        """The link class of a collective over ``group`` (see [Note: link classes])."""
        return link_class(group, self.ranks_per_node)

    def total_elements(self) -> float:
        return sum(self.elements.values())

    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()
        self.bytes_by_link.clear()
        self.control_bytes.clear()

    def snapshot(self) -> dict[str, dict]:
        return {
            "elements": dict(self.elements),
            "bytes": dict(self.bytes),
            "calls": dict(self.calls),
            "bytes_by_link": dict(self.bytes_by_link),
            "control_bytes": dict(self.control_bytes),
        }


def link_class(group: Optional[dist.ProcessGroup], ranks_per_node: Optional[int]) -> str:
    """``"inter_node"`` if ``group``'s ranks (global ranks; ``None``: the default group) sit on more
    than one node of ``ranks_per_node`` ranks, else ``"intra_node"`` (see [Note: link classes])."""
    if ranks_per_node is None:
        return INTRA_NODE
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    nodes = {rank // ranks_per_node for rank in ranks}
    return INTER_NODE if len(nodes) > 1 else INTRA_NODE


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


WIRE_ONE_RANK_ENV = "LIGHTNING_ZERO_WIRE_ONE_RANK"


def local_only(size: int) -> bool:
    """Whether a collective over a group of ``size`` ranks is computed locally with no launch:
    one rank, unless ``LIGHTNING_ZERO_WIRE_ONE_RANK=1`` ([Note: one rank on the wire])."""
    return size == 1 and os.environ.get(WIRE_ONE_RANK_ENV) != "1"


class _Done:
    """The work handle of a collective over one rank: nothing to wait for."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Finishing:
    """Work handle of a collective that needs local work after the wire collective: ``wait()``
    waits on ``work``, then runs ``finish`` (sum, dequantize, copy into the caller's output) once.
    ``buffers`` (send / receive buffers) stay referenced until then, so no allocator reuses them
    mid-collective. ``is_completed()`` says whether the wire collective is done (``wait()`` still
    has to run ``finish``)."""

    def __init__(self, work: Any, finish: Callable[[], None], buffers: tuple = ()) -> None:
        self._work = work
        self._finish: Optional[Callable[[], None]] = finish
        self._buffers = buffers

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    @property
    def wire_work(self) -> Any:
        """The wire collective's own work (``None``: nothing on the wire), which a waiter may
        block on in slices before calling :meth:`wait` ([Note: sliced waits] in ``zero/waits.py``)."""
        return self._work

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
            self._buffers = ()
        return True


def finishing(work: Any, finish: Callable[[], None], async_op: bool, buffers: tuple = ()):
    """A :class:`Finishing` handle (``async_op``), or ``None`` after waiting and finishing now."""
    handle = Finishing(work, finish, buffers)
    if async_op:
        return handle
    handle.wait()
    return None


def _local(output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """A one-rank group: the result is the input (copied unless it is already in place)."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input.view_as(output))
    return _Done() if async_op else None


def _chunked(
    kind: str,
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
    side) is what [Note: logical bytes] counts: ``(n-1)/n`` of its elements leave each rank
    (:func:`~lightning_zero.comm.ring.ring_sent` of ``kind``)."""
    size = _group_size(group)
    if local_only(size):
        return _local(output, input, async_op)
    _count(counter, label, kind, full, size, group)
    with record_function(f"lightning_zero::{label}"):
        return op(output, input, group=group, async_op=async_op)


def _count(counter: Optional[CommCounter], label: str, kind: str, full: torch.Tensor, size: int, group) -> None:
    """Add a ``kind`` collective over ``full`` (its group-sized side) to ``counter`` under ``label``
    ([Note: logical bytes]: :func:`~lightning_zero.comm.ring.ring_sent`)."""
    if counter is not None:
        counter.add(label, ring_sent(kind, full.numel(), size), full.element_size(), counter.link_of(group))


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
    result in ``output``. ``output`` may be a view of ``input`` (this rank's chunk). On gloo a sum
    runs as an all-to-all, summed in ``wait()`` ([Note: reduce-scatter on gloo])."""
    size = _group_size(group)
    if size > 1 and op == dist.ReduceOp.SUM and dist.get_backend(group) == "gloo":
        return _reduce_scatter_by_all_to_all(output, input, group, size, async_op, counter, label)
    run = _reduce_scatter if op == dist.ReduceOp.SUM else functools.partial(_reduce_scatter, op=op)
    return _chunked("reduce_scatter", run, output, input, input, group, async_op, counter, label)


def _reduce_scatter_by_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    size: int,
    async_op: bool,
    counter: Optional[CommCounter],
    label: str,
):
    """[Note: reduce-scatter on gloo]: an all-to-all, then this rank's chunk plus what arrived."""
    if input.numel() != size * output.numel():
        raise ValueError(
            f"reduce_scatter: input.numel()={input.numel()} must be group size ({size}) x"
            f" output.numel()={output.numel()}"
        )
    chunk = output.numel()
    rank = dist.get_rank(group)
    full = input.reshape(-1)
    own = full[rank * chunk : (rank + 1) * chunk]
    _count(counter, label, "all_to_all", full, size, group)
    others_adjacent = rank == 0 or size == 2
    if others_adjacent:  # the other ranks' chunks are one run: send only them, receive n-1 chunks
        send = full[chunk:] if rank == 0 else full[: rank * chunk]
        splits = [0 if source == rank else chunk for source in range(size)]
        received = torch.empty((size - 1) * chunk, dtype=full.dtype, device=full.device)
    else:
        send, splits = full, [chunk] * size
        received = torch.empty_like(full)
    with record_function(f"lightning_zero::{label}"):
        work = dist.all_to_all_single(
            received, send, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True
        )
    rows = received.view(-1, chunk)

    def finish() -> None:
        target = output.view(-1)
        if others_adjacent:
            if target.data_ptr() != own.data_ptr():
                torch.add(own, rows[0], out=target)
            else:
                target.add_(rows[0])
            for row in rows[1:]:
                target.add_(row)
            return
        target.copy_(rows[0])
        for source in range(1, size):
            target.add_(rows[source])

    return finishing(work, finish, async_op, (send, received))


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_gather",
):
    """Concatenate every rank's ``input`` into ``output`` (``output.numel() == size * input.numel()``).
    ``input`` may be this rank's slot of ``output``. A gloo pair runs one all-to-all ([Note:
    all-gather on gloo])."""
    size = _group_size(group)
    if size == 2 and output.is_contiguous() and input.is_contiguous() and dist.get_backend(group) == "gloo":
        return _all_gather_pair(output, input, group, async_op, counter, label)
    return _chunked("all_gather", _all_gather, output, input, output, group, async_op, counter, label)


def _all_gather_pair(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
    counter: Optional[CommCounter],
    label: str,
):
    """[Note: all-gather on gloo]: this rank's chunk goes to the peer's slot of ``output`` and back."""
    chunk = input.numel()
    if output.numel() != 2 * chunk or output.dtype != input.dtype:
        raise ValueError(
            f"all_gather: output ({output.numel()} x {output.dtype}) must hold 2 x input"
            f" ({chunk} x {input.dtype}) over a group of 2"
        )
    rank = dist.get_rank(group)
    flat = output.view(-1)
    mine, theirs = flat[rank * chunk : (rank + 1) * chunk], flat[(1 - rank) * chunk : (2 - rank) * chunk]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.reshape(-1))
    _count(counter, label, "all_gather", flat, 2, group)
    splits = [0, chunk] if rank == 0 else [chunk, 0]
    with record_function(f"lightning_zero::{label}"):
        return dist.all_to_all_single(
            theirs, mine, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=async_op
        )


def all_reduce(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_reduce",
    control: bool = False,
):
    """In-place all-reduce of ``tensor`` over the group (``control``: counted as a control
    exchange, apart from the data bytes)."""
    size = _group_size(group)
    if local_only(size):
        return _Done() if async_op else None
    if counter is not None:
        sent = ring_sent("all_reduce", tensor.numel(), size)
        if control:
            counter.add_control(label, sent, tensor.element_size())
        else:
            counter.add(label, sent, tensor.element_size(), counter.link_of(group))
    with record_function(f"lightning_zero::{label}"):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_to_all",
):
    """Chunk ``r`` of ``input`` (split evenly along dim 0) goes to rank ``r``; chunk ``r`` of
    ``output`` comes from rank ``r``. Each rank sends ``(n-1)/n`` of ``input`` (its own chunk stays)."""
    return _chunked("all_to_all", dist.all_to_all_single, output, input, input, group, async_op, counter, label)


def ring_shift(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    step: int = 1,
    counter: Optional[CommCounter] = None,
    label: str = "ring_shift",
) -> torch.Tensor:
    """Every rank of ``group`` sends ``tensor`` to the rank ``step`` places after it in the group
    (cyclically) and returns what the rank ``step`` places before it sent (same shape and dtype):
    one hop of a ring. Each rank sends all of ``tensor``'s elements ([Note: logical bytes])."""
    size = _group_size(group)
    if local_only(size):
        return tensor.clone()
    rank = dist.get_rank(group)
    received = torch.empty_like(tensor)
    send = tensor.contiguous()
    if counter is not None:
        counter.add(label, float(send.numel()), send.element_size(), counter.link_of(group))
    peers = dist.get_process_group_ranks(group)
    ops = [
        dist.P2POp(dist.isend, send, peers[(rank + step) % size], group),
        dist.P2POp(dist.irecv, received, peers[(rank - step) % size], group),
    ]
    with record_function(f"lightning_zero::{label}"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: Optional[dist.ProcessGroup],
    *,
    async_op: bool = False,
    counter: Optional[CommCounter] = None,
    label: str = "all_to_all_v",
    control: bool = False,
):
    """Uneven all-to-all along dim 0: ``input_splits[r]`` rows of ``input`` go to rank ``r``,
    ``output_splits[r]`` rows of ``output`` come from rank ``r`` (zero-size splits allowed: every
    rank still takes part). Counted from the split sizes: the rows sent to *other* ranks, times
    the elements of a row ([Note: logical bytes]; the own split stays local); ``control``: counted
    as a control exchange, apart from the data bytes."""
    size = _group_size(group)
    if local_only(size):
        return _local(output, input, async_op)
    if counter is not None:
        row = math.prod(input.shape[1:])
        sent = (sum(input_splits) - input_splits[dist.get_rank(group)]) * row
        if control:
            counter.add_control(label, sent, input.element_size())
        else:
            counter.add(label, sent, input.element_size(), counter.link_of(group))
    with record_function(f"lightning_zero::{label}"):
        return dist.all_to_all_single(
            output, input, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group,
            async_op=async_op,
        )  # fmt: skip
