"""The fault matrix (issue 56): every event at every moment, per strategy and door, on 2 CPU ranks.

    python benchmarks/fault_matrix.py --out /tmp/fm --trials 3 [--strategies ddp,zero1,zero2,zero3]
        [--doors trainer,fabric] [--events usr1,term,exc,kill,diskfull,slow,publishkill]
        [--moments accum,val,syncsave,asyncsave,fitpredict,validate,test,predict] [--json fault_matrix.json]
    python benchmarks/fault_matrix.py --from-json fault_matrix.json   (the tables again, from a run)

Each trial is a set of launches of ``tests/scripts/fault_run.py`` as srun starts a job step (SLURM
variables, auto-requeue on SIGUSR1, a fake ``scontrol`` that logs each requeue), ranks forked
from the tests' fork server: one launch runs the cells of a (door, strategy) that end alike on
every rank (SIGUSR1, a slow writer, SIGTERM last) in a row (a caught ``SystemExit`` lets the next
cell run; the last cell's exit is the process's), every other cell is a launch of its own, and
one more launch per (door, strategy) resumes every ``fit`` cell from what it left and runs the
uninterrupted baseline. Per cell it reports: the exit code of each rank (``exit``: a cell inside
a launch reports the code the process would exit with; the last cell of a launch, the process's
own), whether a launch hung (no cell ended for ``--hang-s``: killed), the seconds from the event
to the last rank's exit, the requeues ``scontrol`` logged, the error, what the fault left (links
that dangle, hidden names, complete checkpoints) and the resume diff (max |loss - uninterrupted
loss| over the resumed steps, both ranks).

The documented outcome of each cell (docs/checkpoints.md, "The fault matrix") is
:func:`expected`, the cells that cannot occur included (with what happens instead: they are never
started); :func:`verdict` checks a cell against it. Cells are built by :func:`cells_for` from the
events and moments; a new kind of cell is an entry of ``fault_run.py``'s ``EVENTS`` or ``MOMENTS``,
what its ``Fault`` does for it, and a line in :func:`expected`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_run.py"
HANG_S = 120.0  # a launch in which no cell ended for this long hung
RANKS = 2
EVENTS = ("usr1", "term", "exc", "kill", "diskfull", "slow", "publishkill")
FIT_MOMENTS = ("accum", "val", "syncsave", "asyncsave")  # inside fit: a resume follows
SAVE_MOMENTS = ("syncsave", "asyncsave")
EVAL_MOMENTS = ("fitpredict", "validate", "test", "predict")  # predict after a fit, and the entry points alone
TRAINER_MOMENTS = (*FIT_MOMENTS, *EVAL_MOMENTS)
FABRIC_MOMENTS = ("accum", *SAVE_MOMENTS)  # a Fabric loop has no validation nor evaluation entry points of its own
WRITE_EVENTS = ("diskfull", "slow", "publishkill")
CHAINED = ("usr1", "slow", "term")  # cells that end alike on every rank, many per launch (SIGTERM last)

SCONTROL = '#!/bin/sh\necho "$@" >> "$LZ_SCONTROL_LOG"\n'


def expected(door: str, strategy: str, event: str, moment: str) -> dict[str, Any]:
    """The documented outcome of ``event`` at ``moment`` (docs/checkpoints.md, "The fault matrix"):
    ``runs`` (False: the cell cannot occur, ``why`` says what happens instead), exit codes per rank
    (``None``: any non-zero), requeues, whether the run resumes exactly from what the fault left,
    what the error names, and which checkpoints are published when the run trains on."""
    fit = moment in FIT_MOMENTS
    want: dict[str, Any] = {"runs": True, "why": "", "exit": [0] * RANKS, "requeues": 0, "resume": False,
                            "error": [], "published": None}  # fmt: skip
    if strategy == "ddp" and moment == "asyncsave":
        return dict(want, runs=False, why="n/a: Lightning's ddp has no background save")
    if event in WRITE_EVENTS and moment in EVAL_MOMENTS:
        return dict(want, runs=False, why="no write in predict/validate/test: exit 0, unaffected")
    if event == "publishkill" and moment in ("accum", "val"):
        return dict(want, runs=False, why="no publish mid-step nor in validation (a background publish runs "
                                          "beside the step: the asyncsave cell)")  # fmt: skip
    if event == "usr1":
        return dict(want, exit=[0 if fit else 138] * RANKS, requeues=1, resume=fit,
                    why="one requeue; in fit: hpc checkpoint at the optimizer step, trains on, exit 0, resumes"
                    " exactly; outside fit: exit 138")  # fmt: skip
    if event == "term":
        return dict(
            want,
            exit=[143] * RANKS,
            resume=fit,
            why="exit 143 on every rank; in fit OnExceptionCheckpoint saves at the boundary, resumes exactly",
        )
    if event == "exc":
        return dict(
            want,
            exit=[1] * RANKS,
            resume=fit,
            error=["rank 1"] if strategy != "ddp" else [],
            why="exit 1 on every rank within seconds, naming the rank; in fit `last` resumes exactly",
        )
    if event == "kill":
        return dict(
            want,
            exit=[None, -signal.SIGKILL],
            resume=fit,
            why="-9 there, non-zero on the other within seconds; in fit `last` resumes exactly",
        )
    if strategy == "ddp" and event in ("diskfull", "slow"):
        return dict(want, why="rank 1 writes nothing under ddp (rank 0 saves): exit 0, unaffected")
    if event == "diskfull":
        return dict(want, exit=[1] * RANKS, resume=True, error=["CheckpointWriteError", "rank 1", "EFBIG"],
                    why="the next save fails on every rank (CheckpointWriteError naming rank 1, the file, EFBIG),"
                    " exit 1; `last` stays the step-2 checkpoint and resumes exactly")  # fmt: skip
    if event == "slow":
        published = (
            ["step-2", "step-4", "step-6"]
            if door == "fabric"
            else [
                "ckpts/epoch=0-step=2.ckpt",
                "ckpts/epoch=0-step=4.ckpt",
                "ckpts/epoch=0-step=6.ckpt",
                "ckpts/last.ckpt",
            ]
        )
        return dict(want, published=published,
                    why="a save slower than collective_timeout that writes all along is waited for: exit 0,"
                    " every save published")  # fmt: skip
    # publishkill: rank 0 dies in the publish of the step-4 `last`
    return dict(want, exit=[-signal.SIGKILL, None], resume=True,
                why="-9 on rank 0, non-zero on the other; the next start restores what the publish moved aside"
                " (or keeps the previous `last`) and resumes exactly")  # fmt: skip


def cells_for(door: str, strategy: str, events: list[str], only: Optional[list[str]] = None) -> list[str]:
    """Every cell of ``door`` x ``strategy`` x ``events`` at the door's moments (``only``: a subset),
    those that cannot occur included (:func:`expected` says so; :func:`run_trial` does not start them)."""
    moments = FABRIC_MOMENTS if door == "fabric" else TRAINER_MOMENTS
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
        start = start or _default_start()
        self.procs = []
        for rank in range(RANKS):
            log = out / f"{mode}.{job}.rank{rank}.log"
            self.procs.append(start(argv, cwd=out, env=_env(out, rank, port, job), log_path=log))
        self.started = self.progressed = time.monotonic()
        self.ends: list[Optional[tuple[Optional[int], float]]] = [None] * RANKS
        self.hung = False
        self._seen: list[float] = [0.0] * RANKS

    def _progress(self) -> None:
        """A cell ended on a rank (its result file changed), or a rank ended: the launch moves."""
        for rank in range(RANKS):
            path = self.out / f"{self.mode}.{self.job}.rank{rank}.json"
            mtime = path.stat().st_mtime if path.exists() else 0.0
            if mtime != self._seen[rank]:
                self._seen[rank], self.progressed = mtime, time.monotonic()

    def poll(self, hang_s: float) -> bool:
        """Whether every rank ended; a launch in which no cell ended for ``hang_s`` is killed (hung)."""
        self._progress()
        for rank, proc in enumerate(self.procs):
            if self.ends[rank] is None and proc.poll() is not None:
                self.ends[rank] = (proc.returncode, time.time())
                self.progressed = time.monotonic()
        if time.monotonic() - self.progressed > hang_s and not all(self.ends):
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


def _default_start() -> Callable:
    """The tests' fork server (torch and Lightning imported once, each rank forked: [Note: test fork
    server] in tests/fork_server.py), else plain processes."""
    sys.path.insert(0, str(ROOT))
    from tests.distributed import start_process

    return start_process


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
    """The launches of one trial: per (door, strategy), the cells that end alike on every rank
    (:data:`CHAINED`) in one launch (SIGTERM cells last, so the process's own exit is a
    SIGTERM's), then one launch per other cell; cells that cannot occur are listed but never started."""
    launches = []
    for door in doors:
        for strategy in strategies:
            if door == "fabric" and strategy == "ddp":
                continue  # Fabric's ddp has no scheduler signals to ask: the Fabric door is ZeRO's
            cells = [cell for cell in cells_for(door, strategy, events, moments) if _runs(cell)]
            chained = sorted((c for c in cells if _what(c)[2] in CHAINED), key=lambda c: CHAINED.index(_what(c)[2]))
            if chained:
                launches.append(chained)
            launches += [[cell] for cell in cells if _what(cell)[2] not in CHAINED]
            skipped = [cell for cell in cells_for(door, strategy, events, moments) if not _runs(cell)]
            if skipped:
                launches.append(skipped)  # a launch never started: each cell's documented outcome instead
    return launches


def _runs(cell: str) -> bool:
    return expected(*_what(cell))["runs"]


def run_trial(out: Path, first: list[list[str]], *, job: int, start: Optional[Callable] = None,
              hang_s: float = HANG_S, concurrent: int = 2) -> dict[str, dict]:  # fmt: skip
    """One trial of the matrix in ``out``: the launches ``first`` (:func:`plan`), then the resumes;
    returns ``{cell name: its outcome}``. ``start``: how to start a process (default: the tests'
    fork server). A cell that cannot occur (:func:`expected`) is not started: its outcome says why."""
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

    started = [(i, cells) for i, cells in enumerate(first) if all(_runs(cell) for cell in cells)]
    run_launches([later(i, "fault", cells) for i, cells in started], hang_s, concurrent)
    # the resumes, one launch per (door, strategy): its uninterrupted run, then every cell that resumes
    resumes: dict[tuple[str, str], list[str]] = {}
    for _, cells in started:
        for cell in cells:
            door, strategy, event, moment = _what(cell)
            if expected(door, strategy, event, moment)["resume"]:
                base = f"{door[0]}_{strategy}_base={door}:{strategy}:none"
                resumes.setdefault((door, strategy), [base]).append(cell)
    second = list(resumes.values())
    left = {_name(cell): left_behind(out / _name(cell)) for cells in second for cell in cells}  # before a start
    run_launches([later(1000 + i, "resume", cells) for i, cells in enumerate(second)], hang_s, concurrent)
    outcomes: dict[str, dict] = {}
    for index, cells in enumerate(first):
        launch = launches.get(index)
        results = launch.results() if launch is not None else []
        for position, cell in enumerate(cells):
            if launch is None:
                outcomes[_name(cell)] = _not_run(cell)
            else:
                outcomes[_name(cell)] = _outcome(cell, launch, results, last=position == len(cells) - 1)
    for index, cells in enumerate(second):
        launch = launches[1000 + index]
        results = launch.results()
        for position, cell in enumerate(cells):
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
            ended = _outcome(cell, launch, results, last=position == len(cells) - 1)
            outcomes[_name(cell)].update(
                base_comm=results[0].get(base, {}).get("comm"),
                resume_diff=max(diffs), resumed_from=mine[0].get("resumed_from"),
                resumed_steps=sorted(mine[0].get("losses", {}), key=int),
                resume_exit=ended["exit"], resume_hung=ended["hung"], resume_error=ended["error"],
                left=left[_name(cell)],
            )  # fmt: skip
    return outcomes


def left_behind(root: Path) -> dict[str, list[str]]:
    """What a fault left in ``root`` before the next start: links that dangle, hidden staging or
    moved-aside names (the next start restores or removes them), the complete checkpoints."""
    found: dict[str, list[str]] = {"dangling": [], "hidden": [], "published": []}
    for path in sorted(root.rglob("*")) if root.exists() else []:
        relative = str(path.relative_to(root))
        if path.is_symlink() and not path.exists():
            found["dangling"].append(f"{relative} -> {os.readlink(path)}")
        elif path.name.startswith(".lightning_zero-") or ".tmp-" in path.name:
            found["hidden"].append(relative)
        elif path.parent in (root, root / "ckpts") and (path.is_file() or (path / "meta.json").exists()):
            found["published"].append(relative)
    return found


def _not_run(cell: str) -> dict:
    door, strategy, event, moment = _what(cell)
    return {"door": door, "strategy": strategy, "event": event, "moment": moment, "ran": False,
            "why": expected(door, strategy, event, moment)["why"]}  # fmt: skip


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
    killed = {"kill": 1, "publishkill": 0}.get(event)
    if sent is None and killed is not None and launch.ends[killed]:  # a SIGKILLed rank wrote nothing: its end
        sent = launch.ends[killed][1]
    errors = [r.get("error") for r in per_rank if r and r.get("error")]
    return {
        "door": door, "strategy": strategy, "event": event, "moment": moment, "exit": codes, "ran": True,
        "published": per_rank[0].get("published") if per_rank[0] else None,
        "hung": launch.hung and (last or any(r is None for r in per_rank)),
        "seconds_to_exit": (max(ends) - sent) if sent is not None else None,
        "requeues": per_rank[0].get("requeues") if per_rank[0] else None, "agreed": [r.get("agreed") if r else None for r in per_rank],
        "error": errors[0][:1500] if errors else None, "resume_diff": None,
        "comm": per_rank[0].get("comm") if per_rank[0] else None,
        "logged": per_rank[0].get("logged") if per_rank[0] else None,
    }  # fmt: skip


def verdict(outcome: dict) -> list[str]:
    """What in ``outcome`` differs from :func:`expected` (an empty list: as documented)."""
    want = expected(outcome["door"], outcome["strategy"], outcome["event"], outcome["moment"])
    if not outcome.get("ran", True):
        return [] if not want["runs"] else ["not run"]
    problems = []
    if outcome["hung"]:
        problems.append("hung")
    for rank, (got, code) in enumerate(zip(outcome["exit"], want["exit"])):
        if (code is None and not got) or (code is not None and got != code):
            problems.append(f"rank {rank} exit {got} (documented: {'non-zero' if code is None else code})")
    if outcome["requeues"] is not None and outcome["requeues"] != want["requeues"]:
        problems.append(f"{outcome['requeues']} requeues (documented: {want['requeues']})")
    missing = [part for part in want["error"] if part not in (outcome.get("error") or "")]
    if missing:
        problems.append(f"the error does not name {missing}: {outcome.get('error')!r}")
    if want["published"] is not None and not set(want["published"]) <= set(outcome.get("published") or []):
        problems.append(f"published {outcome.get('published')} (documented: {want['published']})")
    if want["resume"]:
        if not (outcome.get("resume_diff") is not None and outcome["resume_diff"] <= 1e-5):
            problems.append(f"resume diff {outcome.get('resume_diff')}")
        if outcome.get("resume_hung") or any(code not in (0, None) for code in outcome.get("resume_exit") or [1]):
            problems.append(f"the resume ended {outcome.get('resume_exit')}: {outcome.get('resume_error')}")
        if (outcome.get("left") or {}).get("dangling"):
            problems.append(f"dangling links {outcome['left']['dangling']}")
    return problems


def _runs_of(trials: list[dict[str, dict]], name: str) -> list[dict]:
    return [trial[name] for trial in trials if name in trial]


def table(trials: list[dict[str, dict]]) -> str:
    """The matrix as Markdown: one row per cell, over every trial (cells that cannot occur: why)."""
    rows = ["| door | strategy | event | moment | trials | hangs | exit codes | s to exit (max) | requeues |"
            " resume diff (max) | as documented |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name in trials[0]:
        runs = _runs_of(trials, name)
        first = runs[0]
        head = f"| {first['door']} | {first['strategy']} | {first['event']} | {first['moment']} |"
        if not first.get("ran", True):
            rows.append(f"{head} - | - | - | - | - | - | {first['why']} |")
            continue
        codes = sorted({"/".join(str(c) for c in run["exit"]) for run in runs})
        seconds = [run["seconds_to_exit"] for run in runs if run["seconds_to_exit"] is not None]
        diffs = [run["resume_diff"] for run in runs if run.get("resume_diff") is not None]
        ok = sum(not verdict(run) for run in runs)
        worst = f"{max(seconds):.1f}" if seconds else "-"
        requeues = sorted({str(run["requeues"]) for run in runs})
        rows.append(
            f"{head} {len(runs)} | {sum(run['hung'] for run in runs)} | {', '.join(codes)} | {worst} |"
            f" {', '.join(requeues)} | {f'{max(diffs):.1e}' if diffs else '-'} | {ok}/{len(runs)} |"
        )
    return "\n".join(rows)


def _entry(runs: list[dict]) -> str:
    """One cell of :func:`grid`: exit codes, max seconds to exit, max resume diff, as documented / trials."""
    if not runs[0].get("ran", True):
        return (
            "n/a" if runs[0]["why"].startswith("n/a") else "no " + ("write" if "write" in runs[0]["why"] else "publish")
        )
    hangs = sum(run["hung"] for run in runs)
    codes = sorted({"/".join("-" if c is None else str(c) for c in run["exit"]) for run in runs})
    seconds = [run["seconds_to_exit"] for run in runs if run["seconds_to_exit"] is not None]
    diffs = [run["resume_diff"] for run in runs if run.get("resume_diff") is not None]
    parts = [",".join(codes)]
    if hangs:
        parts.append(f"**{hangs} hung**")
    if seconds:
        parts.append(f"{max(seconds):.1f}s")
    if diffs:
        parts.append("d=0" if max(diffs) == 0 else f"d={max(diffs):.0e}")
    ok = sum(not verdict(run) for run in runs)
    mark = f"{ok}/{len(runs)}" if ok == len(runs) else f"**{ok}/{len(runs)}**"
    return " ".join(parts) + f" {mark}"


def grid(trials: list[dict[str, dict]]) -> str:
    """The matrix as it reads: per door, a table of strategy x event rows and moment columns. Each
    entry: exit codes (rank 0/rank 1; ``-``: killed after the hang bound), the max seconds from the
    event to the last exit, the max resume diff (``d``), trials as documented / trials."""
    cells = [trials[0][name] for name in trials[0]]
    out = []
    for door in dict.fromkeys(cell["door"] for cell in cells):
        found = {cell["moment"] for cell in cells if cell["door"] == door}
        moments = [moment for moment in (FABRIC_MOMENTS if door == "fabric" else TRAINER_MOMENTS) if moment in found]
        out += [f"**{door}**", "", "| strategy | event | " + " | ".join(moments) + " |",
                "| --- | --- | " + " | ".join("---" for _ in moments) + " |"]  # fmt: skip
        keys = sorted({(cell["strategy"], cell["event"]) for cell in cells if cell["door"] == door},
                      key=lambda key: (key[0], EVENTS.index(key[1])))  # fmt: skip
        for strategy, event in keys:
            entries = []
            for moment in moments:
                name = f"{door[0]}_{strategy}_{event}_{moment}"
                entries.append(_entry(_runs_of(trials, name)) if name in trials[0] else "")
            out.append(f"| {strategy} | {event} | " + " | ".join(entries) + " |")
        out.append("")
    return "\n".join(out)


KEPT = ("door", "strategy", "event", "moment", "ran", "why", "exit", "hung", "seconds_to_exit", "requeues", "error",
        "published", "resume_diff", "resumed_from", "resumed_steps", "resume_exit", "resume_hung", "left")  # fmt: skip


def slim(trials: list[dict[str, dict]]) -> list[dict[str, dict]]:
    """The outcomes without the bulky per-cell records (communication counters, logged metrics),
    errors without the run's directory and cut to 600 characters, each with its verdict: what
    benchmarks/results/ keeps."""
    kept = []
    for trial in trials:
        cells = {}
        for name, outcome in trial.items():
            cell = {key: outcome[key] for key in KEPT if key in outcome}
            for key in ("error", "resume_error"):
                if cell.get(key):
                    cell[key] = re.sub(r"/\S*/trial\d+/", "", cell[key])[:600]
            cell["verdict"] = verdict(outcome)
            cells[name] = cell
        kept.append(cells)
    return kept


def failures(trials: list[dict[str, dict]]) -> list[str]:
    """Every trial of a cell that is not as documented, with what differs."""
    found = []
    for name in trials[0]:
        for index, run in enumerate(_runs_of(trials, name)):
            problems = verdict(run)
            if problems:
                found.append(f"{name} (trial {index}): {'; '.join(problems)}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from-json", type=Path, default=None, help="print the tables of an earlier run")
    parser.add_argument("--slim-json", type=Path, default=None, help="with --from-json: write its slim() outcomes")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3")
    parser.add_argument("--doors", default="trainer,fabric")
    parser.add_argument("--events", default=",".join(EVENTS))
    parser.add_argument("--moments", default=None, help="a subset of the moments (default: every one)")
    parser.add_argument("--hang-s", type=float, default=HANG_S)
    parser.add_argument("--concurrent", type=int, default=2, help="launches at a time (2 ranks each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.from_json is not None:
        run = json.loads(args.from_json.read_text())
        if args.slim_json is not None:
            args.slim_json.write_text(json.dumps({"argv": run.get("argv"), "trials": slim(run["trials"])}, indent=0))
        _print(run["trials"])
        return
    if args.out is None:
        parser.error("--out DIR is needed to run the matrix")
    trials = []
    for trial in range(args.trials):
        out = args.out / f"trial{trial}"
        out.mkdir(parents=True, exist_ok=True)
        started = time.time()
        moments = args.moments.split(",") if args.moments else None
        launches = plan(args.doors.split(","), args.strategies.split(","), args.events.split(","), moments)
        trials.append(run_trial(out, launches, job=10000 * (trial + 1), hang_s=args.hang_s,
                                concurrent=args.concurrent))  # fmt: skip
        print(f"trial {trial}: {time.time() - started:.0f} s", flush=True)
        if args.json is not None:  # after every trial: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"argv": sys.argv[1:], "trials": trials}, indent=1))
    _print(trials)


def _print(trials: list[dict[str, dict]]) -> None:
    print(grid(trials))
    print(table(trials))
    print("\n".join(["not as documented:", *failures(trials)]))


if __name__ == "__main__":
    main()
