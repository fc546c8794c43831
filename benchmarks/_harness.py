"""What every side-by-side benchmark shares: the driver and the worker (probes: ``_probes.py``;
rows and tables: ``_stats.py``).

[Note: benchmark shape] One command (the *driver*) runs every case of a benchmark, each case in
its own pair of fresh processes: the driver starts ``python <script> --worker CASE ...`` twice at
once, as torchrun starts ranks 0 and 1 (``run_pair``; Lightning's own launcher would start rank 1
only when rank 0 reached ``fit``, and the pair would import Lightning one after the other). A fresh pair per case is what
makes *peak RSS* mean something: ``ru_maxrss`` is a high-water mark over a process's life, and
freed tensors stay in the allocator's arenas, so cases sharing a process would inherit each
other's peaks. To keep time ratios fair on a shared machine, cases run in ``--rounds`` rounds,
alternating forward and reverse order; a case's step time is the median over all its measured
steps in every round, and its ratio to the baseline case is the median over rounds of the ratio
of the two cases' medians within that round (``_stats.step_ratio``).

Each rank runs the probes of ``_probes.py`` ([Note: benchmark probes]) and writes
``<case>.rank<r>.json``, which the driver merges into the table (``_stats.py``) and ``--out`` JSON.
A case that fails shows as "did not run" there, and the driver then exits 1 naming it.

The driver copies ``lightning_zero`` and ``benchmarks/`` first and runs every worker from the
copy: other people commit to the same tree while a run takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from _probes import collective_tap, make_probe, peak_rss_bytes, pin_rank_to_core, rss_bytes
from _stats import format_table, machine_note, summarize

# --------------------------------------------------------------------------------------------
# Driver: run every case in fresh process pairs, merge, print
# --------------------------------------------------------------------------------------------


BASE = "@base"  # suffix of a case run from --baseline-src's checkout
FAILED_RUNS: list[str] = []  # "case round N: reason" for every worker pair that failed (exit_if_any_failed)

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
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="the output head is the embedding (one Parameter)"
    )
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
    parser.add_argument(
        "--baseline-src",
        type=str,
        default=None,
        help="another checkout (its root or src/): every case also runs from its lightning_zero as"
        " '<case>@base', in the same rounds (before/after a change, ratios of the same round)",
    )
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=str, default=None, help=argparse.SUPPRESS)


def model_config(args: argparse.Namespace) -> Any:
    """The benchmark's ``LlamaConfig`` at the shape the command line asks for."""
    from lightning_zero.planner.bench_model import bench_config

    shape = {key: getattr(args, flag.replace("-", "_")) for flag, key in MODEL_FLAGS.items()}
    return bench_config(**shape, max_seq_len=max(args.seq, 16), tie_embeddings=bool(args.tie_embeddings))


def snapshot_sources(
    script: str, work_dir: Path, package_dir: Optional[Path] = None, name: str = "snapshot"
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Copy ``lightning_zero`` and ``benchmarks/`` into ``work_dir``; workers run from the copy.

    Other people commit to the same working tree while a benchmark runs (minutes); without the
    copy, later cases would import a different library than earlier ones. Returns the copied
    script, the environment that puts the copy first on ``sys.path``, and the git state.
    """
    import shutil

    if package_dir is None:
        import lightning_zero

        package_dir = Path(lightning_zero.__file__).resolve().parent
    bench_dir = Path(script).resolve().parent
    snapshot = work_dir / name
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
    cases = list(args.cases)
    argv = _without_option(argv, "--baseline-src")  # a worker is one case from one checkout
    sources = {"": snapshot_sources(script, work_dir)}
    if getattr(args, "baseline_src", None):
        root = Path(args.baseline_src).resolve()
        package = next(p for p in (root / "src" / "lightning_zero", root / "lightning_zero") if p.is_dir())
        # its own benchmark scripts too: a worker is the whole "before", library and harness
        base_script = root / "benchmarks" / Path(script).name
        sources[BASE] = snapshot_sources(str(base_script), work_dir, package, "snapshot_base")
        cases = [name for case in args.cases for name in (case, case + BASE)]
    results: dict[str, list[dict]] = {case: [] for case in cases}
    git = sources[""][2]
    for _, env, _ in sources.values():
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    for round_index in range(args.rounds):
        order = cases if round_index % 2 == 0 else list(reversed(cases))
        for case in order:
            worker_case, source = case.removesuffix(BASE), BASE if case.endswith(BASE) else ""
            script, env, _ = sources[source]
            case_dir = work_dir / f"round{round_index}" / (source.strip("@") or ".")
            case_dir.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, script, *argv, "--worker", worker_case, "--worker-dir", str(case_dir)]
            started = time.perf_counter()
            log_path = case_dir / f"{worker_case}.log"  # rank 0's; rank 1's is <case>.rank1.log
            returncode = run_pair(command, env, [log_path, case_dir / f"{worker_case}.rank1.log"], args.case_timeout)
            wall = time.perf_counter() - started
            ranks = []
            for rank in (0, 1):
                path = case_dir / f"{worker_case}.rank{rank}.json"
                if path.exists():
                    ranks.append(json.loads(path.read_text()))
            if returncode != 0 or len(ranks) < 2:
                tail = log_path.read_text()[-1500:]
                if (case_dir / f"{worker_case}.rank1.log").exists():
                    tail += "\n--- rank 1 ---\n" + (case_dir / f"{worker_case}.rank1.log").read_text()[-1500:]
                reason = "timed out" if returncode == -1 else f"exit code {returncode}"
                print(f"[{case}] round {round_index}: failed ({reason}); log tail:\n{tail}", flush=True)
                results[case].append({"error": f"{reason}: {_last_error_line(tail)}"})
                FAILED_RUNS.append(f"{case} round {round_index}: {reason} (log: {log_path})")
                continue
            print(f"[{case}] round {round_index}: {wall:.0f} s", flush=True)
            results[case].append({"ranks": ranks})
    if BASE in sources:
        git = {**git, "baseline": sources[BASE][2]}
    return {"results": results, "git": git}


PEER_GRACE_S = 60.0  # after one rank failed, how long the other may take to fail too


def run_pair_json_from_src(script: Path, argv: list[str], timeout_s: float, **extra_env: str) -> Optional[list[dict]]:
    """:func:`run_pair_json` with this checkout's ``src`` first on ``PYTHONPATH`` (the benchmark
    measures the tree it sits in, whatever is installed) and ``extra_env`` set."""
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env}
    return run_pair_json(script, argv, env, timeout_s)


def run_pair_json(script: Path, argv: list[str], env: dict, timeout_s: float) -> Optional[list[dict]]:
    """Run ``script --worker-dir DIR`` as a pair (:func:`run_pair`) in a fresh directory and return
    each rank's ``rank{N}.json``; on a failed pair print both logs' tails and return ``None``."""
    import tempfile

    with tempfile.TemporaryDirectory() as work_dir:
        logs = [Path(work_dir) / f"rank{rank}.log" for rank in (0, 1)]
        command = [sys.executable, str(script), *argv, "--worker-dir", work_dir]
        code = run_pair(command, env, logs, timeout_s)
        if code != 0:
            for log in logs:
                print(f"--- {log.name} ---\n{log.read_text()[-3000:]}", file=sys.stderr)
            print(f"{script.name}: the pair failed (exit {code})", file=sys.stderr)
            return None
        return [json.loads((Path(work_dir) / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def run_pair(command: list[str], env: dict, logs: list[Path], timeout_s: float) -> int:
    """Start both ranks of ``command`` at once, as torchrun starts them (Lightning then starts no
    process of its own), each in its own session with its own log; return 0 if both exited 0, the
    first non-zero exit code otherwise, -1 if the pair ran past ``timeout_s``. A rank still alive
    ``PEER_GRACE_S`` after its peer failed is killed (an incumbent strategy may wait out a
    30-minute process-group timeout), and so is every rank at the timeout."""
    from lightning_zero.ports import free_port  # the driver's package, not a baseline's

    port = str(free_port())
    procs = []
    for rank, log_path in enumerate(logs):
        rank_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                    "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(logs)), "NODE_RANK": "0"}  # fmt: skip
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=rank_env, start_new_session=True))  # fmt: skip
    deadline, failed_at, code = time.monotonic() + timeout_s, None, 0
    try:
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            for proc in procs:
                if proc.returncode not in (None, 0) and code == 0:
                    code, failed_at = proc.returncode, now
            if now > deadline or (failed_at is not None and now - failed_at > PEER_GRACE_S):
                return -1 if now > deadline else code
            time.sleep(0.1)
        return next((proc.returncode for proc in procs if proc.returncode != 0), code)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def exit_if_any_failed() -> None:
    """Exit 1, naming them, if any worker pair failed: the tables and ``--out`` JSON are written
    first (a failed case shows as "did not run"), but a script that lost a case must not look like
    a clean run to whoever chains it (a CI step, a sweep, ``&&``)."""
    if FAILED_RUNS:
        print(
            f"\n{len(FAILED_RUNS)} case run(s) failed:",
            *(f"  {line}" for line in FAILED_RUNS),
            sep="\n",
            file=sys.stderr,
        )
        sys.exit(1)


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE``."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            out.append(item)
    return out


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


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
    measure_activations: bool = False,
    callbacks: Sequence[Any] = (),
    result_extra: Optional[Callable[[], dict[str, Any]]] = None,
) -> None:
    """Train one case on this rank (Lightning starts the other) and write ``<case>.rank<r>.json``.

    ``stage`` picks the ZeRO formula the strategy's model states are compared with;
    ``make_module(config)`` builds the LightningModule (default :class:`LlamaLM`);
    ``at_end(trainer, max_steps)`` adds what only the live strategy can tell;
    ``measure_activations``: the probe step counts the activation bytes kept for backward;
    ``callbacks`` run after the probe, and ``result_extra()``'s dict is merged into the rank's
    JSON after fit.
    """
    tap = collective_tap()  # installed by bench_main before lightning_zero bound its collectives
    core = pin_rank_to_core()

    from lightning_zero.comm.ring import ring_sent
    from lightning_zero.ledger import model_state_bytes
    from lightning_zero.planner.bench_model import bench_datamodule, bench_module, bench_trainer, seed_bench

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
        measure_activations=measure_activations,
    )
    rss_before = rss_bytes()
    trainer = bench_trainer(devices=2, max_steps=max_steps, callbacks=[probe, *callbacks], strategy=strategy)
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
    if result_extra is not None:
        result.update(result_extra())
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
    rows = [summarize(case, run["results"][case]) for case in run["results"]]
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
        exit_if_any_failed()
