"""The toy MoE of tests/test_expert_domain.py under ``ZeroFabricStrategy(ep=2)`` on 2 CPU processes.

Usage: python tests/scripts/fabric_ep.py OUT_DIR
Launched torchrun-style by tests/test_expert_domain.py. For stages 1-3 the model is built with this
rank's experts over ``fabric.strategy.mesh_groups.ep`` (after ``fabric.launch()``), set up, trained
for 3 steps of 2 micro batches (``no_backward_sync``, ``clip_gradients``, AdamW with weight decay),
and compared on every rank with one process training the full model on both ranks' batches: losses
and weights to 1e-5 (``assert_close``); a model that does not declare ``check_parallel_dims`` is
refused at ``fabric.setup`` naming ep. Writes ``OUT_DIR/fabric_ep.rank<r>.json``.
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
    result = {f"stage{stage}": run(stage) for stage in (1, 2, 3)}
    result["refused"] = refused()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"fabric_ep.rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
