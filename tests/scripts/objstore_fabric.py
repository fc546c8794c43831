"""Fabric + ZeroFabricStrategy checkpoints in object storage (launched by tests/test_object_store.py).

Usage: LZ_CKPT_URL=s3://bucket python tests/scripts/objstore_fabric.py OUT_DIR CASE [CASE ...]
(torchrun-style ranks; fabric_run.py's tiny Llama, loop and data). Cases:
  save<s>       stage s at WORLD_SIZE ranks (dp = WORLD_SIZE): 3 steps, ``fabric.save(<url>/fab<s>w<W>)``
                in the background (async_checkpoint=True), 1 more step; records the full weights at the save
  resume<t>@<src>   stage t at WORLD_SIZE ranks: ``fabric.load(<url>/<src>)``; records the loaded full
                weights
Each writes OUT_DIR/<case>.rank<r>.pt.
"""

import os
import sys

import torch

torch.set_num_threads(1)

from tests.scripts.fabric_run import build, full_weights, make_fabric, train_steps  # noqa: E402


def save(out: str, url: str, stage: int) -> None:
    fabric = make_fabric(f"zero{stage}", "llama", async_checkpoint=True, upload_threads=2)
    model, optimizer, scheduler = build(fabric, "llama")
    ranks = [fabric.global_rank]
    train_steps(fabric, model, optimizer, scheduler, range(3), "llama", ranks)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 3}
    fabric.save(f"{url}/fab{stage}w{fabric.world_size}", state)
    at_save = full_weights(fabric, model)
    train_steps(fabric, model, optimizer, scheduler, range(3, 4), "llama", ranks)  # while the save uploads
    fabric.strategy.teardown()  # waits for the background save
    torch.save({"at_save": at_save}, os.path.join(out, f"save{stage}w{fabric.world_size}.rank{fabric.global_rank}.pt"))


def resume(out: str, url: str, stage: int, source: str) -> None:
    fabric = make_fabric(f"zero{stage}", "llama")
    model, optimizer, scheduler = build(fabric, "llama")
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    remainder = fabric.load(f"{url}/{source}", state)
    assert state["iter_num"] == 3 and remainder == {}, (state["iter_num"], remainder)
    loaded = full_weights(fabric, model)
    fabric.strategy.teardown()
    tag = f"resume{stage}w{fabric.world_size}@{source}"
    torch.save({"loaded": loaded}, os.path.join(out, f"{tag}.rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    out_dir, url = sys.argv[1], os.environ["LZ_CKPT_URL"]
    for case in sys.argv[2:]:
        if case.startswith("save"):
            save(out_dir, url, int(case[4:]))
        else:
            target, source = case.split("@")
            resume(out_dir, url, int(target[6:]), source)
