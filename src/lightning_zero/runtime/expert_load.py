"""What MoE users look at, for the monitor: tokens per expert (min, mean, max per layer) and the
auxiliary losses, read without a device sync per step.

[Note: expert load without a sync] The model accumulates its routing counts and losses on the
device (``MoETransformer.take_moe_stats``). At a step's end :meth:`ExpertLoadMeter.step` starts a
non-blocking copy of them into pinned host memory and returns the figures of the *previous* step,
whose copy has finished (an event query, no wait) on CUDA; on CPU the copy is the read and the
figures are this step's. Loads are this rank's assignments (tokens x top-k routed by its own
micro-batches, before any capacity drop): the balance the router achieves on the data it sees.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class ExpertLoadMeter:
    """Turns ``take_moe_stats()`` device tensors into per-layer ``moe/`` metrics (see the note)."""

    def __init__(self) -> None:
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor, Any]] = None

    def step(self, stats: Optional[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """The figures to log now: this step's on CPU, the previous step's on CUDA (``{}`` at the
        first CUDA step, or when the model routed nothing)."""
        ready = self._pending
        self._pending = None
        if stats is not None:
            load, aux = stats
            if load.is_cuda:
                host_load = torch.empty(load.shape, dtype=load.dtype, pin_memory=True)
                host_aux = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True)
                host_load.copy_(load, non_blocking=True)
                host_aux.copy_(aux, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                self._pending = (host_load, host_aux, done)
            else:
                ready = (load, aux, None)
        if ready is None:
            return {}
        load, aux, done = ready
        if done is not None and not done.query():  # not finished yet: keep it for the next step
            self._pending = self._pending or ready
            return {}
        return expert_load_metrics(load, aux)


def expert_load_metrics(load: torch.Tensor, aux: torch.Tensor) -> dict[str, float]:
    """``moe/layer<i>/tokens_{min,mean,max}`` per MoE layer (assignments per expert) and
    ``moe/balance_loss``, ``moe/z_loss`` (summed over layers, averaged over micro-batches)."""
    metrics: dict[str, float] = {}
    for layer, counts in enumerate(load.tolist()):
        metrics[f"moe/layer{layer}/tokens_min"] = float(min(counts))
        metrics[f"moe/layer{layer}/tokens_mean"] = float(sum(counts) / len(counts))
        metrics[f"moe/layer{layer}/tokens_max"] = float(max(counts))
    balance, z = aux.tolist()
    metrics["moe/balance_loss"] = float(balance)
    metrics["moe/z_loss"] = float(z)
    return metrics
