"""Llama (2 and 3.x) decoder with Meta's module names: ``Llama`` and its blocks, ``build_llama``.

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
      output           nn.Linear(dim, vocab_size, no bias); with ``tie_embeddings`` its weight
                       *is* ``tok_embeddings.weight`` (one Parameter, [Note: tied head])

[Note: tensor-parallel friendly] ``Attention`` never stores a head count: it reshapes with ``-1``
heads and derives the grouped-query repeat factor from the shapes of q and k. Tensor parallelism
(``lightning_zero.models.llama.parallelize_llama``) can therefore split heads by swapping the Linear layers
for column/row-parallel ones and swap ``Llama.loss_fn`` for a vocab-parallel cross entropy,
without touching any attribute here.

[Note: tied head] With ``LlamaConfig.tie_embeddings`` the model has one ``vocab_size x dim``
Parameter, registered twice (``tok_embeddings.weight`` first, so it is the canonical name that
``named_parameters()`` and the engine use; ``output.weight`` is the alias ``state_dict()`` also
lists). Anything that replaces Parameter objects (``to_empty`` from meta, a dtype change,
tensor parallelism's layer swap) re-ties with :meth:`Llama.tie_weights`; :meth:`Llama.init_weights`
does so first. The shared weight is drawn once, with the head's init (truncated N(0, dim^-0.5):
an N(0, 1) table would make the first logits ``sqrt(dim)`` times too large); ``output`` is then
initialized by nothing. A state dict holding only ``tok_embeddings.weight`` (a plain export of a
tied model) loads: the alias is filled from it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.models.checkpointing import CheckpointingLike, checkpointing_mode
from lightning_zero.models.llama.config import LlamaConfig
from lightning_zero.models.llama.rope import rope_tables
from lightning_zero.models.llama.rope_scaling import needs_dynamic_tables


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def gain(self) -> torch.Tensor:
        """The per-channel gain the normalized input is multiplied by (``weight``; sequence
        parallelism routes it through a TP gradient sum, ``models/llama/parallelize.py``)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.gain()


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
        bias = bool(getattr(config, "qkv_bias", False))  # Qwen2.5
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, kv_dim, bias=bias)
        self.wv = nn.Linear(config.dim, kv_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # Per-head RMSNorms on q and k before rotary (Qwen3, ``qk_norm``).
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if getattr(config, "qk_norm", False):
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        # Mistral 7B v0.1: each query sees the last ``sliding_window`` keys (itself included).
        self.sliding_window: Optional[int] = getattr(config, "sliding_window", None)

    recompute_core = False  # selective checkpointing ([Note: checkpointing modes]); set by Llama
    # Context parallelism: set by cp.parallelize_context; x is then a T/cp slice. A
    # cp.ulysses.UlyssesExchange runs the core on T tokens of q_heads/cp heads ([Note: Ulysses
    # attention]); a cp.ring_attention.RingAttention passes k/v blocks around ([Note: ring attention]).
    sequence_exchange: Optional[Any] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (B, T, q_heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)  # (B, T, kv_heads, head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.sequence_exchange is None:
            y = self._core(q, k, v, cos, sin)
        else:  # x is a T/cp slice: Ulysses exchanges heads around the core, or the ring replaces it
            y = self.sequence_exchange.attend(q, k, v, cos, sin, core=self._core, rope=apply_rope)
        return self.wo(y)  # y: (B, T, q_heads * head_dim)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        window = self.sliding_window
        if self.recompute_core and torch.is_grad_enabled():
            return checkpoint(attention_core, q, k, v, cos, sin, window, use_reentrant=False)
        return attention_core(q, k, v, cos, sin, window)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sliding_window: Optional[int] = None,
):
    """Rotary, grouped-query repeat and causal SDPA: q ``(B, T, q_heads, head_dim)``, k and v
    ``(B, T, kv_heads, head_dim)`` -> ``(B, T, q_heads * head_dim)``. What selective checkpointing
    recomputes ([Note: checkpointing modes] in ``lightning_zero/models/checkpointing.py``).
    ``sliding_window``: query ``i`` sees keys ``j`` with ``i - window < j <= i`` (transformers'
    ``sliding_window_overlay``); a sequence no longer than the window is plain causal."""
    batch, seq = q.shape[:2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    repeats = q.size(2) // k.size(2)
    if repeats > 1:  # query head h reads kv head h // repeats, as in Meta's repeat_kv
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
    if sliding_window is not None and seq > sliding_window:
        position = torch.arange(seq, device=q.device)
        distance = position[:, None] - position[None, :]  # query - key
        mask = (distance >= 0) & (distance < sliding_window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, q_heads * head_dim)


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


def init_attention_extras(attention: nn.Module) -> None:
    """The q/k/v biases (zero, as transformers' Qwen2 init) and q/k norm gains (one) of a block,
    where the family has them."""
    for linear in (attention.wq, attention.wk, attention.wv):
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)
    for norm in (attention.q_norm, attention.k_norm):
        if norm is not None:
            norm.reset_parameters()


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy of ``logits`` ``(B, T, vocab)`` against ``targets`` ``(B, T)``, in
    fp32: the mean (``reduction="sum"``: the sum) over the targets other than -100."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


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


def build_llama(
    config: LlamaConfig, weight_source: Optional[Any] = None, model_class: Optional[type] = None
) -> "Llama":
    """Build a :class:`Llama` whose weights depend only on the RNG state and :meth:`Llama.init_weights`.

    The modules are created on the meta device (no default init draws random numbers), then,
    unless the caller asked for meta (``with torch.device("meta")``, as ZeRO-3's sharded init
    does), materialized on the current default device and initialized. Every strategy therefore
    starts from the same weights for the same seed. With ``weight_source`` (pretrained weights,
    see :attr:`Llama.weight_source`) initialization reads them instead of drawing random values.
    ``model_class``: a family built on :class:`Llama` (``MoETransformer``); default ``Llama``.
    """
    target = torch.get_default_device()
    with torch.device("meta"):
        model = (model_class or Llama)(config)
    model.weight_source = weight_source
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    return model


def check_llama_layout(
    config: LlamaConfig,
    dims: Any,
    *,
    owner: str,
    seq_len: Optional[int] = None,
    sequence_parallel: bool = False,
) -> None:
    """The layouts a Llama runs ([Note: layouts a model declares] in ``runtime/parallelize.py``), for the
    model and for ``LlamaLM``: no experts to split (``ep`` must be 1); context parallelism as its
    attention runs it (Ulysses where ``tp * cp`` divides the heads, else ring attention; ``cp``
    divides the sequence length ``seq_len`` when known, ``tp`` the slice under sequence parallelism:
    ``cp.layout.check_context_parallel``). Raises ``ValueError`` naming the fix, and states a
    key/value head repeat or the ring (a warning)."""
    if dims.ep > 1:
        raise ValueError(
            f"ZeroStrategy(ep={dims.ep}): {owner} has no expert layers split over ep; use ep=1 or a"
            " mixture-of-experts model family that splits them"
        )
    import warnings

    from lightning_zero.cp.layout import RingLayout, check_context_parallel, layout_notice

    layout = check_context_parallel(
        dims.cp, tp=dims.tp, model_config=config, seq_len=seq_len, sequence_parallel=sequence_parallel
    )
    window = getattr(config, "sliding_window", None)
    if window is not None and isinstance(layout, RingLayout) and (seq_len is None or seq_len > window):
        raise ValueError(
            f"ZeroStrategy(cp={dims.cp}, tp={dims.tp}): {owner} attends over a sliding window of {window} tokens, "
            f"which ring attention does not apply; pick cp so that tp * cp divides n_heads ({config.n_heads}) "
            "(Ulysses attention keeps the window), or train on sequences no longer than the window"
        )
    notice = layout_notice(layout)
    if notice is not None:
        warnings.warn(f"lightning_zero: {notice}", stacklevel=3)


class Llama(nn.Module):
    """Llama decoder. ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab)``.

    Builds on whatever device is current, so ``with torch.device("meta"): Llama(cfg)`` allocates
    nothing; materialize with ``model.to_empty(device=...)`` then ``model.init_weights()``.

    Attributes:
        loss_fn: ``(logits, targets, reduction="mean") -> loss`` (``"sum"``: summed over the
            counted tokens); tensor parallelism swaps in a vocab-parallel one, context
            parallelism wraps it in the mean over the cp group's tokens ([Note: global token mean]).
        context_parallel_size: cp ranks each sequence is split over (1; ``cp.parallelize_context``
            sets it): ``forward`` then takes a ``T/cp`` slice of each sequence.
        activation_checkpointing: ``"none"`` (``False``), ``"selective"`` (recompute attention's
            core only) or ``"full"`` (``True``: recompute each block in backward, keeping only its
            input); see [Note: checkpointing modes] in ``lightning_zero/models/checkpointing.py``.
        weight_source: ``None`` (random init), or pretrained weights with a
            ``load(module, prefix)`` method (``models.llama.hf.HFLlamaWeights``): then
            :meth:`init_module` reads each unit's tensors (this rank's TP slices) from it.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(self.make_block(config, layer_id) for layer_id in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self._register_load_state_dict_pre_hook(self._fill_tied_alias)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, scaling=config.rope_scaling)
        # Derived from the config, so not saved: the state dict holds only Meta's parameter keys.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_fn: Callable[..., torch.Tensor] = cross_entropy_loss
        # cp ranks one sequence is split over (cp.parallelize_context): the input is a T/cp slice
        self.context_parallel_size = 1
        self.activation_checkpointing: str = "none"
        self.weight_source: Optional[Any] = None
        self.init_weights()

    @classmethod
    def from_pretrained(
        cls,
        path: Union[str, "os.PathLike[str]"],
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        max_seq_len: Optional[int] = None,
    ) -> "Llama":
        """The Llama in a Hugging Face directory (``config.json`` + safetensors or ``.bin`` weights,
        single or sharded), with parameters in ``dtype`` on ``device``; in fp32 its logits equal
        ``transformers.LlamaForCausalLM.from_pretrained(path)``'s. ``max_seq_len``: the rotary
        table length (default: config.json's ``max_position_embeddings``). See ``models/llama/hf.py``."""
        import dataclasses

        from lightning_zero.models.llama.hf import HFLlamaWeights

        config = LlamaConfig.from_hf(path)
        if max_seq_len is not None:
            config = dataclasses.replace(config, max_seq_len=max_seq_len)
        weights = HFLlamaWeights(path, config)
        with torch.device("meta"):
            model = cls(config)
            for module in model.modules():
                for key, param in module._parameters.items():
                    if param is not None:
                        module._parameters[key] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
        model.to_empty(device=device)
        model.tie_weights()
        model.weight_source = weights
        model.init_weights()
        return model

    def hf_export(self) -> Any:
        """This model's Hugging Face layout (``config.family``) for the no-gather export
        (``checkpoint.hf_write.save_hf_pretrained``; ``models/llama/hf.py``)."""
        from lightning_zero.models.llama.hf import hf_export

        return hf_export(self.config)

    def check_parallel_dims(self, dims: Any) -> None:
        """[Note: layouts a model declares] in ``runtime/parallelize.py``: the Fabric door asks the model
        itself (the Trainer door asks ``LlamaLM``). Raises ``ValueError`` naming the fix for a ``cp``
        its heads cannot split over (:func:`check_llama_layout`), or ``ep > 1`` (this model's experts,
        if any, are not split over ep by the door)."""
        check_llama_layout(self.config, dims, owner=type(self).__name__)

    @property
    def activation_checkpointing(self) -> str:
        """``"none"``, ``"selective"`` or ``"full"``; set with those or ``False`` / ``True``."""
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: CheckpointingLike) -> None:
        self._checkpointing = checkpointing_mode(value, "Llama.activation_checkpointing")
        for layer in self.layers:
            if hasattr(layer, "attention"):  # a block another pp rank holds has none (models/llama/pipeline.py)
                layer.attention.recompute_core = self._checkpointing == "selective"

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, make ``output.weight`` the ``tok_embeddings.weight`` Parameter
        (idempotent; see [Note: tied head]). Both have shape ``(vocab_size, dim)``, or under tensor
        parallelism the same ``(vocab_size / tp, dim)`` rows of it."""
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _fill_tied_alias(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """``load_state_dict`` pre-hook: a tied model's ``output.weight`` is its embedding."""
        embedding, alias = prefix + "tok_embeddings.weight", prefix + "output.weight"
        if self.config.tie_embeddings and embedding in state_dict and alias not in state_dict:
            state_dict[alias] = state_dict[embedding]

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(seq_len, head_dim // 2)`` for a forward of ``seq_len`` tokens: the stored
        tables, or for ``dynamic`` rope scaling past its context, tables computed for this length."""
        scaling = self.config.rope_scaling
        if needs_dynamic_tables(scaling, seq_len):
            theta, head_dim = self.config.rope_theta, self.config.head_dim
            return rope_tables(head_dim, seq_len, theta, self.rope_cos.device, scaling, seq_len=seq_len)
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def reset_parameters(self) -> None:
        """Recompute the rotary tables this module owns directly (Lightning's meta-device
        materialization calls this per module; children reset their own parameters)."""
        config = self.config
        cos, sin = rope_tables(
            config.head_dim, config.max_seq_len, config.rope_theta, self.rope_cos.device, config.rope_scaling
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
        A tied model ([Note: tied head]) draws its one table where the embedding's comes, with the
        head's std, and skips ``output``.
        """
        self.tie_weights()
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
        tied = self.config.tie_embeddings
        if tied and module is self.output:
            return True  # its weight is the embedding's, initialized (or read) with it
        if self.weight_source is not None and module is not self:
            # Any submodule (a unit of another wrap policy too): read its tensors by their names.
            prefix = next((name for name, candidate in self.named_modules() if candidate is module), None)
            if prefix is None:
                return False
            self.weight_source.load(module, prefix)
            return True

        def trunc_normal(layer: nn.Module, std: float) -> None:
            _draw_dense(layer, lambda w: nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std, generator=generator))

        if module is self.tok_embeddings and tied:
            trunc_normal(module, self.config.dim**-0.5)  # it is the head too
            return True
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
                self.init_block(layer, layer_id, trunc_normal, generator)
                return True
        return False

    def make_block(self, config: Any, layer_id: int) -> nn.Module:
        """Transformer block ``layer_id`` (a model family built on this decoder returns its own)."""
        return TransformerBlock(config)

    def init_block(self, layer: nn.Module, layer_id: int, trunc_normal: Callable, generator: Any) -> None:
        """Initialize block ``layer_id`` (see :meth:`init_weights`); ``trunc_normal(linear, std)``
        draws a (TP-aware) truncated normal weight."""
        depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
            trunc_normal(linear, 0.02)
        for linear in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
            trunc_normal(linear, depth_std)
        init_attention_extras(layer.attention)
        layer.attention_norm.reset_parameters()
        layer.ffn_norm.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Under context parallelism idx is a T/cp slice; attention runs on all T tokens at their
        # global positions, so the rotary tables cover T ([Note: Ulysses attention] in cp/ulysses.py).
        seq = idx.size(1) * self.context_parallel_size
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len ({self.config.max_seq_len}) of {self.config.name!r}; "
                "shorten the sequences or raise model max_seq_len"
            )
        h = self.tok_embeddings(idx)  # (B, T, dim); (B, T/cp, dim) under context parallelism
        cos, sin = self.rope(seq)  # (T, head_dim / 2) each
        for layer in self.layers:
            if self.activation_checkpointing == "full" and torch.is_grad_enabled():
                # Call the module (not .forward) so hooks on the block, e.g. ZeRO-3's
                # gather/free, run again during the recompute.
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab)
