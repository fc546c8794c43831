"""Gradient hooks -> buckets -> async reduce-scatter over dp; ``finish_backward()`` ends a backward.

This is the one place where gradients are reduced. The collective API is a pair, as in
Megatron-Core: buckets start their reduce-scatter as soon as every parameter in them has its
gradient (``overlap_comm=True``), or all at the end of backward (``overlap_comm=False``);
``finish_grad_sync()`` launches whatever is left, waits on every bucket in launch order, divides
by dp and hands each rank's fp32 gradient chunk to its master parameter.

[Note: end of backward] A backward ends once, whatever runs inside it. The first gradient of a
backward queues a callback on the autograd graph task it arrives in. Reentrant activation
checkpointing (``use_reentrant=True``) runs a *nested* backward per segment, and a callback
queued from inside one fires when that segment ends, not when the whole backward does; so the
callback first asks autograd which node is running (``torch._C._current_autograd_node()``): if
one is (we are nested inside it), it registers a post-hook on that outer node which re-queues
the callback on the outer graph task, and so on up to the outermost backward. Readiness counts
therefore never reset mid-backward. The strategy's ``post_backward`` calls
:meth:`GradReducer.finish_backward` as well, which is a no-op when the callback already
finished this backward and otherwise finishes it: a rank whose loss reached no trainable
parameter (no hook ever fired) still launches every bucket, with zeros, so its peers never wait
for it.

[Note: launch order] Every rank must issue the same collectives in the same order, even when a
parameter got no gradient on one rank. Buckets therefore launch strictly in one global order: a
bucket that is ready early waits for the ones before it; buckets with missing gradients launch at
the end of backward with zeros for the missing parameters. The first synchronized backward
launches in the order guessed from registration (reverse registration order) and *records* the
order its buckets actually completed in and how many gradients each parameter received
(reentrant checkpointing accumulates a parameter used in several segments several times). At its
end all ranks agree on dp rank 0's observed order and on the largest count per parameter (one
small all-reduce), as DDP rebuilds its buckets after the first iteration; later backwards launch
in that order, a bucket once each of its parameters received its learned number of gradients.
So a layer registered late but used first in forward no longer holds back every launch. (The
flat layout itself, i.e. which parameters share a bucket, stays the one from registration order.)

Where the gradients live between backward and the reduce-scatter (stage 1 vs 2) is
``zero/grad_storage.py``.

[Note: collectives in flight] A bucket's launch first waits for the oldest reduce-scatter still
in flight while ``config.max_buckets_in_flight`` of them are, in every stage.
Stage 2's pool bounds its bucket buffers the same way; for stage 1, whose buffers are the
gradients, the limit bounds the collectives themselves: on gloo each one holds a receive buffer
of up to its bucket's size ([Note: reduce-scatter on gloo] in ``collectives.py``) and runs on the
rank's core beside backward, and launching every bucket at once made stage 1's step erratic on
2 CPU ranks (the numbers: docs/benchmarks.md, stage 1's buckets in flight). On a device
(``waiter.poll`` off: NCCL) the reducer sets no limit of its own: there ``work.wait()`` makes the
compute stream wait for the collective, so a wait forced mid-backward stalls every later backward
kernel behind the oldest reduce-scatter, and stage 1 has no memory reason for it (its buffers are
the gradients). Stage 2's pool still bounds its buffers on a device (it completes the oldest bucket
when no buffer is free: that wait is the reuse of the buffer, and must order after the collective).

[Note: no waits inside backward under expert parallelism] A model whose backward runs collectives
of its own (expert parallelism's token all-to-alls) and whose gradients arrive in a data-dependent
order (an expert no token reached gets none) must never have the engine wait inside backward: a
rank that waits there for a bucket (the in-flight limit, stage 2's pool) waits for a peer that
launches that bucket only at the end of its backward, while the peer waits in the model's
all-to-all for this rank, which is stuck in the wait: a deadlock (seen on 2 gloo ranks). So with
an expert domain (``waits_in_backward = False``, set by the engine) every bucket launches when it is
ready, the pool allocates beyond its bound during backward, and the waits happen in
``finish_grad_sync``; the in-flight limit and the pool bound still hold outside backward. Memory
during backward is then up to one full-size buffer per bucket in flight (docs/topology.md).

[Note: markers off the host path] On a device the host must not read a collective's result
inside backward: ``.tolist()`` on a device tensor waits for every kernel queued before it, so the
launch queue would drain in the middle of every backward. The backward's phase marker is
therefore checked where the sync is already paid, in :meth:`GradReducer.finish_grad_sync` after
its launches and waits are issued, not at the first bucket wait (the marker all-reduce is ordered
before the buckets on NCCL's stream, so a marker that disagrees is still seen, and the host raises
there). On CPU (gloo) a bucket's wait blocks the host, so the marker is checked before the first
bucket wait, as before. ``tests/test_nccl_path.py`` counts host reads inside backward.

[Note: zero_grad detection] The engine does not patch ``optimizer.zero_grad``: Lightning (and
users) call it through wrappers. Instead, when a backward begins, the engine asks each sharded
optimizer whether the master gradients it handed out were dropped or changed in place since,
and resets the gradient storage of *that optimizer's* buckets only (``optA.zero_grad()`` leaves
optimizer B's accumulated gradients alone). Without a ``zero_grad``, gradients accumulate as
torch's do.

[Note: parameters nobody used] Under DDP a parameter that got no gradient on any rank keeps
``.grad = None`` (after ``zero_grad(set_to_none=True)``, torch's default) and the optimizer skips it:
no weight decay, no change to its moments or its step count. An MoE that skips idle experts or
LayerDrop makes such parameters. Here every rank reduce-scatters whole buckets (zeros for what it
did not use), so the reduced gradient alone cannot tell "unused" from "zero". The reducer
therefore records which parameters received a gradient on this rank since their optimizer's
gradients were last dropped (across micro batches), and each optimizer step agrees on it before
the update: the step's phase marker carries one int32 flag per parameter, reduced with MAX over
all of dp ([Note: phase markers] in ``agreements.py``). So the agreement adds no exchange of its own: ``4 P`` bytes for
``P`` parameters on a marker the step needs anyway, paid in every step (no rank can know without
asking that the others used everything), counted as control bytes
(``CommCounter.control_bytes``), apart from the gradient bytes. The optimizer steps one view per
parameter's owned run of a master chunk (``zero/optimizer.py``), so right before the update it
drops the gradient of each parameter no rank used and torch skips it exactly as under DDP, with
its own per-parameter step count; the reduced zeros it would have had leave gradient clipping's
norm unchanged.

Phase markers, which the used flags ride on: ``zero/agreements.py``.

[Note: one reducer module] Past 500 lines, most of it the Notes above: end-of-backward
detection, the learned launch order and the in-flight limit are one state machine over the same
bucket list and readiness counts, driven by the same hooks; split apart they would share all of
that state. What does not share it has left: storage (``grad_storage.py``), waiting
(``waits.py``), agreements (``agreements.py``).
Waiting on collectives (time limit, polling, a failing peer): ``zero/waits.py``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.comm.collectives import CommCounter, all_reduce, reduce_scatter
from lightning_zero.comm.compression import reduce_scatter_compressed
from lightning_zero.zero.agreements import PHASE_BACKWARD, PendingMarker, PhaseMarkers
from lightning_zero.zero.domains import domain_of, ep_shard_dim, shard_group
from lightning_zero.zero.flat import FlatParamGroup, ParamSlot
from lightning_zero.zero.grad_storage import Bucket, FullGradStorage, GradStorage, PendingReduce, ShardedGradStorage
from lightning_zero.zero.timeline import DeviceClock, Mark, SyncTimeline
from lightning_zero.zero.waits import Waiter

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.hybrid import HybridGradReduce

_BACKWARD_OF_FUNCTION = torch.autograd.function.BackwardCFunction.apply.__code__


def _inside_nested_backward() -> bool:
    """True inside a backward run from an autograd Function's backward (reentrant checkpointing)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _BACKWARD_OF_FUNCTION:
            return True
        frame = frame.f_back
    return False


def grad_reduce_op(backend: str, dtype: torch.dtype, divisor: int) -> tuple[dist.ReduceOp, bool]:
    """How to average gradients of ``dtype`` over ``divisor`` ranks on ``backend``: ``(op, divide_after)``.

    [Note: exact averaging] NCCL averages inside the collective (``ReduceOp.AVG``, NCCL >= 2.10):
    no extra pass over the reduced chunk. But for bf16/fp16 NCCL implements AVG as a pre-multiply
    of every input by ``1/n`` *rounded to the dtype*: for ``n`` not a power of two that factor is
    off (bf16's ``1/3`` is ``0.33398``, every gradient scaled by 1.002) and each value takes one
    more rounding before the sum. So AVG is used where ``1/n`` is exact in the dtype or the
    rounding is far below the sum's own (fp32, fp64), or ``n`` is a power of two (``1/n`` is
    exact in every float format); otherwise the reduce-scatter sums and the engine divides this
    rank's chunk by ``n`` afterwards, in the chunk's dtype (one correctly rounded division, as
    gloo always does: gloo has no AVG). Summing first cannot overflow bf16 (fp32's range); for
    fp16 an overflowing sum is an inf the loss scaler sees and skips, where AVG's bias would be
    silent. Pinned by ``tests/test_reducer_grad_path.py`` (``test_grad_reduce_op_rule``).

    [Note: fp16 pre-division] fp16 with ``n`` a power of two is the exception on gloo: there the
    reducer divides the bucket by ``n`` *before* the summing reduce-scatter (exact: a power of two
    only moves the exponent), which is what NCCL's AVG does for it. A sum of ``n`` values each at
    most ``65504 / n`` cannot overflow, so an fp16 reduction overflows exactly when some rank's
    own gradient did, as under ddp, whose fp32 buckets never overflow in the sum: the loss scale
    then skips the same steps on CPU and GPU as ddp does (docs/precision.md).
    """
    exact = dtype in (torch.float32, torch.float64) or (divisor & (divisor - 1)) == 0
    if str(backend).lower() == "nccl" and hasattr(dist.ReduceOp, "AVG") and exact:
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


class GradReducer:
    """Marks gradients ready, launches bucket reduce-scatters in order, waits and averages.

    Args:
        groups: the flat groups whose parameters this reducer owns.
        storage: :class:`FullGradStorage` (stage 1) or :class:`ShardedGradStorage` (stage 2).
        config: the knobs (``lightning_zero.config.ZeroConfig``); read here: ``overlap_comm``
            (the starting value of :attr:`overlap_comm`, which a dynamic stage-3 phase turns off),
            ``grad_comm_dtype`` (what the reduce-scatter sends, ``lightning_zero/comm/compression.py``;
            with ``hybrid`` only the hops that cross nodes, ``zero/hybrid.py``) and
            ``max_buckets_in_flight`` ([Note: collectives in flight]).
        dp_group: the data-parallel process group (``None``: the default group); the reducer
            averages over its size (over every replica's with ``hybrid``).
        counter: logical bytes sent are added here.
        param_order: registration position per parameter id: the launch order of the first
            backward (see [Note: launch order]).
        waiter: how a reduce-scatter is waited on (time limit, polling, the failure channel);
            see ``zero/waits.py``.
        hybrid: the replicate / hierarchical hops around the shard-group reduce-scatter
            (``zero/hybrid.py``); ``None``: ``dp_group`` is all of dp, one flat reduce-scatter.
        reduce_in_fp32: fp32 bucket buffers and chunks under a lower-precision compute dtype
            (``config.reduce_dtype="fp32"`` under bf16-mixed; the engine derives it).
    """

    def __init__(
        self,
        groups: list[FlatParamGroup],
        storage: GradStorage,
        config: "ZeroConfig",
        *,
        dp_group: Optional[dist.ProcessGroup],
        device: torch.device,
        counter: Optional[CommCounter] = None,
        param_order: Optional[dict[int, int]] = None,
        waiter: Optional[Waiter] = None,
        hybrid: Optional["HybridGradReduce"] = None,
        reduce_in_fp32: bool = False,
    ) -> None:
        self.config = config
        self.in_flight_high_water = 0  # most reduce-scatters in flight at once so far
        # [Note: no waits inside backward under expert parallelism]: the engine sets False
        self.waits_in_backward = True
        self.dp_group = dp_group
        dp_size = self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.hybrid = hybrid
        # Reduced gradients average over every dp rank: all replicas when sharding is hybrid.
        self.grad_divisor = hybrid.divisor if hybrid is not None else dp_size
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.device = device
        self.overlap_comm = config.overlap_comm  # state: launch_at_end_of_backward turns it off
        self.counter = counter if counter is not None else CommCounter()
        self.waiter = waiter if waiter is not None else Waiter(poll=device.type == "cpu")
        self.storage = storage
        storage.reduce_in_fp32 = reduce_in_fp32
        self._backend = dist.get_backend(dp_group) if dist.is_initialized() else "gloo"
        # several hops or compressed: SUM, divide once ([Note: exact averaging] otherwise)
        self._sum_then_divide = hybrid is not None or config.grad_comm_dtype is not None
        self.timeline = SyncTimeline(clock=DeviceClock(device))
        self.sync_enabled = True
        self.on_grads_reduced: list[Callable[[], None]] = []  # run after finish_grad_sync
        self.on_backward_begin: list[Callable[[], None]] = []  # run when a backward begins
        # Run by finish_backward before the remaining buckets launch (stage 3: flush_backward).
        self.before_final_launch: list[Callable[[], None]] = []
        self._absent: set[int] = set()  # param ids counted ready without a gradient (mark_absent)
        self.finished_backwards = 0  # backwards ended so far (see [Note: end of backward])
        self.learned_order = False
        self._backward_open = False
        self._autograd_running = False
        self._callback_armed = False
        self._hits: dict[int, int] = {}  # param id -> gradients received in this backward
        self._last_hit: dict[int, int] = {}  # param id -> sequence number of its last gradient
        self._hit_seq = 0
        self._expected_hits: dict[int, int] = {}  # learned; empty before the first sync
        self._nested_seen = False  # first backward: a gradient arrived in a nested backward

        buckets = [Bucket(group, layout) for group in groups for layout in group.layout.buckets]
        # [Note: parameters nobody used]: usage since the last drop, agreed in layout order.
        self._used: set[int] = set()  # param ids that got a gradient here since their last drop
        # [Note: phase markers] in agreements.py, over every dp rank of every replica; the used
        # flags ride on the step's marker.
        self.markers = PhaseMarkers(
            [slot for bucket in buckets for slot in bucket.layout.slots],
            self._used,
            expert_positions={  # [Note: expert domain] in zero/domains.py: ep flags per expert of its own
                id(slot.param): (domain.ep_size, domain.ep_rank)
                for bucket in buckets
                if (domain := domain_of(bucket.group)) is not None
                for slot in bucket.layout.slots
                if ep_shard_dim(slot.param) is None
            },
            group=hybrid.dp_group if hybrid is not None else dp_group,
            device=device,
            counter=counter,
            waiter=waiter,
        )
        self._phase_pending: Optional[PendingMarker] = None  # a backward's, launched with its first bucket
        self._layout_index = {id(bucket): i for i, bucket in enumerate(buckets)}
        # [Note: launch order]: before anything is learned, expected readiness = the
        # earliest-registered parameter in the bucket (its gradient comes last in backward).
        order = param_order or {}

        def expected_ready(bucket: Bucket) -> tuple[int, int]:
            first = min(order.get(id(s.param), 0) for s in bucket.layout.slots)
            return (-first, self._layout_index[id(bucket)])

        self.buckets = sorted(buckets, key=expected_ready)
        self._bucket_of_param: dict[int, tuple[Bucket, ParamSlot]] = {}
        for bucket in self.buckets:
            for slot in bucket.layout.slots:
                self._bucket_of_param[id(slot.param)] = (bucket, slot)
        self._next_launch = 0
        self._in_flight: list[Bucket] = []
        self._launch_times: dict[int, Mark] = {}
        if isinstance(storage, FullGradStorage):
            storage.dp_size = dp_size
        storage.bind(self.buckets, device)
        if isinstance(storage, ShardedGradStorage):
            storage.reducer = self
        self._handles: list[Any] = []
        self.add_hooks()

    # -- backward -------------------------------------------------------------------------------
    def _syncing(self) -> bool:
        return self.sync_enabled or self.storage.reduces_every_backward

    def _begin_backward(self) -> None:
        self._backward_open = True
        self._autograd_running = True  # until finish_backward: the model's own collectives may run
        self.timeline.clear()
        self._last_hit.clear()
        for callback in self.on_backward_begin:
            callback()

    def _arm_end_callback(self) -> None:
        self._callback_armed = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_graph_task_end)

    def _on_graph_task_end(self) -> None:
        """See [Note: end of backward]: finish only when the outermost backward ends."""
        outer = torch._C._current_autograd_node()
        if outer is not None:  # a nested (reentrant) backward ended inside the node ``outer``
            try:
                outer.register_hook(self._after_outer_node)
                return
            except (RuntimeError, AttributeError, TypeError):
                self._callback_armed = False  # the next gradient in the outer task re-arms
                return
        self._callback_armed = False
        if self._backward_open:
            self.finish_backward()

    def _after_outer_node(self, grad_inputs: Any, grad_outputs: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._on_graph_task_end)

    def begin_backward(self) -> None:
        """A backward reached this engine's parameters (idempotent). Stage 3 calls it from the first
        pre-backward hook of a unit, which runs in the outermost backward's graph task, so the
        end-of-backward callback is queued there (see [Note: end of backward])."""
        if not self._backward_open:
            self._begin_backward()
        if not self._callback_armed:
            self._arm_end_callback()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._backward_open:
            self._begin_backward()
        if not self._callback_armed:
            self._arm_end_callback()
        bucket, slot = self._bucket_of_param[id(param)]
        key = id(param)
        syncing = self._syncing()
        if key in self._absent:  # counted ready without a gradient, and one arrived after all
            self._absent.discard(key)
            bucket.ready -= 1
        if bucket.launched:
            raise RuntimeError(
                f"lightning_zero: parameter {slot.name!r} received another gradient in this backward after its"
                f" bucket's reduce-scatter was launched (it received {self._hits.get(key, 0)} before, as many as"
                f" the first backward taught: {self._expected_hits.get(key, 1)}). A parameter used in more"
                " reentrant-checkpoint segments than in the first step? Use"
                " torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or overlap_comm=False."
            )
        with record_function("lightning_zero::grad_ready"):
            self.storage.on_param_ready(bucket, slot)
        if not self.learned_order and not self._nested_seen:
            self._nested_seen = _inside_nested_backward()
        self._used.add(key)
        hits = self._hits.get(key, 0) + 1
        self._hits[key] = hits
        self._hit_seq += 1
        self._last_hit[key] = self._hit_seq
        if hits == self._expected_hits.get(key, 1) and (self.learned_order or hits == 1):
            bucket.ready += 1
        early = self.learned_order or not self._nested_seen
        if syncing and self.overlap_comm and early and bucket.ready == self._complete_count(bucket):
            self._launch_ready_in_order()

    def mark_absent(self, params: list[torch.Tensor]) -> None:
        """``params`` get no gradient in this backward on this rank (stage 3: their unit's backward
        was skipped here): count them ready with zero gradients, so their buckets launch where the
        other ranks launch them ([Note: skipped units and gradient buckets] in stage3/runtime.py).
        Does nothing outside a backward."""
        if not self._backward_open:
            return
        for param in params:
            key = id(param)
            if key not in self._bucket_of_param or key in self._hits or key in self._absent:
                continue
            bucket, _ = self._bucket_of_param[key]
            if bucket.launched:
                continue
            self._absent.add(key)
            bucket.ready += 1
        early = self.learned_order or not self._nested_seen  # the rule _on_grad_ready launches by
        if self._syncing() and self.overlap_comm and early:
            self._launch_ready_in_order()

    def launch_at_end_of_backward(self) -> None:
        """From now on launch every reduce-scatter once backward ended, as ``overlap_comm=False``
        (stage 3 in a dynamic phase: [Note: dynamic execution] in stage3/schedule.py)."""
        self.overlap_comm = False

    def _complete_count(self, bucket: Bucket) -> int:
        """Parameters that must be ready before ``bucket`` launches early (-1: never early).

        After learning, a bucket holding a parameter no rank saw a gradient for in the first
        backward only launches at the end of backward (its count is unknown).
        """
        if self.learned_order and any(self._expected_hits.get(id(s.param), 0) == 0 for s in bucket.layout.slots):
            return -1
        return len(bucket.layout.slots)

    def _launch_ready_in_order(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready != self._complete_count(bucket):
                return
            self._launch(bucket)

    def _reduce_rule(self, dtype: torch.dtype, bucket: Bucket) -> tuple[dist.ReduceOp, bool]:
        """``(op, divide_after)`` for ``bucket`` of ``dtype`` ([Note: exact averaging]). Expert
        buckets sum over their EDP group and are divided by ``dp * cp`` ([Note: expert domain]):
        an in-collective AVG would divide by the EDP group's size."""
        if self._sum_then_divide:
            return dist.ReduceOp.SUM, True
        if self._divides_before(dtype, bucket):
            return dist.ReduceOp.SUM, False
        if domain_of(bucket.group) is not None:
            return dist.ReduceOp.SUM, True
        return grad_reduce_op(self._backend, dtype, self.grad_divisor)

    def _divides_before(self, dtype: torch.dtype, bucket: Bucket) -> bool:
        """[Note: fp16 pre-division]: fp16, a power-of-two divisor, a plain SUM reduce-scatter."""
        n = self.grad_divisor
        if dtype != torch.float16 or self._sum_then_divide or n & (n - 1) or n == 1:
            return False
        return domain_of(bucket.group) is not None or grad_reduce_op(self._backend, dtype, n)[1]

    def _launch(self, bucket: Bucket) -> None:
        if self._next_launch == 0:  # [Note: phase markers]
            self._phase_pending = self.markers.start(PHASE_BACKWARD)
        # [Note: collectives in flight]: on a device no limit of the reducer's own
        while self.waiter.poll and self._may_wait() and len(self._in_flight) >= self.config.max_buckets_in_flight:
            self._complete(self._in_flight[0])
        full = self.storage.full_grad_for_launch(bucket)
        # In place: this rank's chunk of the full bucket receives the sum (NCCL and gloo allow it).
        start = bucket.layout.shard_start(bucket.group.dp_rank) - bucket.layout.start
        output = full[start : start + bucket.layout.shard_numel]
        group = shard_group(bucket.group, self.dp_group)  # [Note: expert domain]
        self.timeline.add("launch", self._layout_index[id(bucket)])
        if self.hybrid is not None and self.hybrid.hierarchical:  # [Note: hierarchical reduction]
            work = self.hybrid.launch_hierarchical(full, output)
        elif self.config.grad_comm_dtype is not None and self.hybrid is None:  # compressed: an all-to-all (any backend)
            work = reduce_scatter_compressed(
                output, full, group, self.config.grad_comm_dtype, async_op=True, counter=self.counter,
                label="reduce_scatter_grads",
            )  # fmt: skip
        else:
            if self._divides_before(full.dtype, bucket):  # [Note: fp16 pre-division]
                full.div_(self.grad_divisor)
            work = reduce_scatter(
                output,
                full,
                group,
                op=self._reduce_rule(full.dtype, bucket)[0],
                async_op=True,
                counter=self.counter,
                label="reduce_scatter_grads",
            )
        bucket.pending = PendingReduce(output, work)
        bucket.launched = True
        self._launch_times[id(bucket)] = self.timeline.mark()
        self._in_flight.append(bucket)
        self.in_flight_high_water = max(self.in_flight_high_water, len(self._in_flight))
        self._next_launch += 1

    def _complete(self, bucket: Bucket) -> None:
        assert bucket.pending is not None
        output, work = bucket.pending

        def waiting_on() -> str:
            position = self.buckets.index(bucket)
            return (
                f"the gradient reduce-scatter of bucket {position} (launch {position + 1} of {len(self.buckets)})"
                f" in backward {self.finished_backwards + 1} on dp rank {self.dp_rank}; this rank's progress:"
                f" {self.describe_progress()}"
            )

        if self._phase_pending is not None and self.waiter.poll:  # before any wait that could pair with another phase
            self._check_backward_marker(waiting_on)

        with record_function("lightning_zero::wait_reduce_scatter"):
            self.waiter.wait(work, waiting_on)
            if self.hybrid is not None:  # [Note: hybrid gradient reduction] in zero/hybrid.py

                def wait_hop(hop_work: Any, what: str) -> None:
                    self.waiter.wait(hop_work, lambda: f"{what}: {waiting_on()}")

                self.hybrid.finish(output, wait_hop)
        self.timeline.spans.append((self._launch_times.pop(id(bucket)), self.timeline.mark()))
        chunk = bucket.grad_chunk
        assert chunk is not None
        # reduced with SUM (gloo has no AVG; [Note: exact averaging]): divide this rank's chunk by dp;
        # with hybrid sharding by every dp rank of every replica (``grad_divisor``).
        divisor = self.grad_divisor if self._reduce_rule(output.dtype, bucket)[1] else 1
        if chunk.data_ptr() == output.data_ptr():
            if divisor != 1:
                chunk.div_(divisor)  # stage 1: the chunk is the reduced part of the full buffer
        elif bucket.chunk_is_fresh:
            if divisor != 1:
                torch.div(output, divisor, out=chunk)
            else:
                chunk.copy_(output)
        else:
            chunk.add_(output, alpha=1.0 / divisor)  # stage 2: accumulate micro batches
        bucket.chunk_is_fresh = False
        bucket.pending = None
        self.storage.after_reduce(bucket)
        self._in_flight.remove(bucket)

    def _check_backward_marker(self, waiting_on: Callable[[], str]) -> None:
        """Check the backward's phase marker ([Note: phase markers], [Note: markers off the host path])."""
        pending, self._phase_pending = self._phase_pending, None
        assert pending is not None
        self.markers.check(pending, lambda: f"the phase marker launched with {waiting_on()}")

    def _may_wait(self) -> bool:
        """Whether a wait for a bucket may happen now ([Note: no waits inside backward under expert
        parallelism])."""
        return self.waits_in_backward or not self._autograd_running

    def complete_oldest(self) -> bool:
        """Wait for the oldest in-flight bucket (frees its pool buffer); False if none is in flight
        or no wait may happen now (the pool then allocates beyond its bound)."""
        if not self._in_flight or not self._may_wait():
            return False
        self._complete(self._in_flight[0])
        return True

    def finish_backward(self) -> None:
        """End the current backward: finish the gradient sync (if this backward syncs) and reset
        readiness. Called by the end-of-backward callback and by the strategy's post-backward; a
        second call for the same backward does nothing (see [Note: end of backward]). With no
        backward open (no gradient reached this rank) it still runs the sync, with zeros."""
        if not self._backward_open:
            self._begin_backward()
        self._autograd_running = False
        self.timeline.add("backward_end", -1)
        if self._syncing():
            for callback in self.before_final_launch:
                callback()
            self.finish_grad_sync()
            if not self.learned_order:
                self._learn_order()
        self._reset_readiness()
        self._backward_open = False
        self.finished_backwards += 1

    def _reset_readiness(self) -> None:
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.launched = False
        self._hits.clear()
        self._absent.clear()
        self._nested_seen = False
        self._next_launch = 0

    def _learn_order(self) -> None:
        """Agree on the launch order and per-parameter gradient counts (see [Note: launch order]).

        Runs after the first synchronized backward's reduce-scatters, so every rank issues it at
        the same point: one all-reduce (MAX) of ``len(buckets) + num_params`` int64s, where dp
        rank 0 contributes the order its buckets completed in and every rank its gradient count
        per parameter.
        """
        unseen = self._hit_seq + 1
        observed = []
        for position, bucket in enumerate(self.buckets):
            seqs = [self._last_hit.get(id(s.param)) for s in bucket.layout.slots]
            observed.append((max(seqs) if all(q is not None for q in seqs) else unseen, position))
        proposal = [position for _, position in sorted(observed)]
        slots = [slot for bucket in self.buckets for slot in bucket.layout.slots]
        # Hybrid sharding: every replica must launch (and all-reduce) buckets in one order.
        order_group, order_rank = self.dp_group, self.dp_rank
        if self.hybrid is not None:
            order_group, order_rank = self.hybrid.dp_group, self.hybrid.dp_rank
        mine = torch.tensor(
            (proposal if order_rank == 0 else [-1] * len(proposal)) + [self._hits.get(id(s.param), 0) for s in slots],
            dtype=torch.int64,
            device=self.device,
        )
        with record_function("lightning_zero::agree_bucket_order"):
            work = all_reduce(mine, order_group, op=dist.ReduceOp.MAX, async_op=True)  # once: uncounted
            self.waiter.wait(
                work, lambda: f"the bucket-order agreement at the end of the first backward on dp rank {self.dp_rank}"
            )
        agreed = mine.tolist()
        order, counts = agreed[: len(proposal)], agreed[len(proposal) :]
        self._expected_hits = {id(slot.param): count for slot, count in zip(slots, counts)}
        self.buckets[:] = [self.buckets[position] for position in order]  # same list the storage holds
        self.learned_order = True

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all, average over dp.

        Safe to call twice: the second call finds nothing in flight and nothing left to launch.
        """
        with record_function("lightning_zero::finish_grad_sync"):
            while self._next_launch < len(self.buckets):
                self._launch(self.buckets[self._next_launch])
            while self._in_flight:
                self._complete(self._in_flight[0])
            if self._phase_pending is not None:  # a device: [Note: markers off the host path]
                self._check_backward_marker(lambda: f"the gradient sync of backward {self.finished_backwards + 1}")
        self.storage.after_sync()
        for callback in self.on_grads_reduced:
            callback()

    def install_grad_views(self) -> None:
        """Call before a backward (the engine's ``pre_backward`` does, after its zero_grad check):
        stage 1 points each parameter's ``.grad`` into its bucket slot ([Note: gradients as
        bucket views]); the other storages do nothing."""
        if not self._in_flight:
            self.storage.install_grad_views()

    def zero_grad(self, buckets: Optional[list[Bucket]] = None, *, dropped: bool = False) -> None:
        """Reset the gradients of ``buckets`` (default: all) before the next backward adds to them.
        ``dropped``: the optimizer's ``zero_grad`` set them to ``None``: their parameters count as
        unused again ([Note: parameters nobody used])."""
        if self._in_flight:
            raise RuntimeError(
                f"lightning_zero: zero_grad() called with {len(self._in_flight)} gradient"
                " reduce-scatters still in flight; finish_grad_sync() must run first"
                f" ({self.describe_progress()})."
            )
        targets = self.buckets if buckets is None else buckets
        self.storage.zero_grad(targets)
        if dropped:
            self._used.difference_update(id(slot.param) for bucket in targets for slot in bucket.layout.slots)
        for bucket in targets:
            bucket.chunk_is_fresh = True

    def describe_progress(self) -> str:
        parts = []
        for i, bucket in enumerate(self.buckets):
            state = "launched" if bucket.launched else "waiting"
            parts.append(f"{bucket.ready}/{len(bucket.layout.slots)} params ready in bucket {i} ({state})")
        return ", ".join(parts)

    def add_hooks(self) -> None:
        """Every parameter's gradient reaches the reducer when autograd accumulates it."""
        self._handles = [
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for bucket in self.buckets
            for slot in bucket.layout.slots
        ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take_grads(self, held: dict[Any, torch.Tensor]) -> None:
        """One backward whose gradients are ``held`` (parameter -> gradient; [Note: gradients handed
        in] in ``zero/engine.py``): each enters its bucket as the hook would have taken it (added to
        an installed view, else set as ``.grad``), then the backward ends, syncing if it syncs."""
        self._callback_armed = True  # no autograd graph task to end: finish_backward below ends it
        with torch.no_grad():
            for bucket in self.buckets:
                for slot in bucket.layout.slots:
                    grad = held.get(slot.param)
                    if grad is None:
                        continue
                    if slot.param.grad is None:
                        slot.param.grad = grad
                    else:
                        slot.param.grad.add_(grad)
                    self._on_grad_ready(slot.param)
        self._callback_armed = False
        self.finish_backward()
