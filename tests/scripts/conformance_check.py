"""Run the conformance matrix (tests/scripts/conformance.py) and judge each case x stage against ddp.

Used by tests/test_conformance.py; also a command line for trying another checkout's engine:

    python tests/scripts/conformance_check.py OUT_DIR [--src PATH/TO/src] [--report FILE.md] [RUN ...]

``run_matrix`` launches the script (2 ranks) for every run, relaunching it for the runs left
whenever a launch ends early (a failed run ends its launch so it cannot poison the next ones).
``judge(out, case, strategy)`` compares one zero run with its reference and returns a verdict.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.distributed import launch_ranks, script_env
from tests.ulps import ulps_apart

SCRIPT = ROOT / "tests" / "scripts" / "conformance.py"
WORLD = 2
ZERO = ("zero1", "zero2", "zero3")

# Tolerances (fp32 on CPU, same seed and data as ddp).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
PROBE_TOL = {"rtol": 1e-4, "atol": 1e-5}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-5}
# Accumulation: stage 2 and 3 reduce every micro batch (a sum of averages where ddp averages the
# local sum once), an fp32 rounding difference that AdamW turns into up to ~1e-5 on an element whose
# gradient is near zero; the losses still agree to LOSS_TOL.
PARAM_TOL_BY_CASE = {"moe_accumulate_clip": {"rtol": 1e-5, "atol": 3e-5}}
# bf16-mixed, in bf16 ulps ([Note: tolerances in ulps] in tests/ulps.py). Stages 2 and 3 against
# zero1: equal, losses and the plain forward after fit (BF16_STAGE_TOL, BF16_PROBE_TOL: 0 ulps): the
# same bf16 compute weights give the same bf16 gradients, two ranks' sum is one commutative add in any
# bucket layout, halving is exact, these cases neither clip nor accumulate, and the optimizer steps
# each fp32 master element by element. Against ddp's bf16-mixed (fp32 weights under autocast, one bf16
# rounding fewer per gradient): each loss, an fp32 mean over bf16 logits, within half an ulp of the
# same exact value, so 1 ulp apart; a mixture of experts also routes by bf16 router logits here and
# fp32-weight ones under ddp, and a token whose top-k scores sit within a rounding of each other goes
# to another expert, moving the mean loss by a part of an ulp per such token: 8 ulps for moe_bf16.
BF16_STAGE_TOL = {"ulps": 0, "dtype": torch.bfloat16, "magnitude": "each"}
BF16_DDP_TOL = {"ulps": 1, "dtype": torch.bfloat16, "magnitude": "each"}
BF16_DDP_TOL_BY_CASE = {"moe_bf16": {"ulps": 8, "dtype": torch.bfloat16, "magnitude": "each"}}
BF16_PROBE_TOL = {"ulps": 0, "dtype": torch.bfloat16, "magnitude": "max"}  # a bf16 forward after fit, vs zero1's
# BatchNorm running statistics: ddp broadcasts rank 0's buffers at every forward, ZeRO (like FSDP)
# keeps each rank's own; the eval-mode plain forward is compared on rank 0 only.
RANK0_PROBE_ONLY = {"cnn_batchnorm", "cnn_batchnorm_bf16"}
BF16_CASES = {"cnn_batchnorm_bf16", "int8_frozen_base_bf16", "moe_bf16"}
# Cases whose stage-3 run must send exactly (3 P - H) (dp-1)/dp elements per step (steps after the
# first; H: the last block, held from its forward into its backward).
COMM_CASES = {"blocks_in_moduledict", "blocks_in_sequential"}
# Cases whose ZeRO runs save a sharded checkpoint after fit (``Case(checkpoint=True)``): every
# parameter must be in it once, equal to the trained one (tied, shared, frozen int8, LoRA).
CHECKPOINT_CASES = {"gpt2_tied", "t5_shared_embedding", "lora_frozen_base_reentrant_ckpt", "int8_frozen_base",
                    "optional_tower"}  # fmt: skip


# Models whose ranks run different modules in one step (issue 20): each record's extra["ran"] lists
# the modules each training step ran on that rank.
DYNAMIC_CASES = {"moe_skip_idle_experts", "moe_accumulate_clip", "moe_bf16", "layerdrop_per_rank", "optional_tower"}


def _experts(blocks: int, experts: int) -> list[str]:
    return [f"blocks.{b}.experts.{e}" for b in range(blocks) for e in range(experts)]


# ... of which some module must go unused on *every* rank in some optimizer step (ddp leaves its
# parameters untouched: ``.grad`` None): every module whose use the case records, and the training
# steps (batches) per optimizer step.
UNUSED_BY_EVERY_RANK = {
    "moe_skip_idle_experts": (_experts(2, 8), 1),
    "moe_accumulate_clip": (_experts(2, 16), 2),
    "moe_bf16": (_experts(2, 8), 1),
    "layerdrop_per_rank": ([f"blocks.{i}" for i in range(4)], 1),
}


def record_path(out: Path, run: str, rank: int) -> Path:
    return Path(out) / f"{run}.rank{rank}.pt"


def all_runs() -> list[str]:
    """Every run the script knows, read from the script (``RUNS``) without importing Lightning."""
    import ast

    tree = ast.parse(SCRIPT.read_text())
    cases: list[str] = []
    strategies: tuple = ()
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "CASES":
            cases = [key.value for key in node.value.keys]
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "STRATEGIES":
            strategies = ast.literal_eval(node.value)
    return [f"{case}-{strategy}" for case in cases for strategy in strategies]


def run_matrix(out: Path, runs: list[str] | None = None, *, src: str | None = None,
               budget_s: float = 1500.0, log=None, script: Path = SCRIPT) -> float:  # fmt: skip
    """Run every run (default: all of the conformance script's), relaunching ``script`` for the
    runs left whenever a launch ended early; returns the seconds taken.

    ``src``: the ``src`` folder of the checkout whose ``lightning_zero`` to test (default: this
    one; the environment variable ``LZ_TEST_SRC`` gives the default).
    """
    src = src or os.environ.get("LZ_TEST_SRC") or None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remaining = list(runs or all_runs())
    env = script_env(ROOT)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), str(ROOT)])
    started = time.monotonic()
    launches = 0
    while remaining:
        left = budget_s - (time.monotonic() - started)
        if left <= 30:
            for run in remaining:
                _driver_record(out, run, f"not run: the matrix's time budget ({budget_s:.0f}s) ran out")
            break
        launches += 1
        codes, tail = launch_ranks([sys.executable, str(script), str(out), *remaining], cwd=out, env=env,
                                   timeout_s=left, log_prefix=f"launch{launches}")  # fmt: skip
        if log is not None:
            log(f"launch {launches} of {len(remaining)} runs ended with codes {codes}")
        for run in remaining:
            began = (out / ".status" / f"{run}.started").exists()
            recorded = any(record_path(out, run, rank).exists() for rank in range(WORLD))
            if began and not recorded:  # the launch died inside this run without a word
                _driver_record(out, run, f"launch ended (codes {codes}) during this run:\n{tail}")
        if not any((out / ".status" / f"{run}.started").exists() for run in remaining):
            for run in remaining:  # nothing started at all (import error, ...): stop here
                _driver_record(out, run, f"launch started no run (codes {codes}):\n{tail}")
        remaining = [run for run in remaining if not (out / ".status" / f"{run}.started").exists()]
    return time.monotonic() - started


def _driver_record(out: Path, run: str, error: str) -> None:
    torch.save({"ok": False, "error": error, "by_driver": True}, record_path(out, run, 0))


# ------------------------------------------------------------------------------------------
# judging
# ------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    ok: bool
    problems: list[str] = field(default_factory=list)
    max_loss_diff: float | None = None

    def summary(self) -> str:
        if self.ok:
            diff = "n/a" if self.max_loss_diff is None else f"{self.max_loss_diff:.1e}"
            return f"pass (max loss diff {diff})"
        return "FAIL: " + " | ".join(self.problems)


def _load(out: Path, run: str) -> list[dict | None]:
    records = []
    for rank in range(WORLD):
        path = record_path(out, run, rank)
        records.append(torch.load(path, weights_only=False) if path.exists() else None)
    return records


def _error_lines(record: dict | None, rank: int) -> str:
    """The exception line and the innermost lightning_zero frame (else the innermost frame)."""
    if record is None:
        return f"rank {rank}: no record"
    text = [line for line in record.get("error", "").splitlines() if line.strip()]
    if not text:
        return f"rank {rank}: failed without a message"
    if text[0].startswith(("hang:", "launch", "not run")):
        return f"rank {rank}: {text[0]}"
    frames = [line.strip() for line in text if line.strip().startswith("File ")]
    ours = [frame for frame in frames if "lightning_zero" in frame and "tests/scripts" not in frame]
    where = (ours or frames)[-1:]
    where_text = f" (at {where[0].split('/src/')[-1]})" if where else ""
    return f"rank {rank}: {text[-1].strip()}{where_text}"


def _failures(records: list[dict | None]) -> list[str]:
    if all(r is None for r in records):
        return ["no record on any rank"]
    problems = [
        _error_lines(record, rank) for rank, record in enumerate(records) if record is None or not record.get("ok")
    ]
    texts = {p.split(": ", 1)[1] for p in problems}
    if len(problems) == len(records) and len(texts) == 1:
        return [f"every rank: {texts.pop()}"]
    return problems


def within(got: torch.Tensor, want: torch.Tensor, tol: dict) -> bool:
    """``torch.allclose`` for an ``rtol``/``atol`` tolerance (fp32), ulps for an ``ulps`` one (bf16)."""
    if "ulps" in tol:
        return ulps_apart(got, want, tol["dtype"], magnitude=tol["magnitude"]) <= tol["ulps"]
    return torch.allclose(got, want, **tol)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> str | None:
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.isfinite(got).all():
        return f"{name}: non-finite values"
    if not within(got, want, tol):
        diff = (got - want).abs().max().item()
        if "ulps" in tol:
            apart = ulps_apart(got, want, tol["dtype"], magnitude=tol["magnitude"])
            return f"{name}: max abs diff {diff:.2e}, {apart:.3g} ulps of {tol['dtype']} (allowed {tol['ulps']})"
        return f"{name}: max abs diff {diff:.2e} (rtol {tol['rtol']}, atol {tol['atol']})"
    return None


def _compare(got: dict, want: dict, rank: int, *, loss_tol: dict, probe: bool, params: bool,
             probe_tol: dict = PROBE_TOL, param_tol: dict = PARAM_TOL) -> tuple[list[str], float]:  # fmt: skip
    problems = []
    losses, ref = torch.tensor(got["losses"]), torch.tensor(want["losses"])
    max_diff = math.nan
    if len(losses) == 0 or losses.shape != ref.shape:
        problems.append(f"rank {rank}: {len(losses)} losses, reference has {len(ref)}")
    else:
        max_diff = (losses - ref).abs().max().item()
        issue = _close(f"rank {rank} per-step losses", losses, ref, loss_tol)
        if issue:
            steps = [i for i in range(len(ref)) if not within(losses[i], ref[i], loss_tol)]
            problems.append(f"{issue}, first bad step {steps[0] if steps else '?'}")
    if want["val_losses"] or got["val_losses"]:
        vals, vref = torch.tensor(got["val_losses"]), torch.tensor(want["val_losses"])
        issue = _close(f"rank {rank} val losses", vals, vref, loss_tol)
        if issue:
            problems.append(issue)
    if probe:
        issue = _close(f"rank {rank} plain forward after fit", got["probe"], want["probe"], probe_tol)
        if issue:
            problems.append(issue)
    if params:
        bad = [
            n
            for n in want["params"]
            if n not in got["params"] or _close(n, got["params"][n], want["params"][n], param_tol)
        ]
        if bad:
            first = bad[0]
            detail = (
                "missing"
                if first not in got["params"]
                else _close(first, got["params"][first], want["params"][first], param_tol)
            )
            problems.append(f"rank {rank} params after fit: {len(bad)} differ, e.g. {detail}")
    return problems, max_diff


def judge(out: Path, case: str, strategy: str) -> Verdict:
    """Compare ``<case>-<strategy>`` with its reference (ddp; zero1 and loosely ddp for bf16)."""
    out = Path(out)
    got = _load(out, f"{case}-{strategy}")
    problems = _failures(got)
    if problems:
        return Verdict(False, problems)
    bf16 = case in BF16_CASES
    ddp = _load(out, f"{case}-ddp")
    if _failures(ddp):
        return Verdict(False, ["reference ddp failed: " + "; ".join(_failures(ddp))])
    verdict = Verdict(True)
    diffs = []
    for rank in range(WORLD):
        probe = rank == 0 or case not in RANK0_PROBE_ONLY
        if bf16:
            ddp_tol = BF16_DDP_TOL_BY_CASE.get(case, BF16_DDP_TOL)
            issues, diff = _compare(got[rank], ddp[rank], rank, loss_tol=ddp_tol, probe=False, params=False)
            issues = [f"vs ddp bf16-mixed: {i}" for i in issues]
            if strategy != "zero1":
                zero1 = _load(out, f"{case}-zero1")
                if _failures(zero1):
                    issues.append("reference zero1 failed: " + "; ".join(_failures(zero1)))
                else:
                    more, diff = _compare(got[rank], zero1[rank], rank, loss_tol=BF16_STAGE_TOL, probe=probe,
                                          params=False, probe_tol=BF16_PROBE_TOL)  # fmt: skip
                    issues += [f"vs zero1: {i}" for i in more]
        else:
            param_tol = PARAM_TOL_BY_CASE.get(case, PARAM_TOL)
            issues, diff = _compare(
                got[rank], ddp[rank], rank, loss_tol=LOSS_TOL, probe=probe, params=True, param_tol=param_tol
            )
        verdict.problems += issues
        diffs.append(diff)
        for name, tied in ddp[rank]["ties"].items():
            if tied and not got[rank]["ties"].get(name, False):
                verdict.problems.append(f"rank {rank} tie broken after fit: {name}")
        verdict.problems += _extra_checks(case, strategy, got[rank], ddp[rank], rank)
    verdict.max_loss_diff = max((d for d in diffs if not math.isnan(d)), default=None)
    verdict.ok = not verdict.problems
    return verdict


def _extra_checks(case: str, strategy: str, got: dict, want: dict, rank: int) -> list[str]:
    problems = []
    extra, ref = got["extra"], want["extra"]
    if case in CHECKPOINT_CASES and strategy != "ddp" and rank == 0 and "saved" not in extra:
        problems.append(f"rank {rank}: no checkpoint round trip recorded")
    if "saved" in extra:  # the sharded checkpoint holds every parameter once, as trained
        saved = extra["saved"]
        for name, param in got["params"].items():
            if name not in saved:
                problems.append(f"rank {rank}: checkpoint lacks {name} (holds {sorted(saved)[:6]}...)")
                continue
            issue = _close(f"rank {rank} checkpointed {name}", saved[name], param, {"rtol": 0, "atol": 1e-6})
            if issue:
                problems.append(issue)
    if "inv_freq" in ref:
        issue = _close(
            f"rank {rank} rotary inv_freq",
            extra.get("inv_freq", torch.empty(0)),
            ref["inv_freq"],
            {"rtol": 0, "atol": 0},
        )
        if issue:
            problems.append(issue)
    if "samples" in ref:
        samples, want_samples = extra.get("samples", []), ref["samples"]
        if len(samples) != len(want_samples) or not want_samples:
            problems.append(f"rank {rank}: {len(samples)} callback forwards, reference {len(want_samples)}")
        else:
            for step, (s, w) in enumerate(zip(samples, want_samples)):
                issue = _close(f"rank {rank} callback forward at step {step}", s, w, PROBE_TOL)
                if issue:
                    problems.append(issue)
                    break
    for name, (dtype, value) in ref.get("frozen", {}).items():
        got_dtype, got_value = extra.get("frozen", {}).get(name, ("missing", None))
        if got_dtype != dtype or got_value is None or not torch.equal(got_value, value):
            problems.append(f"rank {rank}: frozen {name} is {got_dtype} after fit (ddp: {dtype}, unchanged)")
    if "trainable" in ref and extra.get("trainable") != ref["trainable"]:
        problems.append(f"rank {rank}: trainable parameters differ from ddp's")
    if "agreement" in ref and len(extra.get("agreement", [])) != len(ref["agreement"]):
        problems.append(
            f"rank {rank}: {len(extra.get('agreement', []))} no_grad student forwards, reference {len(ref['agreement'])}"
        )
    if not extra.get("manual") and extra.get("accumulate", 1) == 1:  # accumulation: no_sync micro batches
        problems += _check_grad_reduce(extra, rank)
    if case in COMM_CASES and strategy == "zero3":
        problems += _check_sent(extra, rank)
    return problems


def _check_grad_reduce(extra: dict, rank: int) -> list[str]:
    """One gradient reduction per bucket per step: (P_trainable + padding) (dp-1)/dp elements sent
    (an all-reduce counts half: it sends twice that), whatever the checkpointing or stage."""
    trainable, padding = extra["num_trainable"], extra.get("padding_numel") or 0
    low, high = trainable * (WORLD - 1) / WORLD, (trainable + padding) * (WORLD - 1) / WORLD
    for step, kinds in enumerate(extra.get("sent_by_kind", [])):
        sent = sum(v * (0.5 if k.startswith("all_reduce") else 1.0) for k, v in kinds.items() if "grad" in k)
        if not low - 0.5 <= sent <= high + 0.5:
            message = (
                f"rank {rank} step {step}: gradient reduction sent {sent:.0f} elements = {sent / low:.2f} x"
                f" P_trainable (dp-1)/dp ({low:.0f}; padding {padding}); by kind {kinds}"
            )
            return [message]
    return []


def expected_stage3_elements(num_params: int, padding_numel: int, held_numel: int = 0, dp: int = WORLD) -> float:
    """ZeRO-3 per step: all-gather in forward, again in backward but the ``held_numel`` elements
    held between them ([Note: held into backward]), reduce-scatter: (3 (P+pad) - H)(dp-1)/dp."""
    return (3 * (num_params + padding_numel) - held_numel) * (dp - 1) / dp


def _check_sent(extra: dict, rank: int) -> list[str]:
    sent = extra.get("sent_per_step", [])
    padding = extra.get("padding_numel")
    if len(sent) < 2 or padding is None:
        return [f"rank {rank}: no per-step comm counts recorded (sent {sent}, padding {padding})"]
    num_params = extra["num_params"]
    if padding > WORLD * 64:  # a few elements per unit, never a whole block
        return [f"rank {rank}: padding {padding} elements for {num_params} parameters"]
    held = extra.get("held_numel", 0)
    if not held:
        return [f"rank {rank}: no unit held from forward into backward (the last block should be)"]
    want = expected_stage3_elements(num_params, padding, held)
    for step, value in enumerate(sent[1:], start=1):
        if abs(value - want) > 0.5:
            kinds = extra["sent_by_kind"][step]
            message = (
                f"rank {rank} step {step}: sent {value:.0f} elements = {value / want:.2f} x (3 P - H) (dp-1)/dp"
                f" ({want:.0f}; P={num_params}, padding {padding}, H={held}); by kind {kinds}"
            )
            return [message]
    return []


# ------------------------------------------------------------------------------------------
# command line: run and write a markdown table
# ------------------------------------------------------------------------------------------
def cases_of(runs: list[str]) -> list[str]:
    seen: list[str] = []
    for run in runs:
        case = run.rsplit("-", 1)[0]
        if case not in seen:
            seen.append(case)
    return seen


def markdown(out: Path, runs: list[str], title: str) -> str:
    lines = [f"### {title}", "", "| case | ddp (reference) | zero1 | zero2 | zero3 |", "|---|---|---|---|---|"]
    details = []
    for case in cases_of(runs):
        row = [case]
        ddp = _load(out, f"{case}-ddp")
        ddp_fail = _failures(ddp)
        row.append("FAIL" if ddp_fail else "ok")
        if ddp_fail:
            details.append(f"- **{case} ddp**: {'; '.join(ddp_fail)}")
        for strategy in ZERO:
            if f"{case}-{strategy}" not in runs:
                row.append("-")
                continue
            verdict = judge(out, case, strategy)
            if verdict.ok:
                row.append(f"pass ({verdict.max_loss_diff:.0e})" if verdict.max_loss_diff is not None else "pass")
            else:
                row.append("FAIL")
                details.append(
                    f"- **{case} {strategy}**: " + " | ".join(p.replace("|", "/") for p in verdict.problems[:4])
                )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + ["", *details, ""])


HANG_SCRIPT = ROOT / "tests" / "scripts" / "hang_cases.py"
HANG_EXPECTED = {"no_trainable": "finishes, as ddp", "uneven_val": "finishes, as ddp",
                 "divergence_extra": "error on every rank naming module, step, rank",
                 "divergence_skip": "finishes, or error on every rank naming the module",
                 "stuck_collective": "error within seconds naming what rank 0 waited on"}  # fmt: skip


def hang_markdown(out: Path, runs: list[str], title: str) -> str:
    """One row per hazard run: what each rank did (finished / error after N s / hang)."""
    lines = [f"### {title}", "", "| run | expected | rank 0 | rank 1 |", "|---|---|---|---|"]
    for run in runs:
        cells = []
        for rank, record in enumerate(_load(out, run)):
            if record is None:
                cells.append("no record")
            elif record.get("ok"):
                cells.append("finished")
            elif record.get("hang") or record.get("error", "").startswith("hang"):
                cells.append("**HANG** (killed at the 45 s limit)")
            else:
                after = record.get("error_after_s")
                when = f" after {after:.1f} s" if after is not None else ""
                cells.append(f"error{when}: " + _error_lines(record, rank).split(": ", 1)[1].replace("|", "/")[:220])
        lines.append(f"| {run} | {HANG_EXPECTED.get(run.rsplit('-', 1)[0], '')} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="*")
    parser.add_argument("--src", default=None, help="src folder of the checkout to test (default: this one)")
    parser.add_argument("--report", default=None, help="append a markdown table to this file")
    parser.add_argument("--title", default="conformance matrix")
    parser.add_argument("--reuse", action="store_true", help="only judge existing records, run nothing")
    parser.add_argument("--hangs", action="store_true", help="run tests/scripts/hang_cases.py instead")
    args = parser.parse_args()
    out = Path(args.out)
    if args.hangs:
        sys.path.insert(0, str(HANG_SCRIPT.parent))
        from tests.test_hangs import RUNS as hang_runs

        runs = args.runs or hang_runs
    else:
        runs = args.runs or all_runs()
    seconds = 0.0
    if not args.reuse:
        script = HANG_SCRIPT if args.hangs else SCRIPT
        seconds = run_matrix(out, runs, src=args.src, log=lambda m: print(m, flush=True), script=script)
    render = hang_markdown if args.hangs else markdown
    table = render(out, runs, args.title if args.reuse else f"{args.title} ({seconds:.0f}s)")
    print(table)
    if args.report:
        with open(args.report, "a") as report:
            report.write(table + "\n")


if __name__ == "__main__":
    main()
