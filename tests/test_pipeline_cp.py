"""Context parallelism inside pipeline stages (docs/pipeline.md): pp=2 x cp=2 on 4 gloo ranks.

Engine level: torch's schedules over Llama stages whose attention runs over each stage's cp group
(Ulysses, and the ring where the heads do not split) give one process's loss and gradients, and
move the planned bytes: point-to-point (each cp rank sends its ``T/cp`` slice to its peer stage),
the cp exchanges, and the activations saved per micro-batch. Trainer level (tests/scripts/pp_parity.py,
one launch): ``LlamaLM`` under ``ZeroStrategy(pp=2, cp=2)`` at ZeRO stages 1-3 against Lightning's
ddp on the same 4 ranks: losses, validation losses, trained weights and predicted logits.
"""

import pytest
import torch

from tests.distributed import joined_ranks, launch_each, rank_result, run_ranks

CONFIG = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
RING = dict(CONFIG, dim=48, n_heads=3, n_kv_heads=1)  # 3 heads do not split over cp=2: ring attention
# (schedule, stages per rank, micro-batches)
ENGINE_CASES = {"ulysses": [("1f1b", 1, 2)], "ring": [("interleaved_1f1b", 2, 4)]}  # zbv: the Trainer launch


def _reference(config, batch, targets):
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama, cross_entropy_loss

    torch.manual_seed(0)
    model = Llama(LlamaConfig(name="pp-cp-test", **config))
    loss = cross_entropy_loss(model(batch), targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _planned(config, layout, micro_batch: int, seq_len: int):
    """The planner's numbers for one rank's step under pp=2 x cp=2 (fp32): the pipeline plan and
    the cp exchanges' bytes of one micro-batch through the whole model."""
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.planner.ledger import llama_activation_bytes
    from lightning_zero.planner.pipeline import StageShape, plan_pipeline, unit_param_counts
    from lightning_zero.planner.traffic import cp_bytes_by_kind

    model = LlamaConfig(name="pp-cp-test", **config)
    acts = llama_activation_bytes(model, micro_batch=micro_batch, seq_len=seq_len, act_bytes=4, cp=2)
    shape = StageShape(micro_batch=micro_batch, seq_len=seq_len, dim=model.dim, act_bytes=4, cp=2)
    exchanged = cp_bytes_by_kind(model, tokens=micro_batch * seq_len, cp=2, act_bytes=4)
    return plan_pipeline(layout, acts, shape, unit_param_counts(model)), exchanged


def _cp_pipeline_cases(rank, world, batch, targets, references):
    """Each ``(config, schedule)``: one step on fresh stages (the loss and gradients against one
    process), then a second one counted against the plan."""
    import torch.distributed as dist

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.comm.mesh import ParallelDims, build_groups
    from lightning_zero.cp.batch import context_slices
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama
    from lightning_zero.models.llama.pipeline import llama_stages
    from lightning_zero.pp.layout import PipelineLayout
    from lightning_zero.pp.measure import MeasuredStage, SavedPerMicrobatch, schedule_stages
    from lightning_zero.pp.schedule import build_schedule, run_step

    dims = ParallelDims(world_size=world, devices_per_node=world, cp=2, pp=2)
    groups = build_groups(dims)
    pp_rank, cp_rank = groups.rank_in("pp"), groups.rank_in("cp")
    inputs, labels = context_slices((batch, targets), 2, cp_rank)  # this cp rank's slice of every sequence
    for name, config in (("ulysses", CONFIG), ("ring", RING)):
        want_loss, want_grads = references[name]
        for schedule, virtual, microbatches in ENGINE_CASES[name]:
            torch.manual_seed(0)
            counter = CommCounter()
            model = parallelize_context(Llama(LlamaConfig(name="pp-cp-test", **config)), groups.cp, counter=counter)
            layout = PipelineLayout(
                pp=2, schedule=schedule, n_layers=config["n_layers"], microbatches=microbatches, virtual_stages=virtual
            )
            stages = llama_stages(model, layout, pp_rank)
            pipeline = build_schedule(layout, stages, groups.pp, torch.device("cpu"), model.loss_fn, MeasuredStage)
            loss = run_step(pipeline, layout, pp_rank, inputs, labels)
            if loss is not None:  # the global token mean over the cp group: one process's loss
                torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6, msg=f"{name} {schedule}")
            for stage in stages.values():
                for param_name, param in stage.named_parameters():
                    grad = param.grad.clone()  # each cp rank's share: summed over cp, then / cp
                    dist.all_reduce(grad, group=groups.cp)
                    torch.testing.assert_close(
                        grad / 2, want_grads[param_name], rtol=1e-5, atol=1e-6, msg=f"{name} {schedule} {param_name}"
                    )
            # a second step, counted: P2P bytes, saved activations and cp bytes exact
            micro_batch = batch.size(0) // microbatches
            plan, exchanged = _planned(config, layout, micro_batch, batch.size(1))
            planned = plan.ranks[pp_rank]
            counted = schedule_stages(pipeline)
            before = dict(counter.bytes)
            with SavedPerMicrobatch(stages) as saved:
                for stage in counted:
                    stage.reset()
                    stage.before_action.append(saved.sample)
                run_step(pipeline, layout, pp_rank, inputs, labels)
            sent, received = sum(s.sent_bytes for s in counted), sum(s.received_bytes for s in counted)
            assert (sent, received) == (planned.p2p_sent, planned.p2p_received), (name, schedule, sent, received)
            per_microbatch = [{saved.bytes_of(stage, mb) for mb in range(microbatches)} for stage in planned.stages]
            for index, stage in enumerate(planned.stages):
                for mb in range(microbatches):
                    got, want = saved.bytes_of(stage, mb), planned.saved_per_microbatch[index]
                    assert got == want, (name, schedule, stage, mb, got, want)
            assert saved.peak_alive == planned.in_flight_bytes, (name, schedule, saved.peak_alive)
            share = sum(len(layout.stage_blocks(s)) for s in planned.stages) / config["n_layers"]
            kind = "cp_ring_kv" if name == "ring" else "cp_all_to_all"
            got_exchanged, want_exchanged = counter.bytes[kind] - before[kind], microbatches * share * exchanged[kind]
            assert got_exchanged == pytest.approx(want_exchanged), (name, schedule, got_exchanged, want_exchanged)
            if rank in (0, 2):  # measured / planned, for docs/pipeline.md
                print(f"{name} {schedule} rank {rank}: P2P {sent} / {planned.p2p_sent}, {kind} {got_exchanged} /"
                      f" {want_exchanged}, saved {per_microbatch} / {planned.saved_per_microbatch}, most at once"
                      f" {saved.peak_alive} / {planned.in_flight_bytes}")  # fmt: skip


@pytest.mark.slow
def test_cp_inside_pipeline_stages_equals_one_process_and_moves_the_planned_bytes():
    torch.manual_seed(1)
    batch = torch.randint(0, CONFIG["vocab_size"], (4, 16))
    targets = torch.randint(0, CONFIG["vocab_size"], (4, 16))
    references = {name: _reference(config, batch, targets) for name, config in (("ulysses", CONFIG), ("ring", RING))}
    run_ranks(_cp_pipeline_cases, 4, args=(batch, targets, references), timeout_s=240)


# tests/scripts/pp_parity.py, one launch of 4 ranks: fp32, accumulate_grad_batches=2, norm clipping,
# validation before, during and after training, predict after fit; ddp on the same 4 ranks (one
# sequence each) against pp=2 x cp=2 (each rank a 1/2 slice of all 4 sequences); 3 query heads: the ring
LAUNCH = (4, ["ddp4_ring", "pp2cp2ring_1f1b_zero1", "pp2cp2ring_1f1b_zero2", "pp2cp2ring_zbv_zero1",
              "pp2cp2ring_interleaved_zero2", "pp2cp2ring_1f1b_zero3"])  # fmt: skip
PP_CP_CASES = LAUNCH[1][1:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return launch_each("pp_parity.py", tmp_path_factory.mktemp("ppcp"), [LAUNCH], timeout_s=400)


def _joined(results, case: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    return joined_ranks(results, case, LAUNCH[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", PP_CP_CASES)
def test_cp_inside_pipeline_stages_under_the_trainer_matches_ddp(trained, case):
    losses, val_losses, params = _joined(trained, case)
    want_losses, want_val, want_params = _joined(trained, "ddp4_ring")
    assert losses.shape == want_losses.shape == (8,) and val_losses.shape == want_val.shape == (3,)
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(val_losses, want_val, rtol=0, atol=1e-5)
    for rank in range(LAUNCH[0]):  # every rank returns the whole batch's loss (the cp reduction)
        torch.testing.assert_close(
            torch.tensor(rank_result(trained, case, rank)["losses"]), want_losses, rtol=0, atol=1e-5
        )
    assert set(params) == set(want_params)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)
    # predict after fit: each rank predicted its cp slice of both rows, joined over cp by the script
    want = rank_result(trained, "ddp4_ring", 0)["predicted"]
    for rank in range(LAUNCH[0]):
        torch.testing.assert_close(rank_result(trained, case, rank)["predicted"], want, rtol=0, atol=1e-5)


def test_pp_with_cp_is_planned_before_any_process_group_with_every_cp_group_inside_a_stage():
    import torch.distributed as dist

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.session import ZeroSession

    session = ZeroSession(ZeroConfig(stage=2, pp=2, cp=2, tensor_parallel_size=2, sequence_parallel=True))
    dims = session.plan_layout(num_nodes=1, num_processes=8, module=LlamaLM({**CONFIG, "name": "tiny"}))
    # pp outermost, then dp, cp, tp: rank 5 is pp rank 1's (cp 0, tp 1); its peer stage holds the same slice
    groups = {kind: getattr(dims, f"{kind}_ranks")(5) for kind in ("pp", "cp", "tp", "dp_cp")}
    assert groups == {"pp": [1, 5], "cp": [5, 7], "tp": [4, 5], "dp_cp": [5, 7]}
    assert not dist.is_initialized()


def test_cp_inside_pipeline_stages_is_refused_where_it_does_not_run_yet_naming_the_fix():
    """A MoELM's stages run ep, not cp: refused before any process group. The Fabric door plans a
    Llama's (its loop cuts each batch: tests/test_pipeline_fabric.py runs it)."""
    import torch.distributed as dist

    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama
    from lightning_zero.models.moe import MoELM
    from lightning_zero.runtime.pipeline import pipeline_layout
    from lightning_zero.runtime.session import ZeroSession

    moe = {**CONFIG, "name": "tiny_moe_pp", "n_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "aux_loss_coef": 0.0,
           "z_loss_coef": 0.0}  # fmt: skip
    session = ZeroSession(ZeroConfig(stage=1, pp=2, cp=2))
    with pytest.raises(
        ValueError, match="MoETransformer's .* run ZeRO data parallelism and tp and ep .* use cp=1 with pp > 1"
    ):
        session.plan_layout(num_nodes=1, num_processes=4, module=MoELM(moe))
    assert not dist.is_initialized()
    dims = ParallelDims(world_size=4, devices_per_node=4, cp=2, pp=2)
    assert pipeline_layout(ZeroConfig(stage=2, pp=2, cp=2), dims, Llama(LlamaConfig(name="tiny", **CONFIG))).pp == 2
