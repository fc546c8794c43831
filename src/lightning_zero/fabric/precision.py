"""Fabric's precision plugins, mapped to what the ZeRO engine keeps (the one place this mapping lives).

- ``"32-true"`` (Fabric's ``Precision``): fp32 parameters and gradients, the parameter chunk is its
  own master (4 + 4 + 8 bytes/param for Adam before sharding).
- ``"bf16-mixed"`` / ``"16-mixed"`` (Fabric's ``MixedPrecision``): the engine casts the compute
  parameters to the half dtype and keeps fp32 masters and optimizer state only in the shards
  (2 + 2 + 12); Fabric's plugin runs the forward under ``torch.autocast`` as it does for ddp, and
  leaves the module in fp32 (``convert_module`` is the identity), so the engine takes the masters
  from fp32 values. ``16-mixed`` keeps Fabric's flow with the plugin's ``GradScaler``
  ([Note: Fabric loss scaling]).
- ``"bf16-true"`` / ``"16-true"`` (Fabric's ``HalfPrecision``): ``fabric.setup`` converts the
  module to the half dtype (``convert_module``, as for ddp; under stage 3 ``init_module`` builds it
  in that dtype), and the optimizer steps the half-precision chunks (2 + 2 + 4), or fp32 masters
  and optimizer state with ``ZeroConfig.master_weights="fp32"`` ([Note: master_weights] in
  ``runtime/precision.py``).

Fabric's plugin stays in charge of what it does around a forward and a backward; the engine reads
where each byte lives from the plugin's :class:`~lightning_zero.runtime.precision.PrecisionPolicy`
(:func:`policy_of`), the same object the Trainer door hands it.

[Note: Fabric loss scaling] Under ``16-mixed`` Fabric's ``MixedPrecision`` scales the loss in
``fabric.backward`` and runs ``scaler.step`` / ``scaler.update`` in its ``optimizer_step``; it
unscales in ``fabric.clip_gradients``. ``ZeroFabricStrategy`` replaces that unscale, and adds one
right before ``optimizer_step`` when the user did not clip, by :func:`unscale_agreed`: the scaler
unscales this rank's fp32 gradient shards, then the ranks agree whether any shard overflowed
(``runtime/precision.unscale_and_agree``, the Trainer door's call), so ``scaler.step`` skips the
step on every rank alike and ``scaler.update`` backs off on every rank alike. The scaler's state
is not saved by Fabric on its own: as for ddp, a user who wants it put the scaler (or
``fabric.strategy.precision``) in the state given to ``fabric.save`` / ``fabric.load``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

from lightning_zero.runtime.precision import PRECISIONS, PrecisionPolicy, precision_policy, unscale_and_agree

SUPPORTED_PRECISION = PRECISIONS


def policy_of(plugin: Optional[Precision], master_weights: str = "auto") -> PrecisionPolicy:
    """Where the engine keeps each byte under Fabric's ``plugin`` (``master_weights``: the strategy's
    ``ZeroConfig.master_weights``); raises naming the supported precisions."""
    if plugin is None or type(plugin) is Precision:
        return precision_policy("32-true")
    if type(plugin) in (MixedPrecision, HalfPrecision):
        return precision_policy(plugin.precision, master_weights)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ZeroFabricStrategy does not support precision={name!r} ({type(plugin).__name__}; supported:"
        f" {', '.join(SUPPORTED_PRECISION)}). Use Fabric(precision='32-true') (fp32 params, grads and Adam"
        " state), 'bf16-mixed' / '16-mixed' (half compute, fp32 master and optimizer state in the shards;"
        " 16-mixed with the plugin's GradScaler) or 'bf16-true' / '16-true' (everything in the half dtype,"
        " as ddp holds it); see docs/precision.md."
    )


def compute_dtype_of(plugin: Optional[Precision], master_weights: str = "auto") -> torch.dtype:
    """The engine's compute dtype for Fabric's ``plugin``."""
    return policy_of(plugin, master_weights).compute_dtype


def precision_name(plugin: Optional[Precision]) -> str:
    """The Lightning precision string a checkpoint records (``"32-true"``, ``"bf16-true"``, ...)."""
    return policy_of(plugin).name


def scaler_of(plugin: Optional[Precision]) -> Optional[Any]:
    """The plugin's ``GradScaler`` (``16-mixed``), or None."""
    return getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None


def needs_unscale(plugin: Optional[Precision], optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradients are still scaled in this step (the scaler has not unscaled
    them since its last ``update``)."""
    from torch.amp.grad_scaler import OptState

    scaler = scaler_of(plugin)
    if scaler is None or not scaler.is_enabled():
        return False
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED


def unscale_agreed(plugin: Optional[Precision], optimizer: Any, sharded: Any) -> Optional[tuple[bool, bool]]:
    """[Note: Fabric loss scaling]: unscale ``optimizer``'s gradient shards once per step and agree
    on the overflow over every rank; returns ``(this rank's shard overflowed, any rank's)``, or
    None when there was nothing to unscale (no scaler, or already unscaled in this step)."""
    if not needs_unscale(plugin, optimizer):
        return None
    if _optimizer_handles_unscaling(optimizer):
        raise NotImplementedError(
            f"ZeroFabricStrategy under 16-mixed: {type(optimizer).__name__} unscales inside its step, but the"
            " overflow decision is made over every rank's gradient shards before the step; build the optimizer"
            " with fused=False."
        )
    return unscale_and_agree(scaler_of(plugin), optimizer, sharded)
