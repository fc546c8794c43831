"""What one pipeline step moves and keeps, measured on real ranks: the point-to-point bytes each
rank sends and receives, and the bytes autograd saves per micro-batch and stage, with the most of
them alive at once. tests/test_pipeline.py holds these equal to ``pp/cost.py``'s rules (what the
planner prints); benchmarks/bench_pipeline.py times each rank's actions (``MeasuredStage.spans``) for the bubble.

[Note: counting pipeline bytes] Sends and receives are counted where torch's schedules get them:
:class:`CountingStage` is torch's ``PipelineStage`` with its four ``get_*_ops`` methods tallying
the tensors of the ``P2POp``s they return (every activation and gradient a schedule moves goes
through them; in-memory hand-offs between stages of one rank do not). Saved activations are
counted with ``saved_tensors_hooks``: each tensor autograd packs during a stage's forward (or the
loss the schedule computes right after the last stage's) is charged to that stage's micro-batch, once per storage, parameters and buffers aside; a
micro-batch's bytes stay alive until autograd lets go of what the hook packed. The hook packs a
detached alias: packing the tensor itself would hold its ``grad_fn`` (for a saved output, the node
saving it) and make a cycle that never frees (torch's ``saved_tensors_hooks`` warns of it), which
is what nodes run only by a zero-bubble schedule's input-gradient pass (``retain_graph=True``)
then did. The stages' parameter gradients (``.grad``, whole tensors) are counted beside them: the
most of both at once is what a rank holds between actions. torch's receive buffers are read off
the stages after a step (:func:`held_recv_buffers`, [Note: receive buffers] in ``pp/cost.py``).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_zero.pp.cost import RecvBuffers


class MeasuredStage(PipelineStage):
    """torch's ``PipelineStage`` counting the bytes of every send and receive it hands its
    schedule ([Note: counting pipeline bytes]) and timing each forward, backward and weight-gradient
    action it runs (``spans``: ``(start, end, kind)`` in ``time.perf_counter`` seconds).
    :meth:`reset` before the step to measure."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset()

    def reset(self) -> None:
        self.sent_bytes = self.received_bytes = 0
        self.spans: list[tuple[float, float, str]] = []
        self.before_action: list[Any] = []  # called before each forward, backward, weight gradient

    def _tally(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            if op.op is dist.isend:
                self.sent_bytes += op.tensor.nbytes
            else:
                self.received_bytes += op.tensor.nbytes
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tally(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tally(super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tally(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tally(super().get_bwd_recv_ops(bwd_chunk_id))

    def _timed(self, kind: str, run: Any) -> Any:
        for call in self.before_action:
            call()
        start = time.perf_counter()
        out = run()
        self.spans.append((start, time.perf_counter(), kind))
        return out

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", lambda: super(MeasuredStage, self).forward_one_chunk(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("B", lambda: super(MeasuredStage, self).backward_one_chunk(*args, **kwargs))

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("W", lambda: super(MeasuredStage, self).backward_weight_one_chunk(*args, **kwargs))


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a torch schedule runs on this rank (single- and multi-stage schedules)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def held_recv_buffers(stages: list[Any]) -> RecvBuffers:
    """The bytes of the receive buffers ``stages`` (torch ``PipelineStage``s) keep, and of the
    activation buffers' ``.grad``, each storage once."""
    seen: set[int] = set()

    def count(buffers: Any) -> int:
        total = 0
        for buffer in buffers:
            if buffer is not None and buffer.untyped_storage().data_ptr() not in seen:
                seen.add(buffer.untyped_storage().data_ptr())
                total += buffer.untyped_storage().nbytes()
        return total

    received = [info.buffer for stage in stages for infos in stage.args_recv_info.values() for info in infos]
    grads = [info.buffer for stage in stages for infos in stage.grad_recv_info.values() for info in infos]
    return RecvBuffers(
        count(received), count(grads), count(b.grad for b in received if b is not None and b.grad is not None)
    )


class _Packed:
    """What the pack hook hands autograd in place of a saved tensor; its death is autograd letting
    go of the tensor (:class:`SavedPerMicrobatch`)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedPerMicrobatch:
    """Bytes autograd saves per ``(stage, micro-batch)`` while active, and the most it holds at
    once on this rank ([Note: counting pipeline bytes]): each saved storage counts once per
    micro-batch, with the bytes of the largest view saved of it (a micro-batch's token ids are a
    view of the batch's), from the pack until autograd drops the last packed reference.
    ``stage_modules``: this rank's stage modules by stage index (each forward is one micro-batch,
    in order). :meth:`sample` is called before every action of a :class:`MeasuredStage`."""

    def __init__(self, stage_modules: dict[int, nn.Module]) -> None:
        self.exclude = {
            t.untyped_storage().data_ptr()
            for module in stage_modules.values()
            for t in [*module.parameters(), *module.buffers()]
        }
        self.saved: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)  # (stage, mb) -> storage -> bytes
        self.holders: dict[tuple[int, int, int], int] = {}  # (stage, mb, storage) -> packed references alive
        self.params = [param for module in stage_modules.values() for param in module.parameters()]
        self.peak_with_grads = 0
        self.forwards: dict[int, int] = defaultdict(int)
        self.current: Optional[tuple[int, int]] = None
        self.alive = 0
        self.peak_alive = 0
        self._handles = [
            module.register_forward_pre_hook(self._enter(stage)) for stage, module in stage_modules.items()
        ]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed.tensor)

    def _enter(self, stage: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.sample()
            self.current = (stage, self.forwards[stage])
            self.forwards[stage] += 1

        return hook

    def _pack(self, tensor: torch.Tensor) -> Any:
        # charged to the stage forward running, or the last one (the schedule's loss follows it)
        key = tensor.untyped_storage().data_ptr()
        if self.current is None or key in self.exclude:
            return _Packed(tensor.detach())
        stage, mb = self.current
        nbytes = tensor.numel() * tensor.element_size()
        held = self.saved[self.current]
        if key not in held:
            held[key] = nbytes
            self.alive += nbytes
        elif nbytes > held[key]:
            self.alive += nbytes - held[key]
            held[key] = nbytes
        packed = _Packed(tensor.detach())
        self.holders[(stage, mb, key)] = self.holders.get((stage, mb, key), 0) + 1
        weakref.finalize(packed, self._release, stage, mb, key)
        return packed

    def _release(self, stage: int, mb: int, key: int) -> None:
        self.holders[(stage, mb, key)] -= 1
        if self.holders[(stage, mb, key)] == 0:
            self.alive -= self.saved[(stage, mb)][key]

    def grad_bytes(self) -> int:
        """Bytes of the stages' parameter gradients that exist now."""
        return sum(param.grad.nbytes for param in self.params if param.grad is not None)

    def sample(self) -> None:
        self.peak_alive = max(self.peak_alive, self.alive)
        self.peak_with_grads = max(self.peak_with_grads, self.alive + self.grad_bytes())

    def bytes_of(self, stage: int, microbatch: int) -> int:
        return sum(self.saved[(stage, microbatch)].values())

    def __enter__(self) -> "SavedPerMicrobatch":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sample()  # after the last action
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
