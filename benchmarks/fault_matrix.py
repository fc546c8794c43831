"""The fault matrix (issue 56): every event at every moment, per strategy and door, on 2 CPU ranks.

    python benchmarks/fault_matrix.py --out /tmp/fm --trials 3 [--strategies ddp,zero1,zero2,zero3]
        [--doors trainer,fabric] [--events usr1,term,exc,kill] [--json fault_matrix.json]

Each trial is a set of launches of ``tests/scripts/fault_run.py`` as srun starts a job step (SLURM
variables, auto-requeue on SIGUSR1, a fake ``scontrol`` that logs each requeue): one launch runs
every signal cell of a (door, strategy) in a row (a caught ``SystemExit`` lets the next cell run;
the last cell's exit is the process's), each exception or SIGKILL cell is a launch of its own,
and one more launch per (door, strategy) resumes every ``fit`` cell from what it left and runs
the uninterrupted baseline. Per cell it reports: the exit code of each rank (``exit``: a cell
inside a launch reports the code the process would exit with; the last cell of a launch, and
every exception and SIGKILL cell, the process's own), whether a launch hung (killed after
``--hang-s``), the seconds from the event to the last rank's exit, the requeues ``scontrol``
logged, and the resume diff (max |loss - uninterrupted loss| over the resumed steps, both ranks).

The documented outcome of each event (docs/checkpoints.md, "The fault matrix"): SIGUSR1 inside
``fit``: one requeue and training goes on (exit 0); outside ``fit``: one requeue, exit 138; SIGTERM:
exit 143; an exception on one rank: exit 1 on every rank; SIGKILL of one rank: -9 there, non-zero
on the others. :func:`expected` holds it, :func:`verdict` checks a cell against it.

Cells are built by :func:`cells_for` from ``fault_run.py``'s ``EVENTS`` and ``MOMENTS``; a new
kind of cell (rt-ckpt's disk-full, slow-writer, kill-during-publish, async saves) is a new event
or moment there, and a line in :func:`expected`.
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
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_run.py"
HANG_S = 150.0
RANKS = 2
FIT_MOMENTS = ("accum", "val", "fitpredict")
EVAL_MOMENTS = ("validate", "test", "predict")
FABRIC_MOMENTS = ("accum",)  # a Fabric loop has no validate/test/predict entry points of its own

SCONTROL = '#!/bin/sh\necho "$@" >> "$LZ_SCONTROL_LOG"\n'


def expected(event: str, moment: str) -> dict[str, Any]:
    """The documented outcome of ``event`` at ``moment``: exit codes per rank (``None``: any
    non-zero), requeues, and whether the run resumes exactly."""
    fit = moment in FIT_MOMENTS
    if event == "usr1":
        code = 0 if moment in ("accum", "val") else 138
        return {"exit": [code] * RANKS, "requeues": 1, "resume": moment in ("accum", "val")}
    if event == "term":
        return {"exit": [143] * RANKS, "requeues": 0, "resume": moment in ("accum", "val")}
    if event == "exc":
        return {"exit": [1] * RANKS, "requeues": 0, "resume": fit and moment != "fitpredict"}
    if event == "kill":
        return {"exit": [None, -signal.SIGKILL], "requeues": 0, "resume": fit and moment != "fitpredict"}
    return {"exit": [0] * RANKS, "requeues": 0, "resume": False}


def cells_for(door: str, strategy: str, events: list[str], only: Optional[list[str]] = None) -> list[str]:
    moments = FABRIC_MOMENTS if door == "fabric" else (*FIT_MOMENTS, *EVAL_MOMENTS)
    moments = [moment for moment in moments if only is None or moment in only]
    return [f"{door[0]}_{strategy}_{event}_{moment}={door}:{strategy}:{event}@{moment}"
            for event in events for moment in moments]  # fmt: skip


def _name(cell: str) -> str:
    return cell.partition("=")[0]


def _what(cell: str) -> tuple[str, str, str, str]:
    door, strategy, what = cell.partition("=")[2].split(":")
    event, _, moment = what.partition("@")
    return door, strategy, event, moment


def _env(out: Path, rank: int, port: int, job: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"):
        env.pop(key, None)
    env.update(
        PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'src'}", OMP_NUM_THREADS="1",
        SLURM_NTASKS=str(RANKS), SLURM_NTASKS_PER_NODE=str(RANKS), SLURM_NNODES="1", SLURM_NODEID="0",
        SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID=str(job), SLURM_JOB_NAME="fault_run",
        SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        LZ_SCONTROL_LOG=str(out / f"scontrol.{job}.log"), PATH=f"{out / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )  # fmt: skip
    return env


def _free_port() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from lightning_zero.ports import free_port

    return free_port()


class Launch:
    """One job step: RANKS ranks of fault_run.py running ``cells`` in ``out``."""

    def __init__(self, out: Path, mode: str, cells: list[str], job: int, start: Optional[Callable] = None) -> None:
        self.out, self.mode, self.cells, self.job = out, mode, cells, job
        port = _free_port()
        argv = [sys.executable, str(SCRIPT), str(out), mode, *cells]
        self.procs = []
        for rank in range(RANKS):
            log = out / f"{mode}.{job}.rank{rank}.log"
            if start is not None:
                self.procs.append(start(argv, cwd=out, env=_env(out, rank, port, job), log_path=log))
            else:
                with open(log, "wb") as handle:
                    self.procs.append(subprocess.Popen(argv, cwd=out, env=_env(out, rank, port, job), stdout=handle,
                                                       stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        self.started = time.monotonic()
        self.ends: list[Optional[tuple[Optional[int], float]]] = [None] * RANKS
        self.hung = False

    def poll(self, hang_s: float) -> bool:
        for rank, proc in enumerate(self.procs):
            if self.ends[rank] is None and proc.poll() is not None:
                self.ends[rank] = (proc.returncode, time.time())
        if time.monotonic() - self.started > hang_s and not all(self.ends):
            self.hung = True
            for rank, proc in enumerate(self.procs):
                if self.ends[rank] is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self.ends[rank] = (None, time.time())
        return all(end is not None for end in self.ends)

    def results(self) -> list[dict]:
        found = []
        for rank in range(RANKS):
            path = self.out / f"{self.mode}.{self.job}.rank{rank}.json"
            found.append(json.loads(path.read_text()) if path.exists() else {})
        return found

    def requeues(self) -> int:
        log = self.out / f"scontrol.{self.job}.log"
        return len(log.read_text().splitlines()) if log.exists() else 0


def run_launches(starts: list[Callable[[], Launch]], hang_s: float = HANG_S, concurrent: int = 2) -> None:
    waiting, running = list(starts), []
    while waiting or running:
        while waiting and len(running) < concurrent:
            running.append(waiting.pop(0)())
        time.sleep(0.05)
        running = [launch for launch in running if not launch.poll(hang_s)]


def plan(
    doors: list[str], strategies: list[str], events: list[str], moments: Optional[list[str]] = None
) -> list[list[str]]:
    """The launches of one trial: per (door, strategy), the signal cells in one launch (SIGTERM
    cells last, so the process's own exit is a SIGTERM's), then one launch per exception or
    SIGKILL cell."""
    launches = []
    for door in doors:
        for strategy in strategies:
            if door == "fabric" and strategy == "ddp":
                continue
            signals = cells_for(door, strategy, [e for e in events if e in ("usr1", "term")], moments)
            if signals:
                launches.append(signals)
            launches += [[c] for c in cells_for(door, strategy, [e for e in events if e in ("exc", "kill")], moments)]
    return launches


def run_trial(out: Path, first: list[list[str]], *, job: int, start: Optional[Callable] = None,
              hang_s: float = HANG_S) -> dict[str, dict]:  # fmt: skip
    """One trial of the matrix in ``out``: the launches ``first`` (:func:`plan`), then the resumes;
    returns ``{cell name: its outcome}``. ``start``: how to start a process (the tests' fork server)."""
    (out / "bin").mkdir(parents=True, exist_ok=True)
    scontrol = out / "bin" / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(0o755)
    launches: dict[int, Launch] = {}

    def later(index: int, mode: str, cells: list[str]) -> Callable[[], Launch]:
        def begin() -> Launch:
            launches[index] = Launch(out, mode, cells, job + index, start)
            return launches[index]

        return begin

    run_launches([later(i, "fault", cells) for i, cells in enumerate(first)], hang_s)
    # the resumes, one launch per door: the uninterrupted run of each strategy, then every fit cell
    resumes: dict[str, list[str]] = {}
    for cells in first:
        for cell in cells:
            door, strategy, event, moment = _what(cell)
            if expected(event, moment)["resume"]:
                base = f"{door[0]}_{strategy}_base={door}:{strategy}:none"
                resumes.setdefault(door, [])
                if base not in resumes[door]:
                    resumes[door].insert(0, base)
                resumes[door].append(cell)
    second = list(resumes.values())
    run_launches([later(100 + i, "resume", cells) for i, cells in enumerate(second)], hang_s)
    outcomes: dict[str, dict] = {}
    for index, cells in enumerate(first):
        launch = launches[index]
        results = launch.results()
        for position, cell in enumerate(cells):
            outcomes[_name(cell)] = _outcome(cell, launch, results, last=position == len(cells) - 1)
    for index, cells in enumerate(second):
        results = launches[100 + index].results()
        for cell in cells:
            door, strategy, event, _ = _what(cell)
            if event == "none":
                continue
            base, diffs = f"{door[0]}_{strategy}_base", []
            mine = [results[rank].get(_name(cell), {}) for rank in range(RANKS)]
            for rank in range(RANKS):
                losses, reference = mine[rank].get("losses", {}), results[rank].get(base, {}).get("losses", {})
                if not losses or not reference or any(step not in reference for step in losses):
                    diffs.append(float("inf"))
                    continue
                diffs.append(max(abs(losses[step] - reference[step]) for step in losses))
            outcomes[_name(cell)].update(
                base_comm=results[0].get(base, {}).get("comm"),
                resume_diff=max(diffs), resumed_from=mine[0].get("resumed_from"),
                resumed_steps=sorted(mine[0].get("losses", {}), key=int),
            )  # fmt: skip
    return outcomes


def _code(result: dict) -> int:
    exit_ = result.get("exit")
    if exit_ is None:
        return 0
    return exit_ if isinstance(exit_, int) else 1


def _outcome(cell: str, launch: Launch, results: list[dict], *, last: bool) -> dict:
    door, strategy, event, moment = _what(cell)
    name = _name(cell)
    per_rank = [result.get(name) for result in results]
    codes: list[Optional[int]] = []
    ends: list[float] = []
    for rank, result in enumerate(per_rank):
        end = launch.ends[rank]
        if last or result is None:  # the process's own exit
            codes.append(None if end is None or end[0] is None else end[0])
            ends.append(end[1] if end is not None else float("nan"))
        else:
            codes.append(_code(result))
            ends.append(result["ended"])
    sent = next((r["sent"] for r in per_rank if r and r.get("sent")), None)
    if sent is None:  # a SIGKILLed rank wrote nothing: its end is the event
        sent = launch.ends[1][1] if event == "kill" and launch.ends[1] else None
    errors = [r.get("error") for r in per_rank if r and r.get("error")]
    return {
        "door": door, "strategy": strategy, "event": event, "moment": moment, "exit": codes,
        "hung": launch.hung and (last or any(r is None for r in per_rank)),
        "seconds_to_exit": (max(ends) - sent) if sent is not None else None,
        "requeues": per_rank[0].get("requeues") if per_rank[0] else None, "agreed": [r.get("agreed") if r else None for r in per_rank],
        "error": errors[0][:300] if errors else None, "resume_diff": None,
        "comm": per_rank[0].get("comm") if per_rank[0] else None,
        "logged": per_rank[0].get("logged") if per_rank[0] else None,
    }  # fmt: skip


def verdict(outcome: dict) -> list[str]:
    """What in ``outcome`` differs from :func:`expected` (an empty list: as documented)."""
    want = expected(outcome["event"], outcome["moment"])
    problems = []
    if outcome["hung"]:
        problems.append("hung")
    for rank, (got, code) in enumerate(zip(outcome["exit"], want["exit"])):
        if (code is None and not got) or (code is not None and got != code):
            problems.append(f"rank {rank} exit {got} (documented: {'non-zero' if code is None else code})")
    if outcome["requeues"] is not None and outcome["requeues"] != want["requeues"]:
        problems.append(f"{outcome['requeues']} requeues (documented: {want['requeues']})")
    if want["resume"] and not (outcome.get("resume_diff") is not None and outcome["resume_diff"] <= 1e-5):
        problems.append(f"resume diff {outcome.get('resume_diff')}")
    return problems


def table(trials: list[dict[str, dict]]) -> str:
    """The matrix as Markdown: one row per cell, over every trial."""
    rows = ["| door | strategy | event | moment | trials | hangs | exit codes | s to exit (max) | requeues | resume diff (max) | as documented |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name in trials[0]:
        runs = [trial[name] for trial in trials if name in trial]
        first = runs[0]
        codes = sorted({"/".join(str(c) for c in run["exit"]) for run in runs})
        seconds = [run["seconds_to_exit"] for run in runs if run["seconds_to_exit"] is not None]
        diffs = [run["resume_diff"] for run in runs if run.get("resume_diff") is not None]
        ok = sum(not verdict(run) for run in runs)
        worst = f"{max(seconds):.1f}" if seconds else "-"
        requeues = sorted({str(run["requeues"]) for run in runs})
        rows.append(
            f"| {first['door']} | {first['strategy']} | {first['event']} | {first['moment']} | {len(runs)} |"
            f" {sum(run['hung'] for run in runs)} | {', '.join(codes)} | {worst} | {', '.join(requeues)} |"
        )
        rows[-1] += f" {max(diffs):.1e} |" if diffs else " - |"
        rows[-1] += f" {ok}/{len(runs)} |"
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3")
    parser.add_argument("--doors", default="trainer,fabric")
    parser.add_argument("--events", default="usr1,term,exc,kill")
    parser.add_argument("--moments", default=None, help="a subset of the moments (default: every one)")
    parser.add_argument("--hang-s", type=float, default=HANG_S)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trials = []
    for trial in range(args.trials):
        out = args.out / f"trial{trial}"
        out.mkdir(parents=True, exist_ok=True)
        started = time.time()
        moments = args.moments.split(",") if args.moments else None
        launches = plan(args.doors.split(","), args.strategies.split(","), args.events.split(","), moments)
        trials.append(run_trial(out, launches, job=1000 * (trial + 1), hang_s=args.hang_s))
        print(f"trial {trial}: {time.time() - started:.0f} s", flush=True)
    print(table(trials))
    if args.json is not None:
        args.json.write_text(json.dumps({"trials": trials}, indent=1))


if __name__ == "__main__":
    main()
