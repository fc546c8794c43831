"""Tokens per second and model FLOPs utilization (MFU) of a training run, in plain numbers.

[Note: throughput] :class:`ThroughputMeter` is fed, per micro batch, the ``(sequences, tokens per
sequence)`` this rank trained on, and told when an optimizer step ended. A step's time is the
wall time from the previous step's end (the first: from its first micro batch) to its own end, so
data loading, logging and everything between steps count, as they do for the user. On CUDA the
host runs ahead of the GPU only by a bounded queue (``loss.item()`` and logging wait for it), so
over several steps host time is the GPU's time; the summary therefore averages every step after
the first (which carries start-up costs).

- tokens/s per rank: tokens this rank trained on in the step / step time (under context
  parallelism its ``T/cp`` slice of each sequence);
- tokens/s in total: per rank x dp x cp, the tokens every rank together trained on: dp ranks take
  different samples (the distributed sampler gives each the same number of batches), the cp ranks
  of one dp rank different slices of the same samples (``T/cp`` tokens each), and the tp ranks of
  one group share their tokens (counted once). ``dp`` and ``cp`` come from the layout
  (``comm/mesh.py`` ``ParallelDims``), never from the size of the group ZeRO shards over (``dp x
  cp``, or a hybrid layout's shard group);
- MFU: the model's training FLOPs of the step on this rank (``planner.workload.training_flops``
  for a Llama-shaped config: matmuls and attention, recompute *not* counted; otherwise
  ``6 x parameters x tokens``) / step time / the hardware's peak FLOP/s for the precision
  (bf16 peak under bf16-mixed, fp32 under 32-true). Without a hardware config there is no MFU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

LLAMA_FIELDS = ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")


def batch_tokens(module: Any, batch: Any) -> tuple[int, int]:
    """``(sequences, tokens per sequence)`` of ``batch``: the module's own ``batch_tokens(batch)``
    if it has one, else the shape of the first 2-D integer tensor found in the batch (token ids),
    else ``(len of the first tensor, 1)``."""
    own = getattr(module, "batch_tokens", None)
    if callable(own):
        sequences, length = own(batch)
        return int(sequences), int(length)
    tensors = list(_tensors(batch))
    for tensor in tensors:
        if tensor.dim() == 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return int(tensor.shape[0]), int(tensor.shape[1])
    if tensors:
        return int(tensors[0].shape[0]) if tensors[0].dim() else 1, 1
    return 0, 0


def _tensors(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def training_flops_of(config: Any, num_params: int, sequences: int, length: int, tp: int = 1, cp: int = 1) -> float:
    """Model FLOPs of one forward + backward over ``sequences x length`` tokens on one tp rank;
    under context parallelism ``length`` is this rank's ``T/cp`` slice of each sequence (its
    attention runs over all ``T`` tokens with ``1/cp`` of the heads: ``planner.workload``)."""
    if config is not None and all(hasattr(config, name) for name in LLAMA_FIELDS):
        from lightning_zero.planner.workload import training_flops

        return training_flops(config, micro_batch=sequences, seq_len=length * cp, tp=tp, cp=cp)
    return 6.0 * num_params * sequences * length


@dataclass
class StepThroughput:
    """One optimizer step on one rank."""

    tokens: int
    seconds: float
    flops: float
    dp: int
    peak_flops: Optional[float]
    cp: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s_total(self) -> float:
        """Every rank's tokens together: dp ranks x the cp slices of each ([Note: throughput])."""
        return self.tokens_per_s * self.dp * self.cp

    def total_label(self) -> str:
        """What :attr:`tokens_per_s_total` counts, for a table."""
        if self.cp == 1:
            return f"total ({self.dp} dp ranks)"
        return f"total ({self.dp} dp ranks x {self.cp} cp ranks, each a 1/{self.cp} slice of the same samples)"

    @property
    def mfu(self) -> Optional[float]:
        if not self.peak_flops or self.seconds <= 0:
            return None
        return self.flops / self.seconds / self.peak_flops


@dataclass
class ThroughputMeter:
    """Collects :class:`StepThroughput` per optimizer step (see [Note: throughput]).

    Args:
        dp: data-parallel ranks: ranks that take different samples (``ParallelDims.dp``).
        peak_flops: the device's peak FLOP/s for the training precision (``None``: no MFU).
        clock: seconds, monotonic (tests pass a fake one).
        cp: context-parallel ranks: each trains on a ``1/cp`` slice of its dp rank's samples
            (tokens/s in total = per rank x dp x cp).
    """

    dp: int = 1
    peak_flops: Optional[float] = None
    clock: Any = time.perf_counter
    cp: int = 1
    steps: list[StepThroughput] = field(default_factory=list)
    _tokens: int = 0
    _flops: float = 0.0
    _since: Optional[float] = None

    def micro_batch(self, tokens: int, flops: float) -> None:
        """A micro batch of ``tokens`` (``flops`` of training) started or ran on this rank."""
        if self._since is None:
            self._since = self.clock()
        self._tokens += tokens
        self._flops += flops

    def step_end(self) -> StepThroughput:
        """The optimizer step ended: close it and start the next."""
        now = self.clock()
        since = now if self._since is None else self._since
        step = StepThroughput(self._tokens, now - since, self._flops, self.dp, self.peak_flops, self.cp)
        self.steps.append(step)
        self._tokens, self._flops, self._since = 0, 0.0, now
        return step

    def summary(self) -> Optional[StepThroughput]:
        """Every step after the first taken together (the first alone if there is only one)."""
        steady = self.steps[1:] or self.steps
        if not steady:
            return None
        return StepThroughput(
            sum(s.tokens for s in steady),
            sum(s.seconds for s in steady),
            sum(s.flops for s in steady),
            self.dp,
            self.peak_flops,
            self.cp,
        )


def peak_flops_for(hardware: Any, compute_dtype: torch.dtype) -> Optional[float]:
    """The hardware config's peak FLOP/s for ``compute_dtype`` (``None`` without a config)."""
    if hardware is None:
        return None
    from lightning_zero.planner.hardware import load_hardware

    config = load_hardware(hardware)
    return config.peak_fp32_flops if compute_dtype == torch.float32 else config.peak_bf16_flops


def hardware_for_device(device: torch.device) -> Optional[str]:
    """The ``conf/hardware`` config matching a CUDA device's name (H100, H200, A100), else ``None``."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for marker, config in (("H200", "h200_141gb"), ("H100", "h100_80gb"), ("A100", "a100_80gb")):
        if marker in name:
            return config
    return None
