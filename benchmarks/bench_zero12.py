"""ZeRO-1/2 side by side with Lightning's ddp, FSDP (SHARD_GRAD_OP) and DeepSpeed ZeRO-1/2 (issue 3).

2 CPU ranks (gloo), a tiny Llama of ~34M parameters in fp32, every case in one run:

    python benchmarks/bench_zero12.py --out results_zero12.json
    python benchmarks/bench_zero12.py --cases zero2 ddp --steps 2 --warmup 1 --rounds 1   # quick

Per case: median step time (and its ratio to ddp, measured in the same run), peak RSS per rank,
model-state bytes per rank (measured, next to the ZeRO formula for what the strategy shards), and
logical bytes sent per step. See [Note: benchmark shape] in ``_harness.py`` for how it runs and
docs/benchmarks.md for what each column means.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import bench_main, comm_table, drive, run_worker, state_vs_formula, step_ratio  # noqa: E402


@dataclass(frozen=True)
class Case:
    """How to build one strategy, which ZeRO stage its memory should match, how to count it."""

    label: str
    stage: int  # the ZeRO stage whose formula the strategy's model states should follow
    make: Callable[[argparse.Namespace], Any]
    family: str  # "zero", "ddp", "fsdp", "deepspeed"


def _zero(stage: int, overlap: bool = True, **kwargs: Any) -> Callable[[argparse.Namespace], Any]:
    def make(args: argparse.Namespace) -> Any:
        from lightning_zero import ZeroStrategy

        # collective_timeout=None: the reduce-scatter path GPUs run (on gloo a finite timeout polls
        # an all-reduce instead; see [Note: collective timeout] in zero/reducer.py)
        return ZeroStrategy(
            stage=stage,
            bucket_mb=args.bucket_mb,
            overlap_comm=overlap,
            monitor=False,
            collective_timeout=None,
            **kwargs,
        )

    return make


def _ddp(args: argparse.Namespace) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(bucket_cap_mb=args.bucket_mb)


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
    "zero2_no_overlap": Case("ZeroStrategy(stage=2, overlap_comm=False)", 2, _zero(2, overlap=False), "zero"),
    # stage 2 blocks in backward when max_buckets_in_flight buffers are out; 4 of ~6 buckets
    "zero2_inflight4": Case(
        "ZeroStrategy(stage=2, max_buckets_in_flight=4)", 2, _zero(2, max_buckets_in_flight=4), "zero"
    ),
    "ddp": Case("DDPStrategy", 0, _ddp, "ddp"),
    "fsdp_grad_op": Case('FSDPStrategy("SHARD_GRAD_OP"), per block', 2, _fsdp, "fsdp"),
    "deepspeed1": Case("DeepSpeedStrategy(stage=1)", 1, _deepspeed(1), "deepspeed"),
    "deepspeed2": Case("DeepSpeedStrategy(stage=2)", 2, _deepspeed(2), "deepspeed"),
}


# --------------------------------------------------------------------------------------------
# Worker: what each family holds and sends
# --------------------------------------------------------------------------------------------


def zero_state_bytes(trainer: Any) -> dict[str, int]:
    measured = trainer.strategy.engine.measured_bytes()
    return {key: int(measured[key]) for key in ("params", "grads", "optimizer")}


def zero_step_extra(trainer: Any) -> dict[str, float]:
    timeline = trainer.strategy.engine.reducer.timeline
    # exposed_s: collective time left after backward ended (older engines: exposed_wait_s)
    exposed = getattr(timeline, "exposed_s", None)
    exposed = getattr(timeline, "exposed_wait_s", 0.0) if exposed is None else exposed
    return {"comm_s": timeline.comm_s, "exposed_wait_s": exposed}


def zero_at_end(trainer: Any, max_steps: int) -> dict[str, Any]:
    """What only the live engine can tell (it is gone after fit)."""
    from lightning_zero.monitor import predicted_bytes

    engine = trainer.strategy.engine
    factor = 3 if engine.stage == 3 else 2
    return {
        # the project's own prediction for what this engine manages (P/tp under TP, its dp)
        "predicted_state_bytes": predicted_bytes(engine, engine.optimizers[0].optimizer),
        "predicted_sent_bytes_per_step": factor * (engine.dp_size - 1) / engine.dp_size * 4 * engine.num_params(),
        "engine_sent_bytes_per_step": engine.counter.total_bytes() / max_steps,
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

        state = {"ddp": _incumbents.ddp_state_bytes, "fsdp": _incumbents.fsdp_state_bytes}
        hooks = dict(state_bytes=state.get(case.family, _incumbents.deepspeed_state_bytes))
        if case.family == "ddp":
            hooks["at_end"] = _ddp_at_end
    run_worker(args, label=case.label, stage=case.stage, make_strategy=lambda: case.make(args), **hooks)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def report(rows: list[dict]) -> list[str]:
    """Our comm table, the notes, and issue 3's goals, each with the numbers that decide it."""
    lines = [comm_table(rows), ""]
    lines += [f"{row['case']}: {row['notes']}" for row in rows if row.get("notes")]
    by_case = {row["case"]: row for row in rows if "error" not in row}
    zero2, ddp, fsdp = by_case.get("zero2"), by_case.get("ddp"), by_case.get("fsdp_grad_op")
    if zero2 and ddp:
        ratio = step_ratio(zero2, ddp)
        lines.append(f"goal: zero2 step time {ratio:.3f}x ddp (<= 1.05): {'met' if ratio <= 1.05 else 'NOT met'}")
    if zero2 and fsdp:
        ratio = step_ratio(zero2, fsdp)
        lines.append(
            f"goal: zero2 step time {ratio:.3f}x FSDP SHARD_GRAD_OP (< 1): {'met' if ratio < 1 else 'NOT met'}"
        )
    for name in ("zero1", "zero2", "zero2_no_overlap"):
        row = by_case.get(name)
        if row:
            lines.append("goal: " + state_vs_formula(row))
    return lines


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    drive("zero12", str(Path(__file__).resolve()), args, argv, known_cases=CASES, baseline="ddp", report=report)


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], CASES, worker, driver)
