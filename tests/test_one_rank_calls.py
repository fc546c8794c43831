"""Calls a script makes on rank 0 only inside a running job end in seconds (issue 61).

One 2-rank launch of tests/scripts/one_rank_calls.py per case. Before the fix a rank-0-only
``model.state_dict()`` at stage 3 or under bf16-mixed waited out ``collective_timeout`` (300 s),
and ``if trainer.is_global_zero: export(...)`` hung in ``open_checkpoint``'s verification forever.
"""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import ROOT, launch_ranks, script_env

SCRIPT = ROOT / "tests" / "scripts" / "one_rank_calls.py"
REFUSAL = "not every rank called it within"


def _launch(out: Path, case: str) -> tuple[list, str, dict, float]:
    """Exit codes, the ranks' output, rank 0's record, and seconds from the call until every rank ended."""
    codes, tails = launch_ranks([sys.executable, str(SCRIPT), str(out), case], cwd=out, env=script_env(ROOT),
                                timeout_s=120, world=2, log_prefix=case)  # fmt: skip
    ended = time.time()
    record = json.loads((out / f"{case}.rank0.json").read_text())
    return codes, tails, record, ended - record["called_at"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["statedict_trainer", "statedict_fabric"])
def test_a_state_dict_on_rank_zero_only_is_refused_by_name_within_seconds(tmp_path, case):
    """Trainer at stage 3, Fabric at stage 2 under bf16-mixed: rank 0's ``state_dict()`` raises the
    named refusal within 10 s ([Note: one rank's state_dict]); the rank that went on names it too
    (PeerFailedError), and both exit non-zero."""
    codes, tails, record, to_end = _launch(tmp_path, case)
    assert record["seconds"] < 10 and REFUSAL in record["error"], record
    assert codes == [1, 1], tails
    assert tails.count(REFUSAL) >= 2 and "PeerFailedError" in tails, tails
    assert to_end < 60, f"{to_end:.1f} s from the call until every rank ended\n{tails}"


@pytest.mark.slow
def test_export_on_rank_zero_inside_a_job_needs_no_peers(tmp_path):
    """``if trainer.is_global_zero: export(ckpt, out)`` then a barrier: the export is written on rank 0
    alone (every file verified there), the job ends normally, and the file is the one an export in
    another process writes."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import export

    codes, tails, record, _ = _launch(tmp_path, "export")
    assert codes == [0, 0] and record["error"] is None and record["seconds"] < 10, (record, tails)
    inside = load_file(str(tmp_path / "export.safetensors"))
    alone = load_file(str(export(tmp_path / "export.ckpt", tmp_path / "alone.safetensors")))
    assert inside.keys() == alone.keys() and all(torch.equal(inside[k], alone[k]) for k in alone)
