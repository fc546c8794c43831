"""Precision plugins for ZeroStrategy (Lightning glue): Lightning's plugins mapped onto the one policy.

``ZeroStrategy`` swaps the plugin Lightning builds from ``Trainer(precision=...)`` (or the one
passed in ``plugins=[...]``) for one of these; each carries the
:class:`~lightning_zero.precision.PrecisionPolicy` that ``precision.py`` gives for
the plugin's precision string and the strategy's ``ZeroConfig`` (where each byte lives, and the
knobs' validation, are there and in docs/precision.md, not here):

- ``Precision`` (``"32-true"``) -> :class:`ZeroPrecision`.
- ``MixedPrecision("bf16-mixed" | "16-mixed")`` -> :class:`ZeroMixedPrecision`: Lightning's
  autocast forward; ``convert_module`` leaves the module to the engine; ``16-mixed`` adds the
  user's dynamic loss scaler, whose skip decision is global.
- ``HalfPrecision("bf16-true" | "16-true")`` -> :class:`ZeroHalfPrecision`: the module is
  converted to the half dtype as under ddp.

Every one routes gradient clipping to the engine, which clips the sharded gradients by the
*global* norm (one all-reduce of the squared chunk norms) instead of each rank's local chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_zero.precision import PRECISIONS, PrecisionPolicy, precision_policy, unscale_and_agree

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig

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

    def __init__(self, policy: Optional[PrecisionPolicy] = None) -> None:
        self.policy = policy if policy is not None else precision_policy("32-true")


class ZeroMixedPrecision(_EngineClipping, MixedPrecision):
    """The forward under autocast; the engine holds fp32 parameters (``mixed_params="fp32"``, as ddp)
    or half-precision ones with fp32 masters in the shards (``"half"``), as ``policy`` says.

    ``16-mixed`` keeps Lightning's loss scaling with the user's ``torch.amp.GradScaler`` (its
    ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``; its state is the
    plugin's ``state_dict``, saved in checkpoints and restored on resume), in GradScaler's order:
    the loss is scaled before backward; after it, the scaler unscales this rank's fp32 gradient
    shards and finds its inf/NaN; the ranks agree whether *any* shard overflowed ([Note: global
    overflow] in ``zero/optimizer.py``: one int32 on the step's phase marker, no extra collective);
    then gradient clipping (global norm, of unscaled gradients), ``scaler.step`` (which skips
    the update on every rank alike) and ``scaler.update`` (growth or backoff).
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str = "cpu",
        scaler: Optional[Any] = None,
        policy: Optional[PrecisionPolicy] = None,
    ) -> None:
        MixedPrecision.__init__(self, precision=precision, device=device, scaler=scaler)  # type: ignore[arg-type]
        self.policy = policy if policy is not None else precision_policy(precision)
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
        # The engine casts the parameters itself (mixed_params="half"), after taking the fp32 master
        # chunks from them; under "fp32" they stay fp32, as ddp keeps them.
        return module


class ZeroHalfPrecision(_EngineClipping, HalfPrecision):
    """The whole module in bf16 (``bf16-true``) or fp16 (``16-true``), as ddp holds it; the
    optimizer steps the half-precision chunks, or fp32 masters (``master_weights="fp32"``)."""

    def __init__(self, precision: str = "bf16-true", policy: Optional[PrecisionPolicy] = None) -> None:
        HalfPrecision.__init__(self, precision=precision)  # type: ignore[arg-type]
        self.policy = policy if policy is not None else precision_policy(precision)


def to_zero_precision(plugin: Optional[Precision], config: "ZeroConfig") -> Optional[Precision]:
    """Map Lightning's plugin for ``precision=...`` to ours, carrying the policy of its precision
    under ``config``'s knobs; raises naming the supported precisions."""
    if plugin is None:
        return plugin
    if not (type(plugin) is Precision or isinstance(plugin, (_EngineClipping, MixedPrecision, HalfPrecision))):
        name = getattr(plugin, "precision", type(plugin).__name__)
        precision_policy(name)  # raises naming the supported precisions for an unknown name
        raise ValueError(
            f"ZeroStrategy does not support the precision plugin {type(plugin).__name__} ({name!r}): pass"
            " Trainer(precision=...) with one of " + ", ".join(PRECISIONS) + " (or Lightning's own"
            " Precision / MixedPrecision / HalfPrecision plugin for it)."
        )
    policy = precision_policy(plugin.precision, config.master_weights, config.mixed_params)
    if isinstance(plugin, _EngineClipping) and plugin.policy == policy:
        return plugin
    if isinstance(plugin, MixedPrecision):
        return ZeroMixedPrecision(plugin.precision, plugin.device, plugin.scaler, policy)
    if isinstance(plugin, HalfPrecision):
        return ZeroHalfPrecision(plugin.precision, policy)
    return ZeroPrecision(policy)


class ZeroPrecisionSlot:
    """``ZeroStrategy``'s ``precision_plugin``: always one of the plugins above, made from the one
    Lightning sets (at construction, from ``Trainer(precision=...)``: an unsupported precision
    fails then, before any process starts), and the :class:`PrecisionPolicy` it carries."""

    _precision_plugin: Optional[Precision]
    zero_config: "ZeroConfig"

    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = to_zero_precision(Precision(), self.zero_config)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_zero_precision(precision_plugin, self.zero_config)

    @property
    def precision_policy(self) -> PrecisionPolicy:
        """Where each byte lives under the chosen precision (``precision.py``)."""
        return self.precision_plugin.policy  # type: ignore[attr-defined]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision_policy.compute_dtype

    def _precision_name(self) -> str:
        return getattr(self.precision_plugin, "precision", str(self.compute_dtype))
