"""The parameter side of a ZeRO engine: what happens to the parameters around a step.

The gradient side differs between stages 1 and 2 by one object (``grad_storage.py``:
``FullGradStorage`` / ``ShardedGradStorage``); the parameter side differs between stages 1-2 and 3
by one object too, so the engine never asks which stage it runs:

- :class:`ReplicatedParams` (stages 1-2): every rank holds full parameters; after each step the
  updated chunks are all-gathered, overlapped with the next forward when
  ``config.overlap_param_gather`` is on ([Note: overlapped parameter gather] in
  ``param_gather.py``), and the fp32 masters go back into the module at teardown.
- :class:`ShardedParams` (stage 3): each rank holds its shard; ``zero/stage3/`` gathers units on
  demand by the phase of the step ([Note: phases] in ``stage3/runtime.py``).

Both have the same methods, each called by the engine at one point of a step or of its life.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.zero.flat import FlatParamGroup
from lightning_zero.zero.offload import OffloadCopies, pin_masters
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.param_gather import ParamGatherer
from lightning_zero.zero.replicated_optimizer import ReplicatedOptimizer

if TYPE_CHECKING:
    from lightning_zero.zero.reducer import GradReducer
    from lightning_zero.zero.stage3 import Stage3Runtime

REPLICATED_STEP_WARNING = (
    " copies of its parameters on every dp rank, so its optimizer state and fp32 masters are"
    " replicated, not sharded (only the stage-2 gradient shard saves memory), and each step"
    " all-gathers its reduced gradients. See [Note: non-element-wise optimizers]."
)
UNIT_REPLICATED_STEP_WARNING = (
    " copies of one unit's parameters at a time on every dp rank: its optimizer state is"
    " replicated, not sharded (masters, gradients and parameters still are), and each step"
    " all-gathers the fp32 master and gradient chunks. See [Note: replicated step per unit]."
)


def offload_masters(optimizers: list[ShardedOptimizer], device: torch.device) -> None:
    """``config.offload_optimizer``: pin each sharded optimizer's masters on the host and give it
    the copies that move gradients and masters ([Note: offload copies] in ``offload.py``)."""
    for opt in optimizers:
        if isinstance(opt, ReplicatedOptimizer):
            continue
        pin_masters([group for groups in opt.flat_groups for group in groups], device)
        opt.rebind_segments()  # pinning moved the masters' storage
        opt.offload = OffloadCopies(device)


class ReplicatedParams:
    """Stages 1-2: full parameters on every rank, all-gathered after each step."""

    gather_after_step = True  # ShardedOptimizer all-gathers the updated chunks after its step
    replicated_step_warning = REPLICATED_STEP_WARNING

    def __init__(self, module: nn.Module, *, overlap_gather: bool) -> None:
        self.module = module
        self.overlap_gather = overlap_gather
        self.gatherer: Optional[ParamGatherer] = None  # set in attach() when overlap_gather is on
        self.runtime: Optional[Stage3Runtime] = None

    def sharded_optimizer_class(self, optimizer: Optimizer) -> Callable[..., ShardedOptimizer]:
        """What steps an optimizer that is not element-wise: full replicated masters."""
        return ReplicatedOptimizer

    def attach(self, optimizers: list[ShardedOptimizer], reducer: GradReducer, **gather_kwargs: Any) -> None:
        """Wire the optimizers (built after this object): the overlapped all-gather, if on."""
        gathering = [opt for opt in optimizers if not isinstance(opt, ReplicatedOptimizer)]
        if not self.overlap_gather or not gathering:
            return
        self.gatherer = ParamGatherer(
            self.module, [group for opt in gathering for groups in opt.flat_groups for group in groups], **gather_kwargs
        )
        for opt in gathering:
            opt.param_gatherer = self.gatherer

    def wait(self) -> None:
        """Every parameter whole: wait for the all-gathers still in flight."""
        if self.gatherer is not None:
            self.gatherer.wait_all()

    def begin_step(self, kind: str) -> None:
        if self.gatherer is not None:
            if kind == "train":
                self.gatherer.begin_train_step()
            else:
                self.gatherer.wait_all()

    def end_step_call(self) -> None:
        if self.gatherer is not None:
            self.gatherer.end_train_step()

    def end_eval_step(self) -> None:
        pass

    def end_eval_loop(self) -> None:
        pass

    def unshard(self) -> None:
        pass  # already whole

    def release(self, release_grads: Callable[[], None]) -> None:
        """Teardown: nothing to gather (the masters go back into the module next)."""

    def refresh_from_masters(self, optimizers: list[ShardedOptimizer]) -> None:
        """After loading masters: this rank's compute chunks from its masters (separate copies under
        the -mixed precisions and ``master_weights="fp32"``), then all-gather the full parameters."""
        for sharded in optimizers:
            for groups in sharded.flat_groups:
                for group in groups:
                    group.copy_masters_to_params()
            sharded.all_gather_params()

    def remove_hooks(self) -> None:
        if self.gatherer is not None:
            self.gatherer.remove_hooks()


class ShardedParams:
    """Stage 3: each rank holds its shard of every unit; units are gathered on demand."""

    gather_after_step = False  # gathered lazily, at the next forward
    replicated_step_warning = UNIT_REPLICATED_STEP_WARNING

    def __init__(self, runtime: Stage3Runtime, groups: list[FlatParamGroup]) -> None:
        self.runtime = runtime
        self.groups = groups
        self.gatherer: Optional[ParamGatherer] = None  # stage 3 has no post-step all-gather

    def sharded_optimizer_class(self, optimizer: Optimizer) -> Callable[..., ShardedOptimizer]:
        """What steps an optimizer that is not element-wise: one unit's full masters at a time
        (``zero/stage3/replicated_step.py``)."""
        from lightning_zero.zero.stage3 import UnitReplicatedOptimizer

        return functools.partial(UnitReplicatedOptimizer, units=[unit.groups for unit in self.runtime.units])

    def attach(self, optimizers: list[ShardedOptimizer], reducer: GradReducer, **gather_kwargs: Any) -> None:
        """Tie the runtime's backward to the reducer's."""
        runtime = self.runtime
        runtime.on_backward_begin = reducer.begin_backward  # [Note: activation checkpointing] in stage3/runtime.py
        runtime.on_unit_skipped_in_backward = reducer.mark_absent  # [Note: skipped units and gradient buckets]
        runtime.on_dynamic = reducer.launch_at_end_of_backward  # [Note: dynamic execution]
        reducer.before_final_launch.append(runtime.flush_backward)

    def wait(self) -> None:
        pass  # nothing in flight between steps

    def begin_step(self, kind: str) -> None:
        self.runtime.begin_step(kind)

    def end_step_call(self) -> None:
        self.runtime.end_step_call()

    def end_eval_step(self) -> None:
        self.runtime.end_eval_step()

    def end_eval_loop(self) -> None:
        self.runtime.end_eval_loop()

    def unshard(self) -> None:
        """Every parameter becomes a full, independent tensor again (collective over dp), with
        the exact values, not ``param_comm_dtype``'s dequantized ones."""
        compressed = [(group, group.param_comm_dtype) for group in self.groups]
        for group, _ in compressed:
            group.param_comm_dtype = None
        try:
            self.runtime.unshard()
        finally:
            for group, comm_dtype in compressed:
                group.param_comm_dtype = comm_dtype

    def release(self, release_grads: Callable[[], None]) -> None:
        """Teardown: drop the gradients first (nothing reads them after fit), then gather the
        whole module, which holds ``4 P`` beside what is still alive."""
        release_grads()
        self.unshard()

    def refresh_from_masters(self, optimizers: list[ShardedOptimizer]) -> None:
        """After loading masters: each rank refreshes its own shard (gathered on use)."""
        for group in self.groups:
            group.copy_masters_to_params()

    def remove_hooks(self) -> None:
        self.runtime.remove_hooks()
