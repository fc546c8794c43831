"""Bytes and seconds per link class under hybrid sharding, hierarchical reduction and compressed
cross-node communication (issue 14, planner side), and the per-step overhead term (issue 15),
against hand-computed cases. Formulas: docs/topology.md."""

from __future__ import annotations

import json

import pytest

from lightning_zero.config import ZeroConfig
from lightning_zero.models import LlamaConfig
from lightning_zero.planner import load_hardware, plan_run, run_plan, search_layouts
from lightning_zero.planner.hardware import Link
from lightning_zero.planner.ledger import (
    INT8_BLOCK_SIZE,
    Hop,
    comm_element_bytes,
    dp_link_bytes,
    dp_topology,
    model_state_bytes,
)
from lightning_zero.planner.timing import DomainHops, MachineCosts, ZeroSchedule, step_time
from lightning_zero.planner.workload import Tensor, Workload

N = 2048  # parameters per tp rank in the ledger cases: divisible by every group and by 256


def _bytes(stage, *, dp=8, devices_per_node=4, tp=1, micro_batches=2, native=2, **knobs):
    wire = {k: knobs.pop(k) for k in ("grad_comm_dtype", "param_comm_dtype", "defer_grad_reduce") if k in knobs}
    topology = dp_topology(dp=dp, devices_per_node=devices_per_node, tp=tp, **knobs)
    return dp_link_bytes(
        N, stage=stage, topology=topology, micro_batches=micro_batches, grad_bytes=native, param_bytes=native, **wire
    )


# ---------------------------------------------------------------------------- the ledger, by hand
# 2 nodes x 4 devices, tp=1: dp=8, 4 dp ranks per node; bf16 (2 bytes); 2 micro batches.


def test_zero3_over_the_world_sends_everything_across_nodes():
    links = _bytes(3)
    # reduce-scatter every micro batch: 2 x 7/8 x 2N; all-gather twice per micro batch: 4 x 7/8 x 2N
    assert links.inter_node == {"reduce_scatter": 2 * 7 / 8 * 2 * N, "all_gather": 4 * 7 / 8 * 2 * N}
    assert links.inter_node_total == 7168 + 14336
    assert links.intra_node_total == 0


def test_hierarchical_reduce_crosses_the_slow_link_once_per_byte():
    links = _bytes(3, hierarchical_reduce=True)
    # in-node reduce-scatter over 4 ranks of the whole gradient, then over the 2 nodes of the node's quarter
    assert links.intra_node == {"reduce_scatter": 2 * 3 / 4 * 2 * N}  # 6144
    assert links.inter_node == {"reduce_scatter": 2 * 1 / 2 * 2 * N / 4, "all_gather": 4 * 7 / 8 * 2 * N}
    assert links.inter_node["reduce_scatter"] == 1024
    # a single node: hierarchical changes nothing (nothing crosses nodes)
    one_node = _bytes(3, dp=4, hierarchical_reduce=True)
    assert one_node.as_dict() == _bytes(3, dp=4).as_dict()
    assert one_node.inter_node_total == 0


def test_hybrid_per_node_keeps_gathers_inside_and_all_reduces_the_shard_across():
    links = _bytes(3, shard_size="node")
    assert links.intra_node == {"reduce_scatter": 2 * 3 / 4 * 2 * N, "all_gather": 4 * 3 / 4 * 2 * N}  # 6144, 12288
    # the shard (N / 4 elements) all-reduced over 2 replicas after every reduce-scatter: 2 x 2 (1/2) x 2 N / 4
    assert links.inter_node == {"all_reduce": 2 * 2 * (1 / 2) * 2 * N / 4}
    assert links.inter_node_total == 2048


def test_hybrid_int8_and_bf16_wire_formats():
    int8 = _bytes(3, shard_size="node", grad_comm_dtype="int8", param_comm_dtype="int8")
    assert comm_element_bytes("int8", 2) == 1 + 4 / 256 and INT8_BLOCK_SIZE == 256
    # N / 4 = 512 elements: 512 int8 + 2 fp32 scales = 520 bytes of payload, all-reduced by 2 replicas
    assert int8.inter_node == {"all_reduce": 2 * 2 * (1 / 2) * 520}
    assert int8.intra_node == _bytes(3, shard_size="node").intra_node  # in-node hops stay uncompressed
    # fp32 training (32-true): bf16 on the wire halves the cross-node bytes, int8 is about a quarter
    fp32 = _bytes(3, native=4)
    bf16 = _bytes(3, native=4, grad_comm_dtype="bf16", param_comm_dtype="bf16")
    q8 = _bytes(3, native=4, grad_comm_dtype="int8", param_comm_dtype="int8")
    assert bf16.inter_node_total == fp32.inter_node_total / 2
    assert q8.inter_node_total == pytest.approx(fp32.inter_node_total * (1 + 4 / 256) / 4)
    # gradients and parameters take their own format: only the reduce-scatter is compressed here
    grads_only = _bytes(3, grad_comm_dtype="int8")
    assert grads_only.inter_node == {"reduce_scatter": 2 * 7 / 8 * N * (1 + 4 / 256), "all_gather": 4 * 7 / 8 * 2 * N}


def test_stage1_and_deferred_stage2_reduce_once_per_step():
    links = _bytes(1, shard_size="node", micro_batches=4)
    assert links.intra_node == {"reduce_scatter": 3 / 4 * 2 * N, "all_gather": 3 / 4 * 2 * N}  # 3072 each
    assert links.inter_node == {"all_reduce": 2 * (1 / 2) * 2 * N / 4}  # 1024
    deferred = _bytes(2, micro_batches=4, defer_grad_reduce=True, grad_comm_dtype="int8")
    # 4 micro batches, one int8 reduce-scatter (2048 x 1.015625 = 2080 bytes) and one bf16 all-gather
    assert deferred.inter_node == {"reduce_scatter": 7 / 8 * 2080, "all_gather": 7 / 8 * 2 * N}
    every = _bytes(2, micro_batches=4, grad_comm_dtype="int8")
    assert every.inter_node["reduce_scatter"] == 4 * 7 / 8 * 2080


def test_tensor_parallel_layout_shards_over_the_dp_ranks_of_a_node():
    # 2 nodes x 4, tp=2: dp=4, 2 dp ranks per node; "node" = 2 ranks x 2 replicas
    topology = dp_topology(dp=4, devices_per_node=4, tp=2, shard_size="node")
    assert (topology.shard_size, topology.replicas, topology.shard_spans_nodes) == (2, 2, False)
    links = _bytes(3, dp=4, tp=2, shard_size="node", micro_batches=1)
    assert links.intra_node == {"reduce_scatter": 1 / 2 * 2 * N, "all_gather": 2 * 1 / 2 * 2 * N}
    assert links.inter_node == {"all_reduce": 2 * 1 / 2 * 2 * N / 2}
    # tp = devices per node: one dp rank per node, "node" shards over 1 rank = plain replication
    alone = dp_topology(dp=2, devices_per_node=4, tp=4, shard_size="node")
    assert (alone.shard_size, alone.replicas) == (1, 2)
    assert alone.grad_hops(stage=3, grad_bytes=2) == [Hop("all_reduce", 2, 1.0, "inter_node", None, 2)]
    assert alone.gather_hops(param_bytes=2) == []


def test_ddp_ignores_the_topology_knobs():
    plain = _bytes(0, micro_batches=4)
    assert plain.inter_node == {"all_reduce": 2 * 7 / 8 * 2 * N}
    assert _bytes(0, micro_batches=4, shard_size="node", grad_comm_dtype="int8").as_dict() == plain.as_dict()


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(dp=8, shard_size=3), r"shard_size\(3\) does not divide dp\(8\)"),
        (dict(dp=12, shard_size=6), r"shard_size\(6\) neither divides nor is a multiple of the dp ranks per node\(4"),
        (dict(dp=8, shard_size=0), r"shard_size must be None, 'node' or a positive int"),
        (dict(dp=8, shard_size="rack"), r"shard_size must be None, 'node' or a positive int"),
    ],
)
def test_bad_shard_sizes_raise_with_the_numbers(knobs, match):
    with pytest.raises(ValueError, match=match):
        dp_topology(devices_per_node=4, **knobs)


# ---------------------------------------------------------------------------- plan_run


def _tiny_plan(**knobs):
    base = dict(stage=3, world_size=8, devices_per_node=4, micro_batch=1, seq_len=32, hardware="h100_80gb")
    return plan_run("tiny", **{**base, **knobs})


def test_memory_follows_the_zero_formulas_with_shard_size_for_dp():
    for stage in (1, 2, 3):
        for shard, size in ((None, 8), ("node", 4), (2, 2)):
            plan = _tiny_plan(stage=stage, shard_size=shard)
            assert (plan.shard_size, plan.replicas) == (size, 8 // size)
            assert plan.padded_params_per_tp_rank % size == 0
            states = model_state_bytes(plan.padded_params_per_tp_rank, stage=stage, dp=size, optim_bytes_per_param=12)
            assert plan.memory.params == states.params
            assert plan.memory.grads == states.grads
            assert plan.memory.optimizer == states.optimizer
    with pytest.raises(ValueError, match=r"ZeroStrategy\(grad_comm_dtype='fp8'\): give None"):
        _tiny_plan(grad_comm_dtype="fp8")


def test_plan_traffic_is_the_ledger_and_tp_counts_as_intra_node():
    plan = _tiny_plan(tp=2, shard_size="node", grad_comm_dtype="int8", accumulate_grad_batches=2)
    topology = dp_topology(dp=4, devices_per_node=4, tp=2, shard_size="node")
    tiny = LlamaConfig.from_name("tiny")
    head = tiny.vocab_size * tiny.dim // 2  # held from forward into backward: gathered once per micro batch
    ledger = dp_link_bytes(
        plan.padded_params_per_tp_rank,
        stage=3,
        topology=topology,
        micro_batches=2,
        grad_comm_dtype="int8",
        gathered_once_numel=head,
    )
    without = dp_link_bytes(
        plan.padded_params_per_tp_rank, stage=3, topology=topology, micro_batches=2, grad_comm_dtype="int8"
    )
    # 2 micro batches x a ring over the 2 dp ranks of a node x bf16 (the default precision's wire)
    assert without.by_kind("all_gather") - ledger.by_kind("all_gather") == 2 * 1 / 2 * 2 * head
    assert plan.traffic.dp_link_bytes == ledger
    assert plan.traffic.inter_node_bytes == ledger.inter_node_total > 0
    assert plan.traffic.intra_node_bytes == ledger.intra_node_total + plan.traffic.tp_all_reduce_bytes
    assert plan.traffic.dp_all_reduce_bytes == ledger.by_kind("all_reduce")  # the replica all-reduce
    assert plan.traffic.dp_link == "intra_node+inter_node"


def test_each_link_class_gets_its_own_seconds():
    # one stage-1 step, two tensors of 4096 elements, 32-true: hand-made links without latency
    tensors = (Tensor("a", 4096, 0, 0, 0, 1.0), Tensor("b", 4096, 1, 0, 0, 1.0))
    workload = Workload(tensors, (1.0,), 1.0, 2.0, 0.0)
    links = {"intra_node": Link(0.0, 100.0), "inter_node": Link(0.0, 10.0)}
    topology = dp_topology(dp=8, devices_per_node=4, shard_size="node")
    hops = DomainHops(
        topology.shard_size, topology.grad_hops(stage=1, grad_bytes=4), topology.gather_hops(param_bytes=4)
    )
    schedule = ZeroSchedule(stage=1, dp=8, grad_bytes=4, param_bytes=4, bucket_numel=10**9, dense=hops)  # one bucket
    timing = step_time(
        workload,
        schedule,
        ZeroConfig(overlap_param_gather=False).communication,
        MachineCosts(links["inter_node"], links),
        micro_batches=1,
    )
    # in node: reduce-scatter 3/4 x 32768 B + all-gather 3/4 x 32768 B at 100 B/s
    assert timing.link_s("intra_node") == pytest.approx(2 * 24576 / 100)
    # across: all-reduce of the 2048-element shard over 2 replicas: 2 x 1/2 x 8192 B at 10 B/s
    assert timing.link_s("inter_node") == pytest.approx(8192 / 10)
    assert timing.dp_comm_s == pytest.approx(timing.link_s("intra_node") + timing.link_s("inter_node"))
    # the optimizer steps the shard over shard_size ranks: 8192 / 4 parameters
    assert timing.optimizer_s == 0.0  # infinite memory bandwidth by default
    # the reduce (245.76 s + 819.2 s) is exposed after 2 s of backward; the post-step gather too
    assert timing.exposed_comm_s == pytest.approx(24576 / 100 + 8192 / 10 - 0.0, rel=1e-9)
    assert timing.post_step_gather_s == pytest.approx(24576 / 100)


def test_70b_table_options_on_8_nodes():
    common = dict(stage=3, world_size=64, devices_per_node=8, micro_batch=4, seq_len=4096, accumulate_grad_batches=4,
                  activation_checkpointing=True, prefetch_blocks=2, bucket_mb=25, hardware="h100_80gb")  # fmt: skip
    world = plan_run("70b", **common)
    hier = plan_run("70b", hierarchical_reduce=True, **common)
    node = plan_run("70b", shard_size="node", **common)
    node8 = plan_run("70b", shard_size="node", grad_comm_dtype="int8", param_comm_dtype="int8", **common)
    grad = 2 * world.padded_params_per_tp_rank  # bf16 bytes of the whole gradient
    # gathers: 2 per micro batch of the whole model, less one of the head (held into backward)
    gathers = 8 * grad - 4 * 2 * 32000 * 8192
    assert world.traffic.inter_node_bytes == pytest.approx(4 * 63 / 64 * grad + 63 / 64 * gathers)
    assert hier.traffic.inter_node_bytes == pytest.approx(4 * 7 / 8 * grad / 8 + 63 / 64 * gathers)
    assert node.traffic.inter_node_bytes == pytest.approx(4 * 2 * 7 / 8 * grad / 8)
    assert node8.traffic.inter_node_bytes == pytest.approx(node.traffic.inter_node_bytes / 2 * (1 + 4 / 256))
    assert world.memory.total == hier.memory.total < node.memory.total == node8.memory.total
    assert world.fits and not node.fits  # ZeRO-3 over 8 ranks leaves 70B at 167 GiB per GPU


# ---------------------------------------------------------------------------- the CLI and the search


def _cfg(**strategy):
    return {
        "model": {"name": "tiny"},
        "strategy": {"stage": 3, "tensor_parallel_size": 1, **strategy},
        "trainer": {"devices": 4, "num_nodes": 2, "precision": "bf16-mixed", "accumulate_grad_batches": 2},
        "data": {"batch_size": 1, "seq_len": 32},
        "hardware": "h100_80gb",
        "plan": {"format": "json", "stages": "only"},
    }


def test_run_plan_reads_the_strategy_knobs(capsys):
    result = run_plan(_cfg(shard_size="node", hierarchical_reduce=False, grad_comm_dtype="int8"))
    printed = json.loads(capsys.readouterr().out)
    plan = printed["plan"]
    assert (plan["shard_size"], plan["replicas"], plan["grad_comm_dtype"]) == (4, 2, "int8")
    assert plan["traffic"]["inter_node_bytes"] == result["plan"]["traffic"]["inter_node_bytes"] > 0
    assert set(plan["traffic"]["dp_link_bytes"]["inter_node"]) == {"all_reduce"}
    assert run_plan(_cfg(shard_size="2"))["plan"]["shard_size"] == 2  # a command-line string


def test_table_shows_both_link_classes():
    from rich.console import Console

    console = Console(record=True, width=200)
    cfg = _cfg(hierarchical_reduce=True)
    cfg["plan"] = {"format": "table", "stages": "all"}
    run_plan(cfg, console=console)
    text = console.export_text()
    assert "intra-node GB / step" in text and "inter-node GB / step" in text
    assert "hierarchical reduce-scatter" in text


def test_search_enumerates_hybrid_hierarchical_and_int8_and_keeps_what_fits():
    result = search_layouts(
        "tiny",
        world_size=8,
        devices_per_node=4,
        global_batch=16,
        seq_len=32,
        hardware="h100_80gb",
        micro_batches=(1, 2),
        bucket_mbs=(25.0,),
        checkpointing=(False,),
    )
    layouts = [entry.layout for entry in result.ranked]
    assert any(layout.shard_size == "node" for layout in layouts)
    assert any(layout.hierarchical_reduce for layout in layouts)
    assert any(layout.grad_comm_dtype == "int8" for layout in layouts)
    assert not any(layout.grad_comm_dtype == "bf16" for layout in layouts)  # native under bf16-mixed
    assert all(entry.plan.fits for entry in result.ranked)
    hybrid = next(entry for entry in result.ranked if entry.layout.shard_size == "node")
    assert "strategy.shard_size=node" in hybrid.layout.overrides()
    assert all(layout.shard_size is None and layout.grad_comm_dtype is None for layout in layouts if layout.stage == 0)
    one_node = search_layouts("tiny", world_size=4, devices_per_node=4, global_batch=4, seq_len=32, micro_batches=(1,))
    assert {entry.layout.shard_size for entry in one_node.ranked} == {None}  # nothing crosses nodes


# ---------------------------------------------------------------------------- per-step overhead


def test_step_overhead_is_added_once_per_optimizer_step():
    tensors = (Tensor("a", 8, 0, 0, 0, 1.0),)
    workload = Workload(tensors, (0.5,), 0.5, 1.0, 0.0)
    schedule = ZeroSchedule(stage=1, dp=1, grad_bytes=4, param_bytes=4, bucket_numel=8)
    comm = ZeroConfig(overlap_param_gather=False).communication
    plain = step_time(workload, schedule, comm, MachineCosts(Link(0.0, 1.0)), micro_batches=4)
    loaded = step_time(workload, schedule, comm, MachineCosts(Link(0.0, 1.0), overhead_s=0.25), micro_batches=4)
    assert plain.step_s == pytest.approx(4 * 1.5)  # 4 x (forward 0.5 + backward 1.0)
    assert loaded.step_s == pytest.approx(4 * 1.5 + 0.25)  # once per step, not per micro batch
    assert loaded.as_dict()["overhead_s"] == 0.25


def test_hardware_step_overhead_ms_reaches_the_plan():
    values = dict(load_hardware("h100_80gb").as_dict())
    mapping = {
        "name": "slow_loop",
        "memory_bytes": values["memory_bytes"],
        "intra_node_gb_per_s": 450.0,
        "inter_node_gb_per_s": 50.0,
        "peak_bf16_tflops": 989.0,
        "step_overhead_ms": 250.0,
    }
    assert load_hardware("h100_80gb").step_overhead_s == 0.0  # GPU presets: 0
    base = _tiny_plan(hardware={**mapping, "step_overhead_ms": 0.0})
    slow = _tiny_plan(hardware=mapping)
    assert slow.timing.overhead_s == 0.25
    assert slow.step_s - base.step_s == pytest.approx(0.25)
    with pytest.raises(ValueError, match=r"hardware.step_overhead_ms must be >= 0"):
        load_hardware({**mapping, "step_overhead_ms": -1.0})


def test_plan_shows_every_topology_option_on_more_than_one_node(capsys):
    cfg = _cfg()
    cfg["plan"] = {"format": "json", "stages": "only", "topology": True}
    result = run_plan(cfg)
    capsys.readouterr()
    options = {row["option"]: row for row in result["topology"]}
    assert list(options) == [
        "ZeRO over the world",
        "hierarchical reduce",
        "hybrid per node",
        "hybrid per node + int8",
        "world + int8",
    ]
    assert options["hybrid per node + int8"]["overrides"] == [
        "strategy.shard_size=4",
        "strategy.grad_comm_dtype=int8",
        "strategy.param_comm_dtype=int8",
    ]
    inter = {label: row["plan"]["traffic"]["inter_node_bytes"] for label, row in options.items()}
    world = inter["ZeRO over the world"]
    assert inter["hierarchical reduce"] < world and inter["world + int8"] < world
    assert inter["hybrid per node + int8"] < inter["hybrid per node"] < inter["hierarchical reduce"]
    one_node = _cfg()
    one_node["trainer"]["num_nodes"] = 1
    assert "topology" not in run_plan(one_node)  # nothing crosses nodes: no table
    capsys.readouterr()


def test_search_overrides_with_topology_knobs_select_the_layout_they_describe():
    from lightning_zero.planner import plan_inputs_from_config

    result = search_layouts(
        "13b", world_size=16, devices_per_node=8, global_batch=1024, seq_len=4096, hardware="h100_80gb"
    )
    top = result.top(3)
    assert any(entry.layout.shard_size or entry.layout.grad_comm_dtype for entry in top)
    for entry in top:
        cfg = {"model": {"name": "13b"}, "trainer": {"devices": 8, "num_nodes": 2}, "hardware": "h100_80gb"}
        cfg["data"] = {"seq_len": 4096}
        for override in entry.layout.overrides():  # apply them as Hydra would, on a plain config
            key, value = override.split("=")
            group, _, name = key.partition(".")
            if not name:  # strategy=zero3
                cfg["strategy"] = {**cfg.get("strategy", {}), "stage": int(value[-1]) if value != "ddp" else 0}
                continue
            parsed = {"true": True, "false": False}.get(value, value)
            if isinstance(parsed, str) and parsed.replace(".", "").isdigit():
                parsed = float(parsed) if "." in parsed or name == "bucket_mb" else int(parsed)
            cfg.setdefault(group, {})[name] = parsed
        planned, _ = plan_inputs_from_config(cfg)
        again = planned.plan()
        assert again.fits
        assert again.tokens_per_s == pytest.approx(entry.plan.tokens_per_s)
        assert again.traffic.inter_node_bytes == pytest.approx(entry.plan.traffic.inter_node_bytes)
