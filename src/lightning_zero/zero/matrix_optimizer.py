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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.comm.collectives import all_gather
from lightning_zero.zero.domains import domain_of
from lightning_zero.zero.hidden_step import HiddenFromOwnStep
from lightning_zero.zero.matrix_owners import assign_owners, ns_flops
from lightning_zero.zero.muon import adjusted_lr, apply_update, momentum_update, newton_schulz, scalar_lr
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.owner_exchange import Domain, param_runs, run_len

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


class MatrixOwnerOptimizer(HiddenFromOwnStep, ShardedOptimizer):
    """Steps ``torch.optim.Muon`` (or :class:`~lightning_zero.zero.muon.GroupedMuon`) over ZeRO
    shards, each matrix whole on its owner rank ([Note: owner step]). Same constructor and surface
    as :class:`ShardedOptimizer`; ``attach_tensor_parallel`` tells it the tp group (tp > 1)."""

    def _point_optimizer_at_masters(self, eager_state: dict) -> None:
        super()._point_optimizer_at_masters(eager_state)
        self._params_per_group = [list(group["params"]) for group in self.optimizer.param_groups]
        self._owner_grads: Optional[tuple[dict[int, torch.Tensor], int]] = None  # made by clipping
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
        self._norm_plan = False

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
                owned = param_runs(flat_group, slot)
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
                out["muon_to_owner"] += run_len(matrix.runs[me]) * itemsize
            else:
                others = sum(run_len(run) for rank, run in enumerate(matrix.runs) if rank != me)
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
            self._owner_grads = None
            self._show_params()
        super()._after_step(optimizer, args, kwargs)

    def _grad_run(self, matrix: Matrix, a: int, b: int) -> torch.Tensor:
        return self._run(matrix, a, b, grad=True)

    # -- clipping: each matrix's norm on its owner ([Note: exact gradient norm] in owner_exchange.py) --
    def _exact_norm_applies(self) -> bool:
        return self._norm_pieces() is not None  # always: the matrices go to their owners anyway

    def _make_norm_pieces(self) -> Optional[tuple[Domain, list[Matrix]]]:  # type: ignore[override]
        matrices, domains = self.plan()
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        if tp > 1 or len(domains) != 1 or domains[0].size != self.dp_size or self.replicated_weight:
            return None
        if any(m.param.ndim != 2 for m in matrices) or dist.get_world_size(self.norm_group) != self.dp_size:
            return None  # expert stacks: one parameter, several owners
        return domains[0], matrices

    def planned_norm_bytes(self) -> int:
        return 0  # the norm rides on the step's own muon_to_owner exchange

    def _whole_grads_for_norm(self, domain: Domain, pieces: list) -> dict[int, torch.Tensor]:
        """The step's own exchange to the owners, made now: the step reuses it ([Note: owner step])."""
        grads = self._to_owners(domain, pieces, self._grad_run, "muon_to_owner")
        self._owner_grads = (grads, self._backwards_so_far())
        return grads

    def _scale_owned_grads(self, clip_coef: torch.Tensor) -> None:
        for grad in self._owner_grads[0].values() if self._owner_grads is not None else ():
            grad.mul_(clip_coef.to(grad.dtype))  # element-wise: the bits of the clipped runs

    def _backwards_so_far(self) -> int:
        return self.reducer.finished_backwards if self.reducer is not None else 0

    def _clipped_owner_grads(self) -> Optional[dict[int, torch.Tensor]]:
        """The owners' whole gradients clipping made, if no backward ran since (the same answer on
        every rank: a rank-local test, such as a gradient's version, could split the collectives).
        A gradient changed in place between the clip and the step is the clip's for Muon."""
        if self._owner_grads is None or self._owner_grads[1] != self._backwards_so_far():
            return None
        return self._owner_grads[0]

    def _step_domain(self, domain: Domain, members: list[Matrix]) -> None:
        owned = [m for m in members if m.owner == domain.rank]
        grads = self._clipped_owner_grads()
        if grads is None:
            grads = self._to_owners(domain, members, self._grad_run, "muon_to_owner")
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

    # -- the exchanges (``owner_exchange.py``) ----------------------------------------------------------
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
