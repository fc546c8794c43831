"""Pipeline parallelism: the layout's checks (no process group), the schedule played on paper
against torch's own order, torch's schedules over our Llama stages on 2 gloo ranks against one
process running the whole model, and ``LlamaLM`` under ``ZeroStrategy(pp=2)`` through the Trainer
against Lightning's ddp (every schedule; ZeRO stages 1 and 2 within each stage's dp group; a
checkpoint saved at pp=2 resumed at pp=1)."""

import pytest
import torch

from lightning_zero.pp.layout import SCHEDULES, PipelineLayout, balanced_split
from lightning_zero.pp.simulate import StageCosts, schedule_order, trace_schedule
from tests.distributed import joined_ranks, launch_each, rank_result, run_ranks

BAD_LAYOUTS = [
    (dict(pp=2, schedule="pipedream", n_layers=4, microbatches=4), "is not a schedule"),
    (dict(pp=4, schedule="1f1b", n_layers=3, microbatches=4), "every stage needs at least one"),
    (
        dict(pp=2, schedule="interleaved_1f1b", n_layers=3, microbatches=4, virtual_stages=2),
        "every stage needs at least one",
    ),
    (dict(pp=2, schedule="interleaved_1f1b", n_layers=4, microbatches=4), "pp_virtual_stages >= 2"),
    (dict(pp=2, schedule="1f1b", n_layers=4, microbatches=4, virtual_stages=2), "pp_virtual_stages must be 1"),
    (dict(pp=4, schedule="1f1b", n_layers=8, microbatches=2), "at least pp\\(4\\) micro-batches"),
    (dict(pp=2, schedule="zbv", n_layers=8, microbatches=2, virtual_stages=2), "at least 4 micro-batches"),
    (dict(pp=2, schedule="interleaved_1f1b", n_layers=8, microbatches=7, virtual_stages=2), "not a multiple"),
    (dict(pp=2, schedule="1f1b", n_layers=4, microbatches=4, pp_layers=(1, 2)), "sums to 3"),
    (dict(pp=2, schedule="1f1b", n_layers=4, microbatches=4, pp_layers=(4,)), "must give 2 positive block counts"),
    (dict(pp=2, schedule="1f1b", n_layers=4, microbatches=4, pp_layers=(4, 0)), "must give 2 positive block counts"),
    (dict(pp=0, schedule="1f1b", n_layers=4, microbatches=4), "pp must be a positive int"),
]


@pytest.mark.parametrize("kwargs, message", BAD_LAYOUTS)
def test_a_split_that_cannot_work_is_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineLayout(**kwargs)


def test_stages_hold_every_block_once_and_ranks_run_torchs_stages():
    layout = PipelineLayout(pp=2, schedule="1f1b", n_layers=7, microbatches=2)
    assert [list(layout.stage_blocks(s)) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]
    four = PipelineLayout(pp=4, schedule="1f1b", n_layers=10, microbatches=4)
    assert four.layers_per_stage == (2, 3, 3, 2)  # the remainder to the stages without embeddings or head
    by_hand = PipelineLayout(pp=2, schedule="gpipe", n_layers=4, microbatches=1, pp_layers=(1, 3))
    assert list(by_hand.stage_blocks(1)) == [1, 2, 3]
    interleaved = PipelineLayout(pp=2, schedule="interleaved_1f1b", n_layers=8, microbatches=4, virtual_stages=2)
    assert interleaved.rank_stages(0) == (0, 2) and interleaved.rank_stages(1) == (1, 3)
    v = PipelineLayout(pp=2, schedule="zbv", n_layers=8, microbatches=4)
    assert v.rank_stages(0) == (0, 3) and v.rank_stages(1) == (1, 2)
    assert [v.stage_rank(s) for s in range(4)] == [0, 1, 1, 0]


def test_balanced_split_minimizes_the_costliest_stage():
    assert balanced_split([1.0] * 8, 2) == (4, 4)
    assert balanced_split([1.0] * 8, 2, last_extra=2.0) == (5, 3)
    split = balanced_split([1.0] * 8, 4, first_extra=1.0, last_extra=3.0)
    costs = [n + (1.0 if i == 0 else 0.0) + (3.0 if i == 3 else 0.0) for i, n in enumerate(split)]
    assert sum(split) == 8 and split[3] == 1 and max(costs) == 4.0  # 8 + 1 + 3 over 4 stages: 3 is out of reach
    with pytest.raises(ValueError, match="stages need"):
        balanced_split([1.0] * 3, 4)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_one_f_one_b_and_gpipe_bubbles_and_in_flight_match_the_textbook(pp, m):
    # Equal stages, backward = 2 forwards: both have the bubble (pp - 1) / (m + pp - 1); GPipe keeps
    # every micro-batch's activations, 1F1B at most pp - rank of them (pp on the first stage).
    for schedule in ("gpipe", "1f1b"):
        trace = trace_schedule(PipelineLayout(pp=pp, schedule=schedule, n_layers=pp * 2, microbatches=m))
        assert trace.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
        expected = (m,) * pp if schedule == "gpipe" else tuple(min(m, pp - r) for r in range(pp))
        assert trace.in_flight == expected


def test_interleaving_and_zero_bubble_shrink_the_bubble_in_torchs_own_order():
    pp, m = 4, 8
    one_f_one_b = trace_schedule(PipelineLayout(pp=pp, schedule="1f1b", n_layers=16, microbatches=m))
    # v stages per rank, each 1/v of the work: the per-stage costs are 1/v of 1F1B's
    half = StageCosts.uniform(2 * pp, 0.5, 0.5, 0.5)
    interleaved = trace_schedule(
        PipelineLayout(pp=pp, schedule="interleaved_1f1b", n_layers=16, microbatches=m, virtual_stages=2), half
    )
    assert interleaved.bubble_fraction == pytest.approx((pp - 1) / (2 * m + pp - 1))
    zero_bubble = trace_schedule(
        PipelineLayout(pp=pp, schedule="interleaved_zb", n_layers=16, microbatches=m, virtual_stages=2), half
    )
    zbv = trace_schedule(PipelineLayout(pp=pp, schedule="zbv", n_layers=16, microbatches=m), half)
    assert zero_bubble.bubble_fraction < interleaved.bubble_fraction < one_f_one_b.bubble_fraction
    assert zbv.bubble_fraction < interleaved.bubble_fraction
    # the order is torch's: every (stage, micro-batch) runs its forward and backward exactly once
    for schedule in SCHEDULES:
        layout = PipelineLayout(
            pp=2,
            schedule=schedule,
            n_layers=8,
            microbatches=4,
            virtual_stages=1 if schedule in ("gpipe", "1f1b") else 2,
        )
        done = [action for rank in schedule_order(layout) for action in rank]
        forwards = sorted((s, mb) for s, kind, mb in done if kind == "F")
        assert forwards == [(s, mb) for s in range(layout.num_stages) for mb in range(4)]


CONFIG = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
PIPELINE_CASES = [("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved_1f1b", 2, 4), ("interleaved_zb", 2, 4), ("zbv", 2, 4)]


def _reference(batch, targets):
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama, cross_entropy_loss

    torch.manual_seed(0)
    model = Llama(LlamaConfig(name="pp-test", **CONFIG))
    loss = cross_entropy_loss(model(batch), targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _planned(layout, micro_batch, seq_len):
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.planner.ledger import llama_activation_bytes
    from lightning_zero.planner.pipeline import StageShape, plan_pipeline, unit_param_counts

    config = LlamaConfig(name="pp-test", **CONFIG)
    acts = llama_activation_bytes(config, micro_batch=micro_batch, seq_len=seq_len, act_bytes=4, attention="fused")
    shape = StageShape(micro_batch=micro_batch, seq_len=seq_len, dim=config.dim, act_bytes=4)
    return plan_pipeline(layout, acts, shape, unit_param_counts(config), grad_bytes=4)


def _measured_step(rank, layout, pipeline, stages, batch, targets, expected_grads):
    """One more step, counted ([Note: counting pipeline bytes] in pp/measure.py): held equal to
    the planner's numbers for this rank. Every ``.grad`` starts at ``None``, as under the engine's
    ``gradients_by_hand``: the gradients the schedule makes are the ones it holds."""
    from lightning_zero.pp.cost import recv_buffer_bytes
    from lightning_zero.pp.measure import SavedPerMicrobatch, held_recv_buffers, schedule_stages
    from lightning_zero.pp.schedule import run_step

    plan = _planned(layout, batch.size(0) // layout.microbatches, batch.size(1))
    planned = plan.ranks[rank]
    counted = schedule_stages(pipeline)
    for module in stages.values():
        module.zero_grad(set_to_none=True)
    with SavedPerMicrobatch(stages) as saved:
        for stage in counted:
            stage.reset()
            stage.before_action.append(saved.sample)
        run_step(pipeline, layout, rank, batch, targets)
    sent, received = sum(s.sent_bytes for s in counted), sum(s.received_bytes for s in counted)
    assert (sent, received) == (planned.p2p_sent, planned.p2p_received), (layout.schedule, rank, sent, received)
    per_microbatch = tuple({saved.bytes_of(stage, mb) for mb in range(layout.microbatches)} for stage in planned.stages)
    assert per_microbatch == tuple({int(b)} for b in planned.saved_per_microbatch), (layout.schedule, per_microbatch)
    assert sum(s.numel() for m in stages.values() for s in m.parameters()) == planned.params
    # [Note: held between I and W], [Note: gradients a schedule holds] in planner/pipeline.py
    measured = (saved.peak_alive, saved.grad_bytes(), saved.peak_with_grads)
    expected = (planned.in_flight_bytes, planned.grad_bytes, planned.peak_bytes)
    assert measured == expected, (layout.schedule, rank, measured, expected)
    # [Note: receive buffers] in pp/cost.py: torch's, and the input gradients it keeps, after the step
    buffers = held_recv_buffers(counted)
    assert buffers == recv_buffer_bytes(layout, rank, plan.boundary_bytes), (layout.schedule, rank, buffers)
    assert buffers.total == planned.recv_buffers > 0, (layout.schedule, rank, buffers)
    for module in stages.values():  # the counting hooks changed nothing: the same batch, the same gradients
        for name, param in module.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    return dict(
        sent=sent, received=received, peak_saved=saved.peak_alive, per_microbatch=per_microbatch, buffers=buffers
    )


def _pipeline_cases(rank, world, cases, batch, targets, expected_loss, expected_grads):
    import torch.distributed as dist

    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama, cross_entropy_loss
    from lightning_zero.models.llama.pipeline import llama_stages
    from lightning_zero.pp.measure import MeasuredStage
    from lightning_zero.pp.schedule import build_schedule, run_step

    for schedule, virtual, microbatches in cases:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(name="pp-test", **CONFIG))
        layout = PipelineLayout(
            pp=world, schedule=schedule, n_layers=CONFIG["n_layers"], microbatches=microbatches, virtual_stages=virtual
        )
        stages = llama_stages(model, layout, rank)
        pipeline = build_schedule(layout, stages, None, torch.device("cpu"), cross_entropy_loss, MeasuredStage)
        loss = run_step(pipeline, layout, rank, batch, targets)
        if loss is not None:
            assert torch.allclose(loss, expected_loss, rtol=0, atol=1e-6), (schedule, loss, expected_loss)
        seen = set()
        for stage in stages.values():
            for name, param in stage.named_parameters():
                seen.add(name)
                assert param.grad is not None, (schedule, name)
                torch.testing.assert_close(
                    param.grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=f"{schedule} {name}"
                )
        every = [None] * world
        dist.all_gather_object(every, sorted(seen))
        assert sorted(n for names in every for n in names) == sorted(expected_grads), schedule  # each once
        _measured_step(rank, layout, pipeline, stages, batch, targets, expected_grads)


def test_torchs_schedules_over_llama_stages_equal_one_process_and_move_the_planned_bytes():
    torch.manual_seed(1)
    batch = torch.randint(0, CONFIG["vocab_size"], (4, 8))
    targets = torch.randint(0, CONFIG["vocab_size"], (4, 8))
    loss, grads = _reference(batch, targets)
    run_ranks(_pipeline_cases, 2, args=(PIPELINE_CASES, batch, targets, loss, grads), timeout_s=120)


# tests/scripts/pp_parity.py: fp32, accumulate_grad_batches=2, norm clipping, validation before,
# during and after training; the same global batch of 4 sequences a step in every case
LAUNCHES = [
    (
        2,
        ["ddp", "pp2_gpipe_zero1", "pp2_1f1b_zero2", "pp2_interleaved_zero1", "pp2_zb_zero2", "pp2_zbv_zero1",
         "resume_pp2_ckpt_pp1", "ddp_moe", "pp2moe_zbv_zero1", "pp2_1f1b_zero3"],
    ),
    # pp x dp, pp x ep (MoE), and pp x tp with sequence parallelism: every schedule, ZeRO 1 and 2 (1F1B at both),
    # ZeRO 3 with tp (ZBV) and ep (interleaved); pp x dp at ZeRO 3: tests/test_pipeline_stage3.py; pp x tp without
    # sequence parallelism (ZBV), and a MoE's (1F1B); hybrid sharding inside the stages (shard_size=1, interleaved ZB)
    (4, ["pp2dp2_1f1b_zero1", "pp2dp2_interleaved_zero2", "pp2ep2_1f1b_zero1", "pp2ep2_interleaved_zero2",
         "pp2tp2_1f1b_zero1", "pp2tp2_1f1b_zero2", "pp2tp2_gpipe_zero2", "pp2tp2_interleaved_zero1", "pp2tp2_zb_zero2",
         "pp2tp2_zbv_zero1", "pp2tp2_zbv_zero3", "pp2ep2_interleaved_zero3", "pp2tp2nosp_zbv_zero2",
         "pp2tp2moe_1f1b_zero1", "pp2dp2hyb_zb_zero2"]),
]  # fmt: skip
RANKS = {case: devices for devices, cases in LAUNCHES for case in cases}
DP = {case: 2 if case.startswith(("pp2dp2", "pp2ep2_")) else 1 for case in RANKS}  # the dp ranks of each pipelined run
PP_CASES = [case for case in RANKS if case.startswith("pp2")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return launch_each("pp_parity.py", tmp_path_factory.mktemp("pp"), LAUNCHES, timeout_s=400)


def _joined(results, case: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    losses, val_losses, params = joined_ranks(results, case, RANKS[case])
    if "ep2" in case:  # a stage's 2 ranks (ep ranks 0, 1 in rank order) hold consecutive halves of its experts
        ranks = [rank_result(results, case, rank) for rank in range(RANKS[case])]
        for name in [name for name in params if ".experts." in name]:
            params[name] = torch.cat([result["params"][name] for result in ranks if name in result["params"]])
    return losses, val_losses, params


@pytest.mark.slow
@pytest.mark.parametrize("case", PP_CASES)
def test_pipeline_under_the_trainer_matches_ddp(trained, case):
    losses, val_losses, params = _joined(trained, case)
    baseline = "ddp_moe" if "moe" in case or "ep2" in case else "ddp"  # a MoE case: the same MoE under ddp
    want_losses, want_val, want_params = _joined(trained, baseline)
    assert losses.shape == want_losses.shape == (8,) and val_losses.shape == want_val.shape == (3,)
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(val_losses, want_val, rtol=0, atol=1e-5)
    assert set(params) == set(want_params)  # every stage's parameters, under the full model's names
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)
    # predict after fit: ddp's dp rank r predicted row r; each pp rank returns its dp rank's rows
    # (under tp the script joins the tp ranks' vocab-split logits)
    want = torch.cat([rank_result(trained, baseline, rank)["predicted"] for rank in range(2)])
    for rank in range(RANKS[case]):
        got = rank_result(trained, case, rank)["predicted"]
        torch.testing.assert_close(got, want if DP[case] == 1 else want[rank % 2 : rank % 2 + 1], rtol=0, atol=1e-5)
    # the point-to-point bytes every rank sent and received over the 8 batches: the plan's ([Note: pipeline bytes]);
    # under tp each rank's T/tp slice, with or without sequence parallelism
    for rank in range(RANKS[case]):
        sent, received, planned_sent, planned_received = rank_result(trained, case, rank)["p2p"]
        assert (sent, received) == (planned_sent, planned_received) and sent > 0, (case, rank)
    if case.endswith("zero3"):  # [Note: stage 3 under a pipeline]: every block of the stage held at once
        for rank in range(RANKS[case]):
            most, blocks = rank_result(trained, case, rank)["gathered"]
            assert most == blocks > 0
    if DP[case] == 1:  # no dp: every rank trained on the whole global batch
        rows = [rank_result(trained, case, rank)["rows"] for rank in range(RANKS[case])]
        assert all(row == rows[0] for row in rows)


@pytest.mark.slow
def test_a_checkpoint_saved_at_pp2_resumes_at_pp1_exactly(trained):
    losses, _, params = _joined(trained, "resume_pp2_ckpt_pp1")
    want_losses, _, want_params = _joined(trained, "ddp")
    torch.testing.assert_close(losses, want_losses[4:], rtol=0, atol=1e-5)  # steps 3-4 (batches 5-8)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


PIPELINE_REFUSALS = [
    (dict(hierarchical_reduce=True), {}, "use hierarchical_reduce=False with pp > 1"),
    (dict(pp_layers=[1, 2]), {}, "sums to 3"),
    (dict(pp_microbatches=1), {}, "at least pp\\(2\\) micro-batches"),
    (dict(pp_schedule="interleaved_1f1b"), {}, "pp_virtual_stages >= 2"),
    (dict(pp_schedule="interleaved_1f1b", pp_virtual_stages=4), {}, "every stage needs at least one"),
    ({}, dict(tie_embeddings=True), "ties its embedding to its head"),
]


@pytest.mark.parametrize("knobs, model, message", PIPELINE_REFUSALS)
def test_the_doors_refuse_a_pipeline_they_cannot_run_before_any_process_group(knobs, model, message):
    """What ``ZeroStrategy.setup_environment`` checks (``ZeroSession.plan_layout``) before it starts
    the process group: the layout against the model, each refusal naming the fix."""
    import torch.distributed as dist

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.session import ZeroSession

    session = ZeroSession(ZeroConfig(**{"stage": 2, "pp": 2, **knobs}))
    module = LlamaLM({**CONFIG, "name": "tiny", **model})
    with pytest.raises(ValueError, match=message):
        session.plan_layout(num_nodes=1, num_processes=4, module=module)
    assert not dist.is_initialized()


def test_a_moe_pipeline_runs_tp_and_ep_inside_its_stages_and_refuses_what_cannot_before_any_process_group():
    """pp=2 x ep=2 and pp=2 x tp=2 x ep=2 of a MoELM are planned (each stage's ranks split its blocks
    over tp and its experts over ep; its balancing terms per micro-batch: tests/test_pipeline_moe.py);
    a capacity factor under tp stays refused (as at pp=1), naming the fix; the Fabric door plans it too."""
    import torch.distributed as dist

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.moe import MoELM
    from lightning_zero.runtime.session import ZeroSession

    moe = {**CONFIG, "name": "tiny_moe_pp", "n_experts": 4, "top_k": 2, "expert_ffn_dim": 32}  # its default aux terms
    dims = ZeroSession(ZeroConfig(stage=1, pp=2, ep=2)).plan_layout(num_nodes=1, num_processes=4, module=MoELM(moe))
    assert (dims.pp, dims.ep, dims.ep_ranks(2), dims.edp) == (2, 2, [2, 3], 1)
    session = ZeroSession(ZeroConfig(stage=1, pp=2, ep=2, tensor_parallel_size=2))
    dims = session.plan_layout(num_nodes=1, num_processes=8, module=MoELM(moe))
    assert (dims.pp, dims.tp, dims.ep, dims.dp, dims.pp_ranks(1)) == (2, 2, 2, 2, [1, 5])
    session = ZeroSession(ZeroConfig(stage=1, pp=2, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="use capacity_factor=None"):
        session.plan_layout(num_nodes=1, num_processes=4, module=MoELM({**moe, "capacity_factor": 1.0}))
    assert not dist.is_initialized()
    # the Fabric door (the model itself given to fabric.setup; tests/test_pipeline_fabric.py runs it)
    from lightning_zero.models.moe import MoETransformer, resolve_moe_config
    from lightning_zero.runtime.pipeline import pipeline_layout

    with torch.device("meta"):
        model = MoETransformer(resolve_moe_config(moe))
    assert pipeline_layout(ZeroConfig(pp=2, ep=2, tensor_parallel_size=2), dims, model).pp == 2


def test_a_hybrid_layouts_gradient_norm_spans_every_stage():
    """[Note: pipeline ranks]: under hybrid sharding a gradient norm sums over a replica (a shard group
    times tp); under pp the replica takes its place in every pp block, so the norm covers every stage."""
    from lightning_zero.comm.mesh import ParallelDims

    dims = ParallelDims(world_size=8, devices_per_node=8, pp=2, shard_size=1)
    assert dims.rank_groups("shard") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert dims.rank_groups("replicate") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.rank_groups("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tp = ParallelDims(world_size=8, devices_per_node=8, pp=2, tp=2, shard_size=1)
    assert tp.rank_groups("replica") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_a_pipeline_the_doors_run_is_planned_before_any_process_group():
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.session import ZeroSession

    session = ZeroSession(ZeroConfig(stage=1, pp=2, pp_schedule="zbv"))
    dims = session.plan_layout(num_nodes=1, num_processes=4, module=LlamaLM({**CONFIG, "name": "tiny"}))
    assert (dims.pp, dims.dp, dims.pp_ranks(1)) == (2, 2, [1, 3])
    layout = session.pipeline_layout
    assert (layout.schedule, layout.microbatches, layout.rank_stages(0)) == ("zbv", 4, (0, 3))


FABRIC_CASES = ["1f1b-zero2", "interleaved_1f1b-zero1", "zbv-zero1"]


@pytest.mark.slow
def test_fabric_pipeline_step_in_a_hand_loop_equals_one_process(tmp_path):
    """tests/scripts/fabric_pp.py: ``fabric.strategy.pipeline_step`` + ``fabric.backward`` under
    ``no_backward_sync`` (accumulation 2) + ``fabric.clip_gradients`` + ``optimizer.step`` on 2
    ranks equal the same loop on the whole model in one process: losses, every trained parameter
    (each on the rank holding it) and a forward-only evaluation to 1e-5."""
    from tests.distributed import launch

    launch("fabric_pp.py", tmp_path, 2, *FABRIC_CASES, timeout_s=300, ranks=2)
    for case in FABRIC_CASES:
        ranks = [rank_result(tmp_path, case, rank) for rank in range(2)]
        names = [name for result in ranks for name in result["gaps"]]
        assert len(names) == len(set(names)) == 39, case  # every parameter of the 4-block model, once
        for result in ranks:
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["want"]), rtol=0, atol=1e-5)
            assert max(result["gaps"].values()) < 1e-5, (case, result["gaps"])
            assert abs(result["eval"][0] - result["eval"][1]) < 1e-5, case
