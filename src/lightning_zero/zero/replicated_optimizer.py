"""ReplicatedOptimizer: a non-element-wise optimizer (Adafactor) stepping full fp32 masters on every dp rank.

Stages 1-2; stage 3 has :class:`~lightning_zero.zero.stage3.UnitReplicatedOptimizer`
(``stage3/replicated_step.py``). Element-wise optimizers use
:class:`~lightning_zero.zero.optimizer.ShardedOptimizer`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.comm.collectives import all_gather
from lightning_zero.zero.domains import shard_group
from lightning_zero.zero.flat import ChunkedParamGroup, FlatParamGroup, OwnedRange, owned_ranges
from lightning_zero.zero.grad_storage import Bucket
from lightning_zero.zero.optimizer import ShardedOptimizer

# [Note: non-element-wise optimizers]
# Adafactor keeps, for every >= 2-D parameter, one second moment per row and one per column
# (factored); its update of an element depends on whole rows and columns of the parameter. An
# element-range chunk of the flat buffer ([Note: flat layout] in flat.py) cuts rows and whole
# parameters apart, so the sharded step of ShardedOptimizer would compute other statistics than
# the unsharded one. Such an optimizer (``REPLICATED_STEP_OPTIMIZERS`` in build.py) therefore
# steps *full* fp32 masters of its parameters, identically on every dp rank:
#
# - the gradient sync is unchanged (buckets reduce-scatter during backward, stage 2 still keeps
#   only the chunk between backward and step); at the end of the sync one extra all-gather per
#   bucket (``all_gather_grads_replicated``, P (dp-1)/dp elements of the compute dtype per step)
#   gives every rank the full averaged gradient, cast to a fresh fp32 buffer that lives until
#   the next backward (or the optimizer's zero_grad);
# - the optimizer steps full masters shaped like the parameters: in fp32 they are views of the
#   compute parameters (no copy); under bf16-mixed or optimizer offload they are views of one
#   full fp32 buffer per flat group, copied (cast) into the compute parameters after the step.
#   The flat group's master chunks become views of that buffer, so checkpoints read the
#   updated fp32 values through ``owned_ranges`` as for element-wise optimizers. No parameter
#   all-gather runs after the step: every rank already holds the same updated values;
# - the optimizer state is replicated: ZeRO saves nothing on it (nor on the fp32 master),
#   only the stage-2 gradient shard during backward. The engine warns about it at build;
# - gradient clipping: the norm counts only this rank's owned element range of each full
#   gradient (the same ranges the sharded path counts), summed over the norm group once, so it
#   equals the global norm without counting any element dp times;
# - checkpoints save the weights; saving this optimizer's (factored) state is refused with a
#   ValueError that names the fix (``save_weights_only=True``), as it is not range-shardable.
#
# Stage 3 (parameters sharded) keeps no full parameter between uses: there the full masters exist
# only during the step, one unit at a time (:class:`~lightning_zero.zero.stage3.UnitReplicatedOptimizer`,
# [Note: replicated step per unit] in stage3/replicated_step.py). LBFGS stays refused: its ``step(closure)`` re-runs forward and backward several times per step, each a
# gradient sync the step hooks do not expect; SparseAdam needs sparse gradients, which flat
# gradient buffers never are.
#
# [Note: replicated optimizer as a subclass]
# ReplicatedOptimizer is no special kind of sharded optimizer; it subclasses ShardedOptimizer for
# what the two share, about two thirds of that class: the constructor (flat groups, dp and norm
# groups, counter, waiter, the step post-hook), the gradient bookkeeping (zero_grad detection,
# dropping the gradients of parameters nobody used, forgetting handed-out gradients), clipping
# (grad_norm over the norm terms, clip_grad_norm_ / clip_grad_value_), the offload flush,
# state_bytes and remove_hooks. A small common base holding just those would say so honestly,
# but it is not a move of this class alone: the engine and param_side.py type every optimizer
# wrapper as ShardedOptimizer (the surface they call), and stage 3's
# UnitReplicatedOptimizer takes its step from this class and its masters, norm terms and byte
# counts back from ShardedOptimizer by name. Until that base is cut out (with the engine's types
# and the three optimizer paths' tests), "a ShardedOptimizer" in a type hint means any of the
# three wrappers, and an override here replaces a ShardedOptimizer method of the same meaning.


class ReplicatedOptimizer(ShardedOptimizer):
    """Steps full fp32 masters of its parameters on every dp rank (stages 1-2; stage 3 has
    :class:`~lightning_zero.zero.stage3.UnitReplicatedOptimizer`).

    See [Note: non-element-wise optimizers]. Same constructor and surface as
    :class:`ShardedOptimizer`; only the optimizer's params, the gradient hand-off, the post-step
    update and the norm terms differ ([Note: replicated optimizer as a subclass]).
    """

    def _point_optimizer_at_masters(self, eager_state: dict) -> None:
        self._full_masters: list[torch.Tensor] = []  # per flat group: fp32 buffer of layout.numel
        self._master_of_param: dict[int, torch.nn.Parameter] = {}  # module param id -> full master
        self._norm_slices: list[tuple[torch.nn.Parameter, int, int, torch.nn.Parameter, int]] = []
        for param_group, groups in zip(self.optimizer.param_groups, self.flat_groups):
            masters = []
            for group in groups:
                full = self._full_master_buffer(group)
                self._full_masters.append(full)
                masters.extend(self._slot_masters(group, full))
                for owned in owned_ranges([group]):
                    master = self._master_of_param[id(owned.param)]
                    self._norm_slices.append((master, owned.param_lo, owned.param_hi, owned.master, owned.chunk_lo))
            param_group["params"] = masters
        self.optimizer.state.clear()
        self._copy_eager_state(eager_state)

    def _slot_masters(self, group: ChunkedParamGroup, full: torch.Tensor) -> list[torch.nn.Parameter]:
        """One fp32 master per parameter of ``group``, shaped like it: a view of ``full`` (the
        group's whole flat run, ``layout.numel`` elements)."""
        masters = []
        for slot in group.layout.slots:
            master = torch.nn.Parameter(full[slot.offset : slot.end].view(slot.shape))
            self._master_of_param[id(slot.param)] = master
            masters.append(master)
        return masters

    def _copy_eager_state(self, eager_state: dict) -> None:
        """State made in the optimizer's ``__init__``: the parameter's own, copied to its full master."""
        for groups in self.flat_groups:
            for group in groups:
                for slot in group.layout.slots:
                    state = eager_state.get(slot.param)
                    if state:
                        master = self._master_of_param[id(slot.param)]
                        self.optimizer.state[master] = {
                            k: v.detach().clone().to(master.device) if torch.is_tensor(v) else v
                            for k, v in state.items()
                        }

    def _full_master_buffer(self, group: FlatParamGroup) -> torch.Tensor:
        """The full fp32 values of ``group`` on this rank; its master chunks become views of it."""
        if group.masters_alias_params:
            return group.param_buffer  # fp32: the masters are the parameters themselves
        # bf16-mixed / offload: the fp32 values exist only as each rank's chunks: gather them once.
        device = group.param_buffer.device
        full = torch.zeros(group.layout.numel, dtype=group.master_dtype, device=device)
        self._gather_chunks_into(group, full, [m.detach().to(device) for m in group.masters], "all_gather_masters")
        full = full.to(group.master_device)
        group.masters = [
            torch.nn.Parameter(
                full[bucket.shard_start(group.dp_rank) : bucket.shard_start(group.dp_rank) + bucket.shard_numel]
            )
            for bucket in group.layout.buckets
        ]
        return full

    def _gather_chunks_into(
        self, group: ChunkedParamGroup, full: torch.Tensor, chunks: list[torch.Tensor], label: str
    ) -> None:
        """All-gather ``chunks`` (this rank's chunk of each bucket of ``group``) over dp into
        ``full`` (the group's whole run; same device as the chunks)."""
        with record_function(f"lightning_zero::{label}"):
            works = [
                all_gather(
                    full[bucket.start : bucket.end],
                    chunk,
                    shard_group(group, self.dp_group),  # [Note: expert domain]
                    async_op=True,
                    counter=self.counter,
                    label=label,
                )
                for bucket, chunk in zip(group.layout.buckets, chunks)
            ]
            name = type(self.optimizer).__name__
            self._wait_all(works, lambda i, n: f"the {label} all-gather {i + 1} of {n} for {name} (replicated step)")

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        return [master for group in self.optimizer.param_groups for master in group["params"]]

    @property
    def _grad_holders(self) -> list[torch.nn.Parameter]:
        return self.masters

    def _tensors_of_param_id(self, param_id: int) -> list[torch.nn.Parameter]:
        master = self._master_of_param.get(param_id)
        return [] if master is None else [master]

    def optimizer_tensor(self, owned: OwnedRange) -> Optional[torch.Tensor]:
        return None  # its state is not range-shardable ([Note: non-element-wise optimizers])

    def prepare_master_grads(self, buckets: list[Bucket]) -> None:
        """All-gather every owned bucket's reduced chunk: each full master gets the full average."""
        by_group: dict[int, dict[int, torch.Tensor]] = {}
        for bucket in buckets:
            if self.owns(bucket):
                assert bucket.grad_chunk is not None
                by_group.setdefault(id(bucket.group), {})[bucket.layout.index] = bucket.grad_chunk
        for groups in self.flat_groups:
            for group in groups:
                chunks = by_group.get(id(group))
                if chunks is None or len(chunks) != len(group.layout.buckets):
                    continue
                sample = chunks[0]
                gathered = torch.empty(group.layout.numel, dtype=sample.dtype, device=sample.device)
                self._gather_chunks_into(
                    group, gathered, [chunks[i] for i in range(len(chunks))], "all_gather_grads_replicated"
                )
                full_grad = gathered.to(device=group.master_device, dtype=group.master_dtype)
                for slot in group.layout.slots:
                    self._master_of_param[id(slot.param)].grad = full_grad[slot.offset : slot.end].view(slot.shape)
        self._remember_grads()

    def _norm_terms(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Only this rank's owned element range of each full gradient (see the Note)."""
        terms = []
        for master, lo, hi, chunk_master, chunk_lo in self._norm_slices:
            if master.grad is None:
                continue
            weight = self.replicated_weight.get(id(chunk_master))
            terms.append(
                (master.grad.reshape(-1)[lo:hi], None if weight is None else weight[chunk_lo : chunk_lo + hi - lo])
            )
        return terms

    def _groups_and_full_masters(self) -> list[tuple[FlatParamGroup, torch.Tensor]]:
        """Each flat group with its full fp32 buffer (``_full_masters`` is built in this order)."""
        groups = [group for groups in self.flat_groups for group in groups]
        return list(zip(groups, self._full_masters))

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for group, full in self._groups_and_full_masters():
            if full is not group.param_buffer:
                group.param_buffer.copy_(full.detach())

    def all_gather_params(self) -> None:
        """After the chunk masters changed (checkpoint load): refresh the full masters and params."""
        for group, full in self._groups_and_full_masters():
            device = group.param_buffer.device
            if full is group.param_buffer:
                chunks = [group.param_shard(bucket).clone() for bucket in group.layout.buckets]
                self._gather_chunks_into(group, full, chunks, "all_gather_params")
                continue
            gathered = torch.empty(group.layout.numel, dtype=full.dtype, device=device)
            self._gather_chunks_into(
                group, gathered, [m.detach().to(device) for m in group.masters], "all_gather_params"
            )
            full.copy_(gathered)
            group.param_buffer.copy_(gathered)

    def extra_grad_bytes(self) -> int:
        """The full fp32 gradients handed to the masters (alive until zero_grad or the next backward)."""
        storages = {}
        for master in self.masters:
            if master.grad is not None:
                storage = master.grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def extra_master_bytes(self) -> int:
        total = 0
        for group, full in self._groups_and_full_masters():
            if full is not group.param_buffer:
                total += (full.numel() - sum(m.numel() for m in group.masters)) * full.element_size()
        return total
