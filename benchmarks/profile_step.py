"""Where a training step's time goes, per strategy (issue 24): torch.profiler over timed steps.

Each case of ``bench_zero12.py`` (``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp2``, ...) trains
as there (same harness, model presets and run flags: [Note: benchmark shape] in ``_harness.py``),
and ``--profile-steps`` steps right after the warm-up run under ``torch.profiler`` (CPU). Every
event of the training thread gives its *self* CPU time to a category, found by walking up from the
event to its innermost ancestor (itself included) that a rule in :data:`CATEGORIES` names: the
engine's ``record_function`` labels (every collective, the gradient hooks, the waits), torch's
``Optimizer.step#`` / ``Optimizer.zero_grad#``, autograd's nodes, FSDP2's ``FSDP::`` labels, and
two labels this script puts around ``training_step`` (``bench::forward``) and ``backward``
(``bench::backward``; what runs there outside autograd's nodes is the end-of-backward sync:
DDP's reducer waiting on its last all-reduce, our ``finish_grad_sync``). ``untraced`` is the
window's wall time not inside any event: Python between ops, Lightning's loop, sleeping waits.
CPU time per category is less sensitive to the shared machine's load than the step's wall time,
though an op preempted by the rank's gloo threads (pinned to the same core) still grows.

    python benchmarks/profile_step.py --models issue24 --cases ddp zero1 zero2 \\
        --batch 4 --steps 6 --warmup 3 --profile-steps 4 --rounds 1 --out benchmarks/results/profile_issue24.json

Prints one table per case (ms per step by category, mean of the two ranks, profiled steps only)
and the difference of each case to the first one given; ``--out`` holds every rank's categories
and its top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero12  # noqa: E402
from _harness import bench_main, model_config, run_cases, run_worker  # noqa: E402
from _stats import machine_note, summarize  # noqa: E402

# (category, label prefixes): the first category whose prefix starts the innermost labeled
# ancestor of an event gets its self time. Order matters only among labels that nest.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("grad hook: copy into bucket", ("lightning_zero::grad_ready",)),
    ("reduce-scatter launch", ("lightning_zero::reduce_scatter_grads",)),
    ("reduce-scatter wait", ("lightning_zero::wait_reduce_scatter",)),
    ("agreements (phase, used params)", ("lightning_zero::agree_",)),
    ("finish_grad_sync (divide, other)", ("lightning_zero::finish_grad_sync",)),
    ("param all-gather launch", ("lightning_zero::launch_param_gather", "lightning_zero::all_gather_params")),
    ("param all-gather wait", ("lightning_zero::wait_param_gather",)),
    (
        "stage 3 gather/free",
        (
            "lightning_zero::all_gather_unit",
            "lightning_zero::wait_all_gather",
            "lightning_zero::free_unit",
            "lightning_zero::stage3",
        ),
    ),  # fmt: skip
    ("FSDP2 all-gather", ("FSDP::all_gather", "FSDP::pre_forward", "FSDP::pre_backward")),
    ("FSDP2 reduce-scatter", ("FSDP::post_backward",)),
    ("FSDP2 other", ("FSDP::",)),
    ("other lightning_zero labels", ("lightning_zero::",)),
    (
        "AccumulateGrad nodes (+ DDP bucket copies, hook calls)",
        ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",),
    ),
    ("backward compute", ("autograd::engine::evaluate_function",)),
    ("end of backward outside autograd (sync)", ("bench::backward",)),
    ("forward + loss", ("bench::forward",)),
    ("optimizer step", ("Optimizer.step#",)),
    ("zero_grad", ("Optimizer.zero_grad#",)),
]
OTHER, UNTRACED, TOTAL = "other ops (Lightning loop)", "untraced (Python, sleeps)", "wall per step"

# Minor page faults of the rank's process inside each bench label, summed since it started (the
# profiler cannot see them: a fault inside ``aten::mm`` reads as a slower matmul). Fresh pages of
# a large allocation fault in on first touch; a step that allocates what the last one freed back
# to the OS pays them every time.
FAULTS: dict[str, int] = {"bench::forward": 0, "bench::backward": 0}


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def category_of(event: Any) -> str:
    node = event
    while node is not None:
        for category, prefixes in CATEGORIES:
            if node.name.startswith(prefixes):
                return category
        node = node.cpu_parent
    return OTHER


def breakdown(events: Any, wall_us: float, steps: int) -> dict[str, Any]:
    """ms per step by category on the busiest thread (the training thread), plus top ops."""
    by_thread: dict[int, float] = {}
    for event in events:
        by_thread[event.thread] = by_thread.get(event.thread, 0.0) + event.self_cpu_time_total
    main = max(by_thread, key=by_thread.get)
    ms: dict[str, float] = {}
    ops: dict[str, float] = {}
    traced = 0.0
    for event in events:
        if event.thread != main:
            continue
        category = category_of(event)
        ms[category] = ms.get(category, 0.0) + event.self_cpu_time_total / 1e3 / steps
        key = f"{event.name} [{category}]"
        ops[key] = ops.get(key, 0.0) + event.self_cpu_time_total / 1e3 / steps
        if event.cpu_parent is None:
            traced += event.cpu_time_total
    ms[UNTRACED] = max(0.0, wall_us - traced) / 1e3 / steps
    ms[TOTAL] = wall_us / 1e3 / steps
    other_threads = {str(t): us / 1e3 / steps for t, us in by_thread.items() if t != main}
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:25])
    return {"ms_per_step": ms, "other_threads_ms_per_step": other_threads, "top_ops_ms_per_step": top}


def make_profiler_callback(first_step: int, steps: int, result: dict[str, Any]) -> Any:
    """Profile optimizer steps ``first_step`` .. ``first_step + steps - 1`` into ``result``."""
    from lightning.pytorch.callbacks import Callback

    class StepProfiler(Callback):
        def __init__(self) -> None:
            self._profiler: Any = None
            self._started = 0.0
            self._faults_at_start: dict[str, int] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == first_step:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU])
                self._profiler.__enter__()
                self._started = time.perf_counter()
                self._faults_at_start = {**FAULTS, "total": _minor_faults()}

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._profiler is None or trainer.global_step != first_step + steps:  # global_step counts this one
                return
            wall_us = (time.perf_counter() - self._started) * 1e6
            self._profiler.__exit__(None, None, None)
            faults = {**FAULTS, "total": _minor_faults()}
            faults_per_step = {label: (faults[label] - self._faults_at_start[label]) / steps for label in faults}
            result.update(breakdown(self._profiler.events(), wall_us, steps), profiled_steps=steps)
            result["minor_faults_per_step"] = faults_per_step
            self._profiler = None

    return StepProfiler()


def with_phase_labels(make_module: Any) -> Any:
    """``make_module`` whose module runs ``training_step`` / ``backward`` inside bench labels."""

    def make(config: Any) -> Any:
        from torch.profiler import record_function

        module = make_module(config)
        training_step, backward = module.training_step, module.backward

        def labeled(label: str, fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                faults_before = _minor_faults()
                try:
                    with record_function(label):
                        return fn(*args, **kwargs)
                finally:
                    FAULTS[label] += _minor_faults() - faults_before

            return run

        labeled_step, labeled_backward = labeled("bench::forward", training_step), labeled("bench::backward", backward)

        module.training_step, module.backward = labeled_step, labeled_backward
        return module

    return make


def worker(args: argparse.Namespace) -> None:
    case = bench_zero12.CASES[args.worker]
    profile: dict[str, Any] = {}
    callback = make_profiler_callback(args.warmup, args.profile_steps, profile)
    run_worker(
        args,
        label=case.label,
        stage=case.stage,
        make_strategy=lambda: case.make(args),
        make_module=with_phase_labels(bench_zero12.with_backward_tail_timer(case.make_module)),
        state_bytes=lambda trainer: {},
        callbacks=[callback],
        result_extra=lambda: {"profile": profile},
    )


def _mean_ranks(ranks: list[dict[str, Any]]) -> dict[str, float]:
    keys = {key for rank in ranks for key in rank["profile"].get("ms_per_step", {})}
    return {key: statistics.mean(rank["profile"]["ms_per_step"].get(key, 0.0) for rank in ranks) for key in keys}


def faults_by_case(per_case: dict[str, Any]) -> str:
    """Minor page faults per profiled step (mean of the ranks, median over rounds), per case."""
    lines = [f"{'minor page faults per step (mean of 2 ranks)':<56}" + "".join(f"{c:>12}" for c in per_case)]
    for label, name in (
        ("bench::forward", "in training_step"),
        ("bench::backward", "in backward"),
        ("total", "whole step"),
    ):
        cells = ""
        for case in per_case.values():
            means = [
                statistics.mean(rank.get("minor_faults_per_step", {}).get(label, 0.0) for rank in ranks)
                for ranks in case["ranks_by_round"]
            ]
            cells += f"{statistics.median(means):12.0f}"
        lines.append(f"{name:<56}{cells}")
    return "\n".join(lines)


def format_profiles(profiles: dict[str, dict[str, float]]) -> str:
    """One column per case (ms per step), categories as rows, then each case minus the first."""
    cases = list(profiles)
    order = [name for name, _ in CATEGORIES] + [OTHER, UNTRACED, TOTAL]
    rows = [name for name in order if any(profiles[c].get(name, 0.0) >= 0.05 for c in cases)]
    first = cases[0]
    header = f"{'ms per step (mean of 2 ranks)':<56}" + "".join(f"{c:>12}" for c in cases)
    header += "".join(f"{c + '-' + first:>16}" for c in cases[1:])
    lines = [header, "-" * len(header)]
    for name in rows:
        cells = "".join(f"{profiles[c].get(name, 0.0):12.1f}" for c in cases)
        cells += "".join(f"{profiles[c].get(name, 0.0) - profiles[first].get(name, 0.0):+16.1f}" for c in cases[1:])
        lines.append(f"{name:<56}{cells}")
    return "\n".join(lines)


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    import tempfile

    script = str(Path(__file__).resolve())
    if args.knobs is None:
        args.knobs = "fixed" if "--bucket-mb" in argv else "default"
        argv = [*argv, "--knobs", args.knobs]
    runs: dict[str, Any] = {}
    for model in args.models:
        presets = bench_zero12.QUICK_MODELS if args.quick else bench_zero12.MODELS
        model_argv = bench_zero12._without_models([a for a in argv if a != "--quick"]) + presets[model]
        model_argv += bench_zero12.QUICK_RUN if args.quick else []
        model_args = _parse(model_argv)
        if model_args.steps < model_args.profile_steps:  # the profiler must close before training ends
            model_argv += ["--steps", str(model_args.profile_steps)]
            model_args = _parse(model_argv)
        config = model_config(model_args)
        print(f"=== model {model}: {config.num_params() / 1e6:.1f}M params, batch {model_args.batch} x seq"
              f" {model_args.seq}, {model_args.profile_steps} profiled steps after {model_args.warmup} ===", flush=True)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
            run = run_cases(script, model_args, model_argv, Path(tmp))
        profiles: dict[str, dict[str, float]] = {}
        per_case: dict[str, Any] = {}
        for case, rounds in run["results"].items():
            good = [r["ranks"] for r in rounds if "ranks" in r]
            if not good:
                print(f"{case}: no result ({rounds[0].get('error') if rounds else 'not run'})")
                continue
            # median over rounds of each category's mean over ranks
            means = [_mean_ranks(ranks) for ranks in good]
            keys = {k for m in means for k in m}
            profiles[case] = {k: statistics.median(m.get(k, 0.0) for m in means) for k in keys}
            row = summarize(case, rounds)
            per_case[case] = {
                "ms_per_step": profiles[case],
                "unprofiled_step_s_median": row["step_s_median"],
                "ranks_by_round": [[rank["profile"] for rank in ranks] for ranks in good],
            }
        table = format_profiles(profiles) if profiles else "(no results)"
        print("\n" + table)
        if per_case:
            faults_table = faults_by_case(per_case)
            print("\n" + faults_table)
            table += "\n\n" + faults_table
        steps_line = ", ".join(f"{c} {v['unprofiled_step_s_median'] * 1e3:.0f} ms" for c, v in per_case.items())
        print(f"timed step medians (profiled steps included): {steps_line}")
        runs[model] = {"argv": model_argv, "cases": per_case, "table": table, "git": run["git"]}
    if args.out:
        payload = {"benchmark": "profile_step", "machine": machine_note(), "models": runs}
        Path(args.out).write_text(json.dumps(payload, indent=1, default=float))
        print(f"wrote {args.out}")


def extra_args(parser: argparse.ArgumentParser) -> None:
    bench_zero12.extra_args(parser)
    parser.add_argument("--profile-steps", type=int, default=4, help="steps profiled right after the warm-up")


def _parse(argv: list[str]) -> argparse.Namespace:
    from _harness import add_common_args

    parser = argparse.ArgumentParser()
    add_common_args(parser, default_cases=["ddp", "zero1", "zero2"])
    extra_args(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], ["ddp", "zero1", "zero2"], worker, driver, extra_args=extra_args)
