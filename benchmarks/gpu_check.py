"""The one prepared GPU check: every engine collective through NCCL on one GPU, one JSON written as it goes.

Usage (docs/gpu.md)::

    python benchmarks/gpu_check.py --out gpu_check.json     # one CUDA GPU, about 5 minutes on an H200
    python benchmarks/gpu_check.py --dry-run --out dry.json # CPU, tiny model, gloo: every phase that needs no CUDA

Runs on torch >= 2.11 with Lightning 2.6 and nothing else of this project's dependencies: no
Hydra, no omegaconf (the planner reads its hardware YAML with PyYAML). The JSON is rewritten after
every phase, so a run cut short still says how far it got; ``phases[name]["ok"]`` is each phase's
verdict, ``"error"`` its traceback tail.

Phases, in order of value (each one's checks: docs/gpu.md):

1. ``preflight``: versions; every torch API the engine uses exists (the collective names, AVG,
   ``_set_pg_timeout``, ``_abort_process_group``, the autograd internals).
2. ``probes``: on a 1-rank NCCL group: in-place AVG reduce-scatter in bf16 and fp32, in-place
   all-gather, all-to-all, int MAX all-reduce, a consumer kernel after ``wait()`` reading correct
   values, and the group's timeout after ``hold_collective_timeout``.
3. ``runs``: Lightning's single-device run vs ZeroStrategy stage 1/2/3 at bf16-mixed on a ~125M
   Llama: losses, step time, tokens/s, MFU, ``max_memory_allocated`` read before teardown beside
   the planner's prediction. dp=1: every collective short-circuits here.
4. ``forced``: the same zero runs with every collective on the wire ([Note: one rank on the
   wire] in ``comm/collectives.py``): losses equal to phase 3's (a one-rank collective's result is
   the input).
5. ``offload_clip_monitor``: zero2, offload_optimizer, gradient clipping, the monitor, forced.
6. ``zero3_offload_accum_ckpt``: zero3 + offload + accumulation 2 + activation checkpointing
   (backward runs on autograd's device thread), forced.
7. ``uninitialized_fill``: zero2 and zero3 forced with ``fill_uninitialized_memory`` (NaN in every
   fresh float allocation): a read before write shows as a non-finite loss.
8. ``profile``: one forced zero2 step under the profiler: device time per ``lightning_zero::`` label.
9. ``async_checkpoint``: zero3 forced, a checkpoint every 2 steps, saved synchronously and with
   ``async_checkpoint=True``: the same losses, byte-identical tensor files, and how long each save
   held the training loop (the background copy goes from the device into pinned host buffers).

10. ``muon``: torch.optim.Muon + AdamW through matrix owners on the one-rank group, forced, fp32:
   bit for bit torch.optim.Muon on a copy of the model, the owner exchanges on the wire, and the
   optimizer step's seconds beside AdamW's (docs/optimizers.md).

Why one rank: NCCL refuses two ranks on one device ("Duplicate GPU detected"); the wire is
forced instead, so the collectives, their ops, in-place buffers and stream semantics all run
through NCCL. Collective *timing* and overlap need two GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers zero1/zero2/zero3)
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.comm.collectives import WIRE_ONE_RANK_ENV  # noqa: E402
from lightning_zero.models import LlamaConfig, LlamaLM  # noqa: E402
from lightning_zero.planner import plan_run  # noqa: E402
from lightning_zero.planner.bench_model import STEPS_ONLY  # noqa: E402
from lightning_zero.runtime.throughput import peak_flops_for, training_flops_of  # noqa: E402

GPU = {
    "model": dict(
        name="gpu_check_125m",
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
    "steps": 30,
    "short_steps": 10,  # phases 5-9
    "warmup": 5,
    "hardware": "h200_141gb",
}
DRY = {
    "model": dict(name="dry", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32),
    "micro_batch": 2,
    "seq_len": 16,
    "steps": 3,
    "short_steps": 2,
    "warmup": 1,
    "hardware": "h200_141gb",
}
RUNS = ("single", "zero1", "zero2", "zero3")
PHASES = ("preflight", "probes", "runs", "forced", "offload_clip_monitor", "zero3_offload_accum_ckpt",
          "uninitialized_fill", "profile", "async_checkpoint", "muon")  # fmt: skip


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
        self.max_memory_allocated: Optional[int] = None

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

    def on_train_end(self, trainer, pl_module) -> None:
        # before the strategy's teardown (its full fp32 gather is not the training peak)
        if self.device.type == "cuda":
            self.max_memory_allocated = int(torch.cuda.max_memory_allocated(self.device))


def token_batches(settings: dict[str, Any], rows: int) -> list[torch.Tensor]:
    """The same token rows for every run: ``rows`` rows of ``seq_len + 1`` ids."""
    generator = torch.Generator().manual_seed(1234)
    return list(torch.randint(0, settings["model"]["vocab_size"], (rows, settings["seq_len"] + 1), generator=generator))


@contextlib.contextmanager
def wire_forced(forced: bool):
    """[Note: one rank on the wire] in comm/collectives.py, for one run."""
    before = os.environ.get(WIRE_ONE_RANK_ENV)
    if forced:
        os.environ[WIRE_ONE_RANK_ENV] = "1"
    else:
        os.environ.pop(WIRE_ONE_RANK_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WIRE_ONE_RANK_ENV, None)
        else:
            os.environ[WIRE_ONE_RANK_ENV] = before


def run_one(
    kind: str,
    settings: dict[str, Any],
    accelerator: str,
    device: torch.device,
    *,
    steps: Optional[int] = None,
    forced: bool = False,
    knobs: Optional[dict[str, Any]] = None,
    trainer_args: Optional[dict[str, Any]] = None,
    activation_checkpointing: bool = False,
    profile: bool = False,
    checkpoint_dir: Optional[Path] = None,
) -> dict[str, Any]:
    """One training run of ``kind`` ("single" or "zeroN"); returns its figures. ``checkpoint_dir``:
    a ``ModelCheckpoint`` there every 2 steps, and the seconds each save held the loop."""
    steps = steps or settings["steps"]
    trainer_args = dict(trainer_args or {})
    accumulate = trainer_args.get("accumulate_grad_batches", 1)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    L.seed_everything(0, verbose=False)
    model = LlamaLM(settings["model"], lr=3e-4, warmup_steps=min(5, steps), max_steps=steps,
                    activation_checkpointing=activation_checkpointing)  # fmt: skip
    stage = 0 if kind == "single" else int(kind[-1])
    strategy: Any = (
        SingleDevice(device) if kind == "single" else ZeroStrategy(stage=stage, **{"monitor": False, **(knobs or {})})
    )
    probe = StepProbe(device)
    callbacks: list[Any] = [probe]
    profiler_box: dict[str, Any] = {}
    if profile:
        callbacks.append(ProfileLastStep(device, profiler_box))
    stalls: list[float] = []
    if checkpoint_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=2, save_top_k=-1))
        trainer_args["enable_checkpointing"] = True
        strategy.save_checkpoint = _timed_saves(strategy.save_checkpoint, device, stalls)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        use_distributed_sampler=False,  # dp=1: the same rows in the same order as the single run
        callbacks=callbacks,
        **{**STEPS_ONLY, **trainer_args},
    )
    loader = DataLoader(token_batches(settings, steps * accumulate * settings["micro_batch"]),
                        batch_size=settings["micro_batch"], shuffle=False)  # fmt: skip
    started = time.perf_counter()
    with wire_forced(forced):
        trainer.fit(model, loader)
    wall_s = time.perf_counter() - started
    steady = probe.step_s[settings["warmup"] :] or probe.step_s
    step_s = statistics.median(steady) * accumulate
    tokens = settings["micro_batch"] * settings["seq_len"] * accumulate
    config = LlamaConfig.from_name("tiny", **{k: v for k, v in settings["model"].items() if k != "name"})
    flops = training_flops_of(config, 0, settings["micro_batch"], settings["seq_len"]) * accumulate
    peak = peak_flops_for(settings["hardware"], torch.bfloat16)
    result: dict[str, Any] = {
        "forced_wire": forced,
        "losses": probe.losses,
        "finite": all(math.isfinite(loss) for loss in probe.losses),
        "step_s_median": step_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / peak if peak else None,
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    if probe.max_memory_allocated is not None:
        result["max_memory_allocated"] = probe.max_memory_allocated  # read before teardown (issue 46 item 11)
    if kind != "single" and getattr(strategy, "comm_counter", None) is not None:
        result["comm_calls"] = dict(strategy.comm_counter.calls)
    from lightning_zero.config import ZeroConfig

    zero_config = ZeroConfig(stage=max(stage, 1), offload_optimizer=bool((knobs or {}).get("offload_optimizer")))
    plan = plan_run(
        config,
        zero_config if stage else None,
        stage=None if stage else 0,
        world_size=1,
        devices_per_node=1,
        precision="bf16-mixed",
        micro_batch=settings["micro_batch"],
        seq_len=settings["seq_len"],
        activation_checkpointing=activation_checkpointing,
        hardware=settings["hardware"],
        suggest=False,
    )
    result["predicted_memory"] = {key: float(value) for key, value in plan.memory.as_dict().items()}
    if "max_memory_allocated" in result:
        result["measured_over_predicted"] = result["max_memory_allocated"] / plan.memory.total
    if profiler_box:
        result["profile"] = profiler_box["table"]
    if checkpoint_dir is not None:
        result["save_stall_s"] = stalls
    del trainer, model
    return result


def _timed_saves(save: Callable[..., Any], device: torch.device, stalls: list[float]) -> Callable[..., Any]:
    """``save`` (a strategy's ``save_checkpoint``), noting how long each call held the training loop."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = save(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stalls.append(time.perf_counter() - started)
        return out

    return timed


class ProfileLastStep(L.Callback):
    """Profiles the last training batch; keeps device (or CPU) time per ``lightning_zero::`` label."""

    def __init__(self, device: torch.device, box: dict[str, Any]) -> None:
        self.device, self.box, self.profiler = device, box, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps - 1 and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.__exit__(None, None, None)
        table = {}
        for event in self.profiler.key_averages():
            if event.key.startswith("lightning_zero::"):
                device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                table[event.key] = {"count": event.count, "cpu_us": event.cpu_time_total, "device_us": device_us}
        self.box["table"] = table


def loss_diff(a: list[float], b: list[float]) -> dict[str, float]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return {
        "max_abs": max(diffs) if diffs else math.nan,
        "max_rel": max(d / abs(y) for d, y in zip(diffs, b)) if diffs else math.nan,
        "first_abs": diffs[0] if diffs else math.nan,
    }


# -- phases ----------------------------------------------------------------------------------------


def phase_preflight(ctx: dict[str, Any]) -> dict[str, Any]:
    c10d = dist.distributed_c10d
    apis = {
        "reduce_scatter (tensor or single)": hasattr(dist, "reduce_scatter_tensor")
        or hasattr(dist, "reduce_scatter_single"),
        "all_gather (into_tensor or single)": hasattr(dist, "all_gather_into_tensor")
        or hasattr(dist, "all_gather_single"),
        "all_to_all_single": hasattr(dist, "all_to_all_single"),
        "ReduceOp.AVG": hasattr(dist.ReduceOp, "AVG"),
        "_set_pg_timeout": hasattr(c10d, "_set_pg_timeout"),
        "_abort_process_group": hasattr(c10d, "_abort_process_group"),
        "_get_default_store": hasattr(c10d, "_get_default_store"),
        "register_post_accumulate_grad_hook": hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
        "_current_autograd_node": hasattr(torch._C, "_current_autograd_node"),
        "_current_graph_task_id": hasattr(torch._C, "_current_graph_task_id"),
        "fill_uninitialized_memory": hasattr(torch.utils.deterministic, "fill_uninitialized_memory"),
    }
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": L.__version__,
                "cuda": torch.version.cuda}  # fmt: skip
    for name in ("transformers", "omegaconf", "hydra", "yaml"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            versions[name] = None
    if ctx["device"].type == "cuda":
        versions["device"] = torch.cuda.get_device_name(ctx["device"])
        nccl = torch.cuda.nccl.version()  # a tuple on recent torch, an int on older ones
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return {"ok": all(apis.values()), "apis": apis, "versions": versions}


def phase_probes(ctx: dict[str, Any]) -> dict[str, Any]:
    """One-rank group, the wire forced: what the engine's collectives rely on."""
    from lightning_zero.comm.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
    from lightning_zero.zero.waits import hold_collective_timeout

    device, backend = ctx["device"], ctx["backend"]
    checks: dict[str, Any] = {}
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        with wire_forced(True):
            for dtype in (torch.bfloat16, torch.float32):
                full = torch.randn(1 << 20, device=device).to(dtype)
                expect = full.clone()
                op = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
                work = reduce_scatter(full, full, None, op=op, async_op=True)  # in place, as the reducer runs it
                work.wait()
                consumer = full * 2  # a kernel after wait(): reads the collective's output
                checks[f"reduce_scatter_{str(dtype)[6:]}_{'avg' if backend == 'nccl' else 'sum'}_in_place"] = bool(
                    torch.equal(consumer, expect * 2)
                )
            shard = torch.arange(4096, dtype=torch.float32, device=device)
            out = torch.empty_like(shard)
            all_gather(out, shard, None, async_op=True).wait()
            checks["all_gather"] = bool(torch.equal(out, shard))
            inplace = shard.clone()
            all_gather(inplace, inplace, None, async_op=True).wait()
            checks["all_gather_in_place"] = bool(torch.equal(inplace, shard))
            received = torch.empty_like(shard)
            all_to_all(received, shard, None, async_op=True).wait()
            checks["all_to_all"] = bool(torch.equal(received, shard))
            flags = torch.tensor([1, -1, 7, 0], dtype=torch.int32, device=device)
            all_reduce(flags, None, op=dist.ReduceOp.MAX, async_op=True).wait()
            checks["all_reduce_int32_max"] = flags.tolist() == [1, -1, 7, 0]
            # a long kernel queued before the collective: wait() must order the consumer after it
            big = torch.randn(
                4096 if device.type == "cuda" else 256, 4096 if device.type == "cuda" else 256, device=device
            )
            product = big @ big
            before = product.clone()
            work = all_reduce(product, None, op=dist.ReduceOp.MAX, async_op=True)
            work.wait()
            checks["consumer_after_wait"] = bool(torch.equal(product.sum(), before.sum()))
        done = hold_collective_timeout([None], 300.0)
        checks["timeout_set_on_nccl_groups"] = len(done) == (1 if backend == "nccl" else 0)
    finally:
        dist.destroy_process_group()
    return {"ok": all(checks.values()), "checks": checks}


def _runs(ctx, kinds, **kwargs) -> dict[str, Any]:
    out = {}
    for kind in kinds:
        out[kind] = run_one(kind, ctx["settings"], ctx["accelerator"], ctx["device"], **kwargs)
        print(
            f"gpu_check:   {kind:<6} step {out[kind]['step_s_median'] * 1e3:8.1f} ms  last loss {out[kind]['losses'][-1]:.4f}",
            flush=True,
        )
    return out


def phase_runs(ctx: dict[str, Any]) -> dict[str, Any]:
    runs = _runs(ctx, RUNS)
    ctx["short_circuit"] = runs
    single = runs["single"]
    vs = {kind: {**loss_diff(runs[kind]["losses"], single["losses"]),
                 "step_time_vs_single": runs[kind]["step_s_median"] / single["step_s_median"]}
          for kind in RUNS[1:]}  # fmt: skip
    # bf16-mixed: Lightning keeps fp32 weights under autocast, the engine bf16 weights with fp32 masters
    ok = all(run["finite"] for run in runs.values()) and all(v["max_rel"] < 2e-2 for v in vs.values())
    return {"ok": ok, "runs": runs, "vs_single": vs}


def phase_forced(ctx: dict[str, Any]) -> dict[str, Any]:
    runs = _runs(ctx, RUNS[1:], forced=True)
    base = ctx.get("short_circuit", {})
    vs = {kind: loss_diff(runs[kind]["losses"], base[kind]["losses"]) for kind in runs if kind in base}
    wired = all(sum(run.get("comm_calls", {}).values()) > 0 for run in runs.values())
    ok = wired and all(run["finite"] for run in runs.values()) and all(v["max_abs"] == 0.0 for v in vs.values())
    return {"ok": ok, "runs": runs, "vs_short_circuit": vs, "collectives_launched": wired}


def phase_offload(ctx: dict[str, Any]) -> dict[str, Any]:
    run = run_one("zero2", ctx["settings"], ctx["accelerator"], ctx["device"], steps=ctx["settings"]["short_steps"],
                  forced=True, knobs={"offload_optimizer": True, "monitor": True},
                  trainer_args={"gradient_clip_val": 1.0})  # fmt: skip
    return {"ok": run["finite"], "run": run}


def phase_zero3_combo(ctx: dict[str, Any]) -> dict[str, Any]:
    run = run_one("zero3", ctx["settings"], ctx["accelerator"], ctx["device"], steps=ctx["settings"]["short_steps"],
                  forced=True, knobs={"offload_optimizer": True}, trainer_args={"accumulate_grad_batches": 2},
                  activation_checkpointing=True)  # fmt: skip
    return {"ok": run["finite"], "run": run}


def phase_uninitialized(ctx: dict[str, Any]) -> dict[str, Any]:
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)  # the fill applies only in deterministic mode
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        runs = _runs(ctx, ("zero2", "zero3"), steps=ctx["settings"]["short_steps"], forced=True)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic)
    return {"ok": all(run["finite"] for run in runs.values()), "runs": runs}


def phase_profile(ctx: dict[str, Any]) -> dict[str, Any]:
    run = run_one("zero2", ctx["settings"], ctx["accelerator"], ctx["device"], steps=ctx["settings"]["short_steps"],
                  forced=True, profile=True)  # fmt: skip
    table = run.get("profile", {})
    return {
        "ok": any("reduce_scatter" in key for key in table),
        "profile": table,
        "step_s_median": run["step_s_median"],
    }


def phase_async_checkpoint(ctx: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    runs, dirs = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as root:
        for mode in ("sync", "async"):
            dirs[mode] = Path(root, mode)
            runs[mode] = run_one("zero3", ctx["settings"], ctx["accelerator"], ctx["device"],
                                 steps=ctx["settings"]["short_steps"], forced=True,
                                 knobs={"async_checkpoint": mode == "async"}, checkpoint_dir=dirs[mode])  # fmt: skip
        saved = sorted(p.relative_to(dirs["sync"]) for p in dirs["sync"].rglob("*") if p.suffix == ".distcp")
        differing = [str(p) for p in saved if (dirs["sync"] / p).read_bytes() != (dirs["async"] / p).read_bytes()]
    stalls = {mode: runs[mode]["save_stall_s"] for mode in runs}
    ok = (runs["sync"]["losses"] == runs["async"]["losses"] and bool(saved) and not differing
          and len(stalls["sync"]) == len(stalls["async"]) > 0)  # fmt: skip
    return {
        "ok": ok,
        "tensor_files": len(saved),
        "differing_files": differing,
        "save_stall_s": stalls,
        "async_over_sync": sum(stalls["async"]) / max(sum(stalls["sync"]), 1e-9),
        "runs": runs,
    }


def _muon_optimizers(model: torch.nn.Module, muon: bool) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embeddings" not in n and "output" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in hidden)]
    first = torch.optim.Muon(hidden, lr=0.02) if muon else torch.optim.AdamW(hidden, lr=1e-3)
    return [first, torch.optim.AdamW(rest, lr=1e-3)]


def phase_muon(ctx: dict[str, Any]) -> dict[str, Any]:
    """torch.optim.Muon through matrix owners (zero/matrix_optimizer.py) on a one-rank group, the
    wire forced, in fp32: the engine's steps equal torch.optim.Muon's on a copy of the model bit for
    bit (Newton-Schulz in bf16 on the device), the owner exchanges ran, and the optimizer step's
    seconds beside AdamW's at the same size (stage 2; the device synchronized around each step)."""
    import copy

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import Llama
    from lightning_zero.models.llama.config import resolve_config
    from lightning_zero.zero.engine import ZeroEngine

    device, settings = ctx["device"], ctx["settings"]
    created = not dist.is_initialized()  # the Lightning runs before may have left theirs (one rank)
    if created:
        dist.init_process_group(
            ctx["backend"], rank=0, world_size=1, device_id=device if device.type == "cuda" else None
        )
    try:
        with wire_forced(True):
            torch.manual_seed(0)
            reference = Llama(resolve_config(settings["model"])).to(device)
            models = {"reference": reference, "muon": copy.deepcopy(reference), "adamw": copy.deepcopy(reference)}
            plain = _muon_optimizers(reference, True)
            engines, optimizers = {}, {}
            for kind in ("muon", "adamw"):
                optimizers[kind] = _muon_optimizers(models[kind], kind == "muon")
                engines[kind] = ZeroEngine(models[kind], optimizers[kind], ZeroConfig(stage=2), device=device)
            rows = token_batches(settings, settings["micro_batch"] * (settings["short_steps"] + 1))
            step_s: dict[str, list[float]] = {"muon": [], "adamw": []}
            for step in range(settings["short_steps"]):
                ids = torch.stack(rows[step * settings["micro_batch"] : (step + 1) * settings["micro_batch"]]).to(
                    device
                )
                for kind, model in models.items():
                    out = model(ids[:, :-1])
                    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), ids[:, 1:].flatten())
                    if kind == "reference":
                        loss.backward()
                    else:
                        engines[kind].backward(loss)
                    started = StepProbe(device)._sync()
                    for optimizer in plain if kind == "reference" else optimizers[kind]:
                        optimizer.step()
                        optimizer.zero_grad()
                    if kind in engines:
                        engines[kind].wait_param_gathers()
                        step_s[kind].append(StepProbe(device)._sync() - started)
            gap = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), models["muon"].parameters()))
            calls = {k: v for k, v in engines["muon"].counter.calls.items() if k.startswith("muon_")}
            for engine in engines.values():
                engine.close()
    finally:
        if created:
            dist.destroy_process_group()
    warm = settings["warmup"] if settings["short_steps"] > settings["warmup"] else 0
    medians = {kind: statistics.median(times[warm:]) for kind, times in step_s.items()}
    return {
        "ok": gap == 0.0 and calls.get("muon_to_owner", 0) > 0 and calls.get("muon_from_owner", 0) > 0,
        "max_abs_vs_torch_muon": gap,
        "owner_exchange_calls": calls,
        "optimizer_step_s_median": medians,
        "muon_over_adamw": medians["muon"] / medians["adamw"],
    }


PHASE_FUNCTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "preflight": phase_preflight,
    "probes": phase_probes,
    "runs": phase_runs,
    "forced": phase_forced,
    "offload_clip_monitor": phase_offload,
    "zero3_offload_accum_ckpt": phase_zero3_combo,
    "uninitialized_fill": phase_uninitialized,
    "profile": phase_profile,
    "async_checkpoint": phase_async_checkpoint,
    "muon": phase_muon,
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true",
                        help="CPU, tiny model, gloo: every phase that needs no CUDA")  # fmt: skip
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes (rewritten after every phase)")
    parser.add_argument("--phases", nargs="*", default=list(PHASES), choices=PHASES, help="a subset, in order")
    args = parser.parse_args(argv)
    if args.dry_run:
        settings, accelerator, device, backend = DRY, "cpu", torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; --dry-run runs the CPU phases", file=sys.stderr)
            return 2
        settings, accelerator, device, backend = GPU, "gpu", torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    ctx: dict[str, Any] = {"settings": settings, "accelerator": accelerator, "device": device, "backend": backend}
    report: dict[str, Any] = {"dry_run": args.dry_run, "settings": settings, "world_size": 1, "phases": {}}
    out = Path(args.out)
    started = time.perf_counter()
    for name in [phase for phase in PHASES if phase in args.phases]:
        phase_started = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            result = PHASE_FUNCTIONS[name](ctx)
        except Exception:  # noqa: BLE001 - recorded, and the next phase still runs
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
            if dist.is_initialized():
                dist.destroy_process_group()
        result["seconds"] = time.perf_counter() - phase_started
        report["phases"][name] = result
        report["total_s"] = time.perf_counter() - started
        report["ok"] = all(phase["ok"] for phase in report["phases"].values())
        out.write_text(json.dumps(report, indent=2, default=str))  # after every phase
        print(f"gpu_check: {name} {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s", flush=True)
    print(
        f"gpu_check: wrote {out} in {report['total_s']:.0f} s: {'all ok' if report['ok'] else 'FAILURES'}", flush=True
    )
    return 0 if report["ok"] else 1


def _free_port() -> int:
    from lightning_zero.ports import free_port

    return free_port()


if __name__ == "__main__":
    sys.exit(main())
