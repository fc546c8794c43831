"""Measure this machine and write a ``conf/hardware`` YAML the step-time model can use.

``lightning-zero plan calibrate [--out PATH] [--quick] [model options]`` (or
``python benchmarks/calibrate.py``) runs, on this machine:

- **collectives**: 2 processes over gloo (each pinned to its own core with one torch thread,
  as the CPU benchmarks run), timing ``all_reduce``, ``reduce_scatter`` and ``all_gather`` at
  several sizes. Each kind is fitted to ``time = steps * latency + logical_bytes / bandwidth``
  (ring steps: ``n - 1``, twice that for all-reduce; logical bytes as ``CommCounter`` counts
  them); the latency is the larger of the all-reduce fit's and that of a tiny all-reduce issued
  right after a burst of compute (as in training, where the peer must be scheduled again; on a
  loaded machine this is what a collective really costs); the bandwidth the planner uses is the
  all-reduce's, and every other kind gets a
  ``collective_time_factor`` (its measured time over what that bandwidth predicts), so a backend
  that runs a reduce-scatter as a full all-reduce (gloo does) is planned as it really runs;
- **overlap**: a matmul loop alone, a bucket-sized reduce-scatter alone, and the reduce-scatter
  launched asynchronously while the matmul loop runs (what backward does);
  ``overlap_efficiency = (alone_sum - together) / min(matmul, reduce_scatter)``: 1 when
  communication runs beside compute for free (a GPU with its copy engines), about 0 when both
  share one core;
- **compute**, on both processes at once (so they share memory bandwidth as a benchmark's ranks
  do): fp32 (and bf16) matmul FLOP/s on one thread, the fastest timing (``peak_*_tflops``), and
  ``mfu`` (the slower rank's): the model FLOPs of a forward + backward of a Llama of the
  given shape (no communication) over its time at that peak;
- **memory bandwidth**: the engine's gradient staging (``zero_`` + ``copy_`` of a bucket, 12 bytes
  per fp32 element: ``memory_gb_per_s``) and an AdamW step over ``numel`` fp32 parameters, at the
  planner's count of 28 bytes per parameter (``optimizer_gb_per_s``).

- **per-step overhead**: one process, the benchmark's Lightning ``Trainer`` flags, ``LlamaLM`` of the
  given shape; each step's Lightning time (``on_train_batch_start`` to ``on_train_batch_end``, the
  benchmark harness's window) minus the same forward + backward + AdamW step without Lightning,
  timed right after it: ``step_overhead_ms``, added once per optimizer step by the step-time model.

The timing itself is ``measure.py``; this module fits it and writes the YAML.

Everything runs on the local machine (one node), so the intra- and inter-node links get the
same numbers. The YAML is a plain hardware config: ``lightning-zero plan hardware=NAME`` after
copying it into ``conf/hardware/``, or ``planner.load_hardware(path)``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_zero.comm.ring import ring_sent, ring_steps
from lightning_zero.planner.bench_model import (
    BENCH_MODEL,
)
from lightning_zero.planner.measure import DEFAULT_SIZES_MB, measure_collectives, measure_step_overhead

QUICK_SIZES_MB = (0.0625, 1.0)


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def fit_latency_bandwidth(points: Sequence[tuple[float, float]], steps: int) -> tuple[float, float]:
    """Least squares of ``seconds = steps * latency + bytes / bandwidth`` over ``(bytes, seconds)``.

    Returns ``(latency_s, bytes_per_s)``; latency is clipped at 0 and bandwidth kept positive.
    """
    if len(points) < 2:
        raise ValueError("fit_latency_bandwidth: need at least two (bytes, seconds) points")
    xs = [float(b) for b, _ in points]
    ys = [float(s) for _, s in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    if slope <= 0:  # noise swamped the size dependence: all of it is bandwidth through the origin
        slope = sum(ys) / sum(xs)
        intercept = 0.0
    return max(0.0, intercept) / max(1, steps), 1.0 / slope


def summarize_collectives(measured: dict[str, Any]) -> dict[str, Any]:
    """Latency, bandwidth and per-kind time factors from :func:`measure_collectives` output."""
    world = int(measured["world"])
    fits = {}
    for kind, rows in measured["collectives"].items():
        points = [(ring_sent(kind, row["payload_bytes"], world), row["seconds"]) for row in rows]
        fits[kind] = fit_latency_bandwidth(points, ring_steps(kind, world))
    latency, bandwidth = fits["all_reduce"]
    # A tiny all-reduce after compute is two ring steps of pure latency: keep the larger estimate.
    latency = max(latency, measured.get("interleaved_latency_s", 0.0) / ring_steps("all_reduce", world))
    factors = {}
    for kind, rows in measured["collectives"].items():
        ratios = []
        for row in rows:
            sent = ring_sent(kind, row["payload_bytes"], world)
            model = ring_steps(kind, world) * latency + sent / bandwidth
            ratios.append(row["seconds"] / model)
        factors[kind] = max(ratios[-1], 0.05)  # the largest size: where bandwidth decides
    overlap = measured["overlap"]
    hideable = min(overlap["compute_s"], overlap["comm_s"])
    efficiency = (overlap["compute_s"] + overlap["comm_s"] - overlap["together_s"]) / hideable if hideable else 0.0
    return {
        "latency_s": latency,
        "bytes_per_s": bandwidth,
        "fits": {kind: {"latency_s": lat, "bytes_per_s": bw} for kind, (lat, bw) in fits.items()},
        "collective_time_factor": factors,
        "overlap_efficiency": min(1.0, max(0.0, efficiency)),
    }


# --------------------------------------------------------------------------------------------
# The YAML
# --------------------------------------------------------------------------------------------


def calibrate(
    *,
    name: str = "cpu_calibrated",
    sizes_mb: Sequence[float] = DEFAULT_SIZES_MB,
    repeats: int = 7,
    model: Optional[dict[str, int]] = None,
    micro_batch: int = 2,
    seq_len: int = 128,
    adamw_numel: int = 4_000_000,
    overlap_mb: float = 25.0,
    overhead_steps: int = 8,
) -> dict[str, Any]:
    """Measure everything (see module docstring); return ``{"hardware": {...}, "measured": {...}}``."""
    import psutil

    model = dict(model or BENCH_MODEL)
    collectives = measure_collectives(
        sizes_mb,
        repeats=repeats,
        overlap_mb=overlap_mb,
        compute=dict(model=model, micro_batch=micro_batch, seq_len=seq_len, adamw_numel=adamw_numel),
    )
    links = summarize_collectives(collectives)
    overhead = (
        measure_step_overhead(model, micro_batch=micro_batch, seq_len=seq_len, steps=overhead_steps)
        if overhead_steps > 0
        else {"step_overhead_s": 0.0, "steps": 0}
    )
    rates = collectives["compute"]
    fp32, bf16, memory_bps = rates["matmul_fp32_flops"], rates["matmul_bf16_flops"], rates["adamw_bytes_per_s"]
    compute = rates["model"]
    gb = links["bytes_per_s"] / 1e9
    latency_us = links["latency_s"] * 1e6
    hardware = {
        "name": name,
        "memory_bytes": int(psutil.virtual_memory().total // collectives["world"]),
        "intra_node_gb_per_s": gb,
        "inter_node_gb_per_s": gb,
        "intra_node_latency_us": latency_us,
        "inter_node_latency_us": latency_us,
        "peak_bf16_tflops": bf16 / 1e12,
        "peak_fp32_tflops": fp32 / 1e12,
        "memory_gb_per_s": rates["copy_bytes_per_s"] / 1e9,
        "optimizer_gb_per_s": memory_bps / 1e9,
        "overlap_efficiency": links["overlap_efficiency"],
        "collective_time_factor": links["collective_time_factor"],
        "mfu": compute["mfu"],
        "devices_per_node": collectives["world"],
        "step_overhead_ms": overhead["step_overhead_s"] * 1e3,
    }
    return {
        "hardware": hardware,
        "measured": {
            "collectives": collectives,
            "links": links,
            "compute": compute,
            "model": model,
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "step_overhead": overhead,
        },
    }


def hardware_yaml(hardware: dict[str, Any], measured: dict[str, Any]) -> str:
    """The hardware config as YAML, with a header saying where each number came from."""
    from omegaconf import OmegaConf

    compute = measured["compute"]
    header = [
        f"# Calibrated on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by",
        "# `lightning-zero plan calibrate` (lightning_zero/planner/calibrate.py): 2 gloo processes, each",
        "# pinned to one core with one torch thread. Links: all-reduce fit of latency + bytes/bandwidth",
        "# (one machine: intra = inter); collective_time_factor: each kind's measured time over that model;",
        "# overlap_efficiency: how much of a collective hides behind matmuls running at the same time;",
        f"# mfu: forward + backward of a Llama {measured['model']} at micro_batch={measured['micro_batch']},",
        f"# seq_len={measured['seq_len']}: {compute['flops'] / 1e9:.2f} GFLOP in {compute['seconds']:.3f} s;",
        "# memory_gb_per_s: zero_ + copy_ of a bucket (12 B/element); optimizer_gb_per_s: AdamW at 28 B/parameter.",
        "# step_overhead_ms: median Lightning step (1 process, the benchmark's Trainer flags) minus the median",
        "# forward + backward + AdamW of the same model without Lightning, timed step by step side by side.",
    ]
    return "\n".join(header) + "\n" + OmegaConf.to_yaml(OmegaConf.create(hardware))


def main(argv: Optional[Sequence[str]] = None) -> Path:
    """``lightning-zero plan calibrate``: measure, write the YAML, print where it went."""
    parser = argparse.ArgumentParser(prog="lightning-zero plan calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="cpu_calibrated.yaml", help="hardware YAML to write")
    parser.add_argument("--name", default=None, help="hardware name inside the YAML (default: the file stem)")
    parser.add_argument("--quick", action="store_true", help="small sizes and a tiny model (seconds, for tests)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write every raw measurement to this JSON file")
    for key, value in BENCH_MODEL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    model = {key: getattr(args, key) for key in BENCH_MODEL}
    if args.quick:
        model = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32)
        result = calibrate(
            name=args.name or out.stem,
            sizes_mb=QUICK_SIZES_MB,
            repeats=2,
            model=model,
            micro_batch=1,
            seq_len=32,
            adamw_numel=200_000,
            overlap_mb=0.5,
            overhead_steps=3,
        )
    else:
        result = calibrate(
            name=args.name or out.stem,
            repeats=args.repeats,
            model=model,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(hardware_yaml(result["hardware"], result["measured"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    hw = result["hardware"]
    print(
        f"lightning-zero: wrote {out}: link {hw['intra_node_gb_per_s']:.2f} GB/s, "
        f"{hw['intra_node_latency_us']:.0f} us latency, overlap {hw['overlap_efficiency']:.2f}, "
        f"fp32 {hw['peak_fp32_tflops'] * 1e3:.1f} GFLOP/s (mfu {hw['mfu']:.2f}), "
        f"memory {hw['memory_gb_per_s']:.1f} GB/s, step overhead {hw['step_overhead_ms']:.1f} ms"
    )
    return out


if __name__ == "__main__":
    main()
