"""A decoder whose feed-forward layers are mixtures of experts, on Llama's attention and norms.

    MoETransformer
      tok_embeddings   nn.Embedding(vocab_size, dim)
      layers[i]        MoEBlock
        attention_norm   RMSNorm(dim)                          (models/llama)
        attention        Attention: wq, wk, wv, wo (+ q_norm, k_norm with qk_norm)   (models/llama)
        ffn_norm         RMSNorm(dim)
        feed_forward     FeedForward (the first n_dense_layers)  (models/llama)
        moe              MoE (the others):
          router           Router: weight (n_experts, dim) [+ bias buffer]   (router.py)
          experts          GroupedExperts: w1, w3 (E, expert_ffn, dim), w2 (E, dim, expert_ffn)
          shared           FeedForward of width n_shared * expert_ffn (DeepSeek), or absent
      norm             RMSNorm(dim)
      output           nn.Linear(dim, vocab_size, no bias)

Each ``MoE`` keeps what its last forward decided: ``aux`` (balance and z losses, fp32 scalars with
their graph) and ``load`` (assignments per expert, a device tensor: no host read). The model sums
the losses in :meth:`MoETransformer.aux_loss` and accumulates the loads and losses for the
monitor (:meth:`MoETransformer.take_moe_stats`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.ep.dispatch import ExpertParallel, route_to_experts
from lightning_zero.models.llama.model import Attention, FeedForward, Llama, RMSNorm, build_llama, check_llama_layout
from lightning_zero.models.moe.config import MoEConfig, check_moe_layout
from lightning_zero.models.moe.experts import GroupedExperts, mark_expert_params
from lightning_zero.models.moe.router import (
    Router,
    TensorParallelShard,
    balance_loss,
    bias_update,
    expert_counts,
    tp_aux_losses,
    z_loss,
)
from lightning_zero.tp.layers import gather_to_replicated_region, split_to_sequence_region


class _Width(NamedTuple):
    """The two fields Llama's ``FeedForward`` reads."""

    dim: int
    ffn_dim: int


class SharedExperts(FeedForward):
    """DeepSeek's shared experts: one SwiGLU of width ``n_shared * expert_ffn_dim`` (Llama's
    ``FeedForward``, same names), whose weights take ``tp_grad_sum`` under tensor parallelism
    ([Note: experts and tensor parallelism] in ``models/moe/parallelize.py``)."""

    tp_grad_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_grad_sum is None:
            return super().forward(x)
        w1, w3, w2 = (self.tp_grad_sum(linear.weight) for linear in (self.w1, self.w3, self.w2))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(nn.Module):
    """Router, routed experts and optional shared experts (see the module doc)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = Router(config.dim, config.n_experts, config.top_k, config.router, config.norm_topk_prob,
                             config.router_bias, config.routed_scaling)  # fmt: skip
        self.experts = GroupedExperts(config.dim, config.expert_ffn_dim, config.n_experts)
        self.shared = SharedExperts(_Width(config.dim, config.shared_ffn_dim)) if config.n_shared_experts else None
        self.n_experts = config.n_experts
        self.capacity_factor = config.capacity_factor
        self.ep: Optional[ExpertParallel] = None  # set by lightning_zero.models.moe.parallelize.parallelize_experts
        self.tp: Optional[TensorParallelShard] = None  # set by lightning_zero.models.moe.parallelize.parallelize_moe_tp
        self.aux: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.load: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp is not None and not tp.sequence_parallel:  # replicated (B, T, dim): run on this rank's tokens
            shard = split_to_sequence_region(x, tp.group, tp.counter)
            return gather_to_replicated_region(self._forward_tokens(shard), tp.group, tp.counter)
        return self._forward_tokens(x)

    def _forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (N, dim): under TP, this rank's sequence shard
        routing = self.router(tokens)
        counts = expert_counts(routing.expert_ids, self.n_experts)
        if self.tp is None:
            self.aux = (balance_loss(routing, counts), z_loss(routing))
            self.load = counts.detach()
        else:  # the losses and loads of the whole micro-batch, as without TP
            balance, z, all_counts = tp_aux_losses(routing, counts, self.tp)
            self.aux, self.load = (balance, z), all_counts
        out = route_to_experts(tokens, routing.expert_ids, routing.weights, counts, self.experts,
                               capacity_factor=self.capacity_factor, ep=self.ep)  # fmt: skip
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(x.shape)


class MoEBlock(nn.Module):
    """Pre-norm residual block: Llama's attention, then a dense SwiGLU or a :class:`MoE`."""

    def __init__(self, config: MoEConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)  # type: ignore[arg-type]  (reads LlamaConfig's fields, qk_norm too)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if layer_id < config.n_dense_layers:
            self.feed_forward: Optional[FeedForward] = FeedForward(config)  # type: ignore[arg-type]
            self.moe: Optional[MoE] = None
        else:
            self.feed_forward, self.moe = None, MoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))


def build_moe(config: MoEConfig, weight_source: Optional[Any] = None) -> "MoETransformer":
    """A :class:`MoETransformer` whose weights depend only on the RNG state (``build_llama``'s rule)."""
    return build_llama(config, weight_source, MoETransformer)  # type: ignore[arg-type,return-value]


class MoETransformer(Llama):
    """``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab)``; after it,
    :meth:`aux_loss` is the weighted sum of the MoE layers' balance and z losses.

    Llama's decoder (embedding, rotary tables, forward, checkpointing, tied head, init order)
    with :class:`MoEBlock` blocks: see the module doc. Initialization is Llama's scheme plus:
    router N(0, 0.02) truncated, experts' ``w1`` like ``w1`` and ``w2``/``w3`` depth-scaled, drawn
    expert by expert over *all* ``n_experts`` so an expert-parallel rank keeps the rows the whole
    model would hold (the same random numbers at any ``ep``)."""

    def hf_export(self) -> Any:
        """This model's Hugging Face layout (Mixtral or Qwen3-MoE) for the no-gather export
        (``checkpoint.hf_write.save_hf_pretrained``; ``models/moe/hf.py``)."""
        from lightning_zero.models.moe.hf import hf_export

        return hf_export(self.config)

    def __init__(self, config: MoEConfig) -> None:
        self._load_sum: Optional[torch.Tensor] = None  # (n_moe_layers, E) assignments since last taken
        self._aux_sum: Optional[torch.Tensor] = None  # (balance, z) summed over those forwards
        self._forwards = 0
        self._bias_load: Optional[torch.Tensor] = None  # (n_moe_layers, E) int64 since the last bias update
        super().__init__(config)  # type: ignore[arg-type]

    @classmethod
    def from_pretrained(cls, path: Any, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                        max_seq_len: Optional[int] = None) -> "MoETransformer":  # fmt: skip
        """The model in a Hugging Face Mixtral or Qwen3-MoE directory (``models/moe/hf.py``), with
        parameters in ``dtype`` on ``device``; in fp32 its logits equal transformers'."""
        from lightning_zero.models.moe.hf import HFMoEWeights, config_from_hf

        config = config_from_hf(path, max_seq_len)
        weights = HFMoEWeights(path, config)
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.to(dtype)
        model.mark_expert_params()
        model.tie_weights()
        model.weight_source = weights
        model.init_weights()
        return model

    def check_parallel_dims(self, dims: Any) -> None:
        """[Note: layouts a model declares] in ``runtime/parallelize.py``: the Fabric door asks the model
        itself (the Trainer door asks ``MoELM``). ``ep`` must divide the experts, and with ``tp > 1``
        no capacity factor (:func:`~lightning_zero.models.moe.config.check_moe_layout`); ``cp`` as
        Llama's attention runs it. Raises ``ValueError`` naming the fix."""
        check_moe_layout(self.config, ep=dims.ep, tp=dims.tp)
        check_llama_layout(self.config, dataclasses.replace(dims, ep=1), owner=type(self).__name__)

    def make_block(self, config: Any, layer_id: int) -> nn.Module:
        return MoEBlock(config, layer_id)

    def moe_layers(self) -> list[MoE]:
        """This rank's MoE layers (under pp, those of its stages: another rank's block is a
        ``HeldElsewhere``, ``models/llama/pipeline.py``)."""
        return [moe for moe in (getattr(layer, "moe", None) for layer in self.layers) if moe is not None]

    def mark_expert_params(self) -> None:
        """(Re)mark every stacked expert Parameter ([Note: stacked experts]); anything that makes new
        Parameter objects (``to_empty`` from meta, a dtype change) drops the marks."""
        for moe in self.moe_layers():
            mark_expert_params(moe.experts)

    def init_block(self, layer: nn.Module, layer_id: int, trunc_normal: Callable, generator: Any) -> None:
        depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        attention = layer.attention
        for linear in (attention.wq, attention.wk, attention.wv):
            trunc_normal(linear, 0.02)
        trunc_normal(attention.wo, depth_std)
        for norm in (layer.attention_norm, layer.ffn_norm, attention.q_norm, attention.k_norm):
            if norm is not None:
                norm.reset_parameters()
        ffn = layer.feed_forward if layer.moe is None else layer.moe.shared
        if ffn is not None:
            trunc_normal(ffn.w1, 0.02)
            trunc_normal(ffn.w2, depth_std)
            trunc_normal(ffn.w3, depth_std)
        if layer.moe is not None:
            trunc_normal(layer.moe.router, 0.02)
            layer.moe.router.reset_parameters()
            experts = layer.moe.experts
            for weight, std in ((experts.w1, 0.02), (experts.w3, depth_std), (experts.w2, depth_std)):
                _draw_experts(experts, weight, std, generator)

    @property
    def pipeline_stage_class(self) -> type:
        """What ``cut_llama`` builds this model's pipeline stages of ([Note: MoE pipeline stages])."""
        from lightning_zero.models.moe.pipeline import MoEStage

        return MoEStage

    def pipeline_step_done(self, microbatches: int) -> Optional[torch.Tensor]:
        """After a step of the pipeline schedule over this rank's stages: record their routing and
        return their weighted auxiliary loss per micro-batch (``None`` without one): see
        ``models/moe/pipeline.finish_pipeline_step``."""
        from lightning_zero.models.moe.pipeline import finish_pipeline_step

        return finish_pipeline_step(self, microbatches)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        if torch.is_grad_enabled():
            counts = torch.stack([layer.load for layer in self.moe_layers()])  # type: ignore[misc]
            self.record_routing(counts, torch.stack(self.aux_terms()).detach())
        return logits

    def aux_loss(self) -> torch.Tensor:
        """``aux_loss_coef * sum(balance) + z_loss_coef * sum(z)`` over the MoE layers of the last
        forward (fp32 scalar; see [Note: balance loss] in ``models/moe/router.py``)."""
        balance, z = self.aux_terms()
        return self.config.aux_loss_coef * balance + self.config.z_loss_coef * z

    def aux_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The balance and z losses of the last forward, each summed over the MoE layers."""
        layers = self.moe_layers()
        if any(layer.aux is None for layer in layers):
            raise RuntimeError("MoETransformer.aux_terms: run a forward first")
        balance = torch.stack([layer.aux[0] for layer in layers]).sum()  # type: ignore[index]
        z = torch.stack([layer.aux[1] for layer in layers]).sum()  # type: ignore[index]
        return balance, z

    def record_routing(self, counts: torch.Tensor, aux: torch.Tensor, forwards: int = 1) -> None:
        """Add ``forwards`` training forwards' assignments ``counts`` ``(n_moe_layers, E)`` (this
        rank's MoE layers, in :meth:`moe_layers` order) and ``(balance, z)`` sums ``aux`` to the sums
        the bias update and :meth:`take_moe_stats` read (the forward adds its own; a pipeline's
        stages theirs after each schedule step: [Note: MoE pipeline stages])."""
        if self.config.bias_update_rate > 0:  # [Note: bias update] in router.py
            self._bias_load = counts if self._bias_load is None else self._bias_load + counts
        load = counts.float()
        if self._load_sum is None:
            self._load_sum, self._aux_sum, self._forwards = load, aux, forwards
        else:
            self._load_sum, self._aux_sum = self._load_sum + load, self._aux_sum + aux
            self._forwards += forwards

    def update_router_bias(self, group: Optional[Any] = None, counter: Optional[Any] = None) -> None:
        """Move every MoE layer's selection bias by the auxiliary-loss-free rule, from the assignments
        of the training forwards since the last call, summed over ``group`` (the dense dp*cp group;
        ``None``: the default group) ([Note: bias update] in ``models/moe/router.py``). Call it
        after each optimizer step (``MoELM`` does); a no-op with ``bias_update_rate == 0`` or when
        no training forward ran. A collective when a process group is initialized: every rank of
        ``group`` calls it. Its bytes count into ``counter``, by default the model's own (expert or
        tensor parallelism's, which the strategy adopts)."""
        load, self._bias_load = self._bias_load, None
        if self.config.bias_update_rate == 0 or load is None:
            return
        if counter is None:
            counter = getattr(self, "ep_comm_counter", None) or getattr(self, "tp_comm_counter", None)
        step = bias_update(load, self.config.bias_update_rate, group, counter)
        with torch.no_grad():
            for layer, delta in zip(self.moe_layers(), step):
                layer.router.bias.add_(delta.to(layer.router.bias.dtype))

    def take_moe_stats(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """What this rank's training forwards routed since the last call, as device tensors (no host
        read), and start afresh: assignments per (MoE layer, expert) ``(n_moe_layers, E)`` summed,
        and the ``(balance, z)`` losses (each summed over layers) averaged over the forwards;
        ``None`` if none ran. ``runtime/expert_load.py`` turns them into the monitor's figures."""
        if self._load_sum is None:
            return None
        stats = (self._load_sum, self._aux_sum / self._forwards)
        self._load_sum = self._aux_sum = None
        return stats


def _draw_experts(experts: GroupedExperts, weight: torch.Tensor, std: float, generator) -> None:
    """Draw every expert's matrix of ``weight`` in expert order (all ``n_experts``), keeping the
    rows this rank holds (``expert_offset`` .. + ``n_local``): see :meth:`MoETransformer.init_weights`."""
    scratch = torch.empty(weight.shape[1:], dtype=weight.dtype, device=weight.device)
    first, count = experts.expert_offset, weight.shape[0]
    for expert in range(experts.n_experts):
        nn.init.trunc_normal_(scratch, std=std, a=-3 * std, b=3 * std, generator=generator)
        if first <= expert < first + count:
            weight[expert - first].copy_(scratch)
