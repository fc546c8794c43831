"""Llama 2 and 3.x, one job a module: ``config`` (shapes and presets), ``rope`` (rotary tables and
rope scaling), ``model`` (the decoder with Meta's
module names), ``lightning`` (``LlamaLM``), ``hf_config`` (a Hugging Face config.json read into
config fields) and ``hf`` (the rest of the Hugging Face layout: name map, the q/k rotary
permutation, loading, and ``export_hf``), so the generic weight reader and writer in
``checkpoint/`` stay model-agnostic."""

from lightning_zero.models.llama.config import LlamaConfig, preset_names, resolve_config
from lightning_zero.models.llama.lightning import LlamaLM, PerplexityFromLoss, WarmupCosine, split_batch
from lightning_zero.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    build_llama,
    cross_entropy_loss,
    rope_tables,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "LlamaLM",
    "PerplexityFromLoss",
    "RMSNorm",
    "TransformerBlock",
    "WarmupCosine",
    "apply_rope",
    "build_llama",
    "cross_entropy_loss",
    "preset_names",
    "resolve_config",
    "rope_tables",
    "split_batch",
]
