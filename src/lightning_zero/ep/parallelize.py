"""``parallelize_experts``: keep this rank's experts and wire the ``ep`` group into every MoE layer.

Experts are split in ``ep`` consecutive blocks: ep rank ``r`` keeps experts
``[r E/ep, (r+1) E/ep)`` of every MoE layer (rows of the stacked ``w1``/``w3``/``w2``, see
[Note: stacked experts] in ``models/moe/experts.py``), and its MoE layers exchange tokens over the
group ([Note: token exchange] in ``ep/dispatch.py``). The router, shared experts, attention and
norms stay whole on every rank (dense parameters).

[Note: experts and tensor parallelism] Experts are not split by TP (no Megatron ETP): an expert's
SwiGLU is small (Qwen3's 768 wide, DeepSeek's 2048) and splitting it would add a TP all-reduce per
expert batch for little memory. The ``ep`` group is taken among the ranks of the same TP rank
(MESH.md: ``ep`` consecutive members of the ``dp_cp`` group), so a TP group's ranks route the same
tokens to the same experts. The MoE family refuses ``tp > 1`` for now (``check_moe_layout``): its
attention would need the TP wiring of ``parallelize_llama``, which is not done for it yet.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.ep.dispatch import ExpertParallel
from lightning_zero.models.moe.config import check_moe_layout
from lightning_zero.models.moe.experts import mark_expert_params


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
    for moe in model.moe_layers():
        experts = moe.experts
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad))
        mark_expert_params(experts)
        experts.expert_offset = rank * n_local
        moe.ep = expert_parallel
    return model
