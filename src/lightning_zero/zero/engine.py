"""ZeroEngine: builds flat groups, the reducer and the sharded optimizers for one module.

Plain torch.distributed; usable without Lightning::

    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2), groups=EngineGroups(dp=None))
    loss = model(x).sum(); loss.backward()   # buckets reduce-scatter during backward
    optimizer.step(); optimizer.zero_grad()  # steps the shards, all-gathers the parameters

Stages differ in one place each: which :class:`~lightning_zero.zero.grad_storage.GradStorage` keeps
the gradients (stage 1: full, stage 2: sharded), and which parameter side (``param_side.py``)
keeps the parameters (stages 1-2: full, all-gathered after each step; stage 3: sharded,
``zero/stage3/``). Which optimizers are admitted and how the flat groups are cut: ``build.py``.

[Note: one engine module] Past 500 lines because this is the facade: the strategy, checkpoints,
tensor parallelism and the monitor call the engine and nothing below it, so each of their needs is
a short method here that delegates to the part that owns it (reducer, parameter side, sharded
optimizers, step checks). Splitting the facade would scatter that surface over modules a caller
would have to know.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.comm.collectives import INTRA_NODE, CommCounter, local_only
from lightning_zero.config import ZeroConfig, reduce_in_fp32, resolve_bucket_mb
from lightning_zero.precision import PrecisionPolicy, precision_policy
from lightning_zero.zero.agreements import StepChecks
from lightning_zero.zero.bucketing import keeps_full_grads
from lightning_zero.zero.build import (
    build_replicated,
    build_sharded,
    check_elementwise,
    check_optimizer_params,
    matrix_step,
    replicated_step,
)
from lightning_zero.zero.cpu_heap import raise_glibc_thresholds
from lightning_zero.zero.domains import ExpertDomain, shard_group
from lightning_zero.zero.flat import FlatSpec, OptimizerShards, OwnedRange, owned_ranges
from lightning_zero.zero.grad_storage import FullGradStorage, ShardedGradStorage
from lightning_zero.zero.hybrid import HybridGradReduce
from lightning_zero.zero.matrix_optimizer import MatrixOwnerOptimizer
from lightning_zero.zero.optimizer import ShardedOptimizer
from lightning_zero.zero.param_gather import ParamGatherer, closure_then
from lightning_zero.zero.param_side import offload_masters
from lightning_zero.zero.reducer import GradReducer, SyncTimeline
from lightning_zero.zero.replicated_optimizer import ReplicatedOptimizer
from lightning_zero.zero.waits import FailureChannel, Waiter

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import ShardGroups
    from lightning_zero.zero.agreements import MarkerRider


@dataclass(frozen=True)
class EngineGroups:
    """Where one engine's collectives run (runtime objects, not knobs: the layout knobs of
    ``ZeroConfig.layout`` reach the engine as these groups).

    Attributes:
        dp: the dense ZeRO group, dp x cp ranks of one tp rank (``None``: the default group).
        norm: the group gradient norms are summed over (``None``: ``dp``).
        shard: hybrid sharding / hierarchical reduction (``mesh.build_shard_groups``): ZeRO shards
            over ``shard.shard`` (``dp`` must be ``None`` or that group), the reduced gradient chunk
            is all-reduced over ``shard.replicate`` and, when the groups are hierarchical, the
            shard-group reduce-scatter runs in two hops; see ``zero/hybrid.py``. ``None``: ZeRO
            shards over all of ``dp``.
        expert: expert parallelism (``ep > 1``): expert parameters (``param._lz_expert``) are
            sharded, reduced and gathered over its EDP group instead of ``dp`` ([Note: expert
            domain] in ``zero/domains.py``; ``ExpertDomain.from_mesh``). ``None``: every parameter
            is dense (with ``ep == 1`` expert parameters are replicated like dense ones).
        ranks_per_node: ranks of one node, for counting bytes by link class ([Note: link classes]
            in ``collectives.py``); ``None``: keep the counter's, else ``LOCAL_WORLD_SIZE`` if set.
    """

    dp: Optional[dist.ProcessGroup] = None
    norm: Optional[dist.ProcessGroup] = None
    shard: Optional["ShardGroups"] = None
    expert: Optional[ExpertDomain] = None
    ranks_per_node: Optional[int] = None


class ZeroEngine:
    """ZeRO stages 1, 2 and 3 for ``module`` trained by ``optimizers`` on one data-parallel rank.

    Args:
        config: the knobs, validated (:class:`lightning_zero.config.ZeroConfig`, where each is
            documented once). The engine and its parts read ``config.<knob>`` where they use it:
            ``stage``, ``bucket_mb``, ``overlap_comm``, ``defer_grad_reduce``,
            ``max_buckets_in_flight`` (reducer, stage-2 pool; [Note: collectives in flight] in
            ``reducer.py``), ``prefetch_blocks`` (``stage3/runtime.py``), ``offload_optimizer``,
            ``collective_timeout`` ([Note: collective timeout] in ``zero/waits.py``),
            ``overlap_param_gather`` ([Note: overlapped parameter gather] in ``param_gather.py``),
            ``grad_comm_dtype``, ``param_comm_dtype`` (``compression.py``) and ``reduce_dtype``.
            The layout knobs (``tensor_parallel_size``, ``sequence_parallel``, ``shard_size``,
            ``hierarchical_reduce``) reach it as the process groups below; ``monitor`` is the
            strategy's. The other arguments are runtime objects, not knobs:
        groups: where the engine's collectives run (:class:`EngineGroups`: the dp group, the norm
            group, hybrid sharding's groups, the expert domain, ranks per node).
        precision: where each byte lives (``lightning_zero.precision.PrecisionPolicy``): its
            ``compute_dtype`` (parameters and gradients in forward/backward), its ``master_dtype``
            (what the optimizers step, and so their state's dtype: fp32 master chunks beside
            half-precision compute parameters, or the parameter chunks themselves under
            ``bf16-true``; [Note: master_weights] in ``precision.py``) and
            ``half_params_under_autocast`` (norm layers with running statistics keep fp32
            parameters, as under ddp's autocast). ``None``: ``32-true``;
            ``precision.engine_policy(compute_dtype, master_dtype)`` gives one from two dtypes.
        device: where parameters live (default: that of the module's first parameter; stage 3
            materializes meta parameters there, one unit at a time).
        wrap_policy: stage 3: ``(module, parent) -> bool`` picks the units (default:
            ``stage3.default_wrap_policy``).
        counter: where logical bytes sent are counted (share one with tensor parallelism so a
            step's dp and tp traffic show up together).
        failure: the channel through which a failing rank tells the others why, so they stop
            instead of waiting for it ([Note: failure channel] in ``zero/waits.py``; the strategy
            passes its own). ``None``: the engine opens one on the default store and closes it.

    Parameters no optimizer steps (frozen, any dtype, int8 included) are left exactly as they
    are: never cast, never in a gradient buffer or the optimizer state. Under bf16-mixed the
    parameters of norm layers with running statistics (BatchNorm) stay fp32 (``norms_in_fp32``).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: ZeroConfig,
        *,
        groups: Optional["EngineGroups"] = None,
        precision: Optional[PrecisionPolicy] = None,
        device: Optional[torch.device] = None,
        wrap_policy: Optional[Callable[..., bool]] = None,
        counter: Optional[CommCounter] = None,
        failure: Optional[FailureChannel] = None,
    ) -> None:
        groups = groups if groups is not None else EngineGroups()
        precision = precision if precision is not None else precision_policy("32-true")
        dp_group, shard_groups, expert_domain = groups.dp, groups.shard, groups.expert
        compute_dtype = precision.compute_dtype
        if not isinstance(config, ZeroConfig):
            raise TypeError(
                f"ZeroEngine(config={config!r}): pass a lightning_zero.config.ZeroConfig (e.g."
                " ZeroConfig(stage=2)); it validates every knob."
            )
        if shard_groups is not None:
            if dp_group is not None and dp_group is not shard_groups.shard:
                raise ValueError(
                    "ZeroEngine: with EngineGroups(shard=...), ZeRO shards over shard.shard; pass EngineGroups(dp=None)"
                )
            dp_group = shard_groups.shard
        if expert_domain is not None and shard_groups is not None:
            raise ValueError(
                "ZeroEngine(groups=EngineGroups(expert=..., shard=...)): hybrid sharding of expert parameters is not"
                " supported; with ep > 1 use shard_size=None and hierarchical_reduce=False"
            )
        if expert_domain is not None and expert_domain.grad_divisor != dist.get_world_size(dp_group):
            raise ValueError(
                f"ZeroEngine: expert_domain.grad_divisor({expert_domain.grad_divisor}) must be the dense group's"
                f" size ({dist.get_world_size(dp_group)} ranks, dp * cp): both domains average over it"
                " ([Note: gradient averaging over dp_cp] in comm/mesh.py)"
            )
        self.expert_domain = expert_domain
        self.tp_group: Optional[dist.ProcessGroup] = None  # attach_tensor_parallel: full state dicts gather over it
        self.config = config
        self.module = module
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.compute_dtype = compute_dtype
        self.master_dtype = precision.master_dtype
        self.counter = counter if counter is not None else CommCounter()
        ranks_per_node = groups.ranks_per_node
        if ranks_per_node is None and self.counter.ranks_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
            ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        if ranks_per_node is not None:
            self.counter.ranks_per_node = ranks_per_node
        self.shard_groups = shard_groups
        # What the parameter all-gathers send here: config.param_comm_dtype, except that hybrid
        # sharding inside a node sends plain values (its gathers cross no slow link).
        param_comm_dtype = config.param_comm_dtype
        if shard_groups is not None and self.counter.link_of(shard_groups.shard) == INTRA_NODE:
            param_comm_dtype = None
        self.param_comm_dtype = param_comm_dtype
        # config.reduce_dtype as a torch dtype: "fp32", or the compute dtype ("compute", "bf16").
        self.reduce_dtype = torch.float32 if reduce_in_fp32(config.reduce_dtype) else compute_dtype
        self._owned_groups: list[dist.ProcessGroup] = []  # created here, destroyed in close()
        names = check_optimizer_params(module, optimizers)
        trainable = {
            id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"] if p.requires_grad
        }
        grad_bytes = sum(p.numel() for p in trainable.values()) * self.reduce_dtype.itemsize
        bucket_mb = resolve_bucket_mb(config.bucket_mb, grad_bytes)  # "auto": see lightning_zero.config
        self.bucket_mb = bucket_mb  # in MiB, "auto" resolved
        self.bucket_mb_auto = config.bucket_mb == "auto"  # the user never set it (no advice to set it)
        check_elementwise(optimizers, config.stage)
        replicated = sorted({type(opt).__name__ for opt in optimizers if replicated_step(opt)})
        if expert_domain is not None and replicated:
            raise ValueError(
                f"lightning_zero: {', '.join(replicated)} steps replicated full masters, which is not built for expert"
                " parameters sharded over their EDP group (ep > 1) yet; use an element-wise optimizer (AdamW, SGD,"
                " ...) with ep > 1, or ep=1."
            )
        order = {id(param): i for i, (_, param) in enumerate(module.named_parameters())}
        if device is None:
            device = next(module.parameters()).device
        self.device = device
        self._owns_failure = failure is None
        self.failure = failure if failure is not None else FailureChannel.open()
        on_cpu = torch.device(device).type == "cpu"
        self.waiter = Waiter(config.collective_timeout, poll=on_cpu, failure=self.failure)
        if on_cpu:
            raise_glibc_thresholds()  # [Note: glibc's thresholds on CPU]
        spec = FlatSpec(
            names, order, device, bucket_mb, self.dp_size, self.dp_rank, compute_dtype, self.reduce_dtype,
            param_comm_dtype, self.master_dtype, precision.half_params_under_autocast, expert_domain,
        )  # fmt: skip
        if config.stage == 3:
            built = build_sharded(
                module, optimizers, config, spec, dp_group=dp_group, wrap_policy=wrap_policy, counter=self.counter,
                waiter=self.waiter,
            )  # fmt: skip
        else:
            built = build_replicated(module, optimizers, config, spec)
        self.groups = built.groups
        self.frozen_params = built.frozen_params  # parameters no optimizer steps, kept as they are
        self.init_peak_param_bytes = built.init_peak_param_bytes
        self._owned_groups += built.owned_groups
        self.params = built.params  # the parameter side: param_side.py
        self.stage3 = built.params.runtime  # stage 3's runtime (None at stages 1-2), for inspection

        # [Note: deferred gradient reduction] in zero/bucketing.py
        full_grads = keeps_full_grads(config.stage, config.defer_grad_reduce)
        storage = FullGradStorage() if full_grads else ShardedGradStorage(config)
        self._reduced_groups = [
            group for group in self.groups if any(s.param.requires_grad for s in group.layout.slots)
        ]
        self.reducer = GradReducer(
            self._reduced_groups,
            storage,
            config,
            dp_group=dp_group,
            device=device,
            counter=self.counter,
            param_order=order,
            waiter=self.waiter,
            hybrid=self._hybrid_reduce(),
            reduce_in_fp32=self.reduce_dtype == torch.float32 and compute_dtype != torch.float32,
        )
        # [Note: no waits inside backward under expert parallelism] in reducer.py
        self.reducer.waits_in_backward = expert_domain is None
        self.optimizers = [
            self._sharded_optimizer_class(optimizer)(
                optimizer,
                flat_groups,
                dp_group=dp_group,
                dp_size=self.dp_size,
                counter=self.counter,
                norm_group=groups.norm,
                gather_params=self.params.gather_after_step,
                comm_device=device,
                waiter=self.waiter,
            )
            for optimizer, flat_groups in zip(optimizers, built.per_optimizer)
        ]
        self._warn_replicated(optimizers)
        if config.offload_optimizer:
            offload_masters(self.optimizers, torch.device(device))
        self.params.attach(
            self.optimizers, self.reducer, dp_group=dp_group, counter=self.counter, waiter=self.waiter
        )  # fmt: skip
        for sharded in self.optimizers:
            sharded.exact_grad_norm = config.exact_grad_norm  # [Note: exact gradient norm]
            self.reducer.on_grads_reduced.append(lambda s=sharded: s.prepare_master_grads(self.reducer.buckets))
            sharded.reducer = self.reducer  # unused parameters, phase markers (reducer.py)
        self.reducer.on_backward_begin.append(self._zero_grads_zeroed_by_optimizers)
        self._step_pre_hooks = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]
        self.step_checks = StepChecks(self.reducer, self.waiter)  # [Note: a step without a backward]
        self._step_pre_hooks += [opt.register_step_post_hook(self.step_checks.count_step) for opt in optimizers]
        self._finished_at_pre_backward = 0

    def _sharded_optimizer_class(self, optimizer: Optimizer) -> Callable[..., ShardedOptimizer]:
        """What steps ``optimizer``: its chunks (element-wise), or full replicated masters (the
        parameter side says how: ``param_side.py``)."""
        if matrix_step(optimizer):
            return MatrixOwnerOptimizer  # [Note: owner step]
        return self.params.sharded_optimizer_class(optimizer) if replicated_step(optimizer) else ShardedOptimizer

    @property
    def stage(self) -> int:
        """``config.stage``: 1, 2 or 3."""
        return self.config.stage

    @property
    def defer_grad_reduce(self) -> bool:
        """``config.defer_grad_reduce`` ([Note: deferred gradient reduction] in zero/bucketing.py)."""
        return self.config.defer_grad_reduce

    @property
    def param_gatherer(self) -> Optional[ParamGatherer]:
        """Stages 1-2 with ``overlap_param_gather``: the overlapped post-step all-gather; else ``None``."""
        return self.params.gatherer

    def wait_param_gathers(self) -> None:
        """Wait for every parameter all-gather still in flight (stages 1-2 with
        ``overlap_param_gather``); afterwards every parameter is whole. No-op otherwise."""
        self.params.wait()

    def pending_param_gathers(self) -> int:
        """Parameter all-gathers (buckets) launched after the last step and not waited for yet."""
        return 0 if self.param_gatherer is None else self.param_gatherer.pending_count()

    def param_gather_waits(self) -> dict[str, int]:
        """Where parameter all-gathers were waited: ``forward_hook`` (overlapped with forward),
        ``safe_point``, ``at_launch`` (see ``ParamGatherer.waits``); empty when overlap is off."""
        return {} if self.param_gatherer is None else dict(self.param_gatherer.waits)

    def offload_copy_counts(self) -> dict[str, int]:
        """Offload: chunk copies issued so far, ``device_to_host`` (gradients, once per chunk per
        step) and ``host_to_device`` (updated masters); zeros without offload."""
        counts = {"device_to_host": 0, "host_to_device": 0}
        for opt in self.optimizers:
            if opt.offload is not None:
                for key in counts:
                    counts[key] += opt.offload.counts[key]
        return counts

    def _hybrid_reduce(self) -> Optional["HybridGradReduce"]:
        """The replicate / hierarchical hops of the gradient reduction, if the layout has any."""
        groups = self.shard_groups
        if groups is None:
            return None
        hierarchical = groups.shard_intra is not None
        if local_only(dist.get_world_size(groups.replicate)) and not hierarchical:
            return None
        return HybridGradReduce(
            self.config,
            shard_group=groups.shard,
            replicate_group=groups.replicate,
            dp_group=groups.dp,
            intra_group=groups.shard_intra,
            inter_group=groups.shard_inter,
            counter=self.counter,
        )

    def _warn_replicated(self, optimizers: list[Optimizer]) -> None:
        names = sorted({type(opt).__name__ for opt in optimizers if replicated_step(opt)})
        if names and self.dp_size > 1 and dist.get_rank() == 0:
            what = self.params.replicated_step_warning
            warnings.warn(
                f"lightning_zero: {', '.join(names)} is not element-wise: stage {self.stage} steps full fp32{what}",
                stacklevel=3,
            )

    def attach_tensor_parallel(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Matrix optimizers orthogonalize tp-split matrices whole over ``tp_group`` ([Note: owner step]);
        full state dicts hold tp-split tensors whole ([Note: dense TP tensors in a full file])."""
        self.tp_group = tp_group
        for sharded in self.optimizers:
            if isinstance(sharded, MatrixOwnerOptimizer):
                sharded.attach_tensor_parallel(tp_group)

    def has_replicated_optimizers(self) -> bool:
        """Whether some optimizer steps replicated full masters (its state cannot be range-saved)."""
        return any(isinstance(sharded, ReplicatedOptimizer) for sharded in self.optimizers)

    # -- backward boundaries (see [Note: end of backward] in reducer.py) -----------------------
    def _zero_grads_zeroed_by_optimizers(self) -> None:
        """[Note: zero_grad detection]: reset only the buckets of optimizers that zeroed their grads."""
        for sharded in self.optimizers:
            if sharded.grads_were_zeroed():
                dropped = sharded.grads_were_dropped()
                self.reducer.zero_grad([b for b in self.reducer.buckets if sharded.owns(b)], dropped=dropped)
                sharded.forget_handed_out_grads()

    def pre_backward(self) -> None:
        """Call before a backward (the strategy does): lets :meth:`post_backward` tell whether
        this backward reached this rank's parameters at all."""
        self.wait_param_gathers()  # backward reads the parameters forward saved
        self._finished_at_pre_backward = self.reducer.finished_backwards
        if isinstance(self.reducer.storage, FullGradStorage) and not self.reducer._backward_open:
            # [Note: gradients as bucket views] in grad_storage.py: zero_grad is checked here, before
            # autograd writes into the slots, not at the first gradient.
            self._zero_grads_zeroed_by_optimizers()
            self.reducer.install_grad_views()

    def post_backward(self) -> None:
        """Call after a backward (the strategy does): finishes the gradient sync if the backward
        did not already (no gradient reached this rank: every bucket launches with zeros)."""
        if self.reducer.finished_backwards == self._finished_at_pre_backward:
            self.reducer.finish_backward()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward(**kwargs)`` with the gradient sync always finished afterwards."""
        self.pre_backward()
        loss.backward(**kwargs)
        self.post_backward()

    @contextmanager
    def gradients_by_hand(self) -> Iterator[dict[nn.Parameter, torch.Tensor]]:
        """[Note: gradients handed in] A caller that runs its backwards outside the engine's view (a
        pipeline schedule: torch's zero-bubble schedules compute weight gradients with
        ``torch.autograd.grad`` and add them to ``.grad`` themselves, so no accumulate-grad hook
        fires, and every schedule divides ``.grad`` by the micro-batch count at its end) gets the
        parameters to itself inside: the reducer's hooks are off and every ``.grad`` starts at
        ``None``. On the way out the gradients the block left are moved into the yielded dict and
        each ``.grad`` is what it was before (the engine's own state untouched); the caller hands
        them in with :meth:`hand_in_grads` where its backward belongs (the Trainer door: in
        ``backward``, after Lightning's ``zero_grad``, which comes after the training step).
        Stage 3 (inside an open training step): every unit is gathered on the way in and kept for
        the whole block, freed on the way out ([Note: stage 3 under a pipeline] in
        ``zero/stage3/runtime.py``)."""
        self.wait_param_gathers()
        managed = [slot.param for group in self.groups for slot in group.layout.slots]
        saved = {param: param.grad for param in managed}
        for param in managed:
            param.grad = None
        held: dict[nn.Parameter, torch.Tensor] = {}
        self.reducer.remove_hooks()
        try:
            with self.stage3.held_whole() if self.stage3 is not None else nullcontext():
                yield held
        finally:
            self.reducer.add_hooks()
            for param in managed:
                if param.grad is not None:
                    held[param] = param.grad
                param.grad = saved[param]

    def hand_in_grads(self, held: dict[nn.Parameter, torch.Tensor]) -> None:
        """One backward whose gradients are ``held`` (:meth:`gradients_by_hand`): added to the
        buckets and, outside :meth:`no_sync`, reduced, as a backward of this step would have."""
        self.pre_backward()
        self.reducer.take_grads(held)
        self.post_backward()

    def ride_phase_markers(self, rider: "MarkerRider") -> None:
        """Carry ``rider``'s values on every phase marker ([Note: marker riders] in agreements.py):
        agreed over every dp rank of every replica (the world when ``tp == 1``) at each backward
        and optimizer step, for ``4 * rider.width`` bytes a marker. Call on every rank, in the
        same order."""
        if rider not in self.reducer.markers.riders:
            self.reducer.markers.riders.append(rider)

    def check_manual_train_step(self) -> None:
        """A manual-optimization training step returned: raise if it ran no backward and no step
        on this rank while other ranks did ([Note: a step without a backward] in agreements.py)."""
        self.step_checks.after_manual_train_step()

    def _right_before_update(self, sharded: ShardedOptimizer) -> None:
        self.step_checks.before_update(self.optimizers.index(sharded), sharded.optimizer)
        sharded.before_update()

    def _before_step(self, optimizer: Optimizer, args, kwargs):
        if self.reducer._backward_open:  # a backward whose end was never seen: finish it now
            self.reducer.finish_backward()
        # The update must not start while a parameter all-gather reads the chunks it writes, and
        # offloaded gradients must be on the host: right before it, i.e. after a closure's
        # forward/backward (Lightning passes one) or now when there is none.
        sharded = next((s for s in self.optimizers if s.optimizer is optimizer), None)
        if sharded is None:
            return None
        # torch passes the step's own arguments: ``args[0]`` is the optimizer, then the closure.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._right_before_update(sharded)
            return None
        wrapped = closure_then(closure, lambda: self._right_before_update(sharded))
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro batches inside skip the gradient collective (stage 1; stages 2-3 with
        ``defer_grad_reduce``: [Note: deferred gradient reduction] in zero/bucketing.py).

        Stages 2-3 without ``defer_grad_reduce`` still reduce-scatter every backward: keeping only
        the gradient shard is their memory promise.
        """
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    def sharded_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        for sharded in self.optimizers:
            if sharded.optimizer is optimizer:
                return sharded
        raise KeyError(f"optimizer {type(optimizer).__name__} is not managed by this engine")

    def measured_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds now: params, grads, optimizer (master + state)."""
        params = sum(group.param_bytes() for group in self.groups) + self.frozen_param_bytes()
        grads = self.reducer.storage.grad_bytes() + sum(sharded.extra_grad_bytes() for sharded in self.optimizers)
        master = sum(group.master_bytes() for group in self.groups)
        master += sum(sharded.extra_master_bytes() for sharded in self.optimizers)
        state = sum(sharded.state_bytes() for sharded in self.optimizers)
        return {
            "params": params,
            "grads": grads,
            "optimizer": master + state,
            "master": master,
            "optimizer_state": state,
            "total": params + grads + master + state,
            # not model state: stage 2/3's bucket pool ([Note: the bucket pool outlives backward])
            "grad_buffers": self.reducer.storage.buffer_bytes(),
        }

    def frozen_param_bytes(self) -> int:
        """Bytes of the parameters no optimizer steps (stages 1-2: kept as they are, in full)."""
        seen: dict[int, int] = {}
        for param in self.frozen_params:
            storage = param.untyped_storage()
            seen[storage.data_ptr() if storage.nbytes() else id(storage)] = storage.nbytes()
        return sum(seen.values())

    def owned_ranges(self) -> Iterator[OwnedRange]:
        """See :class:`OwnedRange`; names are the module's ``named_parameters`` names."""
        return owned_ranges(self.groups)

    def optimizer_tensor(self, owned: OwnedRange) -> torch.Tensor:
        """What an optimizer steps, and keys its state by, for ``owned``: the view of its master
        run ([Note: parameters nobody used] in reducer.py), or the master chunk itself where no
        optimizer steps views (a frozen stage-3 shard, a replicated step)."""
        for sharded in self.optimizers:
            tensor = sharded.optimizer_tensor(owned)
            if tensor is not None:
                return tensor
        return owned.master

    def optimizer_shards(self) -> OptimizerShards:
        """This rank's runs and what steps each ([Note: optimizer state after the loop] in flat.py)."""
        runs = tuple((owned, self.optimizer_tensor(owned)) for owned in self.owned_ranges())
        whole = any(hasattr(sharded, "stage_range_state") for sharded in self.optimizers)
        return OptimizerShards(runs, tuple(s.optimizer for s in self.optimizers), self.has_replicated_optimizers(),
                               whole)  # fmt: skip

    def num_params(self) -> int:
        """Unpadded parameter count managed by the engine (one dp replica)."""
        return sum(slot.numel for group in self.groups for slot in group.layout.slots)

    def expert_split(self) -> tuple[int, int]:
        """``(expert elements this rank holds, ep)`` ([Note: expert domain] in domains.py): what the
        ledger's ``model_state_bytes(expert_params=..., ep=...)`` needs; ``(0, 1)`` without an
        expert domain."""
        if self.expert_domain is None:
            return 0, 1
        local = sum(slot.numel for group in self.groups if group.domain is not None for slot in group.layout.slots)
        return local, self.expert_domain.ep_size

    def padding_numel(self) -> int:
        return sum(group.layout.padding_numel for group in self.groups)

    # -- what the monitor reads (the engine's public surface; nothing outside zero/ walks buckets)
    @property
    def overlap_comm(self) -> bool:
        """Whether bucket collectives launch during backward."""
        return self.reducer.overlap_comm

    @property
    def timeline(self) -> "SyncTimeline":
        """Launch/done/backward-end times of the last gradient sync (see ``reducer.SyncTimeline``)."""
        return self.reducer.timeline

    def bucket_count(self) -> int:
        """Gradient buckets per backward, each one reduce-scatter."""
        return len(self.reducer.buckets)

    def overlap_possible(self) -> bool:
        """False when every reduced flat group is a single bucket: each bucket is complete only
        when its group's last gradient arrives, so no reduce-scatter can start before the end."""
        return self.bucket_count() > len(self._reduced_groups)

    def unshard_parameters(self) -> None:
        """Stage 3: every parameter becomes a full, independent tensor again (collective over dp);
        stages 1-2: nothing to do."""
        self.params.unshard()

    # -- the phase of a step (stage 3 gathers by phase; stages 1-2 overlap their gathers by it) ----
    def begin_step(self, kind: str) -> None:
        """A training (``"train"``) or evaluation (``"eval"``) step starts ([Note: phases])."""
        if kind == "train":
            self.step_checks.begin_train_step()
        self.params.begin_step(kind)

    def end_step_call(self) -> None:
        """The training-step call returned (its backward may still follow)."""
        self.params.end_step_call()

    def end_eval_step(self) -> None:
        self.params.end_eval_step()

    def end_eval_loop(self) -> None:
        """An evaluation loop ended on this rank; ranks with fewer batches serve the others."""
        self.params.end_eval_loop()

    def release_module(self) -> None:
        """Leave the module usable outside the engine (forward, ``state_dict``, another fit):
        stage 3 unshards every parameter, stages 1-2 put the fp32 masters back. Collective."""
        self.wait_param_gathers()
        self.params.release(self.release_grads)
        self.reducer.storage.release_buffers()  # stage 2's bucket pool; stage 1-2's gradients stay
        self.restore_master_params()

    def release_grads(self) -> None:
        """Drop every gradient this rank holds: the masters' ``.grad`` and the reducer's reduced
        chunks (stage 3 frees ``4 P / dp`` bytes in fp32 this way). Stage 3's ``release_module``
        calls it before unsharding, which holds the whole module (``4 P``) beside what is still
        alive; the last step's gradients would otherwise set the process's peak at teardown."""
        for sharded in self.optimizers:
            sharded.drop_grads()
        self.reducer.storage.release()

    # -- what checkpoints and tensor parallelism read -----------------------------------------
    def managed_parameters(self) -> dict[str, nn.Parameter]:
        """``{name: parameter}`` of every parameter in the engine's flat groups (what a sharded
        checkpoint saves from the engine rather than from the module). Parameters are whole:
        pending all-gathers are waited for first."""
        self.wait_param_gathers()
        return {slot.name: slot.param for group in self.groups for slot in group.layout.slots}

    def managed_param_names(self) -> set[str]:
        """Names of the parameters whose fp32 masters the engine's optimizers step."""
        return set(self.managed_parameters())

    def refresh_params_from_masters(self) -> None:
        """Compute parameters from the fp32 masters (after loading them): stages 1-2 all-gather
        the full parameters; stage 3 refreshes each rank's shard (gathered on use)."""
        self.wait_param_gathers()
        self.params.refresh_from_masters(self.optimizers)

    def master_chunk_weights(self, weight_of: "Callable[[nn.Parameter], float]") -> dict[int, torch.Tensor]:
        """Per-element weights of each master chunk, ``weight_of(param)`` for the elements of
        ``param``; only chunks holding an element whose weight is not 1 get a tensor (keyed by
        ``id(master)``). Tensor parallelism uses it to weigh replicated elements in the norm."""
        weights: dict[int, torch.Tensor] = {}
        for group in self.groups:
            for bucket, master in zip(group.layout.buckets, group.masters):
                start = bucket.shard_start(group.dp_rank)
                end = start + bucket.shard_numel
                weight = torch.ones(bucket.shard_numel, dtype=torch.float32, device=master.device)
                for slot in bucket.slots:
                    lo, hi = max(start, slot.offset), min(end, slot.end)
                    if lo < hi:
                        weight[lo - start : hi - start] = weight_of(slot.param)
                if bool((weight != 1).any()):
                    weights[id(master)] = weight
        return weights

    def restore_master_params(self) -> None:
        """Under bf16-mixed (and wherever the masters are separate copies): parameters become the
        full fp32 masters again (one all-gather over dp), so a forward outside the Trainer, a
        second ``fit`` or a ``state_dict`` sees fp32 weights as under ddp's bf16-mixed. Stage 3
        calls it after :meth:`unshard_parameters`. Collective over dp."""
        for group in self.groups:
            group.restore_master_params(
                shard_group(group, self.dp_group),
                self.counter,
                lambda work: self.waiter.wait(work, lambda: "the fp32 master all-gather at teardown"),
            )

    def close(self, destroy_groups: bool = True) -> None:
        """Remove every hook and destroy the process groups the engine created (``destroy_groups=False``
        on the failure path: a gloo group's destructor waits for its collectives in flight, which a
        failed peer never completes)."""
        self.params.remove_hooks()
        self.reducer.remove_hooks()
        for sharded in self.optimizers:
            sharded.remove_hooks()
        for handle in self._step_pre_hooks:
            handle.remove()
        self._step_pre_hooks.clear()
        if self._owns_failure:
            self.failure.close()
        for group in self._owned_groups if destroy_groups else ():
            if dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):  # already destroyed by its other user
                    pass
        self._owned_groups.clear()
