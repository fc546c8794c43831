"""What one rank sends per step: data-parallel bytes per link and hop (``ledger.dp_link_bytes``),
tensor-parallel bytes per collective (:func:`tp_bytes_by_kind`), and the seconds the step-time
model gives them; :func:`~lightning_zero.planner.arithmetic.plan_run` puts them in its
:class:`~lightning_zero.planner.plan.TrafficPerRank`. Formulas: docs/planner.md, docs/topology.md.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_zero.comm.ring import ring_sent
from lightning_zero.cp.layout import CP_RING_LABEL, RingLayout, attention_layout, ring_layout
from lightning_zero.models.checkpointing import CheckpointingLike, checkpointing_mode
from lightning_zero.planner.ledger import LinkBytes, dp_link_bytes
from lightning_zero.planner.moe import balanced_exchange_bytes
from lightning_zero.planner.plan import TrafficPerRank
from lightning_zero.planner.resolved import ResolvedRun
from lightning_zero.planner.timing import StepTime
from lightning_zero.planner.workload import (
    cp_all_to_all_payloads,
    gathered_once_numel,
    head_dim,
    model_layers,
    training_flops,
)


def traffic_per_rank(resolved: ResolvedRun, simulated: Optional[StepTime]) -> TrafficPerRank:
    """The bytes one rank sends per step, by group, link and collective, with the seconds they take
    (``simulated``: the step-time model's, ``None``: bytes only). The dense parameters one rank
    holds (``resolved.padded``) are reduced and gathered over its shard group; with expert
    parallelism ``expert_padded`` expert parameters over the edp group (``resolved.experts``,
    [Note: expert domain] in ``zero/domains.py``), and the tokens' all-to-alls run over the ep group."""
    # Ring bytes per hop x how often it runs (ledger.dp_link_bytes; docs/planner.md, docs/topology.md):
    # stage 0 all-reduces once; stage 1 (and stages 2-3 deferred) reduce-scatter once per step, stages
    # 2-3 otherwise every micro batch; stages 1-2 all-gather once after the step, stage 3 twice per micro batch
    # (once for the unit held from forward into backward, and for a tied embedding in the root).
    r, dims, dtype, workload = resolved, resolved.dims, resolved.dtype, resolved.workload
    config, stage, micro_batches, hw = resolved.model, resolved.stage, resolved.micro_batches, resolved.hw
    comm = resolved.config.communication
    activation_checkpointing = resolved.checkpointing
    tp = int(dims.tp)

    # what each domain's collectives carry: the bytes per element and the communication policy's wire formats
    wire = dict(grad_bytes=dtype.grad, param_bytes=dtype.param, grad_comm_dtype=comm.grad_comm_dtype,
                param_comm_dtype=comm.param_comm_dtype)  # fmt: skip

    def domain_links(numel: int, domain_topology: Any, expert: bool) -> Any:
        """One ZeRO domain's ring bytes: the dense parameters, or the experts over their edp group."""
        once = gathered_once_numel(workload, expert=expert) if stage == 3 else 0
        return dp_link_bytes(numel, stage=stage, topology=domain_topology, micro_batches=micro_batches,
                             defer_grad_reduce=r.defer_grad_reduce, gathered_once_numel=once, **wire)  # fmt: skip

    links = domain_links(r.padded, r.topology, expert=False)
    if r.experts is not None and r.expert_padded:
        links = links.plus(domain_links(r.expert_padded, r.experts, expert=True))
    reduce_scatter, all_gather = links.by_kind("reduce_scatter"), links.by_kind("all_gather")
    all_reduce = links.by_kind("all_reduce")  # DDP, and the replica all-reduce of hybrid sharding
    tokens = r.micro_batch * r.seq_len
    mode = dict(activation_checkpointing=activation_checkpointing, sequence_parallel=r.config.sequence_parallel)
    tp_bytes = tp_bytes_by_kind(
        config, tokens=tokens, tp=tp, act_bytes=dtype.activation, micro_batches=micro_batches, ep=int(dims.ep), **mode
    )
    cp = int(dims.cp)
    cp_bytes = cp_bytes_by_kind(
        config,
        tokens=tokens,
        cp=cp,
        tp=tp,
        act_bytes=dtype.activation,
        micro_batches=micro_batches,
        activation_checkpointing=activation_checkpointing,
    )
    flops = micro_batches * training_flops(
        config,
        micro_batch=r.micro_batch,
        seq_len=r.seq_len,
        tp=tp,
        activation_checkpointing=activation_checkpointing,
        cp=cp,
    )
    ep_bytes = ep_bytes_by_kind(
        config, tokens=tokens // cp // tp, ep=int(dims.ep), act_bytes=dtype.activation, micro_batches=micro_batches,
        activation_checkpointing=activation_checkpointing,
    )  # fmt: skip
    return TrafficPerRank(
        dp_reduce_scatter_bytes=reduce_scatter,
        dp_all_gather_bytes=all_gather,
        dp_all_reduce_bytes=all_reduce,
        tp_all_reduce_bytes=sum(tp_bytes.values()),
        tp_bytes_by_kind=tp_bytes,
        dp_link=_dp_link_name(links),
        dp_bytes_per_s=hw.inter_node_bytes_per_s if links.inter_node_total else hw.intra_node_bytes_per_s,
        tp_bytes_per_s=hw.intra_node_bytes_per_s,
        flops_per_rank=flops,
        compute_s=micro_batches * (workload.compute_forward_s + workload.compute_backward_s),
        dp_s=simulated.dp_comm_s if simulated else 0.0,
        tp_s=micro_batches * workload.tp_s,
        exposed_comm_s=(simulated.exposed_comm_s + simulated.post_step_gather_s) if simulated else 0.0,
        step_s=simulated.step_s if simulated else 0.0,
        dp_link_bytes=links,
        intra_node_s=simulated.link_s("intra_node") if simulated else 0.0,
        inter_node_s=simulated.link_s("inter_node") if simulated else 0.0,
        cp_all_to_all_bytes=cp_bytes.get("cp_all_to_all", 0.0),
        cp_bytes_by_kind=cp_bytes,
        cp_link=r.cp_link,
        cp_s=micro_batches * workload.cp_s,
        ep_bytes_by_kind=ep_bytes,
        ep_link=r.ep_link,
        ep_s=micro_batches * workload.ep_s,
    )


def tp_bytes_by_kind(
    config: Any,
    *,
    tokens: int,
    tp: int,
    act_bytes: int,
    micro_batches: int = 1,
    activation_checkpointing: CheckpointingLike = False,
    sequence_parallel: bool = False,
    ep: int = 1,
) -> dict[str, float]:
    """Bytes one rank sends in the TP group per step, by the ``CommCounter`` label of each
    collective (``tp/layers.py``; the loss's two small all-reduces are left out); all intra-node.

    Without sequence parallelism: per block 2 all-reduces of ``B T dim`` forward (after wo, w2)
    and 2 backward (the column-parallel inputs' gradients), plus the embedding's (forward) and
    the head's (backward). With it, each of those becomes one reduce-scatter and one all-gather
    of ``B T dim`` (``(tp-1)/tp`` of it each: the same total), plus ``2 n_layers + 1``
    all-reduces of the norm gains' ``dim`` gradient elements. Full recompute repeats what the
    block's saved tensors need: non-reentrant checkpointing stops before w2, so wo's all-reduce
    (1 per block), or with sequence parallelism both all-gathers and wo's reduce-scatter.
    Selective recompute repeats no collective.

    A mixture of experts ([Note: experts and tensor parallelism] in ``models/moe/parallelize.py``): a MoE
    layer runs whole on the rank's ``T/tp`` sequence shard, so its block keeps attention's
    collectives only (with sequence parallelism; a full recompute repeats attention's all-gather and
    ``wo``'s reduce-scatter), or without it adds an all-gather of the layer's output forward and one
    backward (``tp_all_gather_seq``; cutting the shard is free); the MoE layers' gradients (router,
    this rank's experts, shared experts) and q/k norm gains are summed over the TP group once per
    micro batch (``tp_all_reduce_norm_grad``, with the norm gains). The all-reduce of the auxiliary
    losses and loads (a few dozen bytes a micro batch) is left out, as the loss's.
    """
    if tp == 1:
        return {}
    full = checkpointing_mode(activation_checkpointing) == "full"
    layers = config.n_layers
    moe = layers - config.n_dense_layers if getattr(config, "n_experts", 0) else 0
    dense = layers - moe
    activation = tokens * config.dim * act_bytes
    grads = _tp_summed_grads(config, tp=tp, ep=ep, sequence_parallel=sequence_parallel) * micro_batches
    out: dict[str, float] = {}
    if not sequence_parallel:
        all_reduces = (4 * dense + 2 * moe + 2 + (layers if full else 0)) * micro_batches
        out["tp_all_reduce"] = all_reduces * ring_sent("all_reduce", activation, tp)
        if moe:
            out["tp_all_gather_seq"] = 2 * moe * micro_batches * ring_sent("all_gather", activation, tp)
    else:
        gathers = (4 * dense + 2 * moe + 2 + ((2 * dense + moe) if full else 0)) * micro_batches
        scatters = (4 * dense + 2 * moe + 2 + (layers if full else 0)) * micro_batches
        out["tp_all_gather_seq"] = gathers * ring_sent("all_gather", activation, tp)
        out["tp_reduce_scatter_seq"] = scatters * ring_sent("reduce_scatter", activation, tp)
    if grads:
        out["tp_all_reduce_norm_grad"] = ring_sent("all_reduce", grads * act_bytes, tp)
    return out


def _tp_summed_grads(config: Any, *, tp: int, ep: int, sequence_parallel: bool) -> int:
    """Gradient elements one TP rank sums over its TP group per micro batch: the norm gains under
    sequence parallelism (``2 n_layers + 1`` of ``dim``), q/k norm gains (``qk_norm``), and a
    mixture of experts' MoE layers (router, this rank's ``E / ep`` experts, shared experts)."""
    elements = (2 * config.n_layers + 1) * config.dim if sequence_parallel else 0
    if getattr(config, "n_experts", 0) or getattr(config, "qk_norm", False):
        summed = ("moe.", "attention.q_norm", "attention.k_norm")
        layers = model_layers(config, tp=tp, ep=ep)
        elements += sum(tensor.numel for layer in layers for tensor in layer if tensor.name.startswith(summed))
    return elements


def cp_all_to_all_bytes_per_layer(config: Any, *, tokens: int, cp: int, tp: int = 1, act_bytes: int) -> float:
    """Bytes one rank sends in the cp group for one attention layer's forward (backward sends the
    same again), ``tokens`` being ``B T`` of the rank's samples: the two all-to-alls of
    :func:`~lightning_zero.planner.workload.cp_all_to_all_payloads`, each sending ``(cp-1)/cp`` of
    its payload::

        (cp-1)/cp * B T/cp * head_dim * (2 n_heads + 2 n_kv_heads * kv_repeats) / tp * act_bytes
    """
    if cp == 1:
        return 0.0
    payloads = cp_all_to_all_payloads(config, tokens=tokens, cp=cp, tp=tp, act_bytes=act_bytes)
    return ring_sent("all_to_all", sum(payloads), cp)


def cp_ring_kv_bytes_per_layer(
    config: Any, *, tokens: int, cp: int, tp: int = 1, act_bytes: int, recompute: bool = False
) -> float:
    """Bytes one rank sends in the cp ring for one attention layer, forward and backward (and the
    recomputed forward under full checkpointing), ``tokens`` being ``B T`` of the rank's samples
    ([Note: ring attention] in ``cp/ring_attention.py``)::

        (3 cp - 2, or 4 cp - 3 recomputed) * 2 B T/cp * n_kv_heads / tp * head_dim * act_bytes
    """
    layout = ring_layout(cp, tp, config)
    return float(layout.kv_hops(recompute) * layout.kv_block_numel(tokens, head_dim(config)) * act_bytes)


def cp_bytes_by_kind(
    config: Any,
    *,
    tokens: int,
    cp: int,
    tp: int = 1,
    act_bytes: int,
    micro_batches: int = 1,
    activation_checkpointing: CheckpointingLike = False,
) -> dict[str, float]:
    """Bytes one rank sends in the cp group per step, by ``CommCounter`` label (the loss's two
    16-byte all-reduces are left out, as TP's loss all-reduces are). Ulysses (``cp_all_to_all``):
    every layer's exchanges (:func:`cp_all_to_all_bytes_per_layer`) forward and backward, and under
    full recompute once more (the recomputed block runs attention again; selective recompute
    repeats none). Ring attention, where the query heads do not split over ``tp * cp``
    (``cp.layout.attention_layout``; ``cp_ring_kv``): :func:`cp_ring_kv_bytes_per_layer`."""
    if cp == 1:
        return {}
    full = checkpointing_mode(activation_checkpointing) == "full"
    if isinstance(attention_layout(cp, tp, config), RingLayout):
        per_layer = cp_ring_kv_bytes_per_layer(config, tokens=tokens, cp=cp, tp=tp, act_bytes=act_bytes, recompute=full)
        return {CP_RING_LABEL: config.n_layers * micro_batches * per_layer}
    passes = 3 if full else 2
    per_layer = cp_all_to_all_bytes_per_layer(config, tokens=tokens, cp=cp, tp=tp, act_bytes=act_bytes)
    return {"cp_all_to_all": passes * config.n_layers * micro_batches * per_layer}


def ep_bytes_by_kind(
    config: Any,
    *,
    tokens: int,
    ep: int,
    act_bytes: int,
    micro_batches: int = 1,
    activation_checkpointing: CheckpointingLike = False,
) -> dict[str, float]:
    """Bytes one rank sends in the ep group per step, by ``CommCounter`` label (``moe_dispatch``,
    ``moe_combine``, ``moe_dispatch_grad``, ``moe_combine_grad``; the small ``moe_counts`` control
    exchange is left out), ``tokens`` being the rank's ``B T`` of one micro batch (a MoE layer's ``T / cp / tp`` shard): the formula the
    engine's counters are tested against (``planner.moe.all_to_all_bytes``) for a balanced router
    (:func:`~lightning_zero.planner.moe.balanced_exchange_bytes`). Empty for ``ep == 1`` or a
    model without experts."""
    if ep == 1 or not getattr(config, "n_experts", 0):
        return {}
    per_micro_batch = balanced_exchange_bytes(
        tokens, top_k=config.top_k, ep=ep, moe_layers=config.n_layers - config.n_dense_layers,
        row_bytes=config.dim * act_bytes, recomputed=checkpointing_mode(activation_checkpointing) == "full",
    )  # fmt: skip
    return {label: micro_batches * value for label, value in per_micro_batch.items()}


def _dp_link_name(links: LinkBytes) -> str:
    used = [
        name
        for name, total in (("intra_node", links.intra_node_total), ("inter_node", links.inter_node_total))
        if total
    ]
    return "+".join(used) if used else "intra_node"
