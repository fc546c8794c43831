"""The planner's pipeline parallelism without any process group: per pp rank what a plan holds and
sends, the bubble the step carries, and the search choosing pp (measured against real ranks in
tests/test_pipeline.py)."""

import pytest

from lightning_zero.planner.arithmetic import plan_run
from lightning_zero.planner.pipeline import trace_pass, unit_param_counts
from lightning_zero.pp.layout import SCHEDULES, PipelineLayout
from lightning_zero.pp.simulate import StageBytes, StageCosts, trace_schedule

RUN = dict(world_size=64, devices_per_node=8, tp=8, micro_batch=1, seq_len=4096, activation_checkpointing="full",
           hardware="h100_80gb", suggest=False)  # fmt: skip


def test_a_pipelined_plan_splits_the_model_and_carries_the_bubble():
    flat = plan_run("70b", stage=1, accumulate_grad_batches=2, **RUN)  # the same tokens: dp 8 x 2
    piped = plan_run("70b", stage=1, pp=4, pp_schedule="1f1b", pp_microbatches=8, **RUN)
    assert piped.tokens_per_step == flat.tokens_per_step and (piped.dp, flat.dp) == (2, 8)
    pipeline = piped.pipeline
    assert sum(pipeline.layers_per_stage) == 80 and len(pipeline.layers_per_stage) == 4
    assert sum(rank.params for rank in pipeline.ranks) == sum(unit_param_counts(piped_model(), tp=8))
    assert [rank.in_flight for rank in pipeline.ranks] == [4, 3, 2, 1]  # 1F1B: pp - r
    # the first rank sends activations and receives gradients across one boundary per micro-batch: each of the 8
    # tp ranks its T/tp slice of the replicated stream ([Note: pipeline bytes] in pp/cost.py)
    boundary = 1 * 4096 * 8192 * 2 // 8
    assert (pipeline.ranks[0].p2p_sent, pipeline.ranks[1].p2p_sent) == (8 * boundary, 16 * boundary)
    assert piped.traffic.pp_link == "inter_node" and piped.timing.pipeline_bubble_s > 0
    assert 0.2 < piped.bubble_fraction < 0.35  # near (pp - 1) / (m + pp - 1) = 3 / 11
    assert piped.params_per_tp_rank < flat.params_per_tp_rank / 3  # a quarter of the blocks, the head on one rank


def piped_model():
    from lightning_zero.planner.arithmetic import resolve_model

    return resolve_model("70b")


def test_muon_under_pp_orthogonalizes_only_the_rank_s_blocks():
    # a quarter of the blocks over a quarter of the dp ranks: each owner's share is the same as flat
    flat = plan_run("70b", stage=1, accumulate_grad_batches=2, optimizer="muon", **RUN)
    piped = plan_run("70b", stage=1, pp=4, pp_microbatches=8, optimizer="muon", **RUN)
    assert piped.muon_momentum_bytes == flat.muon_momentum_bytes
    assert piped.muon_step_s == pytest.approx(flat.muon_step_s, rel=0.05)


def test_a_split_the_model_cannot_take_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="every stage needs at least one"):
        plan_run("tiny", stage=1, world_size=16, devices_per_node=1, pp=16, pp_microbatches=16, suggest=False)


def test_stage3_under_pp_plans_the_stage_s_parameters_held_for_the_whole_step():
    """[Note: stage 3 under a pipeline]: the stage's parameters gathered once and kept for every
    micro-batch, its gradients whole until they are handed in; not one unit and its prefetch."""
    flat = plan_run("70b", stage=3, accumulate_grad_batches=2, **RUN)
    piped = plan_run("70b", stage=3, pp=4, pp_schedule="1f1b", pp_microbatches=8, **RUN)
    held = piped.pipeline.ranks[piped.pp_rank].params  # this tp rank's stage
    dp = piped.dp
    for planned, width in ((piped.memory.prefetch_buffers, 2), (piped.memory.param_grad, 2)):  # bf16 params, grads
        assert held * width <= planned < (held + dp) * width  # padded to a multiple of dp
    assert piped.memory.prefetch_buffers > 5 * flat.memory.prefetch_buffers  # a fifth of 80 blocks, not 1 + prefetch


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_long_pass_extrapolated_equals_the_whole_pass_played(schedule):
    """[Note: long pipelines extrapolated]: heavier first and last stages, and transfers slow enough
    that their round trip, not the slowest stage, bounds 1F1B's steady state."""
    layout = PipelineLayout(pp=8, schedule=schedule, n_layers=64, microbatches=64,
                            virtual_stages=1 if schedule in ("gpipe", "1f1b") else 2)  # fmt: skip
    forward = [1.0] * layout.num_stages
    forward[0], forward[-1] = 1.3, 1.6
    costs = StageCosts(tuple(forward), tuple(forward), tuple(forward))
    held = StageBytes(tuple(1.0 + s for s in range(layout.num_stages)), grads=(5.0,) * layout.num_stages)
    whole, extrapolated = trace_schedule(layout, costs, 1.0, held), trace_pass(layout, costs, 1.0, held)
    assert extrapolated.bubble_fraction == pytest.approx(whole.bubble_fraction, rel=1e-12)
    assert extrapolated.idle_s == pytest.approx([whole.makespan - busy for busy in whole.busy], rel=1e-12)
    assert (extrapolated.in_flight, extrapolated.peak_held, extrapolated.peak_with_grads) == (
        whole.in_flight, whole.peak_held, whole.peak_with_grads)  # fmt: skip


NARROW = dict(world_size=64, devices_per_node=8, seq_len=4096, hardware="h100_80gb", topology=False, stages=(1,),
              tp_sizes=(8,), cp_sizes=(1,), pp_sizes=(4,), micro_batches=(1,), checkpointing=("full",),
              sequence_parallel=(True,))  # fmt: skip


def test_the_search_plans_every_schedule():
    """``plan.search`` with pp: every schedule torch runs, each where it can (GPipe too: it alone
    runs a pass of fewer micro-batches than pp besides the interleaved ones)."""
    from lightning_zero.planner import search_layouts

    every = search_layouts("70b", global_batch=16, **NARROW)  # 8 micro-batches a pass
    assert sorted({entry.layout.pp_schedule for entry in every.ranked}) == sorted(SCHEDULES)
    few = search_layouts("70b", global_batch=4, **NARROW)  # 2 micro-batches: 1F1B and ZBV refuse
    assert sorted({entry.layout.pp_schedule for entry in few.ranked}) == ["gpipe", "interleaved_1f1b", "interleaved_zb"]


def test_the_search_splits_a_step_into_passes_where_one_pass_does_not_fit():
    """[Note: pipeline passes]: 4096 micro-batches a dp rank's step; one 1F1B pass of them holds a
    receive buffer each, more than the GPU, so the search plans the fewest passes that fit."""
    from lightning_zero.planner import search_layouts

    one_pass = plan_run("70b", stage=1, pp=4, pp_schedule="1f1b", pp_microbatches=4096, sequence_parallel=True, **RUN)
    assert not one_pass.fits
    result = search_layouts("70b", global_batch=8192, **NARROW)  # dp = 64 / (pp 4 x tp 8) = 2
    [entry] = [entry for entry in result.ranked if entry.layout.pp_schedule == "1f1b"]
    layout = entry.layout
    assert (layout.accumulate_grad_batches, layout.pp_microbatches) == (4, 1024) and entry.plan.fits
    assert entry.plan.tokens_per_step == one_pass.tokens_per_step  # the same step, in 4 passes
    # Lightning's batch is one pass of the schedule; the trainer accumulates the passes
    assert {"data.batch_size=1024", "trainer.accumulate_grad_batches=4"} <= set(layout.overrides())
