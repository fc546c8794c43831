"""ZeroStrategy stages 1-2 against Lightning's own ddp, 2 CPU processes, same seed and data.

One script run (tests/scripts/parity.py) trains every case in sequence; here we compare per-step
losses and final parameters of each zero case with its ddp twin to 1e-5.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed import launch
from tests.ulps import assert_close_ulps

ROOT = Path(__file__).resolve().parents[1]

PAIRS = {
    "zero1": "ddp",
    "zero2": "ddp",
    "zero1_small": "ddp",
    "zero2_small": "ddp",
    "zero2_small_no_overlap": "ddp",
    "zero1_acc": "ddp_acc",
    "zero2_acc": "ddp_acc",
    "zero2_acc_defer": "ddp_acc",
    "zero2_value_clip": "ddp_value_clip",
    "zero2_manual": "ddp_manual",
    "zero3": "ddp",
    "zero2_offload": "ddp",
    "zero3_offload_acc": "ddp_acc",
    "zero3_acc": "ddp_acc",
    "zero3_acc_defer": "ddp_acc",
    "zero3_value_clip": "ddp_value_clip",
    "zero2_acc_gather_sync": "ddp_acc",
    "zero2_offload_acc": "ddp_acc",
    "zero2_two_opt": "ddp_two_opt",
    "zero2_ema": "ddp_ema",
    "llama_zero3": "llama_ddp",
    "llama_zero3_p0_acc": "llama_ddp_acc",
    "llama_zero3_ckpt": "llama_ddp_ckpt",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    launch("parity.py", out, timeout_s=600)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PAIRS))
def test_matches_ddp(results, case):
    for rank in (0, 1):
        got = torch.load(results / f"{case}.rank{rank}.pt")
        want = torch.load(results / f"{PAIRS[case]}.rank{rank}.pt")
        assert len(got["losses"]) == len(want["losses"]) > 0
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
        if "val_losses" in want:  # validation interleaved with training
            assert len(got["val_losses"]) == len(want["val_losses"]) > 0
            torch.testing.assert_close(
                torch.tensor(got["val_losses"]), torch.tensor(want["val_losses"]), rtol=1e-5, atol=1e-6
            )
        if "val_loss" in want:  # validate() and predict() after fit, and a plain forward
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
            torch.testing.assert_close(got["predict"], want["predict"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got["outside"], want["outside"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2_bf16", "zero3_bf16"])
def test_bf16_stages_agree(results, case):
    """bf16-mixed: stages differ only in where the same bf16 gradients and fp32 masters live, so they are
    equal bit for bit: the same bf16 compute weights give the same bf16 gradients, two ranks' sum is one
    commutative add in any bucket layout, halving is exact, no clipping or accumulation reorders a sum,
    and AdamW steps each fp32 master element by element."""
    for rank in (0, 1):
        got, want = torch.load(results / f"{case}.rank{rank}.pt"), torch.load(results / f"zero1_bf16.rank{rank}.pt")
        assert got["losses"] == want["losses"], case
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"{case} {name}"


@pytest.mark.slow
def test_stage3_deferred_reduce_equals_ddp_under_bf16_true_accumulation(results):
    """Stage 3 with ``defer_grad_reduce=True`` keeps the micro batches' bf16 gradients unsharded and
    reduce-scatters once, as ddp sums them locally and all-reduces once: bit for bit ([Note: deferred
    gradient reduction] in zero/bucketing.py; the default reduce-scatters every micro batch)."""
    for rank in (0, 1):
        got = torch.load(results / f"zero3_bf16t_acc_defer.rank{rank}.pt")
        want = torch.load(results / f"ddp_bf16t_acc.rank{rank}.pt")
        assert len(got["losses"]) == len(want["losses"]) > 0 and got["losses"] == want["losses"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name


@pytest.mark.slow
def test_bf16_trains_like_ddp_bf16(results):
    """Against ddp's bf16-mixed (fp32 weights under autocast, fp32 gradients: one bf16 rounding fewer per
    gradient): each loss, an fp32 mean over bf16 logits, within half a bf16 ulp of the same exact
    value, so 1 bf16 ulp apart at most ([Note: tolerances in ulps] in tests/ulps.py)."""
    got, want = torch.load(results / "zero1_bf16.rank0.pt"), torch.load(results / "ddp_bf16.rank0.pt")
    assert_close_ulps(got["losses"], want["losses"], 1, torch.bfloat16)
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.slow
def test_bf16_fp32_reduce_trains_like_ddp_bf16(results):
    """ZeroStrategy(reduce_dtype="fp32") reaches the engine: fp32 gradient shards under bf16-mixed,
    accumulated over 2 micro batches and clipped, close to ddp's bf16-mixed (fp32 gradients): 1 bf16 ulp
    of each loss, as above."""
    got, want = torch.load(results / "zero2_bf16_fp32_reduce.rank0.pt"), torch.load(results / "ddp_bf16_acc.rank0.pt")
    assert got["grad_chunk_dtypes"] == ["torch.float32"]
    assert torch.load(results / "zero2_bf16.rank0.pt")["grad_chunk_dtypes"] == ["torch.bfloat16"]
    assert_close_ulps(got["losses"], want["losses"], 1, torch.bfloat16)
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.slow
def test_lr_scheduler_steps_the_sharded_optimizer(results):
    got = torch.load(results / "zero2.rank0.pt")
    # LambdaLR 1/(1+step) after 6 steps on base lrs 1e-2 and 5e-3
    assert got["lr"] == pytest.approx([1e-2 / 7, 5e-3 / 7])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero1_acc", "zero2_acc", "zero2_two_opt"])
def test_param_gather_overlaps_the_next_forward(results, case):
    """[Note: overlapped parameter gather]: after a step the gathers are still in flight, and the
    next forward waits for them in its modules' pre-hooks (not inside the step)."""
    for rank in (0, 1):
        stats = torch.load(results / f"{case}.rank{rank}.pt")["stats"]
        assert max(stats["pending_after_step"]) > 0
        assert stats["waits"]["forward_hook"] > 0, stats
    acc = torch.load(results / "zero2_acc.rank0.pt")["stats"]
    assert max(acc["pending_after_step"]) == acc["chunks"] > 1
    # 6 steps: the gathers of steps 1-5 are each waited in a forward pre-hook, step 6's at the end
    # (by the barrier, before any callback's on_train_end: [Note: parameter reads between steps]).
    assert acc["waits"] == {"forward_hook": 5 * acc["chunks"], "safe_point": acc["chunks"], "at_launch": 0}


@pytest.mark.slow
def test_callback_reading_weights_between_steps_sees_whole_parameters(results):
    """An EMA callback under the default overlapped gather equals ddp's EMA: the barrier waited for
    every step's gathers in on_train_batch_end (none was left to a forward pre-hook)."""
    for rank in (0, 1):
        got = torch.load(results / f"zero2_ema.rank{rank}.pt")
        want = torch.load(results / f"ddp_ema.rank{rank}.pt")
        assert set(got["ema"]) == set(want["ema"]) and want["ema"]
        for name, value in want["ema"].items():
            torch.testing.assert_close(got["ema"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        waits = got["stats"]["waits"]
        assert waits["forward_hook"] == 0 and waits["safe_point"] > 0, waits


@pytest.mark.slow
def test_param_gather_off_waits_inside_the_step(results):
    for rank in (0, 1):
        stats = torch.load(results / f"zero2_acc_gather_sync.rank{rank}.pt")["stats"]
        assert stats["waits"] == {} and set(stats["pending_after_step"]) == {0}


@pytest.mark.slow
def test_offload_copies_gradients_to_host_once_per_step(results):
    """accumulate_grad_batches=2 at stage 2 reduces every micro batch; the chunks still leave the
    device once per optimizer step (and come back once)."""
    for rank in (0, 1):
        stats = torch.load(results / f"zero2_offload_acc.rank{rank}.pt")["stats"]
        expected = stats["optimizer_steps"] * stats["chunks"]
        assert stats["optimizer_steps"] == 6 and stats["chunks"] > 1
        assert stats["offload"] == {"device_to_host": expected, "host_to_device": expected}
