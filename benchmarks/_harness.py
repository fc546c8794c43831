"""What every side-by-side benchmark shares: the driver, the per-rank probes, the table.

[Note: benchmark shape] One command (the *driver*) runs every case of a benchmark, each case in
its own pair of fresh processes: the driver starts ``python <script> --worker CASE ...`` (rank 0)
and Lightning's launcher re-runs that command line for rank 1. A fresh pair per case is what
makes *peak RSS* mean something: ``ru_maxrss`` is a high-water mark over a process's life, and
freed tensors stay in the allocator's arenas, so cases sharing a process would inherit each
other's peaks. To keep time ratios fair on a shared machine, cases run in ``--rounds`` rounds,
alternating forward and reverse order; a case's step time is the median over all its measured
steps in every round, and its ratio to the baseline case is the median over rounds of the ratio
of the two cases' medians within that round (:func:`step_ratio`).

Each rank:

- pins itself to its own core (``os.sched_setaffinity``) and uses one torch thread;
- times every optimizer step (``on_train_batch_start`` -> ``on_train_batch_end``; the first
  ``--warmup`` steps are dropped);
- counts the logical bytes its collectives send in the timed steps (see [Note: logical bytes] in
  ``lightning_zero/collectives.py``), by wrapping the ``torch.distributed`` tensor collectives
  (:class:`CollectiveTap`), which our engine, FSDP and DeepSpeed call from Python; DDP's C++
  reducer calls gloo past the tap, so its bytes come from its own bucket sizes;
- in one extra, untimed *probe* step at the end, counts the model-state bytes it holds (params,
  grads, optimizer state: the live tensors, deduplicated by storage) at three points: after
  forward, before the optimizer step, after it. Per kind the reported value is the largest of
  the three, and ``total`` the largest sum at one point;
- writes ``<case>.rank<r>.json``, which the driver merges into the table and ``--out`` JSON.

The driver copies ``lightning_zero`` and ``benchmarks/`` first and runs every worker from the
copy: other people commit to the same tree while a run takes minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

MIB = 2**20


# --------------------------------------------------------------------------------------------
# Process setup
# --------------------------------------------------------------------------------------------


def pin_rank_to_core() -> int:
    """Pin this process to core ``local_rank % cores`` and use one torch thread; returns the core
    (``lightning_zero.planner.bench_model.pin_to_core``, as the calibration pins)."""
    from lightning_zero.planner.bench_model import pin_to_core

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Rank 1 is started by rank 0 after rank 0 pinned itself, and inherits that mask: the cores
    # the job may use travel in BENCH_CORES, set by rank 0 before it pins.
    if "BENCH_CORES" not in os.environ:
        os.environ["BENCH_CORES"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return pin_to_core(local_rank, [int(c) for c in os.environ["BENCH_CORES"].split(",")])


def rss_bytes(field: str = "VmRSS") -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------------
# Counting what collectives send
# --------------------------------------------------------------------------------------------

# name in torch.distributed -> (kind, which tensor argument the count is taken from); the bytes
# one rank sends are lightning_zero.ring.ring_sent(kind, that tensor's bytes, group size)
_RING = {
    "all_reduce": ("all_reduce", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0),
    "broadcast": ("broadcast", 0),
    # our reduce-scatter on gloo ([Note: reduce-scatter on gloo] in collectives.py) and the
    # compressed collectives: (n-1)/n of the input leaves each rank
    "all_to_all_single": ("all_to_all", 1),
}


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


_TAP: list["CollectiveTap"] = []  # the one tap of this process, once installed


def collective_tap() -> "CollectiveTap":
    """This process's :class:`CollectiveTap`, installed on the first call. A worker calls it before
    anything imports ``lightning_zero`` (:func:`bench_main`), so the library binds the wrappers."""
    if not _TAP:
        _TAP.append(CollectiveTap().install())
    return _TAP[0]


class CollectiveTap:
    """Wraps ``torch.distributed``'s tensor collectives to count logical bytes sent while ``active``.

    Installed before any strategy module is imported, so modules that bind a collective at
    import time bind the wrapper. A collective that calls another one (a deprecated name
    forwarding to the new one) is counted once. ``all_gather`` / ``reduce_scatter`` with tensor
    lists count ``(n-1)/n`` of the list's bytes.
    """

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = threading.local()

    def install(self) -> "CollectiveTap":
        import torch.distributed as dist

        table = dict(_RING)
        table["all_gather"] = ("all_gather", 0)
        table["reduce_scatter"] = ("reduce_scatter", 1)
        for name, (kind, arg) in table.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, arg))
        return self

    def _wrap(self, original: Callable, kind: str, arg: int) -> Callable:
        tap = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(tap._depth, "value", 0)
            if tap.active and depth == 0:
                import torch.distributed as dist

                from lightning_zero.ring import ring_sent  # not at import: the tap goes in first

                tensor = args[arg] if len(args) > arg else next(iter(kwargs.values()), None)
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                n = dist.get_world_size(group)
                sent = ring_sent(kind, _tensor_bytes(tensor), n)
                tap.bytes[kind] = tap.bytes.get(kind, 0.0) + sent
                tap.calls[kind] = tap.calls.get(kind, 0) + 1
            tap._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                tap._depth.value = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def total(self) -> float:
        return sum(self.bytes.values())


# --------------------------------------------------------------------------------------------
# Counting model-state bytes
# --------------------------------------------------------------------------------------------


class StorageLedger:
    """Bytes of distinct tensor storages, each counted once across every kind."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensors: Iterable[Any]) -> None:
        import torch

        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            try:
                storage = tensor.untyped_storage()
                nbytes, pointer = storage.nbytes(), storage.data_ptr()
            except RuntimeError:  # a freed (resized-away) storage, e.g. FSDP2's unsharded param
                continue
            if nbytes == 0 or pointer in self._seen:
                continue
            self._seen.add(pointer)
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


def optimizer_state_tensors(optimizer: Any) -> list[Any]:
    return [
        value for state in optimizer.state.values() for value in state.values() if hasattr(value, "untyped_storage")
    ]


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage a Python-visible tensor holds (C++-only tensors are missed)."""
    import torch

    ledger = StorageLedger()
    with warnings.catch_warnings():  # isinstance() on deprecated torch.distributed aliases warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    ledger.add("all", tensors)
    return ledger.bytes.get("all", 0)


# --------------------------------------------------------------------------------------------
# The per-rank callback
# --------------------------------------------------------------------------------------------


def make_probe(
    *,
    warmup: int,
    tap: CollectiveTap,
    state_bytes: Callable[[Any], dict[str, int]],
    extra_step: Optional[Callable[[Any], dict[str, float]]] = None,
    at_end: Optional[Callable[[Any], dict[str, Any]]] = None,
    profile_path: Optional[Path] = None,
) -> Any:
    """A Lightning callback timing steps, counting sent bytes and (last step) model-state bytes.

    Steps run in this order: ``warmup`` untimed, the timed ones, with ``profile_path`` one
    untimed step under ``torch.profiler`` (its op table is written there), and the probe step.

    ``state_bytes(trainer)`` returns ``{"params", "grads", "optimizer"}`` bytes this rank holds;
    ``extra_step(trainer)`` adds per-step numbers (our engine's overlap timeline);
    ``at_end(trainer)`` runs at ``on_train_end``, while the strategy still holds its engine or
    wrapper, and its dict lands in the summary as ``end``.
    """
    from lightning.pytorch.callbacks import Callback

    class StepProbe(Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.sent: list[dict[str, float]] = []
            self.extra: list[dict[str, float]] = []
            self.states: dict[str, dict[str, int]] = {}
            self.live_bytes = 0
            self.end: dict[str, Any] = {}
            self._start = 0.0
            self._role = "warmup"
            self._profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step, last = trainer.global_step, trainer.max_steps - 1
            if step == last:
                self._role = "probe"
            elif profile_path is not None and step == last - 1:
                self._role = "profile"
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU])
                self._profiler.__enter__()
            else:
                self._role = "timed" if step >= warmup else "warmup"
            self._probing = self._role == "probe"
            tap.active = self._role == "timed"
            tap.bytes.clear()
            tap.calls.clear()
            self._start = time.perf_counter()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self._probing:
                self.states["after_forward"] = state_bytes(trainer)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self._probing:
                self.states["before_step"] = state_bytes(trainer)
                self.live_bytes = live_tensor_bytes()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            elapsed = time.perf_counter() - self._start
            if self._probing:
                self.states["after_step"] = state_bytes(trainer)
                return
            if self._role == "profile":
                self._profiler.__exit__(None, None, None)
                table = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                assert profile_path is not None
                profile_path.write_text(f"one step, {elapsed:.3f} s wall (profiled)\n{table}")
                return
            if self._role != "timed":
                return
            tap.active = False
            self.step_s.append(elapsed)
            self.sent.append(dict(tap.bytes))
            if extra_step is not None:
                self.extra.append(extra_step(trainer))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if at_end is not None:
                self.end = at_end(trainer)

        def summary(self) -> dict[str, Any]:
            kinds = ("params", "grads", "optimizer")
            peak = {kind: max((point.get(kind, 0) for point in self.states.values()), default=0) for kind in kinds}
            peak["total"] = max((sum(point.get(k, 0) for k in kinds) for point in self.states.values()), default=0)
            sent_kinds = sorted({kind for step in self.sent for kind in step})
            return {
                "step_s": self.step_s,
                "sent_bytes_per_step": {k: statistics.median(s.get(k, 0.0) for s in self.sent) for k in sent_kinds}
                if self.sent
                else {},
                "extra": self.extra,
                "state_points": self.states,
                "state_bytes": peak,
                "live_tensor_bytes_before_step": self.live_bytes,
                "end": self.end,
            }

    return StepProbe()


# --------------------------------------------------------------------------------------------
# Driver: run every case in fresh process pairs, merge, print
# --------------------------------------------------------------------------------------------


# command-line flag -> LlamaConfig field of the benchmark's model (defaults: BENCH_MODEL)
MODEL_FLAGS = {
    "dim": "dim",
    "layers": "n_layers",
    "heads": "n_heads",
    "kv-heads": "n_kv_heads",
    "ffn": "ffn_dim",
    "vocab": "vocab_size",
}


def add_common_args(parser: argparse.ArgumentParser, *, default_cases: list[str]) -> None:
    parser.add_argument("--cases", nargs="+", default=default_cases, help="cases to run, in order")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per case and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all cases (forward, reverse, ...)")
    from lightning_zero.planner.bench_model import BENCH_MODEL  # after the tap (bench_main)

    for flag, key in MODEL_FLAGS.items():
        parser.add_argument(f"--{flag}", type=int, default=BENCH_MODEL[key])
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank and step")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size for every strategy")
    parser.add_argument("--out", type=str, default=None, help="write the merged results as JSON here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one extra untimed step under torch.profiler per case (op table in --log-dir)",
    )
    parser.add_argument("--log-dir", type=str, default=None, help="keep each case's log and rank JSON here")
    parser.add_argument("--case-timeout", type=int, default=900, help="seconds one case may run")
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=str, default=None, help=argparse.SUPPRESS)


def model_config(args: argparse.Namespace) -> Any:
    """The benchmark's ``LlamaConfig`` at the shape the command line asks for."""
    from lightning_zero.planner.bench_model import bench_config

    shape = {key: getattr(args, flag.replace("-", "_")) for flag, key in MODEL_FLAGS.items()}
    return bench_config(**shape, max_seq_len=max(args.seq, 16))


def snapshot_sources(script: str, work_dir: Path) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Copy ``lightning_zero`` and ``benchmarks/`` into ``work_dir``; workers run from the copy.

    Other people commit to the same working tree while a benchmark runs (minutes); without the
    copy, later cases would import a different library than earlier ones. Returns the copied
    script, the environment that puts the copy first on ``sys.path``, and the git state.
    """
    import shutil

    import lightning_zero

    package_dir = Path(lightning_zero.__file__).resolve().parent
    bench_dir = Path(script).resolve().parent
    snapshot = work_dir / "snapshot"
    shutil.copytree(package_dir, snapshot / "lightning_zero", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(bench_dir, snapshot / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(snapshot), os.environ.get("PYTHONPATH")]))}
    return str(snapshot / "benchmarks" / Path(script).name), env, git_state(package_dir)


def git_state(path: Path) -> dict[str, Any]:
    def git(*command: str) -> str:
        try:
            return subprocess.run(
                ["git", *command], cwd=path, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_in_src": git("status", "--porcelain", "--", ".").splitlines(),
    }


def run_cases(script: str, args: argparse.Namespace, argv: list[str], work_dir: Path) -> dict[str, Any]:
    """Run every case ``args.rounds`` times (alternating order) from a snapshot of the sources.

    Returns ``{"results": case -> per-round rank results, "git": the library's git state}``.
    """
    results: dict[str, list[dict]] = {case: [] for case in args.cases}
    script, env, git = snapshot_sources(script, work_dir)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    for round_index in range(args.rounds):
        order = args.cases if round_index % 2 == 0 else list(reversed(args.cases))
        for case in order:
            case_dir = work_dir / f"round{round_index}"
            case_dir.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, script, *argv, "--worker", case, "--worker-dir", str(case_dir)]
            started = time.perf_counter()
            log_path = case_dir / f"{case}.log"
            with open(log_path, "w") as log:
                try:
                    proc = subprocess.run(
                        command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.case_timeout
                    )
                    returncode = proc.returncode
                except subprocess.TimeoutExpired:
                    returncode = -1
            wall = time.perf_counter() - started
            ranks = []
            for rank in (0, 1):
                path = case_dir / f"{case}.rank{rank}.json"
                if path.exists():
                    ranks.append(json.loads(path.read_text()))
            if returncode != 0 or len(ranks) < 2:
                tail = log_path.read_text()[-1500:]
                reason = "timed out" if returncode == -1 else f"exit code {returncode}"
                print(f"[{case}] round {round_index}: failed ({reason}); log tail:\n{tail}", flush=True)
                results[case].append({"error": f"{reason}: {_last_error_line(tail)}"})
                continue
            print(f"[{case}] round {round_index}: {wall:.0f} s", flush=True)
            results[case].append({"ranks": ranks})
    return {"results": results, "git": git}


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def summarize(case: str, rounds: list[dict]) -> dict[str, Any]:
    """Merge the rounds and ranks of one case into the row the table and JSON show."""
    good = [r["ranks"] for r in rounds if "ranks" in r]
    if not good:
        return {"case": case, "error": rounds[0].get("error", "no result") if rounds else "not run"}
    # A step takes as long as its slower rank; median over every timed step of every round.
    step_times = [max(times) for ranks in good for times in zip(*(rank["step_s"] for rank in ranks))]
    round_medians = [
        statistics.median(max(times) for times in zip(*(rank["step_s"] for rank in r["ranks"])))
        if "ranks" in r
        else None
        for r in rounds
    ]
    first = good[-1]
    row: dict[str, Any] = {
        "case": case,
        "label": first[0]["label"],
        "step_s_median": statistics.median(step_times) if step_times else float("nan"),
        "step_s_round_medians": round_medians,
        "step_s_all": step_times,
        "peak_rss_bytes": [max(ranks[r]["peak_rss_bytes"] for ranks in good) for r in range(2)],
        "rss_before_fit_bytes": [ranks_r["rss_before_fit_bytes"] for ranks_r in first],
        "state_bytes": [rank["state_bytes"] for rank in first],
        "state_points": [rank["state_points"] for rank in first],
        "predicted_state_bytes": first[0].get("predicted_state_bytes"),
        "sent_bytes_per_step": [rank["sent_bytes_per_step"] for rank in first],
        "sent_source": first[0].get("sent_source", "wrapped torch.distributed collectives"),
        "engine_sent_bytes_per_step": first[0].get("engine_sent_bytes_per_step"),
        "predicted_sent_bytes_per_step": first[0].get("predicted_sent_bytes_per_step"),
        "live_tensor_bytes_before_step": [rank["live_tensor_bytes_before_step"] for rank in first],
        "num_params": first[0]["num_params"],
        "notes": first[0].get("notes", ""),
        "extra": overlap_summary([e for ranks in good for e in ranks[0]["extra"] if "comm_s" in e]),
        "engine_sent_calls_per_step": first[0].get("engine_sent_calls_per_step"),
        "failed_rounds": len(rounds) - len(good),
    }
    # Per-step end-of-backward wait (bench_zero12's timer): a step waits for its slower rank.
    tails = [
        max(steps)
        for ranks in good
        for steps in zip(*([e.get("backward_tail_s") for e in rank["extra"]] for rank in ranks))
        if all(t is not None for t in steps)
    ]
    if tails:
        row["backward_tail_s_median"] = statistics.median(tails)
    return row


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def step_ratio(row: dict, base: dict) -> float:
    """Median over rounds of (this case's median step time / the baseline's) in the same round.

    The load of a shared machine drifts over minutes; a ratio within one round compares cases
    that ran a minute apart, and the median over rounds drops the round a burst of load hit.
    """
    ratios = [
        mine / theirs
        for mine, theirs in zip(row["step_s_round_medians"], base["step_s_round_medians"])
        if mine is not None and theirs is not None
    ]
    return statistics.median(ratios) if ratios else float("nan")


def format_table(rows: list[dict], baseline: str) -> str:
    """The side-by-side table: one row per case; step-time ratios to ``baseline`` by :func:`step_ratio`."""
    base = next((r for r in rows if r["case"] == baseline and "error" not in r), None)
    header = (
        f"{'case':<18}{'step s':>8}{'x ' + baseline:>9}{'peak RSS MiB r0/r1':>20}"
        f"{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}{'formula':>9}{'sent MiB/step':>15}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['case']:<18}  did not run: {row['error']}")
            continue
        state = row["state_bytes"][0]
        ratio = step_ratio(row, base) if base else float("nan")
        rss = "/".join(f"{b / MIB:,.0f}" for b in row["peak_rss_bytes"])
        predicted = row.get("predicted_state_bytes")
        sent = sum(row["sent_bytes_per_step"][0].values())
        lines.append(
            f"{row['case']:<18}{row['step_s_median']:>8.3f}{ratio:>9.2f}{rss:>20}"
            f"{_mb(state.get('params')):>9}{_mb(state.get('grads')):>9}{_mb(state.get('optimizer')):>9}"
            f"{_mb(state.get('total')):>9}{_mb(predicted['total'] if predicted else None):>9}{sent / MIB:>15,.1f}"
        )
    return "\n".join(lines)


def machine_note() -> dict[str, Any]:
    import platform

    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "loadavg_at_end": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


# --------------------------------------------------------------------------------------------
# The worker (one case on this rank) and the driver, shared by every bench_*.py
# --------------------------------------------------------------------------------------------

FP32 = dict(param_bytes=4, grad_bytes=4, optim_bytes_per_param=8)  # AdamW in fp32: 4 + 4 + 8


def run_worker(
    args: argparse.Namespace,
    *,
    label: str,
    stage: int,
    make_strategy: Callable[[], Any],
    state_bytes: Callable[[Any], dict[str, int]],
    make_module: Optional[Callable[[Any], Any]] = None,
    extra_step: Optional[Callable[[Any], dict[str, float]]] = None,
    at_end: Optional[Callable[[Any, int], dict[str, Any]]] = None,
) -> None:
    """Train one case on this rank (Lightning starts the other) and write ``<case>.rank<r>.json``.

    ``stage`` picks the ZeRO formula the strategy's model states are compared with;
    ``make_module(config)`` builds the LightningModule (default :class:`LlamaLM`);
    ``at_end(trainer, max_steps)`` adds what only the live strategy can tell.
    """
    tap = collective_tap()  # installed by bench_main before lightning_zero bound its collectives
    core = pin_rank_to_core()

    from lightning_zero.ledger import model_state_bytes
    from lightning_zero.planner.bench_model import bench_datamodule, bench_module, bench_trainer, seed_bench
    from lightning_zero.ring import ring_sent

    config = model_config(args)
    num_params = config.num_params()
    max_steps = args.warmup + args.steps + int(args.profile) + 1  # + the untimed probe step
    strategy = make_strategy()
    seed_bench()
    module = make_module(config) if make_module is not None else bench_module(config)
    data = bench_datamodule(config, seq_len=args.seq, batch_size=args.batch, max_steps=max_steps)
    probe = make_probe(
        warmup=args.warmup,
        tap=tap,
        state_bytes=state_bytes,
        extra_step=extra_step,
        at_end=(lambda trainer: at_end(trainer, max_steps)) if at_end is not None else None,
        profile_path=Path(args.worker_dir) / f"{args.worker}.rank{os.environ.get('LOCAL_RANK', '0')}.profile.txt"
        if args.profile
        else None,
    )
    rss_before = rss_bytes()
    trainer = bench_trainer(devices=2, max_steps=max_steps, callbacks=[probe], strategy=strategy)
    trainer.fit(module, datamodule=data)

    dp = trainer.world_size
    result: dict[str, Any] = {
        "case": args.worker,
        "label": label,
        "rank": trainer.global_rank,
        "core": core,
        "num_params": num_params,
        "rss_before_fit_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "predicted_state_bytes": model_state_bytes(num_params, stage=stage, dp=dp, **FP32).as_dict(),
        # stages 0-2 send an all-reduce's worth of gradient bytes per step (2 (dp-1)/dp * 4 B * P),
        # stage 3 an all-gather more (3 (dp-1)/dp): the ZeRO paper's figures
        "predicted_sent_bytes_per_step": ring_sent("all_reduce", 4 * num_params, dp)
        + (ring_sent("all_gather", 4 * num_params, dp) if stage == 3 else 0.0),
        **probe.summary(),
    }
    result.update(result.pop("end"))
    out = Path(args.worker_dir) / f"{args.worker}.rank{trainer.global_rank}.json"
    out.write_text(json.dumps(result, indent=1, default=float))


def describe_model(args: argparse.Namespace) -> str:
    config = model_config(args)
    return (
        f"tiny Llama: {config.num_params() / 1e6:.1f}M params (dim {config.dim}, {config.n_layers} layers,"
        f" vocab {config.vocab_size}, ffn {config.ffn_dim}); 2 ranks x batch {args.batch} x seq {args.seq};"
        f" fp32, AdamW; {args.warmup} warmup + {args.steps} timed steps x {args.rounds} round(s)"
    )


def drive(
    name: str,
    script: str,
    args: argparse.Namespace,
    argv: list[str],
    *,
    known_cases: Iterable[str],
    baseline: str,
    report: Callable[[list[dict]], list[str]],
) -> list[dict]:
    """Run every case, print the side-by-side table and ``report(rows)``'s lines, write ``--out``."""
    import tempfile

    unknown = [case for case in args.cases if case not in set(known_cases)]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(known_cases)}")
    print(describe_model(args), flush=True)
    if args.log_dir:
        run = run_cases(script, args, argv, Path(args.log_dir))
    else:
        with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as tmp:
            run = run_cases(script, args, argv, Path(tmp))
    rows = [summarize(case, run["results"][case]) for case in args.cases]
    lines = [format_table(rows, baseline=baseline), ""] + report(rows)
    print("\n" + "\n".join(lines))
    if args.out:
        payload = {
            "benchmark": name,
            "model": describe_model(args),
            "machine": machine_note(),
            "git": run["git"],
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_dir")},
            "rows": rows,
            "report": lines,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1, default=float))
        print(f"wrote {args.out}")
    return rows


def overlap_summary(extra: list[dict[str, float]]) -> dict[str, float]:
    """Medians of our engine's per-step gradient collective time and its exposed part."""
    comm = statistics.median(e["comm_s"] for e in extra) if extra else 0.0
    exposed = statistics.median(e["exposed_wait_s"] for e in extra) if extra else 0.0
    return {
        "comm_s_median": comm,
        "exposed_wait_s_median": exposed,
        "overlap_fraction": (1 - exposed / comm) if comm > 0 else 0.0,
    }


def comm_table(rows: list[dict]) -> str:
    """Our cases: bytes sent per step by the engine's counter, by the tap, by the formula; overlap."""
    header = (
        f"{'case':<18}{'engine MiB/step':>16}{'tapped MiB/step':>16}{'formula':>10}"
        f"{'comm s':>9}{'exposed s':>10}{'hidden':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row or row.get("engine_sent_bytes_per_step") is None:
            continue
        extra = row["extra"]
        tapped = sum(row["sent_bytes_per_step"][0].values())
        lines.append(
            f"{row['case']:<18}{row['engine_sent_bytes_per_step'] / MIB:>16,.2f}{tapped / MIB:>16,.2f}"
            f"{row['predicted_sent_bytes_per_step'] / MIB:>10,.2f}{extra.get('comm_s_median', 0):>9.3f}"
            f"{extra.get('exposed_wait_s_median', 0):>10.3f}{extra.get('overlap_fraction', 0):>8.0%}"
        )
    return "\n".join(lines)


def state_vs_formula(row: dict) -> str:
    """``<case>: model-state bytes N vs formula M (+x%)`` for rank 0 of ``row``."""
    got, want = row["state_bytes"][0]["total"], row["predicted_state_bytes"]["total"]
    return f"{row['case']}: model-state bytes {got:,} vs formula {want:,.0f} ({got / want - 1:+.2%})"


def bench_main(
    description: str,
    cases: Iterable[str],
    worker: Callable,
    driver: Callable,
    extra_args: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> None:
    """Parse the common arguments (plus ``extra_args(parser)``'s) and run the worker or the driver."""
    argv = list(sys.argv[1:])
    if "--worker" in argv:
        collective_tap()  # first: lightning_zero binds torch.distributed's collectives at import
    parser = argparse.ArgumentParser(description=description)
    add_common_args(parser, default_cases=list(cases))
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args, argv)
