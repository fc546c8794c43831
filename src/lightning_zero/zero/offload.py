"""Optimizer offload: the gradient chunks go to host memory once per step, the updated chunks back.

[Note: offload copies] With ``offload_optimizer=True`` each rank's fp32 master chunks and the
optimizer state made like them live in CPU memory; the optimizer steps there. Per optimizer step
and per chunk (one per bucket) exactly one device-to-host copy (the reduced gradient chunk) and
one host-to-device copy (the updated chunk) cross the bus:

- Device to host happens *once per optimizer step*, not per micro batch: the reducer hands the
  reduced gradient chunk over after every synchronized backward (stage 2 reduces every micro
  batch), and :meth:`OffloadCopies.stage` only remembers it; the copies are issued when the
  gradients are first read on the host (gradient clipping, or the optimizer step itself), all
  chunks back to back, in the gradient's own dtype (bf16 under bf16-mixed: half the bytes), and
  waited once. On CUDA they run on a side stream (which first waits for the compute stream that
  produced the gradients) into pinned host buffers, ``non_blocking``.
- Host to device: the updated master is copied into this rank's compute chunk with
  ``non_blocking=True`` from pinned memory (masters are pinned at engine build on CUDA); the
  parameter all-gather that follows is ordered after it by the stream. Before the next update
  writes the masters on the host, :meth:`OffloadCopies.before_host_update` waits for that copy.

``counts`` tells how many copies of each direction were issued (tests read it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.profiler import record_function

from lightning_zero.zero.flat import ChunkedParamGroup


def pin_masters(groups: list[ChunkedParamGroup], device: torch.device) -> None:
    """Pin the host master chunks of ``groups`` when the compute ``device`` is CUDA (the
    optimizer state torch creates like them stays pageable: the host reads it only)."""
    if device.type != "cuda":
        return
    for group in groups:
        for master in group.masters:
            if master.device.type == "cpu" and not master.is_pinned():
                master.data = master.data.pin_memory()


class OffloadCopies:
    """Device-to-host gradient copies (once per step) and host-to-device master copies of one
    sharded optimizer ([Note: offload copies])."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if self.cuda else None
        self.counts = {"device_to_host": 0, "host_to_device": 0}
        self._staged: dict[int, tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = {}  # master id -> ...
        self._host_grad: dict[int, torch.Tensor] = {}  # master id -> fp32 host gradient (persistent)
        self._landing: dict[int, torch.Tensor] = {}  # master id -> host buffer in the chunk's dtype
        self._to_device_done: Optional[torch.cuda.Event] = None

    def _buffer(self, cache: dict[int, torch.Tensor], master: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        buffer = cache.get(id(master))
        if buffer is None or buffer.dtype != dtype or buffer.shape != master.shape:
            buffer = torch.empty(master.shape, dtype=dtype, device="cpu", pin_memory=self.cuda)
            cache[id(master)] = buffer
        return buffer

    def stage(self, master: nn.Parameter, grad_chunk: torch.Tensor) -> None:
        """``grad_chunk`` (on the device) is ``master``'s gradient now; copy it to the host only
        when it is read (:meth:`flush`). ``master.grad`` becomes its persistent host buffer."""
        host = self._buffer(self._host_grad, master, master.dtype)
        self._staged[id(master)] = (master, grad_chunk, host)
        master.grad = host

    def flush(self) -> bool:
        """Issue every staged device-to-host copy and wait for them (one wait); False if none."""
        if not self._staged:
            return False
        staged = [item for item in self._staged.values() if item[0].grad is item[2]]  # zero_grad dropped the rest
        self._staged.clear()
        with record_function("lightning_zero::offload_grads_to_host"):
            landed = []
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    for master, chunk, host in staged:
                        landing = (
                            host if chunk.dtype == host.dtype else self._buffer(self._landing, master, chunk.dtype)
                        )
                        landing.copy_(chunk.detach(), non_blocking=True)
                        chunk.record_stream(self.stream)
                        landed.append((landing, host))
                    done = torch.cuda.Event()
                    done.record(self.stream)
                done.synchronize()
            else:
                for master, chunk, host in staged:
                    landing = host if chunk.dtype == host.dtype else self._buffer(self._landing, master, chunk.dtype)
                    landing.copy_(chunk.detach())
                    landed.append((landing, host))
            self.counts["device_to_host"] += len(staged)
            for landing, host in landed:
                if landing is not host:
                    host.copy_(landing)  # bf16 -> fp32 on the host
        return True

    def copy_masters_to_params(self, group: ChunkedParamGroup) -> None:
        """Write the updated host masters into this rank's compute chunks (non-blocking on CUDA)."""
        with record_function("lightning_zero::offload_masters_to_device"):
            for bucket, master in zip(group.layout.buckets, group.masters):
                shard = group.param_shard(bucket)
                source = master.detach()
                if self.cuda and shard.device.type == "cuda":
                    pinned = source.is_pinned()
                    if source.dtype == shard.dtype:
                        shard.copy_(source, non_blocking=pinned)
                    else:  # move in fp32, cast on the device
                        shard.copy_(source.to(shard.device, non_blocking=pinned))
                else:
                    shard.copy_(source)
                self.counts["host_to_device"] += 1
            if self.cuda:
                self._to_device_done = torch.cuda.Event()
                self._to_device_done.record(torch.cuda.current_stream(self.device))

    def before_host_update(self) -> None:
        """Wait until the last host-to-device copy read the masters (before the host changes them)."""
        if self._to_device_done is not None:
            self._to_device_done.synchronize()
            self._to_device_done = None
