"""ShardedOptimizer: the user's own torch optimizer, pointed at this rank's fp32 master chunks.

The optimizer object the user returned from ``configure_optimizers`` is kept (so LR schedulers,
``isinstance`` checks and hyperparameters in ``param_groups`` keep working); only each param
group's ``"params"`` list is replaced by the fp32 master chunks this rank owns (one per bucket,
see [Note: flat layout] in ``flat.py``). Its state (Adam's ``exp_avg``/``exp_avg_sq``) therefore
exists only for the chunk: that is the optimizer-state sharding of ZeRO stage 1.

Around ``optimizer.step()``:

- the reducer's ``finish_grad_sync`` hands each master its reduced gradient chunk
  (:meth:`prepare_master_grads`; a view in fp32, an fp32 copy under bf16-mixed);
- a step post-hook writes the updated chunks back into the compute parameters and all-gathers
  every bucket, so each rank holds the full updated parameters again (:meth:`all_gather_params`);
- ``optimizer.zero_grad()`` needs no patching: the reducer notices dropped master gradients
  ([Note: zero_grad detection] in ``reducer.py``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.collectives import CommCounter, all_reduce
from lightning_zero.zero.flat import FlatParamGroup
from lightning_zero.zero.reducer import Bucket


class ShardedOptimizer:
    """Rewires ``optimizer`` to step fp32 master chunks and keeps the compute parameters in sync.

    Args:
        optimizer: any element-wise ``torch.optim`` optimizer over the module's parameters; it
            must not have taken a step yet.
        flat_groups: for each of ``optimizer.param_groups``, the flat groups holding its params.
        dp_group / dp_size: the data-parallel group the parameters are sharded over.
        norm_groups: process groups whose ranks hold *different* gradient chunks (dp, plus tp
            under tensor parallelism): the gradient norm is summed over them.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        flat_groups: list[list[FlatParamGroup]],
        *,
        dp_group: Optional[dist.ProcessGroup],
        dp_size: int,
        counter: CommCounter,
        norm_group: Optional[dist.ProcessGroup] = None,
        gather_params: bool = True,
        comm_device: Optional[torch.device] = None,
    ) -> None:
        if any(len(state) for state in optimizer.state.values()):
            raise ValueError(
                f"lightning_zero: the optimizer {type(optimizer).__name__} already holds state."
                " Create it fresh in `configure_optimizers`; the strategy shards it before the first step."
            )
        self.optimizer = optimizer
        self.flat_groups = flat_groups
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.counter = counter
        self.norm_group = norm_group if norm_group is not None else dp_group
        self.gather_params = gather_params
        self.comm_device = comm_device  # where collectives run (masters may be offloaded to CPU)
        self.replicated_weight: dict[int, torch.Tensor] = {}  # master id -> per-element 1/tp weights

        for param_group, groups in zip(optimizer.param_groups, flat_groups):
            param_group["params"] = [master for group in groups for master in group.masters]
        optimizer.state.clear()
        self._handed_out: dict[int, tuple[torch.Tensor, int]] = {}  # master id -> (grad, version)
        self._post_hook = optimizer.register_step_post_hook(self._after_step)

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        return [master for groups in self.flat_groups for group in groups for master in group.masters]

    def owns(self, bucket: Bucket) -> bool:
        return any(bucket.group is group for groups in self.flat_groups for group in groups)

    def prepare_master_grads(self, buckets: list[Bucket]) -> None:
        """Give each master chunk its reduced gradient (called when gradient sync finished)."""
        for bucket in buckets:
            if not self.owns(bucket):
                continue
            master = bucket.group.masters[bucket.layout.index]
            chunk = bucket.grad_chunk
            assert chunk is not None
            same = chunk.dtype == master.dtype and chunk.device == master.device
            master.grad = chunk if same else chunk.to(device=master.device, dtype=master.dtype)
        self._remember_grads()

    def _remember_grads(self) -> None:
        self._handed_out = {id(m): (m.grad, m.grad._version) for m in self.masters if m.grad is not None}

    def grads_were_zeroed(self) -> bool:
        """True if any master gradient we handed out was dropped or changed in place since.

        See [Note: zero_grad detection] in ``reducer.py``.
        """
        for master in self.masters:
            handed = self._handed_out.get(id(master))
            if handed is None:
                continue
            grad, version = handed
            if master.grad is None or master.grad is not grad or grad._version != version:
                return True
        return False

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for groups in self.flat_groups:
            for group in groups:
                group.copy_masters_to_params()
        if self.gather_params:  # stage 3 gathers lazily, at the next forward
            self.all_gather_params()

    def all_gather_params(self) -> None:
        """All-gather every bucket's updated chunk over dp (stages 1-2)."""
        with record_function("lightning_zero::all_gather_params"):
            works = [
                work
                for groups in self.flat_groups
                for group in groups
                for work in group.start_all_gather(self.dp_group, self.counter)
            ]
            for work in works:
                work.wait()

    # -- gradient clipping over shards ---------------------------------------------------------
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over every rank's chunks (one all-reduce of a scalar)."""
        grads = [(m, m.grad) for m in self.masters if m.grad is not None]
        device = grads[0][1].device if grads else torch.device("cpu")
        if norm_type == math.inf:
            local = torch.zeros((), dtype=torch.float32, device=device)
            for _, grad in grads:
                local = torch.maximum(local, grad.detach().abs().max().float())
            return self._all_reduce_scalar(local, dist.ReduceOp.MAX)
        local = torch.zeros((), dtype=torch.float32, device=device)
        for master, grad in grads:
            values = grad.detach().float().abs().pow(norm_type)
            weight = self.replicated_weight.get(id(master))
            local += (values * weight).sum() if weight is not None else values.sum()
        return self._all_reduce_scalar(local, dist.ReduceOp.SUM).pow(1.0 / norm_type)

    def _all_reduce_scalar(self, local: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        device = self.comm_device or local.device
        value = local.to(device)
        all_reduce(value, self.norm_group, op=op, counter=self.counter, label="all_reduce_grad_norm")
        return value.to(local.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every master gradient so the global norm is at most ``max_norm`` (as torch does)."""
        with record_function("lightning_zero::clip_grad_norm"):
            total = self.grad_norm(norm_type)
            clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for master in self.masters:
                if master.grad is not None:
                    master.grad.detach().mul_(clip_coef.to(master.grad.dtype))
            self._remember_grads()
            return total

    def clip_grad_value_(self, clip_value: float) -> None:
        for master in self.masters:
            if master.grad is not None:
                master.grad.detach().clamp_(-clip_value, clip_value)
        self._remember_grads()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (Adam's moments, step counters) on this rank."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def remove_hooks(self) -> None:
        self._post_hook.remove()
