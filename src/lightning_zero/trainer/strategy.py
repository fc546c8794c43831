"""ZeroStrategy: the Trainer's door to the ZeRO runtime, a translation table from Lightning's hooks to the run's events.

Everything a run owns (mesh and groups, engine, checkpoint lifecycle, signals, monitor, failure
channel) is the run's (:class:`~lightning_zero.runtime.run.ZeroRun`, [Note: one runtime object]),
shared with the Fabric door (``fabric/strategy.py``); this file only decides *when* Lightning's loop
reaches it: ``setup_environment`` (layout, then groups), ``setup`` (module, optimizers of
``configure_optimizers`` -- kept and re-pointed at the fp32 master shards, so LR schedulers keep
working --, engine, and the callbacks of ``trainer/callbacks.py``), ``block_backward_sync`` (the
engine's ``no_sync`` on non-final micro batches), the step hooks, the checkpoint methods and
``teardown``. Gradient clipping goes through the precision plugin (``trainer/precision.py``).
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
from lightning_zero.runtime.pipeline import refuse_loss_scaling
from lightning_zero.runtime.run import ZeroRun
from lightning_zero.runtime.views import RunViews
from lightning_zero.trainer._lightning_compat import optimizers_to_device
from lightning_zero.trainer.checkpoints import TrainerCheckpoints
from lightning_zero.trainer.failure_path import check_step_output, where
from lightning_zero.trainer.precision import ZeroPrecisionSlot

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


@knob_views  # ``strategy.stage``, ``strategy.bucket_mb``, ...: read-only views of the one config object
class ZeroStrategy(RunViews, ZeroPrecisionSlot, TrainerCheckpoints, DDPStrategy):
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
        # everything the run owns, and the events this door translates Lightning's hooks into
        self.run = ZeroRun(self.zero_config, wrap_policy, ranks=lambda: (self.world_size, self.global_rank),
                           where=self._where)  # fmt: skip
        self._signals: Any = None  # trainer/signals.py's SchedulerSignals of the running entry point

    @property
    def _dims(self) -> Any:
        return self.run.dims

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
        refuse_loss_scaling(self.zero_config.pp, self.precision_plugin, "ZeroStrategy")
        self.run.plan_layout(num_nodes=self.num_nodes, num_processes=self.num_processes, module=self.lightning_module)
        super().setup_environment()  # starts the process group
        self.run.start(self.root_device, ranks_per_node=self.num_processes)
        # [Note: the parallelize registry]: the LightningModule applies the layout to the model it builds
        self.run.push_layout(self.lightning_module)
        if self.device_mesh is not None:
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self.device_mesh

    # -- failures ([Note: failure path] in runtime/failure.py) -----------------------------------
    def _where(self) -> str:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return where(trainer if trainer is not None and trainer.state else None)

    def _note_failure(self, exception: BaseException) -> None:
        self.run.note_failure(exception)  # an agreed stop is none ([Note: signal boundaries])

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
        self.run.setup_module(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        if fitting or self.zero_config.stage == 3:
            self.precision_plugin.engine = self.run.build_engine(  # type: ignore[attr-defined]
                self.lightning_module, self.optimizers if fitting else [], self.precision_policy
            )
        self.run.start_pipeline(self.lightning_module)  # pp > 1 ([Note: the pipelined step] in runtime/pipeline.py)
        # [Note: full state dicts] in checkpoint/full.py: self.state_dict() while the engine runs hands
        # out ddp's values (stage 3: gathered; bf16-mixed: the fp32 masters), as the Fabric door does
        self.run.serve_state_dicts(self.lightning_module, self.precision_policy.ddp_dtype)
        if fitting:  # offload_optimizer's state stays beside the host masters
            optimizers_to_device(self.run.on_host(self.optimizers), self.root_device)
        self.setup_precision_plugin()
        from lightning_zero.trainer.callbacks import install_callbacks

        self._signals = install_callbacks(trainer, self.run, self._note_failure, self._leftovers_barrier,
                                          fitting=fitting)  # fmt: skip

    def _leftovers_barrier(self) -> None:
        self.barrier("lightning_zero-leftovers")

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with self.run.model_build():  # stage 3: on the meta device; setup materializes one unit at a time
            yield

    @override
    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: the engine reduces
        pass

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.run.no_sync():
            yield None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.run.pipelined_backward():  # the schedule ran it ([Note: the pipelined step])
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # -- gradient sync: always finished after a backward ([Note: end of backward], reducer.py) --
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self.run.pre_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.run.post_backward()

    # -- the phase of every step (stage 3 gathers by it: [Note: phases] in zero/stage3/runtime.py)
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        with self.run.train_step() as engine:  # a failure is posted; the step's backward may still follow
            if engine is None:
                return super().training_step(*args, **kwargs)
            with self.run.stepping(module, module.trainer.accumulate_grad_batches):  # pp > 1: a pipeline
                output = super().training_step(*args, **kwargs)
            check_step_output(output, module, world_size=self.world_size, global_rank=self.global_rank)
            if module is not None and not module.automatic_optimization:
                engine.check_manual_train_step()
        return output

    def _eval_step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        with self.run.eval_step(self.lightning_module):  # after a failure no end_eval_step
            return step(*args, **kwargs)

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
        self.run.wait_param_gathers()  # [Note: overlapped parameter gather] in zero/param_gather.py

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
        self.run.end_eval_loop()  # stage 3: ranks with fewer batches serve the others' all-gathers
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
        # [Note: checkpoint lifecycle]: `last` published, or left as it was; the module usable outside the
        # Trainer (forward, state_dict); a failed save raised after the teardown
        save_error = self.run.teardown()
        super().teardown()
        if save_error is not None:
            raise save_error
