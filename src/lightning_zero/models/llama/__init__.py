"""Llama 2 and 3.x, one job a module: ``config`` (shapes and presets), ``rope_scaling`` (the rope
scaling dict, checked; plain Python), ``rope`` (rotary tables), ``model`` (the decoder with Meta's
module names), ``lightning`` (``LlamaLM``), ``parallelize`` (its tensor-parallel plan,
``parallelize_llama``), ``hf_config`` (a Hugging Face config.json read into config fields) and
``hf`` (the rest of the Hugging Face layout: name map, the q/k rotary permutation, loading, and
``export_hf``), so the generic weight reader and writer in
``checkpoint/`` stay model-agnostic.

Names are imported lazily: ``config``, ``rope_scaling`` and ``hf_config`` import neither torch nor
Lightning, so the planner can read a ``LlamaConfig`` without either."""

from __future__ import annotations

from lightning_zero._lazy import lazy_attributes

_LAZY = {
    "Attention": "lightning_zero.models.llama.model",
    "FeedForward": "lightning_zero.models.llama.model",
    "Llama": "lightning_zero.models.llama.model",
    "LlamaConfig": "lightning_zero.models.llama.config",
    "LlamaLM": "lightning_zero.models.llama.lightning",
    "PerplexityFromLoss": "lightning_zero.models.llama.lightning",
    "RMSNorm": "lightning_zero.models.llama.model",
    "SequenceParallelRMSNorm": "lightning_zero.models.llama.parallelize",
    "TransformerBlock": "lightning_zero.models.llama.model",
    "WarmupCosine": "lightning_zero.models.llama.lightning",
    "apply_rope": "lightning_zero.models.llama.model",
    "build_llama": "lightning_zero.models.llama.model",
    "cross_entropy_loss": "lightning_zero.models.llama.model",
    "parallelize_llama": "lightning_zero.models.llama.parallelize",
    "preset_names": "lightning_zero.models.llama.config",
    "resolve_config": "lightning_zero.models.llama.config",
    "rope_tables": "lightning_zero.models.llama.rope",
    "split_batch": "lightning_zero.models.llama.lightning",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
