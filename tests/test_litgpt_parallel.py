"""LitGPT's GPT under context parallelism through the parallelize registry (runtime/parallelize.py).

- In-process (2 gloo ranks, no Lightning): ``parallelize_litgpt`` on LitGPT's ``GPT`` and LoRA's,
  Ulysses and ring attention, odd lengths and a chunked head: the loss equals the dense model's and
  the gradients averaged over the cp ranks equal its gradients.
- LitGPT's own ``finetune_lora`` and ``pretrain`` under ``--cp 2``: tests/test_litgpt_scripts.py.
- The registry refuses a model it does not know, naming the families, before any process group.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import ZeroConfig
from tests.distributed import run_ranks

NEEDED = ("litgpt", "litdata", "jsonargparse", "tokenizers")
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]
needs_litgpt = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {MISSING} (README: pip install --no-deps litgpt litdata)")  # fmt: skip

CONFIG = dict(name="tiny-lz", block_size=32, vocab_size=120, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32,
              n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
              mlp_class_name="LLaMAMLP", intermediate_size=64)  # fmt: skip


def _seeded_litgpt(overrides: dict, lora_knobs: "dict | None", perturbed: tuple) -> nn.Module:
    """LitGPT's GPT (LoRA's when ``lora_knobs`` are given) from seed 0 over ``CONFIG``, the
    parameters whose names contain one of ``perturbed`` drawn from N(0, 0.1) (LoRA's B starts at
    zero, biases and norms at constants: a split that mixes them up would go unseen)."""
    if lora_knobs is not None:
        from litgpt.lora import GPT, Config
    else:
        from litgpt.model import GPT, Config
    torch.manual_seed(0)
    dense = GPT(Config(**{**CONFIG, **overrides}, **(lora_knobs or {})))
    with torch.no_grad():
        for name, param in dense.named_parameters():
            if any(part in name for part in perturbed):
                param.normal_(std=0.1)
    return dense


def test_a_model_outside_the_registry_is_refused_naming_the_families():
    from lightning_zero.runtime.parallelize import check_layout
    from lightning_zero.runtime.setup import parallel_dims

    for knobs in (dict(tensor_parallel_size=2), dict(cp=2), dict(ep=2)):
        with pytest.raises(ValueError, match=r"does not declare .* the families are: .*MoETransformer.*Llama.*litgpt"):
            parallel_dims(ZeroConfig(**knobs), num_nodes=1, num_processes=4, lightning_module=nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"ZeroStrategy\(cp=2\): Sequential .*litgpt\.model\.GPT"):
        check_layout(ParallelDims(world_size=2, devices_per_node=2, cp=2), nn.Sequential(nn.Linear(2, 2)))
    check_layout(ParallelDims(world_size=2, devices_per_node=2), nn.Linear(2, 2))  # dp only: any model
    assert not torch.distributed.is_initialized()  # refused before any process group started


def _loss(gpt: nn.Module, idx: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """LitGPT's loss as ``pretrain`` (whole head) or ``finetune_lora`` (chunked head, shifted) computes it."""
    from litgpt.utils import chunked_cross_entropy

    if not chunk:
        return chunked_cross_entropy(gpt(idx), targets)
    logits = gpt(idx, lm_head_chunk_size=chunk)
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, targets[..., 1:])


def _litgpt_layout_refusals_name_the_fix() -> None:
    from litgpt.adapter import GPT as AdapterGPT
    from litgpt.adapter import Config as AdapterConfig
    from litgpt.model import GPT, Config

    from lightning_zero.runtime.parallelize import check_layout

    dims = ParallelDims(world_size=2, devices_per_node=2, cp=2)
    check_layout(dims, nn.ModuleDict({"gpt": GPT(Config(**CONFIG))}))  # found inside a wrapper
    check_layout(ParallelDims(world_size=2, devices_per_node=2, tp=2), GPT(Config(**CONFIG)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*n_query_groups\(1\); pick tp"):
        check_layout(
            ParallelDims(world_size=2, devices_per_node=2, tp=2), GPT(Config(**{**CONFIG, "n_query_groups": 1}))
        )
    with pytest.raises(ValueError, match=r"cp=2.*sliding_window_size=4.*use cp=1"):
        check_layout(dims, GPT(Config(**CONFIG, sliding_window_size=4)))
    with pytest.raises(ValueError, match=r"cp=2.*adapter.*use cp=1"):
        check_layout(dims, AdapterGPT(AdapterConfig(**CONFIG, adapter_prompt_length=4, adapter_start_layer=0)))


def _parallel_litgpt_equals_dense(rank: int, world: int) -> None:
    import copy

    from lightning_zero.comm.mesh import build_groups
    from lightning_zero.runtime.parallelize import ParallelPlan
    from lightning_zero.runtime.throughput import batch_tokens

    torch.set_num_threads(1)
    if rank == 0:
        _litgpt_layout_refusals_name_the_fix()  # here: LitGPT is imported in the ranks, not in pytest's process
    groups = build_groups(ParallelDims(world_size=world, devices_per_node=world, cp=world))
    worst = {}
    # (LoRA?, T, lm_head chunk, config overrides): Ulysses; LoRA's qkv, an odd length, a chunked head;
    # 3 heads over cp 2: ring attention
    cases = [(False, 16, 0, {}), (True, 15, 4, {}), (False, 13, 0, dict(n_head=3, n_query_groups=1, n_embd=24))]
    for lora, length, chunk, overrides in cases:
        lora_knobs = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True) if lora else None
        dense = _seeded_litgpt(overrides, lora_knobs, perturbed=("lora_B",))
        model = ParallelPlan(groups).apply(copy.deepcopy(dense))[0]
        if lora:  # LoRA's GPT reads a base model's keys (qkv.weight for qkv.linear.weight) under cp too
            with torch.no_grad():
                for param in model.parameters():
                    param.zero_()
            base_keys = {key.replace(".linear.", "."): value for key, value in dense.state_dict().items()}
            model.load_state_dict(base_keys, strict=True)
        idx, targets = torch.randint(0, 120, (2, length)), torch.randint(0, 120, (2, length))

        dense_loss, loss = _loss(dense, idx, targets, chunk), _loss(model, idx, targets, chunk)
        dense_loss.backward()
        loss.backward()
        grads = {name: param.grad for name, param in dense.named_parameters() if param.grad is not None}
        diff = abs(loss.item() - dense_loss.item())
        for name, param in model.named_parameters():
            if param.grad is not None:
                averaged = param.grad.clone()
                torch.distributed.all_reduce(averaged)  # the engine's average over the dp x cp ranks
                diff = max(diff, (averaged / world - grads.pop(name)).abs().max().item())
        assert not grads, sorted(grads)  # every parameter the dense model trains got a gradient
        assert list(model.state_dict()) == list(dense.state_dict())  # names unchanged
        # the monitor reads the whole batch before the cut and counts this rank's T_pad / cp slice
        assert batch_tokens(model, (idx,)) == (2, -(-length // world)), batch_tokens(model, (idx,))
        assert batch_tokens(dense, (idx,)) == (2, length)
        worst[f"lora={lora} T={length} chunk={chunk} {overrides}"] = diff
    assert all(diff <= 1e-6 for diff in worst.values()), worst
    _tensor_parallel_litgpt_equals_dense(world)


def _tensor_parallel_litgpt_equals_dense(world: int) -> None:
    """tp = 2 (with and without sequence parallelism) on LitGPT's GPT and LoRA's (LoRA on q, v and
    the MLP, biases on): the loss equals the dense model's, each rank's gradient of a split
    parameter is its part of the dense gradient, a replicated one's is the dense gradient; the
    state dict gathered to dense coordinates is the dense model's."""
    import copy

    from lightning_zero.comm.mesh import build_groups
    from lightning_zero.runtime.parallelize import ParallelPlan
    from lightning_zero.tp.segments import gather_dense, tp_segments

    groups = build_groups(ParallelDims(world_size=world, devices_per_node=world, tp=world))
    worst = {}
    lora_knobs = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True, lora_projection=True)
    cases = [(False, True, 16, 0, {}), (True, True, 15, 4, dict(bias=True)), (True, False, 13, 0, {}),
             (False, True, 11, 0, dict(mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", bias=True,
                                       parallel_residual=True, n_query_groups=4))]  # fmt: skip
    for lora, sequence_parallel, length, chunk, overrides in cases:
        dense = _seeded_litgpt(overrides, lora_knobs if lora else None, perturbed=("lora_B", "bias", "norm"))
        model = ParallelPlan(groups, sequence_parallel=sequence_parallel).apply(copy.deepcopy(dense))[0]
        idx, targets = torch.randint(0, 120, (2, length)), torch.randint(0, 120, (2, length))
        dense_loss, loss = _loss(dense, idx, targets, chunk), _loss(model, idx, targets, chunk)
        dense_loss.backward()
        loss.backward()
        diff = abs(loss.item() - dense_loss.item())
        grads = {name: param.grad for name, param in dense.named_parameters()}
        values = dict(dense.named_parameters())
        for name, param in model.named_parameters():
            dim = getattr(param, "_tp_shard_dim", None)
            grad, value = param.grad, param.detach()
            if dim is not None:
                grad = gather_dense(grad, dim, tp_segments(param), groups.tp)
                value = gather_dense(value, dim, tp_segments(param), groups.tp)
            diff = max(diff, (grad - grads.pop(name)).abs().max().item())
            assert torch.equal(value, values[name].detach()), name
        assert not grads, sorted(grads)
        worst[f"tp lora={lora} sp={sequence_parallel} T={length} chunk={chunk} {overrides}"] = diff
    assert all(diff <= 1e-6 for diff in worst.values()), worst


def test_qkv_rows_permute_to_whole_heads_per_rank_and_back():
    """[Note: segmented TP split]: LitGPT's fused qkv rows (queries, then keys, then values) cut per
    segment give each TP rank whole heads of each kind; the ranks' parts in rank order are the dense
    rows permuted, and gathering them back (the full state dict) undoes the permutation exactly."""
    from lightning_zero.tp.segments import dense_from_ranks, local_part, segment_permutation

    head_size = 3
    for n_head, n_groups, tp in ((4, 2, 2), (8, 2, 2), (8, 4, 4), (6, 6, 3), (4, 4, 1)):
        segments = (n_head * head_size, n_groups * head_size, n_groups * head_size)
        dense = torch.arange(sum(segments) * 2, dtype=torch.float32).view(sum(segments), 2)
        parts = [local_part(dense, 0, segments, rank, tp) for rank in range(tp)]
        perm = segment_permutation(segments, tp)
        assert sorted(perm.tolist()) == list(range(sum(segments)))
        assert torch.equal(torch.cat(parts), dense.index_select(0, perm))
        assert torch.equal(dense_from_ranks(torch.cat(parts), 0, segments, tp), dense)
        for rank, part in enumerate(parts):  # rank r: query heads [r nh/tp, ...), then its key and value groups
            q, k, v = part.split((n_head // tp * head_size, n_groups // tp * head_size, n_groups // tp * head_size))
            queries = dense[: segments[0]].view(n_head, head_size, 2)[rank * n_head // tp : (rank + 1) * n_head // tp]
            keys = dense[segments[0] : segments[0] + segments[1]].view(n_groups, head_size, 2)
            values = dense[segments[0] + segments[1] :].view(n_groups, head_size, 2)
            groups = slice(rank * n_groups // tp, (rank + 1) * n_groups // tp)
            assert torch.equal(q, queries.reshape(-1, 2))
            assert torch.equal(k, keys[groups].reshape(-1, 2)) and torch.equal(v, values[groups].reshape(-1, 2))
    with pytest.raises(ValueError, match=r"tp\(2\) does not divide a segment of \(12, 3, 3\)"):
        local_part(torch.zeros(18, 2), 0, (12, 3, 3), 0, 2)
    # a sharded checkpoint places parts as rectangles of the dense tensor: per-segment ones are refused
    from lightning_zero.checkpoint.targets import RankPlacement, split_of

    qkv = torch.nn.Parameter(torch.zeros(18, 2))
    qkv._tp_shard_dim, qkv._tp_segments = 0, (12, 3, 3)
    with pytest.raises(ValueError, match=r"split over TP per segment .*state_dict_type='full'"):
        split_of(qkv, RankPlacement(world_size=2, tp_size=2, tp_rank=1))


@needs_litgpt
def test_litgpt_gpt_under_cp_and_tp_equals_the_dense_model_and_refuses_what_it_cannot_run():
    run_ranks(_parallel_litgpt_equals_dense, world_size=2)


def test_no_model_reads_its_strategy():
    """[Note: the parallelize registry]: the doors push the layout's groups into a model family's
    step; no code under models/ reaches up for them (``trainer.strategy``, its ``mesh_groups``, the
    LightningModule's ``device_mesh``)."""
    import ast
    from pathlib import Path

    models = Path(__file__).resolve().parents[1] / "src" / "lightning_zero" / "models"
    reads = []
    for path in sorted(models.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if name in ("strategy", "mesh_groups", "device_mesh", "_device_mesh"):
                reads.append(f"{path.relative_to(models)}:{node.lineno}")
    assert reads == []
