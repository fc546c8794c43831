"""The named mesh (issue 54 item 1, shared with issue 55): dp, cp, ep and tp in one ``ParallelDims``.

Pure arithmetic first (a table of layouts -> groups, a table of bad inputs -> ``ValueError``), then
the knobs at each door, then one 4-rank gloo launch in which the built process groups hold the
ranks the arithmetic says and the runtime's engine shards over the dense (dp*cp) group.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_zero.comm.mesh import GROUP_KINDS, ParallelDims
from lightning_zero.config import ZeroConfig
from tests.distributed import run_ranks

# -- layouts -> groups (no process group) --------------------------------------------------------

LAYOUTS = [  # (ParallelDims kwargs, {kind: every group of that kind})
    (
        dict(world_size=8, devices_per_node=8, tp=2, ep=2),  # the example of [Note: expert groups]
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "cp": [[0], [1], [2], [3], [4], [5], [6], [7]],
            "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        dict(world_size=8, devices_per_node=4, tp=2, cp=2),  # (dp, cp, tp) = (2, 2, 2)
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    (
        dict(world_size=8, devices_per_node=8, cp=2, ep=4),  # ep spans cp groups: dp_cp = 8
        {
            "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "dp_cp": [list(range(8))],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        dict(world_size=8, devices_per_node=4, cp=2, shard_size=2),  # hybrid splits dp_cp, not dp
        {
            "dp_cp": [list(range(8))],
            "shard": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "replicate": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "replica": [[0, 1], [2, 3], [4, 5], [6, 7]],
        },
    ),
    (
        dict(world_size=4, devices_per_node=4),  # cp == ep == 1: every dense group is the dp group
        {"dp": [[0, 1, 2, 3]], "dp_cp": [[0, 1, 2, 3]], "edp": [[0, 1, 2, 3]], "ep": [[0], [1], [2], [3]]},
    ),
]


@pytest.mark.parametrize("kwargs, expected", LAYOUTS)
def test_layout_groups(kwargs, expected):
    dims = ParallelDims(**kwargs)
    for kind, groups in expected.items():
        assert dims.rank_groups(kind) == groups, kind
    assert dims.dp * dims.cp * dims.tp == dims.world_size
    assert dims.edp * dims.ep == dims.dp_cp == dims.dp * dims.cp
    for rank in range(dims.world_size):
        dense = dims.dp_cp_ranks(rank)
        # ep groups tile the dense group in consecutive runs; edp groups take one of each
        assert dims.ep_ranks(rank) == dense[dense.index(rank) // dims.ep * dims.ep :][: dims.ep]
        assert set(dims.ep_ranks(rank)) & set(dims.edp_ranks(rank)) == {rank}
        assert set(dims.cp_ranks(rank)) & set(dims.dp_ranks(rank)) == {rank}
    for kind in GROUP_KINDS:  # every kind tiles the world
        if kind in ("shard_intra", "shard_inter") and not dims.hierarchical:
            continue
        ranks = sorted(r for group in dims.rank_groups(kind) for r in group)
        assert ranks == list(range(dims.world_size)), kind


def test_cp_one_ep_one_changes_nothing():
    for kwargs in (
        dict(world_size=64, devices_per_node=8, tp=2),
        dict(world_size=16, devices_per_node=4, shard_size=4),
    ):
        plain, named = ParallelDims(**kwargs), ParallelDims(**kwargs, cp=1, ep=1)
        assert (named.dp, named.dp_cp, named.shard, named.replicate) == (
            plain.dp,
            plain.dp,
            plain.shard,
            plain.replicate,
        )
        for kind in ("dp", "shard", "replicate", "replica"):
            assert (
                named.rank_groups(kind)
                == plain.rank_groups(kind)
                == named.rank_groups("dp_cp" if kind == "dp" else kind)
            )
        assert str(named) == str(plain)


def test_gradient_divisor_is_dp_times_cp_for_both_domains():
    dims = ParallelDims(world_size=16, devices_per_node=8, tp=2, cp=2, ep=4)
    assert (dims.dp, dims.cp, dims.edp) == (4, 2, 2)
    assert dims.grad_divisor() == dims.grad_divisor(expert=True) == 8


BAD_LAYOUTS = [  # (ParallelDims kwargs, expected message)
    (
        dict(world_size=8, devices_per_node=8, cp=3),
        r"cp\(3\) does not divide world_size\(8\) / tp\(1\) = 8.*\[1, 2, 4, 8\]",
    ),
    (dict(world_size=8, devices_per_node=4, tp=4, cp=4), r"cp\(4\) does not divide world_size\(8\) / tp\(4\) = 2"),
    (
        dict(world_size=8, devices_per_node=8, ep=3),
        r"ep\(3\) does not divide dp\(8\) = world_size\(8\) / tp\(1\).*\[1, 2, 4, 8\]",
    ),
    (dict(world_size=8, devices_per_node=8, tp=2, cp=2, ep=8), r"ep\(8\) does not divide dp\*cp\(4\).*cp\(2\)"),
    (dict(world_size=8, devices_per_node=8, ep=0), r"ep must be a positive int, got 0"),
    (dict(world_size=8, devices_per_node=8, cp="2"), r"cp must be a positive int, got '2'"),
    (dict(world_size=8, devices_per_node=8, ep=2, shard_size=4), r"ep\(2\) with shard_size\(4\).*shard_size=None"),
    (dict(world_size=8, devices_per_node=4, cp=2, shard_size=3), r"shard_size\(3\) does not divide dp\*cp\(8\)"),
]


@pytest.mark.parametrize("kwargs, match", BAD_LAYOUTS)
def test_bad_layouts_name_the_numbers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(cp=0), r"ZeroStrategy\(cp=0\).*int >= 1"),
        (dict(ep=1.5), r"ZeroStrategy\(ep=1.5\).*int >= 1"),
        (dict(ep=True), r"ZeroStrategy\(ep=True\)"),
        (dict(ep=2, shard_size="node"), r"ZeroStrategy\(ep=2, shard_size='node'.*shard_size=None"),
    ],
)
def test_zero_config_validates_cp_and_ep(knobs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**knobs)


# -- the doors -------------------------------------------------------------------------------------


def test_every_door_takes_cp_and_ep():
    from lightning_zero import ZeroStrategy
    from lightning_zero.hydra_config import compose

    strategy = ZeroStrategy(stage=3, cp=2, ep=4)
    assert (strategy.zero_config.cp, strategy.cp, strategy.ep) == (2, 2, 4)
    cfg = compose(["strategy=zero2", "strategy.cp=2", "strategy.ep=2"])
    assert (cfg.strategy.cp, cfg.strategy.ep) == (2, 2)
    with pytest.raises(ValueError, match=r"strategy\.ep|ep=0"):
        compose(["strategy=zero2", "strategy.ep=0"])


def test_fabric_takes_cp_and_ep_and_checks_the_model_at_setup():
    from lightning_zero.fabric import ZeroFabricStrategy

    # their model is checked at setup (tests/test_fabric_cp.py, tests/test_expert_domain.py)
    assert ZeroFabricStrategy(cp=2).cp_size == 2
    assert ZeroFabricStrategy(ep=2).zero_config.ep == 2


def test_a_model_that_does_not_declare_cp_or_ep_is_refused_before_launch():
    from lightning_zero.runtime.setup import parallel_dims

    plain = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"ZeroStrategy\(cp=2, ep=2\): Linear does not declare .*cp=1 and ep=1"):
        parallel_dims(ZeroConfig(cp=2, ep=2), num_nodes=1, num_processes=4, lightning_module=plain)
    assert parallel_dims(ZeroConfig(), num_nodes=1, num_processes=4, lightning_module=plain).dp == 4

    asked = []

    class Declares(nn.Linear):
        def check_parallel_dims(self, dims):
            asked.append(dims)
            if dims.ep > 2:
                raise ValueError(f"ep({dims.ep}) does not divide num_experts(2)")

    dims = parallel_dims(ZeroConfig(cp=2, ep=2), num_nodes=1, num_processes=4, lightning_module=Declares(2, 2))
    assert asked == [dims] and (dims.dp, dims.cp, dims.ep) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"num_experts\(2\)"):
        parallel_dims(ZeroConfig(ep=4), num_nodes=1, num_processes=4, lightning_module=Declares(2, 2))
    # the hook may live on the module's config (the model family's)
    config_owner = SimpleNamespace(config=SimpleNamespace(check_parallel_dims=asked.append))
    parallel_dims(ZeroConfig(cp=4), num_nodes=1, num_processes=4, lightning_module=config_owner)
    assert asked[-1].cp == 4


def test_the_planner_refuses_what_the_model_would_refuse():
    from lightning_zero.planner.arithmetic import plan_run
    from lightning_zero.planner.report import plan_inputs_from_config

    with pytest.raises(ValueError, match=r"plan: ep=2 but the model 'tiny' has no expert layers"):
        plan_run("tiny", ZeroConfig(ep=2), world_size=4, devices_per_node=4)
    with pytest.raises(ValueError, match=r"ep\(3\) does not divide n_experts\(4\)"):
        plan_run("tiny_moe", ZeroConfig(ep=3), world_size=3, devices_per_node=3)
    from lightning_zero.models.moe import MoEConfig

    capped = MoEConfig.from_name("tiny_moe", capacity_factor=1.25)
    with pytest.raises(ValueError, match=r"capacity_factor\(1.25\) with tensor_parallel_size\(2\)"):
        plan_run(capped, ZeroConfig(tensor_parallel_size=2), world_size=4, devices_per_node=4)
    # ep is planned (issue 54): the experts' own ZeRO domain over edp, the all-to-alls on their link
    moe = {"model": {"name": "tiny_moe"}, "strategy": {"stage": 2, "ep": 2}, "trainer": {"devices": 4}}
    planned, _ = plan_inputs_from_config(moe)
    assert (planned.dims.ep, planned.dims.edp) == (2, 2) and planned.plan().ep == 2
    # cp is planned (issue 55): each rank holds T/cp tokens of activations
    planned, _ = plan_inputs_from_config({"strategy": {"stage": 2, "cp": 2}, "data": {"seq_len": 64}})
    assert planned.dims.cp == 2 and planned.config.cp == 2


# -- on 4 gloo ranks: groups built = arithmetic; the engine shards over dp*cp ----------------------

GLOO_LAYOUTS = [
    dict(cp=2),
    dict(ep=2),
    dict(tp=2, cp=2),
    dict(cp=2, ep=4),
    dict(tp=2, ep=2),
    dict(cp=2, shard_size=2),
]


def _members(group) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _groups_body(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from lightning_zero.comm.mesh import build_groups
    from lightning_zero.precision import precision_policy
    from lightning_zero.runtime.session import ZeroSession

    for kwargs in GLOO_LAYOUTS:
        dims = ParallelDims(world_size=world_size, devices_per_node=world_size, **kwargs)
        groups = build_groups(dims)
        assert _members(groups.dp_cp) == dims.dp_cp_ranks(rank), kwargs
        assert _members(groups.edp) == dims.edp_ranks(rank), kwargs
        for kind in ("tp", "cp", "ep"):
            group = getattr(groups, kind)
            size = getattr(dims, kind)
            assert (group is None) == (size == 1), (kwargs, kind)
            if group is not None:
                assert _members(group) == getattr(dims, f"{kind}_ranks")(rank), (kwargs, kind)
                # a collective over it reaches exactly those ranks
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=group)
                assert total.item() == sum(getattr(dims, f"{kind}_ranks")(rank)), (kwargs, kind)
        if groups.shard is not None:
            assert _members(groups.shard.shard) == dims.shard_ranks(rank)
            assert _members(groups.shard.dp) == dims.dp_cp_ranks(rank)

    class Declares(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))

        def check_parallel_dims(self, dims):
            pass

    for stage in (1, 2, 3):
        for knobs in (dict(cp=2), dict(cp=4), dict(cp=2, shard_size=2)):
            config = ZeroConfig(stage=stage, **knobs)
            session = ZeroSession(config)
            module = Declares()
            dims = session.plan_layout(num_nodes=1, num_processes=world_size, module=module)
            session.start("cpu")
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            session.prepare_module(module, torch.device("cpu"), ranks_per_node=world_size)
            engine = session.build_engine(
                module, [optimizer], precision=precision_policy("32-true"), device=torch.device("cpu"),
                ranks_per_node=world_size,
            )  # fmt: skip
            zero_ranks = dims.shard_ranks(rank)
            assert engine.dp_size == len(zero_ranks) == (2 if config.shard_size else world_size), (stage, knobs)
            assert _members(engine.dp_group) == zero_ranks, (stage, knobs)
            # the sampler splits over dp only: cp ranks read the same samples
            assert (session.dp_size(world_size), session.dp_rank(rank)) == (dims.dp, rank // dims.cp)
            assert session.dense_size(world_size) == world_size
            session.close_engine(rank)
            session.close()


def test_built_groups_hold_the_ranks_the_arithmetic_says():
    run_ranks(_groups_body, world_size=4, timeout_s=240.0)


def test_the_planner_takes_the_layout_and_the_config_whole():
    from lightning_zero.planner.arithmetic import PlanOptions, RunShape, plan, plan_run

    config = ZeroConfig(stage=3, tensor_parallel_size=2, bucket_mb=4.0, shard_size="node", reduce_dtype="fp32")
    dims = ParallelDims.from_config(config, world_size=16, devices_per_node=8)
    assert (dims.tp, dims.dp, dims.shard) == (2, 8, 4)
    run, options = RunShape(precision="bf16-mixed", micro_batch=2, seq_len=1024), PlanOptions(simulate=False)
    keywords = dict(world_size=16, devices_per_node=8, micro_batch=2, seq_len=1024, simulate=False)
    assert plan("7b", config, dims, run, options) == plan_run("7b", config, **keywords)
    # Lightning's DDP on the same 16 ranks: plain data parallelism (no tp, no hybrid sharding)
    ddp = plan("7b", config, dims, run, options, ddp=True)
    assert (ddp.stage, ddp.tp, ddp.dp, ddp.cp, ddp.shard_size) == (0, 1, 16, 1, 16)
    assert ddp == plan_run("7b", stage=0, bucket_mb=4.0, reduce_dtype="fp32", **keywords)
    with pytest.raises(ValueError, match=r"plan_run\(stage=0, tp=2\): stage 0 is Lightning's DDP"):
        plan_run("7b", stage=0, tp=2, **keywords)
    with pytest.raises(ValueError, match=r"plan: ParallelDims\(.*tp=1.*is not the layout the ZeroConfig asks for"):
        plan("7b", config, ParallelDims(world_size=16, devices_per_node=8), run, options)
    with pytest.raises(ValueError, match=r"ep=2 but the model '7b' has no expert layers"):
        cfg = ZeroConfig(ep=2)
        plan("7b", cfg, ParallelDims.from_config(cfg, world_size=16, devices_per_node=8), run, options)
