"""Apply tensor parallelism to ``lightning_zero.models.Llama`` (its TP plan; the generic pieces, the
region hooks and the TP state dicts, are ``lightning_zero.tp``).

Layout (Megatron-LM), per transformer block, on a TP group of ``tp`` ranks:

=========================  ==================  ===============================================
module                     becomes             this rank holds
=========================  ==================  ===============================================
attention.wq / wk / wv     ColumnParallel      ``n_heads/tp`` q heads, ``n_kv_heads/tp`` kv heads
attention.wo               RowParallel         the input columns of its heads
feed_forward.w1 / w3       ColumnParallel      ``ffn_dim/tp`` hidden units (gate, up)
feed_forward.w2            RowParallel         the input columns of those units (down)
tok_embeddings             VocabParallel       ``vocab_size/tp`` rows
output                     ColumnParallel      ``vocab_size/tp`` rows; logits stay vocab-split
norms, RoPE buffers        replicated
=========================  ==================  ===============================================

A tied head (``tie_embeddings``) shares the embedding's shard: both layers split the same
``(vocab_size, dim)`` table on its rows, so rank ``r``'s ``output.weight`` *is* its
``tok_embeddings.weight`` (one Parameter, rows ``[r V/tp, (r+1) V/tp)``), whose gradient sums the
lookup's and the head's (see [Note: tied head] in ``models/llama/model.py``).

Heads are contiguous in ``wq``/``wk``/``wv`` rows, so a contiguous row slice is a set of whole
heads, and with GQA rank ``r``'s query heads map to exactly its own KV heads (both slices start at
``r/tp`` of their range). Attention derives the head counts from shapes, so no attribute changes.

Per-head norms on q and k (``attention.q_norm`` / ``k_norm``, Qwen3) run on this rank's heads: their
gain's gradient is summed over the TP group (as a sequence-parallel norm's is). A block without a
dense ``feed_forward`` (a mixture of experts, ``models/moe``) keeps its ``ffn_norm`` output as it is
(the sequence shard, or the replicated input) for the model family's own wiring ([Note: experts and
tensor parallelism] in ``models/moe/parallelize.py``).

``attention_norm`` and ``ffn_norm`` get a forward hook that enters the TP region once for the
three (two) column layers after them (see [Note: TP regions] in ``tp/layers.py``).
``model.loss_fn`` becomes :func:`vocab_parallel_cross_entropy` on the group.

With ``sequence_parallel=True`` ([Note: sequence parallelism] in ``tp/layers.py``) the residual
stream between blocks is ``(B, T/tp, dim)`` on each TP rank: the embedding reduce-scatters its
partial lookups over the sequence, every norm (the two per block and the final one) runs on the
shard and its forward hook all-gathers the sequence for the column layers after it, ``wo`` and
``w2`` reduce-scatter instead of all-reducing, and the head (``output``) reads the gathered final
norm as the vocab-parallel loss expects. The norms become :class:`SequenceParallelRMSNorm`, whose
gain's gradient is summed over the TP group. Parameter names, shapes and values are those without
sequence parallelism, so checkpoints move freely between the two.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.comm.mesh import check_model_divisible
from lightning_zero.models.llama.model import RMSNorm
from lightning_zero.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_tp_params,
    sum_grad_over_tp,
)
from lightning_zero.tp.loss import vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import MeshGroups

from lightning_zero.tp.parallelize import EnterTPRegion, GatherSequence, TPGroupLike, resolve_tp_group


class SequenceParallelRMSNorm(RMSNorm):
    """An :class:`RMSNorm` run on a sequence shard (or on this rank's heads: a per-head q/k norm):
    the same ``weight`` (same name, shape, init), its gradient summed over the TP group in backward
    (it saw ``T/tp`` of the tokens, or ``heads/tp`` of the heads)."""

    def __init__(self, norm: RMSNorm, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> None:
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.weight = norm.weight  # the same Parameter (meta or real)
        self.group, self.counter = group, counter

    def gain(self) -> torch.Tensor:
        return sum_grad_over_tp(self.weight, self.group, self.counter)


def parallelize_llama(
    model: nn.Module, tp: TPGroupLike, *, counter: Optional[CommCounter] = None, sequence_parallel: bool = False
) -> nn.Module:
    """Swap ``model``'s layers for TP layers holding this rank's slices; returns ``model``.

    Call on the dense model with the same weights on every TP rank (same seed), or on a meta-device
    model: each TP layer copies its rank's slice, so the TP model computes what the dense one does,
    and a meta model materialized afterwards (``to_empty`` + ``reset_parameters`` per module) equals
    the dense one materialized with the same seed (see [Note: TP init] in ``tp/layers.py``).
    Do not re-run a whole-tensor init such as ``Llama.init_weights`` afterwards: with the same RNG
    on every TP rank it would give every rank the *same* slice.

    Every parameter ends up with ``_tp_shard_dim`` set (``0``/``1`` split, ``None`` replicated), see
    :mod:`lightning_zero.tp.grad_norm`; :func:`tp_shard_dims` gives the same from module types.
    With a group of size 1 this returns ``model`` unchanged.

    The TP collectives count their logical bytes into ``counter`` (a new :class:`CommCounter` when
    ``None``), kept as ``model.tp_comm_counter``: a strategy that counts its own traffic adopts it,
    so dp and tp bytes land in one counter without the model knowing the strategy.

    ``sequence_parallel``: shard the norm/residual regions over the sequence (see the module
    doc); the model's input length must then be a multiple of the TP size.
    """
    group = resolve_tp_group(tp)
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return model
    if isinstance(model.tok_embeddings, VocabParallelEmbedding):
        raise ValueError("parallelize_llama: the model is already tensor-parallel; call it once per model")
    config = getattr(model, "config", None)
    if config is not None:
        check_model_divisible(tp_size, config)
    counter = counter if counter is not None else CommCounter()
    model.tp_comm_counter = counter

    model.tp_sequence_parallel = sequence_parallel

    # q/k/v and w1/w3 skip their own input-grad all-reduce: the norm before them enters once
    column = functools.partial(ColumnParallelLinear.from_dense, group=group, reduce_input_grad=False, counter=counter)
    row = functools.partial(
        RowParallelLinear.from_dense, group=group, counter=counter, sequence_parallel=sequence_parallel
    )
    enter_region = (GatherSequence if sequence_parallel else EnterTPRegion)(group, counter)
    for block in model.layers:
        attention, ffn = block.attention, getattr(block, "feed_forward", None)
        attention.wq, attention.wk, attention.wv = column(attention.wq), column(attention.wk), column(attention.wv)
        attention.wo = row(attention.wo)
        for name in ("q_norm", "k_norm"):  # per-head norms (Qwen3) see this rank's heads only
            if getattr(attention, name, None) is not None:
                setattr(attention, name, SequenceParallelRMSNorm(getattr(attention, name), group, counter))
        if sequence_parallel:
            block.attention_norm = SequenceParallelRMSNorm(block.attention_norm, group, counter)
            block.ffn_norm = SequenceParallelRMSNorm(block.ffn_norm, group, counter)
        block.attention_norm.register_forward_hook(enter_region)
        if ffn is not None:
            ffn.w1, ffn.w3 = column(ffn.w1), column(ffn.w3)
            ffn.w2 = row(ffn.w2)
            block.ffn_norm.register_forward_hook(enter_region)

    model.tok_embeddings = VocabParallelEmbedding.from_dense(
        model.tok_embeddings, group, counter=counter, sequence_parallel=sequence_parallel
    )
    if sequence_parallel:  # the head reads the gathered final norm; its dL/dx leaves by reduce-scatter
        model.norm = SequenceParallelRMSNorm(model.norm, group, counter)
        model.norm.register_forward_hook(enter_region)
        model.output = column(model.output)
    else:
        model.output = ColumnParallelLinear.from_dense(model.output, group, counter=counter)
    if getattr(config, "tie_embeddings", False):
        model.output.weight = model.tok_embeddings.weight  # one shard for both (see the module doc)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group, counter=counter)

    mark_tp_params(model)  # split: from the TP layers; replicated (norm weights): None
    return model


def apply_layout(
    model: nn.Module,
    groups: "MeshGroups",
    *,
    sequence_parallel: bool = False,
    dims: tuple[str, ...] = ("tp", "cp"),
    counter: Optional[CommCounter] = None,
) -> nn.Module:
    """The Llama family's one step ([Note: the parallelize registry] in ``runtime/parallelize.py``):
    tensor parallelism (:func:`parallelize_llama`), then context parallelism
    (``cp.parallelize.parallelize_context``), each applied once, over ``groups`` (``MeshGroups``).
    ``dims``: the dimensions to apply now, in that order whatever their order here (``LlamaLM``
    splits a pretrained model for tp on the meta device, reads its slices, then applies the rest)."""
    from lightning_zero.cp.parallelize import parallelize_context

    layout = groups.dims
    # a model cut into pipeline stages had its tp step first (its first stage's embedding may be elsewhere)
    split = (
        isinstance(model.tok_embeddings, VocabParallelEmbedding) or getattr(model, "pipeline_stages", None) is not None
    )
    if "tp" in dims and layout.tp > 1 and not split:
        parallelize_llama(model, groups.tp, counter=counter, sequence_parallel=sequence_parallel)
    if "cp" in dims and layout.cp > 1 and model.context_parallel_size == 1:
        parallelize_context(model, groups.cp, counter=getattr(model, "tp_comm_counter", None) or counter, tp=layout.tp)
    return model
