"""ZeRO-3 side by side with FSDP2 (ModelParallelStrategy), FSDP FULL_SHARD and DeepSpeed ZeRO-3 (issue 4).

2 CPU ranks (gloo), a tiny Llama of ~34M parameters in fp32, every case in one run:

    python benchmarks/bench_zero3.py --out results_zero3.json

Cases: ``ZeroStrategy(stage=3, prefetch_blocks=0|1|2)``, Lightning's ``ModelParallelStrategy``
with FSDP2 ``fully_shard`` per block, ``FSDPStrategy("FULL_SHARD")`` per block and DeepSpeed
stage 3 where it runs. Same columns as ``bench_zero12.py`` (docs/benchmarks.md); the ratio column
is against FSDP2. Goal (issue 4): zero3 at or below FSDP2's step time and peak memory.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import bench_main, drive, run_worker  # noqa: E402
from _stats import comm_table, state_vs_formula, step_ratio  # noqa: E402
from bench_zero12 import _deepspeed, zero_at_end, zero_state_bytes, zero_step_extra  # noqa: E402


@dataclass(frozen=True)
class Case:
    label: str
    make: Callable[[argparse.Namespace], Any]
    family: str  # "zero", "fsdp2", "fsdp", "deepspeed"
    make_module: Optional[Callable[[Any], Any]] = None


def _zero3(prefetch: int) -> Callable[[argparse.Namespace], Any]:
    def make(args: argparse.Namespace) -> Any:
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(  # collective_timeout=None: the path GPUs run (see bench_zero12.py)
            stage=3, bucket_mb=args.bucket_mb, prefetch_blocks=prefetch, monitor=False, collective_timeout=None
        )

    return make


def _fsdp2(args: argparse.Namespace) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _fsdp2_module(config: Any) -> Any:
    from _incumbents import fully_sharded_llama_lm

    return fully_sharded_llama_lm(config, lr=3e-4, warmup_steps=1)


def _constant_lr_module(config: Any) -> Any:
    from _incumbents import llama_lm_without_scheduler

    return llama_lm_without_scheduler(config, lr=3e-4, warmup_steps=1)


def _fsdp_full(args: argparse.Namespace) -> Any:
    from _incumbents import CPUFSDPStrategy

    from lightning_zero.models.llama import TransformerBlock

    return CPUFSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={TransformerBlock})


CASES: dict[str, Case] = {
    "zero3_prefetch0": Case("ZeroStrategy(stage=3, prefetch_blocks=0)", _zero3(0), "zero"),
    "zero3_prefetch1": Case("ZeroStrategy(stage=3, prefetch_blocks=1)", _zero3(1), "zero"),
    "zero3_prefetch2": Case("ZeroStrategy(stage=3, prefetch_blocks=2)", _zero3(2), "zero"),
    "fsdp2": Case("ModelParallelStrategy(dp=2, tp=1), fully_shard per block", _fsdp2, "fsdp2", _fsdp2_module),
    "fsdp_full_shard": Case('FSDPStrategy("FULL_SHARD"), per block', _fsdp_full, "fsdp"),
    "deepspeed3": Case("DeepSpeedStrategy(stage=3), constant LR", _deepspeed(3), "deepspeed", _constant_lr_module),
}


def worker(args: argparse.Namespace) -> None:
    case = CASES[args.worker]
    if case.family == "zero":
        hooks: dict[str, Any] = dict(state_bytes=zero_state_bytes, extra_step=zero_step_extra, at_end=zero_at_end)
    else:
        import _incumbents

        state = {
            "fsdp2": _incumbents.fsdp2_state_bytes,
            "fsdp": _incumbents.fsdp_state_bytes,
            "deepspeed": _incumbents.deepspeed3_state_bytes,
        }
        hooks = dict(state_bytes=state[case.family])
    run_worker(
        args, label=case.label, stage=3, make_strategy=lambda: case.make(args), make_module=case.make_module, **hooks
    )


def report(rows: list[dict]) -> list[str]:
    """Our comm table and issue 4's goal: zero3 at or below FSDP2 in step time and peak RSS."""
    lines = [comm_table(rows), ""]
    by_case = {row["case"]: row for row in rows if "error" not in row}
    fsdp2 = by_case.get("fsdp2")
    for name in ("zero3_prefetch0", "zero3_prefetch1", "zero3_prefetch2"):
        row = by_case.get(name)
        if not row:
            continue
        lines.append(state_vs_formula(row))
        if fsdp2:
            time_ratio = step_ratio(row, fsdp2)
            rss_ratio = max(row["peak_rss_bytes"]) / max(fsdp2["peak_rss_bytes"])
            met = time_ratio <= 1 and rss_ratio <= 1
            lines.append(
                f"goal: {name} step time {time_ratio:.3f}x FSDP2, peak RSS {rss_ratio:.3f}x FSDP2 (both <= 1):"
                f" {'met' if met else 'NOT met'}"
            )
    return lines


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    drive("zero3", str(Path(__file__).resolve()), args, argv, known_cases=CASES, baseline="fsdp2", report=report)


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], CASES, worker, driver)
