"""The one planner on mixtures of experts (issue 54 items 5-6): ``arithmetic.plan`` with ``ep``.

Expert parameters, gradients and optimizer state per rank are ``experts / ep`` sharded over the edp
group (``ledger.model_state_bytes(expert_params=, ep=)``, the rule the monitor's prediction uses);
buckets are cut per domain; the token exchange's bytes are the formula the engine's counters are
tested against (``planner.moe.all_to_all_bytes``) for a balanced router, placed on the ep group's
link; the dispatched copies of the tokens count as activations; the layout search chooses ``ep``
with ``tp``, ``dp`` and the stage. The measured side (the engine's bytes per rank beside this
planner at ep = 2 and 4, stages 1-3, tp = 1 and 2) is tests/test_moe_strategy.py's launch.
"""

from __future__ import annotations

import io

import pytest

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import ZeroConfig
from lightning_zero.models.moe import MoEConfig
from lightning_zero.planner.arithmetic import PlanOptions, RunShape, plan, plan_run
from lightning_zero.planner.ledger import model_state_bytes
from lightning_zero.planner.moe import MOE_EXCHANGES, all_to_all_bytes

H100 = "h100_80gb"
QUICK = PlanOptions(hardware=H100, simulate=False, suggest=False)
LONG = RunShape(seq_len=4096)


def _plan(model, world=64, devices=8, run=LONG, options=QUICK, **knobs):
    config = ZeroConfig(**knobs)
    return plan(
        model, config, ParallelDims.from_config(config, world_size=world, devices_per_node=devices), run, options
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_experts_over_ep_sharded_over_edp_by_the_zero_formulas(stage):
    arch = MoEConfig.from_name("mixtral_8x7b")
    ep8 = _plan(arch, stage=stage, ep=8)
    experts = arch.expert_params() // 8  # this rank's expert (1 of 8) of every layer
    dense = arch.num_params() - arch.expert_params()
    assert (ep8.ep, ep8.edp, ep8.expert_params_per_rank) == (8, 8, experts)
    assert ep8.params_per_tp_rank == dense + experts
    want = model_state_bytes(dense + 8 * experts, stage=stage, dp=64, expert_params=8 * experts, ep=8)
    assert (ep8.memory.params, ep8.memory.grads, ep8.memory.optimizer) == (want.params, want.grads, want.optimizer)
    # every rank holding every expert (ep = 1) keeps 8x the experts' states, sharded over all 64
    ep1 = _plan(arch, stage=stage, ep=1)
    assert ep1.expert_params_per_rank == 0 and ep1.params_per_tp_rank == arch.num_params()
    assert ep1.memory.optimizer == pytest.approx(12 * arch.num_params() / 64)
    # stage 3 shards both over all 64 (experts / 8 over 8 = experts / 64); stages 1-2 hold parameters whole
    assert (
        ep8.memory.model_states == ep1.memory.model_states
        if stage == 3
        else ep8.memory.model_states < ep1.memory.model_states
    )


def test_buckets_are_cut_per_domain_and_padded_to_their_group():
    from lightning_zero.planner.hardware import load_hardware
    from lightning_zero.planner.workload import engine_buckets, llama_workload

    arch = MoEConfig.from_name("tiny_moe_shared")
    link = load_hardware(H100).link(inter_node=False)
    workload = llama_workload(arch, micro_batch=1, seq_len=16, tp=1, activation_checkpointing=False,
                              flops_per_s=1e12, tp_link=link, act_bytes=4, ep=2, ep_link=link)  # fmt: skip
    for stage in (1, 2, 3):
        buckets = engine_buckets(workload, stage=stage, bucket_numel=10**9, dp=6, grad_bytes=4, expert_dp=3)
        for bucket in buckets:
            members = {workload.tensors[i].expert for i in bucket.tensors}
            assert members == {bucket.expert}  # a bucket never mixes the domains
            assert bucket.numel % (3 if bucket.expert else 6) == 0
        assert {b.expert for b in buckets} == {False, True}
        if stage < 3:  # one layout per param group and domain: dense matrices, dense gains, experts
            assert len(buckets) == 3


def test_all_to_alls_are_the_counted_formula_on_the_ep_groups_link():
    arch = MoEConfig.from_name("tiny_moe_shared")
    tokens, micro_batches = 2 * 64, 3
    run = RunShape("32-true", micro_batch=2, seq_len=64, accumulate_grad_batches=micro_batches)
    for checkpointing, forwards in (("none", 1), ("full", 2)):
        shaped = RunShape(**{**run.__dict__, "activation_checkpointing": checkpointing})
        planned = _plan(arch, world=8, devices=8, run=shaped, ep=4)
        # a balanced router: every rank sends tokens x k / E assignments to every expert
        balanced = [[[tokens * arch.top_k / arch.n_experts] * arch.n_experts] * arch.n_moe_layers] * 4
        per_micro_batch = all_to_all_bytes(balanced, rank=1, ep=4, row_bytes=arch.dim * 4, recomputed=forwards == 2)
        assert planned.traffic.ep_bytes_by_kind == {k: micro_batches * v for k, v in per_micro_batch.items()}
        assert set(planned.traffic.ep_bytes_by_kind) == set(MOE_EXCHANGES)
    # the link: ep consecutive ranks of the dense group (stride tp), inside a node while they fit
    assert _plan("mixtral_8x7b", ep=8).traffic.ep_link == "intra_node"
    assert _plan("qwen3_30b_a3b", ep=16).traffic.ep_link == "inter_node"
    sp = dict(tensor_parallel_size=2, sequence_parallel=True)
    assert _plan("qwen3_30b_a3b", ep=4, **sp).traffic.ep_link == "intra_node"  # ranks 0, 2, 4, 6
    assert _plan("qwen3_30b_a3b", ep=8, **sp).traffic.ep_link == "inter_node"  # ranks 0, 2, ..., 14
    timed = _plan("qwen3_30b_a3b", ep=16, options=PlanOptions(hardware=H100))
    inside = _plan("qwen3_30b_a3b", ep=8, options=PlanOptions(hardware=H100))
    assert timed.traffic.ep_s > 0 and timed.traffic.inter_node_bytes > timed.traffic.ep_all_to_all_bytes
    per_byte = timed.traffic.ep_s / timed.traffic.ep_all_to_all_bytes
    assert per_byte > 2 * inside.traffic.ep_s / inside.traffic.ep_all_to_all_bytes  # inter-node is slower
    assert _plan("mixtral_8x7b", ep=1).traffic.ep_bytes_by_kind == {}


def test_dispatched_copies_count_as_activations():
    arch = MoEConfig.from_name("mixtral_8x7b")
    run = RunShape(micro_batch=1, seq_len=4096)
    planned = _plan(arch, stage=2, ep=8, run=run)
    terms = planned.activation_detail.terms
    rows = 4096 * arch.top_k  # a rank's experts get B T k rows (balanced)
    assert terms["moe_dispatched_rows"] == 2 * rows * arch.dim * 2  # the experts' input and the combined rows
    assert terms["moe_experts"] == 4 * rows * arch.expert_ffn_dim * 2
    top4 = _plan(MoEConfig.from_name("mixtral_8x7b", top_k=4), stage=2, ep=8, run=run)
    assert top4.memory.activations > planned.memory.activations


def test_layouts_the_model_refuses_are_refused_before_launch():
    common = dict(stage=3, world_size=64, devices_per_node=8, seq_len=4096, hardware=H100)
    with pytest.raises(ValueError, match=r"ep\(3\) does not divide n_experts\(8\)"):
        plan_run("mixtral_8x7b", ep=3, **{**common, "world_size": 48})
    with pytest.raises(ValueError, match=r"ep\(128\) does not divide"):
        plan_run("qwen3_30b_a3b", ep=128, **common)  # more than the 64 ranks
    with pytest.raises(ValueError, match=r"seq_len\(4095\) does not split over tp\(2\)"):
        plan_run("qwen3_30b_a3b", tp=2, ep=8, **{**common, "seq_len": 4095})
    with pytest.raises(ValueError, match=r"has no expert layers"):
        plan_run("7b", ep=8, **common)


def test_the_search_chooses_ep_with_tp_dp_and_the_stage():
    from lightning_zero.planner import search_layouts

    result = search_layouts("mixtral_8x7b", world_size=64, devices_per_node=8, global_batch=1024, seq_len=4096,
                            hardware=H100, topology=False)  # fmt: skip
    layouts = [entry.layout for entry in result.ranked]
    assert {layout.ep for layout in layouts} >= {1, 2, 4, 8} and {layout.tp for layout in layouts} >= {1, 2}
    best = result.ranked[0]
    assert best.layout.ep > 1 and f"strategy.ep={best.layout.ep}" in best.layout.overrides()
    assert best.plan.tokens_per_s > max(e.plan.tokens_per_s for e in result.ranked if e.layout.ep == 1)


def test_plan_recipe_shows_that_it_fits_on_its_gpus_and_nodes():
    from rich.console import Console

    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import run_plan

    buffer = io.StringIO()
    result = run_plan(compose(["recipe=mixtral_8x7b"]), console=Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "64 ranks (8 nodes x 8): dp=64 x tp=1, experts over ep=8 (edp=8)" in text
    assert "verdict (stage 2): fits" in text and "ep all-to-all bytes / step" in text
    ddp, *zero = result["stages"]
    assert (ddp["stage"], ddp["ep"], ddp["tp"], ddp["expert_params_per_rank"]) == (0, 1, 1, 0)  # plain ddp
    assert all(stage["ep"] == 8 for stage in zero) and result["plan"]["fits"]


def test_a_plan_that_does_not_fit_suggests_splitting_the_experts():
    tight = plan_run("qwen3_30b_a3b", stage=2, world_size=32, devices_per_node=8, seq_len=4096, micro_batch=2,
                     hardware=H100)  # fmt: skip
    assert not tight.fits and tight.ep == 1
    assert tight.suggestions[0].startswith("ep=2 + activation_checkpointing=true (")
    split = plan_run("qwen3_30b_a3b", stage=2, ep=2, activation_checkpointing=True, world_size=32, devices_per_node=8,
                     seq_len=4096, micro_batch=2, hardware=H100)  # fmt: skip
    assert split.fits and f"({split.memory.total / 2**30:.1f} GiB)" in tight.suggestions[0]
    dense = plan_run("7b", stage=1, world_size=8, devices_per_node=8, seq_len=4096, micro_batch=8, hardware=H100)
    assert not any(fix.startswith("ep=") for fix in dense.suggestions)  # no experts to split
