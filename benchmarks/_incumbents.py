"""Lightning's own strategies, made to run on CPU beside ours, and what each one holds.

Shims (benchmark-only; nothing here belongs in ``src/``):

- :class:`CPUFSDPStrategy`: Lightning's ``FSDPStrategy`` refuses ``accelerator="cpu"`` by an
  exact ``type(strategy) is FSDPStrategy`` check, which a subclass passes; it then wraps the module
  with ``device_id=self.root_device.index`` (``None`` on CPU), so we wrap with
  ``device_id=torch.device("cpu")`` instead.
- :class:`FullyShardedLlamaLM`: for Lightning's ``ModelParallelStrategy`` (FSDP2), whose
  ``"auto"`` sizes mean tp = all devices: pass ``data_parallel_size=world, tensor_parallel_size=1``
  and apply ``fully_shard`` per block (then the root) in ``configure_model``.
- :class:`CPUDeepSpeedStrategy`: Lightning's ``DeepSpeedStrategy`` with three overrides: the
  CUDA-only check in ``setup_environment``, the device-index check in ``setup_distributed`` (CPU
  devices have index ``None``), and ``device_rank=local_rank`` for ``deepspeed.initialize``.

Model-state bytes: one function per strategy family counts the tensors the rank holds, by storage
(:class:`~_probes.StorageLedger`), into params / grads / optimizer.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from _probes import StorageLedger, optimizer_state_tensors
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch import nn

# --------------------------------------------------------------------------------------------
# FSDP (FSDP1, Lightning's FSDPStrategy) on CPU
# --------------------------------------------------------------------------------------------


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU: passes the accelerator check, wraps with a CPU device_id."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from lightning.pytorch.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        _move_torchmetrics_to_device(model, self.root_device)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model


def fsdp_state_bytes(trainer: Any) -> dict[str, int]:
    """FSDP1: flat parameters (local shard, unsharded buffer while allocated), their gradients."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    ledger = StorageLedger()
    flat_params = [m._flat_param for m in trainer.model.modules() if isinstance(m, FullyShardedDataParallel)]
    flat_params = [p for p in flat_params if p is not None]
    for flat in flat_params:
        ledger.add("params", [flat, getattr(flat, "_local_shard", None), getattr(flat, "_full_param_padded", None)])
    ledger.add("params", trainer.model.parameters())
    for flat in flat_params:
        ledger.add("grads", [flat.grad, getattr(flat, "_saved_grad_shard", None), getattr(flat, "_cpu_grad", None)])
    ledger.add("grads", (p.grad for p in trainer.model.parameters()))
    for optimizer in trainer.optimizers:
        ledger.add("optimizer", optimizer_state_tensors(optimizer))
    return ledger.bytes


def fsdp2_state_bytes(trainer: Any) -> dict[str, int]:
    """FSDP2: each parameter's local shard, its unsharded buffer while allocated, grads, Adam state."""
    from torch.distributed.tensor import DTensor

    def local(tensor: Any) -> Any:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    ledger = StorageLedger()
    fsdp_params = []
    for module in trainer.lightning_module.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            fsdp_params += list(group.fsdp_params)
    for fsdp_param in fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        ledger.add("params", [local(fsdp_param.sharded_param), unsharded])
        ledger.add("params", getattr(fsdp_param, "all_gather_outputs", []) or [])
    ledger.add("params", (local(p) for p in trainer.lightning_module.parameters()))
    ledger.add("grads", (local(p.grad) for p in trainer.lightning_module.parameters() if p.grad is not None))
    for fsdp_param in fsdp_params:
        ledger.add("grads", [getattr(fsdp_param, "unsharded_accumulated_grad", None)])
    for optimizer in trainer.optimizers:
        ledger.add("optimizer", (local(t) for t in optimizer_state_tensors(optimizer)))
    return ledger.bytes


def fully_sharded_llama_lm(config: Any, **kwargs: Any) -> Any:
    """A :class:`LlamaLM` whose ``configure_model`` applies FSDP2 per block, then to the root."""
    from lightning_zero.models import LlamaLM

    class FullyShardedLlamaLM(LlamaLM):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FullyShardedLlamaLM(config, **kwargs)


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------


def ddp_state_bytes(trainer: Any) -> dict[str, int]:
    """DDP: parameters, ``param.grad`` and the reducer's bucket buffers, optimizer state.

    With Lightning's default ``gradient_as_bucket_view=False`` the C++ reducer keeps its own flat
    copy of every gradient in its buckets (invisible from Python); its size comes from DDP's
    logging data (``bucket_sizes``, bytes).
    """
    ledger = StorageLedger()
    ledger.add("params", trainer.model.parameters())
    ledger.add("grads", (p.grad for p in trainer.model.parameters()))
    ledger.add("optimizer", (t for o in trainer.optimizers for t in optimizer_state_tensors(o)))
    result = dict(ledger.bytes)
    if not getattr(trainer.model, "gradient_as_bucket_view", False):
        bucket_sizes = ddp_bucket_bytes(trainer.model)
        result["grads"] = result.get("grads", 0) + sum(bucket_sizes)
    return result


def ddp_bucket_bytes(ddp_model: Any) -> list[int]:
    data = ddp_model._get_ddp_logging_data()
    sizes = data.get("bucket_sizes", "")
    if isinstance(sizes, str):
        return [int(s) for s in sizes.replace(" ", "").split(",") if s]
    return [int(s) for s in sizes]


# --------------------------------------------------------------------------------------------
# DeepSpeed on CPU
# --------------------------------------------------------------------------------------------


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` with the three CPU overrides below."""

    def setup_environment(self) -> None:
        # Skip DeepSpeedStrategy's "only supported on CUDA GPUs" check; the rest is DDP's.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # As DeepSpeedStrategy, without _validate_device_index_selection (CPU devices have no index).
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @contextmanager
    def _device_rank_is_local_rank(self) -> Iterator[None]:
        import deepspeed

        original = deepspeed.initialize

        def initialize(*args: Any, **kwargs: Any) -> Any:
            kwargs["args"] = argparse.Namespace(device_rank=self.local_rank)
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = original

    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None) -> Any:
        with self._device_rank_is_local_rank():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    def init_deepspeed(self) -> None:
        with self._device_rank_is_local_rank():
            super().init_deepspeed()


def deepspeed_state_bytes(trainer: Any) -> dict[str, int]:
    """DeepSpeed ZeRO-1/2: flat (compute) params, fp32 master partition, grads and buckets, Adam state."""
    engine = trainer.model
    zero = engine.optimizer  # DeepSpeedZeroOptimizer
    ledger = StorageLedger()
    ledger.add("params", engine.module.parameters())
    ledger.add("params", getattr(zero, "bit16_groups_flat", []) or [])
    ledger.add("optimizer", getattr(zero, "single_partition_of_fp32_groups", []) or [])
    ledger.add("optimizer", optimizer_state_tensors(zero.optimizer))
    grads: list[Any] = [p.grad for p in engine.module.parameters()]
    grads += [p.grad for p in getattr(zero, "single_partition_of_fp32_groups", []) or []]
    averaged = getattr(zero, "averaged_gradients", {}) or {}
    for value in averaged.values() if isinstance(averaged, dict) else averaged:
        grads += list(value) if isinstance(value, (list, tuple)) else [value]
    grads += list(getattr(zero, "ipg_buffer", None) or [])
    grads += [getattr(zero, "grads_in_partition", None)]
    ledger.add("grads", grads)
    return ledger.bytes


def llama_lm_without_scheduler(config: Any, **kwargs: Any) -> Any:
    """A :class:`LlamaLM` with constant LR: DeepSpeed ZeRO-3 regroups the optimizer's param groups,
    after which Lightning's ``LambdaLR`` over the original two groups fails (``zip()`` length error)."""
    from lightning_zero.models import LlamaLM

    class ConstantLRLlamaLM(LlamaLM):
        def configure_optimizers(self) -> Any:
            return super().configure_optimizers()["optimizer"]

    return ConstantLRLlamaLM(config, **kwargs)


def deepspeed3_state_bytes(trainer: Any) -> dict[str, int]:
    """DeepSpeed ZeRO-3: parameter partitions (and gathered params), master partition, grads, Adam."""
    engine = trainer.model
    zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    ledger = StorageLedger()
    params = list(engine.module.parameters())
    ledger.add("params", [getattr(p, "ds_tensor", None) for p in params])
    ledger.add("params", params)
    ledger.add("params", getattr(zero, "fp16_partitioned_groups_flat", []) or [])
    ledger.add("optimizer", getattr(zero, "fp32_partitioned_groups_flat", []) or [])
    ledger.add("optimizer", optimizer_state_tensors(zero.optimizer))
    grads: list[Any] = [p.grad for p in params]
    grads += [p.grad for p in getattr(zero, "fp32_partitioned_groups_flat", []) or []]
    grads += [getattr(zero, "grad_partitions_flat_buffer", None)]
    averaged = getattr(zero, "averaged_gradients", {}) or {}
    for value in averaged.values() if isinstance(averaged, dict) else averaged:
        grads += list(value) if isinstance(value, (list, tuple)) else [value]
    ledger.add("grads", grads)
    return ledger.bytes
