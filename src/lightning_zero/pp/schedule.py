"""torch's pipeline schedules over our stages: build once, then one ``step`` per optimizer step.

[Note: what torch's schedules do for us] ``torch.distributed.pipelining`` owns the order of
forwards and backwards, the point-to-point sends and receives, the shape inference of the first
step, the micro-batch split of the batch (``TensorChunkSpec`` on dim 0) and the loss per
micro-batch on the last stage; with ``scale_grads=True`` it divides the accumulated gradients by the
micro-batch count, so equal micro-batches give the batch-mean gradient ddp computes. What it
cannot do for us, and so we do (the doors: [Note: the pipelined step] in ``runtime/pipeline.py``):

- choose the split and check it before any process group (``pp/layout.py``);
- drive a data-parallel engine of its own kind: the stage knows ``DistributedDataParallel`` and
  ``FSDPModule`` by name (``backward_maybe_with_nosync``, ``perform_reduce_grad``) and nothing
  else, so our ZeRO engine is driven from outside, once per step;
- keep gradients where a hook-driven reducer sees them: the zero-bubble schedules compute weight
  gradients with ``torch.autograd.grad`` and add them to ``.grad`` by hand, so no accumulate-grad
  hook fires; the engine's hooks are paused for the step and its gradients handed in as one
  backward ([Note: gradients handed in] in ``zero/engine.py``);
- accumulate across steps: ``scale_grads`` divides every ``.grad`` of the stage in place at the end
  of ``step``, whatever earlier steps left there, so each step's gradients start at ``None``;
- report one loss per step on every rank (only the last stage computes it: it is broadcast); the
  first ``step`` of a schedule also calls the loss on uninitialized outputs while it infers shapes,
  so only the last ``m`` losses are the micro-batches';
- run a batch of another shape: shapes are inferred once per schedule object (one per shape);
- evaluate under ``zbv``: its ``eval`` asserts on the V's local hand-over ("can't steal_bwd_input
  if this stage doesn't have backward"), so evaluation runs the stages forward by hand;
- clip over every stage (the engine's norm group spans every rank);
- name a failure: a stage wraps the model's own exception in "failed to run forward/backward"
  (the pipelined step re-raises the model's own, which the failure path posts);
- end every rank when one fails: its receives have no timeout of their own beyond the process
  group's (not built yet).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.pp.layout import MULTI_STAGE, TORCH_SCHEDULES, PipelineLayout


def build_schedule(
    layout: PipelineLayout,
    stage_modules: dict[int, nn.Module],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stage_class: Optional[type] = None,
) -> Any:
    """torch's schedule for ``layout`` over this rank's ``stage_modules`` (stage index -> module);
    ``stage_class``: a subclass of torch's ``PipelineStage`` instead of it (``pp/measure.py``'s)."""
    import torch.distributed.pipelining as pipelining

    expected = layout.rank_stages(dist.get_rank(group))
    if sorted(stage_modules) != sorted(expected):
        raise ValueError(f"this pp rank runs stages {expected}, got modules for {sorted(stage_modules)}")
    stage_class = stage_class or pipelining.PipelineStage
    stages = [stage_class(stage_modules[index], index, layout.num_stages, device, group=group) for index in expected]
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[layout.schedule])
    if layout.schedule in MULTI_STAGE:
        return schedule_class(stages, layout.microbatches, loss_fn=loss_fn)
    return schedule_class(stages[0], layout.microbatches, loss_fn=loss_fn)


def holds_first_stage(layout: PipelineLayout, pp_rank: int) -> bool:
    return 0 in layout.rank_stages(pp_rank)


def holds_last_stage(layout: PipelineLayout, pp_rank: int) -> bool:
    return layout.num_stages - 1 in layout.rank_stages(pp_rank)


def run_step(
    schedule: Any, layout: PipelineLayout, pp_rank: int, inputs: torch.Tensor, targets: torch.Tensor
) -> Optional[torch.Tensor]:
    """One forward and backward of the whole batch through the pipeline; gradients accumulate in
    each stage's parameters. Returns the batch's mean loss on the rank holding the last stage
    (``None`` elsewhere)."""
    from torch.profiler import record_function

    kwargs: dict[str, Any] = {}
    losses: Optional[list[torch.Tensor]] = None
    if holds_last_stage(layout, pp_rank):
        losses = []
        kwargs.update(target=targets, losses=losses)
    args = (inputs,) if holds_first_stage(layout, pp_rank) else ()
    with record_function("lightning_zero::pp_schedule_step"):
        schedule.step(*args, **kwargs)
    if losses is None:
        return None
    return torch.stack([loss.detach() for loss in losses]).mean()
