"""Mixture-of-experts shapes: ``MoEConfig``, its presets and ``resolve_moe_config``. Plain Python
(no torch), so the planner reads it as it reads ``LlamaConfig``.

Presets (published ``config.json`` values):

- ``tiny_moe``: a CPU test model, Mixtral-style (softmax top-2 of 4 experts, renormalized).
- ``tiny_moe_shared``: a CPU test model, DeepSeek-style (a dense first layer, sigmoid routing with
  a selection bias, one shared expert, top-2 of 8 fine-grained experts, a routed scaling factor).
- ``mixtral_8x7b``: Mixtral 8x7B (46.7B parameters, 12.9B active per token).
- ``qwen3_30b_a3b``: Qwen3-30B-A3B (128 experts, top-8 renormalized, q/k norms, head_dim 128).
- ``deepseek_v3_671b``: DeepSeek-V3's expert shape (3 dense layers then 58 MoE layers of 256
  routed + 1 shared experts, top-8 sigmoid routing with a bias, scaling 2.5). Its multi-head latent
  attention is approximated by grouped-query attention of the same head count (128 heads of 128,
  8 KV heads: ~249M attention parameters a layer against MLA's ~187M); its node-limited group
  routing (``n_group``, ``topk_group``) and multi-token prediction are left out. 675B parameters.
  Its selection bias moves by the auxiliary-loss-free rule at DeepSeek's rate (1e-3).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_zero.models.llama.config import DecoderShape, _check_fields, resolve_preset_config
from lightning_zero.models.llama.rope_scaling import normalize_rope_scaling

ROUTERS = ("softmax", "sigmoid")

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny_moe": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128,
                     n_experts=4, top_k=2, expert_ffn_dim=64),
    "tiny_moe_shared": dict(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            max_seq_len=128, n_experts=8, top_k=2, expert_ffn_dim=32, n_shared_experts=1,
                            n_dense_layers=1, router="sigmoid", router_bias=True, routed_scaling=2.5,
                            qk_norm=True),
    "mixtral_8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, expert_ffn_dim=14336,
                         aux_loss_coef=0.02, z_loss_coef=0.0),
    "qwen3_30b_a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          ffn_dim=6144, max_seq_len=40960, norm_eps=1e-6, rope_theta=1e6, n_experts=128, top_k=8,
                          expert_ffn_dim=768, qk_norm=True, aux_loss_coef=0.001, z_loss_coef=0.0),
    "deepseek_v3_671b": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=8, head_dim=128,
                             ffn_dim=18432, max_seq_len=4096, norm_eps=1e-6, n_experts=256, top_k=8,
                             expert_ffn_dim=2048, n_shared_experts=1, n_dense_layers=3, router="sigmoid",
                             router_bias=True, routed_scaling=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4,
                             z_loss_coef=0.0),
}  # fmt: skip


@dataclass
class MoEConfig(DecoderShape):
    """Shape of a decoder whose feed-forward layers are mixtures of experts.

    The attention, norms and rotary embedding are Llama's (``models/llama``); the fields they read
    (``dim``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``max_seq_len``, ``norm_eps``,
    ``rope_theta``, ``rope_scaling``) mean what they mean in ``LlamaConfig``.

    Args:
        ffn_dim: SwiGLU width of the dense layers (the first ``n_dense_layers``).
        head_dim: per-head width; ``None``: ``dim // n_heads`` (Qwen3 and DeepSeek set it apart).
        n_experts: routed experts per MoE layer.
        top_k: experts each token is sent to.
        expert_ffn_dim: SwiGLU width of one routed expert.
        n_shared_experts: experts every token goes through (DeepSeek), fused into one SwiGLU of
            width ``n_shared_experts * expert_ffn_dim``.
        n_dense_layers: leading layers with a dense SwiGLU instead of experts (DeepSeek's
            ``first_k_dense_replace``).
        router: ``"softmax"`` (Mixtral, Qwen3-MoE: probabilities over all experts, top-k) or
            ``"sigmoid"`` (DeepSeek-V3: independent scores, top-k).
        norm_topk_prob: divide the chosen k weights by their sum (Mixtral always; Qwen3's flag).
        router_bias: a per-expert bias added to the scores for *choosing* experts only (not to
            the weights): DeepSeek-V3's ``e_score_correction_bias``, a buffer (not trained by
            gradient; see [Note: routing] in ``models/moe/router.py``).
        routed_scaling: factor on the routed experts' weights (DeepSeek-V3: 2.5).
        bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing (its ``gamma``): after each
            optimizer step every MoE layer's selection bias moves by ``bias_update_rate *
            sign(mean load - load)`` per expert, the loads being the step's assignments over all
            data-parallel ranks ([Note: bias update] in ``models/moe/router.py``). ``0``: off (the
            bias stays what was loaded). Needs ``router_bias``.
        qk_norm: per-head RMSNorm on q and k before rotary (Qwen3).
        aux_loss_coef: weight of the load-balancing loss summed over MoE layers.
        z_loss_coef: weight of the router z-loss (mean squared log-sum-exp of the router logits)
            summed over MoE layers.
        capacity_factor: ``None`` drops no token; a float caps each expert at
            ``ceil(capacity_factor * tokens * top_k / n_experts)`` assignments of a rank's
            micro-batch, dropping the later tokens' assignments (they pass on the residual).
    """

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    head_dim: Optional[int] = None
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    router: str = "softmax"
    norm_topk_prob: bool = True
    router_bias: bool = False
    routed_scaling: float = 1.0
    bias_update_rate: float = 0.0
    qk_norm: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        where = f"MoEConfig({self.name!r})"
        ints = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "n_experts",
                "top_k", "expert_ffn_dim")  # fmt: skip
        for field in ints:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {field} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"{where}: dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or set head_dim"
                )
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2 or self.head_dim < 2:
            raise ValueError(f"{where}: head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{where}: n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.top_k > self.n_experts:
            raise ValueError(f"{where}: top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        if self.router not in ROUTERS:
            raise ValueError(f"{where}: router must be one of {ROUTERS}, got {self.router!r}")
        if self.router_bias and self.router != "sigmoid":
            raise ValueError(f"{where}: router_bias is DeepSeek-V3's selection bias; set router='sigmoid' with it")
        for field in ("n_shared_experts", "n_dense_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {field} must be an int >= 0, got {value!r}")
        if self.n_dense_layers >= self.n_layers:
            raise ValueError(
                f"{where}: n_dense_layers ({self.n_dense_layers}) leaves no MoE layer of n_layers ({self.n_layers})"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"{where}: capacity_factor must be None (drop nothing) or > 0, got {self.capacity_factor}")
        if self.bias_update_rate < 0:
            raise ValueError(f"{where}: bias_update_rate must be >= 0 (0: off), got {self.bias_update_rate}")
        if self.bias_update_rate > 0 and not self.router_bias:
            raise ValueError(
                f"{where}: bias_update_rate ({self.bias_update_rate}) moves the selection bias; set router_bias=True "
                "(router='sigmoid') with it, or bias_update_rate=0"
            )
        for field in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, field) < 0:
                raise ValueError(f"{where}: {field} must be >= 0, got {getattr(self, field)}")
        if not self.norm_eps > 0 or not self.rope_theta > 0 or not self.routed_scaling > 0:
            raise ValueError(f"{where}: norm_eps, rope_theta and routed_scaling must be positive")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, where=f"{where}.rope_scaling")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def shared_ffn_dim(self) -> int:
        """Width of the fused shared-expert SwiGLU (0: none)."""
        return self.n_shared_experts * self.expert_ffn_dim

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "MoEConfig":
        """The preset ``name`` (see the module doc), with optional field overrides."""
        key = str(name).lower()
        if key not in _PRESETS:
            raise ValueError(f"unknown MoE preset {name!r}; available: {', '.join(_PRESETS)}")
        _check_fields(overrides, f"MoEConfig.from_name({name!r})", MoEConfig)
        return cls(**{"name": key, **copy.deepcopy(_PRESETS[key]), **overrides})

    def attention_params(self) -> int:
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim  # type: ignore[operator]
        norms = 2 * self.head_dim if self.qk_norm else 0  # type: ignore[operator]
        return 2 * self.dim * q_dim + 2 * self.dim * kv_dim + norms

    def expert_params_per_layer(self) -> int:
        """Routed experts' parameters of one MoE layer (all ``n_experts``)."""
        return self.n_experts * 3 * self.dim * self.expert_ffn_dim

    def expert_params(self) -> int:
        """Every routed expert's parameters: what expert parallelism splits over ``ep``."""
        return self.n_moe_layers * self.expert_params_per_layer()

    def num_params(self) -> int:
        """Exact parameter count (matches ``sum(p.numel() for p in MoETransformer(c).parameters())``)."""
        block = self.attention_params() + 2 * self.dim
        dense = self.n_dense_layers * (block + 3 * self.dim * self.ffn_dim)
        moe_layer = block + self.n_experts * self.dim + 3 * self.dim * self.shared_ffn_dim
        tables = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        return tables + dense + self.n_moe_layers * moe_layer + self.expert_params() + self.dim

    def active_params(self) -> int:
        """Parameters one token's forward touches (``top_k`` routed experts a layer)."""
        routed_off = self.n_moe_layers * (self.n_experts - self.top_k) * 3 * self.dim * self.expert_ffn_dim
        return self.num_params() - routed_off


def moe_preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def resolve_moe_config(config: Union[MoEConfig, str, Mapping[str, Any]]) -> MoEConfig:
    """A ``MoEConfig``, a preset name, or a mapping (a preset ``name`` plus overrides, or every field)."""
    return resolve_preset_config(MoEConfig, _PRESETS, config)


def check_moe_layout(config: MoEConfig, *, ep: int = 1, tp: int = 1) -> None:
    """Raise ``ValueError`` naming the fix unless ``config``'s experts split evenly over ``ep``
    ranks and, with ``tp > 1``, the MoE layers can run on sequence shards: no capacity factor
    ([Note: experts and tensor parallelism] in ``models/moe/parallelize.py``; the sequence length must split
    over ``tp``, checked where it is known). Plain arithmetic, called before any process group
    starts."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if config.n_experts % ep:
        fits = [d for d in range(1, config.n_experts + 1) if config.n_experts % d == 0]
        raise ValueError(
            f"ep({ep}) does not divide n_experts({config.n_experts}) of {config.name!r}: each ep rank holds "
            f"n_experts / ep experts; pick ep from {fits}"
        )
    if tp == 1:
        return
    if config.capacity_factor is not None:
        raise ValueError(
            f"capacity_factor({config.capacity_factor}) with tensor_parallel_size({tp}) for {config.name!r}: the "
            "capacity would count each TP rank's sequence shard, not the micro-batch, and drop other tokens than "
            "without TP; use capacity_factor=None (drop nothing) or tensor_parallel_size=1"
        )
