"""Fabric's precisions (bf16-true, 16-mixed with the plugin's GradScaler) under ZeroFabricStrategy
against Fabric's own ddp under the same plugin, 2 CPU processes, same seed and data.

One launch of tests/scripts/fabric_precision.py runs every case in turn (about 25 s); each test
compares what the ranks wrote.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed import launch
from tests.ulps import adam_ulps, assert_close_ulps

STAGES = ["zero1", "zero2", "zero3"]
# bf16-true, 4 steps of 2 micro batches with clip_gradients(max_norm=0.5) ("btrue"), and of one
# batch without clipping ("btrue1"): stage -> (loss ulps, parameter tolerance), in bf16 ulps
# ([Note: tolerances in ulps] in tests/ulps.py).
# btrue1: the reduce-scatter adds the same two bf16 numbers ddp's all-reduce adds, and halving is
# exact ([Note: fp16 pre-division] in zero/reducer.py): equal, 0 ulps, on every stage.
# btrue: stage 1 accumulates the micro batches' gradients locally as ddp does; stages 2-3
# reduce-scatter each micro batch (another order of bf16 roundings), and ddp's clip_grad_norm_
# computes the norm and the clip coefficient in bf16 (the gradients' dtype) where the engine uses
# fp32. The losses, fp32 means over bf16 logits, each within half an ulp of the same exact value:
# 1 ulp apart at most. The weights: AdamW's steps may turn apart where a gradient's last bits differ,
# and the bf16 weights round once a step (ADAM: tests/ulps.adam_ulps, lr 1e-2 over 4 steps).
ADAM = "adam"
BF16_TRUE = {
    "btrue1": {"zero1": (0, 0), "zero2": (0, 0), "zero3": (0, 0)},
    "btrue": {"zero1": (1, ADAM), "zero2": (1, ADAM), "zero3": (1, ADAM)},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_precision")
    cases = [f"{mode}:{stage}" for mode in BF16_TRUE for stage in ["ddp", *STAGES]]
    cases += [f"{mode}:{stage}" for mode in ("fp16", "hf16") for stage in ["ddp", *STAGES, "zero2half"]]
    cases += ["fp16inf:ddp", "fp16inf:zero2", "fp16inf:zero3half", "fp16noclip:ddp", "fp16noclip:zero3"]
    cases += ["fp16save:zero2", "btrue1:zero2fp32", "bf16m:ddp"]
    launch("fabric_precision.py", out, *cases, timeout_s=400)
    return out


def _load(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


def test_precisions_map_to_the_engines_policy():
    import lightning as L
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.fabric.precision import policy_of

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero3", precision="bf16-true")
    assert isinstance(fabric.strategy.precision, HalfPrecision)
    policy = fabric.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype) == (torch.bfloat16, torch.bfloat16)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=2, master_weights="fp32"),
                      precision="16-true")  # fmt: skip
    policy = fabric.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype) == (torch.float16, torch.float32)
    fp16_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    policy = policy_of(fp16_plugin)  # fp32 parameters under autocast, as Fabric's ddp keeps them
    assert (policy.compute_dtype, policy.master_dtype, policy.loss_scaling) == (torch.float32, torch.float32, True)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=2, mixed_params="half"),
                      plugins=[fp16_plugin])  # fmt: skip
    policy = fabric.strategy.precision_policy
    assert (policy.compute_dtype, policy.master_dtype, policy.loss_scaling) == (torch.float16, torch.float32, True)
    with pytest.raises(ValueError, match=r"does not support precision='64-true'.*supported: 32-true"):
        L.Fabric(accelerator="cpu", devices=1, strategy="zero2", precision="64-true")


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(BF16_TRUE))
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_true_equals_fabric_ddp(runs, mode, stage):
    loss_ulps, param_tolerance = BF16_TRUE[mode][stage]
    for rank in (0, 1):
        got, want = _load(runs, f"{mode}_{stage}", rank), _load(runs, f"{mode}_ddp", rank)
        assert got["param_dtypes"] == want["param_dtypes"] == ["torch.bfloat16"]
        assert len(got["losses"]) == len(want["losses"]) == (8 if mode == "btrue" else 4)
        assert_close_ulps(got["losses"], want["losses"], loss_ulps, torch.bfloat16, msg=stage)
        for name, value in want["params"].items():
            ulps = adam_ulps(value, torch.bfloat16, lr_sum=4e-2, rounds=4) if param_tolerance == ADAM else 0
            assert_close_ulps(got["params"][name], value, ulps, torch.bfloat16, magnitude="max", msg=f"{stage} {name}")


# 16-mixed case -> loss tolerance against Fabric's ddp, in fp16 ulps of each loss. fp32 parameters
# under fp16 autocast (the default mixed_params): the same parameters, forward and fp32 gradients as
# ddp; the clip norm sums the shards' squares in another order (fp32 rounding), after which autocast
# now and then rounds a weight to the neighbouring fp16 value: a few of the model's weights one fp16
# rounding apart move a mean loss by a small part of one fp16 rounding (0.1 ulp). DeepSpeed's fp16
# parameters ("zero2half"): the embedding and the norms, which autocast leaves alone, run on their
# fp16 rounding, every weight of them half an ulp off ddp's at most, compounded over 10 steps: 2 ulps.
FP16 = {
    **{f"{mode}_{stage}": 0.1 for mode in ("fp16", "hf16") for stage in STAGES},
    "fp16noclip_zero3": 0.1,
    "fp16_zero2half": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FP16))
def test_16_mixed_scale_trajectory_equals_fabric_ddp(runs, case):
    """GradScaler(init_scale=2**20, growth_interval=3), clip_gradients(max_norm=1.0) (fp16noclip: the
    unscale right before the step), 10 steps: the same steps overflow and are skipped as under ddp,
    so the scale after every step is ddp's; losses within FP16's tolerance."""
    mode = case.split("_")[0]
    for rank in (0, 1):
        got, want = _load(runs, case, rank), _load(runs, f"{mode}_ddp", rank)
        scales = want["scales"]
        assert len(got["scales"]) == 10 and got["scales"] == scales
        assert scales[0] < 2.0**20 and any(b > a for a, b in zip(scales, scales[1:])), "backoff and growth both"
        assert_close_ulps(got["losses"], want["losses"], FP16[case], torch.float16, msg=case)
        skipped = sum(anywhere for _, anywhere in got["overflows"])
        assert len(got["overflows"]) == 10 and got["steps"] == want["steps"] == [10.0 - skipped]
    flags = [_load(runs, case, rank)["overflows"] for rank in (0, 1)]
    assert [a for _, a in flags[0]] == [a for _, a in flags[1]]  # one decision, on every rank
    assert any(mine != anywhere for mine, anywhere in flags[0] + flags[1]), "a skip found in one rank's shard only"


@pytest.mark.slow
def test_fp16_parameters_leave_fabric_ddps_scale_trajectory_on_the_transformers_llama(runs):
    # mixed_params="half" (DeepSpeed's fp16 parameters and gradients) on the transformers Llama:
    # another scale trajectory and drifting losses, the reason fp32 parameters are the default
    # (docs/precision.md); the fp32 cases above are only evidence while this one differs
    for rank in (0, 1):
        got, want = _load(runs, "hf16_zero2half", rank), _load(runs, "hf16_ddp", rank)
        assert got["scales"] != want["scales"]
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3half"])
def test_an_inf_in_one_ranks_gradient_skips_the_step_on_every_rank(runs, stage):
    # rank 1's gradient of one weight gets an inf in one element at step 6: after the reduction it
    # lies in one rank's shard; both ranks skip (parameters and AdamW's step counts unchanged) and
    # back off, as ddp does (fp32 parameters at stage 2, DeepSpeed's fp16 ones at stage 3)
    from tests.scripts.fabric_precision import POISONED

    poisoned = [_load(runs, f"fp16inf_{stage}", rank)["overflows"][POISONED] for rank in (0, 1)]
    assert sorted(poisoned) == [(False, True), (True, True)], poisoned
    for rank in (0, 1):
        got, want = _load(runs, f"fp16inf_{stage}", rank), _load(runs, "fp16inf_ddp", rank)
        assert got["scales"] == want["scales"] and got["scales"][POISONED] == got["scales"][POISONED - 1] / 2
        assert got["steps_after"] == got["steps_before"] == want["steps_after"]
        for name, value in got["before"].items():
            assert torch.equal(got["after"][name], value), name


@pytest.mark.slow
def test_the_scaler_resumes_from_fabric_save(runs):
    # fabric.save after step 5 with the scaler in the state (Fabric's convention); a fresh Fabric
    # with a scaler of other settings loads it: scale, growth tracker and settings continue, and the
    # losses and scales of steps 6-10 are the uninterrupted run's, exactly
    for rank in (0, 1):
        got, want = _load(runs, "fp16save_zero2", rank), _load(runs, "fp16_zero2", rank)
        assert got["resumed_step"] == 5 and got["resumed_scale"] == want["scales"][4]
        assert got["scales"] == want["scales"] and got["losses"] == want["losses"]
        assert got["steps"] == want["steps"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "precision", "master_weights"),
    [*((f"btrue1_{s}", "bf16-true", "auto") for s in STAGES), ("btrue1_zero2fp32", "bf16-true", "fp32"),
     *((f"fp16_{s}", "16-mixed", "auto") for s in [*STAGES, "zero2half"])],
)  # fmt: skip
def test_bytes_per_rank_are_the_ledgers(runs, case, precision, master_weights):
    """The engine's measured model-state bytes per rank equal the ledger's rule for the precision,
    exactly once the padding and Adam's scalar steps are counted."""
    from lightning_zero.ledger import model_state_bytes
    from lightning_zero.planner.ledger import precision_bytes

    row = precision_bytes(precision, master_weights, "half" if case.endswith("half") else "auto")
    for rank in (0, 1):
        recorded = _load(runs, case, rank)["bytes"]
        held = "torch.float32" if row.param == 4 else "torch.bfloat16"  # the masters: fp32 or the parameters
        assert recorded["master_dtypes"] == (["torch.float32"] if row.master else [held])
        padded = model_state_bytes(recorded["num_params"] + recorded["padding"], stage=recorded["stage"], dp=2,
                                   param_bytes=row.param, grad_bytes=row.grad, optim_bytes_per_param=row.optimizer)  # fmt: skip
        measured = recorded["measured"]
        assert (measured["params"], measured["grads"]) == (padded.params, padded.grads)
        assert measured["optimizer"] == padded.optimizer + recorded["beyond"]
    if case == "btrue1_zero3":  # stage 3 holds 8 P / dp under bf16-true
        assert measured["total"] - recorded["beyond"] == 8 * recorded["num_params"] / 2


@pytest.mark.slow
def test_fp32_master_weights_under_bf16_true(runs):
    # master_weights="fp32": bf16 compute parameters without autocast, fp32 masters and AdamW
    # state in the shards; near ddp's bf16-mixed (the same optimizer numbers, other rounding in the
    # forward: autocast keeps softmax and norms in fp32; the losses 1 bf16 ulp apart at most, as above)
    for rank in (0, 1):
        got, want = _load(runs, "btrue1_zero2fp32", rank), _load(runs, "bf16m_ddp", rank)
        assert got["param_dtypes"] == ["torch.bfloat16"]
        assert got["bytes"]["master_dtypes"] == got["bytes"]["state_dtypes"] == ["torch.float32"]
        assert_close_ulps(got["losses"], want["losses"], 1, torch.bfloat16)
