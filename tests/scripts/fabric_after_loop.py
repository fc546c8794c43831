"""Saves after a Fabric loop ends (issue 61), ZeroFabricStrategy beside Fabric's ``ddp``, CPU gloo.

Usage: python tests/scripts/fabric_after_loop.py OUT_DIR [STRATEGY ...]
Launched by tests/test_after_loop_saves.py with 2 ranks; fabric_run.py's tiny Llama, loop and data.
STRATEGY: ``ddp``, ``zero1``-``zero3`` (sync saves), ``async1``-``async3`` (``async_checkpoint=True``);
default: all. For each one:

- ``full``: 10 steps uninterrupted (ddp and the sync stages);
- after 4 steps, ``fabric.save`` after the loop (``loop``), after an evaluation forward under
  ``no_grad`` in ``eval()`` mode (``eval``), after a prediction under ``inference_mode`` (``predict``)
  and, for the ZeRO strategies, after ``fabric.strategy.teardown()`` (``teardown``);
- ``resume_<save>``: a new model and optimizer ``fabric.load`` the last save and train to step 10
  (the test compares the other saves' tensors with it).

Writes OUT_DIR/fabric.rank<r>.json: per strategy the losses of each run and the seconds each save took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

torch.set_num_threads(1)

from lightning.fabric.strategies import DDPStrategy  # noqa: E402

from tests.scripts.fabric_run import batch, build, loss_of, make_fabric, train_steps  # noqa: E402

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "async1", "async2", "async3")


def _fabric(name: str):
    if name.startswith("async"):
        return make_fabric(f"zero{name[-1]}", "llama", async_checkpoint=True)
    return make_fabric(name, "llama")


def _state(model, optimizer, scheduler, step: int) -> dict:
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step}


def _losses(losses: list[list[float]]) -> list[float]:
    return [sum(step) / len(step) for step in losses]


def _teardown(fabric) -> None:
    if type(fabric.strategy) is not DDPStrategy:  # as fabric_run.py's cases: ddp's is not needed
        fabric.strategy.teardown()


def run(out: str, name: str) -> dict:
    sync = not name.startswith("async")
    record: dict = {"save_s": {}, "losses": {}}
    if sync:  # one strategy object per model, as Fabric sets each up once
        fabric = _fabric(name)
        model, optimizer, scheduler = build(fabric, "llama")
        losses, _ = train_steps(fabric, model, optimizer, scheduler, range(10), "llama", [fabric.global_rank])
        record["losses"]["full"] = _losses(losses)
        _teardown(fabric)
    fabric = _fabric(name)
    ranks = [fabric.global_rank]
    model, optimizer, scheduler = build(fabric, "llama")
    losses, _ = train_steps(fabric, model, optimizer, scheduler, range(4), "llama", ranks)
    state = _state(model, optimizer, scheduler, 4)

    def save(what: str) -> None:
        started = time.perf_counter()
        try:  # a refusal raises on every rank alike
            fabric.save(os.path.join(out, name, what), state)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to read
            record.setdefault("errors", {})[what] = f"{type(exc).__name__}: {exc}"
        record["save_s"][what] = time.perf_counter() - started

    save("loop")
    model.eval()
    with torch.no_grad():
        loss_of(model, batch(99, 0, ranks))
    model.train()
    save("eval")
    with torch.inference_mode():
        model(batch(98, 0, ranks)[:, :-1])
    save("predict")
    saves = ["loop", "eval", "predict"]
    if name != "ddp":
        fabric.strategy.teardown()
        save("teardown")
        saves.append("teardown")
    for what in saves[-1:]:  # the last save, after every other point; the test compares the saves' tensors
        if what in record.get("errors", {}):
            continue
        fabric = _fabric(name)
        model, optimizer, scheduler = build(fabric, "llama")
        state = _state(model, optimizer, scheduler, 0)
        fabric.load(os.path.join(out, name, what), state)
        losses, _ = train_steps(fabric, model, optimizer, scheduler, range(state["step"], 10), "llama", ranks)
        record["losses"][f"resume_{what}"] = _losses(losses)
        _teardown(fabric)
    return record


if __name__ == "__main__":
    out_dir = sys.argv[1]
    results = {}
    for strategy_name in sys.argv[2:] or STRATEGIES:
        started = time.perf_counter()
        results[strategy_name] = run(out_dir, strategy_name)
        results[strategy_name]["total_s"] = time.perf_counter() - started
        with open(os.path.join(out_dir, f"fabric.rank{os.environ.get('RANK', '0')}.json"), "w") as handle:
            json.dump(results, handle, indent=1)
