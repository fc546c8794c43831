"""Conformance matrix (issue 11): third-party and odd-shaped models under ZeRO stages 1-3 vs ddp.

One launch of tests/scripts/conformance.py (2 gloo CPU ranks) trains every case under ddp, zero1,
zero2 and zero3 with the same seed and data; each test here judges one case x stage from its
records (tests/scripts/conformance_check.py ``judge``): per-step losses to 1e-5 in fp32,
validation losses, the plain forward after fit, parameters after fit, ties after fit and the
case's own checks (rotary buffer, callback forwards, bytes sent per step).

``LZ_TEST_SRC=/path/to/checkout/src`` runs the matrix against another checkout's engine.
"""

from __future__ import annotations

import pytest
import torch

from tests.scripts.conformance_check import (
    BF16_CASES,
    DYNAMIC_CASES,
    UNUSED_BY_EVERY_RANK,
    ZERO,
    all_runs,
    cases_of,
    judge,
    run_matrix,
)

CASES = cases_of(all_runs())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance")
    run_matrix(out, budget_s=540)  # under pytest-timeout's 600 s
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", ZERO)
@pytest.mark.parametrize("case", CASES)
def test_matches_ddp(matrix, case, stage):
    verdict = judge(matrix, case, stage)
    assert verdict.ok, f"{case} under {stage}:\n  " + "\n  ".join(verdict.problems)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_ddp_reference_trains(matrix, case):
    """The reference itself ran and learned something (else every comparison above is moot)."""
    import torch

    from tests.scripts.conformance_check import _failures, _load

    records = _load(matrix, f"{case}-ddp")
    assert not _failures(records), _failures(records)
    for record in records:
        losses = torch.tensor(record["losses"])
        # 4 steps; the GAN counts each of its 3 optimizer steps per batch (Lightning's manual
        # optimization), so it trains 2 batches.
        assert len(losses) >= 2 and torch.isfinite(losses).all()
    if case not in BF16_CASES:
        assert records[0]["losses"][-1] != records[0]["losses"][0]


def test_checkpoint_cases_are_the_flagged_ones():
    """The judge demands a checkpoint round trip exactly for the cases the script saves."""
    from pathlib import Path

    from tests.scripts.conformance_check import CHECKPOINT_CASES

    script = (Path(__file__).parent / "scripts" / "conformance.py").read_text()
    flagged = {
        line.split('"')[1] for line in script.splitlines() if line.startswith('    "') and "checkpoint=True" in line
    }
    assert flagged == CHECKPOINT_CASES


@pytest.mark.slow
@pytest.mark.parametrize("stage", ZERO)
@pytest.mark.parametrize("case", sorted(DYNAMIC_CASES))
def test_ranks_running_different_modules_train_under_every_stage(matrix, case, stage):
    """An MoE skipping idle experts, LayerDrop per rank, a tower run on some ranks only: every
    stage trains them (no hang, no error; ZeRO-3 turns the phase dynamic), the ranks really ran
    different modules in some step (the same ones as under ddp), where the case says so some module
    went unused on every rank in some optimizer step (what ddp leaves untouched), and the first
    step's loss equals ddp's (every step's, and the weights, are judged by ``test_matches_ddp``)."""
    from tests.scripts.conformance_check import BF16_DDP_TOL, BF16_DDP_TOL_BY_CASE, LOSS_TOL, _failures, _load, within

    records, reference = _load(matrix, f"{case}-{stage}"), _load(matrix, f"{case}-ddp")
    assert not _failures(records), _failures(records)
    ran = [record["extra"]["ran"] for record in records]
    assert any(a != b for a, b in zip(*ran)), f"{case}: the ranks ran the same modules in every step: {ran}"
    assert ran == [record["extra"]["ran"] for record in reference], "the ranks ran other modules than under ddp"
    if case in UNUSED_BY_EVERY_RANK:
        modules, per_step = UNUSED_BY_EVERY_RANK[case]
        steps = range(0, len(ran[0]), per_step)
        used = [{m for rank in ran for batch in rank[start : start + per_step] for m in batch} for start in steps]
        assert any(set(modules) - step for step in used), f"{case}: every module ran on some rank in every step: {ran}"
    tol = BF16_DDP_TOL_BY_CASE.get(case, BF16_DDP_TOL) if case in BF16_CASES else LOSS_TOL  # bf16: in ulps
    for record, want in zip(records, reference):
        got, expected = record["losses"][:1], want["losses"][:1]
        assert within(torch.tensor(got), torch.tensor(expected), tol), (got, expected)
