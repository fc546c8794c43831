"""The gradient path (issue 13): small first bucket, stage-1 gradients as bucket views, no
zero-fill of stage-2 pool buffers, ``reduce_dtype``, the reduce op per backend.

Pure logic first; then one 2-rank gloo spawn runs every engine case.
"""

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks

# -- pure logic ---------------------------------------------------------------------------------


def test_grad_reduce_op_rule():
    """[Note: exact averaging]: NCCL averages inside the collective only where 1/dp is exact in the
    dtype (a power of two) or the dtype is fp32/fp64; bf16/fp16 at dp = 3, 6, 12, 24 sum and divide
    after; gloo (no AVG) always sums and divides."""
    from lightning_zero.zero.reducer import grad_reduce_op

    avg, sum_then_divide = (dist.ReduceOp.AVG, False), (dist.ReduceOp.SUM, True)
    for dp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 64):
        power_of_two = dp & (dp - 1) == 0
        for dtype in (torch.float32, torch.float64):
            assert grad_reduce_op("nccl", dtype, dp) == avg, (dtype, dp)
            assert grad_reduce_op("NCCL", dtype, dp) == avg, (dtype, dp)
        for dtype in (torch.bfloat16, torch.float16):
            assert grad_reduce_op("nccl", dtype, dp) == (avg if power_of_two else sum_then_divide), (dtype, dp)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert grad_reduce_op("gloo", dtype, dp) == sum_then_divide
            assert grad_reduce_op("mpi", dtype, dp) == sum_then_divide


def test_bf16_premultiplied_average_is_what_the_rule_avoids():
    """Why the rule exists: NCCL's bf16 AVG multiplies each input by bf16(1/n) before summing.
    For n = 3 that factor is 1.002 x 1/3; the sum-then-divide the engine runs instead is within
    bf16's half ulp of the exact mean, the pre-multiplied one is not."""
    n = 3
    grads = torch.full((n, 1000), 1.0, dtype=torch.bfloat16) + torch.linspace(0, 1, 1000, dtype=torch.bfloat16)
    exact = grads.double().mean(0)
    factor = torch.tensor(1.0 / n, dtype=torch.bfloat16)
    premultiplied = (grads * factor).double().sum(0)  # NCCL's bf16 AVG, summed exactly (its best case)
    sum_then_divide = (grads.sum(0) / n).double()  # the engine's SUM, then one divide in bf16
    assert abs(float(factor) * n - 1) > 1e-3  # the factor itself is off by ~0.2 %
    ulp = 2.0**-7  # bf16's relative spacing
    assert ((sum_then_divide - exact).abs() / exact).max() <= ulp
    assert ((premultiplied - exact) / exact).mean() > 1e-3  # a bias, the same sign everywhere


def test_first_bucket_is_small_and_the_rest_keep_bucket_numel():
    from lightning_zero.zero.flat import FlatLayout, first_bucket_numel

    params = [nn.Parameter(torch.zeros(100)) for _ in range(10)]
    names = [f"p{i}" for i in range(10)]
    layout = FlatLayout(params, names, dp=2, bucket_numel=450, first_bucket_numel=150)
    sizes = [sum(s.numel for s in b.slots) for b in layout.buckets]
    assert sizes == [200, 500, 300], sizes  # closes at >= 150, then >= 450; a param never straddles
    assert [s.name for s in layout.buckets[0].slots] == ["p9", "p8"]  # last registered: ready first
    assert [sum(s.numel for s in b.slots) for b in FlatLayout(params, names, dp=2, bucket_numel=450).buckets] == [
        500,
        500,
    ]
    # 1 MiB of fp32 is 262144 elements; never more than a whole bucket
    assert first_bucket_numel(10**7, 4) == 262144 and first_bucket_numel(1000, 4) == 1000
    assert first_bucket_numel(10**7, 2) == 524288
    with pytest.raises(ValueError, match="first_bucket_numel"):
        FlatLayout(params, names, dp=2, bucket_numel=450, first_bucket_numel=0)


def test_reduce_dtype_knob_and_bytes():
    from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig, reduce_in_fp32
    from lightning_zero.planner.arithmetic import plan_run
    from lightning_zero.planner.ledger import grad_bytes_per_param

    assert ZERO_DEFAULTS.reduce_dtype == "compute"
    assert reduce_in_fp32("fp32") and not reduce_in_fp32("compute") and not reduce_in_fp32("bf16")
    with pytest.raises(ValueError, match=r"reduce_dtype='fp16'.*\"fp32\""):
        ZeroConfig(reduce_dtype="fp16")
    assert grad_bytes_per_param("bf16-mixed") == 2 and grad_bytes_per_param("bf16-mixed", "fp32") == 4
    assert grad_bytes_per_param("32-true", "compute") == 4 and grad_bytes_per_param("32-true", "fp32") == 4
    common = dict(world_size=8, devices_per_node=8, precision="bf16-mixed", micro_batch=1, seq_len=128, simulate=False)
    for stage in (1, 2, 3):
        bf16 = plan_run("tiny", stage=stage, **common)
        fp32 = plan_run("tiny", stage=stage, reduce_dtype="fp32", **common)
        assert fp32.memory.grads == 2 * bf16.memory.grads, stage  # P (stage 1) or P / dp, in 4 bytes
        assert fp32.traffic.dp_reduce_scatter_bytes == 2 * bf16.traffic.dp_reduce_scatter_bytes
        assert fp32.traffic.dp_all_gather_bytes == bf16.traffic.dp_all_gather_bytes  # params stay bf16
        assert fp32.memory.step_grad_shard == 0 < bf16.memory.step_grad_shard  # no fp32 cast at the step
        assert fp32.reduce_dtype == "fp32"


def test_monitor_predicts_fp32_gradient_bytes():
    from lightning_zero.trainer.monitor import predicted_bytes

    @dataclasses.dataclass
    class FakeEngine:
        reduce_dtype: torch.dtype
        compute_dtype: torch.dtype = torch.bfloat16
        stage: int = 1
        dp_size: int = 2
        defer_grad_reduce: bool = False

        def num_params(self) -> int:
            return 1000

        def expert_split(self) -> tuple[int, int]:
            return 0, 1

    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    assert predicted_bytes(FakeEngine(torch.bfloat16), opt)["grads"] == 2000
    assert predicted_bytes(FakeEngine(torch.float32), opt)["grads"] == 4000


# -- engine cases on 2 gloo ranks ---------------------------------------------------------------

WIDTH = 256  # 8 x Linear(256, 256): 2.1 MB of fp32 gradients, less than bucket_mb=25


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)  # never in forward: its slot gets no gradient (last bucket)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(8)])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack()


def _inputs(steps: int, micro: int, world: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return [[torch.randn(world, 4, WIDTH, generator=gen).to(dtype) for _ in range(micro)] for _ in range(steps)]


def _reference(steps: int, micro: int, world: int, clip: float) -> list[torch.Tensor]:
    model = _stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for batch in _inputs(steps, micro, world):
        opt.zero_grad()
        for x in batch:
            (model(x.reshape(-1, WIDTH)).pow(2).mean() / micro).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _parity_and_views(rank, world, stage, expected):
    """Default-ish knobs (bucket_mb=25 > the model): several buckets, the first launched before
    backward ends and small; stage 1: the first micro batch after zero_grad copies each gradient
    into its (unfilled) slot, later ones let autograd write into the bucket slots; params match."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.flat import FIRST_BUCKET_MB

    model = _stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=25.0))
    reducer = engine.reducer
    assert len(reducer.buckets) > 1, "a model smaller than bucket_mb still gets a small first bucket"
    first = reducer.buckets[0]
    assert first.layout.numel * 4 <= FIRST_BUCKET_MB * 2**20 + WIDTH * WIDTH * 4
    storage = reducer.storage
    launched_when_last_grad_came: list[int] = []
    model.layers[0].weight.register_hook(  # its gradient is the last one backward computes
        lambda grad: launched_when_last_grad_came.append(len(reducer.timeline.launched_buckets()))
    )
    for step, batch in enumerate(_inputs(3, 3, world)):
        opt.zero_grad()
        for i, x in enumerate(batch):
            syncing = i == len(batch) - 1
            with engine.no_sync() if not syncing else torch.enable_grad():
                engine.backward(model(x[rank]).pow(2).mean() / len(batch))
            if stage == 1 and step > 0 and i == 0:
                # right after zero_grad the buffer is not filled: each gradient was copied in
                assert all(p.grad is None for p in model.parameters())
                assert all(b.undefined for b in reducer.buckets)
                used = sum(1 for p in model.parameters() if p.requires_grad) - 2  # `unused` has 2
                assert sum(len(b.written_slots) for b in reducer.buckets) == used
            if stage == 1 and not syncing and (step == 0 or i > 0):
                # gradient_as_bucket_view: every .grad is its slot of the group's buffer
                for group in engine.groups:
                    buffer = storage.buffers[id(group)]
                    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
                    for slot in group.layout.slots:
                        grad = slot.param.grad
                        assert grad is storage._views[id(slot.param)], slot.name
                        assert lo <= grad.data_ptr() < hi and grad.untyped_storage().data_ptr() == lo
        # the first (small) bucket was already in flight when backward computed its last gradient
        assert launched_when_last_grad_came[-1] >= 1, (step, launched_when_last_grad_came)
        assert reducer.timeline.launched_buckets()[0] == reducer._layout_index[id(first)]
        if stage == 1:  # a reduced bucket shows no half-reduced gradient
            assert all(p.grad is None for p in model.parameters())
        engine.optimizers[0].clip_grad_norm_(0.05)
        opt.step()
    for (name, got), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")
    engine.close()


def _stage1_hook_copies_nothing(rank, world):
    """Count what the gradient hook does in a stage-1 backward: with the views installed, the
    grad_ready hook issues no copy/add kernel (autograd accumulated in the slot already)."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=1, bucket_mb=25.0))
    x = _inputs(1, 1, world)[0][0][rank]
    with engine.no_sync():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.backward(model(x).pow(2).mean())
    events = prof.events()
    hooks = [e for e in events if e.name == "lightning_zero::grad_ready"]
    assert len(hooks) == sum(1 for p in model.parameters() if p.requires_grad) - 2  # `unused` has 2
    inside = [
        e
        for e in events
        if e.name in ("aten::copy_", "aten::add_", "aten::add")
        and any(h.time_range.start <= e.time_range.start and e.time_range.end <= h.time_range.end for h in hooks)
    ]
    assert inside == [], [e.name for e in inside]
    storage = engine.reducer.storage
    once = {id(g): storage.buffers[id(g)].clone() for g in engine.groups}
    # User code drops the module's .grad (model.zero_grad()): autograd makes a fresh gradient, the
    # hook adds it into the slot and drops it; accumulation goes on, as before this change.
    model.zero_grad(set_to_none=True)
    with engine.no_sync():
        model(x).pow(2).mean().backward()  # plain backward: no pre_backward, no views
    assert all(p.grad is None for p in model.parameters())
    with engine.no_sync():
        engine.backward(model(x).pow(2).mean())  # views installed again
    for group in engine.groups:
        torch.testing.assert_close(storage.buffers[id(group)], 3 * once[id(group)], rtol=1e-6, atol=1e-7)
        for slot in group.layout.slots:
            if slot.name.startswith("layers"):
                assert slot.param.grad is storage._views[id(slot.param)]
    # create_graph=True: autograd replaces the view by `view + new` out of place; the hook copies it.
    with engine.no_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the reference cycle create_graph makes
        engine.backward(model(x).pow(2).mean(), create_graph=True)
    for group in engine.groups:
        torch.testing.assert_close(storage.buffers[id(group)], 4 * once[id(group)], rtol=1e-6, atol=1e-7)
    engine.close()


def _in_flight_cap(rank, world):
    """Every stage launches a bucket only while fewer than max_buckets_in_flight reduce-scatters
    are in flight (stage 1 has no buffer pool to bound them); the result does not change."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    params = {}
    for stage, cap in ((1, 2), (1, 64), (2, 2), (1, 1)):
        model = _stack()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.01, max_buckets_in_flight=cap))
        assert len(engine.reducer.buckets) > 4, len(engine.reducer.buckets)
        for batch in _inputs(2, 1, world):
            opt.zero_grad()
            engine.backward(model(batch[0][rank]).pow(2).mean())
            opt.step()
        high = engine.reducer.in_flight_high_water
        assert high == cap if cap < 64 else high > 2, (stage, cap, high)
        params[(stage, cap)] = [p.detach().clone() for p in model.parameters()]
        engine.close()
    for key, got in params.items():
        for a, b in zip(got, params[(1, 64)]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=str(key))


def _bf16_accumulation(rank, world):
    """bf16 compute, 8 micro batches: reduce_dtype=fp32 gives the fp32 reduction of the same bf16
    micro-batch gradients (to fp32 rounding); reducing in bf16 is measurably further off."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine

    micro = 8
    batch = _inputs(1, micro, world, torch.bfloat16)[0]
    # The bf16 micro-batch gradients every rank computes, summed in fp32 per rank then over ranks.
    reference = _stack().to(torch.bfloat16)
    want: dict[str, torch.Tensor] = {}
    for r in range(world):
        per_rank: dict[str, torch.Tensor] = {}
        for x in batch:
            reference.zero_grad(set_to_none=True)
            (reference(x[r]).float().pow(2).mean() / micro).backward()
            for name, p in reference.named_parameters():
                if p.grad is not None:
                    per_rank[name] = per_rank.get(name, 0) + p.grad.float()
        for name, g in per_rank.items():
            want[name] = want.get(name, 0) + g
    want = {name: g / world for name, g in want.items()}
    errors = {}
    for stage in (1, 2, 3):
        for reduce_dtype in ("fp32", "compute"):
            model = _stack()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            config = ZeroConfig(stage=stage, bucket_mb=0.05, reduce_dtype=reduce_dtype)
            engine = ZeroEngine(model, [opt], config, precision=engine_policy(torch.bfloat16, torch.float32))
            for i, x in enumerate(batch):
                with engine.no_sync() if i < micro - 1 else torch.enable_grad():
                    engine.backward(model(x[rank]).float().pow(2).mean() / micro)
            worst, scale = 0.0, 0.0
            for owned in engine.owned_ranges():
                got = engine.optimizer_tensor(owned).grad  # the view the optimizer steps
                if owned.name not in want:  # `unused`: its slot was never written (no zero-fill)
                    assert bool((got == 0).all()), (stage, owned.name)
                    continue
                assert got.dtype == torch.float32
                expected = want[owned.name].reshape(-1)[owned.param_lo : owned.param_hi]
                worst = max(worst, float((got - expected).abs().max()))
                scale = max(scale, float(expected.abs().max()))
            errors[(stage, reduce_dtype)] = (worst, scale)
            engine.close()
    for stage in (1, 2, 3):
        fp32_err, scale = errors[(stage, "fp32")]
        bf16_err, _ = errors[(stage, "compute")]
        assert fp32_err <= 2e-6 * scale, (stage, errors)  # fp32 rounding only
        assert bf16_err > 50 * max(fp32_err, 1e-7 * scale), (stage, errors)  # bf16 drift


def _all(rank, world, expected):
    for stage, want in zip((1, 2), expected):
        _parity_and_views(rank, world, stage, want)
    _stage1_hook_copies_nothing(rank, world)
    _in_flight_cap(rank, world)
    _bf16_accumulation(rank, world)


def test_engine_gradient_path():
    torch.set_num_threads(1)
    expected = [_reference(3, 3, 2, 0.05) for _ in (1, 2)]
    run_ranks(_all, 2, args=(expected,), timeout_s=240)
