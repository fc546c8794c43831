"""ZeroFabricStrategy: the ZeRO engine behind Lightning Fabric (``L.Fabric(strategy="zero3")``).

A thin door over the runtime both doors share (:class:`~lightning_zero.runtime.session.ZeroSession`:
layout, groups, failure channel, engine, checkpoint layout); this file only decides *when* Fabric's
calls reach it:

- ``setup_environment``: the layout is checked before the process group starts, the session
  starts after it (as under the Trainer).
- ``setup_module``: the module on the device (meta tensors stay), every dp rank with dp rank 0's
  weights; ``setup_optimizer`` records the optimizer. The engine is built over the module and
  every optimizer set up so far at the first call that needs it (the first forward, a
  ``fabric.load``, a save), so both ``fabric.setup(model, opt)`` and LitGPT's order
  (``fabric.setup(model)``, the optimizer over ``model.parameters()``, then
  ``fabric.setup_optimizers(opt)``) build one engine with every optimizer.
- ``module_init_context`` (``fabric.init_module()``): under stage 3 the model is built on the meta
  device and the engine materializes it one unit at a time (``zero/stage3/init.py``), as the
  Trainer's ``configure_model`` path does.
- step boundaries come from the calls the user makes ([Note: Fabric step boundaries]).
- ``fabric.backward`` finishes the gradient sync; ``no_backward_sync`` is the engine's ``no_sync``;
  ``clip_gradients`` clips by the global norm over the shards.
- precision: Fabric's plugin, mapped to the engine's policy in ``fabric/precision.py``; under
  ``16-mixed`` the gradient shards are unscaled and the overflow agreed over every rank before
  ``clip_gradients`` clips or the plugin's ``optimizer_step`` steps ([Note: Fabric loss scaling]).
- ``fabric.save``/``fabric.load``: the sharded checkpoint of ``checkpoint/`` (atomic, resumable on
  another dp size or stage), or one full file with ``state_dict_type="full"`` (``fabric/checkpoint.py``);
  ``load_raw`` and a set-up model's ``load_state_dict`` write a full state dict through to the
  shards and masters ([Note: full state dicts] in ``checkpoint/full.py``).
- a failure: [Note: failure path] in ``runtime/failure.py``; a rank whose script ends with an
  exception posts it from ``sys.excepthook`` (Fabric has no exception hook of its own).

[Note: Fabric step boundaries] The Trainer names each step through its hooks; under Fabric the
set-up model's forward does:

- a forward with grad enabled, when no training step is open, opens one (``begin_step("train")``);
  forwards before the backward belong to it; ``fabric.backward`` ends it (and with it the gradient
  sync). Each micro batch of a ``no_backward_sync`` loop is one such step, as under the Trainer's
  ``accumulate_grad_batches``. ``optimizer.step()`` frees every gathered unit (stage 3).
- a forward under ``torch.no_grad()`` / ``torch.inference_mode()`` outside a training step is one
  evaluation step (``begin_step("eval")`` ... ``end_eval_step()``): stage 3 gathers along the
  recorded evaluation schedule and frees everything after it. Token-by-token generation is one
  evaluation step per forward. Every rank must run the same number of such forwards.
- a grad-disabled forward inside an open training step (an EMA teacher) follows
  [Note: no_grad forwards in a training step] in ``zero/stage3/runtime.py``.

[Note: context parallelism under Fabric] With ``cp=C`` a Fabric loop, which holds whole batches,
changes one line:

- ``fabric.setup(model)`` makes the model's decoder context-parallel over the cp group
  (``cp/parallelize.py``: Ulysses all-to-alls around attention, rotary at global positions, and
  ``loss_fn`` the mean over the cp group's tokens, [Note: global token mean] in ``cp/loss.py``),
  before anything is broadcast or sharded; a model that does not declare it can
  (``check_parallel_dims``: ``Llama`` does) is refused there, naming cp.
- the loop cuts each batch: ``inputs, targets = fabric.strategy.context_slice(inputs, targets)``
  ([Note: slicing a whole batch] in ``cp/batch.py``: labels shifted before the cut, so a slice's
  last label is the next slice's first token). ``fabric.setup_dataloaders`` already gives the cp
  ranks of one dp rank the same batches (the sampler's replicas are the dp ranks).
- ``model.loss_fn(logits, targets)`` is the unsliced loss on every cp rank; the engine averages
  gradients over the ``dp x cp`` ranks. Losses and weights equal Fabric ``ddp``'s without cp.

Why the loop cuts the batch, not the model's forward: a forward hook could cut the input ids, but
the logits would come back ``T/cp`` long beside labels ``T`` long, so the loop would cut its labels
anyway, or the door would have to gather the logits over cp (``B x T x vocab``, the largest
activation of all: what cp exists to avoid). One explicit cut, the same for every tensor of the
batch, is exact and shows in the loop. The model config and ``seq_len`` given to the constructor
are checked before any process starts; the model's own check runs at ``fabric.setup``, the
sequence length's at each cut (both on every rank, before any collective that could hang).

[Note: expert parallelism under Fabric] With ``ep=E`` the loop of a ``MoETransformer``
(``lightning_zero.models.moe``) changes nothing but the bias update's group:

- ``fabric.setup(model, optimizer)`` splits the experts of the whole model every rank built (the
  same seed on every rank, as under ddp): each keeps ``n_experts / E`` rows of every stacked expert
  tensor, in place, so an optimizer built over ``model.parameters()`` before ``setup`` steps them,
  and its MoE layers exchange tokens over the ep group (``models/moe/parallelize.parallelize_experts``,
  the call ``MoELM.configure_model`` makes under the Trainer; ``ep/dispatch.py``). The model's
  ``check_parallel_dims`` refuses an ``ep`` that does not divide the experts, naming the fix.
  A model that splits its own experts (no whole ``MoETransformer`` inside) is left as it is.
- the loss is ``model.loss_fn(logits, targets) + model.aux_loss()``, as under ddp: each rank's
  balance and z losses are over its own tokens, and the gradients are averaged as ddp's.
- with a selection-bias update (``bias_update_rate > 0``), ``model.update_router_bias(group)``
  after ``optimizer.step()``: ``group`` the strategy's ``mesh_groups.dp_cp`` (``None`` under ddp).
"""

from __future__ import annotations

import atexit
import sys
import warnings
import weakref
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.destinations import location, parent_of
from lightning_zero.checkpoint.objstore import is_url
from lightning_zero.config import ZeroConfig, knob_views
from lightning_zero.cp.layout import check_context_parallel, layout_notice
from lightning_zero.fabric._compat import (
    install_excepthook,
    restore_excepthook,
    route_load_state_dict,
    unroute_load_state_dict,
)
from lightning_zero.fabric.precision import policy_of, unscale_agreed
from lightning_zero.runtime.checkpoints import CheckpointLifecycle, storage_policy
from lightning_zero.runtime.monitor import Monitor
from lightning_zero.runtime.session import SessionViews, ZeroSession
from lightning_zero.runtime.signals import AgreedSignals, SignalBoundary, requeue_slurm_job

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

    from lightning_zero.fabric.checkpoint import FabricState
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.zero.engine import ZeroEngine


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


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@knob_views  # ``strategy.stage``, ``strategy.bucket_mb``, ...: read-only views of the one config object
class ZeroFabricStrategy(SessionViews, DDPStrategy):
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
    zero_config)`` is the Trainer strategy's configuration) and the one runtime both call.
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
        # [Note: context parallelism under Fabric]: what is known of the model and the data is
        # checked now, before any process starts (the model itself arrives after the launch)
        notice = layout_notice(check_context_parallel(self.zero_config.cp, model_config=model_config, seq_len=seq_len))
        if notice is not None:
            warnings.warn(f"lightning_zero: {notice}", stacklevel=2)
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
        self.session = ZeroSession(self.zero_config, wrap_policy)
        # every save from request to publish ([Note: checkpoint lifecycle] in runtime/checkpoints.py)
        self.checkpoints = CheckpointLifecycle(
            async_checkpoint=self.zero_config.async_checkpoint, stall_s=self.zero_config.collective_timeout,
            failed=lambda: self.session.failed, is_global_zero=lambda: self.is_global_zero,
            storage=storage_policy(self.zero_config),
        )  # fmt: skip
        self._module: Optional[nn.Module] = None
        self._optimizers: list[Optimizer] = []
        self._train_step_open = False
        self._eval_forward = False
        self._steps = 0  # optimizer steps taken (for the failure path's "training step N")
        self.overflows: list[tuple[bool, bool]] = []  # 16-mixed, per step: (this rank's shard, any rank's)
        self._hooks: list[Any] = []
        self._after_forward_hook: Optional[Any] = None
        # id(stand-in) -> (stand-in, meta parameter): [Note: stand-ins for meta parameters]
        self._meta_parameters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._previous_excepthook: Optional[Callable[..., Any]] = None
        self._init_rng: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self._init_record: Optional[Any] = None  # [Note: deferred init] in zero/stage3/deferred.py
        self._exit_hook = False  # [Note: nothing running at exit]
        # per optimizer, per param group: the parameter names in the user's order ([Note: full optimizer state])
        self._param_names: list[list[list[str]]] = []
        # [Note: signal boundaries] in runtime/signals.py: the loop asks scheduler_signals() once per step
        self.signals = SignalBoundary()
        # [Note: the monitor] in runtime/monitor.py: measured at the forward pre-hook and the step hook
        self.step_monitor: Optional[Monitor] = Monitor() if self.zero_config.monitor else None
        self._report: Any = None  # the Fabric whose log_dict gets the monitor's metrics (report_to)
        self._torn_down = False

    # -- precision (fabric/precision.py) --------------------------------------------------------
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # unsupported precisions fail now, before any process starts (Fabric's connector sets the
        # plugin after __init__; a strategy built without zero_config gets the knobs' defaults)
        policy_of(precision, self.__dict__.get("zero_config"))
        self._precision = precision

    @property
    def precision_policy(self) -> "PrecisionPolicy":
        """Where each byte lives under Fabric's precision plugin and the knobs (``fabric/precision.py``)."""
        return policy_of(self._precision, self.zero_config)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision_policy.compute_dtype

    # -- environment ----------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # raises on a bad layout before any process group starts
        self.session.plan_layout(num_nodes=self.num_nodes, num_processes=self.num_processes, module=None)
        super().setup_environment()  # starts the process group
        self.session.start(self.root_device.type)
        self.checkpoints.open()  # async_checkpoint: fabric.save writes in the background from now on
        self._install_signal_handlers()
        if self._previous_excepthook is None:  # [Note: replaced attributes at the Fabric door]
            self._previous_excepthook = install_excepthook(self._excepthook)
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(_quiesce_at_exit, weakref.ref(self))

    def _where(self) -> str:
        return f"training step {self._steps + 1}"

    def _excepthook(self, kind: type, exception: BaseException, trace: Any) -> None:
        """[Note: failure path]: a script that ends with an exception posts it first."""
        self.session.note_failure(exception, self._where())
        previous = self._previous_excepthook or sys.__excepthook__
        previous(kind, exception, trace)

    def note_failure(self, exception: BaseException) -> None:
        """Tell the other ranks that this rank failed with ``exception`` (for loops that catch
        their exceptions themselves; an uncaught one is posted by ``sys.excepthook``)."""
        self.session.note_failure(exception, self._where())

    @contextmanager
    def _noting_failures(self) -> Generator[None, None, None]:
        try:
            yield
        except BaseException as exception:
            self.note_failure(exception)
            raise

    # -- module and optimizers ------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """[Note: stage 3 init under Fabric] ``init_module(empty_init=True)`` gives, at every stage, the
        values eager construction gives (Fabric ddp with ``empty_init=False``, same seed), and leaves
        the caller's RNG stream where that eager run leaves it. Stages 1-2 hold the whole model on
        every rank anyway: they build it eagerly (ddp's ``empty_init`` would leave the tensors a
        checkpoint does not hold -- LoRA's, an adapter's -- uninitialized memory). Stage 3 builds on
        the meta device, recording every initializer as it runs, in construction and after it
        (LitGPT's ``reset_parameters(model)``), each random one with the RNG state of its own call;
        the engine materializes one unit at a time and replays them ([Note: deferred init] in
        ``zero/stage3/deferred.py``). Tensors no recorded op made (rare: a buffer recomputed by
        factory calls after construction) get the module's own initializers ([Note: buffer init]),
        drawing from a fork of the RNG state at ``init_module``'s exit. Without ``empty_init``
        (``None`` or ``False``) the module is built for real and sharded at setup."""
        if self.zero_config.stage != 3 or not empty_init:
            return super().module_init_context(empty_init=False)
        from lightning_zero.zero.stage3.deferred import InitRecord

        self._init_record = InitRecord(self.root_device)
        stack = ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(self._init_record.building())
        stack.callback(self._remember_init_rng)
        return stack

    def _remember_init_rng(self) -> None:
        device = self.root_device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._init_rng = (torch.get_rng_state(), cuda)

    @contextmanager
    def _init_rng_stream(self) -> Generator[None, None, None]:
        """The fallback initializers draw from the RNG state ``init_module`` closed with, in a fork
        ([Note: stage 3 init under Fabric]); once. The record is closed after."""
        saved, self._init_rng = self._init_rng, None
        record, self._init_record = self._init_record, None
        try:
            if saved is None:
                yield
                return
            device = self.root_device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.set_rng_state(saved[0])
                if saved[1] is not None:
                    torch.cuda.set_rng_state(saved[1], device)
                yield
        finally:
            if record is not None:
                record.close()

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
        if self.session.pipeline_layout is not None:  # cut to this rank's stages: [Note: the pipelined step]
            from lightning_zero.runtime.pipeline import keep_stage_params

            keep_stage_params(optimizers, module)
        self._ensure_engine()
        self.session.start_pipeline(module, self.root_device)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._module is not None and self._module is not module:
            raise ValueError(
                "ZeroFabricStrategy: one model per strategy; fabric.setup was already called with another"
                f" {type(self._module).__name__}. Put the models in one nn.Module, or use one Fabric per model."
            )
        if self._module is None:
            # [Note: the parallelize registry] in runtime/parallelize.py: under Fabric the model arrives
            # after the launch, so the layout is checked against it and pushed into it here, before
            # anything is broadcast or sharded
            self._parallelize(module)
            self._module = module
            # every dp rank starts from the weights of dp rank 0 (as DDP does at construction)
            self.session.prepare_module(module, self.root_device, ranks_per_node=self.num_processes)
            # first of the module's forward pre-hooks (the engine's come after: [Note: Fabric step boundaries])
            # [Note: hooks under torch.compile] in zero/stage3/runtime.py: the engine is built (stage 3:
            # materialized) at the first forward, which must run eagerly, outside a compiled frame
            self._hooks.append(
                module.register_forward_pre_hook(torch.compiler.disable(self._before_forward), prepend=True)
            )
            # [Note: full state dicts]: load_state_dict on the set-up model writes through to the shards
            route_load_state_dict(module, self._load_module_state_dict)
            # stage 3 (and compute copies under -mixed, and tp-split parameters): model.state_dict() hands out
            # ddp's full values, gathered one parameter at a time (the Trainer door does the same, tp parts aside)
            self._hooks.extend(self.session.serve_full_state_dicts(module, self._value_dtype, dense=True))
            if not self._optimizers:
                self._stand_in_for_meta_parameters(module)
        return module

    # -- the layout pushed into the model ([Note: the parallelize registry]) ---------------------
    def _parallelize(self, module: nn.Module) -> None:
        """The layout's one check against the model, then each registered decoder inside it
        parallelized by its family's step (``runtime/parallelize.py``: tp, ep, cp in that order;
        context parallelism: [Note: context parallelism under Fabric]; experts: [Note: expert
        parallelism under Fabric]); the collectives count into the counter ``prepare_module`` adopts."""
        dims, groups = self.session.dims, self.session.groups
        if dims is None or groups is None:
            return
        from lightning_zero.runtime.parallelize import check_layout
        from lightning_zero.runtime.pipeline import pipeline_layout

        check_layout(dims, module)
        self.session.pipeline_layout = pipeline_layout(self.zero_config, dims, module)  # pp > 1: the checked split
        self.session.parallel_plan().apply(module)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """[Note: litdata's ranks] in ``fabric/_litdata_compat.py``: a litdata ``StreamingDataset``
        splits its items over the dp ranks, not over every process (the cp ranks of one dp rank
        read the same batches, as Fabric's sampler gives them)."""
        from lightning_zero.fabric._litdata_compat import split_streaming_over_dp

        dims = self.session.dims
        if dims is not None and dims.dp != self.world_size:
            split_streaming_over_dp(dataloader, dp_size=dims.dp, dp_rank=self.dp_rank, num_nodes=self.num_nodes)
        return super().process_dataloader(dataloader)

    @property
    def cp_rank(self) -> int:
        """This rank's index in its cp group (0 without context parallelism)."""
        dims = self.session.dims
        return 0 if dims is None else dims.group_rank("cp", self.global_rank)

    @property
    def cp_size(self) -> int:
        """Ranks that hold slices of the same sequences (the ``cp`` knob)."""
        return self.zero_config.cp

    def context_slice(self, *tensors: torch.Tensor, dim: int = 1) -> Any:
        """This rank's slice of a whole batch under context parallelism ([Note: context parallelism
        under Fabric]): each tensor (input ids, labels already shifted by one, a loss mask: all
        ``T`` long along ``dim``) cut at ``[c T/cp, (c+1) T/cp)`` for cp rank ``c``, as views
        ([Note: slicing a whole batch] in ``cp/batch.py``). One tensor in, one out; several in, a
        tuple. Without cp (``cp=1``) the tensors come back unchanged, so one loop serves both.
        A ``T`` that ``cp`` does not divide raises ``ValueError`` naming the fix (on every rank,
        before the step's first collective)."""
        from lightning_zero.cp.batch import context_slices

        sliced = context_slices(tensors, self.cp_size, self.cp_rank, dim)
        return sliced[0] if len(sliced) == 1 else sliced

    def _stand_in_for_meta_parameters(self, module: nn.Module) -> None:
        """[Note: stand-ins for meta parameters] LitGPT's order sets up a model built under
        ``init_module(empty_init=True)`` (stage 3: on the meta device) before its optimizer exists,
        and Fabric's ``setup_optimizers`` refuses an optimizer over meta parameters. Building the
        engine now would materialize the shards, and the optimizer's engine later would have to
        gather the whole model on every rank to rebuild. So each meta parameter gets a stand-in
        until the engine is built: a Parameter of the same shape, dtype and ``requires_grad`` on the
        device, one element broadcast (NaN for floats) -- no memory, and nothing that reads it can
        mistake it for weights. The optimizer is built over the stand-ins; :meth:`_restore_meta_parameters`
        puts the meta parameters back (in the module and in the optimizers' param groups) right
        before the engine materializes them, one unit at a time."""
        stand_ins: dict[int, nn.Parameter] = {}
        for child in module.modules():
            for key, param in child._parameters.items():
                if param is None or not param.is_meta:
                    continue
                stand_in = stand_ins.get(id(param))
                if stand_in is None:  # a tied parameter gets one stand-in
                    fill = float("nan") if param.is_floating_point() else 0
                    value = torch.full((), fill, dtype=param.dtype, device=self.root_device).expand(param.shape)
                    stand_in = stand_ins[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
                    self._meta_parameters[id(stand_in)] = (stand_in, param)
                child._parameters[key] = stand_in

    def _restore_meta_parameters(self) -> None:
        """Back from the stand-ins to the meta parameters ([Note: stand-ins for meta parameters])."""
        if not self._meta_parameters:
            return
        assert self._module is not None
        original = {key: param for key, (_, param) in self._meta_parameters.items()}
        for child in self._module.modules():
            for key, param in child._parameters.items():
                if param is not None and id(param) in original:
                    child._parameters[key] = original[id(param)]
        for optimizer in self._optimizers:
            if any(id(param) in original for param in optimizer.state):
                raise RuntimeError(
                    "ZeroFabricStrategy: the optimizer stepped before the model's first forward; run the model"
                    " (forward, fabric.backward) before optimizer.step()."
                )
            for group in optimizer.param_groups:
                group["params"] = [original.get(id(param), param) for param in group["params"]]
        self._meta_parameters.clear()

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._engine_has_optimizers() and optimizer not in self._optimizers:
            raise RuntimeError(
                f"ZeroFabricStrategy: {type(optimizer).__name__} was set up after the ZeRO engine was built (at"
                " the model's first forward, or fabric.load/save). Set up every optimizer before the first"
                " forward: fabric.setup(model, opt1, opt2) or fabric.setup_optimizers(opt1, opt2)."
            )
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
            optimizer.register_step_post_hook(self._count_step)
        return optimizer

    def _count_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is self._optimizers[0]:
            self._steps += 1
            if self.step_monitor is not None and self.engine is not None:
                self._monitor_step(self.engine)
            if self.zero_config.async_checkpoint and not self.checkpoints.prepared and self.engine is not None:
                self._prepare_saves(self.engine)

    def _prepare_saves(self, engine: "ZeroEngine") -> None:
        """[Note: host buffers before the first save] in checkpoint/background.py, as the Trainer door
        does: once the optimizer state exists (a skipped first step has none yet: the next one then),
        buffers shaped as what ``fabric.save`` of the model and its optimizers writes."""
        from lightning_zero.checkpoint.background import live_tensors

        if not any(opt.state for opt in self._optimizers):
            return
        engine.wait_param_gathers()
        self.checkpoints.prepare(live_tensors(module=self._module, engine=engine, optimizers=self._optimizers,
                                              layout=self._layout(), with_optimizer=True))  # fmt: skip

    # -- the monitor ([Note: the monitor] in runtime/monitor.py) --------------------------------
    def _monitor_step(self, engine: "ZeroEngine") -> None:
        assert self.step_monitor is not None
        metrics = self.step_monitor.step_end(engine, self._module)
        if self._report is not None:
            self._report.log_dict(metrics, step=self._steps)
        message = self.step_monitor.overlap_warning(engine, metrics, metrics["zero/comm_s"], self._steps)
        if message is not None and self.global_rank == 0:
            warnings.warn(message, stacklevel=2)

    def report_to(self, fabric: Any) -> None:
        """Log the monitor's metrics through ``fabric.log_dict`` after every optimizer step (the
        step number is the strategy's count of optimizer steps). Without it they are kept in
        ``step_monitor.history``; ``monitor_metrics()`` is the last step's."""
        if self.step_monitor is None:
            raise ValueError("ZeroFabricStrategy.report_to: the monitor is off (monitor=False)")
        self._report = fabric

    def monitor_metrics(self) -> dict[str, float]:
        """The monitor's metrics of the last optimizer step (``{}`` before the first, or when off)."""
        return (
            dict(self.step_monitor.history[-1]) if self.step_monitor is not None and self.step_monitor.history else {}
        )

    def _engine_has_optimizers(self) -> bool:
        return self.engine is not None and bool(self.engine.optimizers)

    def _ensure_engine(self) -> "ZeroEngine":
        """The engine over the set-up module and every optimizer set up so far (built once; an
        engine built without optimizers, for a forward before any optimizer was set up, is rebuilt
        with them: one full gather)."""
        engine = self.engine
        if engine is not None and (engine.optimizers or not self._optimizers):
            return engine
        if self._module is None:
            raise RuntimeError("ZeroFabricStrategy: set up the model first (fabric.setup(model, ...)).")
        if engine is not None:  # built for a forward without optimizers (stage 3): rebuilt with them
            engine.release_module()
        self._restore_meta_parameters()
        from lightning_zero.checkpoint.full_optimizer import record_param_names

        names = {id(param): name for name, param in self._module.named_parameters()}
        self._param_names = [record_param_names(optimizer, names) for optimizer in self._optimizers]
        with self._init_rng_stream():
            engine = self.session.build_engine(self._module, self._optimizers, precision=self.precision_policy,
                                               device=self.root_device, ranks_per_node=self.num_processes)  # fmt: skip
        # last of the module's forward hooks: a step closes after the engine's own hooks ran
        if self._after_forward_hook is not None:
            self._after_forward_hook.remove()
        self._after_forward_hook = self._module.register_forward_hook(
            torch.compiler.disable(self._after_forward), always_call=True
        )
        # the flags ride on the phase markers, which run over every rank (tp == 1): [Note: marker riders]
        self.signals.ride(engine, markers_cover_world=True)
        return engine

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
        return self.signals.after_steps(self._steps, self._signal_exchange)

    def _signal_exchange(self) -> Callable[[list[int]], list[int]]:
        steps = self._steps
        return self.signals.exchange(self.root_device, failure=self.session.failure_channel,
                                     where=lambda: f"the end of optimizer step {steps}")  # fmt: skip

    def requeue(self) -> int:
        """Every rank waits until a background save in flight is published (``async_checkpoint``:
        the scheduler may end the job right after; [Note: checkpoint lifecycle]), then global rank 0
        runs ``scontrol requeue <job>`` (its exit code; 0 on the other ranks)."""
        self.checkpoints.wait()
        return requeue_slurm_job() if self.global_rank == 0 else 0

    # -- step boundaries ([Note: Fabric step boundaries]) ---------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if _in_backward():
            return
        if self.engine is None and not self._optimizers and self.zero_config.stage != 3:
            return  # stages 1-2 without an optimizer: the module is whole on every rank, nothing to do
        engine = self._ensure_engine()
        if self._train_step_open:
            return
        if torch.is_grad_enabled():
            engine.begin_step("train")
            self._train_step_open = True
            if self.step_monitor is not None:
                self.step_monitor.micro_batch(engine, module, args, dims=self.session.dims)
        else:
            engine.begin_step("eval")
            self._eval_forward = True

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward() or self.engine is None:
            return
        if self._eval_forward:
            self._eval_forward = False
            self.engine.end_eval_step()
        elif self._train_step_open:
            self.engine.end_step_call()  # its backward follows

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulate: int = 1) -> torch.Tensor:
        """``pp > 1``, a hand loop's forward and backward of one batch through the pipeline: the
        schedule over ``inputs``' micro-batches (``pp_microbatches`` equal slices of dim 0) and the
        model's ``loss_fn`` against ``targets``; returns the batch's mean loss on every rank. Pass it
        to ``fabric.backward`` (which hands the schedule's gradients to the engine: once per step,
        or under ``fabric.no_backward_sync`` while accumulating), then step the optimizer. The
        gradients are those of ``loss / accumulate`` (dividing the returned loss changes nothing:
        the backward already ran). Under ``torch.no_grad()``: the forward only, for evaluation
        ([Note: the pipelined step])."""
        run = self.session.pipeline
        if run is None:
            raise RuntimeError("ZeroFabricStrategy.pipeline_step: set pp > 1 and fabric.setup(model, optimizer) first")
        with self._noting_failures():
            if torch.is_grad_enabled() and self.engine is not None:
                self.engine.begin_step("train")
                self._train_step_open = True
            run.grad_divisor = accumulate
            return run.loss(inputs, targets)

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        engine = self.engine
        if engine is None:
            return super().backward(tensor, module, *args, **kwargs)
        if self.session.pipeline is not None:  # the schedule ran it ([Note: the pipelined step])
            with self._noting_failures():
                self.session.pipelined_backward()
            self._train_step_open = False
            return None
        with self._noting_failures():
            engine.pre_backward()
            super().backward(tensor, module, *args, **kwargs)
            engine.post_backward()  # the gradient sync ends here, whatever the loss reached
        self._train_step_open = False

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shards; returns that norm (as
        ``torch.nn.utils.clip_grad_norm_`` does for the whole model). Under ``16-mixed`` the
        gradients are unscaled first, as Fabric does, with the global overflow decision
        ([Note: Fabric loss scaling] in ``fabric/precision.py``)."""
        total = self._unscale(optimizer).clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it"
                " cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway,"
                " set `error_if_nonfinite=False`"
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._unscale(optimizer).clip_grad_value_(float(clip_val))

    def _unscale(self, optimizer: Optimizer) -> Any:
        """``optimizer``'s sharded optimizer, its gradients unscaled (``16-mixed``, once per step) with
        the overflow agreed over every rank ([Note: Fabric loss scaling] in ``fabric/precision.py``)."""
        sharded = self._ensure_engine().sharded_optimizer(optimizer)
        with self._noting_failures():
            overflow = unscale_agreed(self._precision, optimizer, sharded)
        if overflow is not None:
            self.overflows.append(overflow)
        return sharded

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's plugin steps (``scaler.step`` / ``scaler.update`` under ``16-mixed``), after the
        unscale and the global overflow decision when ``clip_gradients`` did not make them."""
        if self.engine is not None and isinstance(optimizer, Optimizer) and optimizer in self._optimizers:
            self._unscale(optimizer)
        return super().optimizer_step(optimizer, **kwargs)

    # -- Fabric's collectives: the failure path skips them; stage 3 serves evaluating peers first -
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return  # [Note: failure path]: the peers are not coming
        self._serve_evaluating_peers()
        super().barrier(*args, **kwargs)

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self._serve_evaluating_peers()
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        self._serve_evaluating_peers()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._serve_evaluating_peers()
        return super().broadcast(obj, src=src)

    def _serve_evaluating_peers(self) -> None:
        """[Note: forwards on some ranks only] At stage 3 a forward needs every rank: the parameters
        are shards, each unit is all-gathered before it runs. LitGPT's fine-tuning scripts run
        ``generate_example`` (a forward per new token, under ``no_grad``) on rank 0 only, while the
        other ranks go on to ``fabric.barrier()`` (after validation) or ``fabric.all_reduce`` (when
        the last epoch ends); under Lightning's FSDP the other ranks' collective and rank 0's
        all-gathers never meet, and the run stalls until the process group's timeout. Here each of
        Fabric's collectives (``barrier``, ``all_reduce``, ``all_gather``, ``broadcast``) first takes
        part in the evaluation forwards other ranks still run, as a rank whose evaluation loop ended
        does (``engine.end_eval_loop``: one 16-byte exchange per call, and while a peer evaluates, the
        recorded evaluation schedule's all-gathers: ``Stage3Runtime.end_eval_loop``), and returns
        once every rank has arrived. A peer's forward must
        follow the recorded evaluation schedule (one forward on every rank first: LitGPT's
        ``validate`` runs before each ``generate_example``), else the serving ranks raise naming the
        fix. Skipped inside a training step (between its forward and ``fabric.backward``), where no
        rank evaluates; every rank takes the same decision, so the exchange itself always meets."""
        engine = self.engine
        if engine is None or engine.stage != 3 or self._train_step_open or self.failed or _in_backward():
            return
        with self._noting_failures():
            engine.end_eval_loop()

    # -- checkpoints ----------------------------------------------------------------------------
    def _layout(self) -> Any:
        return self.session.checkpoint_layout(world_size=self.world_size, global_rank=self.global_rank,
                                              precision=self.precision_policy.name)  # fmt: skip

    def _value_dtype(self, param: nn.Parameter) -> torch.dtype:
        """The dtype ddp holds ``param`` in ([Note: full state dicts]): ``PrecisionPolicy.ddp_dtype``."""
        return self.precision_policy.ddp_dtype(param)

    def _state_io(self) -> "FabricState":
        from lightning_zero.fabric.checkpoint import FabricState

        if self._torn_down:  # the module holds its full parameters, the optimizers' state stays sharded
            shards = self.session.optimizer_shards(self._optimizers)  # [Note: optimizer state after the loop]
            engine = None
        else:
            shards, engine = None, self._ensure_engine()
        assert self._module is not None
        return FabricState(self._module, self._optimizers, engine, self._layout(), param_names=self._param_names,
                           value_dtype=self._value_dtype, optimizer_shards=shards,
                           storage=self.checkpoints.storage)  # fmt: skip

    def _refuse_when_failed(self, what: str) -> None:
        """[Note: failure path]: a save or load that needs every rank raises, naming the failure."""
        if not self.failed:
            return
        channel = self.session.failure_channel
        peer = channel.peer_failure if channel is not None else None
        cause = f"global rank {peer[0]} failed" if peer is not None else "this rank failed"
        raise RuntimeError(
            f"lightning_zero (global rank {self.global_rank}): {cause}; {what} (it needs every rank). The last complete"
            " checkpoint is still the newest."
        )

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save``: sharded (default) or one torch file (``state_dict_type="full"``: what
        Fabric's ddp writes, optimizer state included); ``filter`` as Fabric's strategies take it, and
        a save with a filter is one file whatever the type ([Note: filtered saves are one file] in
        ``fabric/checkpoint.py``). A bad argument raises here and leaves the strategy usable; a save
        that cannot write raises."""
        if storage_options is not None and not is_url(path):
            raise TypeError(
                f"ZeroFabricStrategy.save(storage_options={storage_options!r}): options for object storage, and"
                f" {str(path)!r} is a local path; pass them with a URL (s3://...) or save without them."
            )
        self._refuse_when_failed(f"the checkpoint {str(path)!r} was not saved")
        state_io = self._state_io()
        full = self.state_dict_type == "full" or bool(filter)  # [Note: filtered saves are one file]
        state_io.check_save(state, filter, full=full)  # before any collective: refusing marks nothing failed
        with self._noting_failures():
            self.checkpoints.clean_once(parent_of(location(path)), self.barrier)  # what killed saves left there
            if full:
                state_io.save_full(location(path), state, self.checkpoints, filter, storage_options)
            else:
                state_io.save_sharded(path, state, self.checkpoints, step=self._steps,
                                      storage_options=storage_options)  # fmt: skip

    def save_hf_pretrained(self, path: Any, *, dtype: Optional[str] = None, max_shard_size: Any = "50GB") -> Any:
        """``fabric.strategy.save_hf_pretrained(OUT)``: the set-up model (a ``Llama``, any family) as a
        Hugging Face directory, written with no gather: each rank writes the ranges it holds into
        ``save_pretrained``'s files ([Note: no-gather Hugging Face export] in
        ``checkpoint/hf_write.py``). A collective: every rank calls it. ``dtype``: ``fp32``, ``bf16``,
        ``fp16`` or ``None`` (the fp32 masters)."""
        from lightning_zero.checkpoint.hf_write import save_hf_pretrained

        self._refuse_when_failed(f"the Hugging Face export {str(path)!r} was not written")
        engine = self._ensure_engine()
        engine.wait_param_gathers()
        with self._noting_failures():
            return save_hf_pretrained(path, module=self._module, engine=engine, layout=self._layout(), dtype=dtype,
                                      max_shard_size=max_shard_size, storage=self.checkpoints.storage)  # fmt: skip

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        self._refuse_when_failed(f"{str(path)!r} was not loaded")
        if self._torn_down:
            raise RuntimeError(
                f"ZeroFabricStrategy: fabric.load({str(path)!r}) after strategy.teardown(): the engine that held the"
                " shards is closed. Load into a new Fabric's set-up model and optimizers (as a resumed script does)."
            )
        state_io = self._state_io()
        with self._noting_failures():
            # the save in flight published; a checkpoint a killed publish moved aside back before it is read
            self.checkpoints.before_load(path, self.barrier)
            return state_io.load(path, state, strict=strict, weights_only=weights_only)

    def _load_module_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``model.load_state_dict`` on the set-up model: torch's own traversal, written through to
        the masters and the shards ([Note: torch's load traversal] in ``checkpoint/full.py``)."""
        from lightning_zero.checkpoint.full import load_full_state_dict

        assert self._module is not None
        engine = self._ensure_engine()
        return load_full_state_dict(self._module, engine, state_dict, strict=strict, assign=assign)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict on every rank, in the dtypes ddp holds: a collective, every rank calls it."""
        if self.engine is None:
            return super().get_module_state_dict(module)
        from lightning_zero.checkpoint.full import gather_full_state_dict

        return gather_full_state_dict(module, self.engine, self.engine.dp_group, value_dtype=self._value_dtype)

    # -- teardown -------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        for handle in [*self._hooks, self._after_forward_hook]:
            if handle is not None:
                handle.remove()
        self._hooks.clear()
        self._after_forward_hook = None
        if self._module is not None:
            unroute_load_state_dict(self._module)
        save_error = self.checkpoints.close()  # the save in flight published (abandoned on the failure path)
        self.session.close_engine(self.global_rank)
        self._torn_down = True  # later saves: the full module and the closed engine's optimizer shards
        self.session.close()
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
        """[Note: nothing running at exit] Wait for the collectives this rank still has in flight (the
        stage 1-2 parameter all-gathers launched after the last step) and stop the failure channel's
        watcher thread (joined). Teardown does it; so does interpreter exit for a script that never
        tears down (LitGPT's scripts do not)."""
        if self.engine is not None and not self.failed:
            try:
                self.engine.wait_param_gathers()
            except Exception:  # noqa: BLE001 - a peer is gone: nothing left to wait for
                pass
        channel = self.session.failure_channel
        if channel is not None:
            channel.stop_watching()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: "_StrategyRegistry") -> None:
        pass  # registered by lightning_zero._registry as "zero1"/"zero2"/"zero3"


def _quiesce_at_exit(strategy_ref: "weakref.ReferenceType[ZeroFabricStrategy]") -> None:
    """[Note: nothing running at exit] An ``atexit`` hook (registered after ``zero/waits.py``'s, so it
    runs first): the strategy's collectives finished and its watcher joined before the interpreter
    finalizes. A thread that is inside a C++ call then (a gloo collective, a store read) is ended by
    the finalizing interpreter mid-call: "terminate called without an active exception"."""
    strategy = strategy_ref()
    if strategy is not None:
        strategy.quiesce()


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the engine keeps gradients local (stage 1; stage 2 with
    ``defer_grad_reduce``; stage 2 otherwise reduce-scatters every micro batch, its memory promise)."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if module is not self.strategy._module:
            raise TypeError("no_backward_sync: pass the model set up with this strategy (fabric.setup's result).")
        if self.strategy.engine is None and not self.strategy._optimizers:
            warnings.warn("no_backward_sync before any optimizer was set up: nothing to skip", stacklevel=3)
            return nullcontext()
        return self.strategy._ensure_engine().no_sync()
