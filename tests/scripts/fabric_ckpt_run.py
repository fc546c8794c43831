"""Checkpoint lifecycle cells on the Fabric door (launched by tests/test_checkpoint_lifecycle.py, issue 56).

Usage: python tests/scripts/fabric_ckpt_run.py OUT_DIR MODE:CASE [MODE:CASE ...]   (torchrun-style, 2 ranks)

fabric_run.py's tiny Llama, loop and data; ``ZeroFabricStrategy(stage=N, async_checkpoint=True)``.
Modes (CASE = ``zero<N>``):

- ``async``: 3 steps, ``fabric.save(OUT_DIR/fa<N>_3)``, 3 steps, ``fabric.save(OUT_DIR/fa<N>_6)``,
  teardown; records the losses and whether each save ran in the background;
- ``exit``: as ``async`` into ``fx<N>_*``, but the script ends without a teardown (LitGPT's
  scripts): the save in flight at exit must be published and the exit code 0;
- ``resume``: ``fabric.load(OUT_DIR/fa<N>_3)`` (the test may have moved it aside, as a kill between
  the two renames of a publish leaves it, and planted an older release's staging name), 3 steps;
- ``fullfail``: rank 0's file-size limit drops to 1 KiB, then a full save
  (``state_dict_type="full"``): records on each rank whether ``fabric.save`` raised; ends the process.

Each rank writes ``OUT_DIR/<MODE>_<CASE>.rank<r>.json``. A kill or a full disk in a background
save are cells of the fault matrix (tests/scripts/fault_fabric.py).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

torch.set_num_threads(1)

from tests.scripts.fabric_run import build, make_fabric, train_steps  # noqa: E402


def _write(out: str, name: str, rank: int, result: dict) -> None:
    path = os.path.join(out, f"{name}.rank{rank}.json")
    with open(path + ".part", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".part", path)


def _host_buffers(lifecycle: object) -> dict:
    """The background writer's host buffers after a save: their addresses, and the bytes the saves'
    copies allocated fresh (0: every copy went into buffers prepared after the first step)."""
    from lightning_zero.checkpoint.background import _tensors_of

    writer = lifecycle.writer  # type: ignore[attr-defined]
    return {"ptrs": sorted(t.data_ptr() for t in _tensors_of(writer._buffers)), "fresh_bytes": writer.fresh_bytes,
            "prepared_bytes": writer.prepared_bytes, "copies": writer.copies}  # fmt: skip


def _saves(out: str, case: str, prefix: str, *, teardown: bool) -> dict:
    fabric = make_fabric(case, "llama", async_checkpoint=True)
    model, optimizer, scheduler = build(fabric, "llama")
    ranks, rank = [fabric.global_rank], fabric.global_rank
    stage = case[-1]
    result: dict = {"started": time.time()}
    first, _ = train_steps(fabric, model, optimizer, scheduler, range(3), "llama", ranks)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 3}
    fabric.save(os.path.join(out, f"{prefix}{stage}_3"), state)
    lifecycle = fabric.strategy.checkpoints
    result["background"] = [lifecycle.records[-1].background]
    result["buffers"] = [_host_buffers(lifecycle)]
    rest, _ = train_steps(fabric, model, optimizer, scheduler, range(3, 6), "llama", ranks)
    result["losses"] = first + rest
    state["iter_num"] = 6
    try:
        fabric.save(os.path.join(out, f"{prefix}{stage}_6"), state)
        result["background"].append(lifecycle.records[-1].background)
        result["buffers"].append(_host_buffers(lifecycle))
        if teardown:
            fabric.strategy.teardown()
    finally:
        result["ended"] = time.time()
        _write(out, f"{prefix}_{case}", rank, result)
    return result


def resume(out: str, case: str) -> None:
    fabric = make_fabric(case, "llama", async_checkpoint=True)
    model, optimizer, scheduler = build(fabric, "llama")
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    remainder = fabric.load(os.path.join(out, f"fa{case[-1]}_3"), state)
    assert state["iter_num"] == 3 and remainder == {}, (state["iter_num"], remainder)
    rest, _ = train_steps(fabric, model, optimizer, scheduler, range(3, 6), "llama", [fabric.global_rank])
    _write(out, f"resume_{case}", fabric.global_rank, {"losses": rest, "names": sorted(os.listdir(out))})
    fabric.strategy.teardown()


def fullfail(out: str, case: str) -> None:
    fabric = make_fabric(case, "llama")
    model, optimizer, scheduler = build(fabric, "llama")
    train_steps(fabric, model, optimizer, scheduler, range(1), "llama", [fabric.global_rank])
    fabric.strategy.state_dict_type = "full"
    if fabric.global_rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    result: dict = {"raised": None}
    started = time.monotonic()
    try:
        fabric.save(os.path.join(out, f"full_{case}.pth"), {"model": model})
        result["raised"] = False
    except BaseException as exc:  # noqa: BLE001 - whether each rank raised, and what, is the result
        result["raised"], result["error"] = True, f"{type(exc).__name__}: {exc}"[:2000]
    result["seconds"] = time.monotonic() - started
    _write(out, f"fullfail_{case}", fabric.global_rank, result)
    sys.stdout.flush()
    time.sleep(3)  # rank 0 stays a while: a peer that did not get the save's error would block, not fail
    os._exit(0)  # the ranks may disagree (the fourth release): no teardown that needs both


if __name__ == "__main__":
    out, *cases = sys.argv[1:]
    for item in cases:
        mode, case = item.split(":")
        if mode == "async":
            _saves(out, case, "fa", teardown=True)
        elif mode == "exit":
            _saves(out, case, "fx", teardown=False)
        else:
            {"resume": resume, "fullfail": fullfail}[mode](out, case)
