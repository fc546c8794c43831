"""Engine-level parity (no Lightning): ZeRO stages 1-2 vs one process on the full batch."""

import torch
from torch import nn

from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(steps: int, world: int, micro: int):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(world, 4, 6, generator=gen) for _ in range(micro)] for _ in range(steps)]


def _opt(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
    )


def _reference(steps, world, micro, clip):
    model = _model()
    opt = _opt(model)
    losses = []
    for batch in _batches(steps, world, micro):
        opt.zero_grad()
        for x in batch:
            loss = model(x.reshape(-1, 6)).pow(2).mean() / micro
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()]


def _body(rank, world, stage, bucket_mb, overlap, micro, clip, expected, defer):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    model = _model()
    opt = _opt(model)
    engine = ZeroEngine(
        model, [opt], ZeroConfig(stage=stage, bucket_mb=bucket_mb, overlap_comm=overlap, defer_grad_reduce=defer)
    )
    sharded = engine.optimizers[0]
    for batch in _batches(3, world, micro):
        opt.zero_grad()
        for i, x in enumerate(batch):
            ctx = engine.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                loss = model(x[rank]).pow(2).mean() / micro
                loss.backward()
        if clip:
            sharded.clip_grad_norm_(clip)
        opt.step()
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    if len(engine.reducer.buckets) > 1 and overlap:
        timeline = engine.reducer.timeline
        assert timeline.index_of("launch") < timeline.index_of("backward_end")


CASES = [
    (1, 25.0, True, 1, None, False),
    (2, 25.0, True, 1, None, False),
    (1, 0.0005, True, 2, 0.05, False),
    (2, 0.0005, True, 2, 0.05, False),
    (2, 0.0005, False, 1, None, False),
    (2, 0.0005, True, 3, None, True),
]


def _all_cases(rank, world, cases, expected):
    for case, want in zip(cases, expected):
        stage, bucket_mb, overlap, micro, clip, defer = case
        try:
            _body(rank, world, stage, bucket_mb, overlap, micro, clip, want, defer)
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err


def test_engine_matches_single_process():
    """(stage, bucket_mb, overlap, micro batches, clip, defer) against one process; one spawn for all."""
    expected = [_reference(3, 2, case[3], case[4]) for case in CASES]
    run_ranks(_all_cases, 2, args=(CASES, expected), timeout_s=120)
