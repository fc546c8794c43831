"""ParallelDims arithmetic and validation, without any process group.

The mesh built on real ranks (which global ranks form the tp and dp groups, 4 gloo ranks, tp=2,
dp=2) is checked in ``tests/test_tp.py::test_layers_tp4_and_llama_tp2_dp2_match_dense``, which
launches those 4 ranks anyway (spawning is the slow part of a CPU test).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_zero.comm.mesh import ParallelDims


def _config(n_heads=8, n_kv_heads=8, vocab_size=32000, ffn_dim=256):
    return SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size, ffn_dim=ffn_dim)


def test_sizes_and_auto():
    dims = ParallelDims(world_size=64, devices_per_node=8, tp="auto")
    assert (dims.tp, dims.dp) == (8, 8)
    dims = ParallelDims(world_size=64, devices_per_node=8, tp=2)
    assert (dims.tp, dims.dp, dims.tp_enabled) == (2, 32, True)
    assert ParallelDims(world_size=4, devices_per_node=4).dp == 4  # tp defaults to 1


def test_rank_layout_without_process_group():
    dims = ParallelDims(world_size=8, devices_per_node=4, tp=4)
    assert dims.tp_ranks(5) == [4, 5, 6, 7]
    assert dims.dp_ranks(5) == [1, 5]
    dims = ParallelDims(world_size=64, devices_per_node=8, tp=2)
    assert dims.tp_ranks(13) == [12, 13]
    assert dims.dp_ranks(13) == list(range(1, 64, 2))


def test_pp_is_the_outermost_dimension():
    # [Note: pipeline ranks]: world 8 = pp 2 x dp 2 x tp 2; every inner group stays in one pp block
    dims = ParallelDims(world_size=8, devices_per_node=4, tp=2, pp=2)
    assert (dims.pp, dims.stage_world, dims.dp, dims.dp_cp) == (2, 4, 2, 2)
    assert dims.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.rank_groups("replicate") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    cp = ParallelDims(world_size=16, devices_per_node=8, cp=2, ep=2, pp=2)
    assert cp.rank_groups("cp")[:2] == [[0, 1], [2, 3]] and cp.rank_groups("edp")[0] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match=r"pp\(3\) does not divide world_size\(8\).*pick pp from"):
        ParallelDims(world_size=8, devices_per_node=8, pp=3)
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide world_size\(8\) / pp\(4\) = 2"):
        ParallelDims(world_size=8, devices_per_node=8, tp=4, pp=4)


def test_validates_llama70b_layout_in_one_process():
    cfg70b = _config(n_heads=64, n_kv_heads=8, vocab_size=32000, ffn_dim=28672)
    assert ParallelDims(world_size=64, devices_per_node=8, tp=8).validate(cfg70b).dp == 8


@pytest.mark.parametrize(
    "kwargs, config, match",
    [
        (dict(world_size=8, devices_per_node=4, tp=3), None, r"tp\(3\) does not divide devices_per_node\(4\)"),
        (dict(world_size=16, devices_per_node=8, tp=16), None, r"tp\(16\) does not divide devices_per_node\(8\)"),
        (dict(world_size=2, devices_per_node=4, tp=4), None, r"tp\(4\) does not divide world_size\(2\)"),
        (dict(world_size=6, devices_per_node=4, tp=2), None, r"world_size\(6\) .*devices_per_node\(4\)"),
        (dict(world_size=8, devices_per_node=8, tp=0), None, r"tp \(tensor_parallel_size\).*0"),
        (dict(world_size=8, devices_per_node=8, tp="two"), None, r"'two'"),
        (dict(world_size=0, devices_per_node=8), None, r"world_size.*0"),
        (dict(world_size=8, devices_per_node=8, tp=4), _config(n_heads=6), r"tp\(4\) does not divide n_heads\(6\)"),
        (
            dict(world_size=8, devices_per_node=8, tp=4),
            _config(n_kv_heads=2),
            r"tp\(4\) does not divide n_kv_heads\(2\)",
        ),
        (dict(world_size=8, devices_per_node=8, tp=8), _config(vocab_size=32003), r"vocab_size\(32003\)"),
        (dict(world_size=8, devices_per_node=8, tp=8), _config(ffn_dim=100), r"ffn_dim\(100\)"),
    ],
)
def test_validation_errors_show_the_numbers(kwargs, config, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs).validate(config)


def test_model_error_lists_every_bad_size_and_the_fix():
    with pytest.raises(ValueError) as info:
        ParallelDims(world_size=8, devices_per_node=8, tp=4).validate(_config(n_heads=6, n_kv_heads=2, vocab_size=50))
    message = str(info.value)
    assert "n_heads(6), n_kv_heads(2), vocab_size(50)" in message
    assert "[1, 2]" in message  # the tp sizes that would work
