"""Precision plugins for ZeroStrategy (Lightning glue).

``ZeroStrategy`` swaps the plugin Lightning builds from ``Trainer(precision=...)`` (or the one
passed in ``plugins=[...]``) for one of these; each carries the
:class:`~lightning_zero.runtime.precision.PrecisionPolicy` the engine is built from (where each
byte lives: ``runtime/precision.py``, docs/precision.md):

- ``Precision`` (``"32-true"``) -> :class:`ZeroPrecision`: fp32 parameters and gradients; the
  parameter chunk is its own master (4 + 4 + 8 bytes/param for Adam before sharding).
- ``MixedPrecision("bf16-mixed" | "16-mixed")`` -> :class:`ZeroMixedPrecision`: the engine keeps
  half-precision compute parameters and gradients and fp32 master + optimizer state only in the
  shards (2 + 2 + 12 bytes/param, the ZeRO paper's mixed-precision Adam); forward also runs under
  ``torch.autocast`` so the ops autocast keeps in fp32 stay there. ``16-mixed`` adds the user's
  dynamic loss scaler, whose skip decision is global.
- ``HalfPrecision("bf16-true" | "16-true")`` -> :class:`ZeroHalfPrecision`: the module is
  converted to the half dtype as under ddp, and the optimizer steps the half-precision chunks
  (2 + 2 + 4 bytes/param), or fp32 masters with ``ZeroStrategy(master_weights="fp32")``.

Every one routes gradient clipping to the engine, which clips the sharded gradients by the
*global* norm (one all-reduce of the squared chunk norms) instead of each rank's local chunk.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_zero.runtime.precision import PRECISIONS, PrecisionPolicy, precision_policy, unscale_and_agree

SUPPORTED_PRECISION = PRECISIONS


class _EngineClipping:
    """Clips the engine's sharded gradients; Lightning calls these from ``clip_gradients``."""

    engine: Any = None
    policy: PrecisionPolicy

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

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

    def __init__(self) -> None:
        self.policy = precision_policy("32-true")


class ZeroMixedPrecision(_EngineClipping, MixedPrecision):
    """bf16/fp16 compute parameters and gradients under autocast, with fp32 master weights and
    optimizer state in the shards.

    ``16-mixed`` keeps Lightning's loss scaling with the user's ``torch.amp.GradScaler`` (its
    ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``; its state is the
    plugin's ``state_dict``, saved in checkpoints and restored on resume), in GradScaler's order:
    the loss is scaled before backward; after it, the scaler unscales this rank's fp32 gradient
    shards and finds its inf/NaN; the ranks agree whether *any* shard overflowed ([Note: global
    overflow] in ``zero/optimizer.py``: one int32 on the step's phase marker, no extra collective);
    then gradient clipping (global norm, of unscaled gradients), ``scaler.step`` (which skips
    the update on every rank alike) and ``scaler.update`` (growth or backoff).
    """

    def __init__(self, precision: str = "bf16-mixed", device: str = "cpu", scaler: Optional[Any] = None) -> None:
        MixedPrecision.__init__(self, precision=precision, device=device, scaler=scaler)  # type: ignore[arg-type]
        self.policy = precision_policy(precision)
        self.overflows: list[tuple[bool, bool]] = []  # per scaled step: (this rank's shard, any rank's)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # backward skipped: nothing to unscale or step (as Lightning does)
        self.overflows.append(unscale_and_agree(scaler, optimizer, self._sharded(optimizer)))
        self._after_closure(model, optimizer)
        step_output = scaler.step(optimizer, **kwargs)  # skipped on every rank alike when anywhere
        scaler.update()
        return step_output

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # The engine casts the parameters itself, after taking the fp32 master chunks from them.
        return module


class ZeroHalfPrecision(_EngineClipping, HalfPrecision):
    """The whole module in bf16 (``bf16-true``) or fp16 (``16-true``), as ddp holds it; the
    optimizer steps the half-precision chunks, or fp32 masters (``master_weights="fp32"``)."""

    def __init__(self, precision: str = "bf16-true", master_weights: str = "auto") -> None:
        HalfPrecision.__init__(self, precision=precision)  # type: ignore[arg-type]
        self.policy = precision_policy(precision, master_weights)


def to_zero_precision(plugin: Optional[Precision], master_weights: str = "auto") -> Optional[Precision]:
    """Map Lightning's plugin for ``precision=...`` to ours, or raise naming the supported ones."""
    if plugin is None:
        return plugin
    if isinstance(plugin, ZeroHalfPrecision) and plugin.policy.master_weights != master_weights:
        return ZeroHalfPrecision(plugin.precision, master_weights)
    if isinstance(plugin, _EngineClipping):
        return plugin
    if type(plugin) is Precision:
        return ZeroPrecision()
    if isinstance(plugin, MixedPrecision):
        return ZeroMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    if isinstance(plugin, HalfPrecision):
        return ZeroHalfPrecision(plugin.precision, master_weights)
    name = getattr(plugin, "precision", type(plugin).__name__)
    precision_policy(name)  # raises naming the supported precisions for an unknown name
    raise ValueError(
        f"ZeroStrategy does not support the precision plugin {type(plugin).__name__} ({name!r}): pass"
        " Trainer(precision=...) with one of " + ", ".join(PRECISIONS) + " (or Lightning's own"
        " Precision / MixedPrecision / HalfPrecision plugin for it)."
    )
