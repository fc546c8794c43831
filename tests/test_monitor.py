"""ZeroMonitor's numbers against the engine's counters, and the planner against a real run."""

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import launch, rank_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from monitor_run import CASES, CONFIG  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor")
    launch("monitor_run.py", out, timeout_s=500)
    return out


_load = rank_result


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_logged_bytes_equal_engine_counters(results, case):
    for rank in (0, 1):
        got = _load(results, case, rank)
        assert len(got["history"]) == len(got["sent"]) == 3
        for metrics, sent in zip(got["history"], got["sent"]):
            for kind, value in sent.items():
                assert metrics[f"zero/sent_bytes/{kind}"] == value
            assert metrics["zero/sent_bytes_total"] == sum(sent.values())
            for key in ("params", "grads", "optimizer", "total"):
                assert metrics[f"zero/measured_{key}_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_logger_no_log_calls(results, case):
    # Trainer(logger=False): the monitor keeps its history but does not call self.log (Lightning
    # warned once per metric, 22 times, "You called `self.log(...)` but have no logger configured").
    for rank in (0, 1):
        got = _load(results, case, rank)
        assert got["no_logger_warnings"] == []
        assert len(got["history"]) == 3


@pytest.mark.slow
def test_overlap_reporting(results):
    serial = _load(results, "s2_32-true_serial")["history"]
    for metrics in serial:  # launched only after backward: all exposed, nothing hidden
        assert metrics["zero/first_launch_before_backward_end"] == 0.0
        assert metrics["zero/overlap_fraction"] == 0.0
        assert metrics["zero/exposed_comm_s"] == pytest.approx(metrics["zero/comm_s"])
    overlapped = _load(results, "s2_32-true_overlap")["history"]
    for metrics in overlapped:  # several buckets: the first starts while backward still runs
        assert metrics["zero/first_launch_before_backward_end"] == 1.0
        assert metrics["zero/overlap_fraction"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_planner_model_states_equal_measured(results, case):
    from lightning_zero.models import LlamaConfig
    from lightning_zero.planner import plan_run

    stage, precision, *_ = CASES[case]
    measured = _load(results, case)["measured"]
    plan = plan_run(
        LlamaConfig.from_name("tiny", **{k: v for k, v in CONFIG.items() if k != "name"}),
        stage=stage,
        world_size=2,
        devices_per_node=2,
        precision=precision,
        micro_batch=2,
        seq_len=16,
        hardware="h100_80gb",
    )
    assert plan.num_params == measured["num_params"]
    element = 4 if precision == "32-true" else 2
    pad = measured["padding"]
    # Model states between steps: the planner's formula, up to the engine's per-bucket padding
    # (Adam's moments cover each parameter's owned run, not the padding, plus a scalar `step` per run).
    assert 0 <= measured["params"] - plan.memory.params <= pad * element
    assert 0 <= measured["grads"] - plan.memory.grads <= pad * element
    assert 0 <= measured["master"] - plan.memory.master_weights <= pad * 4
    assert -pad * 8 <= measured["optimizer_state"] - plan.memory.optimizer_moments <= pad * 8 + 4 * 64


class _FakeEngine:
    def __init__(self, overlap_possible: bool, device: str) -> None:

        self.overlap_comm = True
        self._possible = overlap_possible
        self.device = torch.device(device)
        self.compute_dtype = torch.float32
        self.bucket_mb = 25.0
        self.bucket_mb_auto = False

    def overlap_possible(self) -> bool:
        return self._possible

    def num_params(self) -> int:
        return 3_279_104


def _warnings_for(engine, fraction, monkeypatch):
    import lightning_zero.trainer.monitor as monitor_module

    seen = []
    monkeypatch.setattr(monitor_module, "rank_zero_warn", lambda message, **_: seen.append(message))
    monitor = monitor_module.ZeroMonitor()
    monitor.history = [{}, {}]
    for step in range(3):
        monitor._maybe_warn_overlap(engine, {"zero/overlap_fraction": fraction}, comm=0.01, step=step)
    return seen


def test_single_bucket_per_group_warns_once_naming_the_fix(monkeypatch):
    seen = _warnings_for(_FakeEngine(overlap_possible=False, device="cpu"), 0.0, monkeypatch)
    assert len(seen) == 1
    assert "fit in one bucket" in seen[0] and "bucket_mb to about 3.1" in seen[0]


def test_single_bucket_under_auto_bucket_mb_gives_no_advice_to_set_it(monkeypatch):
    """A run that never set bucket_mb ("auto" chose one bucket for a small model) is not told to set it."""
    engine = _FakeEngine(overlap_possible=False, device="cpu")
    engine.bucket_mb_auto = True
    assert _warnings_for(engine, 0.0, monkeypatch) == []


def test_low_hidden_fraction_warns_on_cuda_only(monkeypatch):
    assert _warnings_for(_FakeEngine(overlap_possible=True, device="cpu"), 0.1, monkeypatch) == []
    seen = _warnings_for(_FakeEngine(overlap_possible=True, device="cuda"), 0.1, monkeypatch)
    assert len(seen) == 1 and "only 10%" in seen[0]


@pytest.mark.slow
def test_throughput_is_logged_per_step(results):
    """tokens/s of the step (2 sequences x 16 input tokens per rank), x dp in total; no MFU on CPU
    without a hardware config ([Note: throughput] in throughput.py)."""
    for rank in (0, 1):
        for metrics in _load(results, "s2_32-true_overlap", rank)["history"]:
            assert metrics["zero/step_time_s"] > 0
            assert metrics["zero/tokens_per_s"] * metrics["zero/step_time_s"] == pytest.approx(32)
            assert metrics["zero/tokens_per_s_total"] == pytest.approx(2 * metrics["zero/tokens_per_s"])
            assert "zero/mfu" not in metrics
