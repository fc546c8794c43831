"""ZeroSession: what both front doors call to run ZeRO on this rank (no ``lightning.pytorch``).

Part of the run (:class:`~lightning_zero.runtime.run.ZeroRun`, [Note: one runtime object]), which
builds it once and which both doors forward to; the session does the same things in the same order
for both:

1. :meth:`plan_layout` (before any process group starts): the ``(dp, cp, tp)`` layout (ep inside
   dp*cp, hybrid splits of it) from the knobs and the cluster, checked against the model; raises
   on a bad one.
2. :meth:`start` (once the door started the default process group): the failure channel
   ([Note: failure path] in ``runtime/failure.py``), the layout's groups (:attr:`groups`, built
   once), the NCCL watchdog's timeout.
3. :meth:`prepare_module`: the module on the device, every dp rank starting from dp rank 0's
   weights (as DDP does at construction); meta tensors are left for stage 3 to materialize.
4. :meth:`build_engine`: the :class:`~lightning_zero.zero.engine.ZeroEngine` over the module and
   the optimizers, with the groups, the counter and the failure channel of this session.
5. :meth:`serve_full_state_dicts` once per set-up module: ``module.state_dict()`` hands out
   ddp's values while the engine runs; :meth:`checkpoint_layout` for saves and loads;
   :meth:`close_engine` at teardown (the failure path's teardown when this rank or a peer failed);
   :meth:`close`.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.config import ZeroConfig
from lightning_zero.runtime.failure import note_failure, open_failure_channel, warn_failed
from lightning_zero.runtime.setup import (
    broadcast_module_states,
    build_groups,
    find_tp_counter,
    move_real_tensors,
    parallel_dims,
    weigh_tp_norm,
)
from lightning_zero.zero.waits import hold_collective_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

    from lightning_zero.checkpoint import RankPlacement
    from lightning_zero.comm.mesh import MeshGroups, ParallelDims, ShardGroups
    from lightning_zero.pp.layout import PipelineLayout
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.runtime.parallelize import ParallelPlan
    from lightning_zero.runtime.pipeline import PipelineRun
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.flat import OptimizerShards
    from lightning_zero.zero.waits import FailureChannel


class ZeroSession:
    """One rank's ZeRO run: layout, process groups, failure channel, engine.

    Args:
        config: the knobs (:class:`~lightning_zero.config.ZeroConfig`), passed whole to the engine.
        wrap_policy: stage 3's unit policy (``zero/stage3/units.py``), or ``None`` for the default.
    """

    def __init__(self, config: ZeroConfig, wrap_policy: Optional[Callable[..., bool]] = None) -> None:
        self.config = config
        self.wrap_policy = wrap_policy
        self.dims: Optional["ParallelDims"] = None
        self.pipeline_layout: Optional["PipelineLayout"] = None  # pp > 1: the checked split
        self.pipeline: Optional["PipelineRun"] = None  # pp > 1: this rank's schedules, from start_pipeline
        self.groups: Optional["MeshGroups"] = None  # the layout's process groups, from start()
        self.failure_channel: Optional["FailureChannel"] = None
        self.engine: Optional["ZeroEngine"] = None
        # what the last engine with optimizers left at close ([Note: optimizer state after the loop])
        self._closed_shards: Optional["OptimizerShards"] = None
        self._state_dict_calls = 0  # full state dicts agreed so far ([Note: one rank's state_dict])
        # Logical bytes sent by the engine (dp) and by tensor-parallel layers (tp), per kind.
        self.comm_counter = CommCounter()

    # -- 1. layout, before any process group ----------------------------------------------------
    def plan_layout(self, *, num_nodes: int, num_processes: int, module: Any) -> "ParallelDims":
        """The layout for ``num_nodes * num_processes`` ranks; raises on a bad one."""
        self.dims = parallel_dims(self.config, num_nodes=num_nodes, num_processes=num_processes,
                                  lightning_module=module)  # fmt: skip
        if module is not None:  # the Fabric door's model arrives at fabric.setup, where it checks the split
            from lightning_zero.runtime.pipeline import pipeline_layout

            self.pipeline_layout = pipeline_layout(self.config, self.dims, module)
        return self.dims

    # -- 2. once the default process group is up ------------------------------------------------
    def start(self, device_type: str) -> None:
        """Failure channel, the layout's groups, and the collective timeout of every group."""
        if self.dims is None:
            raise RuntimeError("ZeroSession.start: call plan_layout first (before the process group starts)")
        self.failure_channel = open_failure_channel(self.failure_channel)
        self.groups = build_groups(self.dims, device_type)
        # [Note: collective timeout on NCCL] in zero/waits.py: the watchdog's limit is collective_timeout
        hold_collective_timeout([None, *self.groups.all()], self.config.collective_timeout)

    def parallel_plan(self) -> "ParallelPlan":
        """[Note: the parallelize registry]: the layout's groups and knobs, for a model family's step
        (the Fabric door applies it at ``fabric.setup``; the Trainer door hands it to the
        LightningModule before ``configure_model``)."""
        from lightning_zero.runtime.parallelize import ParallelPlan

        if self.groups is None:
            raise RuntimeError(
                "ZeroSession.parallel_plan: call start first (the groups exist once the process group is up)"
            )
        return ParallelPlan(self.groups, sequence_parallel=self.config.sequence_parallel,
                            pipeline=self.pipeline_layout)  # fmt: skip

    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``DeviceMesh`` the model's parallelize functions read (``("dp", "tp")``, or
        ``("dp", "cp", "tp")`` with cp), when ``tp > 1`` or ``cp > 1``; else ``None``."""
        return None if self.groups is None else self.groups.device_mesh

    @property
    def shard_groups(self) -> Optional["ShardGroups"]:
        """The hybrid layout's groups (``None`` when ZeRO shards over the whole dense group)."""
        return None if self.groups is None else self.groups.shard

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        """The dense (dp*cp) group ZeRO shards over, or ``None`` (the default group: ``tp == 1``)."""
        return None if self.groups is None else self.groups.dp_cp

    def dp_size(self, world_size: int) -> int:
        """Ranks that take different samples (the sampler's replicas): ``world_size / (tp * cp)``."""
        return world_size if self.dims is None else self.dims.dp

    def dp_rank(self, global_rank: int) -> int:
        """This rank's index among the ranks that take different samples."""
        return global_rank if self.dims is None else self.dims.group_rank("dp", global_rank)

    def dense_size(self, world_size: int) -> int:
        """Ranks of the dense (dp*cp) group: ZeRO's group, over which dense gradients are averaged."""
        return world_size if self.dims is None else self.dims.dp_cp

    # -- 3. the module ---------------------------------------------------------------------------
    def prepare_module(self, module: nn.Module, device: torch.device, *, ranks_per_node: int) -> None:
        """``module`` on ``device`` (meta tensors stay: stage 3 materializes them), with dp rank 0's
        weights on every dp rank, and its TP layers' counter adopted."""
        move_real_tensors(module, device)
        broadcast_module_states(module, self.dp_group, self.groups.edp if self.dims and self.dims.ep > 1 else None)
        tp_counter = find_tp_counter(module)  # dp and tp traffic counted in one place
        if tp_counter is not None:
            self.comm_counter = tp_counter
        self.comm_counter.ranks_per_node = ranks_per_node  # [Note: link classes] in collectives.py

    # -- 4. the engine ---------------------------------------------------------------------------
    def build_engine(
        self,
        module: nn.Module,
        optimizers: list,
        *,
        precision: "PrecisionPolicy",
        device: torch.device,
        ranks_per_node: int,
    ) -> "ZeroEngine":
        """A fresh engine over ``module`` and ``optimizers`` (an earlier one is closed first), keeping
        each byte where ``precision`` says (precision.py)."""
        from lightning_zero.zero.domains import ExpertDomain
        from lightning_zero.zero.engine import EngineGroups, ZeroEngine

        if self.engine is not None:
            self.engine.close()
        if optimizers:  # a new set of optimizers: the closed engine's runs belong to the old ones
            self._closed_shards = None
        groups = self.shard_groups
        engine_groups = EngineGroups(
            dp=self.dp_group if groups is None else None,
            # dp chunks differ, and so do tp shards; replicas of a hybrid layout hold the same ones
            norm=dist.group.WORLD if groups is None else groups.replica,
            shard=groups,
            expert=ExpertDomain.from_mesh(self.groups) if self.groups is not None else None,
            ranks_per_node=ranks_per_node,
        )
        self.engine = ZeroEngine(
            module,
            optimizers,
            self.config,  # whole: the engine's parts read config.<knob> where they use it
            groups=engine_groups,
            precision=precision,
            device=device,
            wrap_policy=self.wrap_policy,
            counter=self.comm_counter,
            failure=self.failure_channel,
        )
        if self.dims is not None and self.dims.tp_enabled:
            weigh_tp_norm(self.engine, self.dims.tp)
            self.engine.attach_tensor_parallel(self.groups.tp)  # [Note: owner step]
        return self.engine

    def start_pipeline(self, module: nn.Module, device: torch.device) -> None:
        """``pp > 1``: torch's schedules over the stages ``module``'s decoder was cut into, with
        this session's engine ([Note: the pipelined step] in ``runtime/pipeline.py``)."""
        if self.pipeline_layout is None:
            return
        from lightning_zero.runtime.pipeline import PipelineRun

        assert self.groups is not None
        self.pipeline = PipelineRun(self.pipeline_layout, self.groups, device, self.failure_channel)
        self.pipeline.attach(module, self.engine)

    @contextmanager
    def stepping(self, module: nn.Module, accumulate: int = 1) -> Iterator[None]:
        """Around a LightningModule's step: under ``pp > 1`` its model runs as a pipeline
        ([Note: the pipelined step]); otherwise nothing."""
        if self.pipeline is None:
            yield
            return
        with self.pipeline.stepping(module, accumulate):
            yield

    def pipelined_backward(self) -> bool:
        """``pp > 1``: the backward of the training step that just ran (its schedule kept the
        gradients aside: [Note: the pipelined step]) hands them to the engine; returns whether it
        did (otherwise the door runs its own backward)."""
        if self.pipeline is None:
            return False
        self.pipeline.hand_in_grads()
        return True

    # -- 5. state dicts, checkpoints, failures, teardown ------------------------------------------
    def serve_full_state_dicts(
        self, module: nn.Module, value_dtype: Callable[[nn.Parameter], torch.dtype], *, dense: bool = False
    ) -> list["RemovableHandle"]:
        """[Note: full state dicts] in ``checkpoint/full.py``: while this session's engine runs,
        ``module.state_dict()`` hands out what ddp's would: every engine-owned parameter's full
        value in ``value_dtype(param)`` (the precision policy's ``ddp_dtype``), gathered from the
        masters one parameter at a time. Stage 3 always (the module holds shards); stages 1-2 where
        the module holds compute copies in another dtype (``bf16-mixed``: bf16 copies where ddp
        holds fp32 weights). A collective wherever it gathers: every rank calls ``state_dict()``.
        ``keep_vars=True`` (the checkpoints' path) hands out the parameters as they are; with no
        engine (before setup, after :meth:`close_engine`) the module's own values. Both doors call
        it once per set-up module and remove the handles at teardown. ``dense`` (the Fabric door, whose
        ddp state dict is the dense model's): tp-split parameters are handed out whole, at every
        stage ([Note: dense TP tensors in a full file] in ``checkpoint/full.py``)."""
        hook = functools.partial(_fill_full_values, self, value_dtype, dense)  # a partial: torch marks the hook object
        agree = functools.partial(_agree_full_values, self, value_dtype, dense)  # [Note: one rank's state_dict]
        handles = [child.register_state_dict_pre_hook(agree) for child in module.modules()]
        return handles + [
            child.register_state_dict_post_hook(hook)
            for child in module.modules()
            if any(param is not None for param in child._parameters.values())
        ]

    def agree_full_state_dict(self) -> None:
        """[Note: one rank's state_dict]: every rank is in this ``state_dict()`` call within
        :data:`STATE_DICT_AGREEMENT_S` seconds, or this rank raises (posted on the failure channel,
        so the ranks that went on end too)."""
        channel = self.failure_channel
        if channel is None or channel.world_size == 1:
            return
        self._state_dict_calls += 1
        if channel.all_ranks_reach(f"state_dict/{self._state_dict_calls}", STATE_DICT_AGREEMENT_S):
            return
        error = RuntimeError(
            f"lightning_zero (global rank {channel.rank}): model.state_dict() gathers every parameter from the"
            f" shards (stage {self.config.stage}, or a precision whose parameters are not in ddp's dtype), a"
            f" collective, but not every rank called it within {STATE_DICT_AGREEMENT_S:.0f} s: the others went on"
            " and would wait for this rank until collective_timeout. Call model.state_dict() on every rank (each"
            " gets the full state dict; keep or save it on rank 0), or save with trainer.save_checkpoint /"
            " fabric.save on every rank; after fit (or the Fabric strategy's teardown) the module is whole and"
            " state_dict() is local."
        )
        note_failure(channel, error, "model.state_dict()")
        raise error

    def checkpoint_layout(self, *, world_size: int, global_rank: int, precision: str) -> "RankPlacement":
        """Where this rank sits, as a checkpoint records it (and a load reads into)."""
        from lightning_zero.checkpoint import RankPlacement

        tp = self.dims.tp if self.dims is not None else 1
        tp_rank = self.dims.group_rank("tp", global_rank) if self.dims is not None else 0
        ep = self.dims.ep if self.dims is not None else 1
        ep_rank = self.dims.group_rank("ep", global_rank) if self.dims is not None else 0
        return RankPlacement(world_size, global_rank, self.dp_size(world_size), self.dp_rank(global_rank), tp,
                             tp_rank, self.config.stage, precision, ep, ep_rank)  # fmt: skip

    @property
    def failed(self) -> bool:
        """This rank failed, or knows another rank did: it issues no collective any more."""
        return self.failure_channel is not None and self.failure_channel.failed

    def note_failure(self, exception: BaseException, where: str) -> None:
        """Step 1 of [Note: failure path]: post ``exception`` (or name the peer that caused it)."""
        note_failure(self.failure_channel, exception, where)

    def warn_failed(self, global_rank: int, what: str) -> None:
        """Step 2 of [Note: failure path]: say what this rank skipped and why."""
        warn_failed(self.failure_channel, global_rank, what)

    def close_engine(self, global_rank: int) -> None:
        """Teardown: the module usable outside the engine (full parameters, fp32 under bf16-mixed,
        as under ddp), hooks and the engine's groups gone; on the failure path without anything
        that needs the peers."""
        if self.engine is None:
            return
        if self.engine.optimizers:  # [Note: optimizer state after the loop] in zero/flat.py
            self._closed_shards = self.engine.optimizer_shards()
        if self.failed:  # [Note: failure path]: nothing that needs the peers
            what = ("teardown left the module as it is (stage 3: this rank's shards only; stages 1-2 under"
                    " bf16-mixed: bf16 parameters) and skipped the collectives that need every rank (gathers,"
                    " destroying the engine's process groups)")  # fmt: skip
            self.warn_failed(global_rank, what)
            self.engine.close(destroy_groups=False)
        else:
            self.engine.release_module()
            self.engine.close()
        self.engine = None

    def optimizer_shards(self, optimizers: list) -> Optional["OptimizerShards"]:
        """Where the state of ``optimizers`` lives when no running engine steps them: the runs the
        engine that did left at its close ([Note: optimizer state after the loop] in
        ``zero/flat.py``), for a save after the loop; ``None`` while an engine steps them (saves
        read the engine) or when they are not the closed engine's."""
        if self.engine is not None and self.engine.optimizers:
            return None
        shards = self._closed_shards
        return shards if shards is not None and optimizers and shards.serves(optimizers) else None

    def close(self) -> None:
        """The failure channel's watcher stops (after :meth:`close_engine`)."""
        if self.failure_channel is not None:
            self.failure_channel.close()


STATE_DICT_AGREEMENT_S = 5.0  # [Note: one rank's state_dict]: how far apart the ranks may call it


def _agree_full_values(
    session: ZeroSession,
    value_dtype: Callable[[nn.Parameter], torch.dtype],
    dense: bool,
    module: nn.Module,
    prefix: str,
    keep_vars: bool,
) -> None:
    """The state-dict pre-hook of :meth:`ZeroSession.serve_full_state_dicts` on every module.

    [Note: one rank's state_dict] A full state dict gathers each parameter from the shards over the
    dp group ([Note: full state dicts] in ``checkpoint/full.py``), so every rank must call it: a
    ``model.state_dict()`` under ``if trainer.is_global_zero:`` (or ``fabric.global_rank == 0``)
    left rank 0 in the first gather while the others went on to their next step, and every rank
    waited ``collective_timeout`` (300 s). So the outermost ``state_dict()`` call that will gather
    (``prefix == ""``: the module the user called it on; ``keep_vars=True`` hands out the
    parameters and gathers nothing) first counts itself in through the store and waits for every
    rank, at most :data:`STATE_DICT_AGREEMENT_S` seconds (one store request per poll; ranks called
    at the same point of the loop arrive within milliseconds); a rank that waited in vain raises a
    named error and posts it, so the ranks that went on raise within one poll of their failure
    channel and every rank exits."""
    engine = session.engine
    if prefix or keep_vars or engine is None:
        return
    split = dense and engine.tp_group is not None
    if engine.stage != 3 and not split and all(param.dtype == value_dtype(param) for param in module.parameters()):
        return  # nothing to gather: the parameters are ddp's values already
    session.agree_full_state_dict()


def _fill_full_values(
    session: ZeroSession,
    value_dtype: Callable[[nn.Parameter], torch.dtype],
    dense: bool,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    metadata: Any,
) -> None:
    """The state-dict post-hook of :meth:`ZeroSession.serve_full_state_dicts` on ``module``."""
    engine = session.engine
    if engine is None:
        return
    params = [param for param in module._parameters.values() if param is not None]
    split = dense and engine.tp_group is not None and any(getattr(p, "_tp_shard_dim", None) is not None for p in params)
    if engine.stage != 3 and not split and all(param.dtype == value_dtype(param) for param in params):
        return
    from lightning_zero.checkpoint.full import fill_gathered_values

    fill_gathered_values(state_dict, prefix, module, engine, engine.dp_group, value_dtype, dense=dense)
