"""ZeroStrategy: Lightning glue around the ZeRO engine (launch, mesh, hooks, checkpoints).

Everything that moves tensors lives in ``zero/`` and ``tp/``; this file only decides *when*
Lightning's loop calls into them:

- ``setup``: broadcast the initial weights over dp, build the engine from the module and the
  optimizers of ``configure_optimizers`` (the optimizer objects are kept and re-pointed at the
  fp32 master shards, so LR schedulers keep working).
- ``block_backward_sync``: Lightning enters it on non-final micro batches of
  ``accumulate_grad_batches``; the engine then skips the gradient collective (stage 1).
- gradient clipping goes through the precision plugin to the engine's global-norm clipping.
- a failure on one rank: tell the others, then no collective ([Note: failure path] in
  ``runtime/failure.py``).

What builds the mesh, the engine and the failure channel is :class:`~lightning_zero.runtime.session.ZeroSession`,
shared with the Fabric door (``fabric/strategy.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generator, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig, knob_views
from lightning_zero.runtime.checkpoints import CheckpointLifecycle, storage_policy
from lightning_zero.runtime.session import SessionViews, ZeroSession
from lightning_zero.runtime.signals import AgreedStop
from lightning_zero.trainer._lightning_compat import optimizers_to_device
from lightning_zero.trainer.failure_path import FailureNotice, check_step_output, where
from lightning_zero.trainer.precision import to_zero_precision
from lightning_zero.trainer.signals import attach_scheduler_signals

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.runtime.restore import CheckpointRestore
    from lightning_zero.zero.waits import FailureChannel


@knob_views  # ``strategy.stage``, ``strategy.bucket_mb``, ...: read-only views of the one config object
class ZeroStrategy(SessionViews, DDPStrategy):
    """ZeRO data parallelism (stages 1-3) as a Lightning strategy.

    Args:
        <knobs>: every field of :class:`lightning_zero.config.ZeroConfig` (``stage``,
            ``bucket_mb``, ...), with its default; validated into :attr:`zero_config`, which the
            engine gets whole. Each knob is documented once, in ``ZeroConfig``; the ``Knobs``
            section at the end of this docstring is generated from there. ``strategy.<knob>``
            reads ``strategy.zero_config.<knob>``.
        wrap_policy: stage 3: ``(module, parent) -> bool`` choosing the gathered units; default:
            children of every ``nn.ModuleList`` (and of a ``ModuleDict``/``Sequential`` of repeated
            blocks), embeddings, and modules with parameters beside a block container
            (``zero/stage3/units.py``; docs/stage3.md).
        start_method: how Lightning starts local processes: ``"popen"`` (re-run the script, like
            ``ddp``), or ``"spawn"`` / ``"fork"`` / ``"forkserver"`` (multiprocessing, like
            ``ddp_spawn`` / ``ddp_fork``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's ``DDPStrategy``.

    [Note: why DDPStrategy is the base] Lightning's own FSDP and model-parallel strategies derive
    from ``ParallelStrategy``; this one derives from ``DDPStrategy`` on purpose, because ZeRO *is*
    data parallelism and everything DDP does besides wrapping the module is what we need, unchanged:
    the launchers (``popen`` re-runs the script per local rank, ``spawn``/``fork``), torchrun and
    SLURM cluster environments, ``setup_distributed`` with the backend choice and ``timeout``,
    ``set_world_ranks``, ``distributed_sampler_kwargs``, ``barrier``/``broadcast``/``reduce``,
    ``model_to_device``, ``on_exception`` and ``teardown``, plus Lightning's accumulation contract
    (``block_backward_sync`` on non-final micro batches). What DDP adds and this class replaces:
    ``configure_ddp`` (no ``DistributedDataParallel`` wrapper: the engine's hooks reduce),
    ``block_backward_sync`` (the engine's ``no_sync``), ``setup`` (engine, precision) and the
    checkpoint methods; DDP's comm hooks and model averaging are never reached because no DDP
    module is ever built.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = ZERO_DEFAULTS.stage,
        tensor_parallel_size: Union[int, Literal["auto"]] = ZERO_DEFAULTS.tensor_parallel_size,
        sequence_parallel: bool = ZERO_DEFAULTS.sequence_parallel,
        bucket_mb: Union[float, Literal["auto"]] = ZERO_DEFAULTS.bucket_mb,
        overlap_comm: bool = ZERO_DEFAULTS.overlap_comm,
        prefetch_blocks: int = ZERO_DEFAULTS.prefetch_blocks,
        offload_optimizer: bool = ZERO_DEFAULTS.offload_optimizer,
        defer_grad_reduce: bool = ZERO_DEFAULTS.defer_grad_reduce,
        exact_grad_norm: bool = ZERO_DEFAULTS.exact_grad_norm,
        max_buckets_in_flight: int = ZERO_DEFAULTS.max_buckets_in_flight,
        monitor: bool = ZERO_DEFAULTS.monitor,
        collective_timeout: Optional[float] = ZERO_DEFAULTS.collective_timeout,
        overlap_param_gather: bool = ZERO_DEFAULTS.overlap_param_gather,
        grad_comm_dtype: Optional[str] = ZERO_DEFAULTS.grad_comm_dtype,
        param_comm_dtype: Optional[str] = ZERO_DEFAULTS.param_comm_dtype,
        shard_size: Optional[Union[int, Literal["node"]]] = ZERO_DEFAULTS.shard_size,
        hierarchical_reduce: bool = ZERO_DEFAULTS.hierarchical_reduce,
        wrap_policy: Optional[Any] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        reduce_dtype: Literal["compute", "bf16", "fp32"] = ZERO_DEFAULTS.reduce_dtype,
        master_weights: Literal["auto", "fp32"] = ZERO_DEFAULTS.master_weights,
        mixed_params: Literal["auto", "fp32", "half"] = ZERO_DEFAULTS.mixed_params,
        async_checkpoint: bool = ZERO_DEFAULTS.async_checkpoint,
        storage_options: Optional[dict] = ZERO_DEFAULTS.storage_options,
        upload_threads: int = ZERO_DEFAULTS.upload_threads,
        upload_stall_s: float = ZERO_DEFAULTS.upload_stall_s,
        cp: int = ZERO_DEFAULTS.cp,
        ep: int = ZERO_DEFAULTS.ep,
        pp: int = ZERO_DEFAULTS.pp,
        pp_schedule: str = ZERO_DEFAULTS.pp_schedule,
        pp_virtual_stages: int = ZERO_DEFAULTS.pp_virtual_stages,
        pp_layers: Optional[list[int]] = ZERO_DEFAULTS.pp_layers,
        pp_microbatches: Optional[int] = ZERO_DEFAULTS.pp_microbatches,
    ) -> None:
        # Validates every knob (the one validator, shared with the Hydra schema and the planner).
        knobs = {name: value for name, value in locals().items() if name in ZERO_DEFAULTS.as_dict()}
        self.zero_config = ZeroConfig(**knobs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        # mesh, engine, failure channel, counter: the runtime both doors share (runtime/session.py)
        self.session = ZeroSession(self.zero_config, wrap_policy)
        self._restore: Optional["CheckpointRestore"] = None  # a checkpoint load across Lightning's three calls
        # every save from request to link ([Note: checkpoint lifecycle] in runtime/checkpoints.py)
        self.checkpoints = CheckpointLifecycle(
            async_checkpoint=self.zero_config.async_checkpoint, stall_s=self.zero_config.collective_timeout,
            failed=lambda: self.session.failed, is_global_zero=lambda: self.is_global_zero,
            storage=storage_policy(self.zero_config),
        )  # fmt: skip
        self._signals: Any = None  # trainer/signals.py's SchedulerSignals of the running entry point
        self._state_dict_hooks: list[Any] = []  # ZeroSession.serve_full_state_dicts', removed at teardown

    # -- precision ------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = to_zero_precision(Precision(), self.zero_config)
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning sets the plugin built from Trainer(precision=...) here, at construction:
        # unsupported precisions fail now, before any process starts.
        self._precision_plugin = to_zero_precision(precision_plugin, self.zero_config)

    @property
    def precision_policy(self) -> "PrecisionPolicy":
        """Where each byte lives under the chosen precision (``precision.py``)."""
        return self.precision_plugin.policy  # type: ignore[attr-defined]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision_policy.compute_dtype

    # -- what the session holds (runtime/session.py) ---------------------------------------------
    @property
    def comm_counter(self) -> "CommCounter":
        """Logical bytes sent by the engine (dp) and by tensor-parallel layers (tp), per kind."""
        return self.session.comm_counter

    @property
    def failure_channel(self) -> Optional["FailureChannel"]:
        """[Note: failure path] in runtime/failure.py."""
        return self.session.failure_channel

    @property
    def wrap_policy(self) -> Optional[Any]:
        return self.session.wrap_policy

    @property
    def _dims(self) -> Any:
        return self.session.dims

    @override
    def _configure_launcher(self) -> None:
        from lightning_zero.trainer.checkpoints import resolving_launcher

        # DDPStrategy's launchers, each restoring moved-aside checkpoints before Lightning resolves
        # ckpt_path="last" (trainer/checkpoints.py)
        self._launcher = resolving_launcher(self, self._start_method)

    # -- mesh -----------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``("dp", "tp")`` mesh when ``tensor_parallel_size > 1`` (else ``None``)."""
        return self.session.device_mesh

    @override
    def setup_environment(self) -> None:
        # raises on a bad layout before any process group starts
        self.session.plan_layout(num_nodes=self.num_nodes, num_processes=self.num_processes,
                                 module=self.lightning_module)  # fmt: skip
        super().setup_environment()  # starts the process group
        self.session.start(self.root_device.type)
        # [Note: the parallelize registry]: the LightningModule applies the layout to the model it builds
        from lightning_zero.runtime.parallelize import hand_over

        hand_over(self.lightning_module, self.session.parallel_plan())
        if self.device_mesh is not None:
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self.device_mesh

    # -- failures ([Note: failure path] in runtime/failure.py) -----------------------------------
    def _note_failure(self, exception: BaseException) -> None:
        if isinstance(exception, AgreedStop):
            return  # every rank agreed to exit here: not a failure ([Note: signal boundaries])
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self.session.note_failure(exception, where(trainer if trainer is not None and trainer.state else None))

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._note_failure(exception)  # FailureNotice did, unless the failure came before setup
        super().on_exception(exception)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self.failed:
            return  # [Note: failure path]: the peers are not coming
        super().barrier(name)

    # -- setup ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        # bf16-true/16-true: the whole module in the half dtype, as ddp converts it (the -mixed
        # plugins leave the casting to the engine, which takes the fp32 masters first)
        self.model = self.precision_plugin.convert_module(self.model)
        # every dp rank starts from the weights of dp rank 0 (as DDP does at construction)
        self.session.prepare_module(self.model, self.root_device, ranks_per_node=self.num_processes)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        if fitting or self.zero_config.stage == 3:
            self._build_engine(self.optimizers if fitting else [])
        self.session.start_pipeline(self.lightning_module, self.root_device)  # pp > 1 ([Note: the pipelined step])
        # [Note: full state dicts] in checkpoint/full.py: self.state_dict() while the engine runs hands
        # out ddp's values (stage 3: gathered; bf16-mixed: the fp32 masters), as the Fabric door does
        self._remove_state_dict_hooks()
        self._state_dict_hooks = self.session.serve_full_state_dicts(self.lightning_module,
                                                                     self.precision_policy.ddp_dtype)  # fmt: skip
        if fitting:
            # state the engine put beside the host masters (offload_optimizer; Adagrad creates it in
            # __init__) stays on the host: moving it to the device would break the first step
            on_host = (
                {id(s.optimizer) for s in self.engine.optimizers if s.offload is not None} if self.engine else set()
            )
            optimizers_to_device([opt for opt in self.optimizers if id(opt) not in on_host], self.root_device)
        self.setup_precision_plugin()
        if fitting and self.monitor:
            self._attach_monitor(trainer)
        if fitting and self.engine is not None and self.engine.param_gatherer is not None:
            from lightning_zero.trainer.gather_barrier import ParamGatherBarrier

            # first, so no user hook between steps reads parameters still being gathered
            trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, ParamGatherBarrier)]
            trainer.callbacks.insert(0, ParamGatherBarrier(self._wait_param_gathers))
        # first of all, so the failure is posted before any other on_exception hook runs
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, FailureNotice)]
        trainer.callbacks.insert(0, FailureNotice(self._note_failure))
        # [Note: signal boundaries] in runtime/signals.py: every entry point, not only fit
        self._signals = attach_scheduler_signals(
            trainer, engine=self.engine, markers_cover_world=self.session.dense_size(self.world_size) == self.world_size
        )
        self._signals.closes_eval_loops = True  # after stage 3's ranks served each other (_end_eval_loop)
        if fitting:  # [Note: checkpoint lifecycle] in runtime/checkpoints.py
            from lightning_zero.trainer.checkpoints import checkpoint_directories, route_links

            self.checkpoints.clean(checkpoint_directories(trainer), lambda: self.barrier("lightning_zero-leftovers"))
            route_links(trainer, self.checkpoints)
            self.checkpoints.open()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Stage 3: configure_model builds on the meta device; setup materializes one unit at a time.
        if self.zero_config.stage == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    @override
    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: the engine reduces
        pass

    def _build_engine(self, optimizers: list) -> None:
        assert self.lightning_module is not None
        engine = self.session.build_engine(self.lightning_module, optimizers, precision=self.precision_policy,
                                           device=self.root_device, ranks_per_node=self.num_processes)  # fmt: skip
        self.precision_plugin.engine = engine  # type: ignore[attr-defined]

    def _attach_monitor(self, trainer: "pl.Trainer") -> None:
        from lightning_zero.trainer.monitor import ZeroMonitor

        if not any(isinstance(callback, ZeroMonitor) for callback in trainer.callbacks):
            trainer.callbacks.append(ZeroMonitor())

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.engine is None:
            yield None
            return
        with self.engine.no_sync():
            yield None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.session.pipelined_backward():  # the schedule ran it ([Note: the pipelined step])
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # -- gradient sync: always finished after a backward ([Note: end of backward], reducer.py) --
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.engine is not None:
            self.engine.pre_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self.engine is not None:
            self.engine.post_backward()

    # -- the phase of every step (stage 3 gathers by it: [Note: phases] in zero/stage3/runtime.py)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().training_step(*args, **kwargs)
        self.engine.begin_step("train")
        try:
            with self.session.stepping(self.lightning_module, self.lightning_module.trainer.accumulate_grad_batches):
                output = super().training_step(*args, **kwargs)
            check_step_output(output, self.lightning_module, world_size=self.world_size, global_rank=self.global_rank)
            module = self.lightning_module
            if module is not None and not module.automatic_optimization:
                self.engine.check_manual_train_step()
            return output
        except BaseException as exception:
            self._note_failure(exception)
            raise
        finally:
            self.engine.end_step_call()  # the step's backward may still follow (automatic optimization)

    def _eval_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            with self.session.stepping(self.lightning_module):
                return step(*args, **kwargs)
        self.engine.begin_step("eval")
        try:
            with self.session.stepping(self.lightning_module):
                output = step(*args, **kwargs)
        except BaseException as exception:
            self._note_failure(exception)  # and no end_eval_step: it gathers what the schedule still expects
            raise
        self.engine.end_eval_step()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, *args, **kwargs)

    def _wait_param_gathers(self) -> None:
        # [Note: overlapped parameter gather] in zero/param_gather.py: parameters whole again.
        if self.engine is not None:
            self.engine.wait_param_gathers()

    @override
    def on_validation_start(self) -> None:
        self._wait_param_gathers()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._wait_param_gathers()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._wait_param_gathers()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._wait_param_gathers()
        self.wait_for_checkpoint()  # [Note: background saves]: the end of fit leaves `last` complete
        super().on_train_end()

    def _end_eval_loop(self) -> None:
        # Ranks with fewer evaluation batches serve the others' all-gathers until all are done.
        if self.engine is not None:
            self.engine.end_eval_loop()
        # then every rank is here: the loop's last signal boundary ([Note: signal boundaries])
        if self._signals is not None and self.lightning_module is not None:
            self._signals.end_eval_loop(self.lightning_module.trainer)

    @override
    def on_validation_end(self) -> None:
        self._end_eval_loop()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._end_eval_loop()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._end_eval_loop()
        super().on_predict_end()

    @override
    def teardown(self) -> None:
        # [Note: checkpoint lifecycle]: `last` published, or left as it was; a failed save raised after the teardown
        save_error = self.checkpoints.close()
        # Leave the module usable outside the Trainer (forward, state_dict): full parameters, fp32
        # under bf16-mixed as under ddp; on the failure path without the collectives.
        self.session.close_engine(self.global_rank)
        self.session.close()
        self._remove_state_dict_hooks()
        super().teardown()
        if save_error is not None:
            raise save_error

    def _remove_state_dict_hooks(self) -> None:
        for handle in self._state_dict_hooks:
            handle.remove()
        self._state_dict_hooks = []

    # -- checkpoints (strategy_checkpoint.py; the logic in checkpoint/) -------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (masters, optimizer shards) must exist before a load

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # tensors are written shard by shard in save_checkpoint, never gathered

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # likewise: each rank writes the optimizer state it owns

    def _checkpoint_layout(self) -> Any:
        precision = getattr(self.precision_plugin, "precision", str(self.compute_dtype))
        return self.session.checkpoint_layout(world_size=self.world_size, global_rank=self.global_rank,
                                              precision=precision)  # fmt: skip

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        from lightning_zero.checkpoint.objstore import is_url

        if storage_options is not None and not is_url(filepath):
            raise TypeError(f"ZeroStrategy.save_checkpoint(storage_options={storage_options!r}): options for object"
                            f" storage, and {str(filepath)!r} is a local path; pass them with a URL (s3://...).")  # fmt: skip
        assert self.lightning_module is not None
        if self.failed:  # [Note: failure path]: ModelCheckpoint(save_on_exception=True), or a save after it
            what = (f"the checkpoint {str(filepath)!r} was not saved (a sharded checkpoint needs every rank); the"
                    " last complete checkpoint is still the newest")  # fmt: skip
            self.session.warn_failed(self.global_rank, what)
            return
        self._wait_param_gathers()
        # after fit, validate, test or predict the optimizers' state is where fit's engine left it
        # ([Note: optimizer state after the loop] in zero/flat.py): such a save holds what ddp's holds
        self.checkpoints.save(filepath, checkpoint, step=(checkpoint.get("epoch"), checkpoint.get("global_step")),
                              module=self.lightning_module, engine=self.engine, optimizers=self.optimizers,
                              layout=self._checkpoint_layout(), storage_options=storage_options,
                              optimizer_shards=self.session.optimizer_shards(self.optimizers))  # fmt: skip

    def save_hf_pretrained(self, path: Any, *, dtype: Optional[str] = None, max_shard_size: Any = "50GB") -> Any:
        """Write the model as a Hugging Face directory at ``path`` with no gather: every rank writes
        the bytes of the tensors it holds into their place in the ``model-0000k-of-0000n.safetensors``
        files ``save_pretrained`` would write ([Note: no-gather Hugging Face export] in
        ``checkpoint/hf_write.py``). Call it on every rank (a collective), e.g. from ``on_train_end``.
        ``dtype``: ``fp32``, ``bf16``, ``fp16`` or ``None`` (the fp32 masters); ``max_shard_size``
        as transformers counts it (``5GB`` = 5 * 10^9 bytes, default transformers 5's ``50GB``)."""
        from lightning_zero.checkpoint.hf_write import save_hf_pretrained

        assert self.lightning_module is not None
        if self.failed:  # [Note: failure path]: it needs every rank
            raise RuntimeError(f"ZeroStrategy.save_hf_pretrained({str(path)!r}): a rank failed; not written")
        self._wait_param_gathers()
        return save_hf_pretrained(path, module=self.lightning_module, engine=self.engine,
                                  layout=self._checkpoint_layout(), dtype=dtype, max_shard_size=max_shard_size,
                                  storage=self.checkpoints.storage)  # fmt: skip

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Optional[Any] = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.zero_config.async_checkpoint and not self.checkpoints.prepared:
            self._prepare_saves()
        return output

    def _prepare_saves(self) -> None:
        """[Note: host buffers before the first save] in checkpoint/background.py: once the optimizer
        state exists (a skipped first step, 16-mixed's overflow, has none yet: the next one then)."""
        from lightning_zero.checkpoint.background import live_tensors

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        callbacks = trainer.checkpoint_callbacks if trainer is not None else []
        with_optimizer = not callbacks or not all(getattr(cb, "save_weights_only", False) for cb in callbacks)
        if with_optimizer and not any(opt.state for opt in self.optimizers):
            return
        self._wait_param_gathers()
        self.checkpoints.prepare(live_tensors(module=self.lightning_module, engine=self.engine,
                                              optimizers=self.optimizers, layout=self._checkpoint_layout(),
                                              with_optimizer=with_optimizer))  # fmt: skip

    def wait_for_checkpoint(self) -> None:
        """Until a background save in flight is published ([Note: checkpoint lifecycle]); raises its error."""
        self.checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        from lightning_zero.runtime.restore import CheckpointRestore

        # the save in flight published; a checkpoint a killed publish moved aside back before it is read
        self.checkpoints.before_load(checkpoint_path, lambda: self.barrier("lightning_zero-leftovers"))
        self._restore = CheckpointRestore(checkpoint_path, self._checkpoint_layout(), self.checkpoints.storage)
        return self._restore.lightning_dict()

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._restore is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        assert self.lightning_module is not None
        self._restore.load_model(self.lightning_module, engine=self.engine, optimizers=self.optimizers,
                                 layout=self._checkpoint_layout(), strict=strict)  # fmt: skip

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._restore is None:
            return super().load_optimizer_state_dict(checkpoint)
        self._restore.load_optimizers(self.optimizers)
        self._restore = None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # once the newer one is published ([Note: checkpoint lifecycle])
            self.checkpoints.remove(filepath)
