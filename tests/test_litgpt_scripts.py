"""LitGPT's own scripts, unchanged (``finetune_lora``, ``finetune_adapter``, ``finetune_full``, ``pretrain``
of litgpt 0.5.13), on 2 CPU processes under ZeroFabricStrategy at stages 1-3 against the same scripts
under Fabric's ddp with the model built eagerly, in fp32 and bf16-true: LitGPT's logged per-step
losses, every file it saves (LoRA and adapter weights, full checkpoints with optimizer state, LitGPT's
merged LoRA model) and resuming from a saved step. LoRA and the adapter start from a base checkpoint
without their tensors, as users' checkpoints are: those come from the deferred initialization. One
launch per strategy (tests/scripts/litgpt_scripts.py runs every case in turn through
``lightning_zero.fabric.litgpt``, the command docs/fabric.md gives LitGPT users; each ZeRO stage's
also runs ``finetune_lora`` and ``pretrain`` under ``--tp 2``: dp 1 on 2 processes), one of 4
processes for ``finetune_lora`` and ``pretrain`` under ``--cp 2`` (dp 2) and ``--tp 2 --cp 2`` (dp 1)
at stages 1-3, and one of a single process: Fabric's DDP with dp 1, the reference of the dp-1 runs.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import ROOT, launch_ranks, script_env
from tests.ulps import adam_ulps, ulps_apart

NEEDED = ("litgpt", "litdata", "jsonargparse", "tokenizers")
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING), reason=f"not installed: {MISSING} (README: pip install --no-deps litgpt litdata)"
    ),
]

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
SCRIPTS = ["lora", "adapter", "full", "pretrain"]
RESUMED = ["full", "pretrain"]
CP_SCRIPTS = ["lora", "pretrain"]  # under --cp 2 (models/litgpt/parallelize.py), --tp 2, both
# LoRA's dropout draws per rank: under cp for a slice of the sequence, under tp for a part of the
# features, other numbers than ddp's for the whole
CP_CASE = {"lora": "lora-{strategy}-32-nodropout", "pretrain": "pretrain-{strategy}-32"}
DP1 = [CP_CASE[script].format(strategy="ddp1") for script in CP_SCRIPTS]  # Fabric's DDP on one process
DP1.append("pretrain-ddp1-32-resume")  # the reference of pretrain-zero3tp2-32-resume
DEFERRED = ["lora", "full"]  # accumulate 2 micro batches and do not clip (pretrain clips: docs/precision.md)
# fp32: the bound. bf16-true, the rounding of the same sums in another order (docs/precision.md),
# in bf16 ulps ([Note: tolerances in ulps] in tests/ulps.py): each logged loss, an fp32 mean over bf16
# logits, within half an ulp of the same exact value, 1 ulp apart; each saved weight as far as AdamW's
# steps may turn apart where a gradient's last bits differ and the bf16 weights round once a step
# (adam_ulps: torch's AdamW lr 1e-3, which LitGPT's scripts keep here, betas (0.9, 0.999), 4 steps).
# Optimizer state in the bf16 files is compared for keys, dtypes and shapes; its values (moments of
# gradients that differ by bf16 roundings) are held to the fp32 runs' 1e-5 and the deferred runs' bits.
LOSS_TOL = {"32": 1e-5}
WEIGHT_TOL = {"32": 1e-5}
BF16_LOSS_ULPS, BF16_LR_SUM = 1, 4 * 1e-3


def cases(strategy: str) -> list[str]:
    """One launch per strategy: the four scripts in fp32 and in bf16-true, the two resumes (and at
    stages 2-3 LoRA and full under bf16-true with ``defer_grad_reduce=True``, docs/precision.md). A
    bf16 run takes a second or two."""
    out = [f"{script}-{strategy}-{precision}" for precision in ("32", "bf16") for script in SCRIPTS]
    out += [f"{script}-{strategy}-32-resume" for script in RESUMED]
    out.append(f"lora-{strategy}-32-generate")  # at the same place in every launch (LitGPT keeps state between runs)
    out.append(f"reseed-{strategy}-32")
    if strategy == "ddp":
        out.append("lora-ddp-32-nodropout")  # the reference of --cp 2 (test_litgpt_script_under_cp_equals_fabric_ddp)
    if strategy in ("zero2", "zero3"):
        out += [f"{script}-{strategy}defer-bf16" for script in DEFERRED]
    if strategy != "ddp":  # --tp 2 on the launch's 2 processes: dp 1, against DP1
        out += [CP_CASE[script].format(strategy=f"{strategy}tp2") for script in CP_SCRIPTS]
    if strategy == "zero3":  # a dense file (model, optimizer state) cut back into tp parts
        out.append("pretrain-zero3tp2-32-resume")
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("litgpt")
    argv = [str(ROOT / "tests" / "scripts" / "litgpt_scripts.py"), str(root)]
    for strategy in STRATEGIES:
        codes, tails = launch_ranks(["python", *argv, *cases(strategy)], cwd=root, env=script_env(ROOT),
                                    timeout_s=900, log_prefix=f"litgpt_{strategy}")  # fmt: skip
        assert codes == [0, 0], tails
    codes, tails = launch_ranks(["python", *argv, *DP1], cwd=root, env=script_env(ROOT), timeout_s=900, world=1,
                                log_prefix="litgpt_ddp1")  # fmt: skip
    assert codes == [0], tails
    return root


@pytest.fixture(scope="module")
def cp_root(root):
    """``--cp 2`` (dp 2 x cp 2) and ``--tp 2 --cp 2`` (dp 1) on 4 processes in ``root``, beside the
    ddp runs there (dp 2 and dp 1): a launch of its own, after the others (a fixture of its own: its
    own share of the test timeout)."""
    argv = [str(ROOT / "tests" / "scripts" / "litgpt_scripts.py"), str(root)]
    cases = [CP_CASE[script].format(strategy=f"zero{stage}{layout}") for layout in ("cp2", "tp2cp2")
             for stage in ("1", "2", "3") for script in CP_SCRIPTS]  # fmt: skip
    codes, tails = launch_ranks(["python", *argv, *cases], cwd=root, env=script_env(ROOT), timeout_s=900, world=4,
                                log_prefix="litgpt_cp")  # fmt: skip
    assert codes == [0] * 4, tails
    return root


def results(root: Path) -> dict:
    merged: dict = {}
    for path in root.glob("results.*.rank0.json"):
        merged.update(json.loads(path.read_text()))
    return merged


def losses(root: Path, case: str) -> dict[int, float]:
    """LitGPT's logged training loss per iteration (rank 0's CSV logger)."""
    rows = csv.DictReader((root / "runs" / case / "logs" / "csv" / "version_0" / "metrics.csv").open())
    return {int(row["iter"]): float(row["loss"]) for row in rows if row.get("loss") and row.get("iter")}


def saved_files(root: Path, case: str) -> dict[str, Path]:
    run = root / "runs" / case
    return {str(p.relative_to(run)): p for p in run.rglob("lit_model.pth*") if p.is_file()}


def tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a saved file, by its path of keys."""
    if torch.is_tensor(value):
        return {prefix: value}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(tensors(item, f"{prefix}/{key}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(tensors(item, f"{prefix}/{index}"))
        return out
    return {}


def compare(root: Path, case: str, reference: str) -> dict:
    """max |loss - ddp|, the saved files against ddp's (keys, bytes, max |value - ddp|)."""
    mine, theirs = losses(root, case), losses(root, reference)
    assert mine and set(mine) == set(theirs), (case, sorted(mine), sorted(theirs))
    iters = sorted(mine)
    report = {"loss": max(abs(mine[i] - theirs[i]) for i in mine), "files": {},
              "loss_ulps": ulps_apart([mine[i] for i in iters], [theirs[i] for i in iters], torch.bfloat16)}  # fmt: skip
    files, ddp_files = saved_files(root, case), saved_files(root, reference)
    assert set(files) == set(ddp_files), (case, sorted(files), sorted(ddp_files))
    for name, path in files.items():
        got = tensors(torch.load(path, map_location="cpu", weights_only=True))
        want = tensors(torch.load(ddp_files[name], map_location="cpu", weights_only=True))
        assert set(got) == set(want), (case, name, sorted(set(got) ^ set(want))[:10])
        assert all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape for k in want), (case, name)
        diff = max(
            ((got[k].double() - want[k].double()).abs().max().item() for k in want if want[k].numel()), default=0.0
        )
        weights = [k for k in want if want[k].numel() and want[k].is_floating_point() and "/optimizer/" not in k]
        adam = max((ulps_apart(got[k], want[k], torch.bfloat16, magnitude="max")
                    / adam_ulps(want[k], torch.bfloat16, lr_sum=BF16_LR_SUM, rounds=4) for k in weights), default=0.0)  # fmt: skip
        report["files"][name] = {"keys": len(got), "bytes": path.stat().st_size, "ddp_bytes": ddp_files[name].stat().st_size,
                                 "diff": diff, "weights_of_adam_bound": adam}  # fmt: skip
    return report


def _check(root: Path, script: str, strategy: str, precision: str) -> None:
    case, reference = f"{script}-{strategy}-{precision}", f"{script}-ddp-{precision}"
    ran = results(root)
    assert "exception" not in ran.get(case, {}), ran.get(case)
    report = compare(root, case, reference)
    if precision == "bf16":
        assert report["loss_ulps"] <= BF16_LOSS_ULPS, report
        assert all(entry["weights_of_adam_bound"] <= 1 for entry in report["files"].values()), report
        return
    assert report["loss"] <= LOSS_TOL[precision], report
    for name, entry in report["files"].items():
        assert entry["diff"] <= WEIGHT_TOL[precision], (name, entry)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_litgpt_script_equals_fabric_ddp(root, script, strategy):
    """Faults 1-4 and 7 as LitGPT's scripts meet them: losses and every saved file equal ddp's."""
    _check(root, script, strategy, "32")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_litgpt_script_under_bf16_true_is_within_bf16_rounding_of_ddp(root, script, strategy):
    """The four scripts under bf16-true (fault 6 for LoRA): stage 2 by default and stage 3 reduce-scatter
    each micro batch in bf16, the same sums rounded in another order (docs/precision.md); pretrain's
    clipping norm is summed in another order at every stage."""
    _check(root, script, strategy, "bf16")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_litgpt_rank0_generate_example_runs_as_under_ddp(root, strategy):
    """LitGPT's ``finetune_lora`` runs ``generate_example`` on rank 0 only, after validating (the other
    ranks wait in ``fabric.barrier()``) and when the last epoch ends (they go on to ``fabric.all_reduce``).
    At stage 3 each generated token is a forward over sharded parameters: the waiting ranks serve its
    all-gathers ([Note: forwards on some ranks only] in runtime/forward_steps.py; before, the run stalled).
    Rank 0 generates the same tokens as under ddp, three times; the losses and files are ddp's."""
    case, reference = f"lora-{strategy}-32-generate", "lora-ddp-32-generate"
    ran = results(root)
    assert "exception" not in ran[case], ran[case]
    assert len(ran[reference]["generated"]) == 3 and ran[case]["generated"] == ran[reference]["generated"]
    others = {}
    for path in root.glob("results.*.rank1.json"):
        others.update(json.loads(path.read_text()))
    assert others[case]["generated"] == [] == others[reference]["generated"]
    report = compare(root, case, reference)
    assert report["loss"] <= LOSS_TOL["32"] and all(e["diff"] <= WEIGHT_TOL["32"] for e in report["files"].values())


@pytest.mark.parametrize("strategy", ["zero2defer", "zero3defer"])
@pytest.mark.parametrize("script", DEFERRED)
def test_litgpt_deferred_reduce_under_bf16_true_equals_ddp_bit_for_bit(root, script, strategy):
    """``defer_grad_reduce=True`` (stages 2 and 3) accumulates the micro batches' bf16 gradients
    unsharded and reduces once, as ddp does: losses and every saved file equal ddp's exactly."""
    report = compare(root, f"{script}-{strategy}-bf16", f"{script}-ddp-bf16")
    assert report["loss"] == 0.0 and all(entry["diff"] == 0.0 for entry in report["files"].values()), report


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("script", RESUMED)
def test_litgpt_resume_equals_ddps_resume(root, script, strategy):
    """``--resume`` from the step-2 file (model, optimizer in torch's format, scheduler or dataloader
    state, counters) continues as ddp's resume does, file for file; ``pretrain`` (which saves its
    dataloader's state) also as the run that was not interrupted. (``finetune_full`` saves no
    dataloader state: LitGPT's resume draws other batches, under ddp as under us.)"""
    report = compare(root, f"{script}-{strategy}-32-resume", f"{script}-ddp-32-resume")
    assert report["loss"] <= 1e-5 and all(entry["diff"] <= 1e-5 for entry in report["files"].values()), report
    if script == "pretrain":
        resumed, first = losses(root, f"{script}-{strategy}-32-resume"), losses(root, f"{script}-{strategy}-32")
        assert resumed and max(resumed) == max(first)
        assert max(abs(resumed[i] - first[i]) for i in resumed) <= 1e-5


@pytest.mark.parametrize("stage", ["1", "2", "3"])
@pytest.mark.parametrize("script", CP_SCRIPTS)
def test_litgpt_script_under_cp_equals_fabric_ddp(cp_root, script, stage):
    """``python -m lightning_zero.fabric.litgpt --stage S --cp 2 finetune_lora|pretrain ...`` on 4
    processes (dp 2 x cp 2: [Note: LitGPT under context parallelism] in models/litgpt/parallelize.py)
    against the same script under ddp on 2: LitGPT's logged losses and every file it saves (LoRA
    weights and the merged model; pretrain's model and optimizer state) to 1e-5 in fp32."""
    _check_against(cp_root, CP_CASE[script], f"zero{stage}cp2", "ddp")


@pytest.mark.parametrize("stage", ["1", "2", "3"])
@pytest.mark.parametrize("script", CP_SCRIPTS)
def test_litgpt_script_under_tp_equals_fabric_ddp(root, script, stage):
    """``python -m lightning_zero.fabric.litgpt --stage S --tp 2 finetune_lora|pretrain ...`` on 2
    processes (tp 2 with sequence parallelism, dp 1: [Note: LitGPT under tensor parallelism] in
    models/litgpt/tensor_parallel.py) against the same script under Fabric's DDP on one process:
    LitGPT's logged losses and every file it saves, in the dense layout (LoRA weights and the merged
    model; pretrain's model and optimizer state) to 1e-5 in fp32."""
    _check_against(root, CP_CASE[script], f"zero{stage}tp2", "ddp1")


@pytest.mark.parametrize("stage", ["1", "2", "3"])
@pytest.mark.parametrize("script", CP_SCRIPTS)
def test_litgpt_script_under_tp_and_cp_equals_fabric_ddp(cp_root, script, stage):
    """``--tp 2 --cp 2`` on 4 processes (dp 1): the cp rank's slice of each sequence split again
    over tp, against Fabric's DDP on one process, as above."""
    _check_against(cp_root, CP_CASE[script], f"zero{stage}tp2cp2", "ddp1")


def test_litgpt_pretrain_resumes_under_tp_as_ddp_does(root):
    """``pretrain --resume`` from the step-2 file that ``--tp 2`` at stage 3 wrote (dense model and
    optimizer state): each TP rank loads its parts ([Note: dense TP tensors in a full file] in
    checkpoint/full.py) and the run goes on as ddp's resume from ddp's own file does, file for file."""
    _check_against(root, "pretrain-{strategy}-32-resume", "zero3tp2", "ddp1")


def _check_against(root: Path, case: str, strategy: str, reference: str) -> None:
    ran = results(root)
    assert "exception" not in ran.get(case.format(strategy=strategy), {}), ran.get(case.format(strategy=strategy))
    report = compare(root, case.format(strategy=strategy), case.format(strategy=reference))
    assert report["loss"] <= LOSS_TOL["32"] and all(e["diff"] <= WEIGHT_TOL["32"] for e in report["files"].values()), (
        report
    )


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_reseed_between_construction_and_reset_parameters_equals_eager_ddp(root, strategy):
    """LitGPT's GPT under ``init_module(empty_init=True)``, a seed set, then ``reset_parameters(model)``:
    the initializer replays with the RNG state of its own call, so the weights are ddp's bit for bit
    (before: stage 3 replayed every initializer from the state at ``init_module``'s exit, 4.3e-2 off);
    the caller's stream afterwards is where ddp's eager run left it (the dropout masks, a draw after
    the steps), so the losses and trained weights equal ddp's too."""
    case, reference = f"reseed-{strategy}-32", "reseed-ddp-32"
    ran = results(root)
    assert "exception" not in ran[case], ran[case]
    got = torch.load(root / "runs" / case / "weights.pt", weights_only=True)
    want = torch.load(root / "runs" / reference / "weights.pt", weights_only=True)
    assert set(got["init"]) == set(want["init"]) and got["init"]
    for name, value in want["init"].items():
        assert torch.equal(got["init"][name], value), (name, (got["init"][name] - value).abs().max().item())
    for name, value in want["trained"].items():
        assert (got["trained"][name] - value).abs().max().item() <= 1e-5, name
    assert max(abs(a - b) for a, b in zip(ran[case]["losses"], ran[reference]["losses"])) <= 1e-5
    assert ran[case]["draw"] == ran[reference]["draw"]


def test_no_bucket_advice_on_runs_that_never_set_bucket_mb(root):
    """No run here sets bucket_mb ("auto" gives these tiny models one bucket on purpose): none is told
    to "set bucket_mb to about 0.25 or leave it at 'auto'" (before: three times per launch on rank 0)."""
    for strategy in STRATEGIES[1:]:
        for rank in (0, 1):
            log = (root / f"litgpt_{strategy}.rank{rank}.log").read_text()
            assert "set bucket_mb to about" not in log, (strategy, rank)
