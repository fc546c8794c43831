"""Model families. Llama 2 (presets ``tiny``, ``7b``, ``13b``, ``70b``) lives in :mod:`.llama`.

Names are imported lazily (as ``lightning_zero``'s own): ``LlamaConfig`` and ``resolve_config``
are plain Python, and taking them (the planner, ``lightning-zero plan``) does not import torch or
Lightning; ``LlamaLM`` imports Lightning when it is first taken.
"""

from __future__ import annotations

from lightning_zero._lazy import lazy_attributes

_LAZY = {
    "Attention": "lightning_zero.models.llama.model",
    "FeedForward": "lightning_zero.models.llama.model",
    "Llama": "lightning_zero.models.llama.model",
    "LlamaConfig": "lightning_zero.models.llama.config",
    "LlamaLM": "lightning_zero.models.llama.lightning",
    "RMSNorm": "lightning_zero.models.llama.model",
    "TransformerBlock": "lightning_zero.models.llama.model",
    "WarmupCosine": "lightning_zero.models.llama.lightning",
    "cross_entropy_loss": "lightning_zero.models.llama.model",
    "preset_names": "lightning_zero.models.llama.config",
    "resolve_config": "lightning_zero.models.llama.config",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
