"""Overlapped parameter all-gather (stages 1-2) at engine level, 2 gloo ranks, against one process.

[Note: overlapped parameter gather] in zero/param_gather.py. On CPU a gloo all-gather usually
finishes in the background long before anyone reads the parameters, so a missing wait would go
unnoticed. Here the all-gather the gatherer launches lands in a scratch buffer and reaches the
parameters only when its work is waited on: any read of a parameter that skipped its wait sees the
values from before the step, and the comparison with the single-process reference fails.
"""

import copy

import torch
from torch import nn

from tests.distributed import run_ranks

STEPS = 4
MICRO = 2


class Deferred:
    """A work whose result is copied into the real output only when it is waited on."""

    def __init__(self, work, scratch: torch.Tensor, output: torch.Tensor) -> None:
        self.work, self.scratch, self.output = work, scratch, output

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *args) -> bool:
        self.work.wait()
        self.output.copy_(self.scratch)
        return True


def _defer_gathers() -> None:
    import lightning_zero.zero.param_gather as param_gather

    real = param_gather.all_gather_compressed

    def deferred(output, input, group, comm_dtype, **kwargs):
        scratch = torch.zeros_like(output)
        return Deferred(real(scratch, input.clone(), group, comm_dtype, **kwargs), scratch, output)

    param_gather.all_gather_compressed = deferred


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 4)
        self.scale = nn.Parameter(torch.ones(4))  # read directly by the step, never in a forward

    def forward(self, x):
        return self.head(self.body(x)) * self.scale


def _step_loss(model: Model, x: torch.Tensor) -> torch.Tensor:
    # Like a training_step that calls submodules and reads a parameter directly (before the forward
    # of the module sharing its bucket): the root's own forward never runs in training.
    scale = model.scale * 1.0
    return (model.head(model.body(x)) * scale).pow(2).mean()


def _optimizers(model: Model):
    first = torch.optim.AdamW([*model.body.parameters(), model.scale], lr=2e-2)
    second = torch.optim.SGD(model.head.parameters(), lr=5e-2, momentum=0.9)
    return [first, second]


def _data(world: int):
    gen = torch.Generator().manual_seed(3)
    return [[torch.randn(4 * world, 8, generator=gen) for _ in range(MICRO)] for _ in range(STEPS)]


def _body(rank: int, world: int, stage: int, overlap: bool, offload: bool) -> None:
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    _defer_gathers()
    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference)
    reference_opts = _optimizers(reference)
    opts = _optimizers(model)
    engine = ZeroEngine(
        model, opts, ZeroConfig(stage=stage, bucket_mb=0.0005, overlap_param_gather=overlap, offload_optimizer=offload)
    )
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    for step, micro_batches in enumerate(_data(world)):
        for index, x in enumerate(micro_batches):
            local = x[rank * 4 : (rank + 1) * 4]
            engine.begin_step("train")
            loss = _step_loss(model, local) / MICRO
            engine.end_step_call()
            if index < MICRO - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            (_step_loss(reference, x) / MICRO).backward()
            # the micro batch's loss is that of the reference's parameters on this rank's slice
            with torch.no_grad():
                expected = _step_loss(reference, local) / MICRO
            torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        engine.sharded_optimizer(opts[0]).clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_([*reference.body.parameters(), reference.scale], 0.5)
        for opt in reversed(opts):  # the second to step waits for the first one's gathers
            opt.step()
        for opt in reference_opts:
            opt.step()
        for opt in opts + reference_opts:
            opt.zero_grad()
        if overlap:
            assert engine.pending_param_gathers() > 0, "the gathers should still be in flight after the step"
        else:
            assert engine.pending_param_gathers() == 0
        if step == 1:  # an evaluation forward outside the training step (root forward): waits for all
            engine.begin_step("eval")
            with torch.no_grad():
                torch.testing.assert_close(model(probe), reference(probe), rtol=1e-5, atol=1e-6)
            engine.end_eval_step()
        if step == 2:  # a state_dict read right after the step
            state = model.state_dict()
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # a plain forward of the root outside any step
        torch.testing.assert_close(model(probe), reference(probe), rtol=1e-5, atol=1e-6)
    for name, param in engine.managed_parameters().items():
        torch.testing.assert_close(param, dict(reference.named_parameters())[name], rtol=1e-5, atol=1e-6, msg=name)
    waits = engine.param_gather_waits()
    if overlap:
        assert waits["forward_hook"] > 0 and waits["at_launch"] == 0, waits
    else:
        assert waits == {}
    if offload:  # one gradient copy per chunk per step, though stage 2 reduced every micro batch
        chunks = engine.bucket_count()
        assert engine.offload_copy_counts() == {"device_to_host": STEPS * chunks, "host_to_device": STEPS * chunks}
    engine.close()


def _all(rank: int, world: int) -> None:
    for stage, overlap, offload in [(1, True, False), (2, True, False), (2, True, True), (2, False, False)]:
        _body(rank, world, stage, overlap, offload)


def test_overlapped_gather_is_waited_wherever_parameters_are_read():
    run_ranks(_all, 2, timeout_s=120)


def _without_waits(rank: int, world: int) -> None:
    """The deferred gathers leave the parameters stale until waited on (what makes the test above
    able to fail: a read that skipped its wait differs from the reference)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    _defer_gathers()
    torch.manual_seed(0)
    model = Model()
    opts = _optimizers(model)
    engine = ZeroEngine(model, opts, ZeroConfig(stage=2, bucket_mb=0.0005))
    engine.begin_step("train")
    loss = _step_loss(model, torch.randn(4, 8))
    engine.end_step_call()
    engine.backward(loss)
    for opt in opts:
        opt.step()
    assert engine.pending_param_gathers() > 0
    unwaited = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine.wait_param_gathers()
    changed = [name for name, param in model.named_parameters() if not torch.equal(unwaited[name], param)]
    assert changed, "waiting changed no parameter: the deferred gather did not defer"
    engine.close()


def test_a_missing_wait_reads_stale_parameters():
    run_ranks(_without_waits, 2, timeout_s=120)
