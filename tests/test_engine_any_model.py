"""Engine-level (no Lightning) checks for any model under stages 1-2, on 2 gloo ranks.

- reentrant checkpointing, including a parameter shared by every segment (several gradients per
  backward): one reduce-scatter per bucket per step, parameters equal to one process;
- a rank whose loss reaches no parameter finishes its sync (``engine.backward``), no hang;
- bucket launch order learned from the first backward and agreed over ranks: a late-registered
  first layer no longer holds back every launch, and stage-2 pool buffers are sized per bucket;
- frozen int8 parameters plus LoRA adapters: measured bytes = ledger(trainable) + frozen bytes;
- ``collective_timeout`` turns a stuck wait into an error naming the bucket and the progress;
- process groups the engine creates are destroyed by ``close()``;
- Adafactor (not element-wise): replicated full-master step equals one process at stages 1-2,
  and at stage 3 (one unit at a time; tied GPT-2, accumulation, clipping, bf16-mixed).
"""

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.ledger import model_state_bytes
from tests.distributed import run_ranks
from tests.engine_state import state_beyond_formula
from tests.ulps import assert_close_ulps


class SharedSegments(nn.Module):
    """Three checkpointed segments; ``shared`` is used in every one of them."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def segment(self, index: int, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.blocks[index](h) + self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index in range(len(self.blocks)):
            h = checkpoint(self.segment, index, h, use_reentrant=self.reentrant)
        return self.head(h)


def _batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, 6, generator=gen) for _ in range(steps)]


def _reference_params(steps: int):
    torch.manual_seed(0)
    model = SharedSegments(reentrant=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x in _batches(steps):
        opt.zero_grad()
        model(x.reshape(-1, 6)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _checkpointing(rank, world, expected):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    for stage in (1, 2):
        for reentrant in (True, False):
            torch.manual_seed(0)
            model = SharedSegments(reentrant)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.0005))
            buckets = len(engine.reducer.buckets)
            assert buckets > 2
            for x in _batches(3):
                opt.zero_grad()
                before = engine.counter.calls.get("reduce_scatter_grads", 0)
                model(x[rank]).pow(2).mean().backward()  # the sync finishes when backward ends
                assert engine.counter.calls["reduce_scatter_grads"] - before == buckets, (stage, reentrant)
                opt.step()
            shared = engine.reducer._expected_hits[id(model.shared.weight)]
            assert shared == (3 if reentrant else 1), shared
            for got, want in zip(model.parameters(), expected):
                torch.testing.assert_close(
                    got.detach(), want, rtol=1e-5, atol=1e-6, msg=f"stage {stage} reentrant {reentrant}"
                )
            engine.close()


def _no_params_reached(rank, world):
    """Rank 1's loss reaches no parameter (odd steps) or only the first layer (even steps)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    for stage in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        reference = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        reference.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.0002, collective_timeout=30))
        for step, x in enumerate(_batches(4)):
            opt.zero_grad()
            if rank == 1 and step % 2 == 1:
                loss = torch.zeros((), requires_grad=True) * 1.0
            elif rank == 1:
                loss = model[0](x[1]).pow(2).mean()
            else:
                loss = model(x[0]).pow(2).mean()
            engine.backward(loss)
            opt.step()
            # One process: the average of rank 0's loss and rank 1's (zero or partial) loss.
            ref_opt.zero_grad()
            ref_loss = reference(x[0]).pow(2).mean()
            if step % 2 == 0:
                ref_loss = ref_loss + reference[0](x[1]).pow(2).mean()
            (ref_loss / 2).backward()
            ref_opt.step()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=f"stage {stage}")
        engine.close()


class LateStem(nn.Module):
    """The layer used first in forward is registered last (its gradient comes last in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(32, 4)
        self.stem = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def _learned_order(rank, world, out_dir):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = LateStem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.004, max_buckets_in_flight=2))
    reducer, storage = engine.reducer, engine.reducer.storage
    layout_index = {id(b): reducer._layout_index[id(b)] for b in reducer.buckets}
    # Which bucket completes when, seen from outside the engine.
    ready_order: list[int] = []
    bucket_of = {id(s.param): layout_index[id(b)] for b in reducer.buckets for s in b.layout.slots}
    remaining: dict[int, int] = {}

    def seen(param):
        index = bucket_of[id(param)]
        remaining[index] -= 1
        if remaining[index] == 0:
            ready_order.append(index)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(seen)
    gen = torch.Generator().manual_seed(rank)
    pool_bytes = []
    for step in range(3):
        ready_order.clear()
        remaining.update({layout_index[id(b)]: len(b.layout.slots) for b in reducer.buckets})
        storage.pool_bytes_high_water = storage._alive_bytes
        opt.zero_grad()
        model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        pool_bytes.append(storage.pool_bytes_high_water)
        timeline = reducer.timeline
        if step >= 1:
            assert timeline.launched_buckets() == ready_order, (timeline.launched_buckets(), ready_order)
            assert timeline.index_of("launch") < timeline.index_of("backward_end")
    stem_bucket = bucket_of[id(model.stem.weight)]
    assert reducer.timeline.launched_buckets()[-1] == stem_bucket
    sizes = sorted((b.layout.numel * 4 for b in reducer.buckets), reverse=True)
    assert pool_bytes[2] <= sum(sizes[: storage.max_buffers]), (pool_bytes, sizes)  # 2 in flight + 1 filling
    if rank == 0:
        torch.save({"pool_bytes": pool_bytes, "bucket_bytes": sizes}, os.path.join(out_dir, "pool.pt"))
    engine.close()


def _frozen_int8_bytes(rank, world):
    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine

    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = nn.ModuleList([nn.Linear(24, 24, bias=False) for _ in range(3)])
            quantized = [
                nn.Parameter(torch.randint(-127, 127, (24, 24), dtype=torch.int8), requires_grad=False) for _ in base
            ]
            scales = [nn.Parameter(torch.rand(24, 1), requires_grad=False) for _ in base]
            model = nn.Module()
            model.qweights = nn.ParameterList(quantized)
            model.scales = nn.ParameterList(scales)
            model.adapters = nn.ModuleList(
                [nn.Sequential(nn.Linear(24, 4, bias=False), nn.Linear(4, 24, bias=False)) for _ in base]
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen ones included: torch skips them
            engine = ZeroEngine(
                model, [opt], ZeroConfig(stage=stage, bucket_mb=0.0005), precision=engine_policy(dtype, torch.float32)
            )
            for _ in range(2):
                opt.zero_grad()
                h = torch.randn(8, 24, dtype=dtype)
                for q, s, adapter in zip(model.qweights, model.scales, model.adapters):
                    h = torch.tanh(F.linear(h, (q.float() * s).to(dtype)) + adapter(h))
                h.float().pow(2).mean().backward()
                opt.step()
            assert all(q.dtype == torch.int8 for q in model.qweights) and all(
                s.dtype == torch.float32 for s in model.scales
            )
            trainable = sum(p.numel() for p in model.adapters.parameters())
            frozen_bytes = sum(p.numel() * p.element_size() for p in [*model.qweights, *model.scales])
            elem = torch.empty((), dtype=dtype).element_size()
            k = 8 if dtype == torch.float32 else 12
            want = model_state_bytes(
                trainable + engine.padding_numel(),
                stage=stage,
                dp=world,
                param_bytes=elem,
                grad_bytes=elem,
                optim_bytes_per_param=k,
            )
            got = engine.measured_bytes()
            assert got["params"] == want.params + frozen_bytes, (stage, dtype, got, want)
            assert got["grads"] == want.grads, (stage, dtype)
            assert got["optimizer"] == want.optimizer + state_beyond_formula(engine), (stage, dtype)
            engine.close()


def _timeout(rank, world, out_dir):
    """Rank 1 never runs its backward; rank 0 must fail within collective_timeout, saying why."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.waits import CollectiveTimeoutError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.0005, collective_timeout=2.0))  # hooks stay on the model
    marker = os.path.join(out_dir, "timeout.txt")
    if rank == 0:
        started = time.perf_counter()
        try:
            model(torch.randn(4, 6)).pow(2).mean().backward()
        except CollectiveTimeoutError as err:
            elapsed = time.perf_counter() - started
            with open(marker, "w") as f:
                f.write(f"{elapsed}\n{err}")
        os._exit(0)  # a collective is still pending on this rank: leave without tearing gloo down
    deadline = time.time() + 60
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.2)
    os._exit(0)


class ExtraUse(SharedSegments):
    """On rank 1 from step 2 on, ``shared`` runs in one more reentrant segment than it learned."""

    extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if self.extra:
            h = h + checkpoint(self.shared, torch.tanh(h @ torch.ones(3, 16)), use_reentrant=True).sum()
        return h


def _divergence(rank, world):
    """Rank 1 diverges (an extra gradient after its bucket launched) and raises; rank 0 must raise
    too, within seconds, instead of waiting for the process group's timeout."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = ExtraUse(reentrant=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.0005, collective_timeout=20))
    for step, x in enumerate(_batches(2)):
        model.extra = rank == 1 and step == 1
        opt.zero_grad()
        engine.backward(model(x[rank]).pow(2).mean())
        opt.step()


def _groups_destroyed(rank, world):
    from torch.distributed.distributed_c10d import _world

    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, bucket_mb=0.001))
    owned = list(engine._owned_groups)
    assert owned and all(group in _world.pg_map for group in owned)
    engine.close()
    assert not any(group in _world.pg_map for group in owned)


def _adafactor_reference(steps: int, clip: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adafactor(model.parameters(), lr=5e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def _optimizer_state_save_refused(target, model, engine, opt, layout) -> None:
    """Saving a replicated-step optimizer's state raises, naming the weights-only fix."""
    from lightning_zero.checkpoint import save_checkpoint

    with pytest.raises(ValueError, match="save_weights_only"):
        save_checkpoint(
            target,
            {"global_step": 1, "optimizer_states": []},
            module=model,
            engine=engine,
            optimizers=[opt],
            layout=layout,
        )


def _adafactor(rank, world, out_dir):
    """Adafactor (factored row/column moments) at stages 1-2, fp32 / bf16-mixed / offload: full
    replicated masters equal one process with clipping; stage 3 refused; weights-only checkpoint
    round trip, optimizer-state checkpoint refused."""
    from pathlib import Path

    from lightning_zero.checkpoint import RankPlacement, load_model, open_checkpoint, save_checkpoint
    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.replicated_optimizer import ReplicatedOptimizer

    steps, clip = 3, 0.05
    expected = [p.detach() for p in _adafactor_reference(steps, clip).parameters()]
    for stage, dtype, offload in (
        (1, torch.float32, False),
        (2, torch.float32, False),
        (2, torch.float32, True),
        (1, torch.bfloat16, False),
        (2, torch.bfloat16, False),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.Adafactor(model.parameters(), lr=5e-2)
        config = ZeroConfig(stage=stage, bucket_mb=0.0001, offload_optimizer=offload)
        engine = ZeroEngine(model, [opt], config, precision=engine_policy(dtype, torch.float32))
        sharded = engine.sharded_optimizer(opt)
        assert isinstance(sharded, ReplicatedOptimizer)
        gen = torch.Generator().manual_seed(2)
        norms = []
        for _ in range(steps):
            x = torch.randn(8, 6, generator=gen)[rank * 4 : rank * 4 + 4]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(x).pow(2).mean()
            engine.backward(loss)
            norms.append(float(sharded.clip_grad_norm_(clip)))
            opt.step()
            opt.zero_grad()
        assert min(norms) > clip, ("the case should clip every step", norms)
        assert len(engine.reducer.buckets) > 1, "the case should exercise several buckets"
        for got, want in zip(model.parameters(), expected):
            if dtype == torch.float32:
                torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
            else:  # bf16 autocast against the fp32 reference, in bf16 ulps of the tensor's largest weight
                # ([Note: tolerances in ulps] in tests/ulps.py): the forward and the gradients round to
                # bf16 (2**-9 relative each), and Adafactor's step, lr 5e-2 of the parameter's RMS with an
                # update of RMS at most 1, moves a weight by a few of those roundings of the tensor's
                # scale a step: 3 steps, 10 ulps of the largest weight
                assert_close_ulps(got.detach().float(), want, 10, torch.bfloat16, magnitude="max")
        state = next(iter(opt.state.values()))
        assert "row_var" in state or "variance" in state  # full (factored) state, not chunks
        if stage == 2 and dtype == torch.float32 and not offload:
            layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=stage)
            target = Path(out_dir, "adafactor_ckpt")
            _optimizer_state_save_refused(target, model, engine, opt, layout)
            save_checkpoint(
                target, {"global_step": steps}, module=model, engine=engine, optimizers=[opt], layout=layout
            )
            saved = [p.detach().clone() for p in model.parameters()]
            torch.manual_seed(5)
            fresh = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            fresh_opt = torch.optim.Adafactor(fresh.parameters(), lr=5e-2)
            bf16 = engine_policy(torch.bfloat16, torch.float32)
            fresh_engine = ZeroEngine(fresh, [fresh_opt], ZeroConfig(stage=2, bucket_mb=0.0002), precision=bf16)
            load_model(open_checkpoint(target), fresh, engine=fresh_engine, optimizers=[fresh_opt], layout=layout)
            for got, want in zip(fresh.parameters(), saved):  # bf16 compute params: the masters rounded once
                assert_close_ulps(got.detach().float(), want, 0.5, torch.bfloat16)
            fresh_engine.restore_master_params()  # the full fp32 masters themselves
            for got, want in zip(fresh.parameters(), saved):
                torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
            fresh_engine.close()
        engine.close()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def _adafactor_gpt2(rank: int, *, steps: int, clip: float, engine_kwargs=None):
    """Adafactor with clipping and 2 micro batches per step on a tiny GPT-2 (``lm_head`` tied to
    ``wte``): one process (``engine_kwargs=None``, whole batches) or this rank's half under the engine.
    Returns the model, the engine, per-step losses (mean over ranks) and the clipped norms."""
    import torch.distributed as dist

    from lightning_zero.config import ZeroConfig
    from lightning_zero.precision import engine_policy
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = _tiny_gpt2()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=1e-3)
    engine = None
    if engine_kwargs is not None:
        knobs = {"stage": 3, **engine_kwargs}
        runtime = {name: knobs.pop(name) for name in ("compute_dtype", "device") if name in knobs}
        if "compute_dtype" in runtime:
            runtime["precision"] = engine_policy(runtime.pop("compute_dtype"), torch.float32)
        engine = ZeroEngine(model, [opt], ZeroConfig(**knobs), **runtime)
    bf16 = engine is not None and engine.compute_dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    losses, norms = [], []
    for step in range(steps):
        if engine is not None:
            engine.begin_step("train")  # stage 3: opens the step's gather schedule
        total = 0.0
        for _ in range(2):  # gradient accumulation: the sync of the first micro batch is kept
            tokens = torch.randint(0, 64, (4, 8), generator=gen)
            x = tokens if engine is None else tokens[rank * 2 : rank * 2 + 2]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=x, labels=x).loss / 2
            loss.backward()
            total += loss.item()
        if engine is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        else:
            norms.append(float(engine.sharded_optimizer(opt).clip_grad_norm_(clip)))
            mean = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(mean)
            total = mean.item() / dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # both ways torch zeroes must reset the engine's grads
        losses.append(total)
    return model, engine, losses, norms


def _adafactor_stage3(rank, world, out_dir):
    """Adafactor at stage 3, one unit at a time: a tiny GPT-2 (tied ``lm_head``/``wte``) with
    gradient accumulation and clipping equals one process in fp32, bf16-mixed agrees with stage 2;
    the step's temporaries are one unit's fp32 master + gradient; its optimizer state is not
    checkpointed (weights only)."""
    from pathlib import Path

    from lightning_zero.checkpoint import RankPlacement
    from lightning_zero.zero.stage3 import UnitReplicatedOptimizer

    steps, clip = 3, 0.05
    reference, _, want, want_norms = _adafactor_gpt2(rank, steps=steps, clip=clip)
    assert min(want_norms) > clip, ("the case should clip every step", want_norms)
    for dtype in (torch.float32, torch.bfloat16):
        kwargs = dict(bucket_mb=0.01, compute_dtype=dtype, device=torch.device("cpu"))
        model, engine, got, norms = _adafactor_gpt2(rank, steps=steps, clip=clip, engine_kwargs=kwargs)
        sharded = engine.sharded_optimizer(engine.optimizers[0].optimizer)
        assert isinstance(sharded, UnitReplicatedOptimizer)
        units = [sum(g.layout.numel for g in unit.groups) for unit in engine.stage3.units]
        assert len([n for n in units if n]) > 3 and len(engine.reducer.buckets) > len(units), units
        # Temporaries: one unit's fp32 master + fp32 gradient at a time, never the whole model's.
        assert sharded.step_temporary_bytes_high_water == 8 * max(units) < 8 * sum(units) // 2, (
            sharded.step_temporary_bytes_high_water,
            units,
        )
        assert sharded.step_temporary_bytes == 0
        state = sharded.optimizer.state
        assert len(state) == len(list(model.parameters())), "one state per parameter, the tied one once"
        row = next(s for s in state.values() if "row_var" in s)  # factored: one moment per row / column
        assert row["row_var"].numel() < 64 * 32, "factored moments, not element-wise ones"
        if dtype == torch.float32:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=1e-6)
            layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=3)
            target = Path(out_dir, "adafactor_stage3_ckpt")
            _optimizer_state_save_refused(target, model, engine, sharded.optimizer, layout)
        else:  # the same bf16 gradients and fp32 masters as stage 2
            stage2 = _adafactor_gpt2(rank, steps=steps, clip=clip, engine_kwargs={**kwargs, "stage": 2})
            torch.testing.assert_close(torch.tensor(got), torch.tensor(stage2[2]), rtol=1e-5, atol=1e-5)
        engine.release_module()  # what the strategy's teardown calls: full parameters, fp32 masters
        engine.close()
        assert model.lm_head.weight is model.transformer.wte.weight, "tie lost"
        assert {p.dtype for p in model.parameters()} == {torch.float32}, "bf16-mixed leaves fp32 weights"
        if dtype == torch.bfloat16:  # the fp32 masters themselves, as stage 2 leaves them
            stage2[1].release_module()
            stage2[1].close()
            for (name, got_param), want_param in zip(model.named_parameters(), stage2[0].parameters()):
                assert want_param.dtype == torch.float32
                torch.testing.assert_close(got_param.detach(), want_param.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if dtype == torch.float32:
            for (name, got_param), want_param in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(got_param.detach(), want_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _all(rank, world, expected, out_dir):
    _checkpointing(rank, world, expected)
    _no_params_reached(rank, world)
    _learned_order(rank, world, out_dir)
    _frozen_int8_bytes(rank, world)
    _groups_destroyed(rank, world)
    _adafactor(rank, world, out_dir)
    _adafactor_stage3(rank, world, out_dir)


def test_any_model_engine(tmp_path):
    run_ranks(_all, 2, args=(_reference_params(3), str(tmp_path)), timeout_s=420)
    pool = torch.load(tmp_path / "pool.pt")
    # Step 1 learns the order (everything waits for the stem); afterwards at most three buffers.
    assert pool["pool_bytes"][2] < pool["pool_bytes"][0], pool


def test_collective_timeout_names_what_it_waited_on(tmp_path):
    run_ranks(_timeout, 2, args=(str(tmp_path),), timeout_s=60)  # a hang fails here
    elapsed, message = (tmp_path / "timeout.txt").read_text().split("\n", 1)
    assert 1.5 < float(elapsed) < 20, elapsed
    assert "collective_timeout" in message and "reduce-scatter of bucket" in message, message
    assert "params ready in bucket" in message and "dp rank 0" in message, message


def test_divergence_raises_on_every_rank(tmp_path):
    started = time.perf_counter()
    with pytest.raises(AssertionError) as failure:
        run_ranks(_divergence, 2, timeout_s=60)
    report = str(failure.value)
    assert "--- rank 1 ---" in report and "received another gradient in this backward" in report, report
    assert "--- rank 0 ---" in report and "lightning_zero:" in report.split("--- rank 0 ---")[1], report
    assert time.perf_counter() - started < 80


def test_non_elementwise_optimizers_are_checked_per_stage():
    from lightning_zero.zero.build import check_elementwise

    model = nn.Linear(4, 4)
    check_elementwise([torch.optim.Adafactor(model.parameters())], 1)  # replicated full-master step
    check_elementwise([torch.optim.Adafactor(model.parameters())], 2)
    check_elementwise([torch.optim.Adafactor(model.parameters())], 3)  # one unit at a time
    with pytest.raises(ValueError, match=r"LBFGS.*closure"):
        check_elementwise([torch.optim.LBFGS(model.parameters())], 1)
    with pytest.raises(ValueError, match="SparseAdam.*sparse"):
        check_elementwise([torch.optim.SparseAdam(list(model.parameters()))], 2)
    check_elementwise([torch.optim.Adagrad(model.parameters()), torch.optim.RMSprop(model.parameters())], 3)
    from lightning_zero.tp.layers import mark_tp_param

    split = nn.Linear(4, 4)
    mark_tp_param(split.weight, 0)
    with pytest.raises(ValueError, match="Adafactor over 1 tensor-parallel-split"):
        check_elementwise([torch.optim.Adafactor(split.parameters())], 1)
    check_elementwise([torch.optim.AdamW(split.parameters())], 1)


@pytest.mark.parametrize("value", [0, -1.0, "5", True])
def test_collective_timeout_argument_is_checked(value):
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match="collective_timeout"):
        ZeroStrategy(collective_timeout=value)
    assert (
        ZeroStrategy().collective_timeout == 300.0 and ZeroStrategy(collective_timeout=None).collective_timeout is None
    )
