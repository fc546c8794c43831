"""The planner's step-time model (planner/timing.py) against hand-computed cases, the layout search,
the calibration command, and the planner package's structure."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_zero.planner import load_hardware, plan_run, search_layouts
from lightning_zero.planner.calibrate import fit_latency_bandwidth
from lightning_zero.planner.hardware import Link, collective_seconds
from lightning_zero.planner.timing import simulate_backward, simulate_forward
from lightning_zero.planner.workload import PlannedBucket, Tensor, Workload

SRC = Path(__file__).resolve().parents[1] / "src"
H100 = "h100_80gb"


# ---------------------------------------------------------------------------- one collective


def test_collective_time_is_latency_steps_plus_bytes_over_bandwidth():
    link = Link(latency_s=10e-6, bytes_per_s=50e9)
    # all-reduce of 1 GB over 8 ranks: 2 * 7 ring steps, 2 * 7/8 GB sent
    assert collective_seconds("all_reduce", 1e9, 8, link) == pytest.approx(14 * 10e-6 + 1.75e9 / 50e9)
    # reduce-scatter / all-gather: 7 steps, 7/8 GB
    assert collective_seconds("reduce_scatter", 1e9, 8, link) == pytest.approx(7 * 10e-6 + 0.875e9 / 50e9)
    assert collective_seconds("all_gather", 1e9, 8, link) == pytest.approx(7 * 10e-6 + 0.875e9 / 50e9)
    assert collective_seconds("all_gather", 1e9, 1, link) == 0.0  # a group of one sends nothing
    slow = Link(10e-6, 50e9, time_factor=(("reduce_scatter", 2.5),))  # a calibrated backend quirk
    assert collective_seconds("reduce_scatter", 1e9, 8, slow) == pytest.approx(2.5 * (7 * 10e-6 + 0.875e9 / 50e9))
    assert collective_seconds("all_reduce", 1e9, 8, slow) == collective_seconds("all_reduce", 1e9, 8, link)
    with pytest.raises(ValueError, match="collective kind"):
        collective_seconds("broadcast", 1e9, 8, link)


def test_calibration_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = 1e-4, 2e9
    points = [(b, 2 * latency + b / bandwidth) for b in (1e4, 1e6, 1e7, 1e8)]
    fitted_latency, fitted_bandwidth = fit_latency_bandwidth(points, steps=2)
    assert fitted_latency == pytest.approx(latency)
    assert fitted_bandwidth == pytest.approx(bandwidth)


# ---------------------------------------------------------------------------- overlap, by hand


def _workload(backward_s, forward_s=(1.0,)):
    tensors = tuple(Tensor(f"t{i}", 1, i, 0, 0, s) for i, s in enumerate(backward_s))
    return Workload(tensors, tuple(forward_s), sum(forward_s), sum(backward_s), 0.0)


def _one_bucket_per_tensor(n):
    # launch order: the last-registered tensor's bucket first (its gradient arrives first)
    return [PlannedBucket((i,), 1, i) for i in range(n - 1, -1, -1)]


def _backward(backward_s, comm_s, *, pool=None, efficiency=1.0, sync=True, launch_cap=None):
    workload = _workload(backward_s)
    return simulate_backward(
        workload,
        _one_bucket_per_tensor(len(backward_s)),
        comm_s,
        sync=sync,
        overlap_comm=True,
        pool=pool,
        gather_s=None,
        prefetch=1,
        efficiency=efficiency,
        launch_cap=launch_cap,
    )


def test_a_bucket_hides_behind_the_rest_of_backward_and_the_last_one_is_exposed():
    # grads at t=1 and t=2; bucket A reduces 1.0-1.5 under the second tensor's compute, bucket B 2.0-2.5 after it
    phase = _backward([1.0, 1.0], [0.5, 0.5])
    assert (phase.compute_s, phase.comm_s, phase.exposed_s) == (2.0, 1.0, pytest.approx(0.5))
    assert phase.seconds == pytest.approx(2.5)


def test_exposed_time_when_communication_exceeds_compute():
    # A: 1-4; B ready at 2 waits for the link: 4-7. Compute ends at 2: 5 s exposed.
    phase = _backward([1.0, 1.0], [3.0, 3.0])
    assert phase.exposed_s == pytest.approx(5.0)


def test_no_overlap_efficiency_exposes_what_the_schedule_hides():
    phase = _backward([1.0, 1.0], [0.5, 0.5], efficiency=0.0)
    assert phase.exposed_s == pytest.approx(1.0)  # 0.5 simulated exposed + all 0.5 hidden
    half = _backward([1.0, 1.0], [0.5, 0.5], efficiency=0.5)
    assert half.exposed_s == pytest.approx(0.75)


def test_bucket_pool_stalls_backward_until_the_oldest_reduce_finishes():
    # Backward runs tensor 2 (1 s), tensor 1 (1 s), tensor 0 (5 s). One buffer: bucket 1's gradient
    # (t=2) waits for bucket 0's reduce-scatter (1-4), so the last 5 s of compute start at 4 and end
    # at 9, its reduce 9-9.1: 2.1 s after the 7 s of compute. Without the pool only the last 0.1 s.
    backward = [5.0, 1.0, 1.0]
    comm = [3.0, 0.1, 0.1]
    stalled = _backward(backward, comm, pool=1)
    free = _backward(backward, comm, pool=None)
    assert stalled.exposed_s == pytest.approx(9.1 - 7.0)
    assert free.exposed_s == pytest.approx(0.1)


def test_launch_cap_waits_for_the_oldest_reduce_before_the_next_launch():
    # Stage 1 (no pool), one reduce-scatter in flight at a time. Grads of tensors 2, 1, 0 arrive
    # at 1, 2, 3 (1 s each). Bucket 2 reduces 1-4. Bucket 1 is ready at 2 but its launch waits for
    # bucket 2 (backward stalls until 4), reduces 4-7; backward resumes 4-5, bucket 0's launch waits
    # for bucket 1 until 7, reduces 7-10. Compute 3 s, done at 10: 7 s exposed. Without the cap
    # backward never stalls and the link ends at 10 too: same end, hence the same exposed time.
    capped = _backward([1.0, 1.0, 1.0], [3.0, 3.0, 3.0], launch_cap=1)
    free = _backward([1.0, 1.0, 1.0], [3.0, 3.0, 3.0])
    assert capped.exposed_s == pytest.approx(7.0) and free.exposed_s == pytest.approx(7.0)
    # Where the stall matters: a long last gradient. Tensor 0 takes 5 s; bucket 1 (ready at 2)
    # waits for bucket 2 (1-4) before launching: backward resumes at 4 and ends at 9; bucket 1
    # reduces 4-4.1, bucket 0 launches at 9 after waiting for nothing: 9-9.1. Uncapped: 0.1 s.
    capped = _backward([5.0, 1.0, 1.0], [3.0, 0.1, 0.1], launch_cap=1)
    free = _backward([5.0, 1.0, 1.0], [3.0, 0.1, 0.1])
    assert capped.exposed_s == pytest.approx(9.1 - 7.0)
    assert free.exposed_s == pytest.approx(0.1)


def test_no_sync_micro_batch_communicates_nothing():
    phase = _backward([1.0, 1.0], [3.0, 3.0], sync=False)
    assert (phase.comm_s, phase.exposed_s) == (0.0, 0.0)


def test_stage3_forward_prefetch_hides_all_but_the_first_gather():
    workload = _workload([1.0], forward_s=(1.0, 1.0, 1.0))
    eager = simulate_forward(workload, gather_s=[0.5, 0.5, 0.5], prefetch=0, efficiency=1.0)
    ahead = simulate_forward(workload, gather_s=[0.5, 0.5, 0.5], prefetch=1, efficiency=1.0)
    assert eager.exposed_s == pytest.approx(1.5)  # every gather waits: 0-0.5, 1.5-2.0, 3.0-3.5
    assert ahead.exposed_s == pytest.approx(0.5)  # only the first unit's


# ---------------------------------------------------------------------------- the engine's rules


def _plan_7b(stage: int, **knobs):
    """7B on H100s, sequences of 4096 tokens, one per micro batch: the run the tests below vary."""
    return plan_run("7b", stage=stage, seq_len=4096, micro_batch=1, hardware=H100, **knobs)


def test_stage2_communicates_every_micro_batch_stage1_and_defer_once():
    # first the post-step all-gather exposed (overlap_param_gather=False)
    common = dict(world_size=16, devices_per_node=8, accumulate_grad_batches=8, activation_checkpointing=True,
                  overlap_param_gather=False)  # fmt: skip
    stage1 = _plan_7b(1, **common).timing
    stage2 = _plan_7b(2, **common).timing
    deferred = _plan_7b(2, defer_grad_reduce=True, **common).timing
    gather = stage1.post_step_gather_s
    reduce_once = stage1.dp_comm_s - gather
    assert stage2.dp_comm_s - gather == pytest.approx(8 * reduce_once)
    assert deferred.dp_comm_s == pytest.approx(stage1.dp_comm_s)
    assert deferred.exposed_comm_s == pytest.approx(stage1.exposed_comm_s)
    # overlapped (the engine's default) it hides behind the next forward
    # (one micro batch's: 0.14 s here, shorter than the 0.29 s cross-node gather)
    overlapped = _plan_7b(1, **{**common, "overlap_param_gather": True}).timing
    forward = stage1.forward.compute_s
    assert gather > forward > 0
    assert overlapped.post_step_gather_s == pytest.approx(gather - forward)
    assert overlapped.step_s < stage1.step_s


def test_tokens_per_second_and_mfu_follow_the_step_time():
    plan = _plan_7b(2, world_size=8, devices_per_node=8, accumulate_grad_batches=4, mfu=0.5)
    timing = plan.timing
    assert plan.tokens_per_s == pytest.approx(4 * 4096 * 8 / timing.step_s)
    assert timing.mfu == pytest.approx(timing.model_flops_per_rank / timing.step_s / 989e12)
    assert timing.mfu < 0.5  # exposed communication and memory-bound work only lower it


def test_defer_grad_reduce_keeps_full_gradients_in_memory():
    common = dict(world_size=8, devices_per_node=8, seq_len=1024, accumulate_grad_batches=4, hardware=H100)
    plain, deferred = plan_run("7b", stage=2, **common), plan_run("7b", stage=2, defer_grad_reduce=True, **common)
    stage1 = plan_run("7b", stage=1, **common)
    assert deferred.memory.grads == stage1.memory.grads == 8 * plain.memory.grads
    assert deferred.memory.bucket_buffers == 0
    # stage 3 deferred: stage 3's parameters, stage 1's full gradients, one reduce-scatter per step
    stage3, deferred3 = plan_run("7b", stage=3, **common), plan_run("7b", stage=3, defer_grad_reduce=True, **common)
    assert deferred3.memory.params == stage3.memory.params and deferred3.memory.optimizer == stage3.memory.optimizer
    assert deferred3.memory.grads == stage1.memory.grads and deferred3.memory.bucket_buffers == 0
    assert deferred3.memory.param_grad == 0 < stage3.memory.param_grad
    assert deferred3.timing.dp_comm_s < stage3.timing.dp_comm_s  # 1 gradient reduce-scatter, not 4
    assert plan_run("7b", stage=1, defer_grad_reduce=True, **common) == stage1  # stage 1 always defers


# ---------------------------------------------------------------------------- search


def test_70b_search_is_fast_and_every_layout_fits():
    start = time.perf_counter()
    result = search_layouts("70b", world_size=64, devices_per_node=8, global_batch=1024, seq_len=4096, hardware=H100)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"70B search took {elapsed:.1f} s"
    assert result.ranked and result.rejected_memory > 0
    speeds = [entry.plan.tokens_per_s for entry in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for entry in result.ranked:
        plan = entry.plan
        assert plan.fits and plan.memory.total <= plan.available_bytes
        assert plan.dp * plan.micro_batch * plan.accumulate_grad_batches == 1024  # the global batch is kept


def test_search_overrides_select_the_layout_they_describe():
    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import plan_inputs_from_config

    # topology=False: the strategy schema gains shard_size & co. with the engine's ZeroConfig; the
    # topology overrides are checked through a plain config in test_planner_topology.py
    result = search_layouts(
        "13b", world_size=16, devices_per_node=8, global_batch=1024, seq_len=4096, hardware=H100, topology=False
    )
    for entry in result.top(3):
        cfg = compose(
            ["model=llama13b", "trainer=gpu_2x8", "data.seq_len=4096", f"hardware={H100}", *entry.layout.overrides()]
        )
        planned, _ = plan_inputs_from_config(cfg)
        again = planned.plan()
        assert again.fits
        assert again.tokens_per_s == pytest.approx(entry.plan.tokens_per_s)
        assert again.memory.total == pytest.approx(entry.plan.memory.total)


def test_cli_search_prints_json(capsys):
    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import run_plan

    cfg = compose(["recipe=llama7b", f"hardware={H100}", "plan.search=true", "plan.format=json", "plan.top=5"])
    result = run_plan(cfg)
    capsys.readouterr()
    search = result["search"]
    assert len(search["top"]) == 5 and search["fit"] >= 5
    first = search["top"][0]
    assert first["overrides"][0].startswith("strategy=") and first["memory_gib"] <= first["available_gib"]
    assert first["tokens_per_s"] >= search["top"][-1]["tokens_per_s"]


# ---------------------------------------------------------------------------- calibration


@pytest.mark.slow
def test_calibrate_command_writes_a_valid_hardware_config(tmp_path):
    from omegaconf import OmegaConf

    from lightning_zero.hydra_config import HardwareConf

    out = tmp_path / "this_machine.yaml"
    result = subprocess.run(  # 2 gloo processes, small sizes, a tiny model: seconds
        [sys.executable, "-m", "lightning_zero", "plan", "calibrate", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "wrote" in result.stdout
    loaded = OmegaConf.load(out)
    OmegaConf.merge(OmegaConf.structured(HardwareConf), loaded)  # the hardware schema accepts it
    hardware = load_hardware(out)
    assert hardware.name == "this_machine" and hardware.devices_per_node == 2
    assert hardware.intra_node_bytes_per_s > 0 and hardware.peak_fp32_flops > 0 and 0 < hardware.mfu
    assert 0.0 <= hardware.overlap_efficiency <= 1.0 and hardware.memory_bytes_per_s > 0
    assert {kind for kind, _ in hardware.collective_time_factor} == {"all_reduce", "reduce_scatter", "all_gather"}
    plan = plan_run(
        "tiny", stage=2, world_size=2, devices_per_node=2, precision="32-true", micro_batch=2, seq_len=64, hardware=out
    )
    assert plan.timing.step_s > 0 and plan.mfu == pytest.approx(hardware.mfu)
    # the measured Lightning loop overhead (>= 0 by construction) is planned once per step
    assert "step_overhead_ms" in loaded and hardware.step_overhead_s == pytest.approx(loaded.step_overhead_ms / 1e3)
    assert plan.timing.overhead_s == hardware.step_overhead_s >= 0.0
    assert "step overhead" in result.stdout


# ---------------------------------------------------------------------------- one source of truth


def test_planner_plans_exactly_the_precisions_the_strategy_accepts():
    from lightning_zero.planner import PRECISIONS
    from lightning_zero.trainer.precision import SUPPORTED_PRECISION

    assert set(PRECISIONS) == set(SUPPORTED_PRECISION)
    with pytest.raises(ValueError, match="64-true"):
        plan_run("tiny", stage=2, world_size=2, devices_per_node=2, precision="64-true")


def test_default_hardware_is_config_yamls():
    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import default_hardware_name

    assert compose([]).hardware.name == default_hardware_name()
    assert plan_run("tiny", stage=2, world_size=2, devices_per_node=2).hardware == default_hardware_name()


def test_plan_attention_math_works_from_the_cli(capsys):
    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import run_plan

    math_plan = run_plan(compose(["plan.attention=math", "plan.format=json", "plan.stages=only"]))["plan"]
    fused_plan = run_plan(compose(["plan.format=json", "plan.stages=only"]))["plan"]
    capsys.readouterr()
    assert math_plan["attention"] == "math" and "attention_probs" in math_plan["activation_detail"]["terms"]
    assert math_plan["memory"]["activations"] > fused_plan["memory"]["activations"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("hardware.memory_bytes=abc", "hardware.memory_bytes"),
        ("plan.top=many", "plan.top"),
        ("plan.search=maybe", "plan.search"),
    ],
)
def test_bad_hardware_and_plan_values_fail_validation(override, key):
    from lightning_zero.hydra_config import compose

    with pytest.raises(ValueError, match=key):
        compose([override])


def test_ledger_is_a_re_export_of_the_planner_ledger():
    import lightning_zero.ledger as public
    from lightning_zero.planner import ledger

    assert public.model_state_bytes is ledger.model_state_bytes
    assert public.llama_param_counts is ledger.llama_param_counts


def test_planner_package_has_no_import_circles():
    package = SRC / "lightning_zero" / "planner"
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        if path.stem == "__init__":
            continue
        imports = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_zero.planner."):
                imports.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = imports
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in visiting, f"import circle: {' -> '.join((*trail, name))}"
        if name in order:
            return
        visiting.add(name)
        for dependency in graph.get(name, ()):
            visit(dependency, (*trail, name))
        visiting.discard(name)
        order.append(name)

    for module in graph:
        visit(module, ())
    assert {"ledger", "arithmetic", "timing", "search", "report", "calibrate", "hardware"} <= set(graph)
    assert not (SRC / "lightning_zero" / "planner_report.py").exists()


def test_gradient_path_bytes_per_stage_by_hand():
    from lightning_zero.planner.timing import gradient_path_bytes

    # fp32 (g = 4), 1 micro batch, dp = 2: DDP copies in and back and divides: 6 x 4 = 24;
    # stage 1 zero-fills, accumulates, divides half: 4 + 12 + 4 = 20; stage 2 copies, divides half: 8 + 4.
    one = dict(grad_bytes=4, dp=2, micro_batches=1)
    assert gradient_path_bytes(0, full_grads=False, **one) == 24
    assert gradient_path_bytes(1, full_grads=True, **one) == 20
    assert gradient_path_bytes(2, full_grads=False, **one) == 12
    # 4 micro batches: DDP accumulates 3 more times in .grad (3 x 12); stage 1 accumulates 4 times;
    # stage 2 copies 4 times and its chunk takes 1 divide + 3 adds (2 + 9) x 4 / 2.
    four = dict(grad_bytes=4, dp=2, micro_batches=4)
    assert gradient_path_bytes(0, full_grads=False, **four) == 36 + 24
    assert gradient_path_bytes(1, full_grads=True, **four) == 4 + 48 + 4
    assert gradient_path_bytes(2, full_grads=False, **four) == 32 + 22


def test_search_marks_lossy_layouts_and_lossless_leaves_them_out():
    """The 70B search on 8 x 8 H100 ranks int8 layouts first unless plan.lossless; each entry says
    whether it is lossless; sequence parallelism and selective checkpointing are enumerated."""
    common = dict(world_size=64, devices_per_node=8, global_batch=1024, seq_len=4096, hardware=H100)
    everything = search_layouts("70b", **common)
    lossy = [entry for entry in everything.ranked if not entry.plan.lossless]
    assert lossy and all("int8" in (entry.plan.grad_comm_dtype, entry.plan.param_comm_dtype) for entry in lossy)
    assert everything.ranked[0].as_dict()["lossless"] is everything.ranked[0].plan.lossless
    clean = search_layouts("70b", lossless=True, **common)
    assert clean.ranked and all(entry.plan.lossless for entry in clean.ranked)
    assert clean.evaluated < everything.evaluated
    layouts = [entry.layout for entry in clean.ranked]
    assert {layout.activation_checkpointing for layout in layouts} >= {"none", "selective", "full"}
    assert any(layout.sequence_parallel for layout in layouts) and any(
        not layout.sequence_parallel for layout in layouts
    )
    assert all(layout.tp > 1 for layout in layouts if layout.sequence_parallel)
    # bf16 wire format of fp32 gradients is lossy too; fp32 and the native bf16 are not
    plan = plan_run("70b", stage=3, **{k: v for k, v in common.items() if k != "global_batch"}, tp=8)
    assert plan.lossless
    assert not dataclasses.replace(plan, grad_comm_dtype="bf16", reduce_dtype="fp32").lossless
    assert dataclasses.replace(plan, grad_comm_dtype="fp32", param_comm_dtype="bf16").lossless


def test_held_units_follow_the_engines_rule():
    # [Note: held into backward]: an entry is held when it is the backward entry right after the
    # same unit's forward entry. The planner asks the engine's function about its own order.
    from lightning_zero.models import LlamaConfig
    from lightning_zero.planner.workload import gathered_once_numel, gathered_once_units, held_units, llama_workload
    from lightning_zero.zero.stage3.gather_order import held_entries

    order, backward = [0, 1, 2, 2, 1, 0], [False, False, False, True, True, True]
    assert held_entries(order, backward) == [False, False, False, True, False, False]
    # a unit run twice in forward (0, 0): only the use right before its backward is held
    assert held_entries([0, 0, 0], [False, False, True]) == [False, False, True]
    # a backward entry after another unit's, or a forward after a forward, is not
    assert held_entries([1, 0, 0, 1], [False, True, True, False]) == [False, False, False, False]

    shape = dict(micro_batch=1, seq_len=16, tp=1, activation_checkpointing="none", flops_per_s=1e12,
                 tp_link=Link(1e-5, 1e10), act_bytes=2)  # fmt: skip
    untied = LlamaConfig.from_name("tiny")
    workload = llama_workload(untied, **shape)
    head = untied.n_layers + 2  # units: 0 embedding, 1..L blocks, L+1 final norm, L+2 head
    assert held_units(workload) == gathered_once_units(workload) == {head}
    assert gathered_once_numel(workload) == untied.vocab_size * untied.dim
    # tied: the final norm is held, and the one embedding lives in the root (gathered once a step)
    tied = llama_workload(dataclasses.replace(untied, tie_embeddings=True), **shape)
    assert held_units(tied) == {untied.n_layers + 1}
    assert gathered_once_units(tied) == {0, untied.n_layers + 1}
    assert gathered_once_numel(tied) == untied.vocab_size * untied.dim + untied.dim
