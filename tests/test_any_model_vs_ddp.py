"""Any model under ZeroStrategy stages 1-2 (Adafactor also at stage 3) against Lightning's ddp
(2 CPU ranks, same seed and data).

One launch of tests/scripts/any_model_vs_ddp.py trains every case in sequence: reentrant and
non-reentrant activation checkpointing over a frozen int8 base with LoRA adapters, a rank whose
loss reaches no (or only some) parameters, Adagrad / SGD-momentum / RMSprop / fused Adam, two
optimizers with separate zero_grad (GAN), Adafactor with gradient clipping (replicated
full-master step; at stage 3 one unit at a time, also with gradient accumulation), a BatchNorm
CNN in fp32 and bf16-mixed, and a model whose first layer is registered last. Per-step losses
match ddp to 1e-5, and so does a plain forward after fit.
"""

import pytest
import torch

from tests.distributed import launch
from tests.ulps import assert_close_ulps

PAIRS = {
    "zero1_mlp_adagrad": "ddp_mlp_adagrad",
    "zero2_mlp_adagrad": "ddp_mlp_adagrad",
    "zero2_mlp_sgd_momentum": "ddp_mlp_sgd_momentum",
    "zero2_mlp_rmsprop": "ddp_mlp_rmsprop",
    "zero1_mlp_adam_fused": "ddp_mlp_adam_fused",
    "zero1_unused": "ddp_unused",
    "zero2_unused": "ddp_unused",
    "zero1_gan": "ddp_gan",
    "zero2_gan": "ddp_gan",
    "zero1_lora_reentrant": "ddp_lora",
    "zero2_lora_reentrant": "ddp_lora",
    "zero2_lora_nonreentrant": "ddp_lora",
    "zero1_bn": "ddp_bn",
    "zero2_bn": "ddp_bn",
    "zero2_late": "ddp_late",
    "zero1_mlp_adafactor": "ddp_mlp_adafactor",
    "zero2_mlp_adafactor": "ddp_mlp_adafactor",
    "zero3_mlp_adafactor": "ddp_mlp_adafactor",
    "zero3_mlp_adafactor_accum": "ddp_mlp_adafactor_accum",
}
RANKS = (0, 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("any_model_vs_ddp")
    launch("any_model_vs_ddp.py", out, timeout_s=900)
    return out


def _load(results, case, rank):
    return torch.load(results / f"{case}.rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PAIRS))
def test_matches_ddp(results, case):
    for rank in RANKS:
        got, want = _load(results, case, rank), _load(results, PAIRS[case], rank)
        assert len(got["losses"]) == len(want["losses"]) > 0
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
        # BatchNorm running stats: ddp broadcasts rank 0's buffers before every forward, so only
        # rank 0's eval-mode forward is comparable.
        if "bn" not in case or rank == 0:
            torch.testing.assert_close(got["outside"], want["outside"], rtol=1e-4, atol=1e-5)
        assert got["dtypes"] == want["dtypes"], "stages 1-2 under fp32 change no parameter's dtype"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["zero1_lora_reentrant", "zero2_lora_reentrant", "zero2_lora_nonreentrant", "zero2_lora_reentrant_bf16"]
)
def test_one_reduce_scatter_per_bucket_per_step(results, case):
    """Checkpointing (reentrant or not) syncs once per backward: one reduce-scatter per bucket."""
    for rank in RANKS:
        got = _load(results, case, rank)
        assert got["num_buckets"] > 2, "the case should exercise several buckets"
        assert got["reduce_scatters_per_step"] == [got["num_buckets"]] * len(got["losses"])


@pytest.mark.slow
def test_frozen_params_keep_their_dtype_under_bf16(results):
    for case in ("zero1_lora_bf16", "zero2_lora_reentrant_bf16"):
        got = _load(results, case, 0)
        for dtypes in (got["train_dtypes"], got["dtypes"]):  # during training, and after fit
            assert dtypes["m.blocks.0.base_q"] == "torch.int8"
            assert dtypes["m.blocks.0.scale"] == "torch.float32"
        assert got["train_dtypes"]["m.blocks.0.lora_a.weight"] == "torch.bfloat16"
        assert got["dtypes"]["m.blocks.0.lora_a.weight"] == "torch.float32", "fp32 masters restored after fit"


@pytest.mark.slow
@pytest.mark.parametrize(
    "pair",
    [
        ("zero2_lora_reentrant_bf16", "zero1_lora_bf16"),
        ("zero2_bn_bf16", "zero1_bn_bf16"),
        ("zero2_mlp_adafactor_bf16", "zero1_mlp_adafactor_bf16"),
    ],
)
def test_bf16_stages_agree(results, pair):
    """bf16-mixed: stages 1 and 2 hold the same bf16 gradients and fp32 masters in different places,
    so they are equal bit for bit: the same flat groups cut at the same boundaries, two ranks' sum one
    commutative add, halving exact, the clip norm (Adafactor's case) summing the same chunks in the
    same order, the optimizers stepping the same masters; the running statistics and the plain
    forward after fit follow."""
    case, reference = pair
    for rank in RANKS:
        got, want = _load(results, case, rank), _load(results, reference, rank)
        assert got["losses"] == want["losses"], case
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"{case} {name}"
        torch.testing.assert_close(got["buffers"], want["buffers"], rtol=0, atol=0)
        assert torch.equal(got["outside"], want["outside"]), case  # fp32 forward after fit


@pytest.mark.slow
def test_bf16_batchnorm_trains_like_ddp_bf16(results):
    """BatchNorm under bf16-mixed: its parameters and running stats stay fp32, as under ddp. In bf16 ulps
    ([Note: tolerances in ulps] in tests/ulps.py): each loss, an fp32 mean over bf16 activations,
    within half an ulp of the same exact value, 1 ulp apart; the plain fp32 forward after fit reads
    weights that AdamW (lr 1e-2, 4 steps) may have stepped the other way where a gradient's last bits
    differ (2 lr a step): 25 bf16 ulps of the largest output (5e-2 at 0.4)."""
    got, want = _load(results, "zero1_bn_bf16", 0), _load(results, "ddp_bn_bf16", 0)
    assert_close_ulps(got["losses"], want["losses"], 1, torch.bfloat16)
    during = got["train_dtypes"]
    assert (
        during["m.net.1.weight"] == during["m.net.1.running_mean"] == during["m.net.1.running_var"] == "torch.float32"
    )
    assert during["m.net.0.weight"] == "torch.bfloat16"
    assert got["dtypes"]["m.net.0.weight"] == "torch.float32", "fp32 masters restored after fit"
    assert_close_ulps(got["outside"], want["outside"], 25, torch.bfloat16, magnitude="max")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero1_mlp_adafactor", "zero2_mlp_adafactor"])
def test_adafactor_all_gathers_gradients_not_parameters(results, case):
    """Adafactor (not element-wise) steps replicated full masters: after the reduce-scatter each
    step all-gathers the reduced gradients (P (dp-1)/dp elements per bucket) and no parameters."""
    for rank in RANKS:
        sent = _load(results, case, rank)["sent_elements"]
        assert sent["all_gather_grads_replicated"] == sent["reduce_scatter_grads"] > 0, sent
        assert "all_gather_params" not in sent, sent


@pytest.mark.slow
@pytest.mark.parametrize("case, micro_batches", [("zero3_mlp_adafactor", 1), ("zero3_mlp_adafactor_accum", 2)])
def test_adafactor_stage3_gathers_fp32_masters_and_gradients_once_per_step(results, case, micro_batches):
    """Stage 3 steps each unit's full fp32 masters: per optimizer step one all-gather of the fp32
    master chunks and one of the clipped fp32 gradient chunks (P (dp-1)/dp elements each), while
    every micro batch reduce-scatters its gradients."""
    for rank in RANKS:
        sent = _load(results, case, rank)["sent_elements"]
        assert sent["all_gather_masters"] == sent["all_gather_grads_replicated"] > 0, sent
        assert sent["reduce_scatter_grads"] == micro_batches * sent["all_gather_grads_replicated"], sent
