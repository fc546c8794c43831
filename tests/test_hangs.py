"""Hazards that used to hang (issue 11): each finishes, or ends in an error on every rank within
seconds, never a hang. 2 gloo CPU ranks, Lightning's default 30-minute process-group timeout, so
only the engine can turn a stuck collective into an error; every run is killed after
``HANG_RUN_TIMEOUT_S`` (45 s) and then fails here as a hang. See tests/scripts/hang_cases.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.scripts.conformance_check import _error_lines, _load, record_path, run_matrix

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hang_cases.py"
ERROR_WITHIN_S = 20.0  # from the hazard to the error, on every rank
MODULE_NAME = r"'(extra\.0|head|inp|blocks\.\d)[.']"  # a module of hang_cases.HazardNet, quoted
RUNS = [
    *(f"no_trainable-{s}" for s in ("ddp", "zero1", "zero2", "zero3")),
    *(f"uneven_val-{s}" for s in ("ddp", "zero1", "zero2", "zero3")),
    "divergence_skip-zero3",
    "divergence_extra-zero3",
    "stuck_collective-zero2",
    "stuck_collective-zero3",
]


@pytest.fixture(scope="module")
def hangs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hangs")
    run_matrix(out, RUNS, script=SCRIPT, budget_s=540)  # under pytest-timeout's 600 s
    return out


def _finished(out: Path, run: str) -> list[dict]:
    records = _load(out, run)
    problems = [_error_lines(r, rank) for rank, r in enumerate(records) if r is None or not r.get("ok")]
    assert not problems, f"{run} did not finish on every rank:\n  " + "\n  ".join(problems)
    return records


def _failed_in_time(out: Path, run: str) -> list[str]:
    """Every rank ended in an error (not a hang) within ERROR_WITHIN_S of the hazard; their messages."""
    records = _load(out, run)
    messages = []
    for rank, record in enumerate(records):
        assert record is not None, f"{run}: rank {rank} left no record ({record_path(out, run, rank).name})"
        assert not record.get("ok"), f"{run}: rank {rank} finished without an error"
        assert not record.get("hang"), f"{run}: rank {rank} hung: {_error_lines(record, rank)}"
        after = record.get("error_after_s")
        assert after is not None and after < ERROR_WITHIN_S, (
            f"{run}: rank {rank} failed {after} s after the hazard (limit {ERROR_WITHIN_S} s): {_error_lines(record, rank)}"
        )
        messages.append(_exception_lines(record["error"]))
    return messages


def _exception_lines(traceback_text: str) -> str:
    """The exception lines of a (possibly chained) traceback, joined: what the user reads."""
    skip = ("Traceback", "During handling", "The above exception")
    return " || ".join(
        line
        for line in traceback_text.splitlines()
        if line.strip() and not line[0].isspace() and not line.startswith(skip)
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_loss_reaching_no_trainable_parameter_finishes(hangs, stage):
    """Rank 1's loss at step 2 reaches no trainable parameter: the step finishes with rank 1
    contributing zero gradients (ddp's reference run: the same loss plus 0 * output, since ddp
    itself hangs when no gradient hook fires on a rank)."""
    got, want = _finished(hangs, f"no_trainable-{stage}"), _finished(hangs, "no_trainable-ddp")
    for rank in range(2):
        torch.testing.assert_close(
            torch.tensor(got[rank]["losses"]), torch.tensor(want[rank]["losses"]), rtol=1e-5, atol=1e-6
        )
        for name, value in want[rank]["params"].items():
            torch.testing.assert_close(
                got[rank]["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_uneven_validation_batches_work(hangs, stage):
    """Rank 0 has 3 validation batches, rank 1 has 2 (fit's validation and validate()): as ddp."""
    got, want = _finished(hangs, f"uneven_val-{stage}"), _finished(hangs, "uneven_val-ddp")
    for rank in range(2):
        assert len(want[rank]["val_losses"]) == 2 * (3 - rank)
        torch.testing.assert_close(
            torch.tensor(got[rank]["val_losses"]), torch.tensor(want[rank]["val_losses"]), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            torch.tensor(got[rank]["losses"]), torch.tensor(want[rank]["losses"]), rtol=1e-5, atol=1e-6
        )


@pytest.mark.slow
def test_stage3_divergence_after_first_step_errors_on_every_rank(hangs):
    """From step 2 on rank 1 runs the block ``extra.0`` twice: every rank raises within seconds,
    naming a module (``extra.0`` or the unit whose gather it displaced), the step and the rank --
    not only a peer's "connection closed"."""
    for rank, message in enumerate(_failed_in_time(hangs, "divergence_extra-zero3")):
        assert re.search(MODULE_NAME, message), f"rank {rank}: {message}"
        assert re.search(r"\bstep\b", message), f"rank {rank}: {message}"
        assert re.search(r"\brank\b", message), f"rank {rank}: {message}"


@pytest.mark.slow
def test_stage3_block_skipped_after_first_step_never_hangs(hangs):
    """From step 2 on rank 1 skips ``extra.0``: either both ranks finish (the block counts as
    unused there) or both raise within seconds naming it; never a hang, never one rank alone."""
    records = _load(hangs, "divergence_skip-zero3")
    if all(r is not None and r.get("ok") for r in records):
        return
    for rank, message in enumerate(_failed_in_time(hangs, "divergence_skip-zero3")):
        assert re.search(MODULE_NAME, message), f"rank {rank}: {message}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_collective_timeout_turns_a_stuck_collective_into_an_error(hangs, stage):
    """Rank 1 is stuck in user code for 10 s at step 2; with ``collective_timeout=3`` rank 0
    raises within seconds saying what it waited on (then rank 1 fails too)."""
    messages = _failed_in_time(hangs, f"stuck_collective-{stage}")
    assert "collective_timeout" in messages[0], messages[0]
    assert re.search(r"gather|reduce|bucket|unit", messages[0]), messages[0]
