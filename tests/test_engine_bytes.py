"""Measured model-state bytes and logical bytes sent, against the ZeRO formulas (2 gloo ranks)."""

import torch
from torch import nn

from lightning_zero.ledger import model_state_bytes
from tests.distributed import run_ranks

CASES = [  # (stage, compute dtype, bucket_mb)
    (1, torch.float32, 0.002),
    (2, torch.float32, 0.002),
    (1, torch.bfloat16, 0.002),
    (2, torch.bfloat16, 0.002),
]


def _check(rank, world, stage, dtype, bucket_mb):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(33, 24), *[nn.Sequential(nn.ReLU(), nn.Linear(24, 24)) for _ in range(5)], nn.Linear(24, 5)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=bucket_mb), compute_dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    padded = num_params + engine.padding_numel()
    assert engine.num_params() == num_params
    assert len(engine.reducer.buckets) > 2, "the case should exercise several buckets"

    for _ in range(2):
        opt.zero_grad()
        engine.counter.reset()
        x = torch.randn(8, 33, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()

    elem = torch.empty((), dtype=dtype).element_size()
    k = 8 if dtype == torch.float32 else 12  # Adam moments (+ fp32 master under bf16)
    want = model_state_bytes(padded, stage=stage, dp=world, param_bytes=elem, grad_bytes=elem, optim_bytes_per_param=k)
    got = engine.measured_bytes()
    step_counters = 4 * sum(len(g.masters) for g in engine.groups)  # Adam's scalar `step` per chunk
    assert got["params"] == want.params
    assert got["optimizer"] == want.optimizer + step_counters
    if stage == 1:
        assert got["grads"] == want.grads
    else:
        # Between steps only the gradient chunks live; during backward at most
        # max_buckets_in_flight full-size bucket buffers joined them.
        storage = engine.reducer.storage
        assert got["grads"] == want.grads
        assert 1 <= storage.high_water <= storage.max_buckets_in_flight
        assert storage.pool_bytes_high_water <= storage.max_buckets_in_flight * storage.max_bucket_numel * elem
    # Unpadded, the formulas agree up to the padding.
    unpadded = model_state_bytes(
        num_params, stage=stage, dp=world, param_bytes=elem, grad_bytes=elem, optim_bytes_per_param=k
    )
    assert 0 <= got["params"] - unpadded.params <= engine.padding_numel() * elem

    # Logical elements sent in one step: reduce-scatter + all-gather, each (dp-1)/dp of the padded size.
    sent = engine.counter.elements
    assert sent["reduce_scatter_grads"] == padded * (world - 1) / world
    assert sent["all_gather_params"] == padded * (world - 1) / world
    assert engine.counter.total_elements() == 2 * padded * (world - 1) / world
    assert engine.counter.bytes["reduce_scatter_grads"] == padded * (world - 1) / world * elem
    engine.close()


def _all(rank, world):
    for case in CASES:
        try:
            _check(rank, world, *case)
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err


def test_bytes_match_formulas():
    run_ranks(_all, 2, timeout_s=120)
