"""Faults a sharded checkpoint must survive (gloo, CPU, 2 ranks, short process-group timeouts).

- A rank SIGKILLed in the middle of training (tests/scripts/ckpt_train.py ``kill3``): the surviving
  rank fails with an error within a bounded time (no hang), the last complete checkpoint (step 3)
  is intact, and resuming from ``ckpt_path="last"`` in a fresh launch (``after3``) reproduces the
  uninterrupted run's (``full3``) losses bit for bit.
- A rank SIGKILLed while a checkpoint is being written (tests/scripts/ckpt_write_fault.py): the
  survivor raises, nothing is published, and the previous checkpoint under that name loads.

The two dying launches run concurrently, then one launch runs the uninterrupted run and the resume.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port, launch_ranks, script_env

ROOT = Path(__file__).resolve().parents[1]
STAGE = 3
BOUND_S = 120  # the survivor's whole run (startup + 5 steps + the 30 s process-group timeout) on a loaded box


def _env(**extra):
    return script_env(ROOT, **extra)


def _lightning(out: Path, cases: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests/scripts/ckpt_train.py"), str(out), "2", *cases],
        cwd=out, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _write_fault(out: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests/scripts/ckpt_write_fault.py"), str(out), str(STAGE)],
            cwd=out,
            env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """(return code or None if it ran past ``timeout``, output, wall-clock time it ended)."""
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return None, output, time.monotonic() - start
    return proc.returncode, output, time.time()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_faults")
    (out / "write").mkdir()
    kill = _lightning(out, [f"kill{STAGE}"])
    writers = _write_fault(out / "write")
    results = {"kill": _finish(kill, BOUND_S)}
    (out / "kill.log").write_text(results["kill"][1])
    results["writers"] = [_finish(proc, BOUND_S) for proc in writers]
    # what the killed run left, before anything else writes there
    from lightning_zero.checkpoint import is_checkpoint, open_checkpoint

    ckpts = out / "ckpts" / "kill"
    if results["kill"][0] is not None:
        results["left"] = {
            "last_step": open_checkpoint(ckpts / "last.ckpt").state["global_step"],
            "step3": is_checkpoint(ckpts / "epoch=0-step=3.ckpt"),
            "names": sorted(p.name for p in ckpts.iterdir()),
        }
    # a fresh 2-rank launch: the uninterrupted run, then a resume from what the killed run left
    argv = [sys.executable, str(ROOT / "tests/scripts/ckpt_train.py"), str(out), "2", f"full{STAGE}", f"after{STAGE}"]
    results["after"] = launch_ranks(argv, cwd=out, env=_env(), timeout_s=300, log_prefix="after")
    return out, results


def _record(out, case, rank):
    return torch.load(out / f"{case}.d2.rank{rank}.pt", weights_only=False)


@pytest.mark.slow
def test_rank_killed_mid_training_fails_fast_and_resumes_exactly(faults):
    out, results = faults
    code, output, ended = results["kill"]
    assert code is not None, f"surviving rank hung past {BOUND_S}s:\n{output[-4000:]}"
    assert code != 0, output[-4000:]
    # the survivor failed well within the 30 s timeout: either with gloo's error naming the lost
    # peer, or (when its collective had not started yet) stopped by Lightning's child-process
    # observer, which kills the launch as soon as it sees a rank die
    assert ended - float((out / "killed_at").read_text()) < 45, output[-4000:]
    failure_signs = ("Connection", "timed out", "Timeout", "Forcefully terminating all other processes")
    assert any(sign in output for sign in failure_signs), output[-4000:]
    # the last complete checkpoint (verified: sizes and hashes) is the step-3 one, nothing else is there
    left = results["left"]
    assert left["last_step"] == 3 and left["step3"], left
    assert left["names"] == ["epoch=0-step=3.ckpt", "last.ckpt"], left
    # a fresh launch resumes from it and reproduces the uninterrupted run
    codes, tails = results["after"]
    assert codes == [0, 0], tails
    for rank in (0, 1):
        full, after = _record(out, f"full{STAGE}", rank), _record(out, f"after{STAGE}", rank)
        assert len(full["losses"]) == 8
        assert after["losses"] == full["losses"][3:] and after["draws"] == full["draws"][3:]


@pytest.mark.slow
def test_rank_killed_during_checkpoint_write_publishes_nothing(faults):
    out, results = faults
    out = out / "write"
    (code0, output0, _), (code1, output1, _) = results["writers"]
    assert code1 == -9, output1[-4000:]
    assert code0 == 0, f"rank 0 hung or crashed (code {code0}):\n{output0[-4000:]}"
    survivor = json.loads((out / "rank0.json").read_text())
    assert survivor["raised"] and survivor["seconds"] < 60, survivor  # within the 20 s timeout (+ slack)
    assert survivor["error"].startswith("CheckpointWriteError") and "nothing was published" in survivor["error"], (
        survivor
    )
    from lightning_zero.checkpoint import is_checkpoint, load_model, open_checkpoint
    from lightning_zero.models.llama import Llama, LlamaConfig
    from tests.scripts.ckpt_write_fault import CONFIG

    opened = open_checkpoint(out / "last.ckpt")  # the previous (step-1) checkpoint, verified
    assert opened.state["global_step"] == 1
    assert [p.name for p in out.iterdir() if p.name.startswith("last.ckpt") and is_checkpoint(p)] == ["last.ckpt"]
    model = Llama(LlamaConfig(**CONFIG))
    load_model(opened, model)
    params = dict(model.named_parameters())
    for rank in (0, 1):
        for name, (lo, hi, values) in torch.load(out / f"good.rank{rank}.pt").items():
            assert torch.equal(params[name].detach().reshape(-1)[lo:hi], values), name
