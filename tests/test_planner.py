"""The planner: formulas against the ZeRO paper and exact counts, activations against autograd's
saved tensors on a tiny model, verdicts, layouts, and the CLI outputs (table, JSON, PNG)."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import psutil
import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.ledger import llama_activation_bytes, llama_param_counts, model_state_bytes
from lightning_zero.models import Llama, LlamaConfig, resolve_config
from lightning_zero.planner import MemoryPerRank, Plan, TrafficPerRank, compare_stages, plan_run, run_plan
from lightning_zero.planner.saved_activations import measure_saved_bytes

H100 = "h100_80gb"
RUN_70B = dict(
    world_size=64, devices_per_node=8, tp=8, precision="bf16-mixed", micro_batch=1, seq_len=4096, hardware=H100
)


# ---------------------------------------------------------------------------- model states


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1_every_stage(stage, expected_gb):
    # ZeRO paper, Figure 1: Psi = 7.5B, Nd = 64, K = 12 (mixed-precision Adam).
    total = model_state_bytes(7_500_000_000, stage=stage, dp=64).total
    assert round(total / 1e9, 1) == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("name, expected", [("7b", 6_738_415_616), ("13b", 13_015_864_320), ("70b", 68_976_648_192)])
def test_exact_parameter_counts(name, expected):
    config = LlamaConfig.from_name(name)
    assert llama_param_counts(config).total == expected
    assert plan_run(name, stage=3, world_size=8, devices_per_node=8, seq_len=128).num_params == expected


def test_param_count_per_tp_rank_matches_meta_model():
    config = LlamaConfig.from_name("70b", n_layers=2)
    with torch.device("meta"):
        model = Llama(config)
    tp = 8
    sharded = sum(p.numel() // tp if p.dim() >= 2 else p.numel() for p in model.parameters())
    assert llama_param_counts(config, tp=tp).total == sharded
    assert llama_param_counts(config).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("precision, bytes_per_param", [("bf16-mixed", (2, 2, 12)), ("32-true", (4, 4, 8))])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_model_states_equal_ledger(stage, precision, bytes_per_param):
    plan = plan_run("7b", stage=stage, world_size=16, devices_per_node=8, precision=precision, seq_len=512)
    param_bytes, grad_bytes, optim_bytes = bytes_per_param
    expected = model_state_bytes(
        plan.padded_params_per_tp_rank,
        stage=stage,
        dp=16,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes_per_param=optim_bytes,
    )
    memory = plan.memory
    assert (memory.params, memory.grads, memory.optimizer) == (expected.params, expected.grads, expected.optimizer)
    assert memory.master_weights == (
        0 if precision == "32-true" else 4 * plan.padded_params_per_tp_rank / (16 if stage else 1)
    )


def test_engine_buffers_by_stage():
    plans = compare_stages("7b", world_size=8, devices_per_node=8, seq_len=512, bucket_mb=25.0, prefetch_blocks=2)
    # The engine's pool holds max_buckets_in_flight + 1 (3) buffers of at most its largest bucket
    # (zero/bucketing.pool_buffers): a tensor never straddles buckets, so the 32000 x 4096 output
    # head (and embedding) is a bucket of its own.
    largest_bucket = 32000 * 4096
    assert [p.memory.bucket_buffers for p in plans] == [0, 0, 3 * largest_bucket * 2, 3 * largest_bucket * 2]
    block = llama_param_counts(LlamaConfig.from_name("7b")).block
    assert [p.memory.prefetch_buffers for p in plans] == [0, 0, 0, 3 * block * 2]


def test_stage3_working_set_at_0_44b():
    """Issue 24's 0.44B run (2 CPU ranks, fp32, seq 64 x batch 1): stage 3's working set is the
    gathered unit and the prefetched one -- at most the 32000 x 1536 head (or embedding) and the
    block next to it ([Note: gathered working set]), not twice the largest unit --, three bucket
    buffers in the pool (the head is a bucket of its own) and, in backward, autograd's gradient of
    the head before the hook copies it into its bucket. Stage 1 and deferred stage 2 let autograd
    write into the buckets: no such gradient."""
    config = LlamaConfig.from_name("tiny", dim=1536, n_layers=10, n_heads=12, n_kv_heads=4, ffn_dim=6144,
                                   vocab_size=32000, max_seq_len=64)  # fmt: skip
    assert config.num_params() == 444_366_336
    run = dict(world_size=2, devices_per_node=2, precision="32-true", micro_batch=1, seq_len=64, bucket_mb=25.0)
    plans = {stage: plan_run(config, stage=stage, simulate=False, suggest=False, **run) for stage in (0, 1, 2, 3)}
    head = 32000 * 1536 * 4
    assert [plans[stage].memory.param_grad for stage in (0, 1, 2, 3)] == [0, 0, head, head]
    deferred = plan_run(config, stage=2, defer_grad_reduce=True, simulate=False, suggest=False, **run)
    assert deferred.memory.param_grad == 0
    zero3 = plans[3].memory
    block = llama_param_counts(config).block * 4
    assert zero3.prefetch_buffers == head + block and zero3.bucket_buffers == 3 * head
    assert zero3.total == zero3.model_states + 4 * head + block + zero3.activations + zero3.logits_and_loss + head
    # what bench_memory.py measured (MiB above the post-import RSS, training peak, issue 24): the
    # prediction is within 10%, and stage 3 below stage 2 below stage 1
    assert 4588 * 2**20 / zero3.total == pytest.approx(1.0, abs=0.10)
    assert 4857 * 2**20 / plans[2].memory.total == pytest.approx(1.0, abs=0.10)
    assert plans[3].memory.total < plans[2].memory.total < plans[1].memory.total


# ---------------------------------------------------------------------------- traffic


def test_dp_and_tp_bytes_follow_the_ring_formulas():
    plans = compare_stages("70b", **RUN_70B)
    dp, padded = 8, plans[1].padded_params_per_tp_rank
    ring = (dp - 1) / dp
    for plan in plans[1:3]:
        assert plan.traffic.dp_bytes == pytest.approx(2 * ring * 2 * padded)  # 2 (dp-1)/dp * grad_bytes * P/tp
    # stage 3: the head (32000 x 8192 / tp) stays gathered from forward into backward: gathered once
    head = 32000 * 8192 // 8
    assert plans[3].traffic.dp_bytes == pytest.approx(ring * 2 * (3 * padded - head))
    # Lightning's DDP on the same 64 ranks: plain data parallelism (no tp), every parameter all-reduced
    ddp = plans[0]
    assert (ddp.tp, ddp.dp, ddp.cp, ddp.padded_params_per_tp_rank) == (1, 64, 1, 68_976_648_192)
    assert ddp.traffic.dp_all_reduce_bytes == pytest.approx(2 * 63 / 64 * 2 * 68_976_648_192)
    assert ddp.traffic.tp_all_reduce_bytes == 0
    # 4 all-reduces of B*T*dim per block (2 fwd, 2 bwd) + embedding + head, ring 2(tp-1)/tp each
    tokens_dim_bytes = 1 * 4096 * 8192 * 2
    assert plans[3].traffic.tp_all_reduce_bytes == pytest.approx((4 * 80 + 2) * 2 * 7 / 8 * tokens_dim_bytes)
    # compute: 6 x matmul params (all but the embedding lookup and the norm gains) x tokens / tp, plus
    # causal attention 3 x 2 B T^2 d / tp per block, at peak * mfu; plus the blocking tp all-reduces
    # (14 ring steps of 5 us + 2 * 7/8 * B T d * 2 bytes at 450 GB/s each).
    matmul_params = 68_976_648_192 - 32000 * 8192 - (2 * 80 + 1) * 8192
    flops = 6 * matmul_params * 4096 / 8 + 80 * 3 * 2 * 4096**2 * 8192 / 8
    tp_s = (4 * 80 + 2) * (14 * 5e-6 + 2 * 7 / 8 * tokens_dim_bytes / 450e9)
    assert plans[3].traffic.tp_s == pytest.approx(tp_s)
    assert plans[3].traffic.compute_s == pytest.approx(flops / (989e12 * 0.4) + tp_s)
    assert plans[3].traffic.dp_link == "inter_node"


# ---------------------------------------------------------------------------- activations
# Measured as [Note: measuring saved activations] in lightning_zero/planner/saved_activations.py says.


def _measured_saved_bytes(config, dtype, checkpointing, attention, batch, seq_len):
    torch.manual_seed(0)
    model = Llama(config).to(dtype)
    model.activation_checkpointing = checkpointing
    idx = torch.randint(0, config.vocab_size, (batch, seq_len))
    targets = torch.randint(0, config.vocab_size, (batch, seq_len))
    return measure_saved_bytes(model, idx, targets, attention)


# bf16 + math is left out: SDPA's math path on CPU upcasts bf16 to fp32 (CUDA does not).
@pytest.mark.parametrize(
    "dtype, attention", [(torch.float32, "fused"), (torch.float32, "math"), (torch.bfloat16, "fused")]
)
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("n_kv_heads", [4, 8])  # grouped-query (repeat_interleave) and plain
def test_activation_formula_matches_saved_tensors(dtype, attention, checkpointing, n_kv_heads):
    config = LlamaConfig.from_name("tiny", n_layers=2, n_kv_heads=n_kv_heads)
    batch, seq_len = 2, 64
    measured = _measured_saved_bytes(config, dtype, checkpointing, attention, batch, seq_len)
    predicted = llama_activation_bytes(
        config, micro_batch=batch, seq_len=seq_len, act_bytes=dtype.itemsize, attention=attention
    )
    # Stated tolerance 1% (observed: exact but the 4-byte scalar loss and its 4-byte weight).
    assert measured == pytest.approx(predicted.saved_after_forward(checkpointing), rel=0.01)


def test_checkpointing_shrinks_activations_to_block_inputs():
    common = dict(stage=3, world_size=64, devices_per_node=8, tp=8, micro_batch=1, seq_len=4096)
    full = plan_run("70b", **common)
    ckpt = plan_run("70b", activation_checkpointing=True, **common)
    detail = full.activation_detail
    assert ckpt.memory.activations == pytest.approx(80 * 4096 * 8192 * 2 + detail.per_layer + detail.head)
    assert full.memory.activations == pytest.approx(80 * detail.per_layer + detail.head)


# ---------------------------------------------------------------------------- verdict, layout


def test_verdict_for_a_run_that_does_not_fit():
    plan = plan_run("7b", stage=1, world_size=8, devices_per_node=8, micro_batch=2, seq_len=4096, hardware=H100)
    assert not plan.fits and plan.memory.total > plan.available_bytes
    assert plan.suggestions[0].startswith("stage=2")
    assert any(s.startswith("activation_checkpointing=true") for s in plan.suggestions)
    assert "does NOT fit" in plan.verdict and "stage=2" in plan.verdict
    # every suggestion really fits
    assert plan_run("7b", stage=2, world_size=8, devices_per_node=8, micro_batch=2, seq_len=4096, hardware=H100).fits


def test_verdict_when_no_single_change_fits():
    plan = plan_run("70b", stage=1, world_size=8, devices_per_node=8, tp=8, micro_batch=1, seq_len=4096, hardware=H100)
    assert not plan.fits and plan.dp == 1
    assert "nothing on 1 node(s)" in plan.verdict
    assert "stage=3 + activation_checkpointing=true on 4 nodes" in plan.verdict
    assert any("dp=1" in note for note in plan.notes)


def test_64_rank_layout_validates_without_processes():
    plan = plan_run("70b", stage=3, **{k: v for k, v in RUN_70B.items()})
    assert (plan.world_size, plan.num_nodes, plan.dp, plan.tp) == (64, 8, 8, 8)
    assert plan.params_per_tp_rank == 8_623_235_072  # 68,976,648,192 / 8, norms replicated
    assert plan.fits


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(tp=3), r"tp\(3\) does not divide devices_per_node\(8\)"),
        (dict(world_size=60), r"tp\(8\) does not divide world_size\(60\)"),
        (dict(world_size=60, tp=4), r"world_size\(60\) is not a whole number of nodes"),
        (dict(devices_per_node=16, tp=16, model="13b"), r"n_heads\(40\)"),
        (dict(stage=4), "stage"),
        (dict(micro_batch=0), "micro_batch"),
        (dict(precision="8-bit"), "precision"),
        (dict(seq_len=8192), r"seq_len\(8192\)"),
        (dict(hardware="tpu_v9"), "unknown hardware"),
        (dict(attention="flash3"), r"RunShape: attention must be one of"),
        (dict(simulate="sometimes"), r"PlanOptions: simulate must be True, False or 'if_fits'"),
        (dict(overlap_comm="yes"), r"ZeroStrategy\(overlap_comm='yes'\): must be True or False"),
        (dict(bucket_mb="big"), r"ZeroStrategy\(bucket_mb='big'\): the gradient bucket size must be a number of MiB"),
        (dict(reserved_gib=-1), r"PlanOptions: reserved_gib must be a number >= 0"),
        (dict(prefetch_blocks=1.5), r"ZeroStrategy\(prefetch_blocks=1.5\): must be an int"),
    ],
)
def test_bad_layouts_and_arguments_raise_with_the_numbers(changes, match):
    kwargs = {**RUN_70B, "stage": 3, **changes}
    model = kwargs.pop("model", "70b")
    if model == "13b":
        kwargs["world_size"] = 64
    with pytest.raises(ValueError, match=match):
        plan_run(model, **kwargs)


def test_unknown_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="bukcet_mb"):
        plan_run("70b", **{**RUN_70B, "stage": 3, "bukcet_mb": 25})
    with pytest.raises(TypeError, match="bukcet_mb"):
        run = {k: v for k, v in RUN_70B.items() if k != "tp"}
        plan_run("70b", ZeroConfig(stage=3, tensor_parallel_size=8), **run, bukcet_mb=25)


def test_a_config_with_knobs_of_the_old_signature_plans_as_the_config_alone():
    """``stage=None`` was the 31-keyword signature's default (benchmarks/gpu_check.py passes it
    beside a config); a knob with a value beside a config is refused, naming it."""
    run = {k: v for k, v in RUN_70B.items() if k != "tp"}
    config = ZeroConfig(stage=3, tensor_parallel_size=8)
    assert plan_run("70b", config, stage=None, **run).memory.total == plan_run("70b", config, **run).memory.total
    with pytest.raises(TypeError, match=r"set stage in the ZeroConfig"):
        plan_run("70b", config, stage=2, **run)
    with pytest.raises(TypeError, match=r"give stage="):
        plan_run("70b", stage=None, **RUN_70B)


# ---------------------------------------------------------------------------- outputs


def _compose(*overrides, strategy=("strategy=zero3", "strategy.tensor_parallel_size=8")):
    from lightning_zero.hydra_config import compose

    return compose(
        [
            "model=llama70b",
            "trainer=gpu_8x8",
            *strategy,
            "data.seq_len=4096",
            "data.batch_size=1",
            f"hardware={H100}",
            *overrides,
        ]
    )


def test_70b_plan_is_fast_and_small(capsys):
    cfg = _compose("plan.format=json")
    process = psutil.Process()
    rss_before = process.memory_info().rss
    start = time.perf_counter()
    run_plan(cfg)
    elapsed = time.perf_counter() - start
    rss_growth = process.memory_info().rss - rss_before
    capsys.readouterr()
    assert elapsed < 10, f"70B plan took {elapsed:.1f} s"
    assert rss_growth < 100 * 2**20, f"70B plan grew RSS by {rss_growth / 2**20:.0f} MiB"


def test_json_output_parses_and_has_every_field(capsys):
    result = run_plan(_compose("plan.format=json"))
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(result))
    plan = printed["plan"]
    expected = {f.name for f in dataclasses.fields(Plan)} | {"available_bytes", "fits", "verdict"}
    assert set(plan) == expected
    assert set(plan["memory"]) == {f.name for f in dataclasses.fields(MemoryPerRank)} | {
        "optimizer",
        "model_states",
        "total",
    }
    assert set(plan["traffic"]) >= {f.name for f in dataclasses.fields(TrafficPerRank)} | {"dp_bytes", "tp_s"}
    assert plan["num_params"] == 68_976_648_192 and plan["stage"] == 3 and plan["dp"] == 8
    assert [s["stage"] for s in printed["stages"]] == [0, 1, 2, 3]
    assert plan["memory"]["total"] == printed["stages"][3]["memory"]["total"]


def test_table_output_names_the_numbers():
    from rich.console import Console

    buffer = io.StringIO()
    run_plan(_compose(), console=Console(file=buffer, width=140))
    text = buffer.getvalue()
    assert "68,976,648,192" in text and "dp=8 x tp=8" in text
    for label in (
        "ZeRO-1",
        "ZeRO-2",
        "ZeRO-3",
        "master weights",
        "stage-3 gathered blocks",
        "activations",
        "dp bytes sent",
        "compute time",
        "verdict",
    ):
        assert label in text


def test_plot_is_a_png(tmp_path, capsys):
    path = tmp_path / "memory.png"
    result = run_plan(_compose("plan.format=json", f"plan.plot={path}"))
    capsys.readouterr()
    assert result["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_reads_precision_checkpointing_and_ddp_from_the_config(capsys):
    overrides = (
        "plan.format=json",
        "trainer.precision=32-true",
        "model.activation_checkpointing=true",
        "plan.stages=only",
    )
    result = run_plan(_compose(*overrides, strategy=("strategy=ddp",)))
    capsys.readouterr()
    plan = result["plan"]
    assert (plan["stage"], plan["tp"], plan["precision"], plan["activation_checkpointing"]) == (0, 1, "32-true", True)
    assert len(result["stages"]) == 1
    assert plan["memory"]["params"] == 4 * 68_976_648_192 and plan["memory"]["master_weights"] == 0


def test_sequence_parallel_and_selective_checkpointing_in_the_plan():
    """70B at tp=8: sequence parallelism shrinks the norm/residual activations (not the TP
    total, which only gains the norm gains' gradient sums); selective recompute costs one
    attention forward per block, full one whole block forward."""
    from lightning_zero.planner.workload import attention_forward_flops, training_flops

    common = dict(stage=3, world_size=64, devices_per_node=8, tp=8, micro_batch=1, seq_len=4096)
    plain = plan_run("70b", **common)
    sp = plan_run("70b", sequence_parallel=True, **common)
    tokens, dim, layers = 4096, 8192, 80
    # each of 2 norms per block (and the head's) keeps (4 + 2) bytes x dim x T/8 instead of x T
    saved = (2 * layers + 1) * (tokens - tokens // 8) * (dim * (4 + 2) + 4)
    assert plain.memory.activations - sp.memory.activations == pytest.approx(saved)
    moved = sp.traffic.tp_bytes_by_kind
    assert moved["tp_all_gather_seq"] + moved["tp_reduce_scatter_seq"] == pytest.approx(
        plain.traffic.tp_bytes_by_kind["tp_all_reduce"]
    )
    assert moved["tp_all_reduce_norm_grad"] == pytest.approx((2 * layers + 1) * 2 * 7 / 8 * dim * 2)
    assert sp.checkpointing == "none" and sp.sequence_parallel

    config = resolve_config("70b")
    shape = dict(micro_batch=1, seq_len=tokens, tp=8)
    base = training_flops(config, **shape)
    selective = plan_run("70b", activation_checkpointing="selective", **common)
    assert selective.checkpointing == "selective" and not selective.activation_checkpointing
    assert selective.traffic.flops_per_rank - base == pytest.approx(layers * attention_forward_flops(config, **shape))
    full = plan_run("70b", activation_checkpointing="full", **common)
    assert full.traffic.flops_per_rank > selective.traffic.flops_per_rank
    assert full.memory.activations < selective.memory.activations < plain.memory.activations
    with pytest.raises(ValueError, match=r"sequence_parallel=True, tensor_parallel_size=1"):
        plan_run("70b", stage=3, world_size=8, devices_per_node=8, tp=1, sequence_parallel=True)
