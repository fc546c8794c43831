"""Llama 2 decoder (Meta's module names), its size presets, and a LightningModule around it.

The module tree matches Meta's reference implementation, so its checkpoints' keys line up
(``tok_embeddings``, ``layers.N.attention.wq``, ``layers.N.feed_forward.w1``, ``norm``, ``output``):

    Llama
      tok_embeddings   nn.Embedding(vocab_size, dim)
      layers[i]        TransformerBlock
        attention_norm   RMSNorm(dim)
        attention        Attention: wq, wk, wv, wo (nn.Linear, no bias)
        ffn_norm         RMSNorm(dim)
        feed_forward     FeedForward: w1 (gate), w3 (up), w2 (down) (nn.Linear, no bias)
      norm             RMSNorm(dim)
      output           nn.Linear(dim, vocab_size, no bias), not tied to tok_embeddings

[Note: tensor-parallel friendly] ``Attention`` never stores a head count: it reshapes with ``-1``
heads and derives the grouped-query repeat factor from the shapes of q and k. Tensor parallelism
(``lightning_zero.tp.parallelize_llama``) can therefore split heads by swapping the Linear layers
for column/row-parallel ones and swap ``Llama.loss_fn`` for a vocab-parallel cross entropy,
without touching any attribute here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchmetrics.aggregation import MeanMetric

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

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
        from lightning_zero.models.llama_hf import config_from_hf

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


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``(max_seq_len, head_dim // 2)``, fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (Meta's interleaved layout) of ``x`` ``(B, T, heads, head_dim)``
    by position; ``cos``/``sin`` are ``(T, head_dim // 2)``."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, heads, head_dim/2, 2)
    even, odd = pairs.unbind(-1)
    cos = cos[None, :, None, :]  # (1, T, 1, head_dim/2)
    sin = sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query key/value heads.

    Head counts come from tensor shapes (see [Note: tensor-parallel friendly]).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (B, T, q_heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (B, T, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = q.size(2) // k.size(2)
        if repeats > 1:  # query head h reads kv head h // repeats, as in Meta's repeat_kv
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, q_heads * head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``logits`` ``(B, T, vocab)`` against ``targets`` ``(B, T)``, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _draw_dense(layer: nn.Module, draw: Callable[[torch.Tensor], Any]) -> None:
    """Initialize ``layer.weight`` with ``draw``; for a tensor-parallel layer, draw the dense
    weight and keep this rank's slice, so every TP rank consumes the same random numbers and the
    result equals the dense model's init (what ZeRO-3's sharded init relies on under TP)."""
    weight = layer.weight
    dim = getattr(weight, "_tp_shard_dim", None)
    tp_size = getattr(layer, "tp_size", 1)
    if dim is None or tp_size == 1:
        draw(weight)
        return
    shape = list(weight.shape)
    shape[dim] *= tp_size
    dense = torch.empty(shape, dtype=weight.dtype, device=weight.device)
    draw(dense)
    weight.copy_(dense.narrow(dim, layer.tp_rank * weight.shape[dim], weight.shape[dim]))


def build_llama(config: LlamaConfig, weight_source: Optional[Any] = None) -> "Llama":
    """Build a :class:`Llama` whose weights depend only on the RNG state and :meth:`Llama.init_weights`.

    The modules are created on the meta device (no default init draws random numbers), then,
    unless the caller asked for meta (``with torch.device("meta")``, as ZeRO-3's sharded init
    does), materialized on the current default device and initialized. Every strategy therefore
    starts from the same weights for the same seed. With ``weight_source`` (pretrained weights,
    see :attr:`Llama.weight_source`) initialization reads them instead of drawing random values.
    """
    target = torch.get_default_device()
    with torch.device("meta"):
        model = Llama(config)
    model.weight_source = weight_source
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    return model


class Llama(nn.Module):
    """Llama decoder. ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab)``.

    Builds on whatever device is current, so ``with torch.device("meta"): Llama(cfg)`` allocates
    nothing; materialize with ``model.to_empty(device=...)`` then ``model.init_weights()``.

    Attributes:
        loss_fn: ``(logits, targets) -> mean loss``; tensor parallelism swaps in a vocab-parallel one.
        activation_checkpointing: recompute each block in backward instead of keeping its
            activations (saves about ``n_layers`` blocks' activations for one more forward).
        weight_source: ``None`` (random init), or pretrained weights with a
            ``load(module, prefix)`` method (``models.llama_hf.HFLlamaWeights``): then
            :meth:`init_module` reads each unit's tensors (this rank's TP slices) from it.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        # Derived from the config, so not saved: the state dict holds only Meta's parameter keys.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
        self.activation_checkpointing = False
        self.weight_source: Optional[Any] = None
        self.init_weights()

    @classmethod
    def from_pretrained(
        cls, path: Union[str, "os.PathLike[str]"], dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
    ) -> "Llama":
        """The Llama in a Hugging Face directory (``config.json`` + safetensors or ``.bin`` weights,
        single or sharded), with parameters in ``dtype`` on ``device``; in fp32 its logits equal
        ``transformers.LlamaForCausalLM.from_pretrained(path)``'s. See ``models/llama_hf.py``."""
        from lightning_zero.models.llama_hf import HFLlamaWeights

        config = LlamaConfig.from_hf(path)
        weights = HFLlamaWeights(path, config)
        with torch.device("meta"):
            model = cls(config)
            for module in model.modules():
                for key, param in module._parameters.items():
                    if param is not None:
                        module._parameters[key] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
        model.to_empty(device=device)
        model.weight_source = weights
        model.init_weights()
        return model

    def reset_parameters(self) -> None:
        """Recompute the rotary tables this module owns directly (Lightning's meta-device
        materialization calls this per module; children reset their own parameters)."""
        cos, sin = rope_tables(
            self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, device=self.rope_cos.device
        )
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """(Re)initialize every parameter and the rotary tables, in a fixed order.

        Same ``generator`` state (or global seed when ``None``) -> same weights. The scheme follows
        torchtitan's Llama: embeddings N(0, 1); wq/wk/wv/w1 truncated N(0, 0.02); wo/w2/w3 scaled
        down with depth, 0.02 / sqrt(2 (layer + 1)); output truncated N(0, dim^-0.5); norms 1.
        ``generator`` must live on the parameters' device. The order is that of
        :meth:`init_module` over ``tok_embeddings, layers..., norm, output``, so a strategy that
        materializes one unit at a time (ZeRO-3's sharded init) draws the same numbers.
        """
        for module in (self.tok_embeddings, *self.layers, self.norm, self.output, self):
            self.init_module(module, generator)

    @torch.no_grad()
    def init_module(self, module: nn.Module, generator: Optional[torch.Generator] = None) -> bool:
        """Initialize one of this model's units as :meth:`init_weights` does.

        Returns True when ``module``'s whole subtree was initialized (embedding, a block, the
        final norm, the head); for the model itself only the rotary tables are recomputed and
        False is returned (its children are separate units). Unknown modules: False.
        With :attr:`weight_source` set, the unit's tensors are read from it instead of drawn.
        """
        if self.weight_source is not None and module is not self:
            # Any submodule (a unit of another wrap policy too): read its tensors by their names.
            prefix = next((name for name, candidate in self.named_modules() if candidate is module), None)
            if prefix is None:
                return False
            self.weight_source.load(module, prefix)
            return True

        def trunc_normal(layer: nn.Module, std: float) -> None:
            _draw_dense(layer, lambda w: nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std, generator=generator))

        if module is self.tok_embeddings:
            _draw_dense(module, lambda w: nn.init.normal_(w, generator=generator))
            return True
        if module is self.output:
            trunc_normal(self.output, self.config.dim**-0.5)
            return True
        if module is self.norm:
            self.norm.reset_parameters()
            return True
        if module is self:
            self.reset_parameters()
            return False
        for layer_id, layer in enumerate(self.layers):
            if module is layer:
                depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
                for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                    trunc_normal(linear, 0.02)
                for linear in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                    trunc_normal(linear, depth_std)
                layer.attention_norm.reset_parameters()
                layer.ffn_norm.reset_parameters()
                return True
        return False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.size(1)
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len ({self.config.max_seq_len}) of {self.config.name!r}; "
                "shorten the sequences or raise model max_seq_len"
            )
        h = self.tok_embeddings(idx)  # (B, T, dim)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Call the module (not .forward) so hooks on the block, e.g. ZeRO-3's
                # gather/free, run again during the recompute.
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab)


# --------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------


@dataclass
class WarmupCosine:
    """LR multiplier per optimizer step: linear warmup to 1 over ``warmup_steps``, then cosine
    decay to ``min_lr_ratio`` at ``max_steps``, flat after. A plain object, so ``LambdaLR``
    saves and restores it in checkpoints."""

    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PerplexityFromLoss(MeanMetric):
    """``exp`` of the (token-weighted) mean cross entropy, over all ranks."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T+1]`` token ids -> inputs ``[:, :-1]`` and targets ``[:, 1:]``."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.size(1) < 2 or batch.is_floating_point():
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(
            f"LlamaLM expects an integer token batch of shape [B, T+1] with T >= 1, got {shape}; "
            "use lightning_zero.data.TokenDataModule or yield such tensors"
        )
    return batch[:, :-1], batch[:, 1:]


class LlamaLM(L.LightningModule):
    """Next-token language modelling on a :class:`Llama`.

    Args:
        config: a preset name (``tiny``, ``7b``, ``13b``, ``70b``), a ``LlamaConfig``, or a mapping
            (preset ``name`` plus overrides, or every field); ``None``: ``tiny``, or with
            ``init_from`` the shape in its ``config.json``.
        lr: peak learning rate of AdamW, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW decoupled decay on matrices and embeddings (never on norm gains).
        betas: AdamW (beta1, beta2).
        warmup_steps: optimizer steps of linear warmup.
        max_steps: optimizer step where the cosine decay reaches ``min_lr_ratio * lr``; ``None``
            takes the trainer's estimate of total steps.
        min_lr_ratio: final learning rate as a fraction of ``lr``, in [0, 1].
        activation_checkpointing: recompute each transformer block in backward.
        init_from: a Hugging Face Llama directory (``config.json`` + safetensors/``.bin``) to
            start from instead of random init. The shape comes from its ``config.json``; a
            ``config`` that sets a disagreeing shape field raises ``ValueError`` (``max_seq_len``
            may differ). Config, file headers, names and shapes are checked here, before
            anything trains; the tensors are read when the model is built, each rank reading
            only what it keeps, one unit at a time (see docs/pretrained.md).

    The model is built in ``configure_model`` (so a strategy can build it on the meta device or
    sharded); when the strategy's device mesh has a ``tp`` dimension larger than 1, it is
    parallelized there with :func:`lightning_zero.tp.parallelize_llama`.
    """

    def __init__(
        self,
        config: Union[None, LlamaConfig, str, Mapping[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: bool = False,
        init_from: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.pretrained: Optional[Any] = None  # models.llama_hf.HFLlamaWeights when init_from is set
        if init_from is not None:
            from lightning_zero.models.llama_hf import HFLlamaWeights, pretrained_config

            init_from = str(init_from)
            self.config = pretrained_config(config, init_from)
            self.pretrained = HFLlamaWeights(init_from, self.config)
        else:
            self.config = resolve_config("tiny" if config is None else config)
        betas = tuple(float(beta) for beta in betas)
        if not lr > 0:
            raise ValueError(f"LlamaLM: lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"LlamaLM: weight_decay must be >= 0, got {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"LlamaLM: betas must be two numbers in [0, 1), got {betas}")
        if warmup_steps < 0:
            raise ValueError(f"LlamaLM: warmup_steps must be >= 0, got {warmup_steps}")
        if max_steps is not None and max_steps < max(1, warmup_steps):
            raise ValueError(
                f"LlamaLM: max_steps ({max_steps}) must be >= warmup_steps ({warmup_steps}) and >= 1; "
                "lower warmup_steps or pass max_steps=None to follow the trainer"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"LlamaLM: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        # save_hyperparameters() records the constructor's locals: rebind them to plain types so
        # checkpoints, loggers' hparams and load_from_checkpoint see a dict and a list.
        config, betas = dataclasses.asdict(self.config), list(betas)
        self.save_hyperparameters()
        self.model: Optional[Llama] = None
        self._tp_applied = False
        self.eval_metrics = nn.ModuleDict(
            {f"{stage}_loss": MeanMetric() for stage in ("val", "test")}
            | {f"{stage}_ppl": PerplexityFromLoss() for stage in ("val", "test")}
        )

    def configure_model(self) -> None:
        tp_mesh = self._tp_mesh()
        if self.model is None:
            target = torch.get_default_device()
            if self.pretrained is not None and tp_mesh is not None and target.type != "meta":
                # Pretrained under TP: split on the meta device, then read only this rank's slices.
                from lightning_zero.tp.layers import mark_tp_params

                with torch.device("meta"):
                    self.model = build_llama(self.config, self.pretrained)
                self._parallelize(tp_mesh)
                self.model.to_empty(device=target)
                mark_tp_params(self.model)  # to_empty made new Parameter objects
                self.model.init_weights()
            else:
                self.model = build_llama(self.config, self.pretrained)
        self.model.activation_checkpointing = self.hparams.activation_checkpointing
        if tp_mesh is not None and not self._tp_applied:
            self._parallelize(tp_mesh)

    def _tp_mesh(self) -> Optional[Any]:
        """The strategy's ``tp`` sub-mesh when it has more than one rank, else ``None``."""
        mesh = self.device_mesh
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
            return None
        return mesh["tp"]

    def _parallelize(self, tp_mesh: Any) -> None:
        from lightning_zero.tp import parallelize_llama

        # The strategy's counter, when it has one, so tp traffic is counted beside dp's.
        counter = getattr(self._trainer.strategy, "comm_counter", None) if self._trainer is not None else None
        parallelize_llama(self.model, tp_mesh, counter=counter)
        self._tp_applied = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._built_model()(idx)

    def _built_model(self) -> Llama:
        if self.model is None:
            raise RuntimeError("LlamaLM.model is not built yet; the Trainer calls configure_model(), or call it")
        return self.model

    def _loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        inputs, targets = split_batch(batch)
        model = self._built_model()
        return model.loss_fn(model(inputs), targets), targets.numel()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: torch.Tensor, stage: str) -> None:
        loss, num_tokens = self._loss(batch)
        for kind in ("loss", "ppl"):
            metric = self.eval_metrics[f"{stage}_{kind}"]
            metric.update(loss.detach(), weight=num_tokens)
            # Logging the metric object lets Lightning compute (synced over ranks) and reset it per epoch.
            self.log(f"{stage}_{kind}", metric, prog_bar=kind == "loss")

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for param in self._built_model().parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
        )
        schedule = WarmupCosine(self.hparams.warmup_steps, self._total_steps(), self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.hparams.max_steps is not None:
            return self.hparams.max_steps
        estimate = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimate):
            raise ValueError(
                "LlamaLM: max_steps=None needs a finite training length; set Trainer(max_steps=...) "
                "or max_epochs, or pass LlamaLM(max_steps=...)"
            )
        return max(1, int(estimate))
