"""Context parallelism through the Fabric door: ``ZeroFabricStrategy(cp=C)`` against Fabric's ddp.

A Fabric loop holds whole batches; under cp it cuts each with ``fabric.strategy.context_slice``
and takes ``model.loss_fn`` (the global token mean), nothing else changes ([Note: context
parallelism under Fabric] in ``fabric/layout.py``). tests/scripts/fabric_cp.py trains a tiny
Llama (4 heads, 2 kv heads) on 2 sequences of 2048 tokens per micro batch, 3 steps of 2 micro
batches with ``no_backward_sync`` and norm clipping: ddp on 2 ranks (one sequence each), cp=2 at
ZeRO stages 1-3 (2 ranks), cp=4 at stage 3 and cp=2 x dp=2 at stage 2 (4 ranks). Per-step losses,
clipped norms and trained weights equal ddp's to 1e-5; a ``fabric.save`` under cp=2 resumes
without cp exactly. Layouts cp cannot run are refused before
any process group starts when the constructor is told the model and length, else at
``fabric.setup`` and at the cut.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import assert_same_params, launch

LAUNCHES = {
    2: ["ddp", "cp2_zero1", "cp2_zero2", "resume_cp1_zero2", "cp2_zero3", "ddp_heads3", "cp2_zero3_heads3", "refusals"],
    4: ["cp4_zero3", "cp2_zero2"],
}
CP_CASES = [(world, case) for world, cases in LAUNCHES.items() for case in cases if case.startswith("cp")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_cp")
    for world, cases in LAUNCHES.items():
        (out / str(world)).mkdir()
        launch("fabric_cp.py", out / str(world), *cases, timeout_s=400, ranks=world)
    return out


def _load(results, world: int, case: str, rank: int = 0) -> dict:
    return torch.load(results / str(world) / f"{case}.rank{rank}.pt", weights_only=False)


def _mean(results, world: int, case: str, key: str) -> torch.Tensor:
    """The global batch's per-step value: the mean over the run's ranks (equal token counts)."""
    return torch.tensor([_load(results, world, case, rank)[key] for rank in range(world)]).mean(0)


@pytest.mark.slow
@pytest.mark.parametrize("world, case", CP_CASES)
def test_fabric_cp_matches_fabric_ddp(results, world, case):
    """``*_heads3``: 3 query heads do not split over cp=2, so the model runs ring attention."""
    reference = "ddp_heads3" if case.endswith("_heads3") else "ddp"
    got, want = _load(results, world, case), _load(results, 2, reference)
    torch.testing.assert_close(_mean(results, world, case, "losses"), _mean(results, 2, reference, "losses"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-5)
    assert_same_params(got["params"], want["params"])


@pytest.mark.slow
def test_each_rank_trains_on_its_slice_and_counts_the_global_tokens(results):
    """Each cp rank ran on ``T/cp`` tokens of its dp rank's sequences; the cp ranks of one dp rank
    report the same (unsliced) loss; the monitor's total counts dp x cp ranks' slices."""
    from lightning_zero.models import LlamaConfig
    from lightning_zero.planner.traffic import cp_bytes_by_kind
    from tests.scripts.fabric_cp import CONFIG, MICRO, SEQ, STEPS

    ranks = [_load(results, 4, "cp2_zero2", rank) for rank in range(4)]  # (dp, cp) = (0,0) (0,1) (1,0) (1,1)
    assert all(shape == (1, SEQ // 2) for data in ranks for shape in data["shapes"])
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["losses"] != ranks[2]["losses"]
    for metrics in ranks[0]["monitor"]:
        assert metrics["zero/tokens_per_s_total"] == pytest.approx(4 * metrics["zero/tokens_per_s"])
    assert any("total (2 dp ranks x 2 cp ranks" in line for line in ranks[0]["summary"])
    # the all-to-alls of every micro batch, forward and backward: the planner's formula
    per_micro = cp_bytes_by_kind(LlamaConfig(**CONFIG), tokens=SEQ, cp=2, act_bytes=4)["cp_all_to_all"]
    assert ranks[0]["sent"]["cp_all_to_all"] == pytest.approx(STEPS * MICRO * per_micro)


@pytest.mark.slow
def test_fabric_checkpoint_saved_under_cp2_resumes_under_cp1(results):
    """``fabric.save`` after 2 steps under cp=2 (ZeRO over dp x cp = 2 ranks), loaded by ZeRO-2
    without cp (dp=2, one sequence per rank): the third step's loss and the weights continue
    exactly (parameters are not split by cp: a checkpoint is the model's, whatever the layout)."""
    whole, resumed = _mean(results, 2, "cp2_zero2", "losses"), _mean(results, 2, "resume_cp1_zero2", "losses")
    torch.testing.assert_close(resumed, whole[2:], rtol=1e-5, atol=1e-5)
    want = _load(results, 2, "cp2_zero2")["params"]
    for name, value in _load(results, 2, "resume_cp1_zero2")["params"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_refused_after_launch_naming_the_fix(results):
    for rank in range(2):
        messages = _load(results, 2, "refusals", rank)
        assert "ZeroStrategy(cp=2): Linear does not declare that it splits its sequences over cp" in messages["setup"]
        assert "cp(2) does not divide the sequence length (2047)" in messages["slice"]


def test_refused_or_stated_before_any_process_group():
    """A length cp does not divide is refused when the strategy is built; heads that do not split
    over cp run ring attention, stated then."""
    import torch.distributed as dist

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.models import LlamaConfig
    from tests.scripts.fabric_cp import CONFIG

    config = LlamaConfig(**CONFIG)
    with pytest.raises(ValueError, match=r"cp\(2\) does not divide the sequence length \(2047\).*multiple of 2"):
        ZeroFabricStrategy(stage=2, cp=2, model_config=config, seq_len=2047)
    with pytest.warns(UserWarning, match=r"ring attention.*cp\(3\) = 3 does not divide n_heads\(4\)"):
        ZeroFabricStrategy(stage=2, cp=3, model_config=config, seq_len=2046)
    assert not dist.is_initialized()


def test_context_slice_cuts_inputs_and_shifted_labels_as_the_data_module_does():
    """A whole window cut by ``context_slice`` gives each cp rank what ``TokenDataModule`` gives it
    (its ``T/cp + 1`` tokens, [Note: context-parallel layout]): the last label of a slice is the
    next slice's first input."""
    from lightning_zero.cp import context_slice_bounds
    from lightning_zero.cp.batch import context_slices

    window = torch.arange(2 * 17).view(2, 17)  # T = 16
    inputs, targets = window[:, :-1], window[:, 1:]
    for cp in (1, 2, 4):
        for rank in range(cp):
            got_inputs, got_targets = context_slices((inputs, targets), cp, rank)
            start, stop = context_slice_bounds(16, cp, rank)
            assert torch.equal(got_inputs, window[:, start : stop - 1])
            assert torch.equal(got_targets, window[:, start + 1 : stop])
            if rank + 1 < cp:
                assert torch.equal(got_targets[:, -1], context_slices((inputs,), cp, rank + 1)[0][:, 0])
    with pytest.raises(ValueError, match=r"equally long along dim 1"):
        context_slices((window, targets), 2, 0)
