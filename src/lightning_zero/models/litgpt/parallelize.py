"""LitGPT's ``GPT`` (``litgpt.model.GPT`` and its LoRA subclass) parallelized in one step: the
family's entry in the registry (``runtime/parallelize.py``), applied by the Fabric door at
``fabric.setup``. In the fixed order: tensor parallelism ([Note: LitGPT under tensor parallelism]
in ``models/litgpt/tensor_parallel.py``), expert parallelism (LitGPT's experts are not split:
refused), context parallelism; pipeline stages would come last.

[Note: LitGPT under context parallelism] LitGPT's scripts hold whole batches and compute their
loss outside the model (``chunked_cross_entropy(logits, targets)``, after shifting the logits
themselves), and they stay unchanged. So the model takes the whole ``(B, T)`` batch and gives back
the whole ``(B, T, vocab)`` logits, as under ddp, while everything between runs on the cp rank's
slice:

- a forward pre-hook on ``GPT`` pads ``idx`` to a multiple of ``cp`` (LitGPT's fine-tuning
  batches are as long as their longest sample) and keeps cp rank ``c``'s ``[c S, (c+1) S)``,
  ``S = T_pad / cp``; it fills the rotary tables of the whole padded sequence for the attentions
  ([Note: LitGPT attention under cp] in ``models/litgpt/cp_attention.py``: Ulysses or ring attention
  over the cp group, as ``cp.layout.attention_layout`` picks);
- a forward hook on the final norm ``ln_f`` all-gathers the sequence over the cp group and cuts
  the padding off, so ``lm_head`` (chunked or not) runs on the whole sequence and the script's
  loss sees ddp's logits. Padding sits after every real token: under the causal mask it changes
  nothing before it, and its outputs are cut before anything reads them;
- backward: the gather's adjoint is a reduce-scatter. Every cp rank computes the same loss from
  the same gathered logits, so the reduce-scatter hands each rank ``cp`` times its slice's
  gradient, and the engine's average over the ``dp x cp`` ranks ([Note: gradient averaging over
  dp_cp] in ``comm/mesh.py``) divides the ``cp`` back out: ddp's gradients. ``lm_head`` runs on the
  whole sequence on every cp rank and its gradient is the same on each: averaged, it is ddp's.

What it costs: the head's ``B T vocab`` logits on every cp rank (what the script's loss needs,
and what ddp holds too) and one all-gather of ``B T n_embd`` forward, one reduce-scatter back;
the blocks' activations are ``1/cp`` of ddp's. A loop of one's own that computes the loss on the
slices (this project's ``Llama``: ``model.loss_fn``, [Note: global token mean] in ``cp/loss.py``)
avoids the gathered logits. Under context parallelism the cp ranks of one dp rank must get the
same batches: Fabric's sampler gives them (its replicas are the dp ranks), and a litdata
``StreamingDataset`` is told the dp layout at ``fabric.setup_dataloaders`` ([Note: litdata's
ranks] in ``fabric/_litdata_compat.py``). A KV-cache forward (LitGPT's ``generate``, which
``finetune_lora`` runs on rank 0 alone) cannot run on one cp rank and is refused, naming the fix.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.cp.layout import RingLayout, attention_layout, layout_notice
from lightning_zero.models.litgpt.cp_attention import (
    ContextParallelSelfAttention,
    RopeTables,
    context_parallel_attention,
)
from lightning_zero.models.litgpt.tensor_parallel import check_tensor_parallel, parallelize_tensor
from lightning_zero.tp.layers import gather_from_sequence_region

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import MeshGroups, ParallelDims

CP_GATHER_LABELS = ("cp_all_gather_seq", "cp_reduce_scatter_seq")


def is_litgpt_gpt(module: Any) -> bool:
    """``module`` is a LitGPT ``GPT`` (or a subclass: LoRA's, the adapter's). LitGPT is not
    imported here: a module of that class exists only once a script imported it."""
    litgpt_model = sys.modules.get("litgpt.model")
    return litgpt_model is not None and isinstance(module, litgpt_model.GPT)


@dataclass(frozen=True)
class _Heads:
    """LitGPT's head counts under the names ``cp.layout`` reads."""

    n_heads: int
    n_kv_heads: int


def check_litgpt_layout(model: nn.Module, dims: "ParallelDims") -> None:
    """Whether ``model`` (a LitGPT ``GPT``) runs ``dims``; raises ``ValueError`` naming the fix,
    on every rank, before anything is split, broadcast or sharded. Warns when cp repeats key/value
    heads or falls back to ring attention (``cp.layout.layout_notice``)."""
    config = model.config
    if dims.tp > 1:
        check_tensor_parallel(config, model, dims.tp)
    if dims.ep > 1:
        raise ValueError(
            f"ZeroFabricStrategy(ep={dims.ep}): LitGPT's GPT has no experts split over ep (its LLaMAMoE keeps every"
            " expert on every rank); use ep=1."
        )
    if dims.cp == 1:
        return
    unsupported = {
        "latent_attention": config.latent_attention,
        "sliding_window_size": config.sliding_window_size,
        "attention_logit_softcapping": config.attention_logit_softcapping,
        "rope_indices": config.rope_indices,
        "rope_local_base_freq": config.rope_local_base_freq,
        "rope_interleave": config.rope_interleave or None,
    }
    asked = [f"{name}={value!r}" for name, value in unsupported.items() if value is not None]
    if asked:
        raise ValueError(
            f"ZeroFabricStrategy(cp={dims.cp}): LitGPT's GPT with {', '.join(asked)} has no context-parallel"
            " attention here (models/litgpt/cp_attention.py runs causal attention with rotary positions); use cp=1"
        )
    from litgpt.model import CausalSelfAttention

    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention) and any(
            getattr(type(module), method) is not getattr(CausalSelfAttention, method)
            for method in ("forward", "scaled_dot_product_attention")
        ):
            raise ValueError(
                f"ZeroFabricStrategy(cp={dims.cp}): {name} is a {type(module).__module__}.{type(module).__name__},"
                " whose attention differs from LitGPT's CausalSelfAttention (an adapter's prefix); its"
                " context-parallel form is not available: use cp=1 (LoRA's GPT and the plain GPT run it)"
            )
    layout = attention_layout(dims.cp, 1, _Heads(config.n_head // dims.tp, config.n_query_groups // dims.tp))
    mscales = {getattr(module, "mscale", 1.0) for module in model.modules() if isinstance(module, CausalSelfAttention)}
    if isinstance(layout, RingLayout) and (
        config.attention_scores_scalar not in (None, config.head_size) or mscales != {1.0}
    ):
        raise ValueError(
            f"ZeroFabricStrategy(cp={dims.cp}): cp does not divide the heads of a TP rank ({config.n_head // dims.tp}),"
            " so attention would run"
            " as a ring, which scales scores by head_size**-0.5, but this config scales them otherwise"
            f" (attention_scores_scalar={config.attention_scores_scalar}, YaRN mscale {sorted(mscales)}); pick cp"
            f" from the divisors of {config.n_head // dims.tp}"
        )
    notice = layout_notice(layout)
    if notice is not None:
        warnings.warn(f"lightning_zero: {notice}", stacklevel=3)


def parallelize_litgpt(
    model: nn.Module,
    groups: "MeshGroups",
    *,
    sequence_parallel: bool = False,
    counter: Optional[CommCounter] = None,
) -> nn.Module:
    """Apply ``groups``' layout to ``model`` (a LitGPT ``GPT``): tp ([Note: LitGPT under tensor
    parallelism], with ``sequence_parallel``), ep (refused for this family:
    :func:`check_litgpt_layout`), then cp ([Note: LitGPT under context parallelism]); returns
    ``model``. Collectives count into ``counter``, kept as ``model.tp_comm_counter`` for the session
    to adopt (``runtime/setup.find_tp_counter``)."""
    dims = groups.dims
    check_litgpt_layout(model, dims)
    if dims.tp > 1 or dims.cp > 1:
        counter = counter or getattr(model, "tp_comm_counter", None) or CommCounter()
        model.tp_comm_counter = counter
    if dims.tp > 1:
        parallelize_tensor(model, groups.tp, counter, sequence_parallel)
    if dims.cp > 1:
        _parallelize_context(model, groups.cp, counter)
    return model


def _parallelize_context(model: nn.Module, group: dist.ProcessGroup, counter: CommCounter) -> None:
    from lightning_zero.cp.ring_attention import RingAttention
    from lightning_zero.cp.ulysses import UlyssesExchange

    if any(isinstance(block.attn, ContextParallelSelfAttention) for block in model.transformer.h):
        raise ValueError("parallelize_litgpt: the model is already context-parallel; call it once per model")
    cp = dist.get_world_size(group)
    heads = model.transformer.h[0].attn.config  # the local head counts under tensor parallelism
    layout = attention_layout(cp, 1, _Heads(heads.n_head, heads.n_query_groups))
    exchange = RingAttention(group, counter) if isinstance(layout, RingLayout) else UlyssesExchange(group, counter)
    tables = RopeTables()
    for block in model.transformer.h:
        block.attn = context_parallel_attention(block.attn, exchange, tables)
    cut = _SequenceCut(group, counter, tables)
    model.register_forward_pre_hook(cut.before_model, with_kwargs=True)
    # the monitor reads a module's own batch_tokens (runtime/throughput.py); its hook runs before the cut
    # (prepended), so it sees the whole sequence where this rank trains on one slice of it
    model.batch_tokens = cut.batch_tokens
    model.transformer.ln_f.register_forward_hook(cut.after_final_norm)


class _SequenceCut:
    """The two hooks of [Note: LitGPT under context parallelism]: cut the batch to this cp rank's
    slice before ``GPT.forward``, gather the whole sequence after its final norm."""

    def __init__(self, group: dist.ProcessGroup, counter: CommCounter, tables: RopeTables) -> None:
        self.group, self.counter, self.tables = group, counter, tables
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.length = 0  # T of the forward in progress, before padding

    def before_model(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positional = list(args)
        idx = positional.pop(0) if positional else kwargs.pop("idx")
        input_pos = positional[0] if positional else kwargs.get("input_pos")
        if input_pos is not None:
            raise ValueError(
                f"context parallelism (cp={self.cp}): LitGPT's GPT was called with input_pos (a KV-cache"
                " generation, such as finetune_lora's generate_example on rank 0), which needs every cp rank;"
                " generate after training with cp=1 (litgpt generate on the saved checkpoint), or set"
                " --eval.interval beyond the run"
            )
        self.length = idx.size(1)
        padded = -(-self.length // self.cp) * self.cp  # T rounded up to a multiple of cp
        if padded > self.length:  # after every real token: the causal mask keeps it out of their outputs
            idx = F.pad(idx, (0, padded - self.length))
        cos, sin = model.cos[:padded], model.sin[:padded]  # (T_pad, rope_n_elem), global positions
        if cos.size(0) < padded:  # max_seq_length == T: the padded positions' angles are never read
            cos = F.pad(cos, (0, 0, 0, padded - cos.size(0)))
            sin = F.pad(sin, (0, 0, 0, padded - sin.size(0)))
        self.tables.cos, self.tables.sin = cos, sin
        shard = padded // self.cp
        local = idx[:, self.cp_rank * shard : (self.cp_rank + 1) * shard]  # (B, T_pad / cp)
        return (local, *positional), kwargs

    def batch_tokens(self, args: Any) -> tuple[int, int]:
        """``(sequences, tokens per sequence)`` this cp rank trains on for the forward's whole batch
        ``args`` (``idx`` first): its ``T_pad / cp`` slice, as the monitor counts a Llama's."""
        idx = args[0] if isinstance(args, (tuple, list)) else args
        return int(idx.size(0)), -(-int(idx.size(1)) // self.cp)

    def after_final_norm(self, norm: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        whole = gather_from_sequence_region(output, self.group, self.counter, labels=CP_GATHER_LABELS)
        return whole[:, : self.length]  # (B, T, n_embd): the padding cut off
