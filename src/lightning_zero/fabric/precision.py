"""Fabric's precision plugins, mapped to what the ZeRO engine keeps (the one place this mapping lives).

- ``"32-true"`` (Fabric's ``Precision``): fp32 parameters and gradients, the parameter chunk is its
  own master (4 + 4 + 8 bytes/param for Adam before sharding).
- ``"bf16-mixed"`` (Fabric's ``MixedPrecision``): the engine casts the compute parameters to bf16
  and keeps fp32 masters and optimizer state only in the shards (2 + 2 + 12); Fabric's plugin
  runs the forward under ``torch.autocast`` as it does for ddp, and leaves the module in fp32
  (``convert_module`` is the identity), so the engine takes the masters from fp32 values.

Fabric's plugin stays in charge of what it does around a forward and a backward; the engine reads
where each byte lives from the plugin's :class:`~lightning_zero.runtime.precision.PrecisionPolicy`
(:func:`policy_of`), the same object the Trainer door hands it.
"""

from __future__ import annotations

from typing import Optional

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision

from lightning_zero.runtime.precision import PrecisionPolicy, precision_policy

SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


def policy_of(plugin: Optional[Precision]) -> PrecisionPolicy:
    """Where the engine keeps each byte under Fabric's ``plugin``; raises naming the supported precisions."""
    if plugin is None or type(plugin) is Precision:
        return precision_policy("32-true")
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        return precision_policy("bf16-mixed")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ZeroFabricStrategy does not support precision={name!r} (supported: {', '.join(SUPPORTED_PRECISION)})."
        " Use Fabric(precision='32-true') (fp32 params, grads and Adam state) or Fabric(precision='bf16-mixed')"
        " (bf16 params and grads, fp32 master and optimizer state in the shards)."
    )


def compute_dtype_of(plugin: Optional[Precision]) -> torch.dtype:
    """The engine's compute dtype for Fabric's ``plugin``."""
    return policy_of(plugin).compute_dtype


def precision_name(plugin: Optional[Precision]) -> str:
    """The Lightning precision string a checkpoint records (``"32-true"``, ``"bf16-mixed"``)."""
    return policy_of(plugin).name
