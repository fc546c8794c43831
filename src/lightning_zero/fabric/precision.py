"""Fabric's precision plugins mapped onto the one policy (``precision.py``), and Fabric's
``16-mixed`` loss-scaling flow.

Fabric's ``Precision`` (``"32-true"``), ``MixedPrecision`` (``"bf16-mixed"`` / ``"16-mixed"``) and
``HalfPrecision`` (``"bf16-true"`` / ``"16-true"``) each name a precision string;
:func:`policy_of` turns it and the strategy's ``ZeroConfig`` into the
:class:`~lightning_zero.precision.PrecisionPolicy` the engine is built from, the same object
the Trainer door hands it (where each byte lives: ``precision.py``, docs/precision.md).
Fabric's plugin stays in charge of what it does around a forward and a backward: autocast under
the ``-mixed`` ones (``convert_module`` is the identity there, so the engine takes the masters
from fp32 values, or keeps the fp32 parameters under ``mixed_params="fp32"``), the module
converted to the half dtype under the ``-true`` ones (under stage 3 ``init_module`` builds it in
that dtype), the plugin's ``GradScaler`` under ``16-mixed`` ([Note: Fabric loss scaling]).

[Note: Fabric loss scaling]).
- ``"bf16-true"`` / ``"16-true"`` (Fabric's ``HalfPrecision``): ``fabric.setup`` converts the
  module to the half dtype (``convert_module``, as for ddp; under stage 3 ``init_module`` builds it
  in that dtype), and the optimizer steps the half-precision chunks (2 + 2 + 4), or fp32 masters
  and optimizer state with ``ZeroConfig.master_weights="fp32"`` ([Note: master_weights] in
  ``precision.py``).

Fabric's plugin stays in charge of what it does around a forward and a backward; the engine reads
where each byte lives from the plugin's :class:`~lightning_zero.precision.PrecisionPolicy`
(:func:`policy_of`), the same object the Trainer door hands it.

[Note: Fabric loss scaling] Under ``16-mixed`` Fabric's ``MixedPrecision`` scales the loss in
``fabric.backward`` and runs ``scaler.step`` / ``scaler.update`` in its ``optimizer_step``; it
unscales in ``fabric.clip_gradients``. ``ZeroFabricStrategy`` replaces that unscale, and adds one
right before ``optimizer_step`` when the user did not clip, by :func:`unscale_agreed`: the scaler
unscales this rank's fp32 gradient shards, then the ranks agree whether any shard overflowed
(``precision.unscale_and_agree``, the Trainer door's call), so ``scaler.step`` skips the
step on every rank alike and ``scaler.update`` backs off on every rank alike. The scaler's state
is not saved by Fabric on its own: as for ddp, a user who wants it put the scaler (or
``fabric.strategy.precision``) in the state given to ``fabric.save`` / ``fabric.load``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.precision import PRECISIONS, PrecisionPolicy, precision_policy, unscale_and_agree

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig
    from lightning_zero.runtime.forward_steps import ForwardSteps
    from lightning_zero.runtime.run import ZeroRun


def policy_of(plugin: Optional[Precision], config: Optional["ZeroConfig"] = None) -> PrecisionPolicy:
    """Where the engine keeps each byte under Fabric's ``plugin`` and the strategy's knobs
    (``config``; None: the defaults); raises naming the supported precisions."""
    knobs = dict(master_weights=config.master_weights, mixed_params=config.mixed_params) if config is not None else {}
    if plugin is None or type(plugin) is Precision:
        return precision_policy("32-true", **knobs)
    if type(plugin) in (MixedPrecision, HalfPrecision):
        return precision_policy(plugin.precision, **knobs)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ZeroFabricStrategy does not support precision={name!r} ({type(plugin).__name__}; supported:"
        f" {', '.join(PRECISIONS)}). Use Fabric(precision='32-true') (fp32 params, grads and Adam"
        " state), 'bf16-mixed' / '16-mixed' (half-precision autocast; 16-mixed with the plugin's GradScaler)"
        " or 'bf16-true' / '16-true' (everything in the half dtype, as ddp holds it); see docs/precision.md."
    )


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


class FabricPrecisionSlot:
    """``ZeroFabricStrategy``'s precision: Fabric's plugin (checked when Fabric's connector sets it,
    before any process starts), the policy it maps to, and what the plugin does around clipping
    and stepping under ``16-mixed`` ([Note: Fabric loss scaling])."""

    _precision: Optional[Precision]
    zero_config: "ZeroConfig"
    run: "ZeroRun"
    loop: "ForwardSteps"
    overflows: list[tuple[bool, bool]]  # 16-mixed, per step: (this rank's shard overflowed, any rank's)

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # unsupported precisions fail now, before any process starts (Fabric's connector sets the
        # plugin after __init__; a strategy built without zero_config gets the knobs' defaults)
        policy_of(precision, self.__dict__.get("zero_config"))
        self._precision = precision

    @property
    def precision_policy(self) -> "PrecisionPolicy":
        """Where each byte lives under Fabric's precision plugin and the knobs (``fabric/precision.py``)."""
        return policy_of(self._precision, self.zero_config)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision_policy.compute_dtype

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shards; returns that norm (as
        ``torch.nn.utils.clip_grad_norm_`` does for the whole model); under ``16-mixed`` unscaled first."""
        total = self._unscale(optimizer).clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it"
                " cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway,"
                " set `error_if_nonfinite=False`"
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._unscale(optimizer).clip_grad_value_(float(clip_val))

    def _unscale(self, optimizer: Optimizer) -> Any:
        """``optimizer``'s sharded optimizer, its gradients unscaled (``16-mixed``, once per step) with
        the overflow agreed over every rank ([Note: Fabric loss scaling] in ``fabric/precision.py``)."""
        sharded = self.loop.ensure_engine().sharded_optimizer(optimizer)
        with self.run.noting_failures():
            overflow = unscale_agreed(self._precision, optimizer, sharded)
        if overflow is not None:
            self.overflows.append(overflow)
        return sharded

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's plugin steps (``scaler.step`` / ``scaler.update`` under ``16-mixed``), after the
        unscale and the global overflow decision when ``clip_gradients`` did not make them."""
        if self.run.engine is not None and isinstance(optimizer, Optimizer) and optimizer in self.loop.optimizers:
            self._unscale(optimizer)
        return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
