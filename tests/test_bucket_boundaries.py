"""The planner cuts stage 1-2 gradient buckets exactly where the engine's ``FlatLayout`` does
([Note: bucket boundaries] in zero/bucketing.py): same tensors, same padded sizes, the 1 MiB first
bucket included. Layouts are built from meta-device parameters, so Llama 7B costs no memory."""

import pytest
import torch

from lightning_zero.models import Llama, LlamaConfig
from lightning_zero.planner.bench_model import BENCH_MODEL
from lightning_zero.planner.hardware import Link
from lightning_zero.planner.workload import engine_buckets, llama_workload
from lightning_zero.zero.build import bucket_numel_for
from lightning_zero.zero.flat import FlatLayout, first_bucket_numel


def _engine_layouts(config: LlamaConfig, *, dp: int, bucket_mb: float, dtype: torch.dtype) -> list[tuple]:
    """(parameter names, padded numel) of every bucket, as the stage 1-2 engine lays them: one
    ``FlatLayout`` per ``LlamaLM`` optimizer param group (matrices, then norm gains)."""
    with torch.device("meta"):
        model = Llama(config)
    names = {id(param): name for name, param in model.named_parameters()}
    params = list(model.parameters())
    groups = [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
    bucket_numel = bucket_numel_for(bucket_mb, dtype)
    buckets = []
    for members in groups:
        layout = FlatLayout(
            members,
            [names[id(p)] for p in members],
            dp=dp,
            bucket_numel=bucket_numel,
            first_bucket_numel=first_bucket_numel(bucket_numel, dtype.itemsize),
        )
        buckets += [(tuple(slot.name for slot in bucket.slots), bucket.numel) for bucket in layout.buckets]
    return sorted(buckets)


def _planner_layouts(config: LlamaConfig, *, stage: int, dp: int, bucket_mb: float, dtype: torch.dtype) -> list[tuple]:
    workload = llama_workload(
        config,
        micro_batch=1,
        seq_len=16,
        tp=1,
        activation_checkpointing=False,
        flops_per_s=1e12,
        tp_link=Link(1e-6, 1e9),
        act_bytes=dtype.itemsize,
    )
    buckets = engine_buckets(
        workload,
        stage=stage,
        bucket_numel=bucket_numel_for(bucket_mb, dtype),
        dp=dp,
        grad_bytes=dtype.itemsize,
    )
    return sorted((tuple(workload.tensors[i].name for i in bucket.tensors), bucket.numel) for bucket in buckets)


@pytest.mark.parametrize(
    ("model", "dp", "bucket_mb", "dtype"),
    [
        ("bench", 2, 25.0, torch.float32),  # benchmarks/bench_zero12.py's model and bucket size
        ("bench", 2, 0.5, torch.float32),  # many buckets, the first one smaller than the rest
        ("7b", 8, 25.0, torch.bfloat16),  # the llama7b recipe
        ("7b", 8, 400.0, torch.bfloat16),
        # fp32 gradients (32-true, or reduce_dtype="fp32"): the 65 norm gains (266,240 elements)
        # outgrow 1 MiB, so their layout's first bucket closes early
        ("7b", 8, 25.0, torch.float32),
        ("70b", 8, 25.0, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("stage", [1, 2])
def test_planner_buckets_are_the_engines(model, dp, bucket_mb, dtype, stage):
    config = LlamaConfig.from_name("tiny", **BENCH_MODEL) if model == "bench" else LlamaConfig.from_name(model)
    engine = _engine_layouts(config, dp=dp, bucket_mb=bucket_mb, dtype=dtype)
    planned = _planner_layouts(config, stage=stage, dp=dp, bucket_mb=bucket_mb, dtype=dtype)
    assert planned == engine
