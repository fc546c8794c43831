"""The CUDA/NCCL path, pinned on CPU (issue 46): what a one-rank group sends with the wire forced,
the NCCL timeout the strategy sets, the abort path's errors, offloaded state kept on the host,
and the planner's hardware files read without omegaconf."""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank_gloo(monkeypatch):
    from lightning_zero.ports import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _launch_spy(monkeypatch):
    calls = []
    for name in ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor",
                 "reduce_scatter_single", "all_gather_single"):  # fmt: skip
        real = getattr(dist, name, None)
        if real is None:
            continue

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    from lightning_zero.comm import collectives

    monkeypatch.setattr(
        collectives, "_reduce_scatter", getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    )
    monkeypatch.setattr(
        collectives, "_all_gather", getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )
    return calls


def test_one_rank_group_goes_on_the_wire_only_when_forced(one_rank_gloo, monkeypatch):
    """[Note: one rank on the wire]: a one-rank group short-circuits; forced, the same calls launch
    real collectives (and compression's all-to-all) with the local results."""
    from lightning_zero.comm.collectives import WIRE_ONE_RANK_ENV, all_gather, all_reduce, local_only, reduce_scatter
    from lightning_zero.comm.compression import reduce_scatter_compressed

    calls = _launch_spy(monkeypatch)
    x = torch.arange(8.0)

    def run():
        out = torch.empty(8)
        reduce_scatter(out, x.clone(), None, async_op=True).wait()
        gathered = torch.empty(8)
        all_gather(gathered, x.clone(), None, async_op=True).wait()
        summed = x.clone()
        all_reduce(summed, None, op=dist.ReduceOp.MAX)
        compressed = torch.empty(8)
        reduce_scatter_compressed(compressed, x.clone(), None, "bf16", async_op=True).wait()
        return out, gathered, summed, compressed

    monkeypatch.delenv(WIRE_ONE_RANK_ENV, raising=False)
    assert local_only(1) and not local_only(2)
    local = run()
    assert calls == []
    monkeypatch.setenv(WIRE_ONE_RANK_ENV, "1")
    assert not local_only(1)
    wired = run()
    assert "all_reduce" in calls and "all_to_all_single" in calls and len(calls) == 4, calls
    for a, b in zip(local, wired):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_collective_timeout_becomes_the_nccl_groups_timeout(one_rank_gloo, monkeypatch):
    """[Note: collective timeout on NCCL]: every NCCL group the engine uses gets collective_timeout as
    its watchdog timeout, once each; gloo groups and collective_timeout=None are left alone."""
    from lightning_zero.zero import waits

    set_calls = []
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda t, g: set_calls.append((t, g)))
    assert waits.hold_collective_timeout([None, dist.group.WORLD], 300.0) == []  # gloo: sliced waits
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert waits.hold_collective_timeout([None], None) == []
    done = waits.hold_collective_timeout([None, dist.group.WORLD], 300.0)
    assert set_calls == [(timedelta(seconds=300), dist.group.WORLD)] and done == [dist.group.WORLD]
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    with pytest.raises(RuntimeError, match="collective_timeout"):
        waits.hold_collective_timeout([None], 300.0)


def test_strategy_sets_the_nccl_timeout_from_collective_timeout(monkeypatch):
    """ZeroStrategy.setup_environment (through ZeroSession.start, shared with the Fabric door) hands
    every group it built to hold_collective_timeout."""
    import lightning as L

    from lightning_zero import ZeroStrategy
    from lightning_zero.runtime import session as session_module

    seen = []
    monkeypatch.setattr(session_module, "hold_collective_timeout", lambda groups, t: seen.append((list(groups), t)))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from lightning_zero.ports import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = ZeroStrategy(stage=2, collective_timeout=123.0, monitor=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False)
    try:
        trainer.strategy.setup_environment()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == [([None], 123.0)]


def test_abort_path_errors_name_the_collective(monkeypatch):
    """[Note: NCCL abort]: after the abort clears the default group, the next dist call's ValueError
    counts as a collective's error (so it is rewritten to name the failing rank); the user's own
    ValueError does not; a torch without the abort API fails at setup, not at the failure."""
    from lightning_zero.trainer.failure_path import is_collective_error
    from lightning_zero.zero import waits

    gone = ValueError("Default process group has not been initialized, please make sure to call init_process_group.")
    assert is_collective_error(gone)
    assert is_collective_error(ValueError("Invalid process group specified or has been destroyed."))
    assert is_collective_error(RuntimeError("nccl communicator was aborted on rank 1"))  # any case
    assert not is_collective_error(ValueError("bad learning rate"))
    assert not is_collective_error(RuntimeError("shape mismatch in my layer"))

    aborted = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: aborted.append(group))
    abort = waits.abort_nccl_after(grace_s=0.0)
    abort()
    for _ in range(200):
        if aborted:
            break
        import time

        time.sleep(0.01)
    assert aborted == [None]

    def already_gone(group=None):
        raise ValueError("Invalid process group specified or has been destroyed.")

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", already_gone)
    waits.abort_nccl_after(grace_s=0.0)()  # no traceback from the thread: already destroyed is fine
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    with pytest.raises(RuntimeError, match="_abort_process_group"):
        waits.abort_nccl_after()


def test_offloaded_optimizer_state_is_not_moved_to_the_device(monkeypatch, tmp_path):
    """offload_optimizer with an optimizer that creates its state in __init__ (Adagrad): the
    strategy's move of optimizer state to the root device skips what the engine keeps on the host
    (on CUDA it would put Adagrad's sums on the GPU beside host masters and gradients)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroStrategy
    from lightning_zero.models import LlamaLM
    from lightning_zero.ports import free_port
    from lightning_zero.trainer import strategy as strategy_module

    moved = []
    real = strategy_module.optimizers_to_device
    monkeypatch.setattr(
        strategy_module, "optimizers_to_device", lambda opts, dev: (moved.append(list(opts)), real(opts, dev))
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    class AdagradLM(LlamaLM):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=1e-2)

    cfg = dict(name="t", vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    model = AdagradLM(cfg)
    rows = list(torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0)))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2, offload_optimizer=True, monitor=False),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, DataLoader(rows, batch_size=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    assert moved == [[]], moved  # the Adagrad the engine offloaded is not handed to the move


def test_hardware_files_read_without_omegaconf():
    """The planner's hardware configs load with omegaconf and hydra unimportable (the lent GPU
    machine has neither), and PyYAML reads every file to the same values OmegaConf does."""
    from omegaconf import OmegaConf

    from lightning_zero.planner.hardware import HARDWARE_DIR, Hardware, _read_yaml

    for path in sorted(HARDWARE_DIR.glob("*.yaml")):
        assert Hardware.from_mapping(_read_yaml(path)) == Hardware.from_mapping(
            OmegaConf.to_container(OmegaConf.load(path))
        )
    code = (
        "import sys\n"
        "sys.modules['omegaconf'] = None\nsys.modules['hydra'] = None\n"
        "from lightning_zero.planner.hardware import load_hardware, default_hardware_name\n"
        "from lightning_zero.runtime.throughput import peak_flops_for\n"
        "import torch\n"
        "print(load_hardware('h200_141gb').memory_bytes, default_hardware_name(), peak_flops_for('h200_141gb', torch.bfloat16))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "150754820096"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("device_like", [False, True])
def test_no_host_read_inside_backward_on_a_device(one_rank_gloo, monkeypatch, stage, device_like):
    """[Note: markers off the host path] and [Note: collectives in flight] in reducer.py: with waits
    that do not block the host (``poll=False``, as on NCCL) no ``.tolist()/.item()/.cpu()`` runs
    between the first bucket's launch and ``finish_grad_sync``, and stage 1 sets no in-flight limit
    of the reducer's own; on CPU the marker is checked at the first bucket wait, as before."""
    from lightning_zero.comm.collectives import WIRE_ONE_RANK_ENV
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    monkeypatch.setenv(WIRE_ONE_RANK_ENV, "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    config = ZeroConfig(stage=stage, bucket_mb=0.01, max_buckets_in_flight=1, collective_timeout=None)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())], config)
    reducer = engine.reducer
    reducer.waiter.poll = not device_like
    assert reducer.markers.waiter is reducer.waiter
    window = {"open": False}
    reads = []
    launch, finish = reducer._launch, reducer.finish_grad_sync

    def first_launch(bucket):
        window["open"] = True
        return launch(bucket)

    def finishing():
        window["open"] = False
        return finish()

    monkeypatch.setattr(reducer, "_launch", first_launch)
    monkeypatch.setattr(reducer, "finish_grad_sync", finishing)
    for name in ("tolist", "item", "cpu"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            if window["open"]:
                reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    for _ in range(2):
        engine.pre_backward()
        model(torch.randn(8, 64)).square().mean().backward()
        engine.post_backward()
    assert len(reducer.buckets) >= 3
    if device_like:
        assert reads == [], reads
        if stage == 1:
            assert reducer.in_flight_high_water > config.max_buckets_in_flight
    else:
        assert "tolist" in reads  # the CPU path checks the marker at the first bucket wait
        assert reducer.in_flight_high_water == config.max_buckets_in_flight
    engine.close()
