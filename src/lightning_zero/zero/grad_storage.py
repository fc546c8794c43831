"""Where gradients live between backward and the reduce-scatter: the one thing stages 1 and 2 do differently.

Where the gradients live between backward and the reduce-scatter is the one thing stages 1 and 2
do differently, and it lives in the two :class:`GradStorage` classes here:

- :class:`FullGradStorage` (stage 1, and stages 2-3 with ``defer_grad_reduce=True``: [Note: deferred
  gradient reduction] in ``zero/bucketing.py``): one persistent
  full-size gradient buffer per group; each parameter's gradient is added into it as it arrives
  (and ``param.grad`` dropped), so micro batches accumulate and nothing is communicated until the
  last one. The reduce-scatter runs in place: afterwards this rank's chunk of the buffer holds the
  reduced gradient. A bucket that gets more gradients after its reduction without a ``zero_grad``
  in between (two backwards before a step, e.g. a GAN's generator loss reaching the
  discriminator) is *re-armed* first: the parts other ranks own are zeroed and this rank's chunk
  is scaled back to the sum, so the next reduction yields the accumulated average.
- :class:`ShardedGradStorage` (stage 2): only the reduced gradient chunk per bucket persists.
  A gradient is copied into a bucket buffer taken from a small pool, ``param.grad`` is dropped at
  once, and the buffer goes back to the pool when its reduce-scatter finishes, so peak gradient
  memory is the chunk plus ``config.max_buckets_in_flight + 1`` bucket buffers (the ones in
  flight and the one filling: ``bucketing.pool_buffers``), each sized to the bucket it serves.
  The pool outlives a backward ([Note: the bucket pool outlives backward]); the model state is
  the chunks. Every backward (every micro batch) reduces; the chunk accumulates.

[Note: the bucket pool outlives backward] Stage 2/3's bucket buffers stay in the pool between
backwards and are released when the engine lets go of the module (``release``), as DeepSpeed keeps
its two ``reduce_bucket_size`` buffers. Handing them back after each backward costs nothing on
CUDA (the caching allocator keeps the blocks) but a lot on CPU: the allocator returns pages that
big to the OS, and the next backward's first copy into a fresh buffer faults every 4 KiB page in
again. On issue 24's 29.9M model that was 64 of stage 2's 110 ms of gradient hooks per step
(docs/benchmarks.md, session 9). The price is at most ``pool_buffers`` buckets held
through the optimizer step and the next forward, which the peak already held during backward
(the planner's "gradient buckets in flight"). ``grad_bytes`` stays the model state (the chunks);
``buffer_bytes`` is the pool.

[Note: gradients as bucket views] Stage 1 (:class:`FullGradStorage`) lets autograd write into the
buckets, as DDP's ``gradient_as_bucket_view``: before a backward (the engine's ``pre_backward``,
after its zero_grad check) each parameter's ``.grad`` becomes its slot of the bucket buffer, and
autograd's accumulation (``grad += new``) lands there, so the hook has nothing to copy. After a
bucket is reduced in place its buffer holds this rank's averaged chunk and stale sums elsewhere,
so its parameters' ``.grad`` go back to ``None`` (nobody reads a half-reduced gradient; clipping
and the optimizer use the masters). Whatever breaks the view falls back to the copy path, with
the same numbers: a user who sets ``param.grad = None`` (``model.zero_grad()``) gets a fresh
gradient from autograd, which the hook adds into the slot and drops, as before; a backward with
``create_graph=True`` replaces the view by ``view + new`` out of place, which the hook copies in;
buckets reduced and not zeroed since (two backwards before a step) are re-armed on their first
new gradient and get no view; fp32 buckets under bf16 compute (``reduce_dtype``) cannot be a
bf16 parameter's ``.grad``, so each gradient is added in, cast to fp32. Frozen parameters have no
slot; a tied parameter is one slot; reentrant checkpointing accumulates into the slot once per
segment. A ``zero_grad`` does not fill the buffer with zeros (a pass over every gradient byte,
after which autograd's ``grad += new`` reads it again): it marks the bucket *undefined*, and the
first backward after it copies each gradient into its slot (no views: autograd hands over a
fresh gradient and the hook copies it, one read and one write); only slots no gradient reached,
plus the padding, are zeroed, before launch or before views are installed for the next micro
batch, which accumulates in the views again. Stage 2's pool buffers exist only while a bucket
fills, so there the hook always copies the same way: the first gradient of a slot overwrites the
(never zero-filled) pool buffer, later ones add.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol

import torch

from lightning_zero.zero.bucketing import pool_buffers
from lightning_zero.zero.flat import BucketLayout, FlatParamGroup, ParamSlot

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig


class OldestFirst(Protocol):
    """The reducer as a storage sees it (``GradReducer``): it can complete its oldest in-flight bucket."""

    def complete_oldest(self) -> bool: ...


class PendingReduce(NamedTuple):
    """A launched reduce-scatter: where its result lands and the handle to wait on."""

    output: torch.Tensor
    work: Any


@dataclass(eq=False)  # identity: buckets hold tensors, and list.index/remove compare with ==
class Bucket:
    """Runtime state of one bucket: readiness, its full-size gradient and its in-flight work."""

    group: FlatParamGroup
    layout: BucketLayout
    grad_chunk: Optional[torch.Tensor] = None  # reduced gradient this rank owns (numel = shard)
    ready: int = 0  # parameters that received all their gradients in this backward
    launched: bool = False  # reduce-scatter started in this backward
    full_grad: Optional[torch.Tensor] = None  # full-size gradient while the bucket is filled
    pending: Optional[PendingReduce] = None
    chunk_is_fresh: bool = True  # next reduce overwrites the chunk instead of adding to it
    reduced_in_place: bool = False  # stage 1: the full buffer holds a reduced chunk (see re-arm)
    written_slots: set[int] = field(default_factory=set)  # slot offsets filled since the buffer was undefined
    undefined: bool = False  # stage 1: zero_grad left the buffer as it was; only written_slots hold gradients


def zero_unwritten(bucket: Bucket, full: torch.Tensor) -> None:
    """Zero the slots of ``full`` (``bucket``'s buffer) that are not in ``bucket.written_slots``,
    and the bucket's padding (slots are contiguous, padding only follows the last one)."""
    base = bucket.layout.start
    end = base
    for slot in bucket.layout.slots:
        if slot.offset not in bucket.written_slots:
            full[slot.offset - base : slot.end - base].zero_()
        end = max(end, slot.end)
    full[end - base :].zero_()


def grad_dtype(group: FlatParamGroup, reduce_in_fp32: bool) -> torch.dtype:
    """The dtype ``group``'s gradients are accumulated and reduced in: fp32 when asked
    (``reduce_dtype="fp32"``), else the group's compute dtype."""
    return torch.float32 if reduce_in_fp32 else group.compute_dtype


class GradStorage:
    """Where gradients live between backward and the reduce-scatter (see module docstring)."""

    reduces_every_backward: bool = False
    reduce_in_fp32: bool = False

    def install_grad_views(self) -> None:
        """Before a backward: let autograd write gradients into the buckets (where it can)."""

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

    def zero_grad(self, buckets: Optional[list[Bucket]] = None) -> None:
        raise NotImplementedError

    def grad_bytes(self) -> int:
        """The gradient model state this rank holds."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Working buffers beyond the model state (stage 2/3's bucket pool)."""
        return 0

    def release_buffers(self) -> None:
        """Free the working buffers (the model state stays)."""

    def release(self) -> None:
        """Free what this storage holds (the engine is done training: ``ZeroEngine.release_grads``)."""


class FullGradStorage(GradStorage):
    """Persistent full-size gradients that micro batches add into; in-place reduce-scatter.

    See [Note: gradients as bucket views]: where the buffer has the parameter's dtype, autograd
    accumulates each parameter's gradient straight into its slot (no copy).
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self.dp_size = 1
        self.reduce_in_fp32 = False  # set by GradReducer (``reduce_dtype``)
        self._views: dict[int, torch.Tensor] = {}  # param id -> its slot as a param-shaped view
        self._installed: set[int] = set()  # param ids whose .grad the engine set to their view

    def bind(self, buckets: list[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        for bucket in buckets:
            group = bucket.group
            if id(group) not in self.buffers:
                dtype = grad_dtype(group, self.reduce_in_fp32)
                self.buffers[id(group)] = torch.zeros(group.layout.numel, dtype=dtype, device=device)
            buffer = self.buffers[id(group)]
            start = bucket.layout.shard_start(group.dp_rank)
            bucket.grad_chunk = buffer[start : start + bucket.layout.shard_numel]
            for slot in bucket.layout.slots:
                slot.param.grad = None

    def _bucket_buffer(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers[id(bucket.group)][bucket.layout.start : bucket.layout.end]

    def _rearm(self, bucket: Bucket) -> None:
        """More gradients for an already reduced bucket: keep our chunk's sum, zero the rest."""
        if not bucket.reduced_in_place:
            return
        full = self._bucket_buffer(bucket)
        start = bucket.layout.shard_start(bucket.group.dp_rank) - bucket.layout.start
        full[:start].zero_()
        full[start + bucket.layout.shard_numel :].zero_()
        assert bucket.grad_chunk is not None
        bucket.grad_chunk.mul_(self.dp_size)  # the average back to the sum the next reduce adds to
        bucket.reduced_in_place = False

    def install_grad_views(self) -> None:
        """Before a backward: each parameter's ``.grad`` becomes its slot of the bucket buffer, so
        autograd accumulates there (see [Note: gradients as bucket views]). Skipped for buckets
        whose buffer holds a reduced chunk (re-armed on their next gradient instead) and where the
        buffer's dtype differs from the parameter's (``reduce_dtype="fp32"`` under bf16-mixed)."""
        for bucket in self.buckets:
            if bucket.reduced_in_place:
                continue
            buffer = self.buffers[id(bucket.group)]
            if buffer.dtype != bucket.group.compute_dtype:
                continue  # fp32 buckets under bf16 compute: each gradient is added in (cast)
            if bucket.undefined:
                if not bucket.written_slots:
                    continue  # right after a zero_grad: the hook copies each first gradient in
                self._define(bucket)  # a later micro batch: zero what no gradient reached, then views
            for slot in bucket.layout.slots:
                param = slot.param
                view = self._views.get(id(param))
                if view is None:
                    view = self._views[id(param)] = buffer[slot.offset : slot.end].view(slot.shape)
                if param.grad is not view:
                    if param.grad is not None:  # a gradient the engine has not seen: keep it
                        view.add_(param.grad.reshape(slot.shape))
                    param.grad = view
                self._installed.add(id(param))

    def on_param_ready(self, bucket: Bucket, slot: ParamSlot) -> None:
        grad = slot.param.grad
        view = self._views.get(id(slot.param))
        if view is not None and grad is view:
            return  # autograd accumulated into the bucket slot already
        installed = id(slot.param) in self._installed
        self._installed.discard(id(slot.param))
        self._rearm(bucket)
        target = self.buffers[id(bucket.group)][slot.offset : slot.end]
        if bucket.undefined and slot.offset not in bucket.written_slots:
            target.copy_(grad.detach().reshape(-1))  # first gradient since zero_grad: overwrites
            bucket.written_slots.add(slot.offset)
        elif installed and torch.is_grad_enabled():
            # create_graph=True: autograd replaced the installed view by ``view + new`` out of place.
            target.copy_(grad.detach().reshape(-1))
        else:
            target.add_(grad.detach().reshape(-1))
        slot.param.grad = None

    def _define(self, bucket: Bucket) -> None:
        """An undefined bucket (after ``zero_grad``) becomes whole: zero the slots no gradient
        reached and the padding."""
        if not bucket.undefined:
            return
        zero_unwritten(bucket, self._bucket_buffer(bucket))
        bucket.undefined = False
        bucket.written_slots.clear()

    def full_grad_for_launch(self, bucket: Bucket) -> torch.Tensor:
        self._rearm(bucket)
        self._define(bucket)
        return self._bucket_buffer(bucket)

    def after_reduce(self, bucket: Bucket) -> None:
        bucket.reduced_in_place = True
        # The buffer now holds this rank's reduced chunk and stale sums elsewhere: no parameter
        # shows it as its gradient (``install_grad_views`` puts the views back before the next
        # backward that may add to a zeroed bucket).
        self._drop_views(bucket)

    def _drop_views(self, bucket: Bucket) -> None:
        """No parameter of ``bucket`` keeps its slot as ``.grad`` (the buffer holds no gradient of it)."""
        for slot in bucket.layout.slots:
            self._installed.discard(id(slot.param))
            view = self._views.get(id(slot.param))
            if view is not None and slot.param.grad is view:
                slot.param.grad = None

    def zero_grad(self, buckets: Optional[list[Bucket]] = None) -> None:
        """No fill: the buckets become undefined, and their next gradients overwrite ([Note:
        gradients as bucket views])."""
        for bucket in self.buckets if buckets is None else buckets:
            bucket.reduced_in_place = False
            bucket.undefined = True
            bucket.written_slots.clear()
            self._drop_views(bucket)  # a view would show what the buffer held

    def grad_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

    def release(self) -> None:
        """Drop the full gradient buffers (stage 3's teardown: ``ZeroEngine.release_grads``)."""
        for bucket in self.buckets:
            self._drop_views(bucket)
            bucket.grad_chunk = None
        self._views.clear()
        self.buffers.clear()


class ShardedGradStorage(GradStorage):
    """Stage 2: persistent reduced chunks plus a bounded pool of bucket buffers, each sized to
    the bucket it serves (a buffer is reused for a bucket no larger than it)."""

    reduces_every_backward = True

    def __init__(self, config: "ZeroConfig") -> None:
        self.config = config  # reads max_buckets_in_flight: the pool holds one buffer more
        self.free: list[torch.Tensor] = []  # pool buffers not serving a bucket right now
        self.allocated = 0  # pool buffers that exist right now
        self.high_water = 0  # most pool buffers alive at once
        self.pool_bytes_high_water = 0  # most bytes of pool buffers alive at once
        self._alive_bytes = 0
        self.buckets: list[Bucket] = []
        self.chunk_bytes = 0
        self.max_bucket_numel = 0
        self.reducer: Optional[OldestFirst] = None
        self.reduce_in_fp32 = False  # set by GradReducer (``reduce_dtype``)

    @property
    def max_buffers(self) -> int:
        """The most pool buffers alive at once: ``pool_buffers(config.max_buckets_in_flight)``."""
        return pool_buffers(self.config.max_buckets_in_flight)

    def bind(self, buckets: list[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        self.device = device
        self.max_bucket_numel = max((b.layout.numel for b in buckets), default=0)
        for bucket in buckets:
            dtype = grad_dtype(bucket.group, self.reduce_in_fp32)
            bucket.grad_chunk = torch.zeros(bucket.layout.shard_numel, dtype=dtype, device=device)
            self.chunk_bytes += bucket.grad_chunk.numel() * bucket.grad_chunk.element_size()
        for bucket in buckets:
            for slot in bucket.layout.slots:
                slot.param.grad = None

    def _take_free(self, dtype: torch.dtype, numel: int) -> Optional[torch.Tensor]:
        fitting = [b for b in self.free if b.dtype == dtype and b.numel() >= numel]
        if not fitting:
            return None
        best = min(fitting, key=lambda b: b.numel())
        self.free = [b for b in self.free if b is not best]  # by identity: == on tensors compares values
        return best

    def _release(self, buffer: torch.Tensor) -> None:
        self._alive_bytes -= buffer.numel() * buffer.element_size()
        self.allocated -= 1

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        """A buffer for ``bucket``, not zeroed: every slot is written by its first gradient, and
        what no gradient wrote is zeroed just before launch (``zero_unwritten``)."""
        dtype, numel = grad_dtype(bucket.group, self.reduce_in_fp32), bucket.layout.numel
        buffer = self._take_free(dtype, numel)
        while buffer is None and self.allocated >= self.max_buffers:
            if self.free:  # free buffers of the wrong size: give one back, allocate the right size
                self._release(self.free.pop(0))
                break
            if self.reducer is None or not self.reducer.complete_oldest():
                break  # every buffer belongs to a bucket still being filled: allocate beyond the pool
            buffer = self._take_free(dtype, numel)
        if buffer is None:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self.allocated += 1
            self._alive_bytes += buffer.numel() * buffer.element_size()
            self.high_water = max(self.high_water, self.allocated)
            self.pool_bytes_high_water = max(self.pool_bytes_high_water, self._alive_bytes)
        return buffer[:numel]

    def _ensure_full_grad(self, bucket: Bucket) -> torch.Tensor:
        if bucket.full_grad is None:
            bucket.full_grad = self._acquire(bucket)
            bucket.written_slots.clear()
        return bucket.full_grad

    def on_param_ready(self, bucket: Bucket, slot: ParamSlot) -> None:
        full = self._ensure_full_grad(bucket)
        start = slot.offset - bucket.layout.start
        target = full[start : start + slot.numel]
        grad = slot.param.grad.detach().reshape(-1)
        if slot.offset in bucket.written_slots:
            target.add_(grad)  # another gradient for it in this backward (reentrant checkpointing)
        else:
            target.copy_(grad)  # first gradient: overwrites whatever the pool buffer held
            bucket.written_slots.add(slot.offset)
        slot.param.grad = None

    def full_grad_for_launch(self, bucket: Bucket) -> torch.Tensor:
        full = self._ensure_full_grad(bucket)
        zero_unwritten(bucket, full)
        return full

    def after_reduce(self, bucket: Bucket) -> None:
        full = bucket.full_grad
        bucket.full_grad = None
        bucket.written_slots.clear()
        if full is None:
            return
        self.free.append(full._base if full._base is not None else full)

    def after_sync(self) -> None:
        """Backward is over: the pool keeps its ``max_buffers`` largest buffers for the
        next one ([Note: the bucket pool outlives backward]); buffers allocated beyond it (a
        backward whose buckets filled out of order) go back to the allocator."""
        self.free.sort(key=lambda buffer: buffer.numel(), reverse=True)
        while len(self.free) > self.max_buffers:
            self._release(self.free.pop())

    def zero_grad(self, buckets: Optional[list[Bucket]] = None) -> None:
        for bucket in self.buckets if buckets is None else buckets:
            bucket.chunk_is_fresh = True

    def release_buffers(self) -> None:
        """Hand the pool back to the allocator (fit ended: [Note: the bucket pool outlives backward])."""
        for buffer in self.free:
            self._release(buffer)
        self.free.clear()

    def grad_bytes(self) -> int:
        """The gradient model state: the reduced chunks."""
        return self.chunk_bytes

    def buffer_bytes(self) -> int:
        """Bucket buffers alive now: filling, in flight, or kept in the pool."""
        return self._alive_bytes

    def release(self) -> None:
        """Drop the reduced chunks and the pool (no backward follows)."""
        self.release_buffers()
        for bucket in self.buckets:
            bucket.grad_chunk = None
        self.chunk_bytes = 0
