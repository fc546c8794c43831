"""The benchmark scripts keep working: each runs on a 2-step tiny config and writes its JSON.

Not a timing test (numbers on 2 shared cores mean nothing here); it checks the plumbing: the
driver starts a fresh 2-process Lightning run per case, each rank probes and writes its results,
the driver merges them into the table and ``--out`` JSON.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
QUICK = ["--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1", "--bucket-mb", "0.05"]


def _run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script>`` with ``args`` in ``tmp_path``, one torch thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_bench_zero12_runs_and_writes_json(tmp_path):
    out = tmp_path / "zero12.json"
    logs = tmp_path / "logs"
    proc = _run(
        tmp_path, "bench_zero12.py", "--cases", "zero2", "ddp", *TINY, *QUICK, "--out", str(out), "--log-dir", str(logs)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "did not run" not in proc.stdout, proc.stdout
    for case in ("zero2", "ddp"):  # both ranks started by the driver, torchrun-style, each with its log
        rank0, rank1 = ((logs / "round0" / f"{case}{suffix}.log").read_text() for suffix in ("", ".rank1"))
        assert "GLOBAL_RANK: 0," in rank0 and "GLOBAL_RANK: 1," not in rank0, rank0[-2000:]  # not rank 0's child
        assert "GLOBAL_RANK: 1," in rank1, rank1[-2000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"zero2", "ddp"}
    for row in rows.values():
        assert row["step_s_median"] > 0
        assert all(cpu > 0 for cpu in row["cpu_s_round_medians"])  # CPU seconds per step, every round
        assert all(faults is not None and faults >= 0 for faults in row["minor_faults_round_medians"])
        assert len(row["peak_rss_bytes"]) == 2
    zero2 = rows["zero2"]
    # The engine's own counter and the tapped torch.distributed calls agree, and both equal
    # the ZeRO-2 formula 2 (dp-1)/dp * 4 B * P up to padding.
    tapped = sum(zero2["sent_bytes_per_step"][0].values())
    # (the tap also sees the per-step agreements, which the engine counts as control bytes)
    assert tapped == pytest.approx(zero2["engine_sent_bytes_per_step"] + zero2["engine_control_bytes_per_step"])
    assert 0 < zero2["engine_control_bytes_per_step"] < 1e-3 * zero2["engine_sent_bytes_per_step"]
    assert tapped == pytest.approx(zero2["predicted_sent_bytes_per_step"], rel=0.02)
    assert zero2["state_bytes"][0]["optimizer"] == pytest.approx(zero2["predicted_state_bytes"]["optimizer"], rel=0.02)


def test_a_benchmark_that_loses_a_case_exits_non_zero_after_writing_its_json(tmp_path):
    """A worker pair that fails (here: past a 1 s --case-timeout, still importing) leaves its row
    as "did not run" in the table and the JSON, and the driver exits 1 naming the case and round."""
    out = tmp_path / "zero12.json"
    proc = _run(tmp_path, "bench_zero12.py", "--cases", "ddp", *TINY, *QUICK, "--case-timeout", "1", "--out", str(out))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 case run(s) failed" in proc.stderr and "ddp round 0: timed out" in proc.stderr, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"] for row in rows] == ["ddp"] and "error" in rows[0], rows


@pytest.mark.slow
def test_bench_tp_sequence_parallel_rows_match_the_planner(tmp_path):
    """tp2 and tp2_sp side by side: each rank's activation bytes kept for backward equal the
    planner's (1%) and sequence parallelism keeps fewer; tp bytes per kind equal ``tp_bytes_by_kind``."""
    out = tmp_path / "tp.json"
    proc = _run(tmp_path, "bench_tp.py", "--cases", "tp2", "tp2_sp", *TINY, *QUICK, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "did not run" not in proc.stdout, proc.stdout
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"tp2", "tp2_sp"}
    for row in rows.values():
        assert row["step_s_median"] > 0
        want = row["predicted_saved_activation_bytes"]
        assert len(row["saved_activation_bytes"]) == 2
        for measured in row["saved_activation_bytes"]:
            assert measured == pytest.approx(want, rel=0.01), (row["case"], measured, want)
        counted = row["engine_sent_bytes_per_step_by_kind"][0]
        assert counted == pytest.approx(row["predicted_tp_sent_bytes_per_step_by_kind"]), row["case"]
        # the strategy's counter and the tapped torch.distributed calls agree
        assert sum(row["sent_bytes_per_step"][0].values()) == pytest.approx(sum(counted.values()))
    assert max(rows["tp2_sp"]["saved_activation_bytes"]) < min(rows["tp2"]["saved_activation_bytes"])
    assert "tp_all_gather_seq" in rows["tp2_sp"]["engine_sent_bytes_per_step_by_kind"][0]


@pytest.mark.slow
def test_bench_memory_runs_and_writes_json(tmp_path):
    """bench_memory at --size tiny: per rank the baseline, train-start and end points, the save
    stall and the planner's prediction land in the JSON (issue 24)."""
    out = tmp_path / "memory.json"
    proc = _run(tmp_path, "bench_memory.py", "--size", "tiny", "--cases", "zero3", "--steps", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "did not run" not in proc.stdout, proc.stdout
    payload = json.loads(out.read_text())
    (row,) = payload["memory"]
    assert row["case"] == "zero3" and len(row["ranks"]) == 2
    for rank in row["ranks"]:
        assert rank["baseline_rss"] > 0 and rank["end_peak_above"] >= rank["train_start_peak_above"]
        assert rank["fit_peak_above"] >= rank["end_peak_above"] and rank["save_stall_s"] > 0
        assert rank["teardown_peak_above"] is not None
    predicted = row["planner_memory"]
    assert predicted["total"] > predicted["model_states"] > 0 and predicted["prefetch_buffers"] > 0
    assert any(line.startswith("goal: zero3 peak") for line in payload["report"])


@pytest.mark.slow
def test_profile_step_names_the_engine_categories_and_counts_page_faults(tmp_path):
    """profile_step closes its profiler before training ends (a --quick run once died at exit with
    it still open) and reports the engine's own labels and each rank's minor page faults."""
    out = tmp_path / "profile.json"
    proc = _run(
        tmp_path, "profile_step.py", "--quick", "--models", "small", "--cases", "zero2", "--out", str(out)
    )  # --quick's 1 timed step against the default 4 profiled steps
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "minor page faults per step" in proc.stdout, proc.stdout[-3000:]
    zero2 = json.loads(out.read_text())["models"]["small"]["cases"]["zero2"]
    for category in ("grad hook: copy into bucket", "reduce-scatter launch", "param all-gather launch"):
        assert zero2["ms_per_step"][category] > 0, (category, zero2["ms_per_step"])
    (ranks,) = zero2["ranks_by_round"]
    assert len(ranks) == 2
    for rank in ranks:
        faults = rank["minor_faults_per_step"]
        assert faults["total"] >= faults["bench::forward"] + faults["bench::backward"] > 0, faults


@pytest.mark.slow
def test_planner_check_measures_every_case_it_predicts(tmp_path):
    """planner_check drives bench_zero12's workers with its own arguments: each case it predicts
    is also measured (a missing harness argument once left every measurement NaN)."""
    out = tmp_path / "check.json"
    hardware = str(ROOT / "benchmarks/results/cpu_calibrated_session3.yaml")
    proc = _run(
        tmp_path, "planner_check.py", "--quick", "--cases", "ddp", "zero2", "--hardware", hardware, "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    measured = payload["measured"]
    assert set(payload["predicted"]) == {"ddp", "zero2"}
    for case in ("ddp", "zero2"):
        assert measured[case]["error"] is None, measured[case]
        value = measured[case]["step_s_median"]
        assert value is not None and value == value and value > 0, (case, measured)  # not NaN, not missing


@pytest.mark.slow
def test_gloo_collectives_runs_and_writes_json(tmp_path):
    out = tmp_path / "gloo.json"
    proc = _run(tmp_path, "gloo_collectives.py", "--sizes-mb", "0.0625", "0.25", "--repeats", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["size_mb"] for row in rows] == [0.0625, 0.25]
    for row in rows:
        for case in ("all_reduce (ddp)", "gloo reduce_scatter", "ours reduce_scatter", "all_gather"):
            assert row[case] > 0, (case, row)


def test_planner_check_ranks_only_pairs_every_round_agrees_on():
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_check", ROOT / "benchmarks" / "planner_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rounds = {"ddp": [1.03, 0.91], "zero1": [1.08, 0.89], "zero2": [1.06, 0.95], "zero3_prefetch1": [1.2, 1.19]}
    pairs = check.told_apart(rounds)
    # zero3 is > 2% slower than each in both rounds; ddp than zero2 too; ddp/zero1 and zero1/zero2
    # flip; zero1/zero2 is within 2% in round 0 anyway
    assert pairs == {
        ("ddp", "zero3_prefetch1"): "ddp",
        ("zero1", "zero3_prefetch1"): "zero1",
        ("zero2", "zero3_prefetch1"): "zero2",
        ("ddp", "zero2"): "ddp",
    }
    predicted = {"ddp": 0.96, "zero1": 0.93, "zero2": 0.94, "zero3_prefetch1": 1.1}
    assert check.ranking_where_told_apart(predicted, pairs) == ["ddp/zero2"]
    assert check.ranking_where_told_apart({**predicted, "ddp": 0.9}, pairs) == []
    assert ("zero1", "zero2") not in check.told_apart({"zero1": [1.0, 1.0], "zero2": [1.01, 1.015]})


@pytest.mark.slow
def test_interleaved_ab_times_both_sides_in_one_pair_and_writes_json(tmp_path):
    out = tmp_path / "ab.json"
    proc = _run(
        tmp_path, "interleaved_ab.py", "--switch", "one_bucket_in_flight", "--stage", "2", "--quick",
        "--block", "1", "--pairs", "2", "--batch", "2", "--seq", "16", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(row["rank"], row["clock"]) for row in rows} == {(r, c) for r in (0, 1) for c in ("wall", "cpu")}
    for row in rows:  # 2 pairs of 1-step blocks: 2 timed steps a side
        assert len(row["a_steps_s"]) == len(row["b_steps_s"]) == 2, row
        low, high = row["interval_95"]
        assert low <= row["b_over_a"] <= high


def test_interleaved_ab_switch_and_ratio():
    import importlib.util

    import torch.distributed as dist

    import lightning_zero.zero.waits as waits

    spec = importlib.util.spec_from_file_location("interleaved_ab", ROOT / "benchmarks" / "interleaved_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    work = dist.Work()
    ab.SWITCHES["polled_waits"](None, True)  # B: the engine's waits see no c10d work under a handle, and poll
    try:
        assert waits.wire_work(work) is None
    finally:
        ab.SWITCHES["polled_waits"](None, False)
    assert waits.wire_work(work) is work
    assert ab.model_shape("issue24", quick=False) == {  # bench_zero12's issue-24 model, field by field
        "dim": 512, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 1408, "vocab_size": 4096,
    }  # fmt: skip
    assert ab.ratio_interval([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    ratio, low, high = ab.ratio_interval([1.0, 1.1, 0.9, 1.0], [1.2, 1.3, 1.1, 1.2])
    assert ratio == pytest.approx(1.2) and low <= ratio <= high and high > low


@pytest.mark.slow
def test_bench_pipeline_measures_the_bubble_beside_the_plan(tmp_path):
    out = tmp_path / "pipeline.json"
    proc = _run(tmp_path, "bench_pipeline.py", "--dim", "32", "--layers", "4", "--heads", "2", "--ffn", "64",
                "--vocab", "64", "--seq", "16", "--microbatches", "4", "--steps", "2", "--warmup", "1",
                "--schedules", "1f1b", "zbv", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["schedule"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1f1b", "zbv"}
    assert rows["1f1b"]["planned_equal_stages"] == pytest.approx(1 / 5)  # (pp - 1) / (m + pp - 1)
    for row in rows.values():
        assert len(row["measured_steps"]) == 2 and all(0 <= bubble < 1 for bubble in row["measured_steps"])
        assert 0 <= row["planned_measured_costs"] < 1
