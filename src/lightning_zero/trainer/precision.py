"""Precision plugins for ZeroStrategy (Lightning glue).

``ZeroStrategy`` swaps the plugin Lightning builds from ``Trainer(precision=...)`` for one of these:

- ``"32-true"`` -> :class:`ZeroPrecision`: fp32 parameters and gradients; the parameter chunk is
  its own master (4 + 4 + 8 bytes/param for Adam before sharding).
- ``"bf16-mixed"`` -> :class:`ZeroBf16Precision`: the engine keeps bf16 compute parameters and
  gradients and fp32 master + optimizer state only in the shards (2 + 2 + 12 bytes/param, the
  ZeRO paper's mixed-precision Adam); forward also runs under ``torch.autocast(bf16)`` so the ops
  autocast keeps in fp32 stay there.

Both route gradient clipping to the engine, which clips the sharded gradients by the *global*
norm (one all-reduce of the squared chunk norms) instead of each rank's local chunk.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


class _EngineClipping:
    """Clips the engine's sharded gradients; Lightning calls these from ``clip_gradients``."""

    engine: Any = None

    def _sharded(self, optimizer: Any):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch
        if self.engine is None:
            raise RuntimeError("lightning_zero: gradient clipping before the ZeRO engine was set up")
        return self.engine.sharded_optimizer(optimizer)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self._sharded(optimizer).clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        self._sharded(optimizer).clip_grad_value_(float(clip_val))


class ZeroPrecision(_EngineClipping, Precision):
    """fp32 training under ZeroStrategy."""

    precision = "32-true"
    compute_dtype = torch.float32


class ZeroBf16Precision(_EngineClipping, MixedPrecision):
    """bf16 compute parameters/gradients with fp32 master weights and optimizer state in the shards."""

    compute_dtype = torch.bfloat16

    def __init__(self, device: str = "cpu") -> None:
        MixedPrecision.__init__(self, precision="bf16-mixed", device=device)

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # The engine casts the parameters itself, after taking the fp32 master chunks from them.
        return module


def to_zero_precision(plugin: Optional[Precision]) -> Optional[Precision]:
    """Map Lightning's plugin for ``precision=...`` to ours, or raise naming the supported ones."""
    if plugin is None or isinstance(plugin, (ZeroPrecision, ZeroBf16Precision)):
        return plugin
    if type(plugin) is Precision:
        return ZeroPrecision()
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        return ZeroBf16Precision(device=plugin.device)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ZeroStrategy does not support precision={name!r} (supported: {', '.join(SUPPORTED_PRECISION)})."
        " Use precision='32-true' (fp32 params,"
        " grads and Adam state) or precision='bf16-mixed' (bf16 params and grads, fp32 master and"
        " optimizer state in the shards)."
    )
