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


# -- every stage and precision, against engines built on one rank ([Note: bucket_mb counts gradient bytes])

PRECISIONS = [  # (precision, compute dtype, reduce_dtype)
    ("32-true", torch.float32, "compute"),
    ("bf16-mixed", torch.bfloat16, "compute"),
    ("bf16-mixed", torch.bfloat16, "fp32"),  # fp32 buckets: stage 3 once counted bf16 bytes here
]


def _engine_buckets_by_stage(rank: int, world: int, bucket_mb: float, out: str) -> None:
    """(parameter names, padded numel) of every gradient bucket of real engines over a tiny Llama,
    for each stage and precision (``torch.save``d to ``out``)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine

    found = {}
    for stage in (1, 2, 3):
        for precision, dtype, reduce_dtype in PRECISIONS:
            torch.manual_seed(0)
            model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
            params = list(model.parameters())
            groups = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
            optimizer = torch.optim.AdamW(groups, lr=1e-3)
            config = ZeroConfig(stage=stage, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)
            engine = ZeroEngine(
                model, [optimizer], config, precision=engine_policy(dtype, torch.float32), device=torch.device("cpu")
            )
            found[(stage, precision, reduce_dtype)] = sorted(
                (tuple(slot.name for slot in bucket.layout.slots), bucket.layout.numel)
                for bucket in engine.reducer.buckets
            )
            engine.close()
    torch.save(found, out)


@pytest.mark.parametrize("bucket_mb", [0.5])
def test_engine_and_planner_cut_the_same_buckets_at_every_stage_and_precision(tmp_path, bucket_mb):
    from lightning_zero.planner.ledger import grad_bytes_per_param
    from lightning_zero.zero.bucketing import bucket_numel_for_bytes
    from tests.distributed import run_ranks

    out = str(tmp_path / "buckets.pt")
    run_ranks(_engine_buckets_by_stage, 1, args=(bucket_mb, out), timeout_s=120)
    engine = torch.load(out, weights_only=False)
    config = LlamaConfig.from_name("tiny", n_layers=2)
    for (stage, precision, reduce_dtype), got in engine.items():
        grad_bytes = grad_bytes_per_param(precision, reduce_dtype)  # what the planner reads
        dtype = {2: torch.bfloat16, 4: torch.float32}[grad_bytes]
        planned = _planner_layouts(config, stage=stage, dp=1, bucket_mb=bucket_mb, dtype=dtype)
        assert bucket_numel_for_bytes(bucket_mb, grad_bytes) == bucket_numel_for(bucket_mb, dtype)
        assert len(got) > 3, "the case should cut several buckets"
        assert planned == got, (stage, precision, reduce_dtype)
