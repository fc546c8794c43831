"""The activation-checkpointing modes of ``LlamaLM`` / ``Llama``, read by the model and the planner.

[Note: checkpointing modes]

- ``"none"`` (``False``): every block keeps what autograd saves.
- ``"full"`` (``True``): each transformer block keeps only its input and is recomputed whole in
  backward (one more forward of every block: about 33% more FLOPs than forward + backward).
- ``"selective"``: Korthikanti et al. (2022), section 5: keep the linears' inputs and outputs,
  recompute only attention's core. With SDPA the core is one checkpointed function per block:
  rotary on q and k, the grouped-query repeat of k and v, and ``scaled_dot_product_attention``;
  it keeps q, k, v as the projections produced them and drops the rotated/repeated copies and
  the kernel's own saved state (the ``(B, heads, T, T)`` probabilities on SDPA's math path, a
  log-sum-exp per head and token on the fused ones), recomputing one attention forward per block
  (``4 B T^2 dim / tp`` FLOPs, no matmul of a linear layer).
"""

from __future__ import annotations

from typing import Union

CHECKPOINTING_MODES = ("none", "selective", "full")

CheckpointingLike = Union[bool, str, None]


def checkpointing_mode(value: CheckpointingLike, where: str = "activation_checkpointing") -> str:
    """``"none"``, ``"selective"`` or ``"full"`` for ``value`` (``False``/``None``/``"none"``,
    ``"selective"``, ``True``/``"full"``); a ``ValueError`` naming ``where`` otherwise."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if isinstance(value, str) and value.lower() in CHECKPOINTING_MODES:
        return value.lower()
    if isinstance(value, str) and value.lower() == "false":
        return "none"
    if isinstance(value, str) and value.lower() == "true":
        return "full"
    raise ValueError(
        f"{where}={value!r}: give false (keep every activation), 'selective' (recompute attention's"
        " core only) or 'full' (recompute each block; true means the same)"
    )
