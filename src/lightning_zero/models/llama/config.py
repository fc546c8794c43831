"""Llama shapes: ``LlamaConfig``, its size presets (Llama 2: ``tiny``, ``7b``, ``13b``, ``70b``;
Llama 3.1: ``llama3_8b``, ``llama3_70b``, ``llama3_405b``; Llama 3.2: ``llama3_2_1b``,
``llama3_2_3b``: Meta's ``params.json`` values), the dense families that reuse the Llama decoder
with a flag or two (Mistral: ``mistral_7b``, ``mistral_7b_v03``, ``mistral_nemo_12b``; Qwen2.5:
``qwen2_5_0_5b`` ... ``qwen2_5_72b``, q/k/v biases; Qwen3: ``qwen3_0_6b`` ... ``qwen3_32b``, q/k
norms: the published ``config.json`` values) and ``resolve_config`` (a preset name, a mapping or a
config)."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_zero.models.llama.hf_config import config_fields_from_hf
from lightning_zero.models.llama.rope_scaling import normalize_rope_scaling

# The Llama 2 family shares these; each size overrides the shape (Meta's params.json files).
_LLAMA2_BASE: dict[str, Any] = dict(vocab_size=32000, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0)


# Llama 3.x: a 128,256-token vocabulary, grouped-query attention with 8 KV heads everywhere,
# theta 500,000, 128K context through Llama 3.1's rope scaling of the 8K pretraining context
# (Meta's params.json ``use_scaled_rope``; Hugging Face's ``rope_type: llama3``).
_LLAMA3_BASE: dict[str, Any] = dict(vocab_size=128256, n_kv_heads=8, max_seq_len=131072, norm_eps=1e-5,
                                    rope_theta=500000.0)  # fmt: skip
_LLAMA3_1_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)  # fmt: skip
# Llama 3.2 1B / 3B (pruned and distilled from 3.1 8B): tied embeddings, rope factor 32.
_LLAMA3_2_BASE: dict[str, Any] = dict(_LLAMA3_BASE, tie_embeddings=True, rope_scaling=dict(_LLAMA3_1_ROPE, factor=32.0))

# Mistral 7B v0.1: sliding-window attention over 4096 tokens; v0.3 and Nemo: full attention, theta 1e6.
_MISTRAL_BASE: dict[str, Any] = dict(family="mistral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                     ffn_dim=14336, max_seq_len=32768, norm_eps=1e-5)  # fmt: skip
# Qwen2.5: q/k/v biases, theta 1e6, eps 1e-6; the three small sizes tie their embeddings.
_QWEN2_5_BASE: dict[str, Any] = dict(family="qwen2", qkv_bias=True, vocab_size=151936, max_seq_len=32768,
                                     norm_eps=1e-6, rope_theta=1e6)  # fmt: skip
# Qwen3 (dense): per-head q/k RMSNorms, head_dim 128 whatever the width, theta 1e6, eps 1e-6.
_QWEN3_BASE: dict[str, Any] = dict(family="qwen3", qk_norm=True, vocab_size=151936, n_kv_heads=8, head_dim=128,
                                   max_seq_len=40960, norm_eps=1e-6, rope_theta=1e6)  # fmt: skip

_PRESETS: dict[str, dict[str, Any]] = {
    # ~3.3M parameters over byte-level tokens: trains on a laptop CPU in minutes.
    "tiny": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512),
    "7b": dict(_LLAMA2_BASE, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    "13b": dict(_LLAMA2_BASE, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
    "70b": dict(_LLAMA2_BASE, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "llama3_8b": dict(_LLAMA3_BASE, dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, rope_scaling=_LLAMA3_1_ROPE),
    "llama3_70b": dict(_LLAMA3_BASE, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, rope_scaling=_LLAMA3_1_ROPE),
    "llama3_405b": dict(_LLAMA3_BASE, dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, rope_scaling=_LLAMA3_1_ROPE),
    "llama3_2_1b": dict(_LLAMA3_2_BASE, dim=2048, n_layers=16, n_heads=32, ffn_dim=8192),
    "llama3_2_3b": dict(_LLAMA3_2_BASE, dim=3072, n_layers=28, n_heads=24, ffn_dim=8192),
    "mistral_7b": dict(_MISTRAL_BASE, sliding_window=4096),
    "mistral_7b_v03": dict(_MISTRAL_BASE, vocab_size=32768, rope_theta=1e6),
    "mistral_nemo_12b": dict(_MISTRAL_BASE, vocab_size=131072, dim=5120, n_layers=40, head_dim=128,
                             max_seq_len=1024000, rope_theta=1e6),
    "qwen2_5_0_5b": dict(_QWEN2_5_BASE, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                         tie_embeddings=True),
    "qwen2_5_1_5b": dict(_QWEN2_5_BASE, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960,
                         tie_embeddings=True),
    "qwen2_5_3b": dict(_QWEN2_5_BASE, dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008,
                       tie_embeddings=True),
    "qwen2_5_7b": dict(_QWEN2_5_BASE, vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       ffn_dim=18944, max_seq_len=131072),
    "qwen2_5_14b": dict(_QWEN2_5_BASE, vocab_size=152064, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8,
                        ffn_dim=13824, max_seq_len=131072),
    "qwen2_5_32b": dict(_QWEN2_5_BASE, vocab_size=152064, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8,
                        ffn_dim=27648, max_seq_len=131072),
    "qwen2_5_72b": dict(_QWEN2_5_BASE, vocab_size=152064, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_dim=29568, max_seq_len=131072),
    "qwen3_0_6b": dict(_QWEN3_BASE, dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True),
    "qwen3_1_7b": dict(_QWEN3_BASE, dim=2048, n_layers=28, n_heads=16, ffn_dim=6144, tie_embeddings=True),
    "qwen3_4b": dict(_QWEN3_BASE, dim=2560, n_layers=36, n_heads=32, ffn_dim=9728, tie_embeddings=True),
    "qwen3_8b": dict(_QWEN3_BASE, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288),
    "qwen3_14b": dict(_QWEN3_BASE, dim=5120, n_layers=40, n_heads=40, ffn_dim=17408),
    "qwen3_32b": dict(_QWEN3_BASE, dim=5120, n_layers=64, n_heads=64, ffn_dim=25600),
}  # fmt: skip

# The Hugging Face layouts a LlamaConfig exports to (``family``), each a Llama decoder with flags.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class DecoderShape:
    """The fields every decoder family here shares (``LlamaConfig`` documents them; ``MoEConfig``
    adds its experts), declared once."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int


@dataclass
class LlamaConfig(DecoderShape):
    """Shape of a Llama decoder.

    Args:
        name: a label (a preset name, or anything for a custom shape).
        vocab_size: number of token ids; rows of ``tok_embeddings`` and of ``output``.
        dim: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: query heads; ``dim`` must divide by it unless ``head_dim`` is given.
        n_kv_heads: key/value heads (grouped-query attention when < ``n_heads``); must divide
            ``n_heads``.
        ffn_dim: hidden width of the SwiGLU feed-forward (``w1``/``w3`` out, ``w2`` in).
        max_seq_len: longest sequence the rotary tables cover.
        norm_eps: epsilon of every RMSNorm.
        rope_theta: base of the rotary frequencies.
        rope_scaling: ``None`` (the plain rotary embedding) or a dict with ``rope_type``
            (``llama3``, ``linear``, ``dynamic``, ``yarn``) and that type's keys, as a Hugging Face
            ``config.json`` writes it (see [Note: rope scaling] in ``models/llama/rope.py``).
        tie_embeddings: the output head *is* ``tok_embeddings.weight`` (one Parameter of
            ``vocab_size x dim``, stored, sharded, reduced and saved once; Llama 3.2 1B/3B).
        head_dim: per-head width (even); ``None``: ``dim // n_heads``. Qwen3 and Mistral Nemo set
            it apart from the width (``wq`` is then ``n_heads * head_dim x dim``).
        qk_norm: per-head RMSNorms on q and k before the rotary embedding (Qwen3).
        qkv_bias: biases on ``wq``, ``wk`` and ``wv`` (Qwen2.5).
        sliding_window: ``None`` (full causal attention) or the number of most recent tokens each
            query sees, itself included (Mistral 7B v0.1: 4096); only sequences longer than it differ.
        family: the Hugging Face layout of ``export --format hf`` and ``init_from``: ``llama``,
            ``mistral``, ``qwen2`` or ``qwen3`` (config.json's ``model_type``).
    """

    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: bool = False
    head_dim: Optional[int] = None  # type: ignore[assignment]  (an int after __post_init__)
    qk_norm: bool = False
    qkv_bias: bool = False
    sliding_window: Optional[int] = None
    family: str = "llama"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig({self.name!r}): {field} must be a positive int, got {value!r}")
        for field in ("head_dim", "sliding_window"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"LlamaConfig({self.name!r}): {field} must be a positive int or null, got {value!r}")
        for field in ("qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"LlamaConfig({self.name!r}): {field} must be true or false, got {getattr(self, field)!r}"
                )
        if self.family not in FAMILIES:
            raise ValueError(f"LlamaConfig({self.name!r}): family {self.family!r} is not one of {FAMILIES}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig({self.name!r}): dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                f"pick n_heads among the divisors of {self.dim}, or set head_dim"
            )
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig({self.name!r}): n_heads ({self.n_heads}) must be divisible by "
                f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig({self.name!r}): head_dim ({self.head_dim}) must be even for rotary embeddings"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"LlamaConfig({self.name!r}): norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) "
                "must be positive"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(
                f"LlamaConfig({self.name!r}): tie_embeddings must be true or false, got {self.tie_embeddings!r}"
            )
        where = f"LlamaConfig({self.name!r}).rope_scaling"
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, where=where)  # a plain dict or None

    @classmethod
    def from_hf(cls, path: Union[str, "os.PathLike[str]"]) -> "LlamaConfig":
        """The shape in a Hugging Face Llama directory's ``config.json`` (``hidden_size``,
        ``num_key_value_heads``, ``rope_theta``, ``rms_norm_eps``, ...); other architectures,
        ``tie_word_embeddings``, ``rope_parameters``/``rope_scaling``); other architectures, biases
        and unsupported rope types are refused by name (see ``models/llama/hf_config.py``)."""
        return cls(**config_fields_from_hf(path))

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """The preset ``name`` (``tiny``, ``7b``, ``13b``, ``70b``, ``llama3_8b``, ``llama3_70b``,
        ``llama3_405b``, ``llama3_2_1b``, ``llama3_2_3b``, and the Mistral, Qwen2.5 and Qwen3 sizes of
        :func:`preset_names`), with optional field overrides."""
        key = str(name).lower()
        if key not in _PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; available: {', '.join(_PRESETS)}")
        _check_fields(overrides, where=f"LlamaConfig.from_name({name!r})")
        return cls(**{"name": key, **copy.deepcopy(_PRESETS[key]), **overrides})

    def num_params(self) -> int:
        """Exact parameter count, by formula (matches ``sum(p.numel() for p in Llama(c).parameters())``)."""
        kv_dim, q_dim = self.n_kv_heads * self.head_dim, self.n_heads * self.head_dim  # type: ignore[operator]
        attention = 2 * self.dim * q_dim + 2 * self.dim * kv_dim  # wq, wo + wk, wv
        attention += (q_dim + 2 * kv_dim if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)  # type: ignore[operator]
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        block = attention + feed_forward + 2 * self.dim  # + attention_norm, ffn_norm
        tables = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim  # embeddings (+ untied output)
        return tables + self.n_layers * block + self.dim  # + final norm


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def _check_fields(values: Mapping[str, Any], where: str, cls: Optional[type] = None) -> None:
    """Raise unless every key of ``values`` is a field of ``cls`` (default ``LlamaConfig``)."""
    cls = cls or LlamaConfig
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; {cls.__name__} fields are {sorted(known)}")


def resolve_config(config: Union[LlamaConfig, str, Mapping[str, Any]]) -> LlamaConfig:
    """Accept a ``LlamaConfig``, a preset name, or a mapping (a preset ``name`` plus overrides, or
    every field of a custom shape), as Hydra and ``load_from_checkpoint`` hand them over."""
    return resolve_preset_config(LlamaConfig, _PRESETS, config)


def resolve_preset_config(cls: type, presets: Mapping[str, Mapping[str, Any]], config: Any) -> Any:
    """``config`` as a ``cls`` dataclass with ``cls.from_name`` presets ``presets``: an instance, a
    preset name, or a mapping (a preset ``name`` plus overrides, or every field)."""
    kind = cls.__name__
    if isinstance(config, cls):
        return config
    if isinstance(config, str):
        return cls.from_name(config)
    if isinstance(config, Mapping):
        values = {str(key): value for key, value in config.items()}
        name = values.pop("name", None)
        if name is not None and str(name).lower() in presets:
            return cls.from_name(name, **values)
        _check_fields(values, kind, cls)
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [field for field in required if field != "name" and field not in values]
        if missing:
            raise ValueError(
                f"{kind} {name!r} is not a preset ({', '.join(presets)}) and misses field(s) {missing}; "
                "give a preset name or every field"
            )
        return cls(name=str(name or "custom"), **values)
    raise ValueError(f"config must be a {kind}, a preset name or a mapping, got {type(config).__name__}")
