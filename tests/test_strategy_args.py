"""ZeroStrategy's constructor and precision checks: errors name the argument and the fix, before any process starts."""

import lightning as L
import pytest
import torch

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.trainer.precision import ZeroHalfPrecision, ZeroMixedPrecision, ZeroPrecision


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stage": 0}, "stage"),
        ({"stage": 4}, "stage"),
        ({"stage": "2"}, "stage"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"bucket_mb": -1.0}, "bucket_mb"),
        ({"bucket_mb": "big"}, "bucket_mb"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": "two"}, "tensor_parallel_size"),
        ({"prefetch_blocks": -1}, "prefetch_blocks"),
        ({"max_buckets_in_flight": 0}, "max_buckets_in_flight"),
        ({"offload_optimizer": "yes"}, "offload_optimizer"),
        ({"tensor_parallel_size": True}, r"ZeroStrategy\(tensor_parallel_size=True\)"),
        ({"overlap_comm": 1}, r"ZeroStrategy\(overlap_comm=1\): must be True or False"),
        ({"prefetch_blocks": 1.5}, "prefetch_blocks"),
        ({"collective_timeout": 0}, r"ZeroStrategy\(collective_timeout=0\)"),
        ({"defer_grad_reduce": "yes"}, r"ZeroStrategy\(defer_grad_reduce=.yes.\): must be True or False"),
        ({"sequence_parallel": True}, r"sequence_parallel=True, tensor_parallel_size=1\).*tensor_parallel_size > 1"),
        ({"sequence_parallel": "yes"}, r"ZeroStrategy\(sequence_parallel='yes'\): must be True or False"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2):
        strategy = StrategyRegistry.get(f"zero{stage}")
        assert isinstance(strategy, ZeroStrategy) and strategy.stage == stage
    assert lightning_zero.ZeroStrategy is ZeroStrategy


@pytest.mark.parametrize("precision", ["64-true", "64"])
def test_unsupported_precision_fails_at_trainer_construction(precision):
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision=precision, logger=False)


@pytest.mark.parametrize(
    "precision, plugin, compute, master",
    [
        ("32-true", ZeroPrecision, torch.float32, torch.float32),
        ("bf16-mixed", ZeroMixedPrecision, torch.bfloat16, torch.float32),
        ("bf16-true", ZeroHalfPrecision, torch.bfloat16, torch.bfloat16),
        ("16-true", ZeroHalfPrecision, torch.float16, torch.float16),
    ],
)
def test_supported_precision_maps_to_engine_plugins(precision, plugin, compute, master):
    trainer = L.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision=precision, logger=False)
    assert isinstance(trainer.strategy.precision_plugin, plugin)
    assert trainer.strategy.compute_dtype == compute
    assert trainer.strategy.precision_policy.master_dtype == master


def test_master_weights_knob_gives_fp32_masters_under_bf16_true():
    strategy = ZeroStrategy(stage=3, master_weights="fp32")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision="bf16-true", logger=False)
    policy = trainer.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype, policy.master_weights) == (
        torch.bfloat16,
        torch.float32,
        "fp32",
    )
    with pytest.raises(ValueError, match="master_weights"):
        ZeroStrategy(master_weights="bf16")


def test_optimizer_over_foreign_tensors_is_rejected():
    from lightning_zero.zero.build import check_optimizer_params

    model = torch.nn.Linear(2, 2)
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the LightningModule"):
        check_optimizer_params(model, [opt])


def test_import_is_cheap_and_registers_whenever_lightning_loads():
    import subprocess
    import sys

    code = (
        "import sys, lightning_zero\n"
        "assert 'lightning.pytorch' not in sys.modules, 'import lightning_zero must not import Lightning'\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert all(f'zero{s}' in StrategyRegistry for s in (1, 2, 3))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_16_mixed_plugin_keeps_the_users_scaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    trainer = L.Trainer(
        strategy="zero2", accelerator="cpu", devices=2, logger=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ZeroMixedPrecision) and plugin.scaler is scaler
    # fp32 parameters under fp16 autocast, as ddp (mixed_params="auto"); DeepSpeed's fp16 ones on request
    policy = trainer.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype, policy.loss_scaling) == (torch.float32, torch.float32, True)
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=2, mixed_params="half"), accelerator="cpu", devices=2, logger=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    policy = trainer.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype, policy.loss_scaling) == (torch.float16, torch.float32, True)
    assert trainer.strategy.precision_plugin.scaler is scaler
