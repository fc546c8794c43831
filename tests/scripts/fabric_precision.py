"""Fabric's precisions under Fabric's ddp and ZeroFabricStrategy on 2 CPU processes; each rank writes its results.

Usage: python tests/scripts/fabric_precision.py OUT_DIR MODE:STRATEGY [MODE:STRATEGY ...]
Launched by tests/test_fabric_precision.py; one launch runs every case in turn (strategies: ddp,
zero1, zero2, zero3). Modes:

- ``btrue``: ``precision="bf16-true"``, the tiny Llama, 4 steps of 2 micro batches under
  ``no_backward_sync``, ``clip_gradients(max_norm=0.5)``, AdamW; per-step losses, parameter dtypes.
  ``btrue1``: 4 steps of one batch, without clipping (``zero2fp32``: ``master_weights="fp32"``);
  ``bf16m``: the same under ``bf16-mixed``.
- ``fp16``: ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", init_scale=2**20,
  growth_interval=3))``, 10 steps, ``clip_gradients(max_norm=1.0)``: losses, the scale after every
  step, the strategy's overflow flags (this rank's shard, any rank's). ``hf16``: the same on the
  transformers Llama (``precision_helpers.hf_llama``). A ``half`` suffix on the strategy
  (``zero2half``) sets ``mixed_params="half"`` (fp16 parameters, fp32 masters in the shards); the
  default keeps fp32 parameters under autocast, as ddp.
- ``fp16inf``: the same, with an inf in one element of rank 1's gradient at step ``POISONED``:
  the parameters and AdamW's step counts around it. ``fp16noclip`` steps without clipping (the
  unscale comes right before the step).
- ``fp16save``: the same 10 steps with ``fabric.save`` after step ``SAVED`` (the scaler in the
  state, Fabric's convention); then a fresh Fabric loads it into a new model, optimizer and scaler
  (made with other settings) and runs the remaining steps.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.scripts.fabric_run import WORLD, batch, full_weights, llama, loss_of  # noqa: E402
from tests.scripts.precision_helpers import hf_llama, poison_grad  # noqa: E402

STEPS, POISONED, SAVED = 10, 6, 5


def make_fabric(strategy_name: str, precision) -> L.Fabric:
    """``ddp`` or ``zero<stage>``, with an ``fp32`` suffix for ``master_weights="fp32"``, a ``half``
    suffix for ``mixed_params="half"``."""
    if strategy_name == "ddp":
        strategy = DDPStrategy()
    else:
        master_weights = "fp32" if strategy_name.endswith("fp32") else "auto"
        mixed_params = "half" if strategy_name.endswith("half") else "auto"
        stage = int(strategy_name.removesuffix("fp32").removesuffix("half")[-1])
        strategy = lightning_zero.ZeroFabricStrategy(stage=stage, bucket_mb=0.01, master_weights=master_weights,
                                                     mixed_params=mixed_params)  # fmt: skip
    plugins = [precision] if not isinstance(precision, str) else None
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, plugins=plugins,
                      precision=precision if isinstance(precision, str) else None)  # fmt: skip
    fabric.launch()
    return fabric


def setup(fabric, model_name: str = "llama"):
    L.seed_everything(42, verbose=False)
    module = hf_llama() if model_name == "hf" else llama()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    return fabric.setup(module, optimizer)


def adam_steps(optimizer) -> list[float]:
    return sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})


def bf16_true(out: str, strategy_name: str, mode: str) -> None:
    fabric = make_fabric(strategy_name, "bf16-mixed" if mode == "bf16m" else "bf16-true")
    model, optimizer = setup(fabric)
    losses = []
    micros, clip = (2, True) if mode == "btrue" else (1, False)
    for step in range(4):
        for micro in range(micros):
            with fabric.no_backward_sync(model, enabled=micro < micros - 1):
                loss = loss_of(model, batch(step, micro, [fabric.global_rank])) / 2
                fabric.backward(loss)
            losses.append(loss.item() * 2)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    result = {"losses": losses, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "params": full_weights(fabric, model), "bytes": _bytes(fabric)}  # fmt: skip
    torch.save(result, os.path.join(out, f"{mode}_{strategy_name}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


def _bytes(fabric) -> dict:
    engine = getattr(fabric.strategy, "engine", None)
    if engine is None:
        return {}
    from tests.engine_state import bytes_record

    return bytes_record(engine)


def _scaler(**settings) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **{"init_scale": 2.0**20, "growth_interval": 3, **settings})


def fp16_steps(fabric, model, optimizer, scaler, steps: range, record: dict, poison: bool, clip: bool) -> None:
    for step in steps:
        hook = None
        if poison and step == POISONED:
            record["before"], record["steps_before"] = full_weights(fabric, model), adam_steps(optimizer)
            if fabric.global_rank == 1:
                hook = poison_grad(model._original_module.layers[0].attention.wq.weight)
        loss = loss_of(model, batch(step, 0, [fabric.global_rank]))
        fabric.backward(loss)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        if hook is not None:
            hook.remove()
        if poison and step == POISONED:
            record["after"], record["steps_after"] = full_weights(fabric, model), adam_steps(optimizer)
        record["losses"].append(loss.item())
        record["scales"].append(float(scaler.get_scale()))


def fp16(out: str, strategy_name: str, mode: str = "fp16") -> None:
    scaler = _scaler()
    fabric = make_fabric(strategy_name, MixedPrecision("16-mixed", "cpu", scaler=scaler))
    model, optimizer = setup(fabric, "hf" if mode == "hf16" else "llama")
    record: dict = {"losses": [], "scales": []}
    steps = range(SAVED) if mode == "fp16save" else range(STEPS)
    fp16_steps(fabric, model, optimizer, scaler, steps, record, mode == "fp16inf", mode != "fp16noclip")
    if mode == "fp16save":  # Fabric's convention: the scaler's state is saved when the state holds it
        fabric.save(os.path.join(out, f"ckpt_{strategy_name}"), {"model": model, "optimizer": optimizer,
                                                                 "scaler": scaler, "step": SAVED})  # fmt: skip
        fabric.strategy.teardown()
        scaler = _scaler(init_scale=1.0, growth_interval=100)  # its settings come from the checkpoint
        fabric = make_fabric(strategy_name, MixedPrecision("16-mixed", "cpu", scaler=scaler))
        model, optimizer = setup(fabric)
        state = {"model": model, "optimizer": optimizer, "scaler": scaler, "step": 0}
        fabric.load(os.path.join(out, f"ckpt_{strategy_name}"), state)
        record["resumed_scale"], record["resumed_step"] = float(scaler.get_scale()), state["step"]
        fp16_steps(fabric, model, optimizer, scaler, range(SAVED, STEPS), record, False, True)
    record["steps"] = adam_steps(optimizer)
    record["overflows"] = list(getattr(fabric.strategy, "overflows", []))
    record["params"] = full_weights(fabric, model)
    record["bytes"] = _bytes(fabric)
    torch.save(record, os.path.join(out, f"{mode}_{strategy_name}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


if __name__ == "__main__":
    out, *cases = sys.argv[1:]
    for item in cases:
        mode, strategy_name = item.split(":")
        if mode.startswith("btrue") or mode == "bf16m":
            bf16_true(out, strategy_name, mode)
        else:
            fp16(out, strategy_name, mode)
