"""Deferred initialization (zero/stage3/deferred.py, [Note: deferred init]) without a process group:
a model built under ``InitRecord.building()`` and replayed equals the same model built eagerly from the
same seed, whatever order the initializers ran in, and the caller's RNG stream ends where the eager
run leaves it. The multi-process checks (Fabric stage 3 against ddp, LitGPT's scripts) are in
tests/test_litgpt_scripts.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from lightning_zero.zero.stage3.deferred import DeferredTensor, InitRecord
from lightning_zero.zero.stage3.init import _init, _materialize

HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
CPU = torch.device("cpu")


class Rotary(nn.Module):
    """Parameters initialized inside the children's constructors and after them (the LoRA order:
    a child's draws first, then the parent's own), a buffer computed from factory calls, a
    parameter made by a random factory, a view initialized in place, a parameter nobody initializes."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 4)
        self.extra = nn.Parameter(torch.empty(4, 6))
        self.pos = nn.Parameter(torch.randn(3, 6) * 0.02)
        self.table = nn.Parameter(torch.empty(5, 6))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6)))
        self.untouched = nn.Parameter(torch.empty(2))
        nn.init.kaiming_uniform_(self.extra, a=math.sqrt(5))
        nn.init.trunc_normal_(self.table, std=0.02)
        with torch.no_grad():
            self.table[0].zero_()
            self.table.data[1].normal_()


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def replayed(record: InitRecord, model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: record.value_of(t) for name, t in tensors(model).items()}


def build(make, defer: bool, after=None) -> tuple[dict, torch.Tensor]:
    """The model's tensors and a draw from the stream afterwards: eager, or recorded and replayed."""
    torch.manual_seed(1337)
    record = InitRecord(CPU)
    if defer:
        with record.building():
            model = make()
    else:
        model = make()
    if after is not None:
        after(model)
    draw = torch.rand(5)
    values = replayed(record, model) if defer else tensors(model)
    record.close()
    return values, draw


def assert_same(eager: dict, deferred: dict, skip: tuple = ()) -> None:
    assert set(eager) == set(deferred)
    for name, value in eager.items():
        if name in skip:
            continue
        assert deferred[name] is not None, name
        assert torch.equal(value.detach(), deferred[name]), name


def test_recorded_construction_replays_eager_values_and_moves_the_stream_as_eager():
    eager, eager_draw = build(Rotary, defer=False)
    deferred, deferred_draw = build(Rotary, defer=True)
    assert_same(eager, deferred, skip=("untouched",))  # eager: uninitialized memory
    assert torch.isnan(deferred["untouched"]).all()  # the sentinel: init.py's fallbacks or its error
    assert torch.equal(eager_draw, deferred_draw)


def test_initializer_after_construction_replays_with_the_state_of_its_own_call():
    """A seed set between construction and the initializer (the reseed case), and a draw with an
    explicit generator: each replays from its own call's state; the stream after is eager's."""

    def after(model: Rotary) -> None:
        torch.manual_seed(42)
        nn.init.normal_(model.inner.weight, std=0.1)
        model.inner.reset_parameters()
        nn.init.uniform_(model.extra, generator=torch.Generator().manual_seed(5))
        nn.init.trunc_normal_(model.pos, std=0.5, a=-0.4, b=0.4)  # rejection sampling: [Note: nn.init's meta shortcuts]
        nn.init.orthogonal_(model.table)
        model.to(torch.float64)  # a conversion after construction: the replay's dtype too

    eager, eager_draw = build(Rotary, defer=False, after=after)
    deferred, deferred_draw = build(Rotary, defer=True, after=after)
    assert_same(eager, deferred, skip=("untouched",))
    assert deferred["inner.weight"].dtype == torch.float64
    assert torch.equal(eager_draw, deferred_draw)


def test_materialized_units_take_recorded_values_in_any_order_and_fallbacks_fill_only_the_rest():
    """init.py materializes child before parent here (not construction order): the values are the
    recorded ones; ``reset_parameters`` (the fallback) runs only for a module with a sentinel tensor,
    and does not overwrite its recorded tensors."""

    class WithReset(Rotary):
        def reset_parameters(self) -> None:  # draws over every tensor it has
            for param in (self.extra, self.pos, self.table, self.untouched):
                nn.init.constant_(param, 7.0)

    torch.manual_seed(1337)
    want = tensors(WithReset())
    torch.manual_seed(1337)
    record = InitRecord(CPU)
    with record.building():
        model = WithReset()
    assert isinstance(model.extra, DeferredTensor) and isinstance(model.extra, nn.Parameter)
    modules = [model.inner, model]
    fresh = _materialize(modules, CPU)
    _init(modules, fresh, None, {}, {id(m): n for n, m in model.named_modules()})
    got = tensors(model)
    assert_same(want, got, skip=("untouched",))
    assert torch.equal(got["untouched"], torch.full((2,), 7.0))
    assert type(model.extra) is nn.Parameter and "_lz_record" not in model.extra.__dict__
    record.close()


INIT_ARGS = {"constant_": (0.5,), "sparse_": (0.5,)}
SHAPES = {"dirac_": (4, 4, 3), "eye_": (4, 6), "sparse_": (4, 6)}


def test_every_torch_init_function_is_recorded_on_a_deferred_tensor():
    """Each public ``torch.nn.init`` function on a model's meta tensor leaves an op in the record:
    through its own ops or, for those that return at once on meta (:data:`META_SHORTCUTS`), as one
    wrapped call. A torch that adds another meta shortcut fails here; closing the last record puts
    torch's own functions back."""
    from lightning_zero.zero.stage3.deferred import META_SHORTCUTS

    names = sorted(
        n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))
    )
    assert not any(hasattr(getattr(nn.init, name), "__lz_original__") for name in META_SHORTCUTS)
    originals = {name: getattr(nn.init, name) for name in META_SHORTCUTS}
    record = InitRecord(CPU)
    with record.building():
        tensors_by_name = {name: nn.Parameter(torch.empty(*SHAPES.get(name, (4, 6)))) for name in names}
    missing = []
    for name in names:
        tensor = tensors_by_name[name]
        before = len(record.mutations.get(tensor.untyped_storage()._cdata, ()))
        getattr(nn.init, name)(tensor, *INIT_ARGS.get(name, ()))
        if len(record.mutations.get(tensor.untyped_storage()._cdata, ())) == before:
            missing.append(name)
    assert missing == [], f"torch.nn.init functions that record nothing on meta: {missing} (add to META_SHORTCUTS)"
    assert all(getattr(nn.init, name) is not originals[name] for name in META_SHORTCUTS)
    record.close()
    assert all(getattr(nn.init, name) is originals[name] for name in META_SHORTCUTS)


def test_a_closed_record_replays_nothing():
    record = InitRecord(CPU)
    with record.building():
        layer = nn.Linear(2, 2)
    record.close()
    assert record.value_of(layer.weight) is None
    nn.init.zeros_(layer.weight)  # still a meta tensor; nothing recorded, nothing raised
    assert layer.weight.is_meta


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed")
@pytest.mark.parametrize("reseed", [False, True])
def test_litgpt_lora_gpt_replays_eager_construction(reseed):
    """LitGPT's LoRA GPT (LoRA's own draws after its base layer's: stage 3 used to replay them in
    another order, 5.6e-4 off after 4 steps) and its ``reset_parameters(model)`` after a reseed."""
    from litgpt.lora import GPT, Config
    from litgpt.utils import reset_parameters

    config = dict(block_size=16, padded_vocab_size=64, n_layer=2, n_head=4, n_embd=16, n_query_groups=2,
                  lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True)  # fmt: skip

    def after(model):
        if reseed:
            torch.manual_seed(42)
            reset_parameters(model)

    eager, eager_draw = build(lambda: GPT(Config(**config)), defer=False, after=after)
    deferred, deferred_draw = build(lambda: GPT(Config(**config)), defer=True, after=after)
    # after reset_parameters LitGPT's rotary cache is remade by factory calls on the meta device that no
    # recorded tensor takes part in: the GPT's reset_parameters recomputes it at materialization (init.py)
    assert_same(eager, deferred, skip=("cos", "sin") if reseed else ())
    assert torch.equal(eager_draw, deferred_draw)
