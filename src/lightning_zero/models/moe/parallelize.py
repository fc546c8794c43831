"""The MoE family's expert and tensor parallelism (the generic token exchange is ``lightning_zero.ep``):
``parallelize_experts``: keep this rank's experts and wire the ``ep`` group into every MoE layer;
``parallelize_moe_tp``: run the MoE layers on a tensor-parallel model's sequence shards.

Experts are split in ``ep`` consecutive blocks: ep rank ``r`` keeps experts
``[r E/ep, (r+1) E/ep)`` of every MoE layer (rows of the stacked ``w1``/``w3``/``w2``, see
[Note: stacked experts] in ``models/moe/experts.py``), and its MoE layers exchange tokens over the
group ([Note: token exchange] in ``ep/dispatch.py``). The router, shared experts, attention and
norms stay whole on every rank (dense parameters).

[Note: experts and tensor parallelism] Experts are not split by TP (no Megatron ETP): an expert's
SwiGLU is small (Qwen3's 768 wide, DeepSeek's 2048), and splitting it would add a TP collective per
expert batch and a TP-wide token exchange for little memory. Instead a MoE layer under TP runs on
a *sequence shard*, as a sequence-parallel norm does:

- attention and the dense layers (the first ``n_dense_layers``) are split as Llama's
  (``models/llama/parallelize.parallelize_llama``); with sequence parallelism the ``ffn_norm``
  before a MoE layer keeps its ``(B, T/tp, dim)`` output (no all-gather); without, the layer cuts
  its slice from the replicated ``(B, T, dim)`` and all-gathers its output back
  (``tp.layers.split_to_sequence_region`` /
  ``gather_to_replicated_region``: the same bytes as sequence parallelism's gather and scatter).
  Either way TP rank ``t`` routes tokens ``[t T/tp, (t+1) T/tp)`` of its dp rank's micro-batch;
- its tokens go to their experts over the ``ep`` group of its own TP rank (``comm/mesh.py``: ``ep``
  consecutive members of the dp_cp group, which shares one tp rank), so the TP ranks of one
  position exchange disjoint token sets over disjoint EP groups, and every expert sees each of
  its tokens exactly once, as without TP;
- router, routed experts and shared experts are replicated over the TP group (whole, like a
  sequence-parallel norm's gain): each TP rank's gradient covers its own tokens, so each is summed
  over the TP group in backward (``tp.layers.sum_grad_over_tp``, labelled
  ``tp_all_reduce_norm_grad``), after which the engine treats them as any TP-replicated parameter
  (reduced over dp_cp, or for experts over their EDP group, divided by ``dp * cp``; counted
  ``1/tp`` in the gradient norm: [Note: TP grad norm]);
- the balance and z losses and the loads are those of the whole micro-batch: the shards' sums are
  added over the TP group (``models/moe/router.tp_aux_losses``), so the loss equals the one
  without TP on every TP rank;
- a capacity factor would cap each shard rather than the micro-batch, so it is refused with TP.

What it costs: the MoE layer's compute is split ``tp`` ways with no redundant token, but expert
gradients are all-reduced over the TP group once per micro-batch (``2 (tp-1)/tp`` of this rank's
expert bytes, on the TP group's NVLink) and expert optimizer state is not divided by ``tp``.
Sharding expert states over ``edp * tp`` ranks and reducing once per step would remove both, but
needs the bucket launch order agreed across TP ranks (it is agreed per dense group today:
[Note: launch order] in ``zero/reducer.py``) and checkpoints that take expert chunks from every TP
rank; it is left for later (docs/moe.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.ep.dispatch import ExpertParallel
from lightning_zero.models.moe.config import check_moe_layout
from lightning_zero.models.moe.experts import mark_expert_params
from lightning_zero.models.moe.router import TensorParallelShard
from lightning_zero.tp.layers import sum_grad_over_tp

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import MeshGroups


def parallelize_experts(
    model: nn.Module, group: dist.ProcessGroup, *, counter: Optional[CommCounter] = None
) -> nn.Module:
    """Keep this rank's experts of every MoE layer of ``model`` (a ``MoETransformer``, real or on
    the meta device) and route its tokens over ``group``; returns ``model``.

    The kept rows are those of the whole model (a real model keeps its slice of the experts it
    was initialized with; a meta model initializes only its own, drawing the same numbers:
    ``MoETransformer.init_weights``). With a group of one rank nothing is split, and tokens
    still take the local path. The exchanges count into ``counter`` (the TP layers' counter or a
    new :class:`CommCounter` when ``None``), kept as ``model.ep_comm_counter`` for the strategy to
    adopt (``runtime/setup.find_tp_counter``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    config = model.config
    check_moe_layout(config, ep=size)
    if getattr(model, "ep_size", 1) != 1:
        raise ValueError("parallelize_experts: the model's experts are already split; call it once per model")
    counter = counter or getattr(model, "tp_comm_counter", None) or CommCounter()
    model.ep_comm_counter = counter
    model.ep_size = size
    expert_parallel = ExpertParallel(group, size, rank, counter)
    n_local = config.n_experts // size
    rows = slice(rank * n_local, (rank + 1) * n_local)
    with torch.no_grad():
        for moe in model.moe_layers():
            experts = moe.experts
            for name in ("w1", "w3", "w2"):
                # the same Parameter objects, holding their rows: an optimizer built over the whole
                # model (``fabric.setup(model, optimizer)``) steps what the model trains
                full = getattr(experts, name)
                full.data = full.detach()[rows].clone()
    for moe in model.moe_layers():
        mark_expert_params(moe.experts)
        moe.experts.expert_offset = rank * n_local
        moe.ep = expert_parallel
    return model


def parallelize_moe_tp(
    model: nn.Module, group: dist.ProcessGroup, *, counter: Optional[CommCounter] = None
) -> nn.Module:
    """Run every MoE layer of ``model`` (a ``MoETransformer`` whose attention and dense layers
    ``parallelize_llama`` already split) on its TP rank's sequence shard (without sequence
    parallelism cut from the replicated input, the output all-gathered back):
    router, experts and shared experts replicated with their gradients summed over ``group``, the
    auxiliary losses and loads those of the whole micro-batch ([Note: experts and tensor
    parallelism]); returns ``model``. With a group of one rank nothing changes."""
    size = dist.get_world_size(group)
    if size == 1:
        return model
    if not hasattr(model, "tp_sequence_parallel"):
        raise ValueError("parallelize_moe_tp: split attention and the dense layers first (parallelize_llama)")
    grad_sum = functools.partial(sum_grad_over_tp, group=group, counter=counter)
    for moe in model.moe_layers():
        if moe.tp is not None:
            raise ValueError("parallelize_moe_tp: the MoE layers are already tensor-parallel; call it once per model")
        moe.tp = TensorParallelShard(group, size, counter, sequence_parallel=model.tp_sequence_parallel)
        moe.router.tp_grad_sum = moe.experts.tp_grad_sum = grad_sum
        if moe.shared is not None:
            moe.shared.tp_grad_sum = grad_sum
    return model


def apply_layout(
    model: nn.Module,
    groups: "MeshGroups",
    *,
    sequence_parallel: bool = False,
    dims: tuple[str, ...] = ("tp", "ep", "cp"),
    counter: Optional[CommCounter] = None,
) -> nn.Module:
    """The MoE family's one step ([Note: the parallelize registry] in ``runtime/parallelize.py``):
    tensor parallelism (Llama's for attention and the dense layers, then :func:`parallelize_moe_tp`),
    expert parallelism (:func:`parallelize_experts`), context parallelism as Llama's, each applied
    once, in that order. ``dims``: the dimensions to apply now (``MoELM`` keeps this rank's experts
    on the meta device and initializes only them before the rest)."""
    from lightning_zero.models.llama.parallelize import apply_layout as apply_llama_layout
    from lightning_zero.models.llama.parallelize import parallelize_llama

    layout = groups.dims
    if "tp" in dims and layout.tp > 1 and not hasattr(model, "tp_sequence_parallel"):
        parallelize_llama(model, groups.tp, counter=getattr(model, "ep_comm_counter", None) or counter,
                          sequence_parallel=sequence_parallel)  # fmt: skip
        parallelize_moe_tp(model, groups.tp, counter=model.tp_comm_counter)
    if "ep" in dims and layout.ep > 1 and getattr(model, "ep_size", 1) == 1:
        parallelize_experts(model, groups.ep, counter=counter)
    return apply_llama_layout(model, groups, dims=tuple(name for name in dims if name == "cp"), counter=counter)
