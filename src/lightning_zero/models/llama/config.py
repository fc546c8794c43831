"""Llama 2 shapes: ``LlamaConfig``, its size presets (``tiny``, ``7b``, ``13b``, ``70b``: Meta's
``params.json`` values) and ``resolve_config`` (a preset name, a mapping or a config)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

# The Llama 2 family shares these; each size overrides the shape (Meta's params.json files).
_LLAMA2_BASE: dict[str, Any] = dict(vocab_size=32000, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0)


_PRESETS: dict[str, dict[str, Any]] = {
    # ~3.3M parameters over byte-level tokens: trains on a laptop CPU in minutes.
    "tiny": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512),
    "7b": dict(_LLAMA2_BASE, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    "13b": dict(_LLAMA2_BASE, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
    "70b": dict(_LLAMA2_BASE, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


@dataclass
class LlamaConfig:
    """Shape of a Llama decoder.

    Args:
        name: a label (a preset name, or anything for a custom shape).
        vocab_size: number of token ids; rows of ``tok_embeddings`` and of ``output``.
        dim: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: query heads; ``dim`` must divide by it (``head_dim = dim // n_heads``, even).
        n_kv_heads: key/value heads (grouped-query attention when < ``n_heads``); must divide
            ``n_heads``.
        ffn_dim: hidden width of the SwiGLU feed-forward (``w1``/``w3`` out, ``w2`` in).
        max_seq_len: longest sequence the rotary tables cover.
        norm_eps: epsilon of every RMSNorm.
        rope_theta: base of the rotary frequencies.
    """

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig({self.name!r}): {field} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig({self.name!r}): dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                f"pick n_heads among the divisors of {self.dim}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig({self.name!r}): n_heads ({self.n_heads}) must be divisible by "
                f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig({self.name!r}): head_dim = dim // n_heads = {self.dim} // {self.n_heads} = "
                f"{self.head_dim} must be even for rotary embeddings"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"LlamaConfig({self.name!r}): norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) "
                "must be positive"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, path: Union[str, "os.PathLike[str]"]) -> "LlamaConfig":
        """The shape in a Hugging Face Llama directory's ``config.json`` (``hidden_size``,
        ``num_key_value_heads``, ``rope_theta``, ``rms_norm_eps``, ...); other architectures,
        biases and rope scaling are refused by name (see ``models/llama_hf.py``)."""
        from lightning_zero.models.llama.hf import config_from_hf

        return config_from_hf(path)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """The preset ``name`` (``tiny``, ``7b``, ``13b``, ``70b``), with optional field overrides."""
        key = str(name).lower()
        if key not in _PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; available: {', '.join(_PRESETS)}")
        _check_fields(overrides, where=f"LlamaConfig.from_name({name!r})")
        return cls(**{"name": key, **_PRESETS[key], **overrides})

    def num_params(self) -> int:
        """Exact parameter count, by formula (matches ``sum(p.numel() for p in Llama(c).parameters())``)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim  # wq, wo + wk, wv
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        block = attention + feed_forward + 2 * self.dim  # + attention_norm, ffn_norm
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim  # + embeddings, output, norm


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def _check_fields(values: Mapping[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; LlamaConfig fields are {sorted(known)}")


def resolve_config(config: Union[LlamaConfig, str, Mapping[str, Any]]) -> LlamaConfig:
    """Accept a ``LlamaConfig``, a preset name, or a mapping (a preset ``name`` plus overrides, or
    every field of a custom shape), as Hydra and ``load_from_checkpoint`` hand them over."""
    if isinstance(config, LlamaConfig):
        return config
    if isinstance(config, str):
        return LlamaConfig.from_name(config)
    if isinstance(config, Mapping):
        values = {str(key): value for key, value in config.items()}
        name = values.pop("name", None)
        if name is not None and str(name).lower() in _PRESETS:
            return LlamaConfig.from_name(name, **values)
        _check_fields(values, where="LlamaConfig")
        required = [f.name for f in dataclasses.fields(LlamaConfig) if f.default is dataclasses.MISSING]
        missing = [field for field in required if field != "name" and field not in values]
        if missing:
            raise ValueError(
                f"LlamaConfig {name!r} is not a preset ({', '.join(_PRESETS)}) and misses field(s) {missing}; "
                "give a preset name or every field"
            )
        return LlamaConfig(name=str(name or "custom"), **values)
    raise ValueError(f"config must be a LlamaConfig, a preset name or a mapping, got {type(config).__name__}")
