"""The ``lightning-zero`` command line: dispatch, fail-fast errors, and 2-process training smoke tests.

Training runs in a subprocess (Lightning re-executes the command line for local rank 1, which inside
pytest would re-run pytest); its process group is killed on timeout so no rank is left behind.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
from omegaconf import OmegaConf

from lightning_zero.cli import RESOLVED_CONFIG, main
from tests.distributed import script_env

ROOT = Path(__file__).resolve().parents[1]

# A few steps of the tiny model on short sequences: seconds per step on 2 shared cores.
FAST = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "data.seq_len=64",
    "data.batch_size=4",
]


def run_cli(args: Sequence[str], cwd: Path, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_zero ARGS``; on timeout kill its whole process group and fail."""
    env = script_env(ROOT, HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_zero", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"lightning-zero {' '.join(args)} did not finish in {timeout:.0f}s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, None)


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def last_value(rows: list[dict[str, str]], key: str) -> float:
    values = [float(row[key]) for row in rows if row.get(key)]
    assert values, f"no {key} in metrics.csv"
    return values[-1]


def assert_trained(result: subprocess.CompletedProcess, run_dir: Path, steps: int) -> list[dict[str, str]]:
    """Exit 0, both ranks ran in ``run_dir``, metrics and the resolved config are there."""
    assert result.returncode == 0, result.stdout[-6000:]
    assert (run_dir / "train_ddp_process_1.log").exists(), "local rank 1 did not run in the same run dir"
    rows = read_metrics(run_dir)
    assert max(int(row["step"]) for row in rows) >= steps - 1
    loss = last_value(rows, "train_loss")
    assert 0.0 < loss < 10.0
    resolved = OmegaConf.load(run_dir / RESOLVED_CONFIG)
    assert resolved.trainer.max_steps == steps
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    return rows


# --------------------------------------------------------------------------------------------
# Dispatch and fail-fast errors (in process)
# --------------------------------------------------------------------------------------------


def test_no_command_prints_usage(capsys):
    main([])
    assert "lightning-zero COMMAND" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trian"])
    assert exit_info.value.code == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_unknown_recipe_fails_before_hydra_and_lists_recipes(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=llama8b"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'llama8b'" in err and "tiny" in err
    assert not (tmp_path / "outputs").exists()


def test_plan_prints_and_writes_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning_zero.planner")
    monkeypatch.chdir(tmp_path)
    main(["plan", "model=llama7b", "trainer=gpu", "plan.format=json"])
    assert "7b" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Training smoke tests: 2 CPU processes in a subprocess
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_two_cpu_processes_writes_metrics_and_config(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["train", "strategy=zero2", *FAST, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert_trained(result, run_dir, steps=3)
    assert "lightning-zero: 3 steps" in result.stdout

    # ... and `lightning-zero export` turns its sharded last.ckpt into a plain Llama state dict.
    out = tmp_path / "tiny.safetensors"
    main(["export", str(run_dir / "checkpoints" / "last.ckpt"), str(out)])
    from safetensors.torch import load_file

    from lightning_zero.models import Llama, LlamaConfig

    state = load_file(str(out))
    model = Llama(LlamaConfig.from_name("tiny"))
    model.load_state_dict(state)  # strict: every key and shape of the plain layout


def test_strategy_options_are_the_strategies(tmp_path):
    # The schema the zero{1,2,3} YAMLs extend is no strategy a user can pick (it used to be listed).
    proc = run_cli(["plan", "strategy=zero4"], tmp_path)
    assert proc.returncode != 0
    listed = proc.stdout.split("Available options in 'strategy':", 1)[1].split("Config search path", 1)[0].split()
    assert listed == ["ddp", "zero1", "zero2", "zero3"], proc.stdout[-2000:]
