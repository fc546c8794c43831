"""ZeroStrategy(tensor_parallel_size=2) through Lightning on CPU (gloo).

tp=2 (dp=1) matches a single process; tp=2 x dp=2 matches dp=2 under ZeRO-1, 2 and 3 (with norm
clipping, which must count each parameter once); TP peers see the same batches, dp peers do not.
The same holds with ``sequence_parallel=True``, and checkpoints move between the two layouts.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed import assert_same_params, launch_each, rank_result

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = [
    (1, ["single"]),
    (2, ["tp2", "dp2_zero1", "dp2_zero2", "tp2_sp"]),
    (
        4,
        [
            "tp2dp2_zero1",
            "tp2dp2_zero2",
            "tp2dp2_zero3",
            "tp2dp2_sp_zero1",
            "tp2dp2_sp_zero2",
            "tp2dp2_sp_zero3",
            "resume_sp_ckpt_plain",
            "resume_plain_ckpt_sp",
        ],
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_each("tp_parity.py", tmp_path_factory.mktemp("tp"), LAUNCHES, timeout_s=400)


_load = rank_result


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, reference",
    [
        ("tp2", "single"),
        ("tp2dp2_zero1", "dp2_zero1"),
        ("tp2dp2_zero2", "dp2_zero2"),
        ("tp2dp2_zero3", "dp2_zero2"),
        ("tp2_sp", "single"),
        ("tp2_sp", "tp2"),
        ("tp2dp2_sp_zero1", "dp2_zero1"),
        ("tp2dp2_sp_zero1", "tp2dp2_zero1"),
        ("tp2dp2_sp_zero2", "dp2_zero2"),
        ("tp2dp2_sp_zero2", "tp2dp2_zero2"),
        ("tp2dp2_sp_zero3", "dp2_zero2"),
        ("tp2dp2_sp_zero3", "tp2dp2_zero3"),
    ],
)
def test_tp_matches_reference(results, case, reference):
    got, want = _load(results, case), _load(results, reference)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-5)
    assert_same_params(got["params"], want["params"])


@pytest.mark.slow
def test_tp_peers_share_batches_dp_peers_do_not(results):
    batches = [_load(results, "tp2dp2_zero2", rank)["batches"] for rank in range(4)]
    assert batches[0] == batches[1] and batches[2] == batches[3]  # one TP group each
    assert batches[0] != batches[2]  # different dp ranks
    # ... and dp rank r sees what dp rank r sees without TP.
    assert batches[0] == _load(results, "dp2_zero2", 0)["batches"]
    assert batches[2] == _load(results, "dp2_zero2", 1)["batches"]


@pytest.mark.slow
def test_tp_and_dp_traffic_counted_together(results):
    tp_only = _load(results, "tp2")["sent"]  # dp = 1: no dp collective is issued at all
    assert tp_only.get("tp_all_reduce", 0) > 0
    assert "reduce_scatter_grads" not in tp_only and "all_gather_params" not in tp_only
    both = _load(results, "tp2dp2_zero2")["sent"]
    assert both["tp_all_reduce"] > 0 and both["reduce_scatter_grads"] > 0 and both["all_gather_params"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["resume_sp_ckpt_plain", "resume_plain_ckpt_sp"])
def test_checkpoint_resumes_across_sequence_parallel(results, case):
    """A step-2 checkpoint saved with sequence parallelism resumes without it (and the other way
    round) and continues with the uninterrupted run's steps 3-4, on every rank."""
    for rank in range(4):
        got = torch.tensor(_load(results, case, rank)["losses"])
        want = torch.tensor(_load(results, "tp2dp2_zero2", rank)["losses"][2:])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sequence_parallel_replaces_the_activation_all_reduce(results):
    """Same TP bytes (the reduce-scatter and all-gather of sequence parallelism move what the
    all-reduce did), no activation all-reduce left; the norm gains' gradient sums come on top."""
    plain, sp = _load(results, "tp2")["sent"], _load(results, "tp2_sp")["sent"]
    assert "tp_all_reduce" not in sp
    moved = sp["tp_all_gather_seq"] + sp["tp_reduce_scatter_seq"]
    assert moved == pytest.approx(plain["tp_all_reduce"], rel=1e-12)
    assert 0 < sp["tp_all_reduce_norm_grad"] < 1e-2 * moved
