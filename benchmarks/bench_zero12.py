"""ZeRO-1/2/3 side by side with Lightning's ddp, FSDP (SHARD_GRAD_OP), FSDP2 and DeepSpeed (issues 3, 13).

2 CPU ranks (gloo), fp32, every case in one run, on two models: the 33.6M-parameter bench Llama
and a ~5.3M-parameter one (21 MB of gradients: smaller than DDP's and our default bucket), each
strategy with its default knobs (``--knobs fixed``: every one with ``--bucket-mb``):

    python benchmarks/bench_zero12.py --out results_zero12.json            # ddp zero1 zero2 zero3 fsdp_grad_op fsdp2
    python benchmarks/bench_zero12.py --quick                              # smoke: tiny models, 1 step, 1 round
    python benchmarks/bench_zero12.py --models small --cases zero2 ddp --rounds 3

A third model, ``--models issue24``, is issue 24's harness: 29.9M parameters (dim 512, 8 layers,
4 heads and 4 KV heads, SwiGLU 1408, vocab 4096, untied head), run at seq 128, batch 4 per rank,
12 timed steps after 3 warm-up, 3 rounds:

    python benchmarks/bench_zero12.py --models issue24 --cases ddp zero1 zero2 zero3 fsdp2 \
        --batch 4 --steps 12 --warmup 3 --rounds 3 --out zero12_issue24.json

(``benchmarks/profile_step.py`` runs the same cases under torch.profiler and says where each
step's time goes.)

Per case and model: median step time and its ratio to ddp (median of same-round ratios, each
round's ratio listed), peak RSS per rank, model-state bytes per rank (measured, next to the ZeRO
formula for what the strategy shards), logical bytes sent per step, and the exposed gradient
collective time per step: from the gradient of the embedding output (the last compute of
backward) to backward returning, which is where DDP, FSDP, FSDP2 and our engine all wait for
their last gradient collectives (plus, for our engine, its own timeline's ``exposed_s``). See
[Note: benchmark shape] in ``_harness.py`` and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_common_args, bench_main, drive, run_worker  # noqa: E402
from _stats import comm_table, machine_note, round_ratios, state_vs_formula, step_ratio  # noqa: E402


@dataclass(frozen=True)
class Case:
    """How to build one strategy, which ZeRO stage its memory should match, how to count it."""

    label: str
    stage: int  # the ZeRO stage whose formula the strategy's model states should follow
    make: Callable[[argparse.Namespace], Any]
    family: str  # "zero", "ddp", "fsdp", "fsdp2", "deepspeed"
    make_module: Optional[Callable[[Any], Any]] = None  # default: LlamaLM


# The two models of issue 13 and issue 24's (LlamaConfig fields as command-line flags), and tiny
# ones for --quick.
MODELS: dict[str, list[str]] = {
    "bench": ["--dim", "512", "--layers", "8", "--heads", "8", "--kv-heads", "4", "--ffn", "1536", "--vocab", "8192"],
    "small": ["--dim", "256", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "768", "--vocab", "4096"],
    # issue 24's harness: 29.9M parameters, MHA (4 heads, 4 KV heads), SwiGLU 1408, untied head
    "issue24": ["--dim", "512", "--layers", "8", "--heads", "4", "--kv-heads", "4", "--ffn", "1408", "--vocab", "4096"],
}
QUICK_MODELS: dict[str, list[str]] = {
    "bench": ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"],
    "small": ["--dim", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "128"],
    "issue24": ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "4", "--ffn", "176", "--vocab", "256"],
}
MODEL_FLAGS = ("--dim", "--layers", "--heads", "--kv-heads", "--ffn", "--vocab")
QUICK_RUN = ["--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"]
DEFAULT_CASES = ["ddp", "zero1", "zero2", "zero3", "fsdp_grad_op", "fsdp2"]


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["bench", "small"], help="models, each run in full"
    )
    parser.add_argument(
        "--knobs",
        choices=["default", "fixed"],
        default=None,
        help="default: each strategy's own defaults (ours: bucket_mb='auto'; ddp: 25 MiB buckets);"
        " fixed: every strategy with --bucket-mb (the default when --bucket-mb is given)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny models, 1 timed step, 1 round")


def _zero(stage: int, overlap: bool = True, **kwargs: Any) -> Callable[[argparse.Namespace], Any]:
    def make(args: argparse.Namespace) -> Any:
        from lightning_zero import ZeroStrategy

        # collective_timeout=None: the reduce-scatter path GPUs run (on gloo a finite timeout polls
        # an all-reduce instead; see [Note: collective timeout] in zero/reducer.py)
        return ZeroStrategy(
            stage=stage,
            bucket_mb=args.bucket_mb if getattr(args, "knobs", "fixed") == "fixed" else "auto",
            overlap_comm=overlap,
            monitor=False,
            collective_timeout=None,
            **kwargs,
        )

    return make


def _ddp(args: argparse.Namespace) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(bucket_cap_mb=args.bucket_mb) if getattr(args, "knobs", "fixed") == "fixed" else DDPStrategy()


def _fsdp2(args: argparse.Namespace) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _fsdp2_module(config: Any) -> Any:
    from _incumbents import fully_sharded_llama_lm

    return fully_sharded_llama_lm(config, lr=3e-4, warmup_steps=1)


def _fsdp(args: argparse.Namespace) -> Any:
    from _incumbents import CPUFSDPStrategy

    from lightning_zero.models.llama import TransformerBlock

    return CPUFSDPStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={TransformerBlock})


def _deepspeed(stage: int) -> Callable[[argparse.Namespace], Any]:
    def make(args: argparse.Namespace) -> Any:
        from _incumbents import CPUDeepSpeedStrategy

        bucket_elements = int(args.bucket_mb * 2**20) // 4  # same bucket bytes as everyone (fp32)
        return CPUDeepSpeedStrategy(
            stage=stage,
            reduce_bucket_size=bucket_elements,
            allgather_bucket_size=bucket_elements,
            process_group_backend="gloo",
        )

    return make


CASES: dict[str, Case] = {
    "zero1": Case("ZeroStrategy(stage=1)", 1, _zero(1), "zero"),
    "zero2": Case("ZeroStrategy(stage=2)", 2, _zero(2), "zero"),
    "zero3": Case("ZeroStrategy(stage=3)", 3, _zero(3), "zero"),
    "zero2_no_overlap": Case("ZeroStrategy(stage=2, overlap_comm=False)", 2, _zero(2, overlap=False), "zero"),
    # the post-step parameter all-gather waited inside the step (issue 13's overlap turned off)
    "zero1_gather_sync": Case(
        "ZeroStrategy(stage=1, overlap_param_gather=False)", 1, _zero(1, overlap_param_gather=False), "zero"
    ),
    "zero2_gather_sync": Case(
        "ZeroStrategy(stage=2, overlap_param_gather=False)", 2, _zero(2, overlap_param_gather=False), "zero"
    ),
    # stage 2 blocks in backward when max_buckets_in_flight buffers are out; 4 of ~6 buckets
    "zero2_inflight4": Case(
        "ZeroStrategy(stage=2, max_buckets_in_flight=4)", 2, _zero(2, max_buckets_in_flight=4), "zero"
    ),
    # issue 43: the checkpoint written in the background (bench_memory.py times the save stall)
    "zero1_async": Case("ZeroStrategy(stage=1, async_checkpoint=True)", 1, _zero(1, async_checkpoint=True), "zero"),
    "zero2_async": Case("ZeroStrategy(stage=2, async_checkpoint=True)", 2, _zero(2, async_checkpoint=True), "zero"),
    "zero3_async": Case("ZeroStrategy(stage=3, async_checkpoint=True)", 3, _zero(3, async_checkpoint=True), "zero"),
    "ddp": Case("DDPStrategy", 0, _ddp, "ddp"),
    "fsdp_grad_op": Case('FSDPStrategy("SHARD_GRAD_OP"), per block', 2, _fsdp, "fsdp"),
    "fsdp2": Case("ModelParallelStrategy(dp=2, tp=1), fully_shard per block", 3, _fsdp2, "fsdp2", _fsdp2_module),
    "deepspeed1": Case("DeepSpeedStrategy(stage=1)", 1, _deepspeed(1), "deepspeed"),
    "deepspeed2": Case("DeepSpeedStrategy(stage=2)", 2, _deepspeed(2), "deepspeed"),
}


# --------------------------------------------------------------------------------------------
# Worker: what each family holds and sends
# --------------------------------------------------------------------------------------------


def zero_state_bytes(trainer: Any) -> dict[str, int]:
    engine = trainer.strategy.engine
    measured = engine.measured_bytes()
    states = {key: int(measured[key]) for key in ("params", "grads", "optimizer")}
    if engine.stage3 is not None:  # after forward the head is still gathered: working set, not model state
        states["params"] -= engine.stage3.gathered_bytes()
    return states


def zero_step_extra(trainer: Any) -> dict[str, float]:
    timeline = trainer.strategy.engine.reducer.timeline
    # exposed_s: collective time left after backward ended (older engines: exposed_wait_s)
    exposed = getattr(timeline, "exposed_s", None)
    exposed = getattr(timeline, "exposed_wait_s", 0.0) if exposed is None else exposed
    return {"comm_s": timeline.comm_s, "exposed_wait_s": exposed, **backward_tail_extra(trainer)}


def with_backward_tail_timer(make_module: Optional[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """``make_module`` whose module times the end of each backward, for every strategy alike.

    [Note: exposed gradient-collective time] The last compute of a Llama backward is the
    embedding's (its output's gradient arrives last). Every strategy here waits for its last
    gradient collectives before ``backward()`` returns (DDP's reducer and FSDP's post-backward
    callbacks, our engine's end-of-backward callback), so the time from that gradient to
    ``on_after_backward`` is the gradient-collective time backward did not hide, plus the
    end-of-backward bookkeeping (the embedding's own backward is in it, the same for everyone).
    """

    def make(config: Any) -> Any:
        if make_module is not None:
            module = make_module(config)
        else:
            from lightning_zero.models import LlamaLM

            module = LlamaLM(config, lr=3e-4, warmup_steps=1)
        marks: dict[str, float] = {}
        module._backward_tail_marks = marks

        def mark_embedding_grad(grad: Any) -> None:
            marks["embedding_grad"] = time.perf_counter()

        def on_embedding_forward(mod: Any, inputs: Any, output: Any) -> None:
            if output.requires_grad:
                output.register_hook(mark_embedding_grad)

        def on_train_start() -> None:
            module.model.tok_embeddings.register_forward_hook(on_embedding_forward)

        def on_after_backward() -> None:
            marks["backward_returned"] = time.perf_counter()

        module.on_train_start = on_train_start
        module.on_after_backward = on_after_backward
        return module

    return make


def backward_tail_extra(trainer: Any) -> dict[str, float]:
    """This step's exposed gradient-collective time ([Note: exposed gradient-collective time])."""
    marks = getattr(trainer.lightning_module, "_backward_tail_marks", {})
    if "embedding_grad" not in marks or "backward_returned" not in marks:
        return {}
    return {"backward_tail_s": marks["backward_returned"] - marks["embedding_grad"]}


def zero_at_end(trainer: Any, max_steps: int) -> dict[str, Any]:
    """What only the live engine can tell (it is gone after fit)."""
    from lightning_zero.trainer.monitor import predicted_bytes

    engine = trainer.strategy.engine
    factor = 3 if engine.stage == 3 else 2
    # stage 3 keeps the head gathered from forward into backward from step 2 on ([Note: held into backward])
    held = engine.stage3.held_numel() * (max_steps - 1) / max_steps if engine.stage == 3 else 0.0
    ring = (engine.dp_size - 1) / engine.dp_size
    return {
        # the project's own prediction for what this engine manages (P/tp under TP, its dp)
        "predicted_state_bytes": predicted_bytes(engine, engine.optimizers[0].optimizer),
        "predicted_sent_bytes_per_step": ring * 4 * (factor * engine.num_params() - held),
        "engine_sent_bytes_per_step": engine.counter.total_bytes() / max_steps,
        # the agreements (used parameters, phase markers): not in the ZeRO formulas
        "engine_control_bytes_per_step": sum(engine.counter.control_bytes.values()) / max_steps,
        "engine_sent_calls_per_step": {k: v / max_steps for k, v in engine.counter.calls.items()},
        "padding_numel": engine.padding_numel(),
        "measured_bytes_after_fit": engine.measured_bytes(),
    }


def _ddp_at_end(trainer: Any, max_steps: int) -> dict[str, Any]:
    import _incumbents

    bucket_bytes = sum(_incumbents.ddp_bucket_bytes(trainer.model))
    dp = trainer.world_size
    return {
        # DDP's C++ reducer calls gloo directly, past the tap: every bucket is all-reduced once.
        "sent_bytes_per_step": {"all_reduce": 2 * (dp - 1) / dp * bucket_bytes},
        "sent_source": "DDP's bucket sizes x ring all-reduce factor 2(n-1)/n (not tapped)",
        "notes": f"grads include the DDP reducer's own bucket copy ({bucket_bytes / 2**20:,.1f} MiB;"
        " Lightning's default gradient_as_bucket_view=False)",
    }


def worker(args: argparse.Namespace) -> None:
    case = CASES[args.worker]
    if case.family == "zero":
        hooks: dict[str, Any] = dict(state_bytes=zero_state_bytes, extra_step=zero_step_extra, at_end=zero_at_end)
    else:
        import _incumbents

        state = {
            "ddp": _incumbents.ddp_state_bytes,
            "fsdp": _incumbents.fsdp_state_bytes,
            "fsdp2": _incumbents.fsdp2_state_bytes,
        }
        hooks = dict(state_bytes=state.get(case.family, _incumbents.deepspeed_state_bytes))
        hooks["extra_step"] = backward_tail_extra
        if case.family == "ddp":
            hooks["at_end"] = _ddp_at_end
    run_worker(
        args,
        label=case.label,
        stage=case.stage,
        make_strategy=lambda: case.make(args),
        make_module=with_backward_tail_timer(case.make_module),
        **hooks,
    )


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _goal(lines: list[str], by_case: dict, case: str, base: str, limit: float) -> None:
    """The goal's wall-time ratio (what it is judged by), then the same ratio of CPU seconds per
    step: on one core per rank, wall = CPU + idle, and CPU moves less with the host's load."""
    row, other = by_case.get(case), by_case.get(base)
    if not row or not other:
        return
    ratio = step_ratio(row, other)
    rounds = ", ".join(f"{r:.3f}" for r in round_ratios(row, other))
    cpu = round_ratios(row, other, "cpu_s_round_medians")
    cpu_text = f"; CPU s {statistics.median(cpu):.3f}x (rounds: {', '.join(f'{r:.3f}' for r in cpu)})" if cpu else ""
    lines.append(
        f"goal: {case} step time {ratio:.3f}x {base} (<= {limit:g}; rounds: {rounds}){cpu_text}:"
        f" {'met' if ratio <= limit else 'NOT met'}"
    )


def report(rows: list[dict]) -> list[str]:
    """Our comm table, the notes, exposed gradient-collective time per case, the goals (issue 13's,
    with issue 24's zero3 <= 0.85x FSDP2)."""
    lines = [comm_table(rows), ""]
    lines += [f"{row['case']}: {row['notes']}" for row in rows if row.get("notes")]
    lines.append("exposed gradient-collective time per step ([Note: exposed gradient-collective time]):")
    for row in rows:
        if "error" in row:
            continue
        tail = row.get("backward_tail_s_median")
        engine = row["extra"].get("exposed_wait_s_median") if row.get("engine_sent_bytes_per_step") else None
        lines.append(
            f"  {row['case']:<18} end of backward {'-' if tail is None else f'{tail * 1e3:8.1f} ms'}"
            + ("" if engine is None else f"   engine timeline exposed {engine * 1e3:8.1f} ms")
        )
    by_case = {row["case"]: row for row in rows if "error" not in row}
    _goal(lines, by_case, "zero2", "ddp", 1.00)
    _goal(lines, by_case, "zero1", "ddp", 0.97)
    _goal(lines, by_case, "zero2", "fsdp_grad_op", 1.00)
    _goal(lines, by_case, "zero3", "fsdp2", 0.85)
    for name in ("zero1", "zero2", "zero2_no_overlap"):
        row = by_case.get(name)
        if row:
            lines.append("goal: " + state_vs_formula(row))
    return lines


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_args(parser, default_cases=DEFAULT_CASES)
    extra_args(parser)
    return parser.parse_args(argv)


def _without_models(argv: list[str]) -> list[str]:
    """``argv`` without ``--models NAME ...`` (its values run up to the next option)."""
    out, skipping = [], False
    for item in argv:
        if item == "--models" or item.startswith("--models="):
            skipping = item == "--models"
            continue
        if skipping and not item.startswith("--"):
            continue
        skipping = False
        out.append(item)
    return out


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    """Each model in turn, every case side by side ([Note: benchmark shape]); one JSON for all."""
    script = str(Path(__file__).resolve())
    if args.knobs is None:  # an explicit --bucket-mb means: every strategy with that bucket size
        args.knobs = "fixed" if "--bucket-mb" in argv else "default"
        argv = [*argv, "--knobs", args.knobs]
    if any(flag in argv for flag in MODEL_FLAGS):  # a model given on the command line: that one alone
        argv = [a for a in argv if a != "--quick"] + (QUICK_RUN if args.quick else [])
        drive("zero12", script, _parse(argv), argv, known_cases=CASES, baseline="ddp", report=report)
        return
    presets = QUICK_MODELS if args.quick else MODELS
    runs: dict[str, Any] = {}
    for model in args.models:
        # Flags appended last win: the worker command line carries the concrete model and run.
        # the worker gets the concrete model, not --models (a --baseline-src checkout may not know its name)
        model_argv = _without_models([a for a in argv if a != "--quick"]) + presets[model]
        model_argv += QUICK_RUN if args.quick else []
        if "--out" in model_argv:
            index = model_argv.index("--out")
            del model_argv[index : index + 2]
        model_args = _parse(model_argv)
        print(f"\n=== model {model}{' (quick)' if args.quick else ''}, knobs {args.knobs} ===", flush=True)
        rows = drive(
            f"zero12_{model}", script, model_args, model_argv, known_cases=CASES, baseline="ddp", report=report
        )
        runs[model] = {"argv": model_argv, "rows": rows, "report": report(rows)}
    if args.out:
        payload = {"benchmark": "zero12", "knobs": args.knobs, "quick": args.quick, "machine": machine_note()}
        payload["models"] = runs
        payload["rows"] = [row for run in runs.values() for row in run["rows"]]  # first model's rows first
        Path(args.out).write_text(json.dumps(payload, indent=1, default=float))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], DEFAULT_CASES, worker, driver, extra_args=extra_args)
