"""Context parallelism (``lightning_zero.cp``): layout checks without any process group, then the
Ulysses model on 2 gloo ranks against the unsliced model in one process.

The multi-rank cases run in one launch (``_engine_cases``): cp=2 with grouped-query attention
(kv heads split over cp), cp=2 with one kv head (repeated before the exchange, ALST), and a
batch whose counted targets all lie in the second slice, so its loss reaches the first slice's
tokens only through attention across the slice border (and rank 0 counts no token at all).
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.cp import check_context_parallel, context_slice_bounds, kv_head_repeats, ulysses_layout
from lightning_zero.models import LlamaConfig
from tests.distributed import run_ranks

SEQ = 2048
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)


# -- layout arithmetic (no process group) --------------------------------------------------------


@pytest.mark.parametrize(
    "q_heads, kv_heads, cp, repeats",
    [(4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (8, 1, 4, 4), (12, 4, 3, 3), (32, 8, 4, 1)],
)
def test_kv_head_repeats(q_heads, kv_heads, cp, repeats):
    assert kv_head_repeats(q_heads, kv_heads, cp) == repeats
    # every query head meets its own kv head after the repeat and the split
    group = q_heads // kv_heads
    for rank in range(cp):
        for local in range(q_heads // cp):
            head = rank * q_heads // cp + local
            local_kv = local // (group // repeats)
            assert (rank * kv_heads * repeats // cp + local_kv) // repeats == head // group


@pytest.mark.parametrize(
    "cp, tp, n_heads, n_kv_heads, seq_len, sp, match",
    [
        (2, 2, 6, 3, 2048, False, r"ring attention\): tp\(2\) must divide n_heads\(6\) and n_kv_heads\(3\)"),
        (2, 1, 4, 2, 2047, False, r"cp\(2\) does not divide the sequence length \(2047\).*multiple of 2"),
        (2, 2, 8, 2, 2050, True, r"slice of 1025 tokens.*does not split over tp\(2\).*multiple of 4"),
        (0, 1, 4, 2, 2048, False, r"cp must be a positive int"),
    ],
)
def test_refused_layouts_name_the_fix(cp, tp, n_heads, n_kv_heads, seq_len, sp, match):
    config = LlamaConfig.from_name("tiny", n_heads=n_heads, n_kv_heads=n_kv_heads, dim=8 * n_heads)
    with pytest.raises(ValueError, match=match):
        check_context_parallel(cp, tp=tp, model_config=config, seq_len=seq_len, sequence_parallel=sp)


@pytest.mark.parametrize(
    "knobs, processes, n_heads, seq_len, match",
    [
        (dict(cp=2), 2, 4, 2047, r"cp\(2\) does not divide the sequence length \(2047\).*multiple of 2"),
        (dict(cp=2, tensor_parallel_size=2, sequence_parallel=True), 4, 4, 2050, r"does not split over tp\(2\)"),
        (dict(ep=2), 2, 4, 2048, r"ZeroStrategy\(ep=2\): LlamaLM has no expert layers"),
    ],
)
def test_strategy_refuses_a_layout_before_any_process_group(knobs, processes, n_heads, seq_len, match):
    """The runtime's layout check (``runtime/setup.py``) asks ``LlamaLM.check_parallel_dims``,
    before any process group starts, with the trainer's data module's ``seq_len``."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.setup import parallel_dims

    module = LlamaLM(dict(CONFIG, n_heads=n_heads, n_kv_heads=2, dim=8 * n_heads))
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=seq_len), strategy=SimpleNamespace(**knobs))
    with pytest.raises(ValueError, match=match):
        parallel_dims(ZeroConfig(**knobs), num_nodes=1, num_processes=processes, lightning_module=module)
    assert not dist.is_initialized()


def test_strategy_states_the_kv_repeat_before_launch():
    from types import SimpleNamespace

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.setup import parallel_dims

    module = LlamaLM(CONFIG)  # 2 kv heads: 1 per TP rank at tp=2, repeated 2x for cp=2
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=SEQ), strategy=SimpleNamespace())
    with pytest.warns(UserWarning, match=r"n_kv_heads\(2\) / tp\(2\) = 1 .* repeated 2x"):
        parallel_dims(ZeroConfig(cp=2, tensor_parallel_size=2), num_nodes=1, num_processes=4, lightning_module=module)


@pytest.mark.parametrize(
    "cp, tp, n_heads, match",
    [
        (3, 1, 4, r"tp\(1\) x cp\(3\) = 3 does not divide n_heads\(4\).*pick cp from \[1, 2, 4\]"),
        (2, 2, 2, r"tp\(2\) x cp\(2\) = 4 does not divide n_heads\(2\)"),
    ],
)
def test_ulysses_refuses_heads_that_do_not_split_and_the_rule_picks_the_ring(cp, tp, n_heads, match):
    from lightning_zero.cp.layout import RingLayout, attention_layout

    config = LlamaConfig.from_name("tiny", n_heads=n_heads, n_kv_heads=2, dim=8 * n_heads)
    with pytest.raises(ValueError, match=match):
        ulysses_layout(cp, tp, config)
    assert isinstance(check_context_parallel(cp, tp=tp, model_config=config, seq_len=2048 * 3), RingLayout)
    assert attention_layout(cp, tp, config) == check_context_parallel(cp, tp=tp, model_config=config)


def test_strategy_states_ring_attention_before_launch():
    """Query heads that do not split over ``tp * cp`` (Ulysses cannot) run ring attention: stated
    before launch; the planner plans the same layout with the ring (the same rule)."""
    from types import SimpleNamespace

    from lightning_zero.config import ZeroConfig
    from lightning_zero.models import LlamaLM
    from lightning_zero.runtime.setup import parallel_dims

    module = LlamaLM(dict(CONFIG, n_heads=2, n_kv_heads=2, dim=16))
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=SEQ), strategy=SimpleNamespace())
    with pytest.warns(UserWarning, match=r"ring attention.*cp\(4\) = 4 does not divide n_heads\(2\)"):
        parallel_dims(ZeroConfig(cp=4), num_nodes=1, num_processes=4, lightning_module=module)
    from lightning_zero.cp.layout import RingLayout

    assert isinstance(check_context_parallel(4, model_config=module.config), RingLayout)  # the planner's check


def test_kv_replication_is_stated():
    config = LlamaConfig.from_name("tiny", n_heads=8, n_kv_heads=2, dim=64)
    assert "repeated" not in ulysses_layout(2, 1, config).describe()
    line = ulysses_layout(2, 2, config).describe()  # one kv head per TP rank, cp=2
    assert "n_kv_heads(2) / tp(2) = 1" in line and "repeated 2x" in line


def test_slices_share_their_border_token():
    bounds = [context_slice_bounds(2048, 4, rank) for rank in range(4)]
    assert bounds == [(0, 513), (512, 1025), (1024, 1537), (1536, 2049)]


# -- the model on 2 ranks against the unsliced one ----------------------------------------------


def _dense_and_cp(config: dict, inputs: torch.Tensor, targets: torch.Tensor, group) -> tuple:
    """(loss, grads) of the unsliced model, then of the context-parallel one on this rank's slice
    (its gradients averaged over the cp group, as the engine's dp x cp average does), its counter."""
    import torch.distributed as dist

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.models.llama.model import build_llama

    torch.manual_seed(0)
    dense = build_llama(LlamaConfig(**config))
    loss = dense.loss_fn(dense(inputs), targets)
    loss.backward()
    want = {name: param.grad.clone() for name, param in dense.named_parameters()}

    torch.manual_seed(0)
    counter = CommCounter()
    model = parallelize_context(build_llama(LlamaConfig(**config)), group, counter=counter)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    start, stop = context_slice_bounds(inputs.size(1), cp, rank)
    cp_loss = model.loss_fn(model(inputs[:, start : stop - 1]), targets[:, start : stop - 1])
    cp_loss.backward()
    got = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        got[name] = grad / cp
    return loss, want, cp_loss, got, counter


def _check(loss, want, cp_loss, got) -> None:
    torch.testing.assert_close(cp_loss, loss, rtol=1e-5, atol=1e-5)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _engine_cases(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.models.llama.model import build_llama
    from lightning_zero.planner.saved_activations import measure_saved_bytes
    from lightning_zero.planner.traffic import cp_bytes_by_kind

    world = dist.group.WORLD
    batch = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(7))
    inputs, targets = batch[:, :-1], batch[:, 1:]

    # grouped-query attention, kv heads split over cp; all-to-all bytes per the formula
    loss, want, cp_loss, got, counter = _dense_and_cp(CONFIG, inputs, targets, world)
    _check(loss, want, cp_loss, got)
    shard, head_dim = SEQ // world_size, CONFIG["dim"] // CONFIG["n_heads"]
    heads_sent = 2 * CONFIG["n_heads"] + 2 * CONFIG["n_kv_heads"]  # q + k + v there, y back
    per_layer = (world_size - 1) / world_size * 2 * shard * head_dim * heads_sent * 4  # B=2, fp32
    assert counter.bytes["cp_all_to_all"] == pytest.approx(2 * CONFIG["n_layers"] * per_layer)  # fwd + bwd
    assert counter.calls["cp_all_to_all"] == 4 * CONFIG["n_layers"]
    assert counter.bytes == cp_bytes_by_kind(
        LlamaConfig(**CONFIG), tokens=inputs.numel(), cp=world_size, act_bytes=4
    ) | {"cp_all_reduce_loss": 2 * 2 * (world_size - 1) / world_size * 2 * 8}  # [sum, count] fp64, fwd + bwd

    # one kv head: repeated before the exchange (ALST)
    _check(*_dense_and_cp(dict(CONFIG, n_kv_heads=1), inputs, targets, world)[:4])

    # only second-slice targets count (rank 0 counts none); the first slice's tokens (ids < 32,
    # none in the second slice) reach the loss only through attention across the border
    half = SEQ // 2
    crossing = torch.cat([inputs[:, :half] % 32, 32 + inputs[:, half:] % 32], dim=1)
    ignored = targets.clone()
    ignored[:, :half] = -100
    loss, want, cp_loss, got, _ = _dense_and_cp(CONFIG, crossing, ignored, world)
    first_rows = want["tok_embeddings.weight"][:32]
    assert first_rows.abs().sum() > 0  # the dense loss does depend on the first slice
    _check(loss, want, cp_loss, got)

    # saved activations per rank = the planner's (1%), every checkpointing mode, kv heads split
    # over cp and repeated for it; and the bytes of each mode's exchanges = the formula
    for n_kv_heads in (2, 1):
        config = LlamaConfig(**dict(CONFIG, n_kv_heads=n_kv_heads))
        for mode in ("none", "selective", "full"):
            torch.manual_seed(0)
            counter = CommCounter()
            model = parallelize_context(build_llama(config), world, counter=counter)
            model.activation_checkpointing = mode
            start, stop = context_slice_bounds(SEQ, world_size, rank)
            measured = measure_saved_bytes(model, inputs[:, start : stop - 1], targets[:, start : stop - 1])
            predicted = llama_activation_bytes(config, micro_batch=2, seq_len=SEQ, act_bytes=4, cp=world_size)
            assert measured == pytest.approx(predicted.saved_after_forward(mode), rel=0.01), (n_kv_heads, mode)
            formula = cp_bytes_by_kind(
                config, tokens=inputs.numel(), cp=world_size, act_bytes=4, activation_checkpointing=mode
            )
            assert counter.bytes["cp_all_to_all"] == pytest.approx(formula["cp_all_to_all"]), (n_kv_heads, mode)


@pytest.mark.slow
def test_ulysses_model_equals_the_unsliced_one():
    run_ranks(_engine_cases, world_size=2, timeout_s=300)


# -- the planner ---------------------------------------------------------------------------------


def test_plan_holds_a_cp_slice_and_pays_the_all_to_alls_on_their_link():
    import dataclasses

    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.planner import plan_run
    from lightning_zero.planner.hardware import collective_seconds, load_hardware
    from lightning_zero.planner.traffic import cp_bytes_by_kind
    from lightning_zero.planner.workload import cp_all_to_all_payloads

    config = dataclasses.replace(LlamaConfig.from_name("llama3_8b"), max_seq_len=131072)
    common = dict(stage=3, world_size=16, devices_per_node=8, seq_len=131072, hardware="h100_80gb", suggest=False)
    plans = {cp: plan_run(config, cp=cp, **common) for cp in (1, 2, 8, 16)}
    for cp, plan in plans.items():
        acts = llama_activation_bytes(config, micro_batch=1, seq_len=131072, act_bytes=2, cp=cp)
        assert plan.activation_detail == acts and (plan.cp, plan.dp) == (cp, 16 // cp)
        tokens = plan.micro_batch * plan.seq_len
        assert plan.traffic.cp_all_to_all_bytes == sum(
            cp_bytes_by_kind(config, tokens=tokens, cp=cp, act_bytes=2).values()
        )
    assert plans[1].traffic.cp_all_to_all_bytes == plans[1].traffic.cp_s == 0
    # cp=8 stays in a node (NVLink), cp=16 spans two: each exchange at that link's speed, blocking
    hw = load_hardware("h100_80gb")
    for cp, inter in ((8, False), (16, True)):
        plan = plans[cp]
        assert plan.traffic.cp_link == ("inter_node" if inter else "intra_node")
        payloads = cp_all_to_all_payloads(config, tokens=131072, cp=cp, tp=1, act_bytes=2)
        exchange = sum(collective_seconds("all_to_all", p, cp, hw.link(inter_node=inter)) for p in payloads)
        assert plan.traffic.cp_s == pytest.approx(2 * config.n_layers * exchange)
        assert plan.traffic.compute_s > plan.traffic.cp_s > 0
    assert plans[16].traffic.inter_node_bytes >= plans[16].traffic.cp_all_to_all_bytes
    # activations shrink with cp; the whole step's compute splits over the cp ranks
    assert plans[8].memory.activations < plans[2].memory.activations / 3.9
    assert plans[8].traffic.flops_per_rank == pytest.approx(plans[1].traffic.flops_per_rank / 8)


def test_search_chooses_cp_for_a_long_sequence():
    import dataclasses

    from lightning_zero.planner import search_layouts
    from lightning_zero.planner.search import cp_sizes_for

    assert cp_sizes_for(8192, 64) == [1] and cp_sizes_for(131072, 8) == [1, 2, 4, 8]
    config = dataclasses.replace(LlamaConfig.from_name("llama3_8b"), max_seq_len=131072)
    common = dict(world_size=8, devices_per_node=8, global_batch=8, hardware="h100_80gb", topology=False)
    long = search_layouts(config, seq_len=131072, micro_batches=(1,), **common)
    best = long.ranked[0]
    assert best.layout.cp > 1 and f"strategy.cp={best.layout.cp}" in best.layout.overrides()
    without = search_layouts(config, seq_len=131072, micro_batches=(1,), cp_sizes=(1,), **common)
    assert without.ranked[0].plan.tokens_per_s < best.plan.tokens_per_s  # tp=8 + sequence parallel fits
    short = search_layouts(config, seq_len=8192, micro_batches=(1,), **common)
    assert short.ranked and all(entry.layout.cp == 1 for entry in short.ranked)


def test_plan_plans_a_ring_layout_with_the_engines_bytes_and_names_it():
    """A layout whose query heads do not split over ``tp * cp`` is planned with ring attention, the
    engine's rule (``cp.layout.attention_layout``): its ``cp_ring_kv`` bytes are what the Trainer
    run of ``tests/test_cp_strategy.py`` counts (8,388,608 a rank over 4 steps; 4,194,304 under
    tp=2, docs/context_parallel.md; that launch checks the counter against this planner too), its
    activations the ring's, its hops in the step time, and the report names the ring."""
    import io

    from rich.console import Console

    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.planner import plan_run
    from lightning_zero.planner.hardware import load_hardware
    from lightning_zero.planner.tables import layout_line, print_tables
    from tests.scripts.cp_parity import HEADS3, HEADS6, SEQ, STEPS

    common = dict(stage=2, micro_batch=2, seq_len=SEQ, precision="32-true", suggest=False, hardware="h100_80gb")
    for shape, tp, measured in ((HEADS3, 1, 8_388_608), (HEADS6, 2, 4_194_304)):
        config = LlamaConfig(**shape)
        plan = plan_run(config, cp=2, tp=tp, world_size=2 * tp, devices_per_node=8, **common)
        assert plan.cp_attention == "ring" and "ring attention" in plan.cp_notice
        assert plan.traffic.cp_bytes_by_kind == {"cp_ring_kv": measured / STEPS}
        assert plan.traffic.cp_all_to_all_bytes == 0 and plan.traffic.intra_node_bytes >= measured / STEPS
        assert plan.activation_detail == llama_activation_bytes(
            config, micro_batch=2, seq_len=SEQ, act_bytes=4, tp=tp, cp=2
        )
        assert "cp=2 (ring attention)" in layout_line(plan)
        # 4 hops a layer (forward 1, backward 1 + 2), each one latency + block / bandwidth, blocking
        link = load_hardware("h100_80gb").link(inter_node=False)
        block = 2 * 2 * SEQ // 2 * config.n_kv_heads // tp * config.head_dim * 4
        assert plan.traffic.cp_s == pytest.approx(config.n_layers * 4 * (link.latency_s + block / link.bytes_per_s))
        out = io.StringIO()
        print_tables(plan, [plan], console=Console(file=out, width=200))
        assert "ring attention" in out.getvalue() and "cp_ring_kv" in out.getvalue()
    # the ring keeps q, k, v unrepeated, its output (wo's input) and a log-sum-exp per head and
    # token (compute dtype); selective checkpointing recomputes none of it
    config = LlamaConfig(**HEADS3)
    ring = llama_activation_bytes(config, micro_batch=2, seq_len=SEQ, act_bytes=4, cp=2)
    tokens, q_dim, kv_dim = 2 * SEQ // 2, config.dim, config.n_kv_heads * config.head_dim
    assert ring.terms["attention_q_k_v"] == tokens * (q_dim + 2 * kv_dim) * 4
    assert ring.terms["attention_logsumexp"] == tokens * config.n_heads * 4
    assert "attention_output_heads" not in ring.terms
    assert ring.saved_after_forward("selective") == ring.saved_after_forward("none")
    # full recompute runs the forward ring again: 5 hops a layer at cp=2
    full = plan_run(config, cp=2, world_size=2, devices_per_node=8, activation_checkpointing="full", **common)
    assert full.traffic.cp_bytes_by_kind["cp_ring_kv"] == 8_388_608 / STEPS * 5 / 4


def test_search_offers_ring_layouts():
    """``plan.search`` plans the layouts whose heads do not split over ``tp * cp`` with the ring."""
    import dataclasses

    from lightning_zero.planner import search_layouts

    config = dataclasses.replace(LlamaConfig.from_name("llama3_8b"), max_seq_len=131072)
    config = dataclasses.replace(config, n_heads=24, n_kv_heads=8, dim=24 * 128)  # 24 heads: 3 per TP rank at tp=8
    common = dict(world_size=16, devices_per_node=8, global_batch=16, hardware="h100_80gb", topology=False)
    result = search_layouts(config, seq_len=131072, micro_batches=(1,), tp_sizes=(8,), cp_sizes=(2,), **common)
    assert result.ranked and {entry.plan.cp_attention for entry in result.ranked} == {"ring"}
    assert all(entry.as_dict()["cp_attention"] == "ring" for entry in result.ranked[:1])


def test_monitor_counts_a_cp_ranks_flops_as_the_planner_does():
    """``ZeroMonitor``'s MFU under cp: the rank's ``T/cp`` slice attends over all ``T`` tokens with
    ``1/cp`` of the heads, so its FLOPs are ``1/cp`` of the whole sequence's, not a short sequence's."""
    from lightning_zero.planner.workload import training_flops
    from lightning_zero.runtime.throughput import training_flops_of

    config = LlamaConfig(**CONFIG)
    whole = training_flops(config, micro_batch=2, seq_len=SEQ)
    assert training_flops_of(config, 0, 2, SEQ // 4, tp=1, cp=4) == pytest.approx(whole / 4)
    assert training_flops_of(config, 0, 2, SEQ // 4, tp=1, cp=4) > training_flops(
        config, micro_batch=2, seq_len=SEQ // 4
    )


# -- ring attention ------------------------------------------------------------------------------

RING_SEQ = 256


def _ring_cases(rank: int, world_size: int) -> None:
    """[Note: ring attention] on ``world_size`` cp ranks against the unsliced model in one process:
    loss and gradients (averaged over the cp ranks, as the engine's dp x cp average does) to 1e-5,
    for grouped-query heads (forced ring where Ulysses would run), 3 heads (Ulysses cannot split
    them: ``"auto"`` picks the ring) and plain multi-head attention; the kv blocks' bytes equal
    ``(cp-1)`` hops forward, ``(cp-1)`` of the block and ``cp`` of its gradient backward."""
    import torch.distributed as dist

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.cp.ring_attention import RingAttention
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.models.llama.model import build_llama
    from lightning_zero.planner.saved_activations import measure_saved_bytes
    from lightning_zero.planner.traffic import cp_bytes_by_kind, cp_ring_kv_bytes_per_layer

    batch = torch.randint(0, 64, (2, RING_SEQ + 1), generator=torch.Generator().manual_seed(7))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    start, stop = context_slice_bounds(RING_SEQ, world_size, rank)
    for shape, attention in ((dict(n_heads=4, n_kv_heads=2, dim=32), "ring"), (dict(n_heads=3, n_kv_heads=1, dim=48), "auto"),
                             (dict(n_heads=4, n_kv_heads=4, dim=32), "ring")):  # fmt: skip
        config = LlamaConfig(**dict(CONFIG, max_seq_len=RING_SEQ, **shape))
        torch.manual_seed(0)
        dense = build_llama(config)
        loss = dense.loss_fn(dense(inputs), targets)
        loss.backward()
        torch.manual_seed(0)
        counter = CommCounter()
        model = parallelize_context(build_llama(config), dist.group.WORLD, counter=counter, attention=attention)
        assert isinstance(model.layers[0].attention.sequence_exchange, RingAttention), shape
        cp_loss = model.loss_fn(model(inputs[:, start : stop - 1]), targets[:, start : stop - 1])
        cp_loss.backward()
        torch.testing.assert_close(cp_loss, loss, rtol=1e-5, atol=1e-5)
        for (name, want), got in zip(dense.named_parameters(), model.parameters()):
            grad = got.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / world_size, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        block = 2 * 2 * shape["n_kv_heads"] * (RING_SEQ // world_size) * config.head_dim * 4  # k and v, fp32
        hops = 3 * world_size - 2  # forward cp-1; backward cp-1 of the block, cp of its gradient
        assert counter.bytes["cp_ring_kv"] == config.n_layers * hops * block, shape
        # the planner's ring bytes (its formula, for the forced rings too) are the engine's count
        per_layer = cp_ring_kv_bytes_per_layer(config, tokens=inputs.numel(), cp=world_size, act_bytes=4)
        assert counter.bytes["cp_ring_kv"] == config.n_layers * per_layer, shape

    # saved activations per rank = the planner's ring terms, and each checkpointing mode's ring bytes
    # (full recompute runs the forward ring again) = the planner's, for the layout "auto" rings
    config = LlamaConfig(**dict(CONFIG, max_seq_len=RING_SEQ, n_heads=3, n_kv_heads=1, dim=48))
    predicted = llama_activation_bytes(config, micro_batch=2, seq_len=RING_SEQ, act_bytes=4, cp=world_size)
    for mode in ("none", "selective", "full"):
        counter = CommCounter()
        model = parallelize_context(build_llama(config), dist.group.WORLD, counter=counter)
        model.activation_checkpointing = mode
        measured = measure_saved_bytes(model, inputs[:, start : stop - 1], targets[:, start : stop - 1])
        assert measured == pytest.approx(predicted.saved_after_forward(mode), rel=0.01), mode
        planned = cp_bytes_by_kind(
            config, tokens=inputs.numel(), cp=world_size, act_bytes=4, activation_checkpointing=mode
        )
        assert counter.bytes["cp_ring_kv"] == planned["cp_ring_kv"], mode


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_the_unsliced_model(cp):
    run_ranks(_ring_cases, world_size=cp, timeout_s=300)


# -- tp x cp: saved activations and all-to-all bytes per rank on 4 ranks ------------------------

TP_CP_SEQ = 256


def _tp_cp_activation_cases(rank: int, world_size: int, out: str) -> None:
    """On the ``(dp, cp, tp) = (1, 2, 2)`` layout's groups (``comm/mesh.py`` ``build_groups``):
    heads split by tp, then by cp; what each rank keeps for backward against
    ``llama_activation_bytes(..., tp=2, cp=2)`` (1%), and its all-to-all bytes against
    ``cp_bytes_by_kind(..., tp=2)`` exactly, for kv heads split over cp (4 kv heads: 2 per TP rank)
    and repeated for it (2 kv heads: 1 per TP rank, repeated 2x), with and without sequence
    parallelism, every checkpointing mode. The vocabulary is 256 so that the loss's share is as
    in a real model's (the largest); what is left between the two is the same in every case (every
    per-layer term is exact). Rank 0 writes what it measured."""
    import json

    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.comm.mesh import ParallelDims, build_groups
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.models.llama.model import build_llama
    from lightning_zero.models.llama.parallelize import parallelize_llama
    from lightning_zero.planner.saved_activations import measure_saved_bytes
    from lightning_zero.planner.traffic import cp_bytes_by_kind

    dims = ParallelDims(world_size=world_size, devices_per_node=world_size, tp=2, cp=2)
    groups = build_groups(dims)
    cp_rank = groups.rank_in("cp")
    batch = torch.randint(0, 256, (2, TP_CP_SEQ + 1), generator=torch.Generator().manual_seed(7))
    start, stop = context_slice_bounds(TP_CP_SEQ, 2, cp_rank)
    inputs, targets = batch[:, start : stop - 1], batch[:, start + 1 : stop]
    rows = []
    for n_kv_heads in (4, 2):
        config = LlamaConfig(**dict(CONFIG, vocab_size=256, n_kv_heads=n_kv_heads, max_seq_len=TP_CP_SEQ))
        for sequence_parallel in (False, True):
            predicted = llama_activation_bytes(config, micro_batch=2, seq_len=TP_CP_SEQ, act_bytes=4, tp=2, cp=2,
                                               sequence_parallel=sequence_parallel)  # fmt: skip
            for mode in ("none", "selective", "full"):
                torch.manual_seed(0)
                counter = CommCounter()
                model = parallelize_llama(build_llama(config), groups.tp, counter=counter,
                                          sequence_parallel=sequence_parallel)  # fmt: skip
                parallelize_context(model, groups.cp, counter=counter, tp=2)
                model.activation_checkpointing = mode
                measured = measure_saved_bytes(model, inputs, targets)
                want = predicted.saved_after_forward(mode)
                case = (n_kv_heads, sequence_parallel, mode)
                assert measured == pytest.approx(want, rel=0.01), (case, measured, want)
                formula = cp_bytes_by_kind(config, tokens=2 * TP_CP_SEQ, cp=2, tp=2, act_bytes=4,
                                           activation_checkpointing=mode)  # fmt: skip
                assert counter.bytes["cp_all_to_all"] == pytest.approx(formula["cp_all_to_all"]), case
                rows.append([n_kv_heads, sequence_parallel, mode, measured, want, counter.bytes["cp_all_to_all"]])
    if rank == 0:
        with open(f"{out}/tp_cp_activations.json", "w") as handle:
            json.dump(rows, handle)


@pytest.mark.slow
def test_tp_cp_saved_activations_and_all_to_all_bytes_equal_the_planner(tmp_path):
    run_ranks(_tp_cp_activation_cases, world_size=4, args=(str(tmp_path),), timeout_s=300)
    import json

    rows = json.loads((tmp_path / "tp_cp_activations.json").read_text())
    assert len(rows) == 12
    assert len({measured - want for _, _, _, measured, want, _ in rows}) == 1  # one offset: the loss's
    for n_kv_heads, sequence_parallel, mode, measured, want, sent in rows:
        print(f"kv={n_kv_heads} sp={sequence_parallel} {mode:<9} measured {measured:>12,} planned {want:>14,.0f}"
              f" ({measured / want - 1:+.3%}) all-to-all {sent:,.0f}")  # fmt: skip
