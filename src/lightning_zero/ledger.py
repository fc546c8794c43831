"""``lightning_zero.ledger`` (public contract): the ZeRO paper's bytes per rank.

The formulas live in :mod:`lightning_zero.planner.ledger`; this module re-exports them so
``lightning_zero.ledger.model_state_bytes`` keeps working.
"""

from lightning_zero.planner.ledger import (
    ATTENTION_KERNELS,
    ActivationBytes,
    LlamaParamCounts,
    ModelStateBytes,
    llama_activation_bytes,
    llama_param_counts,
    model_state_bytes,
)

__all__ = [
    "ATTENTION_KERNELS",
    "ActivationBytes",
    "LlamaParamCounts",
    "ModelStateBytes",
    "llama_activation_bytes",
    "llama_param_counts",
    "model_state_bytes",
]
