"""ZeRO-3 with models nobody on this project wrote (engine level, 2 gloo ranks, each case against
one process on the full batch): tied weights (GPT-2, T5), everything in the root unit with two
optimizers (GAN), a frozen transformers Llama with LoRA adapters and reentrant checkpointing,
frozen int8 weights, blocks in a ModuleDict / Sequential (bytes sent), sharded meta init of a
transformers Llama (rotary buffers), a varying number of no_grad forwards of the trained model per
step (kept out of the training schedule, exact bytes), a divergence after the first step (an error on every rank,
within seconds). Lightning-level cases (phases, callbacks, uneven validation) are at the end of
this file, run by tests/scripts/stage3_any.py."""

import time
import warnings

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.engine_state import walked_high_water

pytest.importorskip("transformers")

WORLD = 2


# -- helpers --------------------------------------------------------------------------------------
def _engine(model, optimizers, dp_group=None, **knobs):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    config = ZeroConfig(**{"stage": 3, "bucket_mb": 0.002, **knobs})
    return ZeroEngine(model, optimizers, config, groups=EngineGroups(dp=dp_group), device=torch.device("cpu"))


def _mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def _gathered_state(engine, model):
    """Full parameters assembled from every rank's masters, by name."""
    import torch.distributed as dist

    full = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    for r in engine.owned_ranges():
        full[r.name][r.param_lo : r.param_hi] = r.master.detach()[r.chunk_lo : r.chunk_hi].double()
    for value in full.values():
        dist.all_reduce(value)
    return {n: full[n].view(p.shape) for n, p in model.named_parameters()}


def _close(got, want, what):
    assert len(got) == len(want), (what, got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * max(1.0, abs(w)), f"{what}: step {step}: {g} vs {w} (all: {got} vs {want})"


def _train(build, batches, loss_fn, rank, *, sharded, steps_with=None, **engine_kwargs):
    """Per-step losses (mean over ranks when sharded) of AdamW on ``build()``'s trainable params."""
    torch.manual_seed(0)
    model = build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    engine = _engine(model, [opt], **engine_kwargs) if sharded else None
    losses = []
    for batch in batches:
        opt.zero_grad()
        if engine is not None:
            engine.counter.reset()
            engine.stage3.begin_step()
        x = batch[rank] if sharded else batch.reshape(-1, *batch.shape[2:])
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        losses.append(_mean_over_ranks(loss.item()) if sharded else loss.item())
        if steps_with is not None:
            steps_with(engine, model)
    return model, engine, losses


def _tokens(steps, vocab, seq=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (WORLD, 2, seq), generator=gen) for _ in range(steps)]


# -- 1. tied weights -------------------------------------------------------------------------------
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return T5ForConditionalGeneration(config)


def _lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


def _seq2seq_loss(model, x):
    return model(input_ids=x, labels=x.flip(-1)).loss


def _tied(rank, world):
    batches = _tokens(3, 64)
    _, _, want = _train(_gpt2, batches, _lm_loss, rank, sharded=False)
    checks = []

    def bytes_per_step(engine, model):
        runtime = engine.stage3
        root = sum(g.layout.numel for g in runtime.root.groups)
        rest = sum(g.layout.numel for u in runtime.units[:-1] for g in u.groups)
        sent = engine.counter.elements
        # The tie lives in the root: gathered once, reduced once; every block gathered twice but
        # the last one forward runs (ln_f), held from its forward into its backward from step 2 on
        # ([Note: held into backward]).
        ln_f = sum(g.layout.numel for u in runtime.units if u.name == "transformer.ln_f" for g in u.groups)
        held = runtime.held_numel()
        checks.append(held in (0, ln_f) and ln_f > 0 or (held, ln_f))
        checks.append(
            sent["all_gather_params"] == (root + 2 * rest - held) * (world - 1) / world
            or (sent["all_gather_params"], root, rest, held)
        )
        checks.append(sent["reduce_scatter_grads"] == (root + rest) * (world - 1) / world)

    model, engine, got = _train(_gpt2, batches, _lm_loss, rank, sharded=True, steps_with=bytes_per_step)
    _close(got, want, "gpt2 tied")
    assert all(c is True for c in checks[3:]), checks  # from step 2 on (step 1 records the schedule)
    assert engine.stage3.held_numel() > 0, checks  # ln_f held once the schedule is recorded
    assert engine.stage3.high_water_numel == walked_high_water(engine.stage3) > 0
    assert model.transformer.wte.weight in [s.param for g in engine.stage3.root.groups for s in g.layout.slots]
    engine.unshard_parameters()
    engine.close()
    assert model.lm_head.weight is model.transformer.wte.weight, "tie lost"
    assert "lm_head.weight" not in dict(model.named_parameters())

    batches = _tokens(2, 64, seed=5)
    _, _, want = _train(_t5, batches, _seq2seq_loss, rank, sharded=False)
    model, engine, got = _train(_t5, batches, _seq2seq_loss, rank, sharded=True)
    _close(got, want, "t5 shared embedding")
    engine.unshard_parameters()
    engine.close()
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.decoder.embed_tokens.weight


# -- 2. everything in the root unit, two optimizers (GAN) ---------------------------------------------
class _MLP(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 16)
        self.fc2 = nn.Linear(16, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class _GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = _MLP(4, 6)
        self.discriminator = _MLP(6, 1)


def _gan_steps(model, opt_g, opt_d, engine, rank, sharded, steps=4):
    gen = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        z, real = torch.randn(WORLD, 3, 4, generator=gen), torch.randn(WORLD, 3, 6, generator=gen)
        z, real = (z[rank], real[rank]) if sharded else (z.reshape(-1, 4), real.reshape(-1, 6))
        if engine is not None:
            engine.stage3.begin_step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        fake = model.generator(z)
        loss_g = -model.discriminator(fake).mean()
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        fake = model.generator(z)  # must see the generator's new weights
        loss_d = model.discriminator(fake.detach()).mean() - model.discriminator(real).mean()
        loss_d.backward()
        opt_d.step()
        for loss in (loss_g, loss_d):
            losses.append(_mean_over_ranks(loss.item()) if sharded else loss.item())
    return losses


def _gan(rank, world):
    from lightning_zero.zero.stage3 import find_units

    results = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = _GAN()
        opt_g = torch.optim.Adam(model.generator.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(model.discriminator.parameters(), lr=1e-1, momentum=0.9)
        engine = _engine(model, [opt_g, opt_d]) if sharded else None
        if sharded:
            assert not find_units(model) and len(engine.stage3.units) == 1  # all in the root unit
        results.append(_gan_steps(model, opt_g, opt_d, engine, rank, sharded))
        if engine is not None:
            engine.close()
    _close(results[1], results[0], "gan root unit")


# -- 3. frozen base + LoRA adapters, reentrant checkpointing -----------------------------------------
class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


def _hf_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)  # fmt: skip


def _lora_llama(checkpointing=None):
    from transformers import LlamaForCausalLM

    def build():
        model = LlamaForCausalLM(_hf_llama_config())
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
            layer.self_attn.v_proj = _LoRA(layer.self_attn.v_proj)
        if checkpointing is not None:
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing})
            model.enable_input_require_grads()
        model.train()
        return model

    return build


def _lora(rank, world):
    batches = _tokens(3, 64, seed=7)
    _, _, want = _train(_lora_llama(), batches, _lm_loss, rank, sharded=False)
    for reentrant in (None, True, False):
        checks = []

        def per_step(engine, model, checks=checks):
            trainable = sum(g.layout.numel for g in engine.groups if g.compute_dtype.is_floating_point and any(
                s.param.requires_grad for s in g.layout.slots))  # fmt: skip
            # one reduce-scatter per bucket per backward, frozen weights never in gradient buffers
            checks.append(engine.counter.elements["reduce_scatter_grads"] == trainable * (world - 1) / world)
            checks.append(engine.stage3.high_water_backward <= 3)

        _, engine, got = _train(_lora_llama(reentrant), batches, _lm_loss, rank, sharded=True, steps_with=per_step)
        _close(got, want, f"lora reentrant={reentrant}")
        assert all(checks), (reentrant, checks)
        frozen = [s.param for g in engine.groups for s in g.layout.slots if not s.param.requires_grad]
        assert frozen and all(id(p) not in engine.reducer._bucket_of_param for p in frozen)
        engine.close()


# -- 3b. reentrant / non-reentrant checkpointing on trainable blocks ----------------------------------
class _Blocks(nn.Module):
    """Three same-class blocks in a ModuleList, ModuleDict or Sequential; optional checkpointing."""

    def __init__(self, holder="list", reentrant=None):
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3)]
        if holder == "list":
            self.blocks = nn.ModuleList(blocks)
        elif holder == "dict":
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        else:
            self.blocks = nn.Sequential(*blocks)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        if self.reentrant:
            x = x.detach().requires_grad_()  # a reentrant checkpoint needs an input that requires grad
        for block in blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _blocks_loss(model, x):
    return model(x).pow(2).mean()


def _blocks(rank, world):
    from lightning_zero.zero.stage3 import find_units

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(WORLD, 4, 8, generator=gen) for _ in range(3)]
    _, _, want = _train(lambda: _Blocks("list"), batches, _blocks_loss, rank, sharded=False)
    assert [n for n, _ in find_units(_Blocks("dict"))] == ["blocks.b0", "blocks.b1", "blocks.b2"]
    assert [n for n, _ in find_units(_Blocks("seq"))] == ["blocks.0", "blocks.1", "blocks.2"]
    for holder, reentrant in (("dict", None), ("seq", None), ("list", True), ("list", False)):
        sent = []

        def per_step(engine, model, sent=sent):
            padded = sum(g.layout.numel for g in engine.groups)
            held = engine.stage3.held_numel()  # the last block, from step 2 on ([Note: held into backward])
            sent.append((engine.counter.total_elements(), (3 * padded - held) * (world - 1) / world))
            sent.append((engine.counter.elements["reduce_scatter_grads"], padded * (world - 1) / world))

        _, engine, got = _train(lambda h=holder, r=reentrant: _Blocks(h, r), batches, _blocks_loss, rank, sharded=True,
                                steps_with=per_step, bucket_mb=0.0002)  # fmt: skip
        _close(got, want, f"blocks {holder} reentrant={reentrant}")
        assert all(a == b for a, b in sent), (holder, reentrant, sent)  # exactly 3 P (dp-1)/dp per step, less held
        last = engine.stage3.units[-2]  # the root is last; the last block forward runs before it
        assert engine.stage3.held_numel() == sum(g.layout.numel for g in last.groups) > 0, (holder, reentrant)
        assert not engine.stage3.root.groups
        assert engine.stage3.high_water_backward <= 2, engine.stage3.high_water_backward  # freed in backward
        walked = walked_high_water(engine.stage3)
        assert engine.stage3.high_water_numel == walked > 0, (holder, reentrant, engine.stage3.high_water_numel, walked)
        engine.close()


# -- 4. frozen int8 weights ------------------------------------------------------------------------
class _QLinear(nn.Module):
    def __init__(self, d):
        super().__init__()
        w = torch.randn(d, d)
        scale = w.abs().amax() / 127
        self.qweight = nn.Parameter(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale.reshape(1), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x @ (self.qweight.float() * self.scale).T + self.bias


class _Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(_QLinear(8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _int8(rank, world):
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(WORLD, 4, 8, generator=gen) for _ in range(3)]
    _, _, want = _train(_Quantized, batches, _blocks_loss, rank, sharded=False)
    model, engine, got = _train(_Quantized, batches, _blocks_loss, rank, sharded=True)
    _close(got, want, "int8 frozen")
    qweights = [layer[0].qweight for layer in model.layers]
    int8_groups = [g for g in engine.groups if g.compute_dtype == torch.int8]
    assert len(int8_groups) == 2 and all(q.dtype == torch.int8 for q in qweights)
    assert all(g.shard_buffer.numel() * world == g.layout.numel for g in int8_groups)  # sharded
    state_ids = {id(t) for s in engine.optimizers for m in s.masters for t in [m]}
    assert not any(id(m) in state_ids for g in int8_groups for m in g.masters)
    engine.unshard_parameters()
    torch.manual_seed(0)
    reference = _Quantized()
    for got_q, want_q in zip(qweights, (layer[0].qweight for layer in reference.layers)):
        assert torch.equal(got_q, want_q)  # never cast, gathered intact
    engine.close()


# -- 5. sharded meta init of a transformers Llama -------------------------------------------------
class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.register_buffer("table", torch.arange(4.0))


def _meta_init(rank, world):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM(_hf_llama_config())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_hf_llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(model, [opt])
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)
    losses = []
    for tokens in _tokens(2, 64):
        opt.zero_grad()
        engine.stage3.begin_step()
        loss = _lm_loss(model, tokens[rank])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    engine.close()

    with torch.device("meta"):
        bad = _NoInit()
    with pytest.raises(RuntimeError, match=r"buffer 'table'"):
        _engine(bad, [torch.optim.SGD(bad.parameters(), lr=0.1)])


# -- 5b. a varying number of no_grad forwards of the trained model per step --------------------------
class _Sampled(nn.Module):
    """Three blocks (units), a head beside them (a unit) and a bare scale (the root unit)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x) * self.scale


NO_GRAD_FORWARDS = [1, 0, 2, 2, 0, 1, 2]  # per step; the first step (which records the schedule) has one


def _no_grad_steps(sharded, rank, world):
    """Train ``_Sampled`` with NO_GRAD_FORWARDS[step] no_grad forwards of the model itself per step
    (the second also of one block alone, before the training forward; the first after the training
    forward, while the schedule has units prefetched for backward). Returns the losses, the no_grad
    outputs (summed over ranks), and per no_grad forward (units gathered before, after, elements
    gathered) plus per step (elements gathered by the whole step, reduce-scattered)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _Sampled()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(model, [opt], prefetch_blocks=2) if sharded else None
    gen = torch.Generator().manual_seed(11)
    losses, samples, forwards, steps = [], [], [], []

    def sample(fn, x):
        if engine is None:
            with torch.no_grad():
                samples.append(fn(x).pow(2).sum().item())
            return
        runtime, sent = engine.stage3, engine.counter.elements
        before, gathered_before = {u.index for u in runtime.units if u.gathered}, sent["all_gather_params"]
        with torch.no_grad():
            out = fn(x).pow(2).sum().reshape(1)
        dist.all_reduce(out)
        samples.append(out.item())
        after = {u.index for u in runtime.units if u.gathered}
        forwards.append((before, after, sent["all_gather_params"] - gathered_before))

    for no_grad_forwards in NO_GRAD_FORWARDS:
        batch = torch.randn(WORLD, 4, 8, generator=gen)
        x = batch[rank] if sharded else batch.reshape(-1, 8)
        opt.zero_grad()
        if engine is not None:
            engine.counter.reset()
            engine.stage3.begin_step()
        if no_grad_forwards >= 2:  # a teacher-style forward before the training forward, of one block too
            sample(model, x)
            sample(model.blocks[1], x)
        loss = model(x).pow(2).mean()
        if no_grad_forwards >= 1:  # generation after the training forward: some units are prefetched
            sample(model, batch[rank, :2] if sharded else batch[:, :2].reshape(-1, 8))
        loss.backward()
        opt.step()
        losses.append(_mean_over_ranks(loss.item()) if sharded else loss.item())
        if engine is not None:
            steps.append(
                (engine.counter.elements["all_gather_params"], engine.counter.elements["reduce_scatter_grads"])
            )
    return model, engine, losses, samples, forwards, steps


def _no_grad_forwards(rank, world):
    _, _, want, want_samples, _, _ = _no_grad_steps(False, rank, world)
    model, engine, got, got_samples, forwards, steps = _no_grad_steps(True, rank, world)
    _close(got, want, "no_grad forwards: training losses")
    _close(got_samples, want_samples, "no_grad forwards: outputs")
    runtime = engine.stage3
    numel = {u.index: sum(g.layout.numel for g in u.groups) for u in runtime.units}
    units = [u.index for u in runtime.units if u.groups]
    assert runtime.root.groups and len(units) == 5, units
    # The recorded training schedule holds the training forward and backward only: the root once,
    # every other unit twice -- none of the first step's no_grad forward.
    order = runtime.schedules["train"].order
    assert sorted(order) == sorted([runtime.root.index] + 2 * units[:-1]), order
    block1 = next(u.index for u in runtime.units if u.name == "blocks.1")
    reaches = []  # the units each no_grad forward runs, in order
    for no_grad_forwards in NO_GRAD_FORWARDS:
        reaches += [units, [block1]] if no_grad_forwards >= 2 else []
        reaches += [units] if no_grad_forwards >= 1 else []
    assert len(reaches) == len(forwards), (len(reaches), len(forwards))
    for reached, (before, after, sent) in zip(reaches, forwards):
        # A no_grad forward gathers what is not gathered (exactly those bytes), frees what it
        # gathered, and keeps the rest (the root held for the step; units prefetched for backward).
        assert after == before, (before, after)
        assert sent == sum(numel[i] for i in reached if i not in before) * (world - 1) / world, (reached, before, sent)
    assert any(before - {runtime.root.index} for before, _, _ in forwards), "no no_grad forward met a prefetched unit"
    # The training forward/backward sends what a step without no_grad forwards sends.
    # From step 2 on, less the last block's second gather: held from its forward into its backward
    # ([Note: held into backward]), the no_grad forward between them included.
    held = runtime.held_numel()
    assert held == numel[units[-2]] > 0, (held, numel)
    train_bytes = (numel[runtime.root.index] + 2 * sum(numel[i] for i in units[:-1])) * (world - 1) / world
    reduce_bytes = sum(numel[i] for i in units) * (world - 1) / world
    position = 0
    for step, (no_grad_forwards, (gathered, reduced)) in enumerate(zip(NO_GRAD_FORWARDS, steps)):
        mine = forwards[position : position + {0: 0, 1: 1, 2: 3}[no_grad_forwards]]
        position += len(mine)
        want = train_bytes - (held * (world - 1) / world if step > 0 else 0)
        assert gathered - sum(sent for _, _, sent in mine) == want, (step, gathered, mine, want)
        assert reduced == reduce_bytes, (step, reduced, reduce_bytes)
    engine.close()


# -- 6. divergence after the first step: an error on every rank, within seconds ----------------------
def _divergence(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    # Its own dp group: the collectives left pending by the failure must not block the world's barrier.
    dp_group = dist.new_group(list(range(world)))
    engine = _engine(blocks, [torch.optim.SGD(blocks.parameters(), lr=0.1)], dp_group=dp_group)
    started = None
    try:
        for step in range(3):
            engine.stage3.begin_step()
            started = time.monotonic()
            x = blocks[2](blocks[1](blocks[0](torch.ones(2, 4))))
            if step == 2 and rank == 0:
                x = blocks[2](x)  # one rank runs a block once more than recorded
            x.sum().backward()
    except RuntimeError as err:
        elapsed = time.monotonic() - started
        assert elapsed < 10, elapsed
        message = str(err)
        assert "'2'" in message and "step 3" in message and "dp rank 0" in message, message
        if rank == 1:
            assert "another rank failed" in message, message
    else:
        raise AssertionError("expected a RuntimeError on every rank")


def _all(rank, world, cases):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            globals()[case](rank, world)


def test_wrap_policy_warns_for_a_large_single_unit(monkeypatch):
    from lightning_zero.zero.stage3 import units

    monkeypatch.setattr(units, "SINGLE_UNIT_WARN_NUMEL", 10)
    monkeypatch.setattr(units, "_warned_single_unit", set())
    with pytest.warns(UserWarning, match="no repeated blocks"):
        units.warn_if_single_unit(_GAN(), 0, units.default_wrap_policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        units.warn_if_single_unit(_GAN(), 0, units.default_wrap_policy)  # once
        units.warn_if_single_unit(_Blocks(), 3, units.default_wrap_policy)  # has blocks
    monkeypatch.setattr(units, "SINGLE_UNIT_WARN_NUMEL", 10**9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        units.warn_if_single_unit(_Quantized(), 0, units.default_wrap_policy)  # small model


def test_stage3_any_model():
    cases = ["_tied", "_gan", "_lora", "_blocks", "_int8", "_meta_init", "_no_grad_forwards"]
    run_ranks(_all, WORLD, args=(cases,), timeout_s=240)


def test_stage3_divergence_raises_on_every_rank():
    run_ranks(_all, WORLD, args=(["_divergence"],), timeout_s=20)


# -- Lightning: phases, callbacks, manual optimization, configure_model, uneven validation ------------
LIGHTNING_CASES = [
    "zero3_hf_llama",
    "ddp_hf_llama",
    "zero3_teacher",
    "ddp_teacher",
    "zero3_gan",
    "ddp_gan",
    "zero3_uneven",
    "ddp_uneven",
]  # fmt: skip  (zero3_hf_llama writes the init ddp starts from)


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory):
    from tests.distributed import launch

    out = tmp_path_factory.mktemp("stage3_any")
    launch("stage3_any.py", out, *LIGHTNING_CASES, timeout_s=900)
    return {
        (name, rank): torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)
        for name in LIGHTNING_CASES
        for rank in range(WORLD)
    }


def _same(got, want, what):
    _close([float(v) for v in got], [float(v) for v in want], what)


@pytest.mark.parametrize("rank", range(WORLD))
def test_lightning_matches_ddp(lightning_results, rank):
    def pair(kind):
        return lightning_results[(f"zero3_{kind}", rank)], lightning_results[(f"ddp_{kind}", rank)]

    # no_grad teacher forward inside training_step, validation every 2 steps, a callback's forward
    zero3, ddp = pair("teacher")
    for key in ("losses", "val_losses", "samples"):
        assert zero3[key] and len(zero3[key]) == len(ddp[key]), key
        _same(zero3[key], ddp[key], f"teacher {key}")
    torch.testing.assert_close(zero3["outside"], ddp["outside"], rtol=1e-5, atol=1e-6)
    # two optimizers, manual optimization, everything in the root unit
    zero3, ddp = pair("gan")
    _same(zero3["losses"], ddp["losses"], "gan")
    # transformers Llama built in configure_model: sharded meta init, rotary buffers computed
    zero3, ddp = pair("hf_llama")
    _same(zero3["losses"], ddp["losses"], "hf llama")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    torch.testing.assert_close(zero3["buffers"]["model.model.rotary_emb.inv_freq"], inv_freq, rtol=0, atol=0)
    # rank r evaluates 3 - r batches: no hang, the same losses; no process group left behind
    zero3, ddp = pair("uneven")
    assert len(zero3["val_losses"]) == 2 * (3 - rank)
    _same(zero3["val_losses"], ddp["val_losses"], "uneven validation")
    assert len(set(zero3["groups"])) == 1 and zero3["groups"] == ddp["groups"], zero3["groups"]
