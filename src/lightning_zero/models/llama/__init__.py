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

from lightning_zero._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "lightning_zero.models.llama.model": (
            "Attention FeedForward Llama RMSNorm TransformerBlock apply_rope build_llama cross_entropy_loss"
        ),
        "lightning_zero.models.llama.config": "LlamaConfig preset_names resolve_config",
        "lightning_zero.models.llama.lightning": "LlamaLM PerplexityFromLoss WarmupCosine split_batch",
        "lightning_zero.models.llama.parallelize": "SequenceParallelRMSNorm parallelize_llama",
        "lightning_zero.models.llama.rope": "rope_tables",
    },
)
