"""Hybrid sharding, hierarchical reduction and bytes per link class (issue 14, engine side).

The multi-process cases run in one launch of tests/scripts/hybrid.py: 4 gloo processes started
with the environment torchrun sets for 2 nodes x 2 (TorchElastic), so Lightning sees
``num_nodes=2, devices=2`` and ranks 0-1 / 2-3 are the two "nodes". Each case is compared with
Lightning's ``ddp`` on the same seed and data (per-step fp32 losses to 1e-5), its model-state bytes
with the ZeRO formulas at ``dp = shard_size``, and its bytes per link class in step 2 with the
formulas written out below ([Note: link classes] in collectives.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.ledger import model_state_bytes
from tests.distributed import ROOT, free_port, script_env, start_process
from tests.ulps import assert_close_ulps

# -- pure layout arithmetic (no process group) -------------------------------------------------


def test_hybrid_groups_on_two_nodes_of_two():
    dims = ParallelDims(world_size=4, devices_per_node=2, shard_size="node")
    assert dims.mesh_shape == (2, 2, 1)
    assert dims.rank_groups("shard") == [[0, 1], [2, 3]]
    assert dims.rank_groups("replicate") == [[0, 2], [1, 3]]
    assert dims.rank_groups("replica") == [[0, 1], [2, 3]]
    assert not dims.shard_spans_nodes and not dims.hierarchical

    world = ParallelDims(world_size=4, devices_per_node=2, hierarchical_reduce=True)
    assert world.mesh_shape == (1, 4, 1) and world.hierarchical
    assert world.rank_groups("shard_intra") == [[0, 1], [2, 3]]
    assert world.rank_groups("shard_inter") == [[0, 2], [1, 3]]

    tp = ParallelDims(world_size=4, devices_per_node=2, tp=2, shard_size="node")
    assert tp.mesh_shape == (2, 1, 2)  # one dp rank per node: "node" shards over 1, replicates over 2
    assert tp.rank_groups("replicate") == [[0, 2], [1, 3]]
    assert tp.rank_groups("replica") == [[0, 1], [2, 3]]


def test_hierarchical_groups_with_tp_on_sixteen_ranks():
    dims = ParallelDims(world_size=16, devices_per_node=4, tp=2, shard_size=4, hierarchical_reduce=True)
    assert dims.mesh_shape == (2, 4, 2) and dims.hierarchical
    assert dims.shard_ranks(5) == [1, 3, 5, 7]  # tp position 1, dp ranks 0-3 (nodes 0 and 1)
    assert dims.shard_intra_ranks(5) == [5, 7]
    assert dims.shard_inter_ranks(5) == [1, 5]
    assert dims.replicate_ranks(5) == [5, 13]
    # shard rank r of a group is node r // local, local position r % local
    for shard in dims.rank_groups("shard"):
        for position, rank in enumerate(shard):
            assert dims.shard_intra_ranks(rank).index(rank) == position % dims.dp_per_node
            assert dims.shard_inter_ranks(rank).index(rank) == position // dims.dp_per_node


def test_hierarchical_is_ignored_inside_one_node():
    assert not ParallelDims(world_size=4, devices_per_node=2, shard_size=2, hierarchical_reduce=True).hierarchical
    assert not ParallelDims(world_size=4, devices_per_node=4, hierarchical_reduce=True).hierarchical


BAD_LAYOUTS = [  # (world_size, devices_per_node, tp, shard_size, expected message)
    (4, 2, 1, 3, r"shard_size\(3\) does not divide dp\(4\) = world_size\(4\) / tp\(1\)"),
    (8, 4, 2, 3, r"shard_size\(3\) does not divide dp\(4\) = world_size\(8\) / tp\(2\).*\[1, 2, 4\]"),
    (6, 2, 1, 3, r"shard_size\(3\) with dp\(6\).*2 dp rank\(s\) per node.*fit inside one node"),
    (12, 4, 1, 6, r"shard_size\(6\).*multiple of 4\); pick shard_size from \[1, 2, 4, 12\]"),
    (4, 2, 1, 0, r"shard_size must be None, 'node' or a positive int"),
]


@pytest.mark.parametrize("world, per_node, tp, shard, match", BAD_LAYOUTS)
def test_bad_layouts_name_every_number(world, per_node, tp, shard, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(world_size=world, devices_per_node=per_node, tp=tp, shard_size=shard)


def test_knob_validation():
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=r"ZeroStrategy\(shard_size='nodes'\)"):
        ZeroStrategy(shard_size="nodes")
    with pytest.raises(ValueError, match=r"ZeroStrategy\(hierarchical_reduce=1\)"):
        ZeroStrategy(hierarchical_reduce=1)
    assert ZeroStrategy(shard_size="node", hierarchical_reduce=True).shard_size == "node"


@pytest.mark.parametrize(
    "nodes, shard_size, match",
    [
        (2, 3, r"shard_size\(3\) does not divide dp\(4\)"),  # does not divide dp
        (3, 3, r"shard_size\(3\) with dp\(6\).*fit inside one node"),  # a group across a node boundary
    ],
)
def test_bad_layout_raises_before_any_process_group(monkeypatch, nodes, shard_size, match):
    """Rank 0 of a torchrun-style launch of ``nodes`` x 2: the strategy refuses the layout in
    ``setup_environment``, before ``init_process_group`` (which would wait for the other ranks)."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zero import ZeroStrategy

    env = dict(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", NODE_RANK="0", LOCAL_WORLD_SIZE="2")
    env.update(WORLD_SIZE=str(2 * nodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for key, value in {**env, "TORCHELASTIC_RUN_ID": "bad-layout"}.items():
        monkeypatch.setenv(key, value)

    def started(*args, **kwargs):
        raise AssertionError("init_process_group ran before the layout was validated")

    monkeypatch.setattr(dist, "init_process_group", started)
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=nodes,
        devices=2,
        strategy=ZeroStrategy(shard_size=shard_size),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=match):
        trainer.fit(BoringModel())
    assert not dist.is_initialized()


# -- 4 processes as 2 nodes x 2 -----------------------------------------------------------------

CASES = [
    "ddp",
    "world2",
    "hyb1_s2",
    "hyb2_node",
    "hyb3_s2",
    "hier2",
    "hier3",
    "tp2_hyb1_node",
    "tp2_hyb3_node",
    "hyb2_node_bf16",
    "hyb2_node_int8",
    "hier2_int8",
    "ckpt_resume",
    "ckpt_resume_world",
    "engine_paths",
]
COMPRESSED = {
    "hyb2_node_bf16": ("hyb2_node", "bf16"),
    "hyb2_node_int8": ("hyb2_node", "int8"),
    "hier2_int8": ("hier2", "int8"),
}
ZERO_CASES = [
    case for case in CASES if case != "ddp" and not case.startswith(("ckpt", "engine")) and case not in COMPRESSED
]


def _launch_two_nodes_of_two(out_dir, cases: list[str], timeout_s: float = 600) -> None:
    """Start 4 ranks of tests/scripts/hybrid.py with the environment torchrun gives 2 nodes x 2."""
    port = free_port()
    procs = []
    for rank in range(4):
        env = script_env(
            ROOT,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank % 2),
            WORLD_SIZE="4",
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK=str(rank // 2),
            NODE_RANK=str(rank // 2),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE="4",
            TORCHELASTIC_RUN_ID="lightning-zero-hybrid-test",
        )
        argv = [sys.executable, str(ROOT / "tests" / "scripts" / "hybrid.py"), str(out_dir), *cases]
        procs.append(start_process(argv, cwd=out_dir, env=env, log_path=os.path.join(out_dir, f"log.rank{rank}.txt")))
    failed = []
    try:
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0:
                failed.append(rank)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if failed:
        tails = [open(os.path.join(out_dir, f"log.rank{r}.txt")).read()[-3000:] for r in failed]
        raise AssertionError(f"ranks {failed} failed:\n" + "\n---\n".join(tails))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    _launch_two_nodes_of_two(out, CASES)
    return lambda case, rank: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", ZERO_CASES)
def test_losses_match_ddp(results, case):
    want = results("ddp", 0)["losses"]
    assert len(want) == 4
    for rank in range(4):
        got = results(case, rank)["losses"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ckpt_resume", "ckpt_resume_world"])
def test_hybrid_checkpoint_resumes_exactly(results, case):
    """hyb3_s2 saved at step 2 (shard_size=2: each replica holds the same shards); resuming it in
    the same layout, or sharded over all 4 ranks, continues with ddp's steps 3-4."""
    want = results("ddp", 0)["losses"][2:]
    for rank in range(4):
        torch.testing.assert_close(
            torch.tensor(results(case, rank)["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", ZERO_CASES)
def test_model_state_bytes_follow_the_formula_with_shard_size(results, case):
    for rank in range(4):
        got = results(case, rank)
        want = model_state_bytes(
            got["padded"], stage=got["stage"], dp=got["shard"], param_bytes=4, grad_bytes=4, optim_bytes_per_param=8
        )
        measured = got["measured"]
        assert measured["params"] == want.params, case
        assert measured["grads"] == want.grads, case
        # + AdamW's `step` per owned run, - the moments the padding no longer has
        assert measured["optimizer"] == want.optimizer + got["step_counters"], case


def _link_formulas(case: str, padded: int, held: int = 0) -> dict[str, dict[str, float]]:
    """Bytes one rank sends in one fp32 step on 2 nodes x 2 (``N`` elements per replica, 4 bytes
    each), by kind and link class. A ring over ``n`` ranks sends ``(n-1)/n`` of what it gathers or
    scatters, an all-reduce twice that; a group spanning both nodes counts as inter_node. Stage 3
    gathers ``2 N - held`` elements: the head, ``held``, stays gathered from its forward into its
    backward ([Note: held into backward])."""
    N = padded
    norm_world = 2 * 3 / 4 * 4  # the clipping norm: one fp32 all-reduce over all 4 ranks
    norm_node = 2 * 1 / 2 * 4  # ... over one replica (= one node)
    if case == "world2":  # stage 2, shard over all 4 ranks: both collectives span the nodes
        kinds = {"reduce_scatter_grads": 3 / 4 * N * 4, "all_gather_params": 3 / 4 * N * 4}
        return {"kinds": kinds, "links": {"inter_node": sum(kinds.values()) + norm_world}}
    if case == "hier2":  # in-node reduce-scatter of N, cross-node reduce-scatter of the node's N/2
        in_node, cross = 1 / 2 * N * 4, 1 / 2 * (N / 2) * 4
        gather = 3 / 4 * N * 4  # parameter all-gather stays flat over the 4 ranks
        return {
            "kinds": {
                "reduce_scatter_grads_in_node": in_node,
                "reduce_scatter_grads_cross_node": cross,
                "all_gather_params": gather,
            },
            "links": {"intra_node": in_node, "inter_node": cross + gather + norm_world},
        }
    if case == "hier3":  # stage 3: every unit gathered in forward and again in backward, over 4 ranks
        in_node, cross, gather = 1 / 2 * N * 4, 1 / 2 * (N / 2) * 4, 3 / 4 * (2 * N - held) * 4
        return {
            "kinds": {"reduce_scatter_grads_cross_node": cross, "all_gather_params": gather},
            "links": {"intra_node": in_node, "inter_node": cross + gather + norm_world},
        }
    if case in ("hyb1_s2", "hyb2_node", "hyb3_s2"):  # shard over one node, all-reduce chunks across
        scatter = 1 / 2 * N * 4
        gather = (2 * N - held if case == "hyb3_s2" else N) * 1 / 2 * 4
        replicas = 2 * 1 / 2 * (N / 2) * 4
        return {
            "kinds": {
                "reduce_scatter_grads": scatter,
                "all_gather_params": gather,
                "all_reduce_grads_replicas": replicas,
            },
            "links": {"intra_node": scatter + gather + norm_node, "inter_node": replicas},
        }
    if case in ("tp2_hyb1_node", "tp2_hyb3_node"):  # shard_size 1: only the replica all-reduce of all N
        replicas = 2 * 1 / 2 * N * 4
        return {"kinds": {"all_reduce_grads_replicas": replicas}, "links": {"inter_node": replicas}}
    raise KeyError(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ZERO_CASES)
def test_bytes_per_link_class_match_the_formulas(results, case):
    for rank in range(4):
        got = results(case, rank)
        held = got["held"]
        assert held > 0 if got["stage"] == 3 else held == 0, (case, held)
        want = _link_formulas(case, got["padded"], held)
        for kind, value in want["kinds"].items():
            assert got["sent"]["bytes"][kind] == value, (case, kind)
        links = got["sent"]["bytes_by_link"]
        if case.startswith("tp2"):  # TP all-reduces stay inside a node; only the replicas cross
            assert links["inter_node"] == want["links"]["inter_node"], case
            assert links["intra_node"] > 0
            continue
        assert {link: value for link, value in links.items() if value} == want["links"], case


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [None, 60.0], ids=["reduce_scatter", "all_reduce_path"])
@pytest.mark.parametrize("layout", ["hier_stage2", "hybrid_stage1"])
def test_engine_reduced_gradients_are_the_mean(results, layout, timeout):
    """The engine alone (tests/scripts/hybrid.py ``engine_paths``): every master gradient chunk is
    the mean over the 4 ranks, with gloo's reduce-scatter (no timeout) and with the all-reduce path
    gloo takes under a collective timeout ([Note: collective timeout] in reducer.py)."""
    for rank in range(4):
        got = results("engine_paths", rank)[(layout, timeout)]
        assert got["buckets"] >= 2 and got["hierarchical"] == (layout == "hier_stage2")
        assert got["max_abs_error"] < 1e-6, got
        assert got["bytes_by_link"]["inter_node"] > 0 and got["bytes_by_link"]["intra_node"] > 0


# Tolerance of a compressed run's per-step losses against ddp's over these 4 steps. bf16, in bf16 ulps
# of each loss ([Note: tolerances in ulps] in tests/ulps.py): the hop rounds each gradient element
# once (half an ulp), AdamW's steps follow within a turned step where a gradient's last bits differ,
# and the fp32 losses stay within one bf16 rounding of each other on either side: 1 ulp. int8 moves
# each element by at most 1/254 of its 256-element block's absmax, no rounding of a float format:
# 2% relative leaves room for 4 steps of drift. The uncompressed runs match ddp to 1e-5, and a test
# below checks that compression changed something.
BF16_LOSS_ULPS, INT8_LOSS_RTOL = 1, 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(COMPRESSED))
def test_compressed_cross_node_hops(results, case):
    """grad_comm_dtype compresses exactly the hops that cross nodes: their bytes are 1/2 (bf16) or
    about 1/4 plus one fp32 scale per 256 elements (int8) of the fp32 run's, the in-node bytes are
    unchanged, and the losses stay within the stated tolerance of ddp."""
    base, dtype = COMPRESSED[case]
    want_losses = torch.tensor(results("ddp", 0)["losses"])
    cross = "all_reduce_grads_replicas" if base.startswith("hyb") else "reduce_scatter_grads_cross_node"
    for rank in range(4):
        got, fp32 = results(case, rank), results(base, rank)
        ratio = got["sent"]["bytes"][cross] / fp32["sent"]["bytes"][cross]
        if dtype == "bf16":
            assert ratio == 0.5, (case, ratio)
        else:
            assert 0.25 < ratio < 0.25 * (1 + 4 / 256) * 1.05, (case, ratio)  # + scales, + padding per chunk
        intra = {k: v for k, v in got["sent"]["bytes"].items() if k != cross}
        assert intra == {k: v for k, v in fp32["sent"]["bytes"].items() if k != cross}, case
        assert got["sent"]["bytes_by_link"]["intra_node"] == fp32["sent"]["bytes_by_link"]["intra_node"]
        losses = torch.tensor(got["losses"])
        if dtype == "bf16":
            assert_close_ulps(losses, want_losses, BF16_LOSS_ULPS, torch.bfloat16, msg=case)
        else:
            torch.testing.assert_close(losses, want_losses, rtol=INT8_LOSS_RTOL, atol=0, msg=case)
        assert not torch.equal(losses[1:], want_losses[1:]), f"{case}: compression changed nothing"
