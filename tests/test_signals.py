"""The run survives its scheduler (issue 43): SIGUSR1 / SIGTERM at any moment, a save failing on one rank.

Every launch is tests/scripts/signal_run.py as 2 ranks (4 under tensor parallelism) started the
way srun starts them (``SLURM_*`` variables: Lightning's ``SLURMEnvironment`` with auto-requeue),
each rank sending itself the signal at its own moment of a step (inside backward, in forward,
inside the optimizer step, a stage-3 gather, validation, a checkpoint save). Trials are looped inside a launch where the protocol lets
the process go on (a caught ``SystemExit(143)``), to keep the processes few:

- requeue, per strategy (ddp with ``SchedulerSignals``, zero1-3): two trials; the first trains on
  after its requeue (its losses must equal the uninterrupted run's), the second is SIGKILLed as
  the scheduler would once its ``scontrol requeue`` ran (the fake ``scontrol`` holds rank 0 there
  until the kill, as SLURM ends a job it requeues). Then one launch starts every trial again
  in its directory with no ``ckpt_path``: it resumes from ``hpc_ckpt_1.ckpt`` and its losses equal
  an uninterrupted run's (fresh ``base_*`` runs in that launch). A staging directory planted beside
  one of them is removed with a warning.
- SIGTERM, per strategy, four trials: every rank exits with 143 within 10 s of the agreement; the
  last trial's processes really exit (143); ``OnExceptionCheckpoint`` saves on the way out.
- ``async_checkpoint``: the files equal a synchronous save's byte for byte, every host copy written
  into the buffers filled after the first step; a rank SIGKILLed inside a
  background write leaves the previous checkpoint as ``last``, and it resumes exactly.
- tp=2 x dp=2 (a tiny ``LlamaLM``), stages 1-3, two launches of 4 ranks: requeue (trained on after
  it, or SIGKILLed and resumed from ``hpc_ckpt_1.ckpt``: the uninterrupted losses; the second
  launch runs the uninterrupted ``base_*`` runs, the resume, then the SIGTERM trials) and SIGTERM
  (143 on every rank, all stopped after the same step), signals at different moments on different
  ranks, some reaching one dp group only; the flags cannot ride on the dp-only phase markers, so
  the agreement is one all-reduce over the world per training batch (``exchanges``).
- a save failing with ``EFBIG`` on one rank (rank 1 at zero2, rank 0 at zero3): every rank ends
  within 10 s with an error naming the rank, the file and the OS error; ``ckpt_path="last"``
  resumes exactly from the checkpoint before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import free_port, script_env, start_process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "signal_run.py"
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
EXIT_WITHIN_S = 10.0
HANG_S = 120.0  # one launch (several trials of a few steps each) on a loaded 2-core box
TOL = 1e-5


def _requeue_trials(strategy: str) -> list[str]:
    second = "1.gather@3" if strategy == "zero3" else "1.backward@4"
    return [
        f"rq_{strategy}_a={strategy}:0.backward@3,1.forward@3",
        f"rq_{strategy}_b={strategy}:0.optimizer@3,{second}",
    ]


def _sigterm_trials(strategy: str) -> list[str]:
    during_save = "0.save@2" if strategy != "ddp" else "0.after_step@2"
    return [
        f"tm_{strategy}_a={strategy}:0.backward@3,1.forward@3",
        f"tm_{strategy}_b={strategy}:{during_save},1.optimizer@3",
        f"tm_{strategy}_c={strategy}:0.validation@2,1.gather@3",
        f"tm_{strategy}_d_save={strategy}:0.forward@3,1.backward@3",
    ]


EFBIG_TRIALS = ["fb_zero2=zero2:efbig@1", "fb_zero3=zero3:efbig@0"]
# async_checkpoint: the same run saved synchronously and in the background; then a rank SIGKILLed
# inside a background write (the step-4 save), the previous checkpoint (step 2) still `last`
ASYNC_TRIALS = ["as_sync_zero3=zero3:", "as_async_zero3=zero3:", "ak_async_zero2=zero2:kill@1"]


# tp=2 x dp=2 (4 ranks, a tiny LlamaLM; TP groups {0, 1} and {2, 3}): the flags cannot ride on the
# dp-only phase markers, so every training batch pays one 8-byte all-reduce over the world. Each
# signalled rank sends itself the signal at its own moment of step 3 (validation@2: before step 3),
# so all agree once, after step 3 (a SIGTERM at save@2 or validation@2 ends the validation after step
# 2 at its first batch: [Note: signal boundaries]). In the `_dp` trials only one dp group ({1, 3} or {0, 2}) gets a
# signal: their TP peers learn of it from the world all-reduce alone (dp markers would leave them out).
TP_STAGES = ("tp2z1", "tp2z2", "tp2z3")
TP_REQUEUE_TRIALS = [  # the last one is SIGKILLed once its scontrol ran, then resumed
    "rq_tp2z1=tp2z1:0.backward@3,1.forward@3,2.optimizer@3,3.validation@2",
    "rq_tp2z2_dp=tp2z2:1.optimizer@3,3.backward@3",
    "rq_tp2z3=tp2z3:0.gather@3,1.backward@3,2.forward@3,3.optimizer@3",
]
TP_SIGTERM_TRIALS = [
    "tm_tp2z1_dp=tp2z1:0.after_step@3,2.gather@3",
    "tm_tp2z2=tp2z2:0.save@2,1.gather@3,2.backward@3,3.forward@3",
    "tm_tp2z3=tp2z3:0.backward@3,1.gather@3,2.after_step@3,3.validation@2",
]
# one launch after the requeue launch: the uninterrupted runs, the killed trial resumed from its
# hpc checkpoint (a trial with no signals finds it: no ckpt_path), then the SIGTERM trials
TP_SECOND = [f"base_{s}={s}:" for s in TP_STAGES] + ["rq_tp2z3=tp2z3:", *TP_SIGTERM_TRIALS]


def _name(trial: str) -> str:
    return trial.partition("=")[0]


def _slurm_env(out: Path, rank: int, port: int, job: int, ranks: int, hold_at: int) -> dict:
    env = script_env(ROOT)
    env.update(
        SLURM_NTASKS=str(ranks), SLURM_NTASKS_PER_NODE=str(ranks), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank), SLURM_JOB_ID=str(job), SLURM_JOB_NAME="signal_run", SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LZ_SCONTROL_LOG=str(out / f"scontrol.{job}.log"),
        LZ_SCONTROL_HOLD_AT=str(hold_at),
        PATH=f"{out / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )  # fmt: skip
    return env


class Launch:
    """One job step: ``ranks`` ranks of signal_run.py in ``out``; ``job`` is its SLURM job id."""

    def __init__(
        self, out: Path, mode: str, trials: list[str], job: int, kill_after_requeues: int = 0, ranks: int = 2
    ) -> None:
        self.out, self.mode, self.job, self.kill_after, self.ranks = out, mode, job, kill_after_requeues, ranks
        port = free_port()
        argv = [sys.executable, str(SCRIPT), str(out), mode, *trials]
        self.procs = [
            start_process(argv, cwd=out, env=_slurm_env(out, rank, port, job, ranks, kill_after_requeues),
                          log_path=out / f"{mode}.{job}.rank{rank}.log")
            for rank in range(ranks)
        ]  # fmt: skip
        self.started = time.monotonic()
        self.ends: list = [None] * ranks  # (exit code or None if killed, wall time)
        self.killed = False

    def requeues(self) -> int:
        log = self.out / f"scontrol.{self.job}.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    def poll(self) -> bool:
        """True once every rank ended (SIGKILLing them as the scheduler would, or as hung)."""
        for rank, proc in enumerate(self.procs):
            if self.ends[rank] is None and proc.poll() is not None:
                self.ends[rank] = (proc.returncode, time.time())
        hung = time.monotonic() - self.started > HANG_S
        if (self.kill_after and self.requeues() >= self.kill_after) or hung:
            self.killed = self.killed or not hung
            for rank, proc in enumerate(self.procs):
                if self.ends[rank] is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self.ends[rank] = (None if hung else "killed", time.time())
        return all(end is not None for end in self.ends)

    def results(self) -> list[dict]:
        return [
            json.loads((self.out / f"{self.mode}.{self.job}.rank{rank}.json").read_text()) for rank in range(self.ranks)
        ]


def _run(launches: list, concurrent: int = 2) -> None:
    waiting, running = list(launches), []
    while waiting or running:
        while waiting and len(running) < concurrent:
            running.append(waiting.pop(0)())
        time.sleep(0.02)
        running = [launch for launch in running if not launch.poll()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("signals")
    (out / "bin").mkdir()
    scontrol = out / "bin" / "scontrol"
    # the n-th requeue of a launch that is killed after n (LZ_SCONTROL_HOLD_AT) holds rank 0 until
    # the kill, as SLURM ends a running job it requeues: no later step (and no later signal of
    # that trial) can race the test's SIGKILL
    scontrol.write_text(
        '#!/bin/sh\necho "$@" >> "$LZ_SCONTROL_LOG"\n'
        'if [ "$LZ_SCONTROL_HOLD_AT" -gt 0 ] && [ "$(wc -l < "$LZ_SCONTROL_LOG")" -ge "$LZ_SCONTROL_HOLD_AT" ]; then\n'
        "  sleep 600\nfi\n"
    )
    scontrol.chmod(0o755)
    done: dict = {}

    def later(key, *args, **kwargs):
        def start():
            done[key] = Launch(out, *args, **kwargs)
            return done[key]

        return start

    first = [later("tp_requeue", "requeue", TP_REQUEUE_TRIALS, 600, kill_after_requeues=3, ranks=4)]
    for job, strategy in enumerate(STRATEGIES):
        first.append(
            later(("requeue", strategy), "requeue", _requeue_trials(strategy), 100 + job, kill_after_requeues=2)
        )
        first.append(later(("sigterm", strategy), "sigterm", _sigterm_trials(strategy), 200 + job))
    first += [later(("efbig", _name(trial)), "efbig", [trial], 300 + job) for job, trial in enumerate(EFBIG_TRIALS)]
    first.append(later("async", "async", ASYNC_TRIALS, 500))
    _run(first)
    # what a save killed mid-write leaves beside the hpc checkpoints of the killed zero2 trial
    planted = out / "rq_zero2_b" / f".lightning_zero-staging-0123456789ab-{'hpc_ckpt_2.ckpt'.encode().hex()}"
    planted.mkdir()
    (planted / "__0_0.distcp").write_bytes(b"partial")
    resumes = [t.partition(":")[0] for s in STRATEGIES for t in _requeue_trials(s)]
    resumes += [f"base_{s}={s}:" for s in STRATEGIES] + [
        f"last_{_name(t)}={t.split('=')[1].split(':')[0]}:" for t in (*EFBIG_TRIALS, ASYNC_TRIALS[-1])
    ]
    _run([later("tp_second", "sigterm", TP_SECOND, 601, ranks=4), later("resume", "resume", resumes, 400)])
    return out, done, planted


def _agreed_steps(result: dict) -> int:
    return len(result["agreed"])


def _baseline(done: dict, strategy: str, rank: int) -> dict[str, float]:
    return done["resume"].results()[rank][f"base_{strategy}"]["losses"]


def _same(losses: dict, base: dict, steps: list[str]) -> float:
    return max(abs(losses[step] - base[step]) for step in steps)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requeue_signal_saves_requeues_and_resumes_exactly(runs, strategy):
    out, done, _ = runs
    launch = done[("requeue", strategy)]
    assert launch.killed, f"{strategy}: the second trial never requeued (ends: {launch.ends}); see {out}"
    assert launch.requeues() == 2
    assert sorted(_baseline(done, strategy, 0), key=int) == [str(step) for step in range(1, 7)]
    first = [result[f"rq_{strategy}_a"] for result in launch.results()]
    for rank, result in enumerate(first):  # agreed once, on both ranks, and trained on exactly
        assert [event["requeue"] for event in result["agreed"]] == [True], (rank, result)
        base = _baseline(done, strategy, rank)
        assert _same(result["losses"], base, list(base)) <= TOL
        # the flags rode on the phase markers under ZeRO; ddp paid one all-reduce per batch
        assert result["exchanges"] == (6 if strategy == "ddp" else 0)
    resumed = done["resume"].results()
    for trial in _requeue_trials(strategy):
        name = _name(trial)
        assert (out / name / "hpc_ckpt_1.ckpt").exists()
        for rank in range(2):
            losses = resumed[rank][name]["losses"]
            steps = sorted(losses, key=int)
            assert int(steps[0]) in (4, 5), (name, steps)  # resumed at the boundary of step 3 or 4
            assert steps[-1] == "6"
            assert _same(losses, _baseline(done, strategy, rank), steps) <= TOL


def test_a_staging_directory_left_behind_is_removed_with_a_warning(runs):
    out, done, planted = runs
    assert not planted.exists()
    log = (out / "resume.400.rank0.log").read_text()
    assert "removed" in log and planted.name in log and "never finished" in log
    for path in (out / "rq_zero2_b").iterdir():  # nothing a scan for checkpoints could mistake
        assert not path.name.startswith(".lightning_zero-"), path


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_at_any_moment_exits_every_rank_with_143(runs, strategy):
    out, done, _ = runs
    launch = done[("sigterm", strategy)]
    assert [end[0] for end in launch.ends] == [143, 143], f"{strategy}: {launch.ends}; logs in {out}"
    results = launch.results()
    for trial in _sigterm_trials(strategy):
        name = _name(trial)
        per_rank = [result[name] for result in results]
        agreed_steps = {tuple(sorted(r["losses"], key=int))[-1] for r in per_rank}
        assert len(agreed_steps) == 1, (name, per_rank)  # both ranks stopped after the same step
        for result in per_rank:
            assert result["exit"] == 143, (name, result)
            assert [event["terminate"] for event in result["agreed"]] == [True]
            assert result["ended"] - result["agreed"][0]["at"] <= EXIT_WITHIN_S
    agreed = max(result[_name(_sigterm_trials(strategy)[-1])]["agreed"][0]["at"] for result in results)
    assert max(end[1] for end in launch.ends) - agreed <= EXIT_WITHIN_S  # the processes are gone
    saved = out / _name(_sigterm_trials(strategy)[-1]) / "on_sigterm.ckpt"
    assert saved.exists() and (strategy == "ddp" or (saved / "meta.json").exists())


@pytest.mark.parametrize("trial", EFBIG_TRIALS)
def test_a_save_failing_on_one_rank_names_it_and_resumes_from_the_one_before(runs, trial):
    out, done, _ = runs
    name = _name(trial)
    failing = int(trial.rpartition("@")[2])
    launch = done[("efbig", name)]
    codes = [end[0] for end in launch.ends]
    assert codes == [1, 1], (codes, out)
    assert max(end[1] for end in launch.ends) - min(end[1] for end in launch.ends) <= EXIT_WITHIN_S
    for rank, result in enumerate(launch.results()):
        error = result[name]["error"]
        assert result[name]["exit"] == "CheckpointWriteError", (rank, result[name])
        assert f"rank {failing}: cannot write" in error and "File too large" in error and "EFBIG" in error, error
        assert str(out / name / "ckpts") in error
    strategy = trial.split("=")[1].split(":")[0]
    resumed = done["resume"].results()
    for rank in range(2):
        losses = resumed[rank][f"last_{name}"]["losses"]
        assert sorted(losses, key=int) == ["3", "4", "5", "6"]  # from step 2's checkpoint: step 4's failed
        assert _same(losses, _baseline(done, strategy, rank), list(losses)) <= TOL


# --------------------------------------------------------------------------------------------
# Without processes: staging names, leftovers, the agreement's rules
# --------------------------------------------------------------------------------------------


def test_staging_names_never_look_like_checkpoints(tmp_path):
    """Nothing a save writes on the way matches what Lightning scans for ([Note: staging names])."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_zero.checkpoint.publish import RETIRED, STAGING, side_name

    for target in ("hpc_ckpt_1.ckpt", "last.ckpt", "epoch=0-step=4.ckpt", "x" * 300 + ".ckpt"):
        for prefix in (STAGING, RETIRED):
            name = side_name(prefix, tmp_path / target)
            assert "hpc_ckpt_" not in name and not name.endswith(".ckpt") and not name.startswith("last")
            assert len(name) <= 255
            (tmp_path / name).mkdir()
    max_version = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder
    assert max_version(tmp_path, "hpc_ckpt_") is None  # Lightning's SLURM resume finds nothing to resume


def test_leftovers_are_removed_and_a_checkpoint_moved_aside_is_restored(tmp_path):
    from lightning_zero.checkpoint.publish import RETIRED, STAGING, clean_leftovers, side_name

    (tmp_path / "last.ckpt").mkdir()
    kept = tmp_path / "epoch=0-step=2.ckpt"
    kept.mkdir()
    (tmp_path / side_name(STAGING, tmp_path / "last.ckpt")).mkdir()  # a save killed before its publish
    (tmp_path / side_name(RETIRED, tmp_path / "last.ckpt")).mkdir()  # killed before removing the old one
    moved = tmp_path / side_name(RETIRED, tmp_path / "hpc_ckpt_2.ckpt")  # killed between the two renames
    moved.mkdir()
    (moved / "meta.json").write_text("{}")
    (tmp_path / "hpc_ckpt_1.ckpt.tmp-30179fcb00f7").mkdir()  # an older version's staging name
    lines = clean_leftovers(tmp_path)
    assert len(lines) == 5, lines  # the older version's name: hidden first (restore_moved_aside), then removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "hpc_ckpt_2.ckpt", "last.ckpt"]
    assert (tmp_path / "hpc_ckpt_2.ckpt" / "meta.json").exists()
    assert any("restored" in line and "hpc_ckpt_2.ckpt" in line for line in lines)
    assert clean_leftovers(tmp_path) == []


def test_cleanup_keeps_a_staging_directory_another_live_process_is_writing(tmp_path):
    """[Note: staging in flight]: two jobs saving into one directory: the cleanup at one job's start
    leaves the other's in-flight staging alone, and removes it once its process is gone."""
    import subprocess
    import textwrap

    from lightning_zero.checkpoint.publish import STAGING, clean_leftovers, hold, release, side_name

    theirs = tmp_path / side_name(STAGING, tmp_path / "step-4.ckpt")
    theirs.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, pathlib
            from lightning_zero.checkpoint.publish import hold
            hold(pathlib.Path({str(theirs)!r}))
            print("held", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "held"
        ours = tmp_path / side_name(STAGING, tmp_path / "last.ckpt")
        ours.mkdir()
        hold(ours)  # this process's own save in flight
        lines = clean_leftovers(tmp_path)
        assert theirs.is_dir() and ours.is_dir(), lines
        assert sum("kept" in line for line in lines) == 2, lines
    finally:
        writer.stdin.close()
        writer.wait(timeout=30)
    release(ours)
    lines = clean_leftovers(tmp_path)  # the writer died without publishing; ours was let go
    assert not theirs.exists() and not ours.exists(), lines


def test_the_handler_only_records_and_the_boundary_acts_once():
    """[Note: signals as events]: a signal is recorded, agreed at a boundary (riding on markers or
    by an exchange), and cleared once acted on; riders put their slots on every phase marker."""
    from lightning_zero.runtime.signals import SignalAgreement

    agreement = SignalAgreement(signal.SIGUSR1)
    agreement.install()
    try:
        assert agreement.boundary(lambda values: values) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert agreement.values() == [1, 0] and agreement.pending().startswith("the requeue signal")
        agreement.agreed([0, 0])  # a marker launched before the signal: nothing agreed yet
        agreement.agreed([0, 1])  # the next marker: another rank had SIGTERM
        assert agreement.rode
        agreed = agreement.boundary(None)
        assert (agreed.requeue, agreed.terminate) == (False, True)
        assert agreement.values() == [1, 0] and not agreement.rode  # this rank's own signal still pending
        agreed = agreement.boundary(lambda values: values)
        assert (agreed.requeue, agreed.terminate) == (True, False) and agreed.received_at[0] > 0
        assert agreement.values() == [0, 0] and agreement.pending() is None
    finally:
        agreement.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_background_saves_write_the_same_bytes_and_a_kill_mid_write_keeps_the_last_one(runs):
    out, done, _ = runs
    launch = done["async"]
    assert launch.ends[1][0] == -signal.SIGKILL and launch.ends[0][0] == 1, launch.ends
    # last.ckpt: the second save of its step, written from the same host copy as the first
    for step in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"):
        sync = out / "as_sync_zero3" / "ckpts" / step
        background = out / "as_async_zero3" / "ckpts" / step
        names = sorted(p.name for p in sync.iterdir() if p.name.startswith(("__", "rank")))
        assert names == ["__0_0.distcp", "__1_0.distcp", "rank0.json", "rank1.json"]
        for name in names:
            assert (sync / name).read_bytes() == (background / name).read_bytes(), (step, name)
        meta = [json.loads((d / "meta.json").read_text()) for d in (sync, background)]
        assert meta[0]["params"] == meta[1]["params"] and meta[0]["optimizers"] == meta[1]["optimizers"]
    results = launch.results()
    for rank in range(2):
        assert results[rank]["as_async_zero3"]["losses"] == results[rank]["as_sync_zero3"]["losses"]
        # [Note: host buffers before the first save]: filled after the first step, every save copied into them
        host = results[rank]["as_async_zero3"]["host"]
        assert host["prepared"] == host["copied"] > 0 and host["fresh"] == 0, host
    killed = out / "ak_async_zero2" / "ckpts"
    assert not (killed / "epoch=0-step=4.ckpt").exists()
    resumed = done["resume"].results()
    for rank in range(2):
        losses = resumed[rank]["last_ak_async_zero2"]["losses"]
        assert sorted(losses, key=int) == ["3", "4", "5", "6"]  # from step 2's checkpoint
        assert _same(losses, _baseline(done, "zero2", rank), list(losses)) <= TOL
    assert not [p for p in killed.iterdir() if p.name.startswith(".lightning_zero-")]  # cleaned at the restart


def test_the_first_host_copy_goes_into_buffers_filled_before_it():
    # [Note: host buffers before the first save]: shaped from the live tensors' shapes only, filled once
    import torch

    from lightning_zero.checkpoint.background import BackgroundSaves, _tensors_of, host_copy
    from lightning_zero.checkpoint.dcp import DenseChunks

    live = {"model.w": DenseChunks((4, 4), [((0, 0), torch.randn(2, 4)), ((2, 0), torch.randn(2, 4))]),
            "optim.0.w.step": torch.tensor(3.0), "note": 1}  # fmt: skip
    saves = BackgroundSaves()
    saves.prepare(live)
    saves._take_prepared()
    assert saves.prepared and saves.prepared_bytes == 2 * 8 * 4 + 4
    prepared = {t.data_ptr() for t in _tensors_of(saves._buffers)}
    saves.prepare(live)  # once: the buffers stay those of the first prepare
    assert {t.data_ptr() for t in _tensors_of(saves._buffers)} == prepared
    copied, total = host_copy(live, saves._buffers)
    assert total == saves.prepared_bytes and {t.data_ptr() for t in _tensors_of(copied)} == prepared
    for (_, mine), (_, theirs) in zip(copied["model.w"].pieces, live["model.w"].pieces):
        assert torch.equal(mine, theirs)
    assert copied["optim.0.w.step"].item() == 3.0 and copied["note"] == 1


# --------------------------------------------------------------------------------------------
# tp=2 x dp=2: the agreement is one all-reduce over the world per training batch
# --------------------------------------------------------------------------------------------


def _signalled(trial: str) -> set[int]:
    return {int(part.partition(".")[0]) for part in trial.partition(":")[2].split(",") if part}


def _tp_base(done: dict, stage: str, rank: int) -> dict[str, float]:
    return done["tp_second"].results()[rank][f"base_{stage}"]["losses"]


@pytest.mark.parametrize("stage", TP_STAGES)
def test_tp_requeue_signal_saves_requeues_and_resumes_exactly(runs, stage):
    out, done, _ = runs
    launch = done["tp_requeue"]
    assert launch.killed, f"the last tp trial never requeued (ends: {launch.ends}); see {out}"
    assert launch.requeues() == 3  # once per trial: rank 0 of the agreement only
    trial = next(t for t in TP_REQUEUE_TRIALS if t.startswith(f"rq_{stage}"))
    name = _name(trial)
    assert (out / name / "hpc_ckpt_1.ckpt" / "meta.json").exists()
    assert not (out / name / "hpc_ckpt_2.ckpt").exists()
    for rank in range(4):
        base = _tp_base(done, stage, rank)
        assert sorted(base, key=int) == [str(step) for step in range(1, 7)]
        assert done["tp_second"].results()[rank][f"base_{stage}"]["exchanges"] == 6  # one per batch
    # TP peers trained on the same batches, dp peers on different ones: two runs of losses, 2 ranks each
    runs_of_losses = [tuple(sorted(_tp_base(done, stage, rank).items())) for rank in range(4)]
    assert sorted(runs_of_losses.count(losses) for losses in set(runs_of_losses)) == [2, 2], runs_of_losses
    if trial != TP_REQUEUE_TRIALS[-1]:  # trained on after its requeue: agreed once, the same losses
        for rank, result in enumerate(launch.results()):
            result = result[name]
            assert (result["sent"] is not None) == (rank in _signalled(trial)), (rank, result)  # its moment came
            assert [(event["requeue"], event["terminate"]) for event in result["agreed"]] == [(True, False)]
            assert result["exit"] is None and result["exchanges"] == 6, (rank, result)
            assert _same(result["losses"], _tp_base(done, stage, rank), list(map(str, range(1, 7)))) <= TOL
        return
    resumed = done["tp_second"].results()  # the killed trial, started again in its directory
    for rank in range(4):
        result = resumed[rank][name]
        assert sorted(result["losses"], key=int) == ["4", "5", "6"], (rank, result)  # from step 3's boundary
        assert _same(result["losses"], _tp_base(done, stage, rank), ["4", "5", "6"]) <= TOL
        assert result["agreed"] == [] and result["exchanges"] == 3


@pytest.mark.parametrize("stage", TP_STAGES)
def test_tp_sigterm_at_any_moment_exits_every_rank_with_143(runs, stage):
    out, done, _ = runs
    launch = done["tp_second"]
    assert [end[0] for end in launch.ends] == [143] * 4, f"{launch.ends}; logs in {out}"
    trial = next(t for t in TP_SIGTERM_TRIALS if t.startswith(f"tm_{stage}"))
    name = _name(trial)
    per_rank = [result[name] for result in launch.results()]
    # every rank stopped after the same step: 2 when a signal came before the validation after step 2
    # (it ends at that validation's first batch: [Note: signal boundaries]), else 3; the moments of
    # step 3 then never came
    stop = 2 if any(moment in trial for moment in ("save@2", "validation@2")) else 3
    sent = {int(part.partition(".")[0]) for part in trial.partition(":")[2].split(",") if stop == 3 or "@2" in part}
    for rank, result in enumerate(per_rank):
        assert result["exit"] == 143 and (result["sent"] is not None) == (rank in sent), (rank, result)
        assert [(event["requeue"], event["terminate"]) for event in result["agreed"]] == [(False, True)]
        assert sorted(result["losses"], key=int)[-1] == str(stop), (rank, result)
        assert result["exchanges"] == stop  # one all-reduce per training batch
        assert result["ended"] - result["agreed"][0]["at"] <= EXIT_WITHIN_S
        assert _same(result["losses"], _tp_base(done, stage, rank), [str(s) for s in range(1, stop + 1)]) <= TOL
    if name == _name(TP_SIGTERM_TRIALS[-1]):  # the last trial's processes are gone
        assert max(end[1] for end in launch.ends) - max(r["agreed"][0]["at"] for r in per_rank) <= EXIT_WITHIN_S
