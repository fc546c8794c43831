"""LitGPT's causal self-attention on a context-parallel slice (Ulysses or ring, from ``cp/``).

[Note: LitGPT attention under cp] LitGPT's ``CausalSelfAttention.forward`` takes its sequence
length from its input and its rotary tables from ``GPT.forward`` (``cos[:T]``): on a ``T/cp``
slice both would be the slice's, so the slice would attend only to itself, at positions
``0 .. T/cp - 1``. :func:`context_parallel_attention` puts the attention's state (its ``qkv``,
``proj``, ``norm_q``, ``norm_k``: parameter names, values and LoRA layers unchanged) into a module
whose class puts :class:`ContextParallelSelfAttention` before LitGPT's own (so a load still renames
keys as LitGPT's class does). It runs LitGPT's training path: the fused ``qkv`` projection split
into ``n_head`` query and ``n_query_groups`` key/value heads, the optional q/k norms, rotary over
the first ``rope_n_elem`` features at *global* positions, grouped-query attention with LitGPT's
scale, then ``proj``; between them the cp group's exchange (``cp/ulysses.py``: heads for the
sequence and back; ``cp/ring_attention.py``: key/value blocks around the ring). The global
rotary tables come from :class:`RopeTables`, which ``GPT``'s forward pre-hook fills for the
forward it starts (``models/litgpt/parallelize.py``). Configurations this path does not cover
(sliding windows, attention soft-capping, latent attention, per-layer rope indices, the adapter's
prefix) are refused before anything is split (``check_litgpt_layout``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class RopeTables:
    """The rotary tables of the whole (padded) sequence for the forward in progress: ``cos`` and
    ``sin`` ``(T, rope_n_elem)``, set by the model's forward pre-hook, read by every attention."""

    def __init__(self) -> None:
        self.cos: Optional[torch.Tensor] = None
        self.sin: Optional[torch.Tensor] = None


class ContextParallelSelfAttention(nn.Module):
    """[Note: LitGPT attention under cp]: the forward of a LitGPT ``CausalSelfAttention`` on a cp
    slice, exchanging over ``exchange`` (a ``UlyssesExchange`` or ``RingAttention``). Placed before
    the attention's own class by :func:`context_parallel_attention`, so everything else (its
    children, its state-dict key renames) stays LitGPT's."""

    exchange: Any
    tables: RopeTables

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
        input_pos_maxp1: Optional[int] = None,
    ) -> torch.Tensor:
        # cos/sin are GPT.forward's tables of the slice's length; the whole sequence's are in self.tables
        config = self.config
        batch, shard, _ = x.shape  # (B, T/cp, n_embd)
        head_size, n_head, n_groups = config.head_size, config.n_head, config.n_query_groups
        q, k, v = self.qkv(x).split((n_head * head_size, n_groups * head_size, n_groups * head_size), dim=-1)
        if config.norm_qk and config.norm_qk_type == "olmo2":
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.view(batch, shard, n_head, head_size)  # (B, T/cp, n_head, hs)
        k = k.view(batch, shard, n_groups, head_size)  # (B, T/cp, n_query_groups, hs)
        v = v.view(batch, shard, n_groups, head_size)
        if config.norm_qk and config.norm_qk_type == "default":
            q, k = self.norm_q(q), self.norm_k(k)  # per head: the layout of the other dims does not matter
        y = self.exchange.attend(q, k, v, self.tables.cos, self.tables.sin, core=self._core, rope=self._rope)
        return self.proj(y)  # y: (B, T/cp, n_head * hs)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """LitGPT's ``apply_rope`` on the first ``rope_n_elem`` features: x ``(B, S, heads, hs)``,
        cos/sin ``(S, rope_n_elem)`` -> ``(B, S, heads, hs)``."""
        from litgpt.model import apply_rope

        n_elem = self.config.rope_n_elem
        heads_first = x.transpose(1, 2)  # (B, heads, S, hs), as LitGPT rotates
        roped = apply_rope(heads_first[..., :n_elem], cos.unsqueeze(0), sin.unsqueeze(0))
        return torch.cat((roped, heads_first[..., n_elem:]), dim=-1).transpose(1, 2)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotary, grouped-query repeat and causal attention with LitGPT's scale over whole
        sequences: q ``(B, T, q_heads, hs)``, k and v ``(B, T, kv_heads, hs)`` -> ``(B, T, q_heads * hs)``."""
        batch, seq = q.shape[:2]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
        repeats = q.size(1) // k.size(1)
        if repeats > 1:  # query head h reads key/value head h // repeats, as LitGPT's repeat_interleave
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=attention_scale(self.config, self.mscale),
                                           is_causal=True)  # fmt: skip
        return y.transpose(1, 2).reshape(batch, seq, -1)


_CLASSES: dict[type, type] = {}


def context_parallel_attention(attention: nn.Module, exchange: Any, tables: RopeTables) -> nn.Module:
    """``attention`` (a LitGPT ``CausalSelfAttention``, LoRA's included) as a new module of the class
    ``(ContextParallelSelfAttention, type(attention))`` holding the same state: the same ``qkv``,
    ``proj`` and norms, so parameter names, values and LoRA layers are unchanged, and a load renames
    keys as LitGPT's own class does (LoRA's: a base model's ``qkv.weight`` into ``qkv.linear.weight``)."""
    base = type(attention)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"ContextParallel{base.__name__}", (ContextParallelSelfAttention, base),
                              {"__module__": __name__})  # fmt: skip
    parallel = _CLASSES[base].__new__(_CLASSES[base])
    parallel.__dict__.update(attention.__dict__)  # the module's state: children, config, hooks
    parallel.exchange, parallel.tables = exchange, tables
    return parallel


def attention_scale(config: Any, mscale: float) -> float:
    """LitGPT's ``scaled_dot_product_attention`` scale: ``mscale**2 / sqrt(attention_scores_scalar or head_size)``."""
    return mscale * mscale / (config.attention_scores_scalar or config.head_size) ** 0.5
