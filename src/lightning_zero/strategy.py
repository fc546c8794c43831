"""ZeroStrategy: Lightning glue around the ZeRO engine (launch, mesh, hooks, checkpoints).

Everything that moves tensors lives in ``zero/`` and ``tp/``; this file only decides *when*
Lightning's loop calls into them:

- ``setup``: broadcast the initial weights over dp, build the engine from the module and the
  optimizers of ``configure_optimizers`` (the optimizer objects are kept and re-pointed at the
  fp32 master shards, so LR schedulers keep working).
- ``block_backward_sync``: Lightning enters it on non-final micro batches of
  ``accumulate_grad_batches``; the engine then skips the gradient collective (stage 1).
- gradient clipping goes through the precision plugin to the engine's global-norm clipping.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.precision import to_zero_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_zero.zero.engine import ZeroEngine


def _check_args(
    stage: Any, tensor_parallel_size: Any, bucket_mb: Any, prefetch_blocks: Any, offload_optimizer: Any
) -> None:
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"ZeroStrategy(stage={stage!r}): stage must be 1, 2 or 3.")
    if stage == 3:
        raise ValueError(
            "ZeroStrategy(stage=3): parameter sharding is not available in this version yet;"
            " use stage=2 (optimizer state and gradients sharded) meanwhile."
        )
    if not (tensor_parallel_size == "auto" or (isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1)):
        raise ValueError(
            f"ZeroStrategy(tensor_parallel_size={tensor_parallel_size!r}): give a positive int or 'auto'"
            " (= devices per node)."
        )
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(
            f"ZeroStrategy(bucket_mb={bucket_mb!r}): the gradient bucket size must be a number of MiB > 0"
            " (25 is a good start; larger buckets mean fewer, bigger reduce-scatters)."
        )
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
        raise ValueError(f"ZeroStrategy(prefetch_blocks={prefetch_blocks!r}): must be an int >= 0.")
    if offload_optimizer:
        raise ValueError(
            "ZeroStrategy(offload_optimizer=True): CPU offload of the optimizer shards is not available"
            " in this version; leave it False."
        )


def _tp_norm_weights(engine: "ZeroEngine", tp: int) -> dict[int, torch.Tensor]:
    """Per-element weights of each master chunk's squared gradient in the world-wide norm sum.

    See [Note: TP grad norm] in ``tp/grad_norm.py``: elements of TP-split parameters count 1,
    elements of parameters replicated over tp (norm gains) count ``1/tp``. Only chunks that
    hold replicated elements get a weight tensor.
    """
    from lightning_zero.tp.grad_norm import tp_grad_norm_weight

    weights: dict[int, torch.Tensor] = {}
    for group in engine.groups:
        for bucket, master in zip(group.layout.buckets, group.masters):
            start = bucket.shard_start(group.dp_rank)
            end = start + bucket.shard_numel
            weight = torch.ones(bucket.shard_numel, dtype=torch.float32, device=master.device)
            for slot in bucket.slots:
                lo, hi = max(start, slot.offset), min(end, slot.end)
                if lo < hi:
                    weight[lo - start : hi - start] = tp_grad_norm_weight(slot.param, tp)
            if bool((weight != 1).any()):
                weights[id(master)] = weight
    return weights


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism (stages 1-2) as a Lightning strategy.

    Args:
        stage: 1 shards fp32 master weights and optimizer state over the dp ranks; 2 also keeps
            only each rank's shard of the reduced gradients (``2 P / dp`` bytes in bf16).
        tensor_parallel_size: ranks per tensor-parallel group (consecutive ranks of one node), or
            ``"auto"`` for devices per node. ``dp = world_size // tensor_parallel_size``.
        bucket_mb: gradient bucket size in MiB; each full bucket launches one async
            reduce-scatter over dp.
        overlap_comm: launch bucket reduce-scatters during backward (``True``) or only once
            backward ended (``False``, for comparison).
        prefetch_blocks: stage 3: blocks whose parameters are all-gathered ahead.
        offload_optimizer: keep fp32 master and optimizer shards in CPU memory (not available yet).
        defer_grad_reduce: stage 2 with ``accumulate_grad_batches > 1``: keep full-size gradients
            across micro batches and reduce once at the last one (stage-1 gradient memory, one
            reduce-scatter per step instead of one per micro batch). Stage 1 always defers.
        max_buckets_in_flight: stage 2: full-size bucket buffers alive at once (bounds gradient
            memory to the shard plus this many buckets).
        monitor: attach :class:`~lightning_zero.ZeroMonitor` (measured vs predicted bytes, comm).
        start_method: how Lightning starts local processes: ``"popen"`` (re-run the script, like
            ``ddp``) or ``"spawn"``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        tensor_parallel_size: Union[int, Literal["auto"]] = 1,
        bucket_mb: float = 25.0,
        overlap_comm: bool = True,
        prefetch_blocks: int = 1,
        offload_optimizer: bool = False,
        defer_grad_reduce: bool = False,
        max_buckets_in_flight: int = 2,
        monitor: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        _check_args(stage, tensor_parallel_size, bucket_mb, prefetch_blocks, offload_optimizer)
        if not isinstance(max_buckets_in_flight, int) or max_buckets_in_flight < 1:
            raise ValueError(f"ZeroStrategy(max_buckets_in_flight={max_buckets_in_flight!r}): must be an int >= 1.")
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
        self.stage = stage
        self.tensor_parallel_size = tensor_parallel_size
        self.bucket_mb = float(bucket_mb)
        self.overlap_comm = overlap_comm
        self.prefetch_blocks = prefetch_blocks
        self.offload_optimizer = offload_optimizer
        self.defer_grad_reduce = defer_grad_reduce
        self.max_buckets_in_flight = max_buckets_in_flight
        self.monitor = monitor
        self.engine: Optional["ZeroEngine"] = None
        self._device_mesh: Optional["DeviceMesh"] = None
        self._dims: Any = None

    # -- precision ------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = to_zero_precision(Precision())
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning sets the plugin built from Trainer(precision=...) here, at construction:
        # unsupported precisions fail now, before any process starts.
        self._precision_plugin = to_zero_precision(precision_plugin)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision_plugin.compute_dtype  # type: ignore[attr-defined]

    # -- mesh -----------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Optional["DeviceMesh"]:
        """The ``("dp", "tp")`` mesh when ``tensor_parallel_size > 1`` (else ``None``)."""
        return self._device_mesh

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        if self._device_mesh is None:
            return None
        return self._device_mesh["dp"].get_group()

    @property
    def dp_size(self) -> int:
        return self.world_size if self._dims is None else self._dims.dp

    @property
    def dp_rank(self) -> int:
        if self._device_mesh is None:
            return self.global_rank
        return self._device_mesh["dp"].get_local_rank()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one TP group see the same batch; the data is split over dp only.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @override
    def setup_environment(self) -> None:
        from lightning_zero.mesh import ParallelDims, build_mesh

        world_size = self.num_nodes * self.num_processes
        dims = ParallelDims(world_size=world_size, devices_per_node=self.num_processes, tp=self.tensor_parallel_size)
        model_config = getattr(self.lightning_module, "config", None)
        dims.validate(model_config if hasattr(model_config, "n_heads") else None)
        self._dims = dims
        super().setup_environment()  # starts the process group
        if dims.tp > 1:
            self._device_mesh = build_mesh(dims, self.root_device.type)
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._device_mesh

    # -- setup ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        self._broadcast_module_states()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._build_engine()
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and self.monitor:
            self._attach_monitor(trainer)

    @override
    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: the engine reduces
        pass

    def _broadcast_module_states(self) -> None:
        """Every dp rank starts from the weights of dp rank 0 (as DDP does at construction)."""
        assert self.model is not None
        group = self.dp_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(tensor.data, src=src, group=group)

    def _build_engine(self) -> None:
        from lightning_zero.zero.engine import ZeroEngine

        if self.engine is not None:
            self.engine.close()
        assert self.lightning_module is not None
        self.engine = ZeroEngine(
            self.lightning_module,
            self.optimizers,
            stage=self.stage,
            dp_group=self.dp_group,
            compute_dtype=self.compute_dtype,
            bucket_mb=self.bucket_mb,
            overlap_comm=self.overlap_comm,
            defer_grad_reduce=self.defer_grad_reduce,
            max_buckets_in_flight=self.max_buckets_in_flight,
            norm_group=None,  # the world: dp chunks differ, and so do tp shards
        )
        if self._device_mesh is not None:
            weights = _tp_norm_weights(self.engine, self._dims.tp)
            for sharded in self.engine.optimizers:
                sharded.replicated_weight = weights
        self.precision_plugin.engine = self.engine  # type: ignore[attr-defined]

    def _attach_monitor(self, trainer: "pl.Trainer") -> None:
        from lightning_zero.monitor import ZeroMonitor

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
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zero{stage}", cls, description=f"lightning_zero ZeRO stage {stage}", stage=stage, override=True
            )
