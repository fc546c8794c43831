"""ZeroFabricStrategy (the Fabric door) against Fabric's own ddp, 2 CPU processes, same seed and data.

Three script launches (tests/scripts/fabric_run.py) run every case in turn: parity per model and
stage, LitGPT's setup order, the step-3 save; fresh processes resuming it (2 ranks, other stages; 1
rank); and a rank that raises mid-loop. Each test compares what the ranks wrote.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_zero.ledger import model_state_bytes
from tests.distributed import ROOT, launch, launch_ranks, script_env
from tests.ulps import adam_ulps, assert_close_ulps

HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
NO_LITGPT = (
    "litgpt is not installed (CI: pip install --no-deps 'litgpt==0.5.13'; litgpt.model needs torch and lightning only)"
)
MODELS = ["llama", "gpt2", "moe", "litgpt"]
STAGES = ["zero1", "zero2", "zero3"]
RESUMES = ["zero2@zero2", "zero1@zero2", "zero3@zero2"]  # <loaded by>@<saved by>, 2 ranks


def _needs(model: str) -> None:
    if model.startswith("litgpt") and not HAS_LITGPT:
        pytest.skip(NO_LITGPT)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, "stage"),
        ({"state_dict_type": "dcp"}, "state_dict_type"),
        ({"config": "zero2", "stage": 2}, "not both"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    from lightning_zero import ZeroFabricStrategy

    with pytest.raises(ValueError, match=match):
        ZeroFabricStrategy(**kwargs)


def test_every_knob_is_honoured_or_refused_by_the_fabric_door():
    """[Note: knobs at the Fabric door]: no ZeroConfig field is dropped. Each is honoured (the strategy
    reads it from the one config) or refused at construction, by keyword or in a config object."""
    import dataclasses

    from lightning_zero import ZeroFabricStrategy, ZeroStrategy
    from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig
    from lightning_zero.fabric.strategy import FABRIC_HONOURS, FABRIC_REFUSES

    fields = set(ZERO_DEFAULTS.as_dict())
    assert FABRIC_HONOURS | set(FABRIC_REFUSES) == fields and not FABRIC_HONOURS & set(FABRIC_REFUSES)
    for name in FABRIC_REFUSES:
        value = True if isinstance(getattr(ZERO_DEFAULTS, name), bool) else 2
        config = dataclasses.replace(ZeroConfig(stage=2), **{name: value},
                                     **({"tensor_parallel_size": 2} if name == "sequence_parallel" else {}))  # fmt: skip
        with pytest.raises(ValueError, match="ZeroFabricStrategy.*Fabric door cannot honour"):
            ZeroFabricStrategy(config=config)
    assert ZeroFabricStrategy(config=ZeroStrategy(stage=2, monitor=False).zero_config).monitor is False


def test_registered_in_fabric_with_the_trainer_strategys_config():
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    assert {"zero1", "zero2", "zero3"} <= set(STRATEGY_REGISTRY)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero3")
    assert isinstance(fabric.strategy, ZeroFabricStrategy) and fabric.strategy.stage == 3
    twin = ZeroFabricStrategy(config=ZeroStrategy(stage=2, bucket_mb=4.0).zero_config)
    assert (twin.stage, twin.bucket_mb) == (2, 4.0)
    with pytest.raises(ValueError, match="supported: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true"):
        L.Fabric(accelerator="cpu", devices=1, strategy="zero2", precision="64-true")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    models = [m for m in MODELS if m != "litgpt" or HAS_LITGPT]
    cases = [f"parity:{m}_{s}" for m in models for s in ["ddp", *STAGES]]
    if HAS_LITGPT:
        cases += ["parity:litgpt_order_ddp", "parity:litgpt_order_zero3"]
    cases += [f"parity:llama_{s}bf16" for s in ["ddp", *STAGES]] + ["parity:llama_zero2defer"]
    cases += ["save:zero2", "save:zero3"]
    launch("fabric_run.py", out, *cases, timeout_s=500)
    # fresh processes: the checkpoint of step 3 on 2 ranks (other stages), then on 1 rank
    launch("fabric_run.py", out, *[f"resume:{case}" for case in RESUMES], timeout_s=300)
    launch("fabric_run.py", out, "resume:zero1@zero3", "resume:zero3@zero3", timeout_s=300, ranks=1)
    return out


def _load(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", MODELS)
def test_losses_norms_and_weights_match_fabric_ddp(runs, model, stage):
    # 4 steps of 2 micro batches (no_backward_sync), clip_gradients(max_norm=0.5), AdamW with weight decay.
    _needs(model)
    for rank in (0, 1):
        got, want = _load(runs, f"{model}_{stage}", rank), _load(runs, f"{model}_ddp", rank)
        assert len(got["losses"]) == len(want["losses"]) == 4
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-6)
        assert max(want["norms"]) > 0.5  # the clipping clipped
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{model} {stage} {name}")


@pytest.mark.slow
def test_bf16_mixed_keeps_bf16_parameters_and_stays_near_ddp(runs):
    # bf16-mixed, tolerances in bf16 ulps of the values compared ([Note: tolerances in ulps] in
    # tests/ulps.py). Stages 2 and 3 keep the same bf16 parameters and reduce the same bf16 gradients
    # (two ranks: one commutative add), but the clip norm sums the squares of differently cut shards
    # (stage 2's flat groups, stage 3's units), so it can differ in its last fp32 bit: the paths are
    # not bitwise equal by design. The fp32 masters then differ in their last bits, a master at a bf16
    # rounding boundary flips its compute weight to the neighbour, and from there the gradients differ
    # by bf16 roundings as any two bf16 runs' do. The losses, fp32 means over bf16 logits, each within
    # half a bf16 ulp of the same exact value: 1 ulp of the loss apart at most, stage against stage
    # and against ddp (which rounds each gradient once less; stage 1 accumulates the micro batches'
    # full bf16 gradients before reducing). The weights: two runs' AdamW steps may turn apart where a
    # gradient's last bits differ (tests/ulps.adam_ulps): lr 1e-2 / (1 + step) over the 4 steps.
    for rank in (0, 1):
        runs_of = {stage: _load(runs, f"llama_{stage}bf16", rank) for stage in ["ddp", *STAGES]}
        for stage in STAGES:
            assert runs_of[stage]["param_dtypes"] == ["torch.bfloat16"]
            assert_close_ulps(runs_of[stage]["losses"], runs_of["ddp"]["losses"], 1, torch.bfloat16, msg=stage)
        assert_close_ulps(runs_of["zero3"]["losses"], runs_of["zero2"]["losses"], 1, torch.bfloat16)
        for name, value in runs_of["zero2"]["params"].items():
            ulps = adam_ulps(value, torch.bfloat16, lr_sum=1e-2 * (1 + 1 / 2 + 1 / 3 + 1 / 4))
            assert_close_ulps(runs_of["zero3"]["params"][name], value, ulps, torch.bfloat16, magnitude="max", msg=name)


@pytest.mark.slow
def test_moe_skips_idle_experts_on_every_stage(runs):
    # The parity above covers it; here: experts really were skipped, on each rank.
    for rank in (0, 1):
        idle = {stage: _load(runs, f"moe_{stage}", rank)["idle"] for stage in ["ddp", *STAGES]}
        assert idle["ddp"] > 0 and len(set(idle.values())) == 1, idle


@pytest.mark.slow
def test_no_gradient_collective_on_skipped_micro_batches(runs):
    # stage 1, and stage 2 with defer_grad_reduce; stage 2 without it reduce-scatters every micro
    # batch (its memory promise: the gradient shard only)
    for rank in (0, 1):
        for case in ("llama_zero1", "llama_zero2defer"):
            skipped = _load(runs, case, rank)["skipped"]
            assert len(skipped) == 4 and all(calls == {} for calls in skipped), (case, skipped)
        assert all(calls for calls in _load(runs, "llama_zero2", rank)["skipped"])
        got, want = _load(runs, "llama_zero2defer", rank), _load(runs, "llama_ddp", rank)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-5)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_bytes_per_rank_are_the_planners(runs, stage):
    got = _load(runs, f"llama_{stage}", 0)["bytes"]
    want = model_state_bytes(got["num_params"], stage=int(stage[-1]), dp=2, param_bytes=4, grad_bytes=4,
                             optim_bytes_per_param=8)  # fmt: skip
    measured, padding = got["measured"], got["padding"]
    assert 0 <= measured["params"] - want.params <= padding * 4
    assert 0 <= measured["grads"] - want.grads <= padding * 4
    assert 0 <= measured["optimizer"] - got["beyond_formula"] - want.optimizer <= padding * 8


@pytest.mark.slow
def test_litgpt_order_with_empty_init_matches_ddp(runs):
    # init_module(empty_init=True) (stage 3: meta, materialized unit by unit), setup(model), the
    # optimizer over model.parameters(), setup_optimizers, load_raw; then model.load_state_dict of the
    # initial weights writes through to the shards: an evaluation loss equals the first loss, and
    # the next step equals ddp's; greedy generation (a no_grad forward per token) equals ddp's.
    _needs("litgpt")
    for rank in (0, 1):
        got, want = _load(runs, "litgpt_order_zero3", rank), _load(runs, "litgpt_order_ddp", rank)
        assert got["deferred"]  # the engine came at load_raw: nothing gathered for the optimizer
        assert set(got["state_dict"]) == set(want["state_dict"])  # stage 3: gathered, as ddp's
        for name, value in want["state_dict"].items():
            torch.testing.assert_close(got["state_dict"][name], value, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-5)
        assert got["eval_loss"] == pytest.approx(got["losses"][0][0], abs=1e-6)
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-6)
        assert torch.equal(got["generated"], want["generated"])  # token by token under no_grad
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", [*RESUMES, "zero1@zero3", "zero3@zero3"])
def test_resume_equals_the_uninterrupted_run(runs, case):
    loaded_by, saved_by = case.split("@")
    world = 2 if case in RESUMES else 1
    for rank in range(world):
        got = _load(runs, f"resume_{loaded_by}_from_{saved_by}_w{world}", rank)
        want = _load(runs, f"save_{saved_by}", rank)
        if world == 2:  # each rank's own losses; on 1 rank, the mean over both ranks' batches
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            torch.tensor(got["mean_losses"]), torch.tensor(want["mean_losses"]), rtol=0, atol=1e-5
        )
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=name)
        # the full file of step 3, loaded into the sharded model, is the weights of step 3
        for name, value in want["params_at_save"].items():
            torch.testing.assert_close(got["params_from_full"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_checkpoint_layout_and_full_file(runs):
    assert _load(runs, "save_zero2", 0)["layout"] == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rank0.json", "rank1.json"
    ]  # fmt: skip
    assert not [p.name for p in runs.iterdir() if p.name.startswith(".lightning_zero-") or p.name.endswith(".partial")]
    # the full file is a plain state dict LitGPT's tools (and the model itself) read without lightning_zero
    full = torch.load(runs / "full_zero2.pth", weights_only=True)
    assert full["iter_num"] == 3
    from lightning_zero.models import Llama, LlamaConfig

    config = LlamaConfig.from_name("tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   max_seq_len=8)  # fmt: skip
    Llama(config).load_state_dict(full["model"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_a_rank_raising_in_the_loop_ends_every_rank_naming_it(tmp_path, stage):
    argv = [sys.executable, str(ROOT / "tests" / "scripts" / "fabric_run.py"), str(tmp_path), f"fail:{stage}"]
    codes, tails = launch_ranks(argv, cwd=tmp_path, env=script_env(ROOT), timeout_s=120, log_prefix="fail")
    ended = time.time()
    assert codes == [1, 1], tails
    raised = json.loads((tmp_path / "raised_at").read_text())
    assert ended - raised < 10, tails
    rank0 = (tmp_path / "fail.rank0.log").read_text()
    assert "PeerFailedError" in rank0 and "global rank 1" in rank0 and "boom at step 3 on rank 1" in rank0, tails


@pytest.mark.slow
def test_the_fabric_pretrain_example_trains_saves_and_resumes(tmp_path):
    example = str(ROOT / "examples" / "fabric_pretrain.py")
    common = ["--devices", "2", "--out", str(tmp_path / "run"), "--save-every", "2"]
    for steps, extra in ((4, []), (6, ["--export-full"])):
        argv = [sys.executable, example, *common, "--max-steps", str(steps), *extra]
        codes, tails = launch_ranks(argv, cwd=tmp_path, env=script_env(ROOT), timeout_s=180, log_prefix=f"ex{steps}")
        assert codes == [0, 0], tails
    first = (tmp_path / "ex4.rank0.log").read_text()
    second = (tmp_path / "ex6.rank0.log").read_text()
    assert "step 4: loss" in first and "resumed from" not in first, first
    assert "at step 4" in second and "step 5: loss" in second and "step 6: loss" in second, second
    assert "step 1: loss" not in second and "val loss" in second
    weights = torch.load(tmp_path / "run" / "lit_model.pth", weights_only=True)["model"]
    assert "tok_embeddings.weight" in weights and "layers.0.attention.wq.weight" in weights
