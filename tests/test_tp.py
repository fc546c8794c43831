"""Tensor-parallel layers, loss and parallelize_llama against their dense counterparts (gloo, CPU).

Every rank builds the dense module from the same seed, so the dense reference runs inside each
rank and the TP result (gathered over the TP group) is compared with it directly.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.comm.mesh import ParallelDims, build_mesh, dp_group_and_rank, tp_group_and_rank
from lightning_zero.models.llama.parallelize import parallelize_llama
from lightning_zero.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_tp_state_dict,
    shard_dense_state_dict,
    tp_grad_norm,
    tp_grad_norm_weight,
    tp_shard_dim,
    vocab_parallel_cross_entropy,
)
from lightning_zero.tp.layers import shard_size
from tests.distributed import run_ranks

ATOL = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _slice(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.chunk(size, dim=dim)[rank]


def _gather(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def test_uneven_split_error_shows_numbers():
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide vocab_size\(50\)"):
        shard_size(50, 4, "vocab_size")


# --------------------------------------------------------------------------------------------
# Layers and loss, one TP group of the whole world


def _check_column(group, rank, size, counter) -> None:
    torch.manual_seed(0)
    dense = nn.Linear(8, 12, bias=True)
    layer = ColumnParallelLinear.from_dense(dense, group, counter=counter)
    assert layer.weight.shape == (12 // size, 8) and tp_shard_dim(layer.weight) == 0
    x = torch.randn(3, 5, 8)
    grad_y = torch.randn(3, 5, 12)
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_dense = dense(x_dense)
    (y_dense * grad_y).sum().backward()
    counter.reset()
    y_tp = layer(x_tp)  # [3, 5, 12 / tp]
    (y_tp * _slice(grad_y, -1, rank, size)).sum().backward()

    _close(y_tp, _slice(y_dense, -1, rank, size), "column output")
    _close(x_tp.grad, x_dense.grad, "column input grad")
    _close(_gather(layer.weight.grad, 0, group), dense.weight.grad, "column weight grad")
    _close(_gather(layer.bias.grad, 0, group), dense.bias.grad, "column bias grad")
    # backward all-reduces dL/dx once: 2 (tp-1)/tp * numel * 4 bytes
    assert counter.calls == {"tp_all_reduce": 1}
    assert counter.bytes["tp_all_reduce"] == pytest.approx(2 * (size - 1) / size * x.numel() * 4)


def _check_row(group, rank, size, counter) -> None:
    torch.manual_seed(1)
    dense = nn.Linear(12, 8, bias=True)
    layer = RowParallelLinear.from_dense(dense, group, counter=counter)
    assert layer.weight.shape == (8, 12 // size) and tp_shard_dim(layer.weight) == 1
    assert tp_shard_dim(layer.bias) is None
    x = torch.randn(3, 5, 12)
    grad_y = torch.randn(3, 5, 8)
    x_dense = x.clone().requires_grad_()
    x_tp = _slice(x, -1, rank, size).clone().requires_grad_()

    y_dense = dense(x_dense)
    (y_dense * grad_y).sum().backward()
    counter.reset()
    y_tp = layer(x_tp)  # [3, 5, 8], replicated
    (y_tp * grad_y).sum().backward()

    _close(y_tp, y_dense, "row output")
    _close(x_tp.grad, _slice(x_dense.grad, -1, rank, size), "row input grad")
    _close(_gather(layer.weight.grad, 1, group), dense.weight.grad, "row weight grad")
    _close(layer.bias.grad, dense.bias.grad, "row bias grad")
    assert counter.calls == {"tp_all_reduce": 1}  # forward only
    assert counter.bytes["tp_all_reduce"] == pytest.approx(2 * (size - 1) / size * y_dense.numel() * 4)


def _check_embedding(group, rank, size, counter) -> None:
    torch.manual_seed(2)
    dense = nn.Embedding(16, 6)
    layer = VocabParallelEmbedding.from_dense(dense, group, counter=counter)
    assert layer.weight.shape == (16 // size, 6)
    idx = torch.randint(0, 16, (3, 7))
    idx[0, :4] = torch.tensor([0, 15, 16 // size, 16 // size - 1])  # both edges of each range
    grad_y = torch.randn(3, 7, 6)

    y_dense = dense(idx)
    (y_dense * grad_y).sum().backward()
    y_tp = layer(idx)
    (y_tp * grad_y).sum().backward()

    _close(y_tp, y_dense, "embedding output")
    _close(_gather(layer.weight.grad, 0, group), dense.weight.grad, "embedding weight grad")


def _check_cross_entropy(group, rank, size, counter) -> None:
    torch.manual_seed(3)
    vocab = 16
    for scale in (1.0, 60.0):  # 60: exp overflows without the max shift
        logits = scale * torch.randn(2, 5, vocab)
        targets = torch.randint(0, vocab, (2, 5))
        targets[0, 0] = -100  # ignored
        targets[1, :2] = torch.tensor([0, vocab - 1])
        full = logits.clone().requires_grad_()
        local = _slice(logits, -1, rank, size).clone().requires_grad_()

        loss_dense = F.cross_entropy(full.flatten(0, 1), targets.flatten())
        loss_dense.backward()
        loss_tp = vocab_parallel_cross_entropy(local, targets, group, counter=counter)
        loss_tp.backward()

        _close(loss_tp, loss_dense, f"cross entropy (scale {scale})")
        _close(local.grad, _slice(full.grad, -1, rank, size), f"cross entropy logits grad (scale {scale})")


def _check_layers(group: dist.ProcessGroup) -> None:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    counter = CommCounter()
    _check_column(group, rank, size, counter)
    _check_row(group, rank, size, counter)
    _check_embedding(group, rank, size, counter)
    _check_cross_entropy(group, rank, size, counter)


# --------------------------------------------------------------------------------------------
# parallelize_llama


def _tiny_config():
    from lightning_zero.models import LlamaConfig

    # GQA (4 q heads, 2 kv heads) so tp=2 splits kv heads too
    return LlamaConfig(
        name="tp-test", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16
    )


def _batch(step: int, dp_rank: int, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, 64, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: nn.Module, optimizer, idx, targets, dp_group=None) -> torch.Tensor:
    optimizer.zero_grad()
    logits = model(idx)
    loss = model.loss_fn(logits, targets)
    loss.backward()
    if dp_group is not None:  # plain data parallel: average gradients over dp
        for param in model.parameters():
            dist.all_reduce(param.grad, group=dp_group)
            param.grad /= dist.get_world_size(dp_group)
    optimizer.step()
    return loss.detach()


def _two_rank_body(rank: int, world_size: int) -> None:
    """One 2-rank launch (spawning is the slow part on CPU): layers at tp=2, then the Llama."""
    _check_layers(dist.group.WORLD)

    from lightning_zero.models import Llama

    cfg = _tiny_config()
    group = dist.group.WORLD
    torch.manual_seed(0)
    dense = Llama(cfg)
    model = parallelize_llama(copy.deepcopy(dense), group, counter=(counter := CommCounter()))
    assert all(hasattr(p, "_tp_shard_dim") for p in model.parameters())
    assert tp_shard_dim(model.layers[0].attention_norm.weight) is None
    assert model.layers[0].attention.wk.weight.shape == (cfg.n_kv_heads // 2 * cfg.head_dim, cfg.dim)

    # forward: vocab-split logits equal the dense slice; loss equal
    idx, targets = _batch(0, 0)
    _close(model(idx), _slice(dense(idx), -1, rank, world_size), "llama logits")

    # one forward+backward moves (4 n_layers + 2) all-reduces of B*T*dim (docs/tensor_parallel.md)
    counter.reset()
    model.loss_fn(model(idx), targets).backward()
    dense.loss_fn(dense(idx), targets).backward()
    activation = idx.numel() * cfg.dim
    assert counter.calls["tp_all_reduce"] == 4 * cfg.n_layers + 2
    assert counter.bytes["tp_all_reduce"] == pytest.approx((4 * cfg.n_layers + 2) * 2 * (1 / 2) * activation * 4)
    _close(
        tp_grad_norm(model.parameters(), group),
        nn.utils.get_total_norm([p.grad for p in dense.parameters()]),
        "grad norm",
    )

    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    tp_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        idx, targets = _batch(step, 0)
        loss_dense = _step(dense, dense_opt, idx, targets)
        loss_tp = _step(model, tp_opt, idx, targets)
        _close(loss_tp, loss_dense, f"loss at step {step}")

    full = gather_tp_state_dict(model, group)
    expected = dense.state_dict()
    assert full.keys() == expected.keys()
    for name, tensor in expected.items():
        _close(full[name], tensor, f"param {name} after 3 AdamW steps")

    # round trip: dense layout -> this rank's slices -> a fresh TP model -> dense layout again
    torch.manual_seed(123)
    fresh = parallelize_llama(Llama(cfg), group)
    fresh.load_state_dict(shard_dense_state_dict(fresh, full, group))
    again = gather_tp_state_dict(fresh, group)
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor), name
    # and the gathered dict loads into a plain Llama that computes the same logits
    plain = Llama(cfg)
    plain.load_state_dict(full)
    _close(fresh(idx), _slice(plain(idx), -1, rank, world_size), "reloaded logits")

    torch.manual_seed(0)
    _check_sequence_parallel(Llama(cfg), group)
    _check_saved_activations(Llama(cfg), group)

    # meta-device path (Lightning's empty init, then to_empty + reset_parameters per module): the
    # materialized TP model equals the materialized dense one with the same seed
    from lightning.fabric.utilities.init import _materialize_meta_tensors

    with torch.device("meta"):
        dense_meta, tp_meta = Llama(cfg), Llama(cfg)
    parallelize_llama(tp_meta, group)
    for seeded in (dense_meta, tp_meta):
        torch.manual_seed(7)
        _materialize_meta_tensors(seeded, torch.device("cpu"))
    assert tp_shard_dim(tp_meta.output.weight) == 0 and tp_shard_dim(tp_meta.layers[1].attention.wo.weight) == 1
    materialized = gather_tp_state_dict(tp_meta, group)
    for name, tensor in dense_meta.state_dict().items():
        assert torch.equal(materialized[name], tensor), f"meta-materialized {name}"


def _check_sequence_parallel(dense: nn.Module, group: dist.ProcessGroup, dp_group=None, dp_rank: int = 0) -> None:
    """``parallelize_llama(sequence_parallel=True)`` trains like the dense model (3 steps),
    sends exactly the bytes [Note: sequence parallelism] says, and saves and loads the same state
    dict as the layout without it."""
    from lightning_zero.tp.layers import SP_GATHER_LABEL, SP_GRAD_LABEL, SP_SCATTER_LABEL, TP_LABEL

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    cfg = dense.config
    plain = parallelize_llama(copy.deepcopy(dense), group)
    model = parallelize_llama(copy.deepcopy(dense), group, counter=(counter := CommCounter()), sequence_parallel=True)
    assert tp_shard_dim(model.layers[0].ffn_norm.weight) is None
    assert model.state_dict().keys() == plain.state_dict().keys()

    idx, targets = _batch(0, dp_rank)
    h = model.tok_embeddings(idx)
    assert h.shape == (idx.shape[0], idx.shape[1] // size, cfg.dim)  # (B, T/tp, dim)
    _close(model(idx), _slice(dense(idx), -1, rank, size), "sequence-parallel logits")

    # one forward + backward: 4 L + 2 all-gathers and as many reduce-scatters of B T dim (each
    # (tp-1)/tp of it leaves a rank), no activation all-reduce, 2 L + 1 norm-gain gradient sums
    counter.reset()
    model.loss_fn(model(idx), targets).backward()
    activation_bytes = idx.numel() * cfg.dim * 4
    collectives = 4 * cfg.n_layers + 2
    assert counter.calls[SP_GATHER_LABEL] == counter.calls[SP_SCATTER_LABEL] == collectives
    assert TP_LABEL not in counter.calls
    assert counter.bytes[SP_GATHER_LABEL] == (size - 1) / size * activation_bytes * collectives
    assert counter.bytes[SP_SCATTER_LABEL] == (size - 1) / size * activation_bytes * collectives
    assert counter.calls[SP_GRAD_LABEL] == 2 * cfg.n_layers + 1
    assert counter.bytes[SP_GRAD_LABEL] == 2 * (size - 1) / size * cfg.dim * 4 * (2 * cfg.n_layers + 1)
    # the norm gains hold the full (TP-summed) gradient, like every replicated parameter
    plain.loss_fn(plain(idx), targets).backward()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        _close(got.grad, want.grad, f"sequence-parallel grad {name}")
    model.zero_grad()

    dense = copy.deepcopy(dense)
    # AdamW at tp only; SGD over dp as in _four_rank_body (Adam's g / sqrt(v) blows the dp sum's
    # rounding up on near-zero gradients)
    make_opt = (
        functools.partial(torch.optim.AdamW, lr=1e-2)
        if dp_group is None
        else functools.partial(torch.optim.SGD, lr=0.1)
    )
    dense_opt, sp_opt = make_opt(dense.parameters()), make_opt(model.parameters())
    for step in range(3):
        both = [_batch(step, r) for r in range(1 if dp_group is None else 2)]
        loss_dense = _step(dense, dense_opt, torch.cat([b[0] for b in both]), torch.cat([b[1] for b in both]))
        loss_sp = _step(model, sp_opt, *both[dp_rank], dp_group=dp_group)
        if dp_group is not None:
            dist.all_reduce(loss_sp, group=dp_group)
            loss_sp /= 2
        _close(loss_sp, loss_dense, f"sequence-parallel loss at step {step}")
    full = gather_tp_state_dict(model, group)
    for name, tensor in dense.state_dict().items():
        _close(full[name], tensor, f"sequence-parallel param {name} after 3 steps")
    plain.load_state_dict(model.state_dict())  # a sequence-parallel state dict is the plain one
    _close(plain(idx), model(idx), "plain TP model loaded from a sequence-parallel one")

    with pytest.raises(ValueError, match=r"tp\(2\) does not divide the sequence length \(7\)"):
        model(idx[:, :7])


def _check_saved_activations(dense: nn.Module, group: dist.ProcessGroup) -> None:
    """What a tp=2 Llama keeps for backward per rank equals the planner's count (1%) for every
    checkpointing mode, with and without sequence parallelism ([Note: measuring saved
    activations] in lightning_zero/planner/saved_activations.py), and the bytes of each TP collective of
    that forward + backward equal the planner's ``tp_bytes_by_kind`` exactly."""
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.planner.saved_activations import measure_saved_bytes
    from lightning_zero.planner.traffic import tp_bytes_by_kind
    from lightning_zero.tp.loss import TP_LOSS_LABEL

    size = dist.get_world_size(group)
    batch, seq_len = 4, 16
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, dense.config.vocab_size, (batch, seq_len), generator=gen)
    targets = torch.randint(0, dense.config.vocab_size, (batch, seq_len), generator=gen)
    for sequence_parallel in (False, True):
        predicted = llama_activation_bytes(
            dense.config, micro_batch=batch, seq_len=seq_len, act_bytes=4, tp=size, sequence_parallel=sequence_parallel
        )
        for mode in ("none", "selective", "full"):
            counter = CommCounter()
            model = parallelize_llama(copy.deepcopy(dense), group, counter=counter, sequence_parallel=sequence_parallel)
            model.activation_checkpointing = mode
            measured = measure_saved_bytes(model, idx, targets)
            want = predicted.saved_after_forward(mode)
            assert measured == pytest.approx(want, rel=0.01), (sequence_parallel, mode, measured, want)
            sent = {kind: sent for kind, sent in counter.bytes.items() if kind != TP_LOSS_LABEL}
            formula = tp_bytes_by_kind(
                dense.config,
                tokens=idx.numel(),
                tp=size,
                act_bytes=4,
                activation_checkpointing=mode,
                sequence_parallel=sequence_parallel,
            )
            assert sent == formula, (sequence_parallel, mode)


def test_layers_and_llama_tp2_match_dense():
    run_ranks(_two_rank_body, world_size=2, timeout_s=90)


def _four_rank_body(rank: int, world_size: int) -> None:
    """One 4-rank launch (spawning is the slow part on CPU): layers at tp=4, then tp=2 x dp=2."""
    _check_layers(dist.group.WORLD)  # tp=4

    # tp=2 x dp=2 on the (dp, tp) mesh vs a dense model trained on both dp ranks' batches
    from lightning_zero.models import Llama

    dims = ParallelDims(world_size=world_size, devices_per_node=2, tp=2)
    mesh = build_mesh(dims, "cpu")
    tp_group, tp_rank = tp_group_and_rank(mesh)
    dp_group, dp_rank = dp_group_and_rank(mesh)
    # mesh layout: TP = consecutive ranks (one node), DP = same local position across nodes
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert dist.get_process_group_ranks(tp_group) == dims.tp_ranks(rank) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(dp_group) == dims.dp_ranks(rank) == [rank % 2, rank % 2 + 2]
    assert (dp_rank, tp_rank) == divmod(rank, 2)
    cfg = _tiny_config()
    torch.manual_seed(0)
    dense = Llama(cfg)
    model = parallelize_llama(copy.deepcopy(dense), mesh)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    tp_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        # the dense reference sees the global batch (both dp ranks' halves) at once
        both = [_batch(step, r) for r in range(2)]
        idx_all, targets_all = torch.cat([b[0] for b in both]), torch.cat([b[1] for b in both])
        loss_dense = _step(dense, dense_opt, idx_all, targets_all)
        idx, targets = both[dp_rank]  # same batch on both ranks of a TP group
        loss_tp = _step(model, tp_opt, idx, targets, dp_group=dp_group)
        mean_loss = loss_tp.clone()
        dist.all_reduce(mean_loss, group=dp_group)
        _close(mean_loss / 2, loss_dense, f"dp-mean loss at step {step}")
        _check_zero_style_grad_norm(model, dense, dp_rank, dp_size=2, tp_size=2)
    full = gather_tp_state_dict(model, tp_group)
    for name, tensor in dense.state_dict().items():
        _close(full[name], tensor, f"param {name} after 2 SGD steps")

    torch.manual_seed(0)
    _check_sequence_parallel(Llama(cfg), tp_group, dp_group=dp_group, dp_rank=dp_rank)


def _check_zero_style_grad_norm(model: nn.Module, dense: nn.Module, dp_rank: int, dp_size: int, tp_size: int) -> None:
    """The documented rule under ZeRO-2: each rank holds a dp chunk of every local gradient;
    sum tp_grad_norm_weight(p) * ||chunk||^2 and all-reduce over the whole world."""
    local_sq = torch.zeros(())
    for param in model.parameters():
        grad_shard = param.grad.flatten().chunk(dp_size)[dp_rank]
        local_sq += tp_grad_norm_weight(param, tp_size) * grad_shard.pow(2).sum()
    dist.all_reduce(local_sq)
    expected = nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    _close(local_sq.sqrt(), expected, "ZeRO-style TP grad norm")


def test_layers_tp4_and_llama_tp2_dp2_match_dense():
    run_ranks(_four_rank_body, world_size=4, timeout_s=90)
