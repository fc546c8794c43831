"""One prepared GPU check: zero1/2/3 against Lightning's single-device run, in one process, one JSON.

Usage::

    python benchmarks/gpu_check.py --out gpu_check.json            # one CUDA GPU, < 8 minutes
    python benchmarks/gpu_check.py --smoke --out smoke.json        # CPU, tiny model, 3 steps (gloo)

What it runs, one after the other in this process, on the same seed, weights and token batches:
Lightning's own single-device strategy (``SingleDeviceStrategy``, ``devices=1``) and
``ZeroStrategy(stage=1|2|3)`` with ``devices=1``, all ``precision="bf16-mixed"``, ``STEPS`` optimizer
steps of a ~100M-parameter Llama (12 blocks, dim 768, GQA with 4 KV heads, vocab 32000, 1024
tokens per sequence). For each run it records, into one JSON:

- the per-step losses, and for each zero stage the largest absolute and relative difference to
  the single-device losses (bf16-mixed: Lightning keeps fp32 weights under autocast, the engine
  bf16 parameters with fp32 masters, so they agree to bf16 rounding, not bit for bit; the first
  step, from identical weights, agrees most closely);
- the median step time (CUDA-synchronized at each step end, first ``WARMUP`` steps dropped) and
  its ratio to the single-device run;
- ``torch.cuda.max_memory_allocated`` beside the planner's prediction (``plan_run(...).memory``
  for the same model, stage, dp=1, micro batch and sequence length on ``h200_141gb``), and their
  ratio;
- tokens/s and MFU (model FLOPs from ``planner.timing.training_flops``, recompute not counted,
  against the hardware config's bf16 peak; [Note: throughput] in ``lightning_zero/runtime/throughput.py``).

Why world size 1: this check is written for the one GPU a session may be lent. Several ranks on
one GPU are not possible with NCCL (it refuses two ranks on the same device: "Duplicate GPU
detected"), so every zero run is dp=1 over an NCCL group of one rank. dp=1 exercises the engine's
whole code path (flat buffers, buckets, fp32 masters, the stage-3 gather/free of units, the
overlapped parameter gather) but no real communication: collective timing and overlap need
two or more GPUs. ``--smoke`` runs the same code on CPU with gloo so a test can run it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import lightning as L  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers zero1/zero2/zero3)
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models import LlamaConfig, LlamaLM  # noqa: E402
from lightning_zero.planner import plan_run  # noqa: E402
from lightning_zero.planner.bench_model import STEPS_ONLY  # noqa: E402
from lightning_zero.runtime.throughput import peak_flops_for, training_flops_of  # noqa: E402

GPU = {
    "model": dict(
        name="gpu_check_100m",
        vocab_size=32000,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=2048,
        max_seq_len=1024,
    ),  # fmt: skip
    "micro_batch": 8,
    "seq_len": 1024,
    "steps": 50,
    "warmup": 5,
    "hardware": "h200_141gb",
}
SMOKE = {
    "model": dict(name="smoke", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32),
    "micro_batch": 2,
    "seq_len": 16,
    "steps": 3,
    "warmup": 1,
    "hardware": "h200_141gb",
}
RUNS = ("single", "zero1", "zero2", "zero3")


class SingleDevice(SingleDeviceStrategy):
    """Lightning's single-device strategy, re-seeded where DDP-derived strategies (ZeroStrategy)
    re-seed (``reset_seed()`` in ``setup_environment``), so every run starts from the same weights."""

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()


class StepProbe(L.Callback):
    """Per-step loss and wall time (the device synchronized at each step end)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self._last: Optional[float] = None

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = self._sync()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self._sync()
        self.step_s.append(now - self._last)
        self._last = now
        self.losses.append(float(outputs["loss"]))


def token_batches(settings: dict[str, Any]) -> list[torch.Tensor]:
    """The same token rows for every run: ``steps x micro_batch`` rows of ``seq_len + 1`` ids."""
    generator = torch.Generator().manual_seed(1234)
    rows = settings["steps"] * settings["micro_batch"]
    vocab = settings["model"]["vocab_size"]
    return list(torch.randint(0, vocab, (rows, settings["seq_len"] + 1), generator=generator))


def run_one(kind: str, settings: dict[str, Any], accelerator: str, device: torch.device) -> dict[str, Any]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    L.seed_everything(0, verbose=False)
    model = LlamaLM(settings["model"], lr=3e-4, warmup_steps=min(5, settings["steps"]), max_steps=settings["steps"])
    strategy: Any = SingleDevice(device) if kind == "single" else ZeroStrategy(stage=int(kind[-1]), monitor=False)
    probe = StepProbe(device)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=settings["steps"],
        **STEPS_ONLY,
        use_distributed_sampler=False,  # dp=1: the same rows in the same order as the single run
        callbacks=[probe],
    )
    loader = DataLoader(token_batches(settings), batch_size=settings["micro_batch"], shuffle=False)
    started = time.perf_counter()
    trainer.fit(model, loader)
    wall_s = time.perf_counter() - started
    steady = probe.step_s[settings["warmup"] :] or probe.step_s
    step_s = statistics.median(steady)
    tokens = settings["micro_batch"] * settings["seq_len"]
    config = LlamaConfig.from_name("tiny", **{k: v for k, v in settings["model"].items() if k != "name"})
    flops = training_flops_of(config, 0, settings["micro_batch"], settings["seq_len"])
    peak = peak_flops_for(settings["hardware"], torch.bfloat16)
    result: dict[str, Any] = {
        "losses": probe.losses,
        "step_s_median": step_s,
        "step_s": probe.step_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / peak if peak else None,
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        result["max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
    plan = plan_run(
        config,
        stage=0 if kind == "single" else int(kind[-1]),
        world_size=1,
        devices_per_node=1,
        precision="bf16-mixed",
        micro_batch=settings["micro_batch"],
        seq_len=settings["seq_len"],
        hardware=settings["hardware"],
        suggest=False,
    )
    result["predicted_memory"] = {key: float(value) for key, value in plan.memory.as_dict().items()}
    if "max_memory_allocated" in result:
        result["measured_over_predicted"] = result["max_memory_allocated"] / plan.memory.total
    del trainer, model
    return result


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    single = results["single"]
    out: dict[str, Any] = {}
    for kind in RUNS[1:]:
        got = results[kind]
        pairs = list(zip(got["losses"], single["losses"]))
        diffs = [abs(a - b) for a, b in pairs]
        out[kind] = {
            "loss_max_abs_diff": max(diffs) if diffs else math.nan,
            "loss_max_rel_diff": max(d / abs(b) for d, (_, b) in zip(diffs, pairs)) if diffs else math.nan,
            "first_loss_abs_diff": diffs[0] if diffs else math.nan,
            "step_time_vs_single": got["step_s_median"] / single["step_s_median"],
            "tokens_per_s_vs_single": got["tokens_per_s"] / single["tokens_per_s"],
        }
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 steps, gloo")
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS, help="subset (single is always run)")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else GPU
    if args.smoke:
        accelerator, device = "cpu", torch.device("cpu")
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --smoke for the CPU plumbing check", file=sys.stderr)
            return 2
        accelerator, device = "gpu", torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    runs = ["single", *[run for run in args.runs if run != "single"]]
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for kind in runs:
        results[kind] = run_one(kind, settings, accelerator, device)
        print(
            f"gpu_check: {kind:<6} step {results[kind]['step_s_median'] * 1e3:8.1f} ms"
            f"  {results[kind]['tokens_per_s']:10,.0f} tokens/s  last loss {results[kind]['losses'][-1]:.4f}",
            flush=True,
        )
    report = {
        "settings": {**settings, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "runs": results,
        "vs_single": compare(results) if len(results) > 1 else {},
        "total_s": time.perf_counter() - started,
        "world_size": 1,
        "note": "dp=1 per run: NCCL refuses several ranks on one GPU (see the module docstring)",
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"gpu_check: wrote {args.out} in {report['total_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
