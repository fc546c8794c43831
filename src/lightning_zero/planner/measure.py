"""The measurements behind ``lightning-zero plan calibrate`` (``calibrate.py`` fits them and
writes the YAML): collectives, overlap and compute on 2 pinned gloo processes, memory bandwidth,
and a Lightning step's overhead in a fresh process. What each one times is in ``calibrate.py``'s
module docstring.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_zero.planner.bench_model import (
    bench_config,
    bench_datamodule,
    bench_module,
    bench_trainer,
    pin_to_core,
    seed_bench,
)
from lightning_zero.ports import free_port

OPTIMIZER_BYTES_PER_PARAM_FP32 = 28  # AdamW, fp32: param r/w, grad r, exp_avg r/w, exp_avg_sq r/w
DEFAULT_SIZES_MB = (0.0625, 1.0, 8.0, 25.0)  # 25 MiB: the default bucket

# --------------------------------------------------------------------------------------------
# The distributed part: 2 gloo processes
# --------------------------------------------------------------------------------------------


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_loop(size: int, iterations: int):
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def run() -> None:
        for _ in range(iterations):
            torch.mm(a, b)

    return run


def _collective_worker(
    rank: int,
    world: int,
    port: int,
    sizes_mb: Sequence[float],
    repeats: int,
    overlap_mb: float,
    out_dir: str,
    compute: dict[str, Any],
) -> None:
    import torch
    import torch.distributed as dist

    from lightning_zero.comm.collectives import all_gather, all_reduce, reduce_scatter

    pin_to_core(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {"collectives": {}}
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            rows = []
            for size_mb in sizes_mb:
                numel = max(world, int(size_mb * 2**20) // 4 // world * world)
                full = torch.ones(numel)
                shard = torch.ones(numel // world)

                def once(kind: str = kind, full: torch.Tensor = full, shard: torch.Tensor = shard) -> None:
                    if kind == "all_reduce":
                        all_reduce(full, None)
                    elif kind == "reduce_scatter":
                        reduce_scatter(shard, full, None)
                    else:
                        all_gather(full, shard, None)

                once()  # warm the connection and buffers
                dist.barrier()
                seconds = _timed(once, repeats)
                rows.append({"payload_bytes": numel * 4, "seconds": seconds})
            result["collectives"][kind] = rows

        # Latency as training sees it: a tiny all-reduce issued right after a burst of compute (the
        # peer must be scheduled again), not back to back with the previous collective.
        tiny = torch.ones(world)
        burst = _matmul_loop(128, 8)
        waits = []
        for _ in range(max(5, 3 * repeats)):
            dist.barrier()
            burst()
            start = time.perf_counter()
            all_reduce(tiny, None)
            waits.append(time.perf_counter() - start)
        result["interleaved_latency_s"] = statistics.median(waits)

        # Overlap: matmuls alone, a reduce-scatter alone (what backward overlaps), both at once.
        numel = max(world, int(overlap_mb * 2**20) // 4 // world * world)
        full, shard = torch.ones(numel), torch.ones(numel // world)
        dist.barrier()
        comm_s = _timed(lambda: reduce_scatter(shard, full, None), repeats)
        size = 256
        probe = _timed(_matmul_loop(size, 4), 3) / 4
        iterations = max(1, int(comm_s / max(probe, 1e-6)))
        matmuls = _matmul_loop(size, iterations)
        dist.barrier()
        compute_s = _timed(matmuls, repeats)

        def both() -> None:
            work = reduce_scatter(shard, full, None, async_op=True)
            matmuls()
            work.wait()

        dist.barrier()
        both_s = _timed(both, repeats)
        result["overlap"] = {"compute_s": compute_s, "comm_s": comm_s, "together_s": both_s}

        # Compute and memory, on every rank at once (as a benchmark's ranks run: they share memory bandwidth).
        dist.barrier()
        result["matmul_fp32_flops"] = measure_matmul_flops("float32", repeats=repeats)
        result["matmul_bf16_flops"] = measure_matmul_flops("bfloat16", repeats=repeats)
        dist.barrier()
        result["adamw_bytes_per_s"] = measure_adamw_bytes_per_s(compute["adamw_numel"], repeats=repeats)
        result["copy_bytes_per_s"] = measure_copy_bytes_per_s(compute["adamw_numel"], repeats=repeats)
        dist.barrier()
        result["model"] = measure_model_mfu(
            compute["model"],
            micro_batch=compute["micro_batch"],
            seq_len=compute["seq_len"],
            peak_flops=result["matmul_fp32_flops"],
            repeats=max(2, repeats // 2),
        )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    sizes_mb: Sequence[float] = DEFAULT_SIZES_MB,
    repeats: int = 7,
    overlap_mb: float = 25.0,
    world: int = 2,
    timeout_s: float = 600.0,
    compute: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Time the collectives, the overlap probe and (``compute``: model, micro_batch, seq_len,
    adamw_numel) the compute rates on ``world`` local gloo processes; per number, the slower rank's."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lz_calibrate_") as out_dir:
        port = free_port()
        processes = [
            context.Process(
                target=_collective_worker,
                args=(rank, world, port, list(sizes_mb), repeats, overlap_mb, out_dir, compute),
            )
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
        alive = [p for p in processes if p.is_alive()]
        for process in alive:
            process.kill()
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if alive or failed:
            raise RuntimeError(
                f"calibrate: collective processes failed (exit codes {failed}, "
                f"{len(alive)} killed after {timeout_s:.0f} s)"
            )
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    # the slower rank is what a collective costs
    merged: dict[str, Any] = {"collectives": {}, "world": world}
    for kind, rows in ranks[0]["collectives"].items():
        merged["collectives"][kind] = [
            {"payload_bytes": row["payload_bytes"], "seconds": max(r["collectives"][kind][i]["seconds"] for r in ranks)}
            for i, row in enumerate(rows)
        ]
    merged["overlap"] = {key: max(r["overlap"][key] for r in ranks) for key in ranks[0]["overlap"]}
    merged["interleaved_latency_s"] = max(r["interleaved_latency_s"] for r in ranks)
    slowest_model = max((r["model"] for r in ranks), key=lambda m: m["seconds"])
    model_rate = slowest_model["flops"] / slowest_model["seconds"]
    # The peak is the best matmul rate seen; the model's forward + backward cannot beat it (if a
    # noisy matmul timing says otherwise, the model's rate is the peak and mfu is 1).
    fp32_peak = max(max(r["matmul_fp32_flops"] for r in ranks), model_rate)
    merged["compute"] = {
        "matmul_fp32_flops": fp32_peak,
        "matmul_bf16_flops": max(r["matmul_bf16_flops"] for r in ranks),
        "adamw_bytes_per_s": min(r["adamw_bytes_per_s"] for r in ranks),
        "copy_bytes_per_s": min(r["copy_bytes_per_s"] for r in ranks),
        "model": {**slowest_model, "mfu": model_rate / fp32_peak},
    }
    return merged


# --------------------------------------------------------------------------------------------
# Compute and memory (this process, one thread, pinned like a benchmark rank)
# --------------------------------------------------------------------------------------------


def measure_matmul_flops(dtype_name: str = "float32", size: int = 512, repeats: int = 5) -> float:
    """Peak FLOP/s of ``size x size`` matmuls in ``dtype_name`` on this process's threads: the
    fastest of ``repeats`` timings (a peak; on a shared machine the median would measure the load)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    iterations = 4
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 * iterations / fastest


def measure_adamw_bytes_per_s(numel: int = 4_000_000, tensors: int = 8, repeats: int = 5) -> float:
    """Bytes/s an AdamW step moves, at ``OPTIMIZER_BYTES_PER_PARAM_FP32`` bytes per parameter."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()
    seconds = _timed(optimizer.step, repeats)
    return OPTIMIZER_BYTES_PER_PARAM_FP32 * sum(p.numel() for p in params) / seconds


def measure_copy_bytes_per_s(numel: int = 4_000_000, repeats: int = 5) -> float:
    """Bytes/s of the engine's gradient staging: ``bucket.zero_(); bucket.copy_(grad)`` (12 bytes per fp32 element)."""
    import torch

    grad = torch.randn(numel)
    bucket = torch.empty(numel)

    def stage() -> None:
        bucket.zero_()
        bucket.copy_(grad)

    stage()
    return 12 * numel / _timed(stage, repeats)


def measure_model_mfu(
    model: dict[str, int], *, micro_batch: int, seq_len: int, peak_flops: float, repeats: int = 3
) -> dict[str, float]:
    """Forward + backward of a Llama of shape ``model`` (single process, fp32): achieved fraction
    of ``peak_flops`` by the planner's FLOP count (:func:`lightning_zero.planner.workload.training_flops`)."""
    import torch

    from lightning_zero.models import Llama
    from lightning_zero.models.llama import cross_entropy_loss
    from lightning_zero.planner.workload import training_flops

    config = bench_config(**model)
    torch.manual_seed(0)
    net = Llama(config)
    idx = torch.randint(0, config.vocab_size, (micro_batch, seq_len))

    def step() -> None:
        loss = cross_entropy_loss(net(idx), idx)
        loss.backward()
        for param in net.parameters():
            param.grad = None

    step()
    seconds = _timed(step, repeats)
    flops = training_flops(config, micro_batch=micro_batch, seq_len=seq_len, tp=1, activation_checkpointing=False)
    return {"seconds": seconds, "flops": flops, "mfu": flops / seconds / peak_flops}


# --------------------------------------------------------------------------------------------
# Per-step overhead: what a Lightning training step costs beyond its forward, backward and optimizer
# --------------------------------------------------------------------------------------------


def step_overhead_from(lightning_step_s: Sequence[float], bare_step_s: Sequence[float]) -> float:
    """``median(lightning) - median(bare)``, at least 0: the loop's cost per optimizer step."""
    if not lightning_step_s or not bare_step_s:
        raise ValueError("step_overhead_from: need at least one Lightning and one bare step time")
    return max(0.0, statistics.median(lightning_step_s) - statistics.median(bare_step_s))


def _overhead_worker(model: dict[str, int], micro_batch: int, seq_len: int, steps: int, warmup: int, out: str) -> None:
    """One process, pinned to one core with one thread (as a benchmark rank): a Lightning fit of
    ``LlamaLM`` with the benchmark harness's Trainer flags, each step timed from
    ``on_train_batch_start`` to ``on_train_batch_end`` (the harness's window); right after each timed
    step, the same work without Lightning on a second copy of the model (forward, loss, backward,
    AdamW step over the same two parameter groups, ``zero_grad``) is timed, so both see the same load."""
    pin_to_core(0)
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_zero.models import Llama

    config = bench_config(**model)
    torch.manual_seed(0)
    bare_model = Llama(config)
    matrices = [p for p in bare_model.parameters() if p.dim() >= 2]
    gains = [p for p in bare_model.parameters() if p.dim() < 2]
    bare_optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": gains, "weight_decay": 0.0}]
    )
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len + 1))

    def bare_step() -> float:
        start = time.perf_counter()
        loss = bare_model.loss_fn(bare_model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        bare_optimizer.step()
        bare_optimizer.zero_grad()
        return time.perf_counter() - start

    class Timer(Callback):
        def __init__(self) -> None:
            self.lightning: list[float] = []
            self.bare: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            elapsed = time.perf_counter() - self.start
            if trainer.global_step > warmup:  # global_step already counts this step
                self.lightning.append(elapsed)
                self.bare.append(bare_step())
            elif trainer.global_step == warmup:
                bare_step()  # warm the bare copy's optimizer state too

    timer = Timer()
    max_steps = warmup + steps
    seed_bench()
    trainer = bench_trainer(devices=1, max_steps=max_steps, callbacks=[timer])
    data = bench_datamodule(config, seq_len=seq_len, batch_size=micro_batch, max_steps=max_steps)
    trainer.fit(bench_module(config), datamodule=data)
    Path(out).write_text(json.dumps({"lightning_step_s": timer.lightning, "bare_step_s": timer.bare}))


def measure_step_overhead(
    model: dict[str, int], *, micro_batch: int, seq_len: int, steps: int = 8, warmup: int = 2, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Seconds per optimizer step a Lightning training step spends beyond the work the step-time
    model counts (forward, backward, AdamW): hooks, logging, the LR scheduler, the optimizer closure
    and ``zero_grad`` bookkeeping, measured in a fresh process (:func:`_overhead_worker`).
    Returns the step times and ``step_overhead_s`` (:func:`step_overhead_from`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lz_overhead_") as out_dir:
        out = str(Path(out_dir, "overhead.json"))
        process = context.Process(target=_overhead_worker, args=(model, micro_batch, seq_len, steps, warmup, out))
        process.start()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            raise RuntimeError(f"calibrate: the step-overhead fit did not finish in {timeout_s:.0f} s")
        if process.exitcode != 0:
            raise RuntimeError(f"calibrate: the step-overhead fit failed (exit code {process.exitcode})")
        result = json.loads(Path(out).read_text())
    result["step_overhead_s"] = step_overhead_from(result["lightning_step_s"], result["bare_step_s"])
    result["steps"] = steps
    return result
