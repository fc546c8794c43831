"""MatrixOwnerOptimizer: Muon over ZeRO's element-range shards, each matrix stepped whole by its owner.

[Note: owner step] Every stage keeps, per rank, the fp32 master chunks of every bucket and hands
the optimizer views of this rank's run of each parameter (``optimizer.py``). Muon's update of a
matrix needs the whole matrix ([Note: Muon's update, split] in ``muon.py``), so each matrix has an
*owner* in the group it is sharded over (dp; the EDP group for expert stacks), balanced by
Newton-Schulz FLOPs ([Note: matrix owners] in ``matrix_owners.py``). Inside ``optimizer.step()``
(after clipping scaled this rank's gradient runs):

1. one uneven all-to-all per domain (``muon_to_owner``, reduce-scatter-shaped: every rank sends
   the gradient runs it holds of each matrix to that matrix's owner, in the master dtype) gives
   each owner its matrices' whole averaged, clipped gradients;
2. the owner advances the matrix's momentum (whole, on the owner only: optimizer state is spread
   by ownership, not by slice) and runs Newton-Schulz. A tensor-parallel-split matrix is
   orthogonalized whole: the owners of its tp shards (the same dp rank on every tp rank, since
   the assignment sees the same shapes) all-gather their shards' updates over tp
   (``muon_tp_gather``), each runs NS on the whole matrix and keeps its shard's rows/columns;
3. a second all-to-all (``muon_from_owner``) sends every rank the bf16 orthogonalized values of
   the runs it holds, and each rank applies decay and update to its own master runs.

Bytes a rank sends per step, for ``P`` matrix elements over ``n`` ranks: ``P (n-1)/n^2`` master
elements out and as many bf16 elements back (``planner/muon.py`` counts them; the engine's
counter measures them). The optimizer's own loop sees no parameters (``hidden_step.py``); the
compute parameters are refreshed and, at stages 1-2, all-gathered afterwards as for any optimizer.

[Note: Muon state in checkpoints] The momentum lives whole on owners, but checkpoints speak in
element ranges (``checkpoint/targets.py``). Before a save, :meth:`stage_range_state` sends each
rank its runs of every momentum (the return trip of step 3, in the state's dtype) as the state of
the views it steps, which the checkpoint saves in dense coordinates like Adam's moments; after
the save they are dropped. A load fills those same views; the next step first sends them to the
owners (the trip of step 1) and drops them. So a checkpoint loads across dp, tp and stage, and
the momentum a run resumes with is the one it saved, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.comm.collectives import all_gather, all_to_all_v
from lightning_zero.zero.domains import domain_of
from lightning_zero.zero.hidden_step import HiddenFromOwnStep
from lightning_zero.zero.matrix_owners import assign_owners, ns_flops
from lightning_zero.zero.muon import adjusted_lr, apply_update, momentum_update, newton_schulz, scalar_lr
from lightning_zero.zero.optimizer import ShardedOptimizer

MOMENTUM = "momentum_buffer"


@dataclass(eq=False)
class Matrix:
    """One matrix Muon steps whole: ``param.reshape(-1)[lo:hi]`` viewed as ``shape`` (this tp
    rank's shard of a ``full_shape`` matrix when ``tp_dim`` is set)."""

    param: nn.Parameter
    param_group: int
    lo: int
    hi: int
    shape: tuple[int, int]
    full_shape: tuple[int, int]
    tp_dim: Optional[int]
    domain: int  # index into the plan's domains
    runs: list[tuple[int, int]]  # per rank of the domain: its run [a, b) of param.reshape(-1) in [lo, hi)
    index: int = 0  # position in the plan (keys the owner's state)
    owner: int = 0


@dataclass
class Domain:
    """A group matrices are sharded over (dp, or an EDP group), with this rank's place in it."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int


class MatrixOwnerOptimizer(HiddenFromOwnStep, ShardedOptimizer):
    """Steps ``torch.optim.Muon`` (or :class:`~lightning_zero.zero.muon.GroupedMuon`) over ZeRO
    shards, each matrix whole on its owner rank ([Note: owner step]). Same constructor and surface
    as :class:`ShardedOptimizer`; ``attach_tensor_parallel`` tells it the tp group (tp > 1)."""

    def _point_optimizer_at_masters(self, eager_state: dict) -> None:
        self._module_params = [list(group["params"]) for group in self.optimizer.param_groups]
        super()._point_optimizer_at_masters(eager_state)
        self._params_per_group = [list(group["params"]) for group in self.optimizer.param_groups]
        self._segment_of = {id(owned.param): (owned, tensor) for owned, tensor in self._segments}
        self.matrix_state: dict[int, dict[str, torch.Tensor]] = {}  # matrix index -> its whole state (owner)
        self.tp_group: Optional[dist.ProcessGroup] = None
        self._plan: Optional[tuple[list[Matrix], list[Domain]]] = None
        self._unused_now: set[int] = set()
        self.has_state = False  # a step (or a load) made momenta: the same on every rank
        self._register_hiding()

    def attach_tensor_parallel(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """TP-split matrices are orthogonalized whole over ``tp_group`` ([Note: owner step])."""
        self.tp_group = tp_group
        self._plan = None

    # -- the plan: matrices, their runs on every rank, their owners -----------------------------------
    def plan(self) -> tuple[list[Matrix], list[Domain]]:
        """Every matrix of this optimizer (param group order) and the domains they live in."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> tuple[list[Matrix], list[Domain]]:
        from lightning_zero.tp.layers import tp_shard_dim

        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        slot_of = {
            id(slot.param): (group, slot)
            for groups in self.flat_groups
            for group in groups
            for slot in group.layout.slots
        }
        matrices: list[Matrix] = []
        domains: list[Domain] = []
        domain_index: dict[int, int] = {}
        for group_index, params in enumerate(self._module_params):
            for param in params:
                if id(param) not in slot_of:  # frozen (requires_grad=False): never stepped
                    continue
                flat_group, slot = slot_of[id(param)]
                domain = domain_of(flat_group)
                key = id(domain)
                if key not in domain_index:
                    domain_index[key] = len(domains)
                    group = self.dp_group if domain is None else domain.group
                    domains.append(Domain(group, flat_group.layout.dp, flat_group.dp_rank))
                bucket = flat_group.layout.buckets[slot.bucket_index]
                owned = []
                for rank in range(flat_group.layout.dp):
                    start = bucket.shard_start(rank)
                    owned.append(
                        (max(start, slot.offset) - slot.offset, min(start + bucket.shard_numel, slot.end) - slot.offset)
                    )
                tp_dim = tp_shard_dim(param) if tp > 1 else None
                if tp_dim is not None and param.ndim != 2:
                    raise ValueError(
                        f"lightning_zero: {type(self.optimizer).__name__} over a tensor-parallel-split"
                        f" {param.ndim}-D parameter of shape {tuple(param.shape)} is not supported: only 2-D"
                        " matrices are gathered over tp. Keep such parameters out of tp, or use AdamW for them."
                    )
                stack = param.shape[0] if param.ndim == 3 else 1
                shape = tuple(param.shape[-2:])
                full = list(shape)
                if tp_dim is not None:
                    full[tp_dim] *= tp
                numel = shape[0] * shape[1]
                for index in range(stack):
                    lo, hi = index * numel, (index + 1) * numel
                    runs = [(max(a, lo), min(b, hi)) if max(a, lo) < min(b, hi) else (lo, lo) for a, b in owned]
                    matrix = Matrix(param, group_index, lo, hi, shape, tuple(full), tp_dim, domain_index[key], runs)
                    matrix.index = len(matrices)
                    matrices.append(matrix)
        for index, domain in enumerate(domains):
            members = [m for m in matrices if m.domain == index]
            costs = [ns_flops(*m.full_shape, self.optimizer.param_groups[m.param_group]["ns_steps"]) for m in members]
            for matrix, owner in zip(members, assign_owners(costs, domain.size)):
                matrix.owner = owner
        return matrices, domains

    def planned_bytes(self, stepped: Optional[list[nn.Parameter]] = None) -> dict[str, int]:
        """Bytes this rank sends per step when every matrix (of ``stepped`` parameters: those
        with a gradient) steps, by label (the counter's kinds): its runs of others' matrices in the
        master dtype, the runs others hold of its own in bf16, and, under tp, its owned tp-split
        shards to the ``tp - 1`` peers."""
        matrices, domains = self.plan()
        if stepped is not None:
            matrices = [m for m in matrices if any(m.param is p for p in stepped)]
        itemsize = self._value_dtype().itemsize
        out = {"muon_to_owner": 0, "muon_from_owner": 0}
        for matrix in matrices:
            me = domains[matrix.domain].rank
            if matrix.owner != me:
                out["muon_to_owner"] += _len(matrix.runs[me]) * itemsize
            else:
                others = sum(_len(run) for rank, run in enumerate(matrix.runs) if rank != me)
                out["muon_from_owner"] += others * torch.bfloat16.itemsize
        split = [m for m in matrices if m.tp_dim is not None and m.owner == domains[m.domain].rank]
        if split and self.tp_group is not None:
            tp = dist.get_world_size(self.tp_group)
            out["muon_tp_gather"] = sum(m.hi - m.lo for m in split) * (tp - 1) * itemsize
        return out

    # -- the step ------------------------------------------------------------------------------------
    def _drop_grads_of(self, unused: set[int]) -> None:
        self._unused_now = set(unused)  # agreed over dp: every rank skips the same matrices
        super()._drop_grads_of(unused)

    def _steps(self, matrix: Matrix) -> bool:
        """Whether ``matrix`` has a gradient this step (torch skips a parameter without one); the
        same answer on every rank (the unused set is agreed, zero_grad runs everywhere)."""
        held = self._segment_of.get(id(matrix.param))
        if held is not None:
            return held[1].grad is not None
        if id(matrix.param) in self._unused_now:
            return False
        return any(tensor.grad is not None for _, tensor in self._segments) or not self._segments

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        try:
            with record_function("lightning_zero::matrix_owner_step"):
                self._absorb_range_state()
                matrices, domains = self.plan()
                stepping = [m for m in matrices if self._steps(m)]
                for index, domain in enumerate(domains):
                    members = [m for m in stepping if m.domain == index]
                    if members:
                        self._step_domain(domain, members)
                        self.has_state = True
        finally:
            self._show_params()
        super()._after_step(optimizer, args, kwargs)

    def _step_domain(self, domain: Domain, members: list[Matrix]) -> None:
        owned = [m for m in members if m.owner == domain.rank]
        grads = self._to_owners(domain, members, lambda m, a, b: self._run(m, a, b, grad=True), "muon_to_owner")
        updates = {}
        for matrix in owned:
            group = self.optimizer.param_groups[matrix.param_group]
            grad = grads[id(matrix)].view(matrix.shape)
            state = self.matrix_state.setdefault(matrix.index, {})
            if MOMENTUM not in state:
                state[MOMENTUM] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            updates[id(matrix)] = momentum_update(grad, state[MOMENTUM], group["momentum"], group["nesterov"])
        whole = self._whole_over_tp([m for m in owned if m.tp_dim is not None], updates)
        orthos = {}
        for matrix in owned:
            group = self.optimizer.param_groups[matrix.param_group]
            update = whole.get(id(matrix), updates[id(matrix)])
            ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            orthos[id(matrix)] = self._own_tp_shard(matrix, ortho).reshape(-1)
        received = self._from_owners(domain, members, orthos, "muon_from_owner", torch.bfloat16)
        for matrix in members:
            a, b = matrix.runs[domain.rank]
            if a == b:
                continue
            group = self.optimizer.param_groups[matrix.param_group]
            lr = scalar_lr(group["lr"])
            master = self._run(matrix, a, b, grad=False)
            matrix_lr = adjusted_lr(lr, group["adjust_lr_fn"], matrix.full_shape)
            apply_update(master, received[id(matrix)].to(master.device), lr, group["weight_decay"], matrix_lr)

    def _run(self, matrix: Matrix, a: int, b: int, *, grad: bool) -> torch.Tensor:
        """This rank's master run ``[a, b)`` of ``matrix.param`` (or its gradient: zeros if none)."""
        owned, tensor = self._segment_of[id(matrix.param)]
        values = tensor.detach() if not grad else tensor.grad
        if values is None:
            return torch.zeros(b - a, dtype=tensor.dtype, device=tensor.device)
        return values[a - owned.param_lo : b - owned.param_lo]

    # -- the exchanges ------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.comm_device is not None:
            return torch.device(self.comm_device)
        return self._segments[0][1].device if self._segments else torch.device("cpu")

    def _value_dtype(self) -> torch.dtype:
        return self._segments[0][1].dtype if self._segments else torch.float32

    def _to_owners(
        self,
        domain: Domain,
        members: list[Matrix],
        run_of: Callable[[Matrix, int, int], torch.Tensor],
        label: str,
    ) -> dict[int, torch.Tensor]:
        """Each owner gets its matrices whole (flat, this tp rank's shard), assembled from every
        rank's ``run_of(matrix, a, b)``; one uneven all-to-all over the domain."""
        me, device, dtype = domain.rank, self._device(), self._value_dtype()
        sends = [[m for m in members if m.owner == rank] for rank in range(domain.size)]
        pieces = [
            run_of(m, *m.runs[me]).to(device) for rank in range(domain.size) for m in sends[rank] if _len(m.runs[me])
        ]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        input_splits = [sum(_len(m.runs[me]) for m in sends[rank]) for rank in range(domain.size)]
        mine = sends[me]
        output_splits = [sum(_len(m.runs[rank]) for m in mine) for rank in range(domain.size)]
        received = torch.empty(sum(output_splits), dtype=send.dtype, device=device)
        self._exchange(received, send, output_splits, input_splits, domain, label)
        whole = {id(m): torch.empty(m.hi - m.lo, dtype=send.dtype, device=device) for m in mine}
        offset = 0
        for rank in range(domain.size):
            for matrix in mine:
                a, b = matrix.runs[rank]
                whole[id(matrix)][a - matrix.lo : b - matrix.lo].copy_(received[offset : offset + b - a])
                offset += b - a
        return whole

    def _from_owners(
        self, domain: Domain, members: list[Matrix], whole: dict[int, torch.Tensor], label: str, dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """Every rank gets its runs of each matrix from the owner's ``whole[id(matrix)]`` (flat)."""
        me, device = domain.rank, self._device()
        mine = [m for m in members if m.owner == me]
        pieces = [
            whole[id(m)][m.runs[rank][0] - m.lo : m.runs[rank][1] - m.lo].to(dtype)
            for rank in range(domain.size)
            for m in mine
            if _len(m.runs[rank])
        ]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        input_splits = [sum(_len(m.runs[rank]) for m in mine) for rank in range(domain.size)]
        froms = [[m for m in members if m.owner == rank] for rank in range(domain.size)]
        output_splits = [sum(_len(m.runs[me]) for m in froms[rank]) for rank in range(domain.size)]
        received = torch.empty(sum(output_splits), dtype=send.dtype, device=device)
        self._exchange(received, send, output_splits, input_splits, domain, label)
        out, offset = {}, 0
        for rank in range(domain.size):
            for matrix in froms[rank]:
                length = _len(matrix.runs[me])
                out[id(matrix)] = received[offset : offset + length]
                offset += length
        return out

    def _exchange(
        self,
        received: torch.Tensor,
        send: torch.Tensor,
        output_splits: list,
        input_splits: list,
        domain: Domain,
        label: str,
    ) -> None:
        work = all_to_all_v(
            received, send, output_splits, input_splits, domain.group, async_op=True, counter=self.counter, label=label
        )
        if work is not None:
            name = type(self.optimizer).__name__
            self.waiter.wait(work, lambda: f"the {label} all-to-all of {name}.step() (matrix owners)")

    def _whole_over_tp(self, split: list[Matrix], updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The whole matrices of the tp-split ``split`` (every tp rank owns the same ones, in the
        same order): one all-gather over tp of their shards' updates."""
        if self.tp_group is None or not split:
            return {}
        tp = dist.get_world_size(self.tp_group)
        local = torch.cat([updates[id(m)].reshape(-1) for m in split])
        gathered = torch.empty(tp * local.numel(), dtype=local.dtype, device=local.device)
        work = all_gather(gathered, local, self.tp_group, async_op=True, counter=self.counter, label="muon_tp_gather")
        if work is not None:
            self.waiter.wait(work, lambda: "the muon_tp_gather all-gather of the matrix owners' step")
        per_rank = gathered.view(tp, local.numel())
        whole, offset = {}, 0
        for matrix in split:
            numel = matrix.hi - matrix.lo
            shards = [per_rank[rank, offset : offset + numel].view(matrix.shape) for rank in range(tp)]
            whole[id(matrix)] = torch.cat(shards, dim=matrix.tp_dim)
            offset += numel
        return whole

    def _own_tp_shard(self, matrix: Matrix, ortho: torch.Tensor) -> torch.Tensor:
        if matrix.tp_dim is None:
            return ortho
        size = matrix.shape[matrix.tp_dim]
        return ortho.narrow(matrix.tp_dim, dist.get_rank(self.tp_group) * size, size)

    # -- state: spread by ownership ([Note: Muon state in checkpoints]) -----------------------------------
    def stage_range_state(self) -> None:
        """Give each stepped view its runs of every momentum (collective over every domain)."""
        if not self.has_state:  # no step yet (the same on every rank): nothing to save
            return
        matrices, domains = self.plan()
        dtype, device = self._value_dtype(), self._device()
        for index, domain in enumerate(domains):
            members = [m for m in matrices if m.domain == index]
            whole = {}
            for matrix in members:
                if matrix.owner == domain.rank:
                    momentum = self.matrix_state.get(matrix.index, {}).get(MOMENTUM)
                    whole[id(matrix)] = (
                        momentum.reshape(-1)
                        if momentum is not None
                        else torch.zeros(matrix.hi - matrix.lo, dtype=dtype, device=device)
                    )
            received = self._from_owners(domain, members, whole, "muon_state_from_owner", dtype)
            for matrix in members:
                a, b = matrix.runs[domain.rank]
                if a == b:
                    continue
                owned, tensor = self._segment_of[id(matrix.param)]
                state = self.optimizer.state.setdefault(tensor, {})
                if MOMENTUM not in state:
                    state[MOMENTUM] = torch.zeros_like(tensor.detach())
                state[MOMENTUM][a - owned.param_lo : b - owned.param_lo].copy_(received[id(matrix)])

    def drop_range_state(self) -> None:
        """After a save: the views' copies of the momentum go (the owners keep theirs)."""
        self.optimizer.state.clear()

    def _absorb_range_state(self) -> None:
        """After a load: the views' momentum runs go to the owners, then are dropped."""
        if not any(MOMENTUM in state for state in self.optimizer.state.values()):
            return
        matrices, domains = self.plan()

        def run_of(matrix: Matrix, a: int, b: int) -> torch.Tensor:
            owned, tensor = self._segment_of[id(matrix.param)]
            return self.optimizer.state[tensor][MOMENTUM][a - owned.param_lo : b - owned.param_lo]

        for index, domain in enumerate(domains):
            members = [m for m in matrices if m.domain == index]
            whole = self._to_owners(domain, members, run_of, "muon_state_to_owner")
            for matrix in members:
                if matrix.owner == domain.rank:
                    self.matrix_state[matrix.index] = {MOMENTUM: whole[id(matrix)].view(matrix.shape).clone()}
        self.optimizer.state.clear()
        self.has_state = True

    def state_bytes(self) -> int:
        """Bytes of the momenta this rank owns (plus any staged range copies)."""
        owned = sum(t.numel() * t.element_size() for state in self.matrix_state.values() for t in state.values())
        return owned + super().state_bytes()

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self._remove_hiding()


def _len(run: tuple[int, int]) -> int:
    return run[1] - run[0]
