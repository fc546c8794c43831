"""The planner's step-time model against measured step times on this machine (issue 15).

2 CPU ranks (gloo), the benchmark model of ``bench_zero12.py`` / ``bench_zero3.py`` (tiny Llama,
33.6M parameters, fp32, AdamW), four cases: Lightning ``ddp``, ``zero1``, ``zero2``, ``zero3``
(``prefetch_blocks=1``). Three parts, all in one run:

1. calibrate this machine (``lightning_zero.planner.calibrate``: gloo collectives, overlap,
   matmul FLOP/s, a forward + backward of the model shape in one process, AdamW memory
   bandwidth, the Lightning loop's per-step overhead: ``step_overhead_ms``) and write the hardware YAML (``--hardware PATH`` reuses one instead);
2. predict each case's step time with ``planner.plan_run`` on that hardware;
3. measure each case (the benchmarks' harness: fresh process pairs, each rank pinned to a core,
   rounds in alternating order, median over timed steps) and compare: error per case (goal: within
   25%) and the ranking of the four (goal: the same).

    python benchmarks/planner_check.py --out benchmarks/results/planner_check.json
    python benchmarks/planner_check.py --quick      # tiny model, 1 round: checks the plumbing

``--previous benchmarks/results/zero12.json benchmarks/results/zero3.json`` also compares the
predictions with those earlier runs (same model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero3  # noqa: E402
import bench_zero12  # noqa: E402
from _harness import add_common_args, exit_if_any_failed, model_config, run_cases  # noqa: E402
from _stats import machine_note, summarize  # noqa: E402

# case -> (ZeRO stage for the planner, module whose worker runs it, label)
CASES: dict[str, tuple[int, Any, str]] = {
    "ddp": (0, bench_zero12, "ddp"),
    "zero1": (1, bench_zero12, "zero1"),
    "zero2": (2, bench_zero12, "zero2"),
    "zero3_prefetch1": (3, bench_zero3, "zero3"),
}
QUICK = [
    "--dim",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--ffn",
    "128",
    "--vocab",
    "512",
    "--seq",
    "32",
    "--batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--rounds",
    "1",
]
TOLERANCE = 0.25


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, default_cases=list(CASES))
    parser.add_argument("--hardware", default=None, help="a calibrated hardware YAML to use (skips calibration)")
    parser.add_argument("--hardware-out", default=None, help="where calibration writes its YAML")
    parser.add_argument("--previous", nargs="*", default=[], help="earlier bench_zero12/zero3 JSON to compare with")
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="per-step overhead to plan with (default: the hardware YAML's step_overhead_ms, which calibration measures)",
    )
    parser.add_argument("--no-measure", action="store_true", help="predict only")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round (plumbing check)")
    args = parser.parse_args(argv)
    if args.quick and not args.worker:
        args = parser.parse_args([*argv, *QUICK])
    return args


def calibrated_hardware(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """Run the calibration (or reuse ``--hardware``); return the YAML path and the raw measurements."""
    from lightning_zero.planner import calibrate

    if args.hardware:
        return Path(args.hardware), {}
    out = Path(args.hardware_out or (Path(__file__).resolve().parent / "results" / "cpu_calibrated.yaml"))
    # The calibration model is the benchmark's own (the harness builds it from the same args).
    model = {key: value for key, value in dataclasses.asdict(model_config(args)).items() if key != "name"}
    if args.quick:
        result = calibrate.calibrate(
            name=out.stem,
            sizes_mb=calibrate.QUICK_SIZES_MB,
            repeats=2,
            model=model,
            micro_batch=args.batch,
            seq_len=args.seq,
            adamw_numel=200_000,
            overlap_mb=0.5,
            overhead_steps=3,
        )
    else:
        result = calibrate.calibrate(name=out.stem, model=model, micro_batch=args.batch, seq_len=args.seq)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(calibrate.hardware_yaml(result["hardware"], result["measured"]))
    print(f"calibrated hardware written to {out}", flush=True)
    return out, result


def predict(args: argparse.Namespace, hardware: Path) -> dict[str, dict[str, Any]]:
    """The planner's step time for each case (2 ranks on one 2-device node, fp32, the bench model)."""
    from lightning_zero.config import ZERO_DEFAULTS
    from lightning_zero.planner import load_hardware, plan_run

    hw = load_hardware(hardware)
    if args.step_overhead_ms is not None:
        hw = dataclasses.replace(hw, step_overhead_s=args.step_overhead_ms * 1e-3)
    config = model_config(args)
    out = {}
    for case in args.cases:
        stage = CASES[case][0]
        plan = plan_run(
            config,
            stage=stage,
            world_size=2,
            devices_per_node=2,
            precision="32-true",
            micro_batch=args.batch,
            seq_len=args.seq,
            bucket_mb=args.bucket_mb,
            prefetch_blocks=1,
            overlap_param_gather=ZERO_DEFAULTS.overlap_param_gather,  # what the benchmarked engine does
            hardware=hw,
            suggest=False,
        )
        assert plan.timing is not None
        out[case] = plan.timing.as_dict()
    return out


def ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.get)  # type: ignore[arg-type]


def previous_runs(paths: list[str]) -> dict[str, dict[str, float]]:
    """Median and quietest-round median step time per case from earlier benchmark JSON files."""
    found: dict[str, dict[str, float]] = {}
    for path in paths:
        payload = json.loads(Path(path).read_text())
        for row in payload.get("rows", []):
            if row.get("case") in CASES and "step_s_median" in row:
                rounds = [r for r in row.get("step_s_round_medians") or [] if r is not None]
                found[row["case"]] = {
                    "median_s": row["step_s_median"],
                    "quietest_round_s": min(rounds) if rounds else row["step_s_median"],
                    "source": f"{path} ({payload['machine']['date']})",
                }
    return found


TIE_MARGIN = 0.02  # a same-round difference below 2% is no order


def told_apart(round_medians: dict[str, list[float]], margin: float = TIE_MARGIN) -> dict[tuple[str, str], str]:
    """Pairs of cases the measurement tells apart: ``(a, b) -> faster`` when the same one of the
    two was faster by more than ``margin`` (relative) in every round (same-round medians; rounds
    where either failed are skipped). Other pairs (the order flips between rounds, or the two are
    within the margin) are ties at this machine's noise and are left out."""
    pairs: dict[tuple[str, str], str] = {}
    cases = sorted(round_medians)
    for i, a in enumerate(cases):
        for b in cases[i + 1 :]:
            rounds = [
                (x, y)
                for x, y in zip(round_medians[a], round_medians[b])
                if x is not None and y is not None and x == x and y == y
            ]
            if rounds and all(x * (1 + margin) < y for x, y in rounds):
                pairs[(a, b)] = a
            elif rounds and all(y * (1 + margin) < x for x, y in rounds):
                pairs[(a, b)] = b
    return pairs


def ranking_where_told_apart(predicted_s: dict[str, float], pairs: dict[tuple[str, str], str]) -> list[str]:
    """The pairs the measurement tells apart whose predicted order is the other way round."""
    return [
        f"{a}/{b}"
        for (a, b), faster in pairs.items()
        if (predicted_s[a] < predicted_s[b]) != (faster == a) or predicted_s[a] == predicted_s[b]
    ]


def compare(
    predicted: dict[str, dict[str, Any]],
    measured: dict[str, float],
    round_medians: Optional[dict[str, list[float]]] = None,
) -> tuple[list[str], dict[str, Any]]:
    header = (
        f"{'case':<8}{'predicted s':>12}{'measured s':>12}{'error':>9}  {'compute':>8}{'exposed':>9}"
        f"{'optim':>8}{'copies':>8}{'post-AG':>8}{'overhead':>9}"
    )
    lines = [header, "-" * len(header)]
    errors = {}
    for case, timing in predicted.items():
        label = CASES[case][2]
        got = measured.get(case)
        error = (timing["step_s"] / got - 1) if got else float("nan")
        errors[case] = error
        lines.append(
            f"{label:<8}{timing['step_s']:>12.3f}{(got or float('nan')):>12.3f}{error:>+9.1%}  "
            f"{timing['compute_s']:>8.3f}{timing['exposed_comm_s']:>9.3f}{timing['optimizer_s']:>8.3f}"
            f"{timing['grad_copy_s']:>8.3f}{timing['post_step_gather_s']:>8.3f}{timing.get('overhead_s', 0.0):>9.3f}"
        )
    predicted_order = [CASES[c][2] for c in ranking({c: t["step_s"] for c, t in predicted.items()})]
    measured_order = [CASES[c][2] for c in ranking({c: measured[c] for c in predicted if c in measured})]
    within = all(abs(e) <= TOLERANCE for e in errors.values() if e == e) and len(measured) == len(predicted)
    lines.append(
        f"ranking, fastest first: predicted {' < '.join(predicted_order)}; measured {' < '.join(measured_order)}"
    )
    lines.append(
        f"goal: every case within {TOLERANCE:.0%}: {'met' if within else 'NOT met'}; "
        f"same ranking: {'met' if predicted_order == measured_order else 'NOT met'}"
    )
    verdict = {
        "errors": errors,
        "predicted_order": predicted_order,
        "measured_order": measured_order,
        "within_tolerance": within,
        "same_ranking": predicted_order == measured_order,
    }
    if round_medians:
        pairs = told_apart({c: round_medians[c] for c in predicted if c in round_medians})
        wrong = ranking_where_told_apart({c: t["step_s"] for c, t in predicted.items()}, pairs)
        label = {c: CASES[c][2] for c in predicted}
        shown = ", ".join(f"{label[pairs[p]]} < {label[p[0] if pairs[p] == p[1] else p[1]]}" for p in pairs)
        lines.append(
            f"pairs faster by > {TIE_MARGIN:.0%} in every round: {shown or 'none'}; predicted the same way: "
            f"{'met' if not wrong else 'NOT met (' + ', '.join(wrong) + ')'} (the other pairs are ties at this noise)"
        )
        verdict["told_apart"] = {f"{a}/{b}": faster for (a, b), faster in pairs.items()}
        verdict["ranking_where_told_apart"] = not wrong
    return lines, verdict


def worker(args: argparse.Namespace) -> None:
    CASES[args.worker][1].worker(args)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return {}
    unknown = [case for case in args.cases if case not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    hardware, calibration = calibrated_hardware(args)
    predicted = predict(args, hardware)
    payload: dict[str, Any] = {
        "benchmark": "planner_check",
        "started": started,
        "hardware_yaml": str(hardware),
        "hardware": Path(hardware).read_text(),
        "calibration": calibration,
        "predicted": predicted,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_dir")},
    }
    report: list[str] = []
    if not args.no_measure:
        worker_argv = [a for a in (QUICK + argv if args.quick else argv) if a != "--quick"]
        with tempfile.TemporaryDirectory(prefix="planner_check_") as tmp:
            run = run_cases(str(Path(__file__).resolve()), args, worker_argv, Path(tmp))
        rows = [summarize(case, run["results"][case]) for case in args.cases]
        measured = {row["case"]: row["step_s_median"] for row in rows if "error" not in row}
        payload.update(
            measured={
                row["case"]: {k: row.get(k) for k in ("step_s_median", "step_s_round_medians", "step_s_all", "error")}
                for row in rows
            },
            git=run["git"],
            machine=machine_note(),
        )
        rounds = {row["case"]: row.get("step_s_round_medians") or [] for row in rows if "error" not in row}
        report, verdict = compare(predicted, measured, rounds)
        payload["verdict"] = verdict
    if args.previous:
        previous = previous_runs(args.previous)
        payload["previous"] = previous
        for key in ("median_s", "quietest_round_s"):
            lines, verdict = compare(predicted, {case: row[key] for case, row in previous.items()})
            sources = "; ".join(sorted({r["source"] for r in previous.values()}))
            report += ["", f"against earlier runs ({key}): {sources}"]
            report += lines
            payload[f"verdict_previous_{key}"] = verdict
    if not report:
        report = [f"{CASES[c][2]}: predicted {t['step_s']:.3f} s" for c, t in predicted.items()]
    print("\n" + "\n".join(report))
    payload["report"] = report
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1, default=float))
        print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
    exit_if_any_failed()
