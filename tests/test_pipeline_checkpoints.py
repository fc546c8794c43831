"""Checkpoints, export and precision across pipeline layouts (issue 63, items 5 and 6): one launch of
tests/scripts/pp_parity.py on 4 ranks, every case on the same global batch of 4 sequences a step
(fp32 unless named, accumulation 2, norm clipping, validation).

- ``save_pp1dp4`` (ZeRO-2 over 4 ranks, no pipeline: ddp's numbers) and ``save_pp2dp2`` (pp=2 x dp=2,
  1F1B) train 4 steps uninterrupted, saving at steps 2 and 4, and write the Hugging Face layout from
  the live run after fit (``ZeroStrategy.save_hf_pretrained``);
- their step-2 checkpoints resume at another split: pp=2 with ``pp_layers=[1, 3]`` (the save split
  2 + 2), pp=4 (a block a stage, dp=1), interleaved 1F1B (two stages a rank), and the pp=1 save at
  pp=2; each continues as the uninterrupted run;
- ``pp2dp2_bf16`` against Lightning's ddp (``ddp4_bf16``) under ``precision="bf16-mixed"``.

The checkpoints then export (``lightning-zero export``, plain and ``--format hf``) with every stage's
tensors once, under the dense model's names.

Before that launch, tests/scripts/pp_failure.py (2 ranks, pp=2, the same training) fails mid-schedule
at step 3: rank 1 raises, or is SIGKILLed; every rank must end, the error naming rank 1, and the
kill's ``last`` checkpoint (step 2) resumes in the launch (``resume_killed_last``, pp=2 x dp=2) as
the uninterrupted run.
"""

import pytest
import torch

from tests.distributed import joined_ranks, launch_each
from tests.ulps import adam_ulps, assert_close_ulps, ulps_apart

RANKS = 4
LAUNCH = (RANKS, ["save_pp1dp4", "save_pp2dp2", "resume_pp2_ckpt_pp2_layers13", "resume_pp2_ckpt_pp4",
                  "resume_pp2_ckpt_interleaved", "resume_pp1_ckpt_pp2", "resume_killed_last", "ddp4_bf16",
                  "pp2dp2_bf16"])  # fmt: skip
REFERENCE = "save_pp1dp4"  # uninterrupted, no pipeline: ZeRO-2 equals ddp (tests/test_any_model_vs_ddp.py)
RESUMED = ["resume_pp2_ckpt_pp2_layers13", "resume_pp2_ckpt_pp4", "resume_pp2_ckpt_interleaved", "resume_pp1_ckpt_pp2",
           "resume_killed_last"]  # fmt: skip
# A failing rank must end every rank long before anything else would: the process group's timeout is 30
# minutes and collective_timeout 300 s, so a hang ends there at the soonest. 60 s (the fault matrix's bound,
# tests/test_fault_matrix.py) leaves a loaded 2-core box room; on an idle one they end in about 2 s.
EXIT_WITHIN_S = 60.0
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _fail_mid_schedule(out) -> dict:
    """Both cases of tests/scripts/pp_failure.py at once, 2 ranks each: ``{case: {"ends": [(exit
    code, seconds after the hazard) per rank], "logs": [per rank]}}`` (a rank not ended after 150 s
    is killed: its end is ``None``)."""
    import sys
    import time
    from pathlib import Path

    from tests.distributed import free_port, script_env, start_process, torchrun_env

    root = Path(__file__).resolve().parents[1]
    running = {}
    for case in ("raise", "kill"):
        port = free_port()
        argv = [sys.executable, str(root / "tests" / "scripts" / "pp_failure.py"), str(out), case]
        running[case] = [start_process(argv, cwd=out, env=torchrun_env(script_env(root), rank, 2, port),
                                       log_path=out / f"{case}.rank{rank}.log") for rank in range(2)]  # fmt: skip
    ends: dict = {case: [None, None] for case in running}
    started = time.monotonic()
    while any(None in value for value in ends.values()) and time.monotonic() - started < 150:
        for case, procs in running.items():
            for rank, proc in enumerate(procs):
                if ends[case][rank] is None and proc.poll() is not None:
                    ends[case][rank] = (proc.returncode, time.time())
        time.sleep(0.05)
    for procs in running.values():
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = {}
    for case in running:
        hazard = out / f"{case}.hazard"
        at = float(hazard.read_text()) if hazard.exists() else float("nan")
        failed[case] = {
            "ends": [None if end is None else (end[0], end[1] - at) for end in ends[case]],
            "logs": [(out / f"{case}.rank{rank}.log").read_text(errors="replace") for rank in range(2)],
        }
    return failed


@pytest.fixture(scope="module")
def failures_and_training(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_ckpt")
    failed = _fail_mid_schedule(out)  # first: the launch resumes the kill's `last`
    return failed, launch_each("pp_parity.py", out, [LAUNCH], timeout_s=400)


@pytest.fixture
def trained(failures_and_training):
    return failures_and_training[1]


def _joined(results, case: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    return joined_ranks(results, case, RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["save_pp2dp2", *RESUMED])
def test_a_checkpoint_resumes_at_another_split_pp_or_schedule_exactly(trained, case):
    """Every tensor is saved in dense coordinates under the full model's names, so a step-2
    checkpoint of pp=2 x dp=2 loads into pp=2 cut 1 + 3, into pp=4 and into interleaved stages, and
    pp=1's into pp=2: steps 3-4 (batches 5-8), the last validation and the trained weights equal the
    uninterrupted run's to 1e-5 (fp32)."""
    losses, val_losses, params = _joined(trained, case)
    want_losses, want_val, want_params = _joined(trained, REFERENCE)
    resumed = case in RESUMED
    assert want_losses.shape == (8,) and losses.shape == ((4,) if resumed else (8,))
    torch.testing.assert_close(losses, want_losses[4:] if resumed else want_losses, rtol=0, atol=1e-5)
    torch.testing.assert_close(val_losses[-1], want_val[-1], rtol=0, atol=1e-5)  # after training
    assert set(params) == set(want_params)  # every stage's parameters, under the full model's names
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_bf16_mixed_pipeline_trains_like_ddp_bf16(trained):
    """pp=2 x dp=2 under ``precision="bf16-mixed"`` (the stages compute in bf16, the activations sent
    between them in the compute dtype) against Lightning's ddp in bf16-mixed, in bf16 ulps ([Note:
    tolerances in ulps] in tests/ulps.py). Each loss is an fp32 mean over bf16 logits of weights
    that may already differ by Adam steps turned the other way (below): 1 ulp of each loss, as the
    other bf16 parities state it; the validation losses likewise. The trained weights: AdamW at most
    lr = 1e-2 a step for 4 steps, each step that a gradient's last bits turned the other way moving a
    weight by at most 2 lr (``adam_ulps``, in ulps of the tensor's largest weight)."""
    losses, val_losses, params = _joined(trained, "pp2dp2_bf16")
    want_losses, want_val, want_params = _joined(trained, "ddp4_bf16")
    assert losses.shape == want_losses.shape == (8,)
    assert_close_ulps(losses, want_losses, 1, torch.bfloat16)
    assert_close_ulps(val_losses, want_val, 1, torch.bfloat16)
    assert set(params) == set(want_params)
    for name, value in want_params.items():
        bound = adam_ulps(value, torch.bfloat16, lr_sum=4 * 1e-2)
        assert_close_ulps(params[name], value, bound, torch.bfloat16, magnitude="max", msg=name)
    # not equal to fp32 training: the stages did compute in bf16
    fp32 = _joined(trained, REFERENCE)[0]
    assert ulps_apart(losses, fp32, torch.float32) > 100


def _dense_names() -> set:
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama

    with torch.device("meta"):
        return set(Llama(LlamaConfig(**CONFIG)).state_dict())


@pytest.mark.slow
def test_export_of_a_pp2_checkpoint_gathers_every_stage_under_the_dense_names(trained, tmp_path):
    """``lightning-zero export`` of the step-4 checkpoint written at pp=2 x dp=2: every parameter of
    the dense model once, equal to what the ranks trained (bit for bit: the fp32 masters) and to the
    pp=1 run's export to 1e-5; ``--format hf`` loads strictly in ``transformers`` and computes our
    model's logits; the live run's ``save_hf_pretrained`` wrote the same tensors at pp=2 as at pp=1."""
    from safetensors.torch import load_file

    from lightning_zero.cli import main
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama

    transformers = pytest.importorskip("transformers")
    exported = {}
    for case, folder in (("save_pp2dp2", "pp2dp2"), (REFERENCE, "pp1dp4")):
        ckpt = trained / "ckpts" / folder / "epoch=0-step=4.ckpt"
        main(["export", str(ckpt), str(tmp_path / f"{folder}.safetensors")])
        exported[case] = load_file(tmp_path / f"{folder}.safetensors")
        assert set(exported[case]) == _dense_names(), case
        trained_params = _joined(trained, case)[2]
        for name, value in trained_params.items():
            assert torch.equal(exported[case][name], value), (case, name)
    for name, value in exported[REFERENCE].items():
        torch.testing.assert_close(exported["save_pp2dp2"][name], value, rtol=0, atol=1e-5, msg=name)

    ckpt = trained / "ckpts" / "pp2dp2" / "epoch=0-step=4.ckpt"
    main(["export", str(ckpt), str(tmp_path / "hf"), "--format", "hf"])
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected, mismatched
    ours = Llama(LlamaConfig(**CONFIG))
    ours.load_state_dict(exported["save_pp2dp2"])
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - theirs.eval()(tokens).logits).abs().max().item() < 1e-5

    def hf_tensors(folder):
        return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}

    written = hf_tensors(tmp_path / "hf")
    live = {case: hf_tensors(trained / "hf" / case) for case in ("save_pp2dp2", REFERENCE)}
    assert set(live["save_pp2dp2"]) == set(live[REFERENCE]) == set(written)
    for name, value in written.items():
        assert torch.equal(live["save_pp2dp2"][name], value), name  # the same run, the same step
        torch.testing.assert_close(live[REFERENCE][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["raise", "kill"])
def test_a_pp_rank_failing_mid_schedule_ends_every_rank_naming_it(failures_and_training, case):
    """tests/scripts/pp_failure.py: at step 3 rank 1 (the last stage) raises, or SIGKILLs itself,
    inside its first block's forward while rank 0 waits in the schedule's transfer; both ranks exit
    non-zero within ``EXIT_WITHIN_S``, and rank 0's error names rank 1: after a raise with rank 1's
    own exception and the step ([Note: failure path]), after a kill as gone without a word, its
    transfer failed ([Note: a pipeline neighbour gone] in runtime/pipeline.py). The kill's ``last``
    resumes exactly: ``resume_killed_last`` above."""
    import signal

    failed = failures_and_training[0][case]
    ends, logs = failed["ends"], failed["logs"]
    tails = "\n".join(log[-3000:] for log in logs)
    for rank, end in enumerate(ends):
        assert end is not None and end[0] != 0, (case, rank, end, tails)
        assert end[1] < EXIT_WITHIN_S, (case, rank, end, tails)
    survivor = logs[0]
    assert "stops because another rank failed (global rank 1)" in survivor, tails
    if case == "raise":
        assert "ValueError: a bad micro-batch on pp rank 1" in logs[1]
        assert "training step 3" in survivor
        assert "ValueError: a bad micro-batch on pp rank 1" in survivor  # the model's own, not torch's wrapper
    else:
        assert ends[1][0] == -signal.SIGKILL
        assert "global rank 1 (pp rank 1, stages [1]) left the pipeline without a word" in survivor, tails
        assert "the training schedule's transfer between it and global rank 0 failed" in survivor, tails


def test_16_mixed_is_refused_under_pp_before_any_process_group():
    """Loss scaling wraps the backward the door runs; under pp the schedule ran the backwards inside
    the step, on unscaled losses, so the unscale would divide every gradient by the scale: both doors
    refuse ``16-mixed`` with pp > 1 (bf16-mixed runs: above), naming the fix."""
    import torch.distributed as dist
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_zero import ZeroStrategy
    from lightning_zero.fabric import ZeroFabricStrategy

    trainer_door = ZeroStrategy(stage=2, pp=2)
    trainer_door.precision_plugin = MixedPrecision("16-mixed", "cuda")
    fabric_door = ZeroFabricStrategy(stage=2, pp=2)
    fabric_door.precision = FabricMixed("16-mixed", "cuda")
    for door in (trainer_door, fabric_door):
        with pytest.raises(ValueError, match="use precision='bf16-mixed' \\(or '32-true'\\) with pp > 1"):
            door.setup_environment()
    assert not dist.is_initialized()
