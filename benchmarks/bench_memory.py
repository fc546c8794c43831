"""Peak memory per rank at a size where it matters, beside the planner's prediction (issue 24).

2 CPU ranks (gloo), fp32 AdamW, the model built in ``configure_model``; each case in its own pair
of fresh processes ([Note: benchmark shape] in ``_harness.py``):

    python benchmarks/bench_memory.py --out results/memory.json                # 0.44B: ddp zero1 zero2 zero3 fsdp2
    python benchmarks/bench_memory.py --size tiny --cases zero2 zero3          # smoke test

Per case and rank: the RSS after the imports (the baseline), and above it the RSS at
``on_train_start`` and the peak RSS (``VmHWM``) at train start and at the end of training,
beside :func:`lightning_zero.planner.plan_run`'s ``memory`` for the same stage, precision, batch
and bucket size (model states, then the total with the engine's working set: bucket buffers,
stage 3's gathered units, activations). Then one checkpoint save, timed on each rank from a
barrier to ``trainer.save_checkpoint`` returning: the seconds the training loop waits (the
*save stall*), and the save's own peak; then the teardown's own peak (stage 3 gathers the whole
module back), each phase's peak apart ([Note: peak per phase]). On CUDA the same points also
report ``torch.cuda.max_memory_allocated``.

``--size 0.44b`` is issue 24's ``LlamaLM`` (dim 1536, 10 layers, 12 heads / 4 KV heads, ffn 6144,
vocab 32000: 444,366,336 parameters; seq 64 x batch 1, 3 steps). ``ddp`` needs about 20P bytes
per rank (weights, gradients, DDP's bucket copy, Adam): the driver skips it, with the reason
printed, when ``MemAvailable`` cannot hold two such ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import bench_main, drive, run_worker  # noqa: E402
from _probes import rss_bytes  # noqa: E402
from _stats import MIB  # noqa: E402
from bench_zero12 import CASES as ZERO12_CASES  # noqa: E402
from bench_zero12 import zero_at_end, zero_state_bytes  # noqa: E402

GIB = 2**30

# --size: LlamaConfig fields as the harness's model flags, and the run's defaults
SIZES: dict[str, dict[str, int]] = {
    "0.44b": {"dim": 1536, "layers": 10, "heads": 12, "kv-heads": 4, "ffn": 6144, "vocab": 32000},
    "tiny": {"dim": 64, "layers": 2, "heads": 4, "kv-heads": 2, "ffn": 128, "vocab": 256},
}
RUN_DEFAULTS = {"--seq": "64", "--batch": "1", "--steps": "2", "--warmup": "0", "--rounds": "1"}
CASE_NAMES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "zero1_async", "zero2_async", "zero3_async"]
DDP_BYTES_PER_PARAM = 20  # weights 4 + grads 4 + DDP's bucket copy 4 + Adam 8
SHARED_HEADROOM = 6 * GIB  # left to the other users of a shared machine (and the driver)


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=sorted(SIZES), default="0.44b", help="model size (sets the model flags)")
    parser.add_argument("--no-save", action="store_true", help="skip the timed checkpoint save")
    parser.add_argument(
        "--second-save", action="store_true", help="time a second save of the same state (steady state)"
    )
    parser.add_argument(
        "--trim-probe",
        action="store_true",
        help="diagnosis: at each point also call glibc's malloc_trim(0) and record the RSS after it"
        " (what the allocator kept of freed memory); lowers later RSS, so not for the table",
    )


def with_size(argv: list[str]) -> list[str]:
    """``argv`` with ``--size``'s model flags and the run defaults put in front (explicit flags win)."""
    size = "0.44b"
    if "--size" in argv:
        size = argv[argv.index("--size") + 1]
    front: list[str] = []
    for flag, value in SIZES[size].items():
        front += [f"--{flag}", str(value)]
    for flag, value in RUN_DEFAULTS.items():
        front += [flag, value]
    return front + argv


# --------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------


def cuda_peak() -> int:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2().fordblks``); 0 elsewhere."""
    from lightning_zero.zero.cpu_heap import mallinfo2

    info = mallinfo2()
    return info["fordblks"] if info is not None else 0


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0: ``5`` into
    ``/proc/self/clear_refs``), so the next read is the peak of what follows alone."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def make_memory_probe(save_dir: Path, *, save: bool, trim: bool = False, second_save: bool = False) -> Any:
    """A callback reading RSS (now and peak) at ``on_train_start`` and ``on_train_end``, then
    timing one ``trainer.save_checkpoint`` (the save stall) at ``on_train_end``."""
    from lightning.pytorch.callbacks import Callback

    class MemoryProbe(Callback):
        def __init__(self) -> None:
            self.points: dict[str, dict[str, int]] = {}
            self.save_s: float = float("nan")
            self.background_s: float = float("nan")  # async_checkpoint: until the background save published
            self.host_copy_bytes = 0  # async_checkpoint: the host copy the background save writes from
            self.prepared: dict[str, float] = {}  # async_checkpoint: the buffers filled after the first step
            self.copy_s: float = float("nan")  # async_checkpoint: the strategy's own part of the stall
            self.second_save = second_save
            self.save2_s: float = float("nan")
            self.copy2_s: float = float("nan")
            self.peaks_reset = False

        def _point(self, name: str) -> None:
            point = {"rss": rss_bytes("VmRSS"), "hwm": rss_bytes("VmHWM"), "cuda_peak": cuda_peak()}
            point["malloc_free"] = malloc_free_bytes()
            if trim and _libc() is not None:
                _libc().malloc_trim(0)
                point["rss_after_trim"] = rss_bytes("VmRSS")
            self.points[name] = point

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._point("train_start")
            if hasattr(trainer.strategy, "engine"):
                self.points["train_start"]["engine_total"] = int(trainer.strategy.engine.measured_bytes()["total"])

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._point("end")
            # [Note: peak per phase] VmHWM is reset after each phase, so the save's peak and the
            # teardown's (read once fit returned) are their own, not the training's again.
            self.peaks_reset = reset_peak_rss()
            if not save:
                return
            path = save_dir / f"{trainer.lightning_module.__class__.__name__}.ckpt"  # both ranks: one folder
            trainer.strategy.barrier("bench_memory.save")
            started = time.perf_counter()
            trainer.save_checkpoint(path)
            self.save_s = time.perf_counter() - started
            self._point("after_save")
            saves = getattr(
                getattr(trainer.strategy, "checkpoints", None), "writer", None
            )  # async_checkpoint: the write goes on (issue 43)
            if saves is not None:
                self.host_copy_bytes = saves.last_host_bytes
                # [Note: host buffers before the first save]: fresh bytes 0 when the save used them
                self.prepared = {"bytes": saves.prepared_bytes, "s": saves.prepare_s, "fresh": saves.fresh_bytes,
                                 "wait": saves.prepare_wait_s}  # fmt: skip
                self.copy_s = saves.last_stall_s  # inside ZeroStrategy.save_checkpoint: snapshot + host copy
                trainer.strategy.wait_for_checkpoint()
                self.background_s = time.perf_counter() - started
                self._point("after_background_save")
            if self.second_save:  # a second save of the same state: a steady-state one (issue 43)
                trainer.strategy.barrier("bench_memory.save2")
                started = time.perf_counter()
                trainer.save_checkpoint(path)
                self.save2_s = time.perf_counter() - started
                if saves is not None:
                    self.copy2_s = saves.last_stall_s
                    trainer.strategy.wait_for_checkpoint()
            trainer.strategy.barrier("bench_memory.saved")
            reset_peak_rss()
            if trainer.is_global_zero:
                import shutil

                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

        def result(self) -> dict[str, Any]:
            """Called after fit returned: the teardown's peak is VmHWM now ([Note: peak per phase])."""
            self._point("after_fit")
            return {"memory_points": self.points, "save_stall_s": self.save_s, "peaks_reset": self.peaks_reset,
                    "save_background_s": self.background_s, "save_host_copy_bytes": self.host_copy_bytes,
                    "save_copy_s": self.copy_s, "save2_stall_s": self.save2_s, "save2_copy_s": self.copy2_s,
                    "save_prepared": self.prepared}  # fmt: skip

    return MemoryProbe()


def predicted_memory(args: argparse.Namespace, stage: int) -> dict[str, float]:
    """The planner's ``MemoryPerRank`` for this run (the project's functions, not a formula here)."""
    from _harness import model_config

    from lightning_zero.planner import plan_run

    plan = plan_run(
        model_config(args),
        stage=stage,
        world_size=2,
        devices_per_node=2,
        precision="32-true",
        micro_batch=args.batch,
        seq_len=args.seq,
        bucket_mb=args.bucket_mb,
        prefetch_blocks=1,
        simulate=False,
        suggest=False,
        reserved_gib=0.0,
    )
    return plan.memory.as_dict()


def worker(args: argparse.Namespace) -> None:
    case = ZERO12_CASES[args.worker]
    probe = make_memory_probe(Path(args.worker_dir), save=not args.no_save, trim=args.trim_probe,
                              second_save=args.second_save)  # fmt: skip
    if case.family == "zero":
        hooks: dict[str, Any] = dict(state_bytes=zero_state_bytes, at_end=zero_at_end)
    else:
        import _incumbents

        hooks = dict(
            state_bytes={"ddp": _incumbents.ddp_state_bytes, "fsdp2": _incumbents.fsdp2_state_bytes}[case.family]
        )
    prediction = predicted_memory(args, case.stage)
    run_worker(
        args,
        label=case.label,
        stage=case.stage,
        make_strategy=lambda: case.make(args),
        make_module=case.make_module,
        callbacks=[probe],
        result_extra=lambda: {**probe.result(), "planner_memory": prediction},
        **hooks,
    )


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def memory_rows(run_dir_rows: list[dict], log_dir: Path) -> list[dict]:
    """Per case and rank: baseline, above-baseline RSS and peaks, the prediction, the save stall."""
    out = []
    for row in run_dir_rows:
        if "error" in row:
            out.append({"case": row["case"], "error": row["error"]})
            continue
        ranks = [json.loads(p.read_text()) for p in sorted(log_dir.glob(f"round0/{row['case']}.rank*.json"))]
        per_rank = []
        for rank in ranks:
            base = rank["rss_before_fit_bytes"]
            points = rank["memory_points"]
            per_rank.append(
                {
                    "rank": rank["rank"],
                    "baseline_rss": base,
                    "train_start_rss_above": points["train_start"]["rss"] - base,
                    "train_start_peak_above": points["train_start"]["hwm"] - base,
                    "end_peak_above": points["end"]["hwm"] - base,
                    "after_save_peak_above": points.get("after_save", {}).get("hwm", base) - base,
                    # teardown: stage 3 unshards the module ([Note: peak per phase])
                    "teardown_peak_above": points["after_fit"]["hwm"] - base if rank.get("peaks_reset") else None,
                    # the whole fit: training, save, teardown (ru_maxrss where VmHWM was not reset)
                    "fit_peak_above": max(point["hwm"] for point in points.values()) - base
                    if rank.get("peaks_reset")
                    else rank["peak_rss_bytes"] - base,
                    "end_rss_above": points["end"]["rss"] - base,
                    "end_malloc_free": points["end"].get("malloc_free", 0),
                    "cuda_peak_end": points["end"]["cuda_peak"],
                    "engine_total_at_train_start": points["train_start"].get("engine_total"),
                    "save_stall_s": rank["save_stall_s"],
                    "save_background_s": rank.get("save_background_s", float("nan")),
                    "save_host_copy_bytes": rank.get("save_host_copy_bytes", 0),
                    "save_copy_s": rank.get("save_copy_s", float("nan")),
                    "save2_stall_s": rank.get("save2_stall_s", float("nan")),
                    "save2_copy_s": rank.get("save2_copy_s", float("nan")),
                    "save_prepared": rank.get("save_prepared", {}),
                }
            )
        predicted = ranks[0]["planner_memory"]
        out.append({"case": row["case"], "label": row["label"], "ranks": per_rank, "planner_memory": predicted})
    return out


def _mib_or_dash(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def memory_table(rows: list[dict]) -> str:
    header = (
        f"{'case':<7}{'start RSS r0/r1':>17}{'start peak':>12}{'end peak r0/r1':>16}{'states pred':>13}"
        f"{'total pred':>12}{'end/pred':>10}{'save s r0/r1':>14}{'save peak':>11}{'teardown':>10}{'fit peak':>10}"
    )
    lines = ["MiB above the post-import RSS per rank; pred = lightning_zero.planner.plan_run memory", header]
    lines.append("-" * len(header))
    for row in rows:
        if "error" in row:
            lines.append(f"{row['case']:<7}  did not run: {row['error']}")
            continue
        ranks, pred = row["ranks"], row["planner_memory"]

        def pair(key: str, ranks: list[dict] = ranks) -> str:
            return "/".join(f"{r[key] / MIB:,.0f}" for r in ranks)

        end_peak = max(r["end_peak_above"] for r in ranks)
        save = "/".join(f"{r['save_stall_s']:.1f}" for r in ranks)
        lines.append(
            f"{row['case']:<7}{pair('train_start_rss_above'):>17}{max(r['train_start_peak_above'] for r in ranks) / MIB:>12,.0f}"
            f"{pair('end_peak_above'):>16}{pred['model_states'] / MIB:>13,.0f}{pred['total'] / MIB:>12,.0f}"
            f"{end_peak / pred['total']:>10.2f}{save:>14}{max(r['after_save_peak_above'] for r in ranks) / MIB:>11,.0f}"
            f"{_mib_or_dash(max((r['teardown_peak_above'] for r in ranks), key=lambda v: v or 0)):>10}"
            f"{max(r['fit_peak_above'] for r in ranks) / MIB:>10,.0f}"
        )
    return "\n".join(lines)


def _teardown_or_fit_peak(rank: dict) -> int:
    teardown = rank["teardown_peak_above"]
    return rank["fit_peak_above"] if teardown is None else teardown


def goals(rows: list[dict]) -> list[str]:
    """Issue 24's goal: every peak (training, and teardown) within 10% of the planner's total, and
    zero3 < zero2 < zero1."""
    lines = []
    peaks = {}
    for row in rows:
        if "error" in row:
            continue
        # training and teardown (stage 3 gathers the whole module then); the save is reported apart
        # (no per-phase peaks: the fit's, the save included)
        # async_checkpoint's host buffers are taken after the first step ([Note: host buffers
        # before the first save]): the planner models training, so they are left out, and named
        held = {r["rank"]: r.get("save_prepared", {}).get("bytes", 0) for r in row["ranks"]}
        peak = max(max(r["end_peak_above"], _teardown_or_fit_peak(r)) - held[r["rank"]] for r in row["ranks"])
        peaks[row["case"]] = peak
        ratio = peak / row["planner_memory"]["total"]
        less = f" (less {max(held.values()) / MIB:,.0f} MiB of checkpoint host buffers)" if any(held.values()) else ""
        lines.append(
            f"goal: {row['case']} peak{less} {ratio:.3f}x predicted (within 10%):"
            f" {'met' if abs(ratio - 1) <= 0.10 else 'NOT met'}"
        )
    if all(case in peaks for case in ("zero1", "zero2", "zero3")):
        order = peaks["zero3"] < peaks["zero2"] < peaks["zero1"]
        lines.append(
            f"goal: zero3 {peaks['zero3'] / MIB:,.0f} < zero2 {peaks['zero2'] / MIB:,.0f} < zero1"
            f" {peaks['zero1'] / MIB:,.0f} MiB: {'met' if order else 'NOT met'}"
        )
    return lines


def async_lines(rows: list[dict]) -> list[str]:
    """Issue 43: the save stall with ``async_checkpoint`` beside the synchronous one (goal: at most
    15% of it), the background write's own time and the host copy it holds."""
    by_case = {row["case"]: row for row in rows if "error" not in row}
    lines = []
    for case, row in by_case.items():
        sync = by_case.get(case.removesuffix("_async"))
        if not case.endswith("_async") or sync is None:
            continue
        stall = max(r["save_stall_s"] for r in row["ranks"])
        sync_stall = max(r["save_stall_s"] for r in sync["ranks"])
        written = max(r["save_background_s"] for r in row["ranks"])
        host = max(r["save_host_copy_bytes"] for r in row["ranks"])
        copy = max(r["save_copy_s"] for r in row["ranks"])
        ratio = stall / sync_stall
        stall2 = max(r["save2_stall_s"] for r in row["ranks"])
        sync2 = max(r["save2_stall_s"] for r in sync["ranks"])
        if stall2 == stall2 and sync2 == sync2:  # --second-save: the host buffers are reused then
            lines.append(
                f"second save: {case} stall {stall2:.2f} s vs {sync['case']} {sync2:.2f} s = {stall2 / sync2:.1%}"
            )
        prepared = [r["save_prepared"] for r in row["ranks"] if r["save_prepared"]]
        if prepared:
            lines.append(
                f"host buffers: {case} filled after the first step in {max(p['s'] for p in prepared):.1f} s (off the"
                f" loop), {max(p['bytes'] for p in prepared) / MIB:,.0f} MiB per rank; the first save waited"
                f" {max(p.get('wait', 0.0) for p in prepared):.2f} s for them; fresh pages at the first save"
                f" {max(p['fresh'] for p in prepared) / MIB:,.0f} MiB"
            )
        lines.append(
            f"goal: {case} stall {stall:.2f} s vs {sync['case']} {sync_stall:.2f} s = {ratio:.1%} (at most 15%):"
            f" {'met' if ratio <= 0.15 else 'NOT met'} (snapshot + host copy {copy:.2f} s of it); published after"
            f" {written:.1f} s; host copy"
            f" {host / MIB:,.0f} MiB per rank"
        )
    return lines


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    import tempfile

    from _harness import model_config

    num_params = model_config(args).num_params()
    if "ddp" in args.cases:
        need, have = 2 * DDP_BYTES_PER_PARAM * num_params + SHARED_HEADROOM, mem_available()
        if need > have:
            print(
                f"skipping ddp: two ranks need about {need / GIB:.1f} GiB ({DDP_BYTES_PER_PARAM} B/param x"
                f" {num_params:,} x 2 + {SHARED_HEADROOM / GIB:.0f} GiB left to others), MemAvailable is {have / GIB:.1f} GiB",
                flush=True,
            )
            args.cases = [c for c in args.cases if c != "ddp"]
            argv = [a for a in argv if a != "ddp"]
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench_memory_"))
    args.log_dir = str(log_dir)
    if "--log-dir" not in argv:
        argv = [*argv, "--log-dir", str(log_dir)]
    out = args.out
    args.out = None  # drive's JSON is extended below
    table_rows: list[dict] = []

    def report(rows: list[dict]) -> list[str]:
        table_rows[:] = memory_rows(rows, log_dir)
        return [memory_table(table_rows), "", *goals(table_rows), *async_lines(table_rows)]

    rows = drive(
        "memory", str(Path(__file__).resolve()), args, argv, known_cases=CASE_NAMES, baseline="zero2", report=report
    )
    if out:
        from _stats import machine_note

        payload = {
            "benchmark": "memory",
            "size": args.size,
            "num_params": num_params,
            "machine": machine_note(),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_dir")},
            "memory": table_rows,
            "report": [memory_table(table_rows), *goals(table_rows)],
            "rows": rows,
        }
        Path(out).write_text(json.dumps(payload, indent=1, default=float))
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.argv[1:] = with_size(sys.argv[1:])
    bench_main(__doc__.split("\n\n")[0], CASE_NAMES, worker, driver, extra_args=extra_args)
