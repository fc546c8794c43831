"""The toy MoE of tests/test_expert_domain.py under ``ZeroFabricStrategy(ep=2)`` on 2 CPU processes.

Usage: python tests/scripts/fabric_ep.py OUT_DIR [moe]
Launched torchrun-style by tests/test_expert_domain.py (on 4 ranks with ``moe``: :func:`moe_model` alone). For stages 1-3 the model is built with this
rank's experts over ``fabric.strategy.mesh_groups.ep`` (after ``fabric.launch()``), set up, trained
for 3 steps of 2 micro batches (``no_backward_sync``, ``clip_gradients``, AdamW with weight decay),
and compared on every rank with one process training the full model on both ranks' batches: losses
and weights to 1e-5 (``assert_close``); a model that does not declare ``check_parallel_dims`` is
refused at ``fabric.setup`` naming ep; a full file saved at ep=2 loads into Fabric's ddp and back
into ep=2 (:func:`full_file`); our ``MoETransformer``, built whole and split by ``fabric.setup``,
trains at ep=2 (and 4), stages 1-3, as under Fabric's ddp (:func:`moe_model`). Writes
``OUT_DIR/fabric_ep.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero import ZeroFabricStrategy  # noqa: E402
from tests.test_expert_domain import CLIP, EXPERTS, MICRO, ToyMoE, _batches, _optimizer, _reference  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def run(stage: int) -> float:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=ZeroFabricStrategy(stage=stage, ep=2, bucket_mb=0.0005,
                      collective_timeout=60))  # fmt: skip
    fabric.launch()
    groups = fabric.strategy.mesh_groups
    rank, ep_rank = fabric.global_rank, groups.rank_in("ep")
    model = ToyMoE(2, ep_rank, groups.ep)
    optimizer = _optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    want_losses, want_weights = _reference(WORLD)
    worst = 0.0
    for step, batch in enumerate(_batches(WORLD)):
        total = 0.0
        for micro, x in enumerate(batch):
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = model(x[rank]) / MICRO
                fabric.backward(loss)
            total += loss.item()
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        worst = max(worst, abs(total - want_losses[step][rank]))
    assert worst < 1e-5, (stage, worst)
    for name, value in fabric.strategy.get_module_state_dict(model._forward_module).items():
        if ".experts." in name:
            prefix, local = name.rsplit(".", 1)
            name = f"{prefix}.{int(local) + ep_rank * (EXPERTS // 2)}"  # this EP rank's global expert
        torch.testing.assert_close(value, want_weights[name], rtol=1e-5, atol=1e-5, msg=f"stage {stage}: {name}")
    return worst


def _train(fabric, model, optimizer, batches, loss_of=None, after_step=None) -> list[float]:
    """Per batch: its MICRO micro batches (``no_backward_sync``; this rank's row of each), each's
    ``loss_of(model, x)`` (default ``model(x)``) / MICRO, clipping, the step, ``after_step()``.
    Returns this rank's per-step losses."""
    losses = []
    for batch in batches:
        total = 0.0
        for micro, x in enumerate(batch):
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                x = x[fabric.global_rank]
                loss = (model(x) if loss_of is None else loss_of(model, x)) / MICRO
                fabric.backward(loss)
            total += loss.item()
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
        losses.append(total)
    return losses


def full_file(out: str) -> dict:
    """A full file saved under ``ZeroFabricStrategy(stage=3, ep=2, state_dict_type="full")`` after 2
    steps of the stacked toy MoE holds the whole expert tensors and their AdamW state: Fabric's
    ddp loads it strictly into the unsplit model and trains step 3 exactly as the ep=2 run goes on
    (losses and weights), and a ZeRO-2 ep=2 run loads it back into its EP rank's rows alike."""
    path, batches = os.path.join(out, "full_ep2.pth"), _batches(WORLD)

    def zero(stage: int, state_dict_type: str):
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=ZeroFabricStrategy(
            stage=stage, ep=2, bucket_mb=0.0005, collective_timeout=60, state_dict_type=state_dict_type))  # fmt: skip
        fabric.launch()
        groups = fabric.strategy.mesh_groups
        model = ToyMoE(2, groups.rank_in("ep"), groups.ep, stacked=True)
        optimizer = _optimizer(model)
        model, optimizer = fabric.setup(model, optimizer)
        return fabric, model, optimizer, groups.rank_in("ep")

    fabric, model, optimizer, ep_rank = zero(3, "full")
    _train(fabric, model, optimizer, batches[:2])
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    ep_losses = _train(fabric, model, optimizer, batches[2:])
    ep_weights = fabric.strategy.get_module_state_dict(model._forward_module)

    ddp = L.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    ddp.launch()
    dense = ToyMoE(stacked=True, seed=1)  # other weights than the file's: the load must replace them all
    dense_optimizer = _optimizer(dense)
    dense, dense_optimizer = ddp.setup(dense, dense_optimizer)
    state = {"model": dense, "optimizer": dense_optimizer, "step": 0}
    ddp.load(path, state, strict=True)
    assert state["step"] == 2
    saved = torch.load(path, weights_only=True)
    shape = tuple(saved["model"]["blocks.0.experts.0"].shape)
    assert shape == (EXPERTS, 8, 8), shape  # every expert, as ddp's model holds them
    ddp_losses = _train(ddp, dense, dense_optimizer, batches[2:])
    worst = max(abs(a - b) for a, b in zip(ep_losses, ddp_losses))
    n_local = EXPERTS // 2
    for name, value in dense.state_dict().items():
        mine = ep_weights[name]
        if ".experts." in name:
            value = value[ep_rank * n_local : (ep_rank + 1) * n_local]
        worst = max(worst, (value - mine).abs().max().item())

    fabric, model, optimizer, ep_rank = zero(2, "sharded")  # and back into ep=2, each rank its rows
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state, strict=True)
    back_losses = _train(fabric, model, optimizer, batches[2:])
    worst_back = max(abs(a - b) for a, b in zip(ep_losses, back_losses))
    for name, value in fabric.strategy.get_module_state_dict(model._forward_module).items():
        worst_back = max(worst_back, (value - ep_weights[name]).abs().max().item())
    return {"full_file_vs_ddp": worst, "full_file_back_to_ep2": worst_back, "expert_shape": list(shape)}


MOE_CONFIG = {"name": "tiny_moe_shared", "bias_update_rate": 0.01}  # aux loss, z loss, the bias update
MOE_SEQ = 16


def _moe_tokens() -> torch.Tensor:
    """(STEPS, MICRO, WORLD, 2, MOE_SEQ + 1) token ids: rank r's micro batch m of step s."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (len(_batches(WORLD)), MICRO, WORLD, 2, MOE_SEQ + 1), generator=gen)


def _train_moe(
    strategy, empty_init: bool = False, constructor: bool = False
) -> tuple[list[float], dict, int, list[str]]:
    """``MoETransformer`` (``MOE_CONFIG``) under Fabric with ``strategy``, fp32, built whole on every
    rank from one seed (``build_moe``; ``constructor``: by ``MoETransformer(config)`` itself, whose
    default layer inits draw before its ``init_weights``), AdamW over ``model.parameters()`` before
    ``fabric.setup`` (``empty_init``: ``MoETransformer(config)`` under ``init_module(empty_init=True)``,
    on the meta device at stage 3, the optimizer after: the values that constructor gives eagerly,
    [Note: deferred init]); per step 2 micro
    batches (``no_backward_sync``) of ``cross entropy + aux_loss``, clipping, the bias update over
    the dense group. Returns this rank's per-step losses, the trained state dict (an EP rank's
    expert rows), the EP rank's expert offset and the labels the strategy's counter counted."""
    from lightning_zero.models.moe import MoETransformer, build_moe, resolve_moe_config

    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    if empty_init:  # LitGPT's order: built on the meta device, set up, then the optimizer
        with fabric.init_module(empty_init=True):
            model = MoETransformer(resolve_moe_config(MOE_CONFIG))
        assert next(model.parameters()).is_meta
        model = fabric.setup(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    else:
        config = resolve_moe_config(MOE_CONFIG)
        model = MoETransformer(config) if constructor else build_moe(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model, optimizer = fabric.setup(model, optimizer)
    groups = getattr(fabric.strategy, "mesh_groups", None)
    dense_group = None if groups is None else groups.dp_cp

    def loss_of(model, batch):
        return model.loss_fn(model(batch[:, :-1]), batch[:, 1:]) + model.aux_loss()

    losses = _train(fabric, model, optimizer, _moe_tokens(), loss_of, lambda: model.update_router_bias(dense_group))
    state = {
        name: value.detach().clone()
        for name, value in fabric.strategy.get_module_state_dict(model._forward_module).items()
    }
    offset = model.moe_layers()[0].experts.expert_offset
    session = getattr(fabric.strategy, "session", None)  # the all-to-alls in the strategy's counter
    counted = sorted(session.comm_counter.snapshot()["bytes"]) if session is not None else []
    return losses, state, offset, counted


MOE_CASES = {2: [(1, 2), (2, 2), (3, 2), ("3_meta", 2)], 4: [(2, 2), (3, 4)]}  # (stage, ep) per world size


def moe_model() -> dict:
    """Our own ``MoETransformer`` under ``ZeroFabricStrategy(stage=S, ep=E)`` (``MOE_CASES``; on 4
    ranks ep=2 shards the experts over an EDP group of 2): ``fabric.setup`` splits
    its experts ([Note: expert parallelism under Fabric]); per-step losses and trained weights
    (experts: this EP rank's rows; the routers' selection biases too) against Fabric's ``ddp``.
    ``3_meta``: stage 3 from ``MoETransformer(config)`` built under ``init_module(empty_init=True)`` (on
    the meta device, its initializers recorded and replayed after the experts are split), against
    ddp building the same constructor eagerly."""
    references = {False: _train_moe("ddp")}
    result = {}
    for stage, ep in MOE_CASES[WORLD]:
        strategy = ZeroFabricStrategy(stage=int(str(stage)[0]), ep=ep, bucket_mb=0.02, collective_timeout=60)
        meta = stage == "3_meta"
        if meta not in references:
            references[meta] = _train_moe("ddp", constructor=True)
        want_losses, want_state, _, _ = references[meta]
        losses, state, offset, counted = _train_moe(strategy, empty_init=meta)
        assert set(state) == set(want_state), sorted(set(state) ^ set(want_state))
        weights = 0.0
        for name, want in want_state.items():
            if ".experts." in name:
                want = want[offset : offset + state[name].shape[0]]
            assert state[name].shape == want.shape, (name, state[name].shape, want.shape)
            weights = max(weights, (state[name] - want).abs().max().item())
        result[f"moe_stage{stage}_ep{ep}"] = {
            "loss": max(abs(a - b) for a, b in zip(losses, want_losses)),
            "weights": weights,
            "expert_rows": int(state["layers.1.moe.experts.w1"].shape[0]),
            "bias_moved": float(want_state["layers.1.moe.router.bias"].abs().max()),
            "counted": counted,
        }
    return result


def refused() -> str:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=ZeroFabricStrategy(stage=2, ep=2))
    fabric.launch()
    plain = torch.nn.Linear(2, 2)
    try:
        fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    except ValueError as error:
        return str(error)
    raise AssertionError("a model without check_parallel_dims was accepted with ep=2")


if __name__ == "__main__":
    out = sys.argv[1]
    if sys.argv[2:] == ["moe"]:  # the 4-rank launch: our MoETransformer alone
        result = moe_model()
    else:
        result = {f"stage{stage}": run(stage) for stage in (1, 2, 3)}
        result.update(full_file(out))
        result.update(moe_model())
        result["refused"] = refused()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"fabric_ep.rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
