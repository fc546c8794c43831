"""The router of a mixture-of-experts layer and its two auxiliary losses.

[Note: routing] ``Router.forward(x)`` maps tokens ``(N, dim)`` to ``Routing``: the ``top_k`` expert
ids of each token, their combine weights, and the fp32 quantities the auxiliary losses read.

- ``softmax`` (Mixtral, Qwen3-MoE): ``p = softmax(x W^T)`` over all experts in fp32; the k largest
  are chosen and, with ``norm_topk_prob``, divided by their sum (Mixtral always renormalizes;
  transformers' ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter`` compute exactly this).
- ``sigmoid`` (DeepSeek-V3): ``s = sigmoid(x W^T)``; experts are chosen by ``s + bias`` (the
  ``router_bias`` buffer, DeepSeek's ``e_score_correction_bias``), weighted by ``s`` alone,
  renormalized with ``norm_topk_prob``, times ``routed_scaling``. The bias is a buffer loaded from a
  checkpoint and saved with it, and moved during training by the rule below when
  ``bias_update_rate > 0``.

[Note: bias update] DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): after each
optimizer step, each MoE layer's bias moves by ``rate * sign(mean_e load_e - load_e)``: an expert
that took more than its share of the step's assignments is chosen less next step, one with less
more. ``load`` counts the step's assignments (every micro-batch's tokens x top-k, before any
capacity drop) over *all* data-parallel ranks, so every rank applies the same update, the same one
with and without expert or tensor parallelism, and the one ddp applies: the model sums the counts
its forwards already keep for the monitor (``MoE.load``, device tensors, in int64), and
:func:`bias_update` all-reduces them over the dense (dp*cp) group in one ``moe_bias_load``
exchange of ``n_moe_layers x E`` int64 (control bytes) and takes the sign in integers
(``sign(sum_e load_e - E load_e)``: exact at any token count). Device tensors throughout: no host
read, no device sync. The bias is a buffer: no gradient, no optimizer state, saved and resumed
with the model.

[Note: balance loss] The load-balancing loss of one MoE layer over the ``N`` tokens a rank's
micro-batch routes (Switch Transformer / DeepSeek's normalization: 1 at perfect balance)::

    balance = E / (N k) * sum_e  count_e * P_e        P_e = mean over tokens of p_e

``count_e``: assignments to expert ``e`` (not differentiable); ``p``: the softmax probabilities, or
for a sigmoid router the scores normalized to sum to 1 per token. The router z-loss (ST-MoE) is
``mean over tokens of logsumexp(logits)^2``. Both are computed from the rank's own tokens *before*
any token leaves the rank, so they are the same numbers with and without expert parallelism; under
data parallelism each rank's loss holds its own micro-batch's term and the gradients average over
ranks, as the cross entropy's do (the definition most libraries use: a per-rank sequence-batch
statistic, not a global all-reduced one). Counts of tokens dropped by a capacity factor still count
here (the router chose them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero.comm.collectives import CommCounter, all_reduce
from lightning_zero.tp.layers import reduce_from_tp_region


class Routing(NamedTuple):
    """What the router decided for ``N`` tokens."""

    expert_ids: torch.Tensor  # (N, k) int64: chosen experts, in descending score order
    weights: torch.Tensor  # (N, k) fp32: combine weights
    probs: torch.Tensor  # (N, E) fp32: the balance loss's p (see [Note: balance loss])
    logits: torch.Tensor  # (N, E) fp32: router logits (z-loss)


class Router(nn.Module):
    """``weight`` ``(n_experts, dim)`` (a bias-free linear gate) and, for DeepSeek-style routing,
    the selection ``bias`` buffer ``(n_experts,)`` (see [Note: routing])."""

    def __init__(self, dim: int, n_experts: int, top_k: int, kind: str, norm_topk_prob: bool, bias: bool,
                 scaling: float) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.kind, self.norm_topk_prob, self.scaling = top_k, kind, norm_topk_prob, scaling
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        if bias:
            self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.bias = None

    tp_grad_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # [Note: experts and tensor parallelism]

    def reset_parameters(self) -> None:
        if self.bias is not None:
            self.bias.zero_()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """``module.to(dtype)`` (a ``-true`` precision) leaves the selection bias in fp32: its
        updates ([Note: bias update]) are ``1e-3``-sized steps that bf16 would round away."""
        super()._apply(fn, recurse)
        if self.bias is not None and self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def forward(self, x: torch.Tensor) -> Routing:
        weight = self.weight if self.tp_grad_sum is None else self.tp_grad_sum(self.weight)
        logits = F.linear(x, weight).float()  # (N, E)
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, expert_ids = probs.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choose = scores if self.bias is None else scores + self.bias
            expert_ids = choose.topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, expert_ids)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return Routing(expert_ids, weights, probs, logits)


def expert_counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert ``(E,)`` int64 of ``expert_ids`` ``(N, k)``, on its device (no sync)."""
    return torch.bincount(expert_ids.reshape(-1), minlength=n_experts)


def balance_loss(routing: Routing, counts: torch.Tensor) -> torch.Tensor:
    """[Note: balance loss]: ``E / (N k) * sum_e count_e * mean_tokens(p_e)``, fp32 scalar."""
    tokens, n_experts = routing.probs.shape
    top_k = routing.expert_ids.shape[-1]
    if tokens == 0:
        return routing.probs.sum() * 0.0
    mean_probs = routing.probs.mean(dim=0)
    return (counts.to(mean_probs.dtype) * mean_probs).sum() * (n_experts / (tokens * top_k))


def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean over tokens of logsumexp(logits)^2``, fp32 scalar."""
    if routing.logits.shape[0] == 0:
        return routing.logits.sum() * 0.0
    return torch.logsumexp(routing.logits, dim=-1).pow(2).mean()


@dataclass
class TensorParallelShard:
    """The TP group a MoE layer's sequence shard belongs to ([Note: experts and tensor
    parallelism] in ``models/moe/parallelize.py``): ``size`` ranks, each routing ``1/size`` of the tokens;
    without ``sequence_parallel`` the layer cuts its shard from a replicated input and all-gathers
    its output."""

    group: dist.ProcessGroup
    size: int
    counter: Optional[CommCounter] = None
    sequence_parallel: bool = True  # False: the layer's input is replicated; it runs on its slice


def tp_aux_losses(
    routing: Routing, counts: torch.Tensor, tp: TensorParallelShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The balance and z losses of the whole micro-batch when each TP rank routed one sequence shard
    of it (equal shards), and the micro-batch's assignments per expert: ``(balance, z, counts)``.

    Both losses are sums over tokens, so the shards' sums are added over the TP group (probability
    sums and squared log-sum-exps with ``reduce_from_tp_region``: every rank then holds the whole
    micro-batch's loss, and its backward reaches this rank's own tokens unchanged; counts by a plain
    all-reduce, ``moe_tp_counts``, counted as control bytes). The result is
    :func:`balance_loss` / :func:`z_loss` of the unsplit micro-batch ([Note: balance loss])."""
    tokens, n_experts = routing.probs.shape
    top_k = routing.expert_ids.shape[-1]
    lse_sq = torch.logsumexp(routing.logits, dim=-1).pow(2).sum()
    sums = reduce_from_tp_region(torch.cat([routing.probs.sum(dim=0), lse_sq.unsqueeze(0)]), tp.group, tp.counter)
    all_counts = counts.detach().clone()
    all_reduce(all_counts, tp.group, counter=tp.counter, label="moe_tp_counts", control=True)
    total = tokens * tp.size
    balance = (all_counts.to(sums.dtype) * sums[:n_experts]).sum() * (n_experts / (total * total * top_k))
    return balance, sums[n_experts] / total, all_counts


def bias_update(
    load: torch.Tensor,
    rate: float,
    group: Optional[dist.ProcessGroup] = None,
    counter: Optional[CommCounter] = None,
) -> torch.Tensor:
    """[Note: bias update]: the step of every MoE layer's selection bias ``(n_moe_layers, E)``
    fp32, from this rank's assignments ``load`` ``(n_moe_layers, E)`` int64 of the step (summed over
    ``group``, the dense group; ``None``: the default group, when one is initialized)."""
    load = load.to(torch.int64).clone()
    if dist.is_available() and dist.is_initialized():
        all_reduce(load, group, counter=counter, label="moe_bias_load", control=True)
    n_experts = load.shape[-1]
    above_mean = torch.sign(load.sum(dim=-1, keepdim=True) - n_experts * load)  # sign(mean - load), exact
    return rate * above_mean.to(torch.float32)
