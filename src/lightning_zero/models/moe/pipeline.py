"""Pipeline stages of a :class:`~lightning_zero.models.moe.model.MoETransformer`.

A ``MoETransformer`` is a ``Llama`` whose blocks take the same ``(h, cos, sin)``: it is cut by
Llama's own step (``models/llama/pipeline.cut_llama``, which builds the model's
``pipeline_stage_class``: :class:`MoEStage`, a ``LlamaStage`` holding the model's own blocks
under their dense names), after the ep step kept this rank's experts, so each stage's MoE layers
exchange tokens over the ep group of that stage's ranks (``comm/mesh.py``: every ep and edp group
lives inside one pp rank's block). What is the MoE family's own is where its batch-dependent
terms go.

[Note: MoE pipeline stages] A pipeline runs each training batch as ``m = pp_microbatches``
slices, each one forward through the stages, so the terms that depend on the tokens a forward
sees together are each micro-batch's (Megatron does the same): the load-balancing and z losses
(not linear in the tokens: the mean of micro-batches' balance losses is not the batch's), the
assignments the selection-bias update counts, and the capacity a capacity factor allows. A
pipelined MoE therefore equals ddp run on the micro-batches: ``batch_size`` the micro-batch's,
``accumulate_grad_batches`` times ``m`` (ddp's loss of each is ``ce + aux``, divided by
Lightning's accumulation count; tests/scripts/pp_moe_parity.py checks losses and weights):

- the balance and z losses live in the MoE layers of every stage, not only the last, where the
  loss is. Each training forward of a :class:`MoEStage` sums its layers' terms, ``aux =
  aux_loss_coef * balance + z_loss_coef * z``, and attaches them to its output with
  :class:`AttachAux` (Megatron's ``MoEAuxLossAutoScaler``): forward returns the activation, backward
  passes the activation's gradient on and sends ``loss_scale`` into ``aux``: the factor the
  schedule's loss function puts on each micro-batch's loss (``1 / accumulate_grad_batches``: the
  pipelined step's ``_loss_of_microbatch``), so ``aux`` gets the gradient it would get were it
  added to that micro-batch's loss; torch's ``scale_grads`` then divides both by ``m``. The
  gradient rides the stage's own graph, so it needs nothing of the schedule: a zero-bubble
  schedule's input pass (``retain_graph``) reaches the router through the same nodes, and its
  weight pass finds the router weight's share there too (the router's linear joins both paths).
- the logged loss is ddp's: the stages' ``aux`` of the step's last ``m`` forwards (torch's first
  step of a schedule runs one more, inferring shapes), averaged over them, summed over the pp
  ranks with the last stage's mean cross entropy (one all-reduce): ``MoELM``'s
  ``loss + model.aux_loss()`` reads it from the pipelined model.
- the bias update counts each stage's assignments over those same forwards (counts add), into the
  model's step sums (:meth:`MoETransformer.record_routing`), which ``update_router_bias`` reduces
  over the stage's dense group after the optimizer step as ddp reduces its accumulated forwards';
  the expert-load monitor reads the same sums (``take_moe_stats``): under pp a rank's figures are
  its stages' MoE layers, numbered in its own order.
- a capacity factor caps each forward's assignments, so each micro-batch's, as ddp's forward of
  the same micro-batch does: nothing to add.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_zero.models.llama.pipeline import LlamaStage


class AttachAux(torch.autograd.Function):
    """``apply(output, aux, scale)``: ``output`` unchanged; in backward ``output``'s gradient and
    ``scale`` for the scalar ``aux`` ([Note: MoE pipeline stages])."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        # the same storage as a new tensor, not a view: torch's stage detaches its outputs in place
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoEStage(LlamaStage):
    """A :class:`LlamaStage` of a MoE model: each training forward keeps its MoE layers' loads and
    ``(balance, z)`` in :attr:`routed` and attaches their weighted sum to its output ([Note: MoE
    pipeline stages]); ``model``: the ``MoETransformer`` it is cut from."""

    def __init__(self, model: Any, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__(model, blocks, first=first, last=last)
        self.moe_blocks = [(int(index), block.moe) for index, block in self.layers.items() if block.moe is not None]
        self.coefs = (model.config.aux_loss_coef, model.config.z_loss_coef)
        # per training forward: (loads (n_moe_blocks, E) int64, (balance, z) summed over the blocks, detached)
        self.routed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.moe_blocks or not torch.is_grad_enabled():
            return out
        balance = torch.stack([moe.aux[0] for _, moe in self.moe_blocks]).sum()
        z = torch.stack([moe.aux[1] for _, moe in self.moe_blocks]).sum()
        loads = torch.stack([moe.load for _, moe in self.moe_blocks])
        self.routed.append((loads, torch.stack([balance, z]).detach()))
        aux_coef, z_coef = self.coefs
        if aux_coef or z_coef:
            out = AttachAux.apply(out, aux_coef * balance + z_coef * z, self.loss_scale)
        return out


def finish_pipeline_step(model: Any, microbatches: int) -> Optional[torch.Tensor]:
    """After one step of the schedule: the loads and losses of each stage's last ``microbatches``
    training forwards go to ``model.record_routing`` (the bias update and the monitor), and the
    weighted auxiliary loss of this rank's stages, averaged over the micro-batches, is returned
    (``None`` when both coefficients are 0) ([Note: MoE pipeline stages]). ``model``: the cut
    ``MoETransformer`` (its own module imports this one's)."""
    loads: dict[int, torch.Tensor] = {}
    terms: list[torch.Tensor] = []
    for stage in model.pipeline_stages.values():
        routed, stage.routed = stage.routed[-microbatches:], []
        if not routed:
            continue
        summed = torch.stack([entry[0] for entry in routed]).sum(dim=0)
        loads.update({index: summed[row] for row, (index, _) in enumerate(stage.moe_blocks)})
        terms.append(torch.stack([entry[1] for entry in routed]).sum(dim=0))
    if loads:
        counts = torch.stack([loads[index] for index in sorted(loads)])  # moe_layers()'s order
        model.record_routing(counts, torch.stack(terms).sum(dim=0), forwards=microbatches)
    aux_coef, z_coef = model.config.aux_loss_coef, model.config.z_loss_coef
    if not (aux_coef or z_coef):
        return None
    if not terms:
        return torch.zeros((), dtype=torch.float32, device=model.rope_cos.device)
    balance, z = torch.stack(terms).sum(dim=0)
    return (aux_coef * balance + z_coef * z) / microbatches
