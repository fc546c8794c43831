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
  ([Note: zero_grad detection] in ``reducer.py``), per optimizer.

Optimizers that create their state in ``__init__`` (Adagrad's ``sum``) are accepted: their
per-element state tensors are cut into the same chunks as the parameters (padding reads zero)
and scalar state (``step``) is copied, so the sharded step starts where the unsharded would.
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
from lightning_zero.zero.reducer import Bucket, wait_work


class ShardedOptimizer:
    """Rewires ``optimizer`` to step fp32 master chunks and keeps the compute parameters in sync.

    Args:
        optimizer: any element-wise ``torch.optim`` optimizer over the module's parameters; it
            must not have taken a step yet (state made in its ``__init__`` is sharded).
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
        collective_timeout: Optional[float] = None,
    ) -> None:
        eager_state = {param: state for param, state in optimizer.state.items() if len(state)}
        self.optimizer = optimizer
        self.flat_groups = flat_groups
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.counter = counter
        self.norm_group = norm_group if norm_group is not None else dp_group
        self.gather_params = gather_params
        self.comm_device = comm_device  # where collectives run (masters may be offloaded to CPU)
        self.collective_timeout = collective_timeout
        self.replicated_weight: dict[int, torch.Tensor] = {}  # master id -> per-element 1/tp weights

        for param_group, groups in zip(optimizer.param_groups, flat_groups):
            param_group["params"] = [master for group in groups for master in group.masters]
        optimizer.state.clear()
        if eager_state:
            self._shard_eager_state(eager_state)
        self._handed_out: dict[int, tuple[torch.Tensor, int]] = {}  # master id -> (grad, version)
        self._post_hook = optimizer.register_step_post_hook(self._after_step)

    @property
    def _poll(self) -> bool:
        return self.comm_device is None or torch.device(self.comm_device).type == "cpu"

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

    def _shard_eager_state(self, state_of_param: dict) -> None:
        """State made before the engine existed (Adagrad's ``sum``): cut it like the parameters."""
        name = type(self.optimizer).__name__
        for groups in self.flat_groups:
            for group in groups:
                for bucket, master in zip(group.layout.buckets, group.masters):
                    states = [(slot, state_of_param.get(slot.param)) for slot in bucket.slots]
                    keys = {key for _, state in states if state for key in state}
                    if not keys:
                        continue
                    sharded: dict[str, Any] = {}
                    for key in sorted(keys):
                        values = [(slot, state[key]) for slot, state in states if state and key in state]
                        sample = values[0][1]
                        if torch.is_tensor(sample) and sample.dim() > 0:
                            for slot, value in values:
                                if value.shape != slot.shape:
                                    raise ValueError(
                                        f"lightning_zero: {name} holds state {key!r} of shape {tuple(value.shape)}"
                                        f" for parameter {slot.name!r} of shape {tuple(slot.shape)}: only state"
                                        " shaped like its parameter (element-wise optimizers) can be sharded."
                                    )
                            by_param = {id(slot.param): value for slot, value in values}
                            chunk = torch.zeros(master.shape, dtype=sample.dtype, device=master.device)
                            group.layout.copy_range_from(
                                bucket.shard_start(group.dp_rank),
                                bucket.shard_start(group.dp_rank) + bucket.shard_numel,
                                chunk,
                                lambda slot: by_param.get(id(slot.param)),
                            )
                            sharded[key] = chunk
                        else:
                            sharded[key] = sample.clone() if torch.is_tensor(sample) else sample
                    self.optimizer.state[master] = sharded

    def forget_handed_out_grads(self) -> None:
        """After the engine reset this optimizer's gradients: nothing handed out is pending."""
        self._handed_out = {}

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
            for index, work in enumerate(works):
                wait_work(
                    work,
                    self.collective_timeout,
                    lambda index=index: f"the parameter all-gather {index + 1} of {len(works)} after"
                    f" {type(self.optimizer).__name__}.step()",
                    poll=self._poll,
                )

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
        work = all_reduce(value, self.norm_group, op=op, async_op=True, counter=self.counter, label="all_reduce_grad_norm")
        wait_work(work, self.collective_timeout, lambda: "the gradient-norm all-reduce of gradient clipping", poll=self._poll)
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
