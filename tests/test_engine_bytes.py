"""Measured model-state bytes and logical bytes sent, against the ZeRO formulas (2 gloo ranks)."""

import torch
from torch import nn

from lightning_zero.ledger import model_state_bytes
from tests.distributed import run_ranks
from tests.engine_state import state_beyond_formula

CASES = [  # (stage, compute dtype, bucket_mb)
    (1, torch.float32, 0.002),
    (2, torch.float32, 0.002),
    (1, torch.bfloat16, 0.002),
    (2, torch.bfloat16, 0.002),
]


def _check(rank, world, stage, dtype, bucket_mb):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(33, 24), *[nn.Sequential(nn.ReLU(), nn.Linear(24, 24)) for _ in range(5)], nn.Linear(24, 5)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(
        model, [opt], ZeroConfig(stage=stage, bucket_mb=bucket_mb), precision=engine_policy(dtype, torch.float32)
    )
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
    assert got["params"] == want.params
    assert got["optimizer"] == want.optimizer + state_beyond_formula(engine)
    if stage == 1:
        assert got["grads"] == want.grads
        assert got["grad_buffers"] == 0
    else:
        # The gradient state is the chunks; at most max_buckets_in_flight + 1 full-size bucket
        # buffers joined them during backward, and the pool keeps them for the next one
        # ([Note: the bucket pool outlives backward]) until the engine lets go.
        storage = engine.reducer.storage
        assert got["grads"] == want.grads
        assert storage.max_buffers == engine.config.max_buckets_in_flight + 1
        # the third bucket filled while the first two were on the link (zero/bucketing.pool_buffers)
        assert storage.high_water == storage.max_buffers
        pool_limit = storage.max_buffers * storage.max_bucket_numel * elem
        assert storage.pool_bytes_high_water <= pool_limit
        assert 0 < got["grad_buffers"] <= pool_limit
        assert got["grad_buffers"] == sum(b.numel() * b.element_size() for b in storage.free)
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
    if stage == 2:
        storage = engine.reducer.storage
        kept = [b.data_ptr() for b in storage.free]
        model(torch.randn(8, 33, dtype=dtype)).float().pow(2).mean().backward()
        assert sorted(b.data_ptr() for b in storage.free) == sorted(kept), "the next backward reuses the pool"
        assert storage.allocated == len(kept)
        engine.release_module()
        assert engine.measured_bytes()["grad_buffers"] == 0 and storage.allocated == 0
    engine.close()


def _all(rank, world):
    for case in CASES:
        try:
            _check(rank, world, *case)
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err


def test_bytes_match_formulas():
    run_ranks(_all, 2, timeout_s=120)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _teardown_releases_grads(rank, world):
    """Stage 3's teardown (``release_module``) gathers the whole module; the last step's gradient
    chunks are dropped first, so they do not sit beside it (issue 24: the fit's peak RSS)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, bucket_mb=0.001))
    model(torch.randn(8, 24)).pow(2).mean().backward()
    opt.step()
    assert engine.measured_bytes()["grads"] > 0
    optimizer_bytes = engine.measured_bytes()["optimizer"]
    engine.release_module()
    assert engine.measured_bytes()["grads"] == 0
    assert all(bucket.grad_chunk is None for bucket in engine.reducer.buckets)
    assert all(master.grad is None for sharded in engine.optimizers for master in sharded.masters)
    assert engine.measured_bytes()["optimizer"] == optimizer_bytes, "the optimizer state stays"
    assert [tuple(p.shape) for p in model.parameters()] == [(24, 24), (24,)] * 4, "the module is whole"
    model(torch.randn(2, 24))  # usable outside the engine
    engine.close()


def _stage3_deferred(rank, world):
    """Stage 3 with ``defer_grad_reduce=True``: full gradients over the micro batches (the bytes the
    ledger's rule counts, ``zero.bucketing.keeps_full_grads``), one reduce-scatter per step, the
    same parameters as the default after the step, the gradients dropped at teardown."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.trainer.monitor import predicted_bytes
    from lightning_zero.zero.engine import ZeroEngine

    trained = []
    for defer in (False, True):
        torch.manual_seed(0)
        model = _Blocks()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, bucket_mb=0.001, defer_grad_reduce=defer))
        padded = engine.num_params() + engine.padding_numel()
        inputs = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(rank))
        engine.counter.reset()
        for micro, x in enumerate(inputs):
            with engine.no_sync() if micro == 0 else torch.enable_grad():
                (model(x).pow(2).mean() / 2).backward()
        opt.step()
        sent = engine.counter.elements["reduce_scatter_grads"]
        assert sent == (1 if defer else 2) * padded * (world - 1) / world, (defer, sent)
        want = model_state_bytes(padded, stage=3, dp=world, param_bytes=4, grad_bytes=4, defer_grad_reduce=defer)
        got = engine.measured_bytes()
        assert got["grads"] == want.grads == (padded * 4 if defer else padded * 4 / world), (defer, got)
        assert got["grad_buffers"] == 0 if defer else got["grad_buffers"] > 0
        assert (
            predicted_bytes(engine, opt)["grads"]
            == model_state_bytes(
                engine.num_params(), stage=3, dp=world, param_bytes=4, grad_bytes=4, defer_grad_reduce=defer
            ).grads
        )
        engine.release_module()
        assert engine.measured_bytes()["grads"] == 0
        trained.append([p.detach().clone() for p in model.parameters()])
        engine.close()
    for plain, deferred in zip(*trained):
        torch.testing.assert_close(deferred, plain, rtol=1e-5, atol=1e-6)


def _stage3_cases(rank, world):
    _teardown_releases_grads(rank, world)
    _stage3_deferred(rank, world)


def test_stage3_teardown_releases_gradients_and_deferred_reduce_holds_full_gradients():
    """One launch: :func:`_teardown_releases_grads`, then :func:`_stage3_deferred`."""
    run_ranks(_stage3_cases, 2, timeout_s=180)
