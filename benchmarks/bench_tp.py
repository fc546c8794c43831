"""Tensor parallel (tp=2) against data parallel (dp=2) on 2 CPU ranks, through ZeroStrategy (issue 5).

    python benchmarks/bench_tp.py --out results_tp.json

Cases: ``ZeroStrategy(stage=2, tensor_parallel_size=2)`` (tp=2, dp=1: each rank holds half of
every block and of the vocabulary; both ranks see the same batch) and
``ZeroStrategy(stage=2, tensor_parallel_size=1)`` (dp=2: each rank its own batch). Per case:
logical bytes sent per step on the tp group (the all-reduces of activations and of the
vocab-parallel loss) and on the dp group (gradient reduce-scatter + parameter all-gather), each
beside its formula (docs/tensor_parallel.md; ``lightning_zero/ring.py``), step time, and tokens per second over
both ranks (dp=2 trains on twice the tokens per step at the same per-rank batch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import bench_main, drive, model_config, run_worker  # noqa: E402
from _stats import MIB, step_ratio  # noqa: E402
from bench_zero12 import zero_at_end, zero_state_bytes, zero_step_extra  # noqa: E402

CASES = {"tp2": 2, "dp2": 1}  # case -> tensor_parallel_size


def worker(args: argparse.Namespace) -> None:
    tp = CASES[args.worker]

    def make_strategy() -> Any:
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(  # collective_timeout=None: the path GPUs run (see bench_zero12.py)
            stage=2, tensor_parallel_size=tp, bucket_mb=args.bucket_mb, monitor=False, collective_timeout=None
        )

    run_worker(
        args,
        label=f"ZeroStrategy(stage=2, tensor_parallel_size={tp})",
        stage=2,
        make_strategy=make_strategy,
        state_bytes=zero_state_bytes,
        extra_step=zero_step_extra,
        at_end=zero_at_end,
    )


def predicted(args: argparse.Namespace, tp: int) -> dict[str, float]:
    """Bytes one rank sends per step: tp all-reduces (docs/tensor_parallel.md) and the dp formula."""
    config = model_config(args)
    dp = 2 // tp
    tokens = args.batch * args.seq
    ring = 2 * (tp - 1) / tp
    norm_params = (2 * config.n_layers + 1) * config.dim  # replicated over tp
    params_per_rank = (config.num_params() - norm_params) / tp + norm_params
    return {
        "tp_activations": (4 * config.n_layers + 2) * ring * tokens * config.dim * 4,
        "tp_loss": ring * 3 * tokens * 4,
        "dp": 2 * (dp - 1) / dp * 4 * params_per_rank,
    }


def report(rows: list[dict], args: argparse.Namespace) -> list[str]:
    header = (
        f"{'case':<8}{'tp MiB/step':>13}{'formula':>10}{'dp MiB/step':>13}{'formula':>10}"
        f"{'step s':>9}{'tokens/s':>10}{'params MiB/rank':>17}"
    )
    lines = [header, "-" * len(header)]
    by_case = {row["case"]: row for row in rows if "error" not in row}
    for name, row in by_case.items():
        tp = CASES[name]
        want = predicted(args, tp)
        sent = row["sent_bytes_per_step"][0]
        tp_sent = sent.get("all_reduce", 0.0)
        dp_sent = sent.get("reduce_scatter", 0.0) + sent.get("all_gather", 0.0)
        tokens_per_step = args.batch * args.seq * (2 // tp)
        lines.append(
            f"{name:<8}{tp_sent / MIB:>13,.2f}{(want['tp_activations'] + want['tp_loss']) / MIB:>10,.2f}"
            f"{dp_sent / MIB:>13,.2f}{want['dp'] / MIB:>10,.2f}{row['step_s_median']:>9.3f}"
            f"{tokens_per_step / row['step_s_median']:>10,.0f}{row['state_bytes'][0]['params'] / MIB:>17,.1f}"
        )
        row["predicted_sent_bytes_per_step_by_group"] = want
    if "tp2" in by_case and "dp2" in by_case:
        ratio = step_ratio(by_case["tp2"], by_case["dp2"])
        lines.append(f"tp=2 step time {ratio:.3f}x dp=2 at the same per-rank batch (half the tokens per step)")
    return lines


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    drive(
        "tp",
        str(Path(__file__).resolve()),
        args,
        argv,
        known_cases=CASES,
        baseline="dp2",
        report=lambda rows: report(rows, args),
    )


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], CASES, worker, driver)
