"""ShardedOptimizer: the user's own torch optimizer, pointed at this rank's fp32 master chunks.

The optimizer object the user returned from ``configure_optimizers`` is kept (so LR schedulers,
``isinstance`` checks and hyperparameters in ``param_groups`` keep working); only each param
group's ``"params"`` list is replaced by views of the fp32 master chunks this rank owns (one chunk
per bucket, see [Note: flat layout] in ``flat.py``): one view per parameter's owned run of a
chunk, so each parameter keeps its own state and step count and one that no rank used can be
skipped as under DDP ([Note: parameters nobody used] in ``reducer.py``). Its state (Adam's
``exp_avg``/``exp_avg_sq``) therefore exists only for this rank's runs: that is the
optimizer-state sharding of ZeRO stage 1.

Around ``optimizer.step()``:

- the reducer's ``finish_grad_sync`` hands each master's views their reduced gradient runs
  (:meth:`prepare_master_grads`; views in fp32, of an fp32 copy under bf16-mixed);
- a step post-hook writes the updated chunks back into the compute parameters and all-gathers
  every bucket, so each rank holds the full updated parameters again (:meth:`all_gather_params`);
- ``optimizer.zero_grad()`` needs no patching: the reducer notices dropped master gradients
  ([Note: zero_grad detection] in ``reducer.py``), per optimizer.

[Note: global overflow] Under a dynamic loss scale (``16-mixed``) a step whose gradients hold an
inf or NaN is skipped, and the scale backs off (``torch.amp.GradScaler``). Each rank holds only
its shard of the reduced gradients, so an inf lands in one rank's shard: that rank alone would
skip while the others step, and the stages-1-2 all-gather after the step would pair with nothing.
The decision must be global, and the step already makes an exchange every rank issues at the
same point: the step's phase marker ([Note: phase markers] in ``agreements.py``), a MAX
all-reduce. :meth:`ShardedOptimizer.agree_overflow` runs that marker early, after the unscale
and before the update, with one more int32 (this rank's overflow flag): MAX is "any rank", so
every rank learns the same answer. Cost: 4 bytes per step, no extra collective, no extra wait
(the marker's wait moves, it is not added). The step's own ``before_update`` then reuses the
agreed marker instead of issuing another. On a global overflow no rank calls
``optimizer.step()``: optimizer state, step counts and parameters stay as they were, and no
post-step all-gather is issued anywhere.

Optimizers that create their state in ``__init__`` (Adagrad's ``sum``) are accepted: their
per-element state tensors are cut into the same chunks as the parameters (padding reads zero)
and scalar state (``step``) is copied, so the sharded step starts where the unsharded would.

Optimizers that are not element-wise (Adafactor) use
:class:`~lightning_zero.zero.replicated_optimizer.ReplicatedOptimizer` instead: full fp32 masters
stepped identically on every rank (see [Note: non-element-wise optimizers] in
``replicated_optimizer.py``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.comm.collectives import CommCounter, all_reduce
from lightning_zero.zero.domains import domain_of, shard_group
from lightning_zero.zero.flat import FlatParamGroup, OwnedRange, owned_ranges
from lightning_zero.zero.grad_storage import Bucket
from lightning_zero.zero.owner_exchange import (
    Domain,
    OwnerExchange,
    WholeParam,
    longest_run_owner,
    param_norm,
    param_runs,
    run_len,
)
from lightning_zero.zero.waits import Waiter


class ShardedOptimizer(OwnerExchange):
    """Rewires ``optimizer`` to step fp32 master chunks and keeps the compute parameters in sync.

    Args:
        optimizer: any element-wise ``torch.optim`` optimizer over the module's parameters; it
            must not have taken a step yet (state made in its ``__init__`` is sharded).
        flat_groups: for each of ``optimizer.param_groups``, the flat groups holding its params.
        dp_group / dp_size: the data-parallel group the parameters are sharded over.
        norm_groups: process groups whose ranks hold *different* gradient chunks (dp, plus tp
            under tensor parallelism): the gradient norm is summed over them.
    """

    exact_grad_norm = False  # the engine sets config.exact_grad_norm ([Note: exact gradient norm])

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
        waiter: Optional[Waiter] = None,
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
        poll = comm_device is None or torch.device(comm_device).type == "cpu"
        self.waiter = waiter if waiter is not None else Waiter(poll=poll)
        self.replicated_weight: dict[int, torch.Tensor] = {}  # master id -> per-element 1/tp weights
        # Set by the engine: the overlapped post-step all-gather (zero/param_gather.py) and the
        # offload copies (zero/offload.py); None: gather synchronously / no offload.
        self.param_gatherer: Any = None
        self.offload: Any = None
        # Set by the engine: the gradient reducer, which knows the parameters no dp rank gave a
        # gradient since the last zero_grad ([Note: parameters nobody used]) and runs the phase
        # markers ([Note: phase markers]); None: every parameter counts as used, no markers.
        self.reducer: Any = None
        # What the optimizer steps: one view per (parameter, owned element run) of a master chunk.
        self._segments: list[tuple[OwnedRange, torch.nn.Parameter]] = []
        self._segments_of_master: dict[int, list[tuple[OwnedRange, torch.nn.Parameter]]] = {}
        self._tensors_of_param: dict[int, list[torch.nn.Parameter]] = {}  # module param id -> views

        self._point_optimizer_at_masters(eager_state)
        self._handed_out: dict[int, tuple[torch.Tensor, int]] = {}  # master id -> (grad, version)
        self._agreed_unused: Optional[set[int]] = None  # the step marker, already agreed ([Note: global overflow])
        self._post_hook = optimizer.register_step_post_hook(self._after_step)

    def _point_optimizer_at_masters(self, eager_state: dict) -> None:
        """Each param group steps this rank's owned run of each of its parameters: a view of the
        master chunk it lies in ([Note: parameters nobody used])."""
        self._module_params = [list(group["params"]) for group in self.optimizer.param_groups]
        for param_group, groups in zip(self.optimizer.param_groups, self.flat_groups):
            tensors = []
            for owned in owned_ranges(groups):
                tensor = torch.nn.Parameter(owned.master.detach()[owned.chunk_lo : owned.chunk_hi])
                self._segments.append((owned, tensor))
                self._segments_of_master.setdefault(id(owned.master), []).append((owned, tensor))
                self._tensors_of_param.setdefault(id(owned.param), []).append(tensor)
                tensors.append(tensor)
            param_group["params"] = tensors
        self.optimizer.state.clear()
        if eager_state:
            self._shard_eager_state(eager_state)

    def rebind_segments(self) -> None:
        """Point each stepped view at its master again (after a master's storage moved, e.g. was
        pinned); the view objects, and so the optimizer state keyed by them, stay."""
        for owned, tensor in self._segments:
            tensor.data = owned.master.detach()[owned.chunk_lo : owned.chunk_hi]

    def optimizer_tensor(self, owned: OwnedRange) -> Optional[torch.Tensor]:
        """The tensor this optimizer steps (and keys its state by) for ``owned``; None if not ours."""
        for segment, tensor in self._segments_of_master.get(id(owned.master), []):
            if segment.chunk_lo == owned.chunk_lo:
                return tensor
        return None

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
            if self.offload is not None:  # copied to the host once per step, when read
                self.offload.stage(master, chunk)
                self._hand_out(master, master.grad)  # views of the host buffer the copy fills
                continue
            same = chunk.dtype == master.dtype and chunk.device == master.device
            self._hand_out(master, chunk if same else chunk.to(device=master.device, dtype=master.dtype))
        self._remember_grads()

    def _hand_out(self, master: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``grad`` (shaped like ``master``) becomes the gradient of what steps ``master``."""
        segments = self._segments_of_master.get(id(master))
        if segments is None:  # stepped as a whole elsewhere (stage 3's replicated step)
            master.grad = grad
            return
        for owned, tensor in segments:
            tensor.grad = grad[owned.chunk_lo : owned.chunk_hi]

    def flush_offloaded_grads(self) -> None:
        """Offload: copy the staged gradient chunks to the host now ([Note: offload copies])."""
        if self.offload is not None and self.offload.flush():
            self._remember_grads()

    def before_update(self) -> None:
        """Right before the optimizer changes the masters: gradients on the host (offload), the
        last host-to-device copy of the masters done, and no parameter all-gather reading them."""
        if self.param_gatherer is not None:
            self.param_gatherer.wait_all()
        unused: set[int] = set()
        if self._agreed_unused is not None:  # agreed with the overflow flag ([Note: global overflow])
            unused, self._agreed_unused = self._agreed_unused, None
        elif self.reducer is not None:  # [Note: phase markers] in agreements.py
            unused = self._step_marker()
        if self.offload is not None:
            self.flush_offloaded_grads()
            self.offload.before_host_update()
        self._drop_grads_of(unused)

    def _step_marker(self, overflow: bool = False) -> set[int]:
        step = f"{type(self.optimizer).__name__}.step()"
        return self.reducer.markers.at_step(lambda: f"the phase marker of {step}, right before its update", overflow)

    def agree_overflow(self, overflow: bool) -> bool:
        """Whether any dp rank's gradient shard overflowed (``overflow``: this rank's), agreed on
        the step's own phase marker, run now ([Note: global overflow]). Call once per step after
        the gradients are unscaled; when it returns ``False`` the step must follow (its update
        reuses the marker), when ``True`` every rank skips the step."""
        if self.reducer is None:
            raise RuntimeError("lightning_zero: agree_overflow needs the engine's reducer (its phase markers)")
        self.flush_offloaded_grads()
        unused = self._step_marker(overflow)
        if self.reducer.markers.overflow_anywhere:
            self._agreed_unused = None
            return True
        self._agreed_unused = unused
        return False

    def _drop_grads_of(self, unused: set[int]) -> None:
        """A parameter no dp rank gave a gradient since the last ``zero_grad`` is left alone by
        the step, as under DDP ([Note: parameters nobody used])."""
        for param_id in unused:
            for tensor in self._tensors_of_param_id(param_id):
                if tensor.grad is not None:
                    tensor.grad = None
                    self._handed_out.pop(id(tensor), None)  # not a zero_grad of the user's

    def _tensors_of_param_id(self, param_id: int) -> list[torch.nn.Parameter]:
        """What this optimizer steps for module parameter ``param_id``."""
        return self._tensors_of_param.get(param_id, [])

    def _shard_eager_state(self, state_of_param: dict) -> None:
        """State made before the engine existed (Adagrad's ``sum``): cut it like the parameters."""
        name = type(self.optimizer).__name__
        for owned, tensor in self._segments:
            state = state_of_param.get(owned.param)
            if not state:
                continue
            sharded: dict[str, Any] = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.shape != owned.shape:
                        raise ValueError(
                            f"lightning_zero: {name} holds state {key!r} of shape {tuple(value.shape)}"
                            f" for parameter {owned.name!r} of shape {tuple(owned.shape)}: only state"
                            " shaped like its parameter (element-wise optimizers) can be sharded."
                        )
                    flat = value.detach().reshape(-1)[owned.param_lo : owned.param_hi]
                    sharded[key] = flat.to(device=tensor.device, copy=True)
                else:
                    sharded[key] = value.clone() if torch.is_tensor(value) else value
            self.optimizer.state[tensor] = sharded

    def drop_grads(self) -> None:
        """Every gradient this optimizer holds becomes ``None`` (the engine is done training)."""
        for tensor in [*self._grad_holders, *self.masters]:
            tensor.grad = None
        self.forget_handed_out_grads()

    def forget_handed_out_grads(self) -> None:
        """After the engine reset this optimizer's gradients: nothing handed out is pending."""
        self._handed_out = {}

    @property
    def _grad_holders(self) -> list[torch.nn.Parameter]:
        """The tensors in the optimizer's param groups whose ``.grad`` ``zero_grad`` resets."""
        return [tensor for _, tensor in self._segments]

    @property
    def _scaled_by_clipping(self) -> list[torch.nn.Parameter]:
        """The tensors whose ``.grad`` gradient clipping scales (or clamps) in place."""
        return self._grad_holders

    def _remember_grads(self) -> None:
        self._handed_out = {id(m): (m.grad, m.grad._version) for m in self._grad_holders if m.grad is not None}

    def grads_were_zeroed(self) -> bool:
        """True if any master gradient we handed out was dropped or changed in place since.

        See [Note: zero_grad detection] in ``reducer.py``.
        """
        for master in self._grad_holders:
            handed = self._handed_out.get(id(master))
            if handed is None:
                continue
            grad, version = handed
            if master.grad is None or master.grad is not grad or grad._version != version:
                return True
        return False

    def grads_were_dropped(self) -> bool:
        """True if ``zero_grad`` set a handed-out gradient to ``None`` (not zeroed in place): the
        parameters behind it have no gradient again, as under torch."""
        return any(id(tensor) in self._handed_out and tensor.grad is None for tensor in self._grad_holders)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for groups in self.flat_groups:
            for group in groups:
                if self.offload is not None and not group.masters_alias_params:
                    self.offload.copy_masters_to_params(group)
                else:
                    group.copy_masters_to_params()
        if self.gather_params:  # stage 3 gathers lazily, at the next forward
            if self.param_gatherer is not None:  # [Note: overlapped parameter gather]
                name = type(self.optimizer).__name__
                groups = [group for groups in self.flat_groups for group in groups]
                self.param_gatherer.launch(
                    groups, lambda b: f"the parameter all-gather of bucket {b} after {name}.step()"
                )
            else:
                self.all_gather_params()

    def all_gather_params(self) -> None:
        """All-gather every bucket's updated chunk over dp (stages 1-2)."""
        with record_function("lightning_zero::all_gather_params"):
            works = [
                work
                for groups in self.flat_groups
                for group in groups
                for work in group.start_all_gather(shard_group(group, self.dp_group), self.counter)
            ]
            name = type(self.optimizer).__name__
            self._wait_all(works, lambda i, n: f"the parameter all-gather {i + 1} of {n} after {name}.step()")

    def _wait_all(self, works: list[Any], describe: Any) -> None:
        """Wait on ``works`` in order; ``describe(index, count)`` names what a stuck one was
        (see [Note: collective timeout] in ``zero/waits.py``)."""
        for index, work in enumerate(works):
            self.waiter.wait(work, lambda index=index: describe(index, len(works)))

    # -- gradient clipping over shards ---------------------------------------------------------
    def _norm_terms(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(gradient values this rank counts in the global norm, their per-element weight or None)."""
        terms = []
        for owned, tensor in self._segments:
            if tensor.grad is not None:
                weight = self.replicated_weight.get(id(owned.master))
                terms.append((tensor.grad, None if weight is None else weight[owned.chunk_lo : owned.chunk_hi]))
        return terms

    def _chunk_norm_terms(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The norm terms of whole master chunks (when the chunks themselves hold the gradients)."""
        return [(m.grad, self.replicated_weight.get(id(m))) for m in self.masters if m.grad is not None]

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over every rank's chunks (one all-reduce of a scalar)."""
        self.flush_offloaded_grads()
        grads = self._norm_terms()
        if norm_type != math.inf and self._exact_norm_applies():
            return self._exact_grad_norm(float(norm_type))  # [Note: exact gradient norm]
        device = grads[0][0].device if grads else torch.device("cpu")
        if norm_type == math.inf:
            local = torch.zeros((), dtype=torch.float32, device=device)
            for grad, _ in grads:
                local = torch.maximum(local, grad.detach().abs().max().float())
            return self._all_reduce_scalar(local, dist.ReduceOp.MAX)
        local = torch.zeros((), dtype=torch.float32, device=device)
        for grad, weight in grads:
            values = grad.detach().float().abs().pow(norm_type)
            local += (values * weight).sum() if weight is not None else values.sum()
        return self._all_reduce_scalar(local, dist.ReduceOp.SUM).pow(1.0 / norm_type)

    # -- [Note: exact gradient norm] in owner_exchange.py ----------------------------------------
    def _exact_norm_applies(self) -> bool:
        return self.exact_grad_norm and self._norm_pieces() is not None

    def _norm_pieces(self) -> Optional[tuple[Domain, list[WholeParam]]]:
        """Every trainable parameter of this optimizer (in its order) with the rank that gets its
        whole gradient; None where per-parameter norms cannot be ddp's (experts, tp, replicas)."""
        if getattr(self, "_norm_plan", False) is False:
            self._norm_plan = self._make_norm_pieces()
        return self._norm_plan

    def _make_norm_pieces(self) -> Optional[tuple[Domain, list[WholeParam]]]:
        groups = [group for groups in self.flat_groups for group in groups]
        norm_ranks = dist.get_world_size(self.norm_group) if dist.is_initialized() else 1
        if not groups or self.replicated_weight or norm_ranks != self.dp_size:
            return None
        if any(domain_of(group) is not None or group.layout.dp != self.dp_size for group in groups):
            return None
        slot_of = {id(slot.param): (group, slot) for group in groups for slot in group.layout.slots}
        pieces = []
        for params in self._module_params:
            for param in params:
                if id(param) in slot_of:
                    runs = param_runs(*slot_of[id(param)])
                    pieces.append(WholeParam(param, 0, param.numel(), runs, longest_run_owner(runs)))
        return Domain(self.dp_group, self.dp_size, groups[0].dp_rank), pieces

    def planned_norm_bytes(self) -> int:
        """Bytes this rank sends per clip for [Note: exact gradient norm] (``grad_norm_to_owner``):
        its runs of the cut parameters others own; 0 where the exact norm does not apply."""
        plan = self._norm_pieces() if self._exact_norm_applies() else None
        if plan is None or not any(sum(1 for run in p.runs if run_len(run)) > 1 for p in plan[1]):
            return 0
        domain, pieces = plan
        held = sum(run_len(p.runs[domain.rank]) for p in pieces if p.owner != domain.rank)
        return held * self._value_dtype().itemsize

    def _whole_grads_for_norm(self, domain: Domain, pieces: list[WholeParam]) -> dict[int, torch.Tensor]:
        """Each piece this rank owns, its whole gradient (flat): the runs of cut parameters travel."""
        if all(sum(1 for run in piece.runs if run_len(run)) <= 1 for piece in pieces):  # none cut: no exchange
            mine = [piece for piece in pieces if piece.owner == domain.rank]
            return {id(p): self._run(p, *p.runs[domain.rank], grad=True) for p in mine}

        def run_of(piece: WholeParam, a: int, b: int) -> torch.Tensor:
            return self._run(piece, a, b, grad=True)

        return self._to_owners(domain, pieces, run_of, "grad_norm_to_owner")

    def _exact_grad_norm(self, norm_type: float) -> torch.Tensor:
        """Per-parameter norms of whole gradients, stacked in torch's order ([Note: exact gradient norm])."""
        plan = self._norm_pieces()
        assert plan is not None
        domain, pieces = plan
        whole = self._whole_grads_for_norm(domain, pieces)
        norms = torch.zeros(len(pieces), dtype=self._value_dtype(), device=self._device())
        for index, piece in enumerate(pieces):
            if piece.owner == domain.rank:
                norms[index] = param_norm(whole[id(piece)].view(piece.param.shape), norm_type)
        norms = self._all_reduce_scalar(norms, dist.ReduceOp.SUM)  # one owner fills each entry: exact
        return torch.linalg.vector_norm(norms, norm_type)

    def _scale_owned_grads(self, clip_coef: torch.Tensor) -> None:
        """Clipping scaled the gradient runs: scale any whole copies made for the norm the same way."""

    def _all_reduce_scalar(self, local: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        device = self.comm_device or local.device
        value = local.to(device)
        work = all_reduce(
            value, self.norm_group, op=op, async_op=True, counter=self.counter, label="all_reduce_grad_norm"
        )
        self.waiter.wait(work, lambda: "the gradient-norm all-reduce of gradient clipping")
        return value.to(local.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every master gradient so the global norm is at most ``max_norm`` (as torch does)."""
        with record_function("lightning_zero::clip_grad_norm"):
            total = self.grad_norm(norm_type)
            clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for tensor in self._scaled_by_clipping:
                if tensor.grad is not None:
                    tensor.grad.detach().mul_(clip_coef.to(tensor.grad.dtype))
            self._scale_owned_grads(clip_coef)
            self._remember_grads()
            return total

    def clip_grad_value_(self, clip_value: float) -> None:
        self.flush_offloaded_grads()
        for tensor in self._scaled_by_clipping:
            if tensor.grad is not None:
                tensor.grad.detach().clamp_(-clip_value, clip_value)
        self._remember_grads()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (Adam's moments, step counters) on this rank."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def extra_grad_bytes(self) -> int:
        """Gradient bytes held beyond the reducer's storage (see :class:`ReplicatedOptimizer`)."""
        return 0

    def extra_master_bytes(self) -> int:
        """fp32 master bytes beyond the flat groups' own chunks (see :class:`ReplicatedOptimizer`)."""
        return 0

    def remove_hooks(self) -> None:
        self._post_hook.remove()
