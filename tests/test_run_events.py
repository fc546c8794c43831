"""The run's events without a process group ([Note: one runtime object] in runtime/run.py): what both
doors forward to does the same before any engine exists, and the meta-parameter stand-ins round-trip."""

import pytest
import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.runtime.deferred_init import DeferredInit
from lightning_zero.runtime.run import ZeroRun
from lightning_zero.runtime.signals import AgreedStop


def _run(**knobs) -> ZeroRun:
    return ZeroRun(ZeroConfig(**knobs), None, ranks=lambda: (1, 0), where=lambda: "training step 1")


def test_the_run_builds_its_parts_from_the_config_policies():
    run = _run(stage=3, monitor=False, async_checkpoint=True, collective_timeout=12.0)
    assert run.session.config is run.config and run.monitor is None
    assert run.checkpoints.async_checkpoint and run.checkpoints.stall_s == 12.0 and run.is_global_zero
    assert _run(monitor=True).monitor is not None
    with run.model_build():
        assert nn.Linear(2, 2).weight.is_meta  # stage 3 builds on the meta device
    with _run(stage=2).model_build():
        assert not nn.Linear(2, 2).weight.is_meta


def test_step_events_before_an_engine_pass_through_and_post_nothing():
    run = _run()
    with run.train_step() as engine:
        assert engine is None
    with pytest.raises(ValueError, match="boom"), run.eval_step(nn.Linear(1, 1)):
        raise ValueError("boom")
    with run.no_sync():
        pass
    run.pre_backward()
    run.post_backward()
    run.wait_param_gathers()
    run.end_eval_loop()
    assert not run.failed and run.teardown() is None


def test_an_agreed_stop_is_no_failure_and_a_local_path_takes_no_storage_options():
    run = _run()
    posted = []
    run.session.note_failure = lambda exception, where: posted.append((type(exception), where))
    run.note_failure(AgreedStop(143, "SIGTERM"))
    run.note_failure(RuntimeError("x"))
    assert posted == [(RuntimeError, "training step 1")]
    with pytest.raises(TypeError, match=r"ZeroStrategy.save_checkpoint\(storage_options=.*local path"):
        run.check_storage_options("ZeroStrategy.save_checkpoint", "/tmp/ckpt", {"anon": True})
    run.check_storage_options("ZeroStrategy.save_checkpoint", "s3://bucket/ckpt", {"anon": True})


def test_meta_parameters_get_stand_ins_and_come_back_in_module_and_optimizer():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight  # tied: one stand-in for both
    metas = list(model.parameters())
    init = DeferredInit()
    init.stand_in_for_meta_parameters(model, torch.device("cpu"))
    stand_ins = list(model.parameters())
    assert all(not p.is_meta and p.shape == m.shape and torch.isnan(p).all() for p, m in zip(stand_ins, metas))
    assert model[1].weight is model[0].weight and len(stand_ins) == 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    init.restore_meta_parameters(model, [optimizer])
    assert [id(p) for p in model.parameters()] == [id(m) for m in metas]
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(m) for m in metas]


def test_an_optimizer_that_stepped_on_stand_ins_is_refused():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    init = DeferredInit()
    init.stand_in_for_meta_parameters(model, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.state[model.weight]["momentum_buffer"] = torch.zeros(2, 2)  # what a step over the stand-in leaves
    with pytest.raises(RuntimeError, match="before the model's first forward"):
        init.restore_meta_parameters(model, [optimizer])
