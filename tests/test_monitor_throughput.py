"""tokens/s and MFU ([Note: throughput] in throughput.py) and their rows in ZeroMonitor's table."""

import logging

import pytest
import torch

from lightning_zero.models import LlamaConfig
from lightning_zero.planner.hardware import load_hardware
from lightning_zero.planner.workload import training_flops
from lightning_zero.runtime.throughput import ThroughputMeter, batch_tokens, peak_flops_for, training_flops_of


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_counts_tokens_per_step_and_mfu():
    clock = FakeClock()
    meter = ThroughputMeter(dp=4, peak_flops=1e12, clock=clock)
    for step_seconds in (5.0, 2.0, 2.0):  # the first step carries start-up time
        for _ in range(2):  # two micro batches of 8 x 128 tokens
            meter.micro_batch(8 * 128, 3e11)
            clock.now += step_seconds / 2
        meter.step_end()
    assert [s.seconds for s in meter.steps] == [5.0, 2.0, 2.0]
    assert meter.steps[0].tokens_per_s == pytest.approx(2048 / 5.0)
    steady = meter.summary()
    assert steady.tokens == 4096 and steady.seconds == 4.0
    assert steady.tokens_per_s == pytest.approx(1024.0)
    assert steady.tokens_per_s_total == pytest.approx(4096.0)
    assert steady.mfu == pytest.approx(4 * 3e11 / 4.0 / 1e12)
    assert ThroughputMeter(peak_flops=None).summary() is None


def test_tokens_and_flops_of_a_batch():
    config = LlamaConfig.from_name("tiny")
    assert batch_tokens(object(), torch.zeros(4, 33, dtype=torch.long)) == (4, 33)
    assert batch_tokens(object(), (torch.randn(4, 8), torch.zeros(4, 16, dtype=torch.long))) == (4, 16)
    assert training_flops_of(config, 123, 4, 32) == training_flops(config, micro_batch=4, seq_len=32)
    assert training_flops_of(None, 1000, 4, 32) == 6.0 * 1000 * 4 * 32
    hardware = load_hardware("h100_80gb")
    assert peak_flops_for("h100_80gb", torch.bfloat16) == hardware.peak_bf16_flops
    assert peak_flops_for("h100_80gb", torch.float32) == hardware.peak_fp32_flops
    assert peak_flops_for(None, torch.bfloat16) is None


def test_llama_module_counts_its_input_tokens():
    from lightning_zero.models import LlamaLM

    module = LlamaLM("tiny")
    assert batch_tokens(module, torch.zeros(2, 17, dtype=torch.long)) == (2, 16)  # inputs: one shorter


def _table(rank: int, caplog) -> str:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_zero.trainer.monitor import ZeroMonitor

    clock = FakeClock()
    monitor = ZeroMonitor(hardware="h100_80gb")
    monitor.throughput = ThroughputMeter(dp=2, peak_flops=1e12, clock=clock)
    for _ in range(3):
        monitor.throughput.micro_batch(1000, 5e11)
        clock.now += 1.0
        monitor.throughput.step_end()
    metrics = {
        f"zero/{kind}_{key}_bytes": 1.0
        for kind in ("measured", "predicted")
        for key in ("params", "grads", "optimizer", "total")
    }
    monitor.history = [{**metrics, "zero/sent_bytes_total": 2.0, "zero/overlap_fraction": 0.5}]
    # Listen on the logger rank_zero_info writes to, directly: earlier tests may have turned its
    # propagation to the root logger (what caplog reads) off.
    import lightning_utilities.core.rank_zero as rank_zero_module

    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = rank_zero_module.log
    previous, previous_level, previous_disabled = rank_zero_only.rank, logger.level, logger.disabled
    rank_zero_only.rank = rank
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        monitor.on_fit_end(None, None)
    finally:
        rank_zero_only.rank = previous
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
        logger.disabled = previous_disabled
    return "\n".join(records)


def test_end_table_shows_tokens_per_s_and_mfu_on_rank_zero_only(caplog):
    table = _table(0, caplog)
    assert "tokens/s" in table and "1,000.0  per rank" in table and "2,000.0  total (2 dp ranks)" in table
    assert "MFU" in table and "50.00%" in table
    assert _table(1, caplog) == ""


class _Engine:
    """What ``Monitor.micro_batch`` reads of an engine: ``dp_size`` is the group ZeRO shards over."""

    def __init__(self, dp_size: int) -> None:
        from lightning_zero.comm.collectives import CommCounter

        self.counter = CommCounter()
        self.device = torch.device("cpu")
        self.compute_dtype = torch.float32
        self.dp_size = dp_size

    def num_params(self) -> int:
        return 1000


def _steady(dims, engine_group: int, batch: torch.Tensor):
    """Two steps of one micro batch each (1 s apart) through ``Monitor.micro_batch``."""
    from lightning_zero.runtime.monitor import Monitor

    clock = FakeClock()
    monitor = Monitor()
    engine = _Engine(engine_group)
    monitor.micro_batch(engine, object(), batch, dims=dims)
    monitor.throughput.clock = clock
    monitor.throughput._since = clock()
    for _ in range(2):
        clock.now += 1.0
        monitor.throughput.step_end()
        monitor.micro_batch(engine, object(), batch, dims=dims)
    return monitor, monitor.throughput.summary()


def test_total_tokens_count_cp_slices_of_shared_samples_not_dp_ranks():
    """Under cp=2 with dp=2 ZeRO's group has 4 ranks; 2 take different samples, and each of
    those is cut in 2 slices of T/2 tokens: the total is per rank x dp x cp (the global tokens),
    and the table says so, not "4 dp ranks" ([Note: throughput])."""
    from lightning_zero.comm.mesh import ParallelDims

    dims = ParallelDims(world_size=4, devices_per_node=4, cp=2)
    # each rank: 2 sequences, its 1024-token slice of each (T = 2048)
    monitor, steady = _steady(dims, engine_group=4, batch=torch.zeros(2, 1024, dtype=torch.long))
    assert (steady.dp, steady.cp) == (2, 2)
    assert steady.tokens_per_s == pytest.approx(2048.0)
    assert steady.tokens_per_s_total == pytest.approx(2 * 2 * 2048 * 2 / 2)  # 2 dp x 2 sequences x 2048 tokens / s
    table = "\n".join(monitor._throughput_lines())
    assert "8,192.0  total (2 dp ranks x 2 cp ranks, each a 1/2 slice of the same samples)" in table
    assert "4 dp ranks" not in table


def test_total_tokens_count_every_dp_rank_of_a_hybrid_layout():
    """With shard_size ZeRO's group (the engine's ``dp_size``) is a shard group of 4 of the 8 dp
    ranks; every one of the 8 takes different samples."""
    from lightning_zero.comm.mesh import ParallelDims

    dims = ParallelDims(world_size=8, devices_per_node=4, shard_size=4)
    _, steady = _steady(dims, engine_group=4, batch=torch.zeros(2, 16, dtype=torch.long))
    assert (steady.dp, steady.cp) == (8, 1)
    assert steady.tokens_per_s_total == pytest.approx(8 * 32.0)
