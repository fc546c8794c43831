"""Model families. Llama 2 (presets ``tiny``, ``7b``, ``13b``, ``70b``) lives in :mod:`.llama`.

Names are imported lazily (as ``lightning_zero``'s own): ``LlamaConfig`` and ``resolve_config``
are plain Python, and taking them (the planner, ``lightning-zero plan``) does not import torch or
Lightning; ``LlamaLM`` imports Lightning when it is first taken.
"""

from __future__ import annotations

from lightning_zero._lazy import lazy_exports

# Llama's public names, taken from its package (models/llama/__init__.py says which module defines each)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "lightning_zero.models.llama": (
            "Attention FeedForward Llama LlamaConfig LlamaLM RMSNorm TransformerBlock WarmupCosine"
            " cross_entropy_loss preset_names resolve_config"
        ),
    },
)
