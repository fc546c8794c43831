"""``lightning_zero.ledger`` (public contract): the ZeRO paper's bytes per rank.

The formulas live in :mod:`lightning_zero.planner.ledger`; this module re-exports them so
``lightning_zero.ledger.model_state_bytes`` keeps working, and so the engine's byte counts per
link class can be checked against :func:`dp_link_bytes` (docs/topology.md).
"""

from lightning_zero.planner.ledger import (
    ATTENTION_KERNELS,
    INT8_BLOCK_SIZE,
    LINK_CLASSES,
    ActivationBytes,
    DpTopology,
    LinkBytes,
    LlamaParamCounts,
    ModelStateBytes,
    dp_link_bytes,
    dp_topology,
    llama_activation_bytes,
    llama_param_counts,
    model_state_bytes,
)

__all__ = [
    "ATTENTION_KERNELS",
    "INT8_BLOCK_SIZE",
    "LINK_CLASSES",
    "ActivationBytes",
    "DpTopology",
    "LinkBytes",
    "LlamaParamCounts",
    "ModelStateBytes",
    "dp_link_bytes",
    "dp_topology",
    "llama_activation_bytes",
    "llama_param_counts",
    "model_state_bytes",
]
