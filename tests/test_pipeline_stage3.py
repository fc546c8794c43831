"""ZeRO-3 inside pipeline stages ([Note: stage 3 under a pipeline] in zero/stage3/runtime.py), one
4-rank launch (tests/scripts/pp_stage3.py) for both doors:

- the Trainer door: ``LlamaLM`` at pp=2 x dp=2 under every schedule (two local stages per rank under
  the interleaved ones and ZBV, the weight gradients split from the input gradients under the
  zero-bubble ones) against Lightning's ddp on 4 ranks: fp32, ``accumulate_grad_batches=2``, norm
  clipping, validation and predict (tests/scripts/pp_parity.py); each rank gathers its stage once
  and reduce-scatters its gradients once per training batch, and holds what the planner plans;
- the Fabric door: ``pipeline_step`` in a hand loop at pp=2 x dp=2 against the same loop on the
  whole model in one process (tests/scripts/fabric_pp.py).

The same launch runs ZBV at stages 1-2 on pp=2 x dp=2 (tests/test_pipeline.py's 2-sequence batch
is too small for ZBV's 4 micro-batches there). pp=2 x tp=2 and pp=2 x ep=2 at stage 3 run in tests/test_pipeline.py's 4-rank launch, beside their
stage 1-2 cases and baselines.
"""

import pytest
import torch

from tests.distributed import joined_ranks, launch, rank_result

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb", "zbv"]  # tests/scripts/pp_parity.py's names
TORCH_NAMES = {"interleaved": "interleaved_1f1b", "zb": "interleaved_zb"}
ZBV_STAGES_1_2 = ["pp2dp2_zbv4_zero1", "pp2dp2_zbv4_zero2"]  # ZBV at this batch, beside its ddp4 reference
CASES = ["ddp4", *(f"pp2dp2_{name}_zero3" for name in SCHEDULES), *ZBV_STAGES_1_2, "fabric-zbv-zero3"]
RANKS, DP = 4, 2
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_stage3")
    launch("pp_stage3.py", out, RANKS, *CASES, timeout_s=400, ranks=RANKS)
    return out


def _joined(results, case: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    return joined_ranks(results, case, RANKS)


def _planned(schedule: str):
    """The planner's stage-3 pp rank for this layout (8 sequences a step, 4 micro-batches of 1 a dp rank)."""
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.planner.arithmetic import plan_run

    virtual = {"pp_virtual_stages": 2} if schedule in ("interleaved", "zb") else {}
    return plan_run(
        LlamaConfig(**CONFIG), stage=3, world_size=RANKS, devices_per_node=RANKS, pp=2, pp_microbatches=4,
        pp_schedule=TORCH_NAMES.get(schedule, schedule), micro_batch=1, seq_len=CONFIG["max_seq_len"],
        precision="32-true", accumulate_grad_batches=2, suggest=False, simulate=False, **virtual,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage3_inside_pipeline_stages_matches_ddp_under_every_schedule(trained, schedule):
    case = f"pp2dp2_{schedule}_zero3"
    losses, val_losses, params = _joined(trained, case)
    want_losses, want_val, want_params = _joined(trained, "ddp4")
    assert losses.shape == want_losses.shape == (8,) and val_losses.shape == want_val.shape
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(val_losses, want_val, rtol=0, atol=1e-5)
    assert set(params) == set(want_params)  # every stage's parameters, under the full model's names
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)
    planned = _planned(schedule)
    for rank in range(RANKS):
        result = rank_result(trained, case, rank)
        # predict after fit: ddp's rank r predicted row r; dp rank d of the pipeline rows d and d + 2
        want = torch.cat([rank_result(trained, "ddp4", row)["predicted"] for row in (rank % DP, rank % DP + DP)])
        torch.testing.assert_close(result["predicted"], want, rtol=0, atol=1e-5)
        # every block of the stage (both local stages under interleaving and ZBV) held gathered at once
        most, blocks = result["gathered"]
        assert most == blocks > 0, (rank, most, blocks)
        # once per training batch, whatever the micro-batches and the schedule's B/W split: one all-gather
        # of the stage and one reduce-scatter of its gradients over the dp group (each rank sends (d-1)/d)
        assert len(result["sent"]) == 8
        for sent in result["sent"]:
            assert sent["all_gather_params"] == sent["reduce_scatter_grads"] == blocks * (DP - 1) / DP, (rank, sent)
        # measured = planned on the rank the planner plans (the fullest): the stage's parameters and
        # the schedule's gradients, whole (fp32)
        if rank // DP == planned.pp_rank:
            held = result["held"]
            grads = planned.pipeline.ranks[planned.pp_rank].grad_bytes  # [Note: gradients a schedule holds]
            assert held == (planned.memory.prefetch_buffers, grads) == (4 * blocks,) * 2, rank


@pytest.mark.slow
@pytest.mark.parametrize("case", ZBV_STAGES_1_2)
def test_zbv_at_stages_1_and_2_on_pp2_dp2_matches_ddp(trained, case):
    losses, val_losses, params = _joined(trained, case)
    want_losses, want_val, want_params = _joined(trained, "ddp4")
    assert losses.shape == want_losses.shape == (8,)
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(val_losses, want_val, rtol=0, atol=1e-5)
    assert set(params) == set(want_params)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_stage3_under_the_fabric_doors_pipeline_step_equals_one_process(trained):
    """``fabric.strategy.pipeline_step`` + ``fabric.backward`` under ``no_backward_sync``
    (accumulation 2) + ``fabric.clip_gradients`` at stage 3, ZBV, pp=2 x dp=2: the mean of the dp
    ranks' losses, every trained parameter and an evaluation equal the whole model's loop."""
    ranks = [rank_result(trained, "zbv-zero3", rank) for rank in range(RANKS)]
    losses = torch.tensor([result["losses"] for result in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ranks[0]["want"]), rtol=0, atol=1e-5)
    names = {name for result in ranks for name in result["gaps"]}
    assert len(names) == 39  # every parameter of the 4-block model
    for result in ranks:
        assert max(result["gaps"].values()) < 1e-5, result["gaps"]
    evaluated = sum(result["eval"][0] for result in ranks) / RANKS
    assert abs(evaluated - ranks[0]["eval"][1]) < 1e-5
