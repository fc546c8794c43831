"""ZeroFabricStrategy: Fabric's door to the ZeRO runtime (``L.Fabric(strategy="zero3")``), a translation table.

Everything a run owns is the run's (:class:`~lightning_zero.runtime.run.ZeroRun`, [Note: one
runtime object]), shared with the Trainer door; a loop the user writes is followed by
:class:`~lightning_zero.runtime.forward_steps.ForwardSteps` (engine built at the first call that
needs it, step boundaries from the model's forward: [Note: Fabric step boundaries]). This file only
maps Fabric's calls onto them:

- ``setup_environment``: the layout checked before the process group starts, the run started after.
- ``setup_module`` / ``setup_optimizer``: the model and its optimizers handed to the loop (the layout
  pushed into the model first: [Note: the parallelize registry]); ``module_init_context``
  (``fabric.init_module()``): stage 3 builds on the meta device ([Note: stage 3 init under Fabric]
  in ``runtime/deferred_init.py``).
- ``backward`` ends the gradient sync; ``no_backward_sync`` is the engine's ``no_sync``;
  ``clip_gradients`` clips by the global norm over the shards; under ``16-mixed`` the gradient
  shards are unscaled and the overflow agreed over every rank first ([Note: Fabric loss scaling]
  in ``fabric/precision.py``).
- Fabric's collectives serve evaluating peers first ([Note: forwards on some ranks only]).
- ``fabric.save``/``fabric.load``: the sharded checkpoint of ``checkpoint/``, or one full file with
  ``state_dict_type="full"`` (``fabric/checkpoint.py``); ``load_raw`` and a set-up model's
  ``load_state_dict`` write a full state dict through to the shards and masters ([Note: full state
  dicts] in ``checkpoint/full.py``).
- context and expert parallelism: ``fabric/layout.py`` ([Note: context parallelism under Fabric],
  [Note: expert parallelism under Fabric]).
- a failure: [Note: failure path] in ``runtime/failure.py``; a rank whose script ends with an
  exception posts it from ``sys.excepthook`` (``fabric/_compat.py``: Fabric has no exception hook).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config import ZeroConfig, knob_views
from lightning_zero.fabric._compat import (
    install_excepthook,
    restore_excepthook,
    route_load_state_dict,
    unroute_load_state_dict,
)
from lightning_zero.fabric.checkpoint import FabricCheckpoints
from lightning_zero.fabric.layout import FabricLayout, check_before_launch
from lightning_zero.fabric.precision import FabricPrecisionSlot
from lightning_zero.runtime.forward_steps import ForwardSteps
from lightning_zero.runtime.pipeline import refuse_loss_scaling
from lightning_zero.runtime.run import ZeroRun
from lightning_zero.runtime.signals import AgreedSignals
from lightning_zero.runtime.views import RunViews

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

    from lightning_zero.runtime.monitor import Monitor
    from lightning_zero.runtime.signals import SignalBoundary


# [Note: knobs at the Fabric door] Every ZeroConfig field is honoured here or refused at
# construction (a ValueError naming the knob, the door and the fix); none is dropped. The engine's
# knobs (buckets, overlap, offload, compression, topology, timeouts, precision) mean the same under
# both doors because the session builds the same engine; ``monitor`` reports through the runtime's
# monitor (``runtime/monitor.py``; ``monitor_metrics()``, ``report_to(fabric)``); the refused ones
# and why are below (tests/test_knobs.py checks that the two sets cover every field).
# None is refused today: tp and sequence_parallel reach the model through its family's step ([Note: the
# parallelize registry]), which refuses a model it cannot split; pp goes through pipeline_step.
FABRIC_REFUSES: dict[str, tuple[Callable[[Any], bool], str]] = {}
FABRIC_HONOURS = frozenset(
    {
        "stage", "bucket_mb", "overlap_comm", "prefetch_blocks", "offload_optimizer", "defer_grad_reduce",
        "exact_grad_norm", "max_buckets_in_flight", "monitor", "collective_timeout", "overlap_param_gather", "grad_comm_dtype",
        "param_comm_dtype", "shard_size", "hierarchical_reduce", "reduce_dtype", "master_weights", "mixed_params",
        "async_checkpoint", "storage_options", "upload_threads", "upload_stall_s", "ep", "cp",
        "tensor_parallel_size", "sequence_parallel",
        "pp", "pp_schedule", "pp_virtual_stages", "pp_layers", "pp_microbatches",  # pipeline_step
    }
)  # fmt: skip


def refuse_knobs(config: ZeroConfig) -> None:
    """[Note: knobs at the Fabric door]: raise for a knob this door cannot honour."""
    for name, (refused, fix) in FABRIC_REFUSES.items():
        value = getattr(config, name)
        if refused(value):
            raise ValueError(f"ZeroFabricStrategy({name}={value!r}): the Fabric door cannot honour it: {fix}")


@knob_views  # ``strategy.stage``, ``strategy.bucket_mb``, ...: read-only views of the one config object
class ZeroFabricStrategy(RunViews, FabricPrecisionSlot, FabricCheckpoints, FabricLayout, DDPStrategy):
    """ZeRO data parallelism (stages 1-3) as a Lightning Fabric strategy.

    Args:
        config: a :class:`~lightning_zero.config.ZeroConfig` (e.g. the Trainer strategy's
            ``ZeroStrategy(...).zero_config``), or ``None`` to build one from ``knobs``.
        state_dict_type: ``"sharded"`` (default): ``fabric.save`` writes a sharded checkpoint
            directory (every rank its shards; resumes on any dp size or stage); ``"full"``: one
            file, ``torch.save`` of the state with the model's full state dict (fp32 masters) and
            the optimizers' state in torch's format, as Fabric's ddp writes it for LitGPT's tools;
            written by global rank 0. A save with a ``filter`` is such a file under either type
            ([Note: filtered saves are one file] in ``fabric/checkpoint.py``).
        wrap_policy: stage 3's unit policy (see ``ZeroStrategy``).
        model_config, seq_len: with ``cp > 1``, the model's config (``n_heads``, ``n_kv_heads``)
            and the sequence length the loop will feed, checked here against ``cp`` before any
            process starts (``ValueError`` naming the fix; ring attention or a kv repeat stated);
            without them the heads are checked at ``fabric.setup`` and the length at each
            ``context_slice``
            ([Note: context parallelism under Fabric]).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
            process_group_backend, timeout, start_method: as for Fabric's ``DDPStrategy``.
        knobs: every field of :class:`~lightning_zero.config.ZeroConfig` (``stage``, ``bucket_mb``,
            ...), the same knobs as ``ZeroStrategy``'s, validated by the same object.

    [Note: one config, two doors] ``ZeroStrategy`` is a ``lightning.pytorch`` strategy and Fabric
    accepts only ``lightning.fabric`` ones, so the Fabric door is a twin class; what makes them
    the same is the one ``ZeroConfig`` both take (``ZeroFabricStrategy(config=trainer_strategy.
    zero_config)`` is the Trainer strategy's configuration) and the one runtime object both
    forward to (``runtime/run.py``, [Note: one runtime object]).
    Tensor parallelism (``tensor_parallel_size > 1``, with ``sequence_parallel``) is applied to the
    model given to ``fabric.setup`` by its family's step (LitGPT's ``GPT``: [Note: LitGPT under
    tensor parallelism] in ``models/litgpt/tensor_parallel.py``).
    """

    strategy_name = "zero_fabric"

    def __init__(
        self,
        config: Optional[ZeroConfig] = None,
        *,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        wrap_policy: Optional[Callable[..., bool]] = None,
        model_config: Optional[Any] = None,
        seq_len: Optional[int] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **knobs: Any,
    ) -> None:
        if config is not None and knobs:
            raise ValueError(
                f"ZeroFabricStrategy(config=..., {', '.join(sorted(knobs))}=...): pass the knobs in the config or"
                " as keywords, not both (dataclasses.replace(config, ...) changes one)."
            )
        self.zero_config = config if config is not None else ZeroConfig(**knobs)
        refuse_knobs(self.zero_config)
        check_before_launch(self.zero_config.cp, model_config=model_config, seq_len=seq_len)  # fabric/layout.py
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"ZeroFabricStrategy(state_dict_type={state_dict_type!r}): use 'sharded' (a checkpoint directory,"
                " resumable on any layout) or 'full' (one file with the full model state dict)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.state_dict_type = state_dict_type
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        # everything the run owns, and the events this door translates Fabric's calls into
        self.run = ZeroRun(self.zero_config, wrap_policy, ranks=lambda: (self.world_size, self.global_rank),
                           where=lambda: self.loop.where)  # fmt: skip
        self.loop = ForwardSteps(self.run, precision=lambda: self.precision_policy)  # runtime/forward_steps.py
        self.overflows: list[tuple[bool, bool]] = []  # 16-mixed, per step: (this rank's shard, any rank's)
        self._previous_excepthook: Optional[Callable[..., Any]] = None
        self._torn_down = False

    @property
    def signals(self) -> "SignalBoundary":
        """[Note: signal boundaries] in runtime/signals.py: the loop asks scheduler_signals() once per step."""
        return self.run.signals

    @property
    def step_monitor(self) -> Optional["Monitor"]:
        """[Note: the monitor] in runtime/monitor.py: measured at the forward pre-hook and the step hook."""
        return self.run.monitor

    # -- environment, failures ------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # raises on a bad layout before any process group starts
        refuse_loss_scaling(self.zero_config.pp, self.precision, "ZeroFabricStrategy")
        self.run.plan_layout(num_nodes=self.num_nodes, num_processes=self.num_processes, module=None)
        super().setup_environment()  # starts the process group
        self.run.start(self.root_device, ranks_per_node=self.num_processes)
        self.checkpoints.open()  # async_checkpoint: fabric.save writes in the background from now on
        self._install_signal_handlers()
        if self._previous_excepthook is None:  # [Note: replaced attributes at the Fabric door]
            self._previous_excepthook = install_excepthook(self._excepthook)
        self.run.quiesce_at_exit()  # [Note: nothing running at exit]

    def _excepthook(self, kind: type, exception: BaseException, trace: Any) -> None:
        """[Note: failure path]: a script that ends with an exception posts it first."""
        self.run.excepthook(self._previous_excepthook or sys.__excepthook__)(kind, exception, trace)

    def note_failure(self, exception: BaseException) -> None:
        """Tell the other ranks that this rank failed with ``exception`` (for loops that catch
        their exceptions themselves; an uncaught one is posted by ``sys.excepthook``)."""
        self.run.session.note_failure(exception, self.loop.where)

    # -- module and optimizers ------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """[Note: stage 3 init under Fabric] in ``runtime/deferred_init.py``; under ``pp > 1`` built whole,
        then cut at setup, as the Trainer door does ([Note: stage 3 under a pipeline])."""
        if self.zero_config.stage != 3 or not empty_init or self.zero_config.pp > 1:
            return super().module_init_context(empty_init=False)
        return self.loop.init.building(self.root_device, self.precision.module_init_context())

    @override
    def module_to_device(self, module: nn.Module) -> None:
        from lightning_zero.runtime.setup import move_real_tensors

        move_real_tensors(module, self.root_device)  # meta tensors stay: stage 3 materializes them

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        # optimizers first: the engine is built once, over all of them (stage 3 from the meta model)
        optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        module = self.setup_module(module)
        self.run.rebind_optimizers(optimizers, module)  # split (tp, ep) or cut (pp) before the engine sees them
        self.loop.ensure_engine()
        self.run.start_pipeline(module)  # [Note: the pipelined step] in runtime/pipeline.py
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.loop.set_module(module, self._value_dtype):
            # [Note: full state dicts]: load_state_dict on the set-up model writes through to the shards
            route_load_state_dict(module, self._load_module_state_dict)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self.loop.add_optimizer(optimizer)

    # -- the monitor ([Note: the monitor] in runtime/monitor.py) --------------------------------
    def report_to(self, fabric: Any) -> None:
        """Log the monitor's metrics through ``fabric.log_dict`` after every optimizer step (the
        step number is the strategy's count of optimizer steps). Without it they are kept in
        ``step_monitor.history``; ``monitor_metrics()`` is the last step's."""
        if self.run.monitor is None:
            raise ValueError("ZeroFabricStrategy.report_to: the monitor is off (monitor=False)")
        self.loop.report = fabric

    def monitor_metrics(self) -> dict[str, float]:
        """The monitor's metrics of the last optimizer step (``{}`` before the first, or when off)."""
        monitor = self.run.monitor
        return dict(monitor.history[-1]) if monitor is not None and monitor.history else {}

    # -- scheduler signals ([Note: signal boundaries] in runtime/signals.py) --------------------
    def _install_signal_handlers(self) -> None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        environment = self.cluster_environment
        requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self.signals.agreement.requeue_signal = environment.requeue_signal if requeue else None  # type: ignore[union-attr]
        self.signals.agreement.install()

    def scheduler_signals(self) -> Optional[AgreedSignals]:
        """What every rank agreed on since the last optimizer step: ``None`` (go on), or an
        :class:`~lightning_zero.runtime.signals.AgreedSignals` whose ``requeue`` (the SLURM requeue
        signal, under ``SLURMEnvironment(auto_requeue=True)``) and ``terminate`` (SIGTERM) say what
        to do: save (``fabric.save``), then ``requeue()`` and go on, or exit with
        ``SIGTERM_EXIT_CODE`` (143). Call it on every rank once per optimizer step, after
        ``optimizer.step()``; a call with no optimizer step since the last one (inside gradient
        accumulation, or twice) is no boundary and returns ``None``. The flags rode on the step's
        phase markers: no collective of its own once the engine exists (docs/fabric.md)."""
        return self.loop.scheduler_signals()

    def requeue(self) -> int:
        """Every rank waits until a background save in flight is published (``async_checkpoint``:
        the scheduler may end the job right after; [Note: checkpoint lifecycle]), then global rank 0
        runs ``scontrol requeue <job>`` (its exit code; 0 on the other ranks)."""
        return self.run.requeue()

    # -- backward --------------------------------------------------------------------------------
    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulate: int = 1) -> torch.Tensor:
        """``pp > 1``, a hand loop's forward and backward of one batch through the pipeline: the
        schedule over ``inputs``' micro-batches (``pp_microbatches`` equal slices of dim 0) and the
        model's ``loss_fn`` against ``targets``; returns the batch's mean loss on every rank (a MoE
        with balancing terms: plus every stage's, averaged over the micro-batches). Pass it
        to ``fabric.backward`` (which hands the schedule's gradients to the engine: once per step,
        or under ``fabric.no_backward_sync`` while accumulating), then step the optimizer. The
        gradients are those of ``loss / accumulate`` (dividing the returned loss changes nothing:
        the backward already ran). Under ``torch.no_grad()``: the forward only, for evaluation
        ([Note: the pipelined step])."""
        return self.loop.pipeline_step(inputs, targets, accumulate)

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self.loop.pipelined_backward():  # the schedule ran it ([Note: the pipelined step])
            return
        with self.loop.backward():  # the gradient sync ends here, whatever the loss reached
            super().backward(tensor, module, *args, **kwargs)

    # -- Fabric's collectives: the failure path skips them; stage 3 serves evaluating peers first -
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return  # [Note: failure path]: the peers are not coming
        self.loop.serve_evaluating_peers()
        super().barrier(*args, **kwargs)

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self.loop.serve_evaluating_peers()
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        self.loop.serve_evaluating_peers()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.loop.serve_evaluating_peers()
        return super().broadcast(obj, src=src)

    # -- teardown -------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self.loop.remove_hooks()
        if self.loop.module is not None:
            unroute_load_state_dict(self.loop.module)
        save_error = self.run.teardown()  # the save in flight published (abandoned on the failure path)
        self._torn_down = True  # later saves: the full module and the closed engine's optimizer shards
        self.signals.forget_engine()
        # a SIGTERM after the last boundary is raised again, not swallowed ([Note: signal boundaries])
        self.signals.agreement.uninstall(deliver_pending=True)
        if self._previous_excepthook is not None:
            restore_excepthook(self._excepthook, self._previous_excepthook)
        self._previous_excepthook = None
        super().teardown()
        if save_error is not None:
            raise save_error

    def quiesce(self) -> None:
        """[Note: nothing running at exit] in ``runtime/run.py``: in-flight gathers waited, the watcher joined."""
        self.run.quiesce()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: "_StrategyRegistry") -> None:
        pass  # registered by lightning_zero._registry as "zero1"/"zero2"/"zero3"


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the engine keeps gradients local (``ForwardSteps.no_sync``)."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.strategy.loop.no_sync(module) if enabled else nullcontext()
