"""Gradient hooks -> buckets -> async reduce-scatter over dp; ``finish_grad_sync()`` waits.

This is the one place where gradients are reduced. The collective API is a pair, as in
Megatron-Core: buckets start their reduce-scatter as soon as every parameter in them has its
gradient (``overlap_comm=True``), or all at the end of backward (``overlap_comm=False``);
``finish_grad_sync()`` (queued to run when autograd's backward ends) launches whatever is left,
waits on every bucket in launch order, divides by dp and hands each rank's fp32 gradient chunk to
its master parameter.

[Note: launch order] Every rank must issue the same collectives in the same order, even when a
parameter got no gradient on one rank. Buckets therefore launch strictly in a fixed global order
(the order their last gradient is expected in backward): a bucket that is ready early waits for
the ones before it. Buckets with missing gradients launch at the end of backward with zeros for
the missing parameters, so unused parameters never hang a step.

Where the gradients live between backward and the reduce-scatter is the one thing stages 1 and 2
do differently, and it lives in the two :class:`GradStorage` classes below:

- :class:`FullGradStorage` (stage 1, and stage 2 with ``defer_grad_reduce=True``): one persistent
  full-size gradient buffer per group; each parameter's gradient is added into it as it arrives
  (and ``param.grad`` dropped), so micro batches accumulate and nothing is communicated until the
  last one. The reduce-scatter runs in place: afterwards this rank's chunk of the buffer holds the
  reduced gradient.

[Note: zero_grad detection] The engine does not patch ``optimizer.zero_grad``: Lightning (and
users) call it through wrappers. Instead, at the first gradient of a backward that follows a
sync, the reducer asks ``grads_were_zeroed()`` (the engine checks whether the master chunks'
``.grad`` were set to None or changed in place since it handed them out) and, if so, resets the
gradient storage before adding anything. Without a ``zero_grad``, gradients accumulate as torch's
do.
- :class:`ShardedGradStorage` (stage 2): only the reduced gradient chunk per bucket persists.
  A gradient is copied into a full-size bucket buffer taken from a small pool, ``param.grad`` is
  dropped at once, and the bucket buffer goes back to the pool when its reduce-scatter finishes,
  so peak gradient memory is the chunk plus ``max_buckets_in_flight`` bucket buffers; once
  backward ends the pool is released, so between steps only the chunks remain. Every backward
  (every micro batch) reduces; the chunk accumulates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.collectives import CommCounter, reduce_scatter
from lightning_zero.zero.flat import BucketLayout, FlatParamGroup, ParamSlot


class PendingReduce(NamedTuple):
    """A launched reduce-scatter: where its result lands and the handle to wait on."""

    output: torch.Tensor
    work: Any


@dataclass
class Bucket:
    """Runtime state of one bucket: readiness, its full-size gradient and its in-flight work."""

    group: FlatParamGroup
    layout: BucketLayout
    grad_chunk: Optional[torch.Tensor] = None  # reduced gradient this rank owns (numel = shard)
    ready: int = 0
    full_grad: Optional[torch.Tensor] = None  # full-size gradient while the bucket is filled
    pending: Optional[PendingReduce] = None
    chunk_is_fresh: bool = True  # next reduce overwrites the chunk instead of adding to it


class GradStorage:
    """Where gradients live between backward and the reduce-scatter (see module docstring)."""

    reduces_every_backward: bool = False

    def bind(self, buckets: list[Bucket], device: torch.device) -> None:
        raise NotImplementedError

    def on_param_ready(self, bucket: Bucket, slot: ParamSlot) -> None:
        raise NotImplementedError

    def full_grad_for_launch(self, bucket: Bucket) -> torch.Tensor:
        raise NotImplementedError


    def after_reduce(self, bucket: Bucket) -> None:
        pass

    def after_sync(self) -> None:
        pass

    def zero_grad(self) -> None:
        raise NotImplementedError

    def grad_bytes(self) -> int:
        raise NotImplementedError


class FullGradStorage(GradStorage):
    """Persistent full-size gradients that micro batches add into; in-place reduce-scatter."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self.reduced_since_zero = False

    def bind(self, buckets: list[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        for bucket in buckets:
            group = bucket.group
            if id(group) not in self.buffers:
                self.buffers[id(group)] = torch.zeros(
                    group.layout.numel, dtype=group.compute_dtype, device=device
                )
            buffer = self.buffers[id(group)]
            start = bucket.layout.shard_start(group.dp_rank)
            bucket.grad_chunk = buffer[start : start + bucket.layout.shard_numel]
            for slot in bucket.layout.slots:
                slot.param.grad = None

    def on_param_ready(self, bucket: Bucket, slot: ParamSlot) -> None:
        if self.reduced_since_zero:
            raise RuntimeError(
                "lightning_zero: a synchronized backward ran after the gradients of this step were"
                " already reduce-scattered (stage 1 reduces in place). Call optimizer.step() and"
                " optimizer.zero_grad() in between, or run the earlier micro batches inside"
                " `strategy.block_backward_sync()` (Lightning's accumulate_grad_batches does this)."
            )
        buffer = self.buffers[id(bucket.group)]
        buffer[slot.offset : slot.end].add_(slot.param.grad.reshape(-1))
        slot.param.grad = None

    def full_grad_for_launch(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers[id(bucket.group)][bucket.layout.start : bucket.layout.end]

    def after_reduce(self, bucket: Bucket) -> None:
        self.reduced_since_zero = True

    def zero_grad(self) -> None:
        for buffer in self.buffers.values():
            buffer.zero_()
        self.reduced_since_zero = False

    def grad_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())


class ShardedGradStorage(GradStorage):
    """Stage 2: persistent reduced chunks plus a bounded pool of full-size bucket buffers."""

    reduces_every_backward = True

    def __init__(self, max_buckets_in_flight: int = 2) -> None:
        if max_buckets_in_flight < 1:
            raise ValueError(f"max_buckets_in_flight must be >= 1, got {max_buckets_in_flight}")
        self.max_buckets_in_flight = max_buckets_in_flight
        self.free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.allocated = 0  # pool buffers that exist right now
        self.high_water = 0  # most pool buffers alive at once
        self.pool_bytes_high_water = 0
        self._alive_bytes = 0
        self.buckets: list[Bucket] = []
        self.chunk_bytes = 0
        self.reducer: Optional["GradReducer"] = None

    def bind(self, buckets: list[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        self.device = device
        self.max_bucket_numel = max((b.layout.numel for b in buckets), default=0)
        for bucket in buckets:
            bucket.grad_chunk = torch.zeros(
                bucket.layout.shard_numel, dtype=bucket.group.compute_dtype, device=device
            )
            self.chunk_bytes += bucket.grad_chunk.numel() * bucket.grad_chunk.element_size()
        for bucket in buckets:
            for slot in bucket.layout.slots:
                slot.param.grad = None

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        dtype = bucket.group.compute_dtype
        key = (dtype, self.max_bucket_numel)
        while not self.free.get(key) and self.allocated >= self.max_buckets_in_flight:
            if self.reducer is None or not self.reducer.complete_oldest():
                break  # every buffer belongs to a bucket still being filled: allocate beyond the pool
        if self.free.get(key):
            buffer = self.free[key].pop()
        else:
            buffer = torch.empty(self.max_bucket_numel, dtype=dtype, device=self.device)
            self.allocated += 1
            self._alive_bytes += buffer.numel() * buffer.element_size()
            self.high_water = max(self.high_water, self.allocated)
            self.pool_bytes_high_water = max(self.pool_bytes_high_water, self._alive_bytes)
        view = buffer[: bucket.layout.numel]
        view.zero_()
        return view

    def _ensure_full_grad(self, bucket: Bucket) -> torch.Tensor:
        if bucket.full_grad is None:
            bucket.full_grad = self._acquire(bucket)
        return bucket.full_grad

    def on_param_ready(self, bucket: Bucket, slot: ParamSlot) -> None:
        full = self._ensure_full_grad(bucket)
        start = slot.offset - bucket.layout.start
        full[start : start + slot.numel].copy_(slot.param.grad.reshape(-1))
        slot.param.grad = None

    def full_grad_for_launch(self, bucket: Bucket) -> torch.Tensor:
        return self._ensure_full_grad(bucket)

    def after_reduce(self, bucket: Bucket) -> None:
        full = bucket.full_grad
        bucket.full_grad = None
        if full is None:
            return
        base = full._base if full._base is not None else full
        self.free.setdefault((base.dtype, base.numel()), []).append(base)

    def after_sync(self) -> None:
        """Backward is over: hand the bucket buffers back to the allocator (only chunks persist)."""
        for buffers in self.free.values():
            for buffer in buffers:
                self._alive_bytes -= buffer.numel() * buffer.element_size()
                self.allocated -= 1
        self.free.clear()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.chunk_is_fresh = True

    def grad_bytes(self) -> int:
        return self.chunk_bytes + self._alive_bytes


@dataclass
class SyncTimeline:
    """What happened during the last backward, in order (for overlap checks and the monitor).

    ``comm_s`` sums each bucket's collective time, from its launch to the end of its wait.
    ``hidden_s`` is the part of it that ran before backward ended (overlapped with backward
    compute); ``exposed_s = comm_s - hidden_s``. With ``overlap_comm=False`` every launch comes
    after backward ends, so all of it is exposed.
    """

    events: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, bucket, time)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (launch, done) per bucket
    backward_end: Optional[float] = None

    def add(self, kind: str, bucket: int) -> None:
        now = time.perf_counter()
        self.events.append((kind, bucket, now))
        if kind == "backward_end":
            self.backward_end = now

    def clear(self) -> None:
        self.events.clear()
        self.spans.clear()
        self.backward_end = None

    @property
    def comm_s(self) -> float:
        return sum(done - launch for launch, done in self.spans)

    @property
    def hidden_s(self) -> float:
        end = self.backward_end
        if end is None:
            return 0.0
        return sum(max(0.0, min(done, end) - launch) for launch, done in self.spans)

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.hidden_s

    def index_of(self, kind: str) -> int:
        for i, event in enumerate(self.events):
            if event[0] == kind:
                return i
        return -1


class GradReducer:
    """Marks gradients ready, launches bucket reduce-scatters in order, waits and averages.

    Args:
        groups: the flat groups whose parameters this reducer owns.
        storage: :class:`FullGradStorage` (stage 1) or :class:`ShardedGradStorage` (stage 2).
        dp_group: the data-parallel process group (``None``: the default group).
        overlap_comm: launch each bucket as soon as it is ready (``True``) or only once backward
            ended (``False``).
        counter: logical bytes sent are added here.
    """

    def __init__(
        self,
        groups: list[FlatParamGroup],
        storage: GradStorage,
        *,
        dp_group: Optional[dist.ProcessGroup],
        dp_size: int,
        device: torch.device,
        overlap_comm: bool = True,
        counter: Optional[CommCounter] = None,
        param_order: Optional[dict[int, int]] = None,
    ) -> None:
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.overlap_comm = overlap_comm
        self.counter = counter if counter is not None else CommCounter()
        self.storage = storage
        self.timeline = SyncTimeline()
        self.sync_enabled = True
        self._callback_queued = False
        self.on_grads_reduced: list = []  # callbacks run after finish_grad_sync
        self.grads_were_zeroed = lambda: True  # set by the engine, see [Note: zero_grad detection]
        self._synced_since_reset = False

        buckets = [Bucket(group, layout) for group in groups for layout in group.layout.buckets]
        # [Note: launch order]: expected readiness = the earliest-registered parameter in the
        # bucket (its gradient comes last in backward). Later-registered buckets launch first.
        order = param_order or {}

        def expected_ready(bucket: Bucket) -> tuple[int, int]:
            first = min(order.get(id(s.param), 0) for s in bucket.layout.slots)
            return (-first, bucket.layout.index)

        self.buckets = sorted(buckets, key=expected_ready)
        self._bucket_of_param: dict[int, tuple[Bucket, ParamSlot]] = {}
        for bucket in self.buckets:
            for slot in bucket.layout.slots:
                self._bucket_of_param[id(slot.param)] = (bucket, slot)
        self._next_launch = 0
        self._in_flight: list[Bucket] = []
        self._launch_times: dict[int, float] = {}
        storage.bind(self.buckets, device)
        if isinstance(storage, ShardedGradStorage):
            storage.reducer = self
        self._handles = [
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for bucket in self.buckets
            for slot in bucket.layout.slots
        ]

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """A backward started: queue the end-of-sync on it (idempotent). Stage 3 calls this from
        the first hook that sees the outermost backward, so a reentrant checkpoint's nested
        backward (where the first gradient may arrive) never ends the sync early."""
        if not self._callback_queued:
            self._callback_queued = True
            self.timeline.clear()
            if self._synced_since_reset and self.grads_were_zeroed():
                self.zero_grad()
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.begin_backward()
        bucket, slot = self._bucket_of_param[id(param)]
        syncing = self.sync_enabled or self.storage.reduces_every_backward
        with record_function("lightning_zero::grad_ready"):
            self.storage.on_param_ready(bucket, slot)
        bucket.ready += 1
        if syncing and self.overlap_comm and bucket.ready == len(bucket.layout.slots):
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.layout.slots):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        full = self.storage.full_grad_for_launch(bucket)
        # In place: this rank's chunk of the full bucket receives the sum (NCCL and gloo allow it).
        start = bucket.layout.shard_start(bucket.group.dp_rank) - bucket.layout.start
        output = full[start : start + bucket.layout.shard_numel]
        self.timeline.add("launch", self._next_launch)
        work = reduce_scatter(
            output, full, self.dp_group, async_op=True, counter=self.counter, label="reduce_scatter_grads"
        )
        bucket.pending = PendingReduce(output, work)
        self._launch_times[id(bucket)] = time.perf_counter()
        self._in_flight.append(bucket)
        self._next_launch += 1

    def _complete(self, bucket: Bucket) -> None:
        assert bucket.pending is not None
        output, work = bucket.pending
        with record_function("lightning_zero::wait_reduce_scatter"):
            work.wait()
        self.timeline.spans.append((self._launch_times.pop(id(bucket)), time.perf_counter()))
        chunk = bucket.grad_chunk
        assert chunk is not None
        # gloo has no AVG: reduce with SUM, then divide this rank's chunk by dp.
        if chunk.data_ptr() == output.data_ptr():
            chunk.div_(self.dp_size)  # stage 1: the chunk is the reduced part of the full buffer
        elif bucket.chunk_is_fresh:
            torch.div(output, self.dp_size, out=chunk)
        else:
            chunk.add_(output, alpha=1.0 / self.dp_size)  # stage 2: accumulate micro batches
        bucket.chunk_is_fresh = False
        bucket.pending = None
        self.storage.after_reduce(bucket)
        self._in_flight.remove(bucket)

    def complete_oldest(self) -> bool:
        """Wait for the oldest in-flight bucket (frees its pool buffer); False if none is in flight."""
        if not self._in_flight:
            return False
        self._complete(self._in_flight[0])
        return True

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self.timeline.add("backward_end", -1)
        if self.sync_enabled or self.storage.reduces_every_backward:
            self.finish_grad_sync()
        self._reset_readiness()

    def _reset_readiness(self) -> None:
        for bucket in self.buckets:
            bucket.ready = 0
        self._next_launch = 0

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all, average over dp.

        Safe to call twice: the second call finds nothing in flight and nothing left to launch.
        """
        with record_function("lightning_zero::finish_grad_sync"):
            while self._next_launch < len(self.buckets):
                self._launch(self.buckets[self._next_launch])
            while self._in_flight:
                self._complete(self._in_flight[0])
        self.storage.after_sync()
        self._synced_since_reset = True
        for callback in self.on_grads_reduced:
            callback()

    def zero_grad(self) -> None:
        if self._in_flight:
            raise RuntimeError(
                f"lightning_zero: zero_grad() called with {len(self._in_flight)} gradient"
                " reduce-scatters still in flight; finish_grad_sync() must run first"
                f" ({self.describe_progress()})."
            )
        self.storage.zero_grad()
        for bucket in self.buckets:
            bucket.chunk_is_fresh = True
        self._synced_since_reset = False

    def describe_progress(self) -> str:
        parts = [f"{b.ready}/{len(b.layout.slots)} params ready in bucket {i}" for i, b in enumerate(self.buckets)]
        return ", ".join(parts)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
