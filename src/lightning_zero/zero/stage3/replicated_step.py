"""Stage 3 with an optimizer that is not element-wise (Adafactor): full fp32 masters, one unit at a time.

[Note: replicated step per unit] Stages 1-2 run such an optimizer (``REPLICATED_STEP_OPTIMIZERS``
in ``build.py``) on full fp32 masters that persist on every rank ([Note: non-element-wise
optimizers] in ``zero/replicated_optimizer.py``). Stage 3 holds no full parameter between uses, so the full
masters exist only while the step runs, and only for one unit at a time:

- the gradient sync is stage 3's own (a reduce-scatter per bucket during backward); every chunk
  master gets its reduced gradient chunk, exactly as for element-wise optimizers, and gradient
  clipping scales those chunks (the global norm: each rank counts only the elements it owns);
- the wrapped optimizer's param groups hold one fp32 *full master* per parameter, shaped like
  it: a view of a per-flat-group run whose storage is allocated only during the step (as stage
  3's compute parameters are). Its ``.grad`` between steps is a *stand-in*: a 4-byte zero scalar
  expanded to the parameter's shape. ``optimizer.zero_grad()`` drops it (or zeroes it in place),
  which is how the engine sees that this optimizer zeroed its gradients ([Note: zero_grad
  detection] in ``reducer.py``);
- ``optimizer.step(closure)`` runs the closure (forward, backward, clipping) with those param
  groups in place, then the optimizer's own loop sees empty param groups (a step pre-hook wraps
  the closure so they are emptied once it returned); a step post-hook then steps each unit in
  turn: all-gather that unit's fp32 master chunks and clipped fp32 gradient chunks into full
  runs (``all_gather_masters`` and ``all_gather_grads_replicated``, ``P (dp-1)/dp`` fp32
  elements each per step), hand the full gradients to the full masters, run the optimizer
  class's own ``step`` over that unit's full masters only (no hooks, no closure), copy each
  bucket's owned range back into this rank's master chunk, and free the runs. The step's
  temporaries are at most ``8 * numel`` bytes of the largest unit (``step_temporary_bytes_high_water``);
- a full master whose stand-in was dropped is skipped (as torch skips a parameter without
  gradient); one zeroed in place steps with a zero gradient, as torch would;
- the optimizer state (Adafactor's row/column second moments and step, the full ``variance``
  of 1-D parameters) belongs to the full masters, is identical on every rank and is *not*
  sharded; only the fp32 masters are (each rank keeps its chunks). Tied parameters are one
  parameter of one unit (the root, [Note: shared parameters] in ``units.py``): one full master.
  Checkpoints save the weights (from the chunks); saving this optimizer's state is refused, as
  at stages 1-2.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.zero.flat import ChunkedParamGroup
from lightning_zero.zero.hidden_step import HiddenFromOwnStep
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.replicated_optimizer import ReplicatedOptimizer


def unhooked_step(optimizer: Optimizer) -> Callable[..., Any]:
    """The optimizer class's own ``step``, without torch's wrapper that runs the step hooks."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _stand_in(master: torch.Tensor) -> torch.Tensor:
    """A gradient shaped like ``master`` that costs one element (see the Note)."""
    return torch.zeros((), dtype=master.dtype, device=master.device).expand(master.shape)


class UnitReplicatedOptimizer(HiddenFromOwnStep, ReplicatedOptimizer):
    """Stage 3: steps full fp32 masters of its parameters, one unit at a time, on every dp rank.

    See [Note: replicated step per unit]. Same surface as :class:`ShardedOptimizer`; gradients,
    clipping and the norm work on the master chunks (the element-wise optimizer's versions).

    Args (besides :class:`ShardedOptimizer`'s):
        units: the flat groups of each stage-3 unit, in the order the units are stepped (the
            same on every rank); the step's temporaries never exceed one unit's fp32 master plus
            fp32 gradient (``8`` bytes per element of its groups).
    """

    masters = ShardedOptimizer.masters
    _norm_terms = ShardedOptimizer._chunk_norm_terms
    extra_grad_bytes = ShardedOptimizer.extra_grad_bytes
    extra_master_bytes = ShardedOptimizer.extra_master_bytes

    def __init__(
        self, optimizer: Optimizer, flat_groups: list[list[ChunkedParamGroup]], *, units: list[list[Any]], **kwargs: Any
    ) -> None:
        self.step_temporary_bytes = 0  # bytes of full runs alive now (only inside a step)
        self.step_temporary_bytes_high_water = 0
        super().__init__(optimizer, flat_groups, **kwargs)
        param_group_of = {id(group): index for index, groups in enumerate(flat_groups) for group in groups}
        plan = [[(param_group_of[id(g)], g) for g in unit if id(g) in param_group_of] for unit in units]
        self._plan: list[list[tuple[int, ChunkedParamGroup]]] = [steps for steps in plan if steps]
        self._register_hiding()  # zero/hidden_step.py

    def _point_optimizer_at_masters(self, eager_state: dict) -> None:
        self._master_of_param: dict[int, nn.Parameter] = {}  # module param id -> full master
        self._runs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # group id -> (master run, grad run)
        self._grad_view: dict[int, torch.Tensor] = {}  # full master id -> its view of the grad run
        self._params_per_group: list[list[nn.Parameter]] = []
        for param_group, groups in zip(self.optimizer.param_groups, self.flat_groups):
            masters = []
            for group in groups:
                master_run, grad_run = (
                    torch.empty(group.layout.numel, dtype=group.master_dtype, device=group.master_device)
                    for _ in range(2)
                )
                slot_masters = self._slot_masters(group, master_run)
                for slot, master in zip(group.layout.slots, slot_masters):
                    self._grad_view[id(master)] = grad_run[slot.offset : slot.end].view(slot.shape)
                for run in (master_run, grad_run):  # views made: storage only during the step
                    run.untyped_storage().resize_(0)
                self._runs[id(group)] = (master_run, grad_run)
                masters.extend(slot_masters)
            param_group["params"] = masters
            self._params_per_group.append(masters)
        self.optimizer.state.clear()
        self._copy_eager_state(eager_state)

    @property
    def _grad_holders(self) -> list[nn.Parameter]:
        return [master for masters in self._params_per_group for master in masters]

    @property
    def _scaled_by_clipping(self) -> list[nn.Parameter]:
        return ShardedOptimizer.masters.fget(self)  # the chunks hold the gradients the step gathers

    def prepare_master_grads(self, buckets: list[Any]) -> None:
        """Chunk masters get their reduced chunks; full masters of groups that got them a stand-in."""
        ShardedOptimizer.prepare_master_grads(self, buckets)
        for groups in self.flat_groups:
            for group in groups:
                if all(chunk.grad is not None for chunk in group.masters):
                    for slot in group.layout.slots:
                        master = self._master_of_param[id(slot.param)]
                        master.grad = _stand_in(master)
        self._remember_grads()

    # -- the step ---------------------------------------------------------------------------------
    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        try:
            with record_function("lightning_zero::replicated_step_by_unit"):
                for steps in self._plan:
                    self._step_unit(steps)
        finally:
            self._show_params()
        for groups in self.flat_groups:
            for group in groups:
                group.copy_masters_to_params()

    def _step_unit(self, steps: list[tuple[int, ChunkedParamGroup]]) -> None:
        """Gather one unit's full fp32 masters and gradients, step them, keep the owned ranges."""
        stepping = [
            (index, group)
            for index, group in steps
            if any(self._master_of_param[id(slot.param)].grad is not None for slot in group.layout.slots)
        ]
        if not stepping:
            return
        for _, group in stepping:
            master_run, grad_run = self._allocate(group)
            self._gather_run(group, master_run, [chunk.detach() for chunk in group.masters], "all_gather_masters")
            grads = [chunk.grad if chunk.grad is not None else torch.zeros_like(chunk) for chunk in group.masters]
            self._gather_run(group, grad_run, [grad.detach() for grad in grads], "all_gather_grads_replicated")
        params_per_group: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        stand_ins: list[tuple[nn.Parameter, torch.Tensor]] = []
        for index, group in stepping:
            for slot in group.layout.slots:
                master = self._master_of_param[id(slot.param)]
                if master.grad is None:  # zero_grad dropped it: torch skips such a parameter
                    continue
                stand_in, full_grad = master.grad, self._grad_view[id(master)]
                handed = self._handed_out.get(id(master))
                if handed is None or handed[0] is not stand_in or stand_in._version != handed[1]:
                    full_grad.copy_(stand_in)  # zeroed in place (or replaced) since the hand-out
                stand_ins.append((master, stand_in))
                master.grad = full_grad
                params_per_group[index].append(master)
        try:
            for param_group, params in zip(self.optimizer.param_groups, params_per_group):
                param_group["params"] = params
            unhooked_step(self.optimizer)(self.optimizer)
        finally:
            for master, stand_in in stand_ins:
                master.grad = stand_in
        for _, group in stepping:
            master_run, _ = self._runs[id(group)]
            for bucket, chunk in zip(group.layout.buckets, group.masters):
                start = bucket.shard_start(group.dp_rank)
                chunk.detach().copy_(master_run[start : start + bucket.shard_numel])
            self._free(group)

    def _allocate(self, group: ChunkedParamGroup) -> tuple[torch.Tensor, torch.Tensor]:
        runs = self._runs[id(group)]
        for run in runs:
            run.untyped_storage().resize_(run.numel() * run.element_size())
            self.step_temporary_bytes += run.numel() * run.element_size()
        self.step_temporary_bytes_high_water = max(self.step_temporary_bytes_high_water, self.step_temporary_bytes)
        return runs

    def _free(self, group: ChunkedParamGroup) -> None:
        for run in self._runs[id(group)]:
            self.step_temporary_bytes -= run.untyped_storage().nbytes()
            run.untyped_storage().resize_(0)

    def _gather_run(self, group: Any, run: torch.Tensor, chunks: list[torch.Tensor], label: str) -> None:
        """All-gather ``chunks`` into ``run`` on the device the collectives use (through a
        temporary there when the masters are offloaded to CPU)."""
        device = group.shard_buffer.device
        on_device = [chunk.to(device) for chunk in chunks]
        if run.device == device:
            self._gather_chunks_into(group, run, on_device, label)
            return
        gathered = torch.empty(run.numel(), dtype=run.dtype, device=device)
        self._gather_chunks_into(group, gathered, on_device, label)
        run.copy_(gathered)

    def all_gather_params(self) -> None:
        """Stage 3 gathers parameters at their unit's next use: nothing to refresh here."""

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self._remove_hiding()
