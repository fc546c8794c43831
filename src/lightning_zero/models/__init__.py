"""Model families. Llama 2 (presets ``tiny``, ``7b``, ``13b``, ``70b``) lives in :mod:`.llama`."""

from lightning_zero.models.llama import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    LlamaLM,
    RMSNorm,
    TransformerBlock,
    WarmupCosine,
    cross_entropy_loss,
    preset_names,
    resolve_config,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "LlamaLM",
    "RMSNorm",
    "TransformerBlock",
    "WarmupCosine",
    "cross_entropy_loss",
    "preset_names",
    "resolve_config",
]
