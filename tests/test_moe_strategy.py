"""Expert parallelism under ZeroStrategy against Lightning's ddp without EP (issue 54 item 4).

One launch of tests/scripts/moe_vs_ddp.py per world size trains ``MoELM`` (``tiny_moe_shared``) in
fp32 with accumulation 2 and clipping: on 2 ranks ddp and ``ep=2`` at stages 1-3, on 4 ranks ddp,
``ep=4`` at stages 1-3 and ``ep=2`` (two EP groups, experts sharded over an EDP group of 2) at stage
2, and ``tp=2`` (sequence-parallel) x ``ep=2`` at stages 1-3 and without sequence parallelism at
stage 2 (against the 2-rank ddp: its dp ranks).
Micro-batch 2 routes no token to the last ``8 / world`` experts (under ``ep = world`` the last
rank receives zero tokens for all of its experts), micro-batch 3 none from rank 0 to expert 0.
Per-micro-batch losses and the trained weights must equal ddp's to 1e-5 (an EP rank's experts
against the same rows of ddp's), and the all-to-all bytes counted from the split sizes must equal
``planner.moe.all_to_all_bytes`` of the routing counts the ranks saw.

A third launch (tests/scripts/moe_resume.py, 4 ranks) resumes across ep 2 -> 1 -> 4 (stages 2, 2,
3) and across tp=2 x ep=2 -> tp=1 x ep=4 against uninterrupted runs, and exports the ep=4
checkpoint as a Hugging Face Qwen3-MoE directory, which transformers loads strictly with the uninterrupted run's weights.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.planner.moe import MOE_EXCHANGES, all_to_all_bytes
from tests.distributed import launch

LAUNCHES = {
    2: ["ddp", "zero1_ep2", "zero2_ep2", "zero3_ep2", "ddp_bias", "zero2_ep1_bias", "zero2_ep2_bias"],
    4: ["ddp", "zero1_ep4", "zero2_ep4", "zero3_ep4", "zero2_ep2", "zero1_tp2_ep2", "zero2_tp2_ep2", "zero3_tp2_ep2",
        "zero2_tp2_ep2_nosp", "ddp_bias", "zero3_ep4_bias", "zero1_tp2_ep2_bias"],
}  # fmt: skip
CASES = [(world, case) for world, cases in LAUNCHES.items() for case in cases if not case.startswith("ddp")]
STEERED = [(world, case) for world, case in CASES if not case.endswith("_bias")]
EP_ONLY = [(world, case) for world, case in STEERED if "_tp" not in case]
BIAS = [(world, case) for world, case in CASES if case.endswith("_bias")]
BIAS_UPDATE_RATE = 0.01  # tests/scripts/moe_vs_ddp.py
TOL = 1e-5
N_EXPERTS, DIM = 8, 64  # tiny_moe_shared


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world, cases in LAUNCHES.items():
        where = tmp_path_factory.mktemp(f"moe_ranks{world}")
        launch("moe_vs_ddp.py", where, *cases, timeout_s=900, ranks=world)
        out[world] = {case: [torch.load(where / f"{case}.rank{r}.pt") for r in range(world)] for case in cases}
    return out


def _ep(case: str) -> int:
    return int(case.split("_ep")[1].split("_")[0])


def _tp(case: str) -> int:
    return int(case.split("_tp")[1].split("_")[0]) if "_tp" in case else 1


@pytest.mark.parametrize("world,case", CASES)
def test_losses_and_weights_equal_ddp(results, world, case):
    """A case with ``tp`` ranks per TP group is ddp on ``world / tp`` ranks (its dp ranks)."""
    tp = _tp(case)
    reference = results[world // tp]["ddp_bias" if case.endswith("_bias") else "ddp"]
    ranks = results[world][case]
    for rank in range(world):
        ours, theirs = ranks[rank], reference[rank // tp]
        assert len(ours["losses"]) == len(theirs["losses"]) == 6
        worst_loss = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
        assert worst_loss < TOL, (rank, ours["losses"], theirs["losses"])
        n_local = N_EXPERTS // _ep(case)
        for name, value in ours["params"].items():
            expected = theirs["params"][name]
            if ".moe.experts." in name:
                layer = int(name.split(".")[1]) - 1  # layer 0 is dense (tiny_moe_shared)
                first = ours["offsets"][layer]
                assert first == (rank // tp % _ep(case)) * n_local
                expected = expected[first : first + n_local]
            torch.testing.assert_close(value, expected, rtol=0, atol=TOL, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("world,case", EP_ONLY)
def test_all_to_all_bytes_equal_the_planner(results, world, case):
    ep, ranks = _ep(case), results[world][case]
    for rank in range(world):
        group = [rank - rank % ep + i for i in range(ep)]
        predicted = dict.fromkeys(MOE_EXCHANGES, 0.0)
        for micro_batch in range(len(ranks[rank]["loads"])):
            counts = [ranks[member]["loads"][micro_batch] for member in group]
            sent = all_to_all_bytes(counts, rank=rank % ep, ep=ep, row_bytes=DIM * 4)
            for label, value in sent.items():
                predicted[label] += value
        counted = {label: ranks[rank]["counted"].get(label, 0.0) for label in MOE_EXCHANGES}
        assert counted == predicted, (rank, counted, predicted)
        assert all(value > 0 for value in counted.values())


def _planned(world: int, case: str):
    """``arithmetic.plan`` of one launched case (``tiny_moe_shared``, fp32, 2 x 16 tokens, accumulation 2)."""
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.config import ZeroConfig
    from lightning_zero.planner.arithmetic import PlanOptions, RunShape, plan

    tp, ep = _tp(case), _ep(case)
    sequence_parallel = tp > 1 and not case.endswith("_nosp")  # tests/scripts/moe_vs_ddp.py
    config = ZeroConfig(stage=int(case[4]), ep=ep, bucket_mb=0.02, tensor_parallel_size=tp,
                        sequence_parallel=sequence_parallel)  # fmt: skip
    dims = ParallelDims.from_config(config, world_size=world, devices_per_node=world)
    run = RunShape("32-true", micro_batch=2, seq_len=16, accumulate_grad_batches=2)
    return plan("tiny_moe_shared", config, dims, run, PlanOptions(simulate=False, suggest=False))


@pytest.mark.parametrize("world,case", STEERED)
def test_model_state_bytes_per_rank_equal_the_planner(results, world, case):
    """Issue 54 item 5: per rank, dense states over dp*cp and the rank's experts / ep over edp
    (under tp=2 the dense matrices split, the MoE layers whole): the engine's measured bytes at every
    step's end equal the one planner's (``arithmetic.plan``) for the same run."""
    from lightning_zero.models.moe import MoEConfig
    from lightning_zero.planner.workload import layer_tensors

    planned = _planned(world, case)
    want = (planned.memory.params, planned.memory.grads)
    # AdamW also keeps a 4-byte fp32 step count per tensor it steps (a rank steps a view per owned
    # run of a parameter: at most one per tensor), which the planner's 8 bytes per element leave out
    model = MoEConfig.from_name("tiny_moe_shared")
    tensors = 3 + sum(len(layer_tensors(model, layer)) for layer in range(model.n_layers))
    for rank, record in enumerate(results[world][case]):
        assert len(record["monitor"]) == 3
        for step in record["monitor"]:
            got = tuple(step[f"zero/measured_{key}_bytes"] for key in ("params", "grads"))
            assert got == want, (rank, got, want)
            steps = step["zero/measured_optimizer_bytes"] - planned.memory.optimizer
            assert 0 < steps <= 4 * tensors and steps % 4 == 0, (rank, steps)


@pytest.mark.parametrize("world,case", STEERED)
def test_zero_and_tp_bytes_per_rank_equal_the_planner(results, world, case):
    """The bytes every rank counted over the 3 steps beside the planner's per step, x 3: ZeRO's
    reduce-scatters and all-gathers per domain (dense over dp*cp, experts over edp), exactly at
    stages 1-2 and the reduce-scatters at stage 3 (its all-gathers differ in the first step, before
    the schedule is recorded: tests/test_stage3.py compares them from step 2 on); and under tp=2,
    with and without sequence parallelism, the TP collectives of the blocks (a MoE block keeps
    attention's only), the MoE layers' gradients and the norm gains summed over TP. What the
    planner leaves out: the loss's all-reduces and the auxiliary losses' and loads' (a few bytes)."""
    planned = _planned(world, case)
    stage, tp = int(case[4]), _tp(case)
    links = planned.traffic.dp_link_bytes
    want = {"reduce_scatter_grads": 3 * links.by_kind("reduce_scatter")}
    if stage < 3:
        want["all_gather_params"] = 3 * links.by_kind("all_gather")
    want.update({label: 3 * sent for label, sent in planned.traffic.tp_bytes_by_kind.items()})
    aux = []
    for rank, record in enumerate(results[world][case]):
        counted = record["counted"]
        got = {label: counted.get(label, 0.0) for label in want}
        if "tp_all_reduce" in want:  # the activations' all-reduces and the auxiliary losses'
            aux.append(got["tp_all_reduce"] - want["tp_all_reduce"])
            got["tp_all_reduce"] = want["tp_all_reduce"]
        elif tp > 1:
            aux.append(counted.get("tp_all_reduce", 0.0))
        assert got == want, (rank, got, want)
    assert all(0 < extra <= 100 * 6 for extra in aux) and len(set(aux)) <= 1, aux  # < 100 bytes a micro-batch


@pytest.mark.parametrize("world,case", BIAS)
def test_bias_update_is_the_global_sign_rule_and_equals_ddp(results, world, case):
    """[Note: bias update]: each step moves a layer's bias by rate * sign(mean - load) of the step's
    assignments summed over every dp rank (recomputed here from ddp's per-rank loads), on every rank
    of every layout: so the routing, the losses and the weights (the test above) equal ddp's."""
    tp = _tp(case)
    reference = results[world // tp]["ddp_bias"]
    dp = len(reference)
    loads = torch.tensor([record["loads"] for record in reference])  # (dp, micro-batches, layers, experts)
    expected = torch.zeros(loads.shape[2:])
    for step in range(loads.shape[1] // 2):  # accumulation 2
        step_load = loads[:, 2 * step : 2 * step + 2].sum(dim=(0, 1))
        expected += BIAS_UPDATE_RATE * torch.sign(step_load.sum(-1, keepdim=True) - step_load.shape[-1] * step_load)
    assert expected.abs().sum() > 0 and (expected > 0).any() and (expected < 0).any()
    for rank in range(dp):
        torch.testing.assert_close(torch.stack(reference[rank]["biases"]), expected, rtol=0, atol=1e-7)
    for rank, record in enumerate(results[world][case]):
        torch.testing.assert_close(torch.stack(record["biases"]), expected, rtol=0, atol=1e-7, msg=f"rank {rank}")


@pytest.mark.parametrize("world", list(LAUNCHES))
def test_steered_steps_starve_a_rank_and_an_expert(results, world):
    ranks = results[world]["ddp"]
    n_last = N_EXPERTS // world
    for rank in range(world):
        starved = torch.tensor(ranks[rank]["loads"][2])  # (moe layers, experts)
        assert starved[:, -n_last:].sum() == 0 and starved.sum() > 0
        expert0 = torch.tensor(ranks[rank]["loads"][3])[:, 0]
        assert (expert0 == 0).all() if rank == 0 else (expert0 > 0).all()


@pytest.mark.parametrize("world,case", [(2, "zero2_ep2"), (4, "zero3_ep4")])
def test_monitor_logs_tokens_per_expert_and_the_aux_losses(results, world, case):
    for rank, record in enumerate(results[world][case]):
        assert len(record["monitor"]) == 3  # one entry per optimizer step
        for step, logged in enumerate(record["monitor"]):
            loads = torch.tensor(record["loads"][2 * step : 2 * step + 2]).sum(0)  # the step's 2 micro-batches
            for layer, counts in enumerate(loads):
                assert logged[f"moe/layer{layer}/tokens_min"] == counts.min().item()
                assert logged[f"moe/layer{layer}/tokens_max"] == counts.max().item()
                assert logged[f"moe/layer{layer}/tokens_mean"] == pytest.approx(counts.float().mean().item())
            assert logged["moe/balance_loss"] > 0 and logged["moe/z_loss"] > 0, (rank, logged)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    where = tmp_path_factory.mktemp("moe_resume")
    launch("moe_resume.py", where, timeout_s=900, ranks=4)
    return where


def test_resume_across_ep_2_1_4_equals_one_run(resumed):
    for rank in range(4):
        straight = torch.load(resumed / f"straight.rank{rank}.pt")
        ep2, ep1, ep4 = (torch.load(resumed / f"{case}.rank{rank}.pt") for case in ("ep2", "ep1", "ep4"))
        joined = ep2["losses"][:4] + ep1["losses"][:4] + ep4["losses"]  # steps 0-1, 2-3, 4-5 (2 micro-batches each)
        assert len(joined) == len(straight["losses"]) == 12
        assert max(abs(a - b) for a, b in zip(joined, straight["losses"])) < TOL, (rank, joined, straight["losses"])
        for name, value in ep4["params"].items():
            expected = straight["params"][name]
            if ".moe.experts." in name:
                first = ep4["offsets"][int(name.split(".")[1])]
                assert first == 2 * rank  # 8 experts over ep=4
                expected = expected[first : first + 2]
            torch.testing.assert_close(value, expected, rtol=0, atol=TOL, msg=f"rank {rank} {name}")


def test_resume_across_tp_and_ep_equals_one_run(resumed):
    """tp=2 x ep=2 (dp 2, micro-batches of 4) -> tp=1 x ep=4 (dp 4, micro-batches of 2) at the same
    global batch: each micro-batch's loss averaged over the dp ranks (TP ranks log the same) and the
    trained weights equal one ep=4 run's."""
    straight = [torch.load(resumed / f"tp_straight.rank{rank}.pt") for rank in range(4)]
    tp2 = [torch.load(resumed / f"tp2_ep2.rank{rank}.pt") for rank in (0, 2)]  # tp rank 0 of each dp rank
    tp1 = [torch.load(resumed / f"tp1_ep4.rank{rank}.pt") for rank in range(4)]

    def mean_losses(records, count=None):
        losses = torch.tensor([record["losses"][:count] for record in records])
        return losses.mean(dim=0)

    joined = torch.cat([mean_losses(tp2, 4), mean_losses(tp1)])  # steps 0-1, then 2-5 (2 micro-batches each)
    assert joined.numel() == 12
    torch.testing.assert_close(joined, mean_losses(straight), rtol=0, atol=TOL)
    for rank in range(4):
        for name, value in tp1[rank]["params"].items():
            torch.testing.assert_close(value, straight[rank]["params"][name], rtol=0, atol=TOL, msg=f"{rank} {name}")


def test_export_of_an_ep4_checkpoint_gathers_the_experts(resumed, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_zero.cli import main
    from lightning_zero.models.moe import MoETransformer

    main(["export", str(resumed / "ckpts" / "ep4" / "last.ckpt"), str(tmp_path / "hf"), "--format", "hf"])
    theirs, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    ours = MoETransformer.from_pretrained(tmp_path / "hf")
    straight = torch.load(resumed / "straight.rank0.pt")["params"]
    for name, value in straight.items():  # every expert, from the four ranks' rows
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=0, atol=TOL, msg=name)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(idx) - theirs.eval()(idx).logits).abs().max() < 1e-5
