"""A Fabric hand loop on ``ZeroFabricStrategy(tensor_parallel_size=2)`` (pp=1, 2 ranks: one tp group,
dp=1), with the optimizer built over the whole model *before* ``fabric.setup(model, optimizer)``,
for tests/test_fabric_tp.py ([Note: optimizers built before the split] in runtime/parallelize.py).

Usage: python tests/scripts/fabric_tp.py OUT_DIR CASE [CASE ...]   (CASE: ``zero<stage>-sp`` or ``zero<stage>-nosp``)

Every rank also runs the same loop on the whole model in one process (no process group) and writes
OUT_DIR/<case>.rank<r>.pt: both loops' losses and, per parameter of the dense state dict, the
largest difference between the two loops' trained values. SGD with momentum: its update is linear
in the gradient, so the loops part by the gradients' float32 rounding only (Adam would divide it
by the gradient's own scale), and an optimizer stepping stale parameters leaves weights ``lr x
grad`` apart.
"""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero.fabric import ZeroFabricStrategy  # noqa: E402
from lightning_zero.models.llama.config import LlamaConfig  # noqa: E402
from lightning_zero.models.llama.model import build_llama  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
STEPS = 3


def model_and_optimizer():
    torch.manual_seed(42)
    model = build_llama(LlamaConfig(**CONFIG))
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def batches():
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2, 17), generator=generator) for _ in range(STEPS)]


def train(model, optimizer, backward) -> list[float]:
    losses = []
    for batch in batches():
        loss = model.loss_fn(model(batch[:, :-1]), batch[:, 1:])
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    reference, optimizer = model_and_optimizer()
    want = train(reference, optimizer, lambda loss: loss.backward())
    dense = reference.state_dict()
    for case in cases:
        stage, sp = int(case.split("-")[0].removeprefix("zero")), case.endswith("-sp")
        strategy = ZeroFabricStrategy(stage=stage, tensor_parallel_size=2, sequence_parallel=sp, monitor=False)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        model, optimizer = model_and_optimizer()
        model, optimizer = fabric.setup(model, optimizer)
        losses = train(model, optimizer, fabric.backward)
        trained = model.state_dict()  # dense: tp-split parameters whole
        gaps = {name: (trained[name].float() - value).abs().max().item() for name, value in dense.items()}
        moved = max(
            (value - model_and_optimizer()[0].state_dict()[name]).abs().max().item() for name, value in dense.items()
        )
        torch.save({"losses": losses, "want": want, "gaps": gaps, "moved": moved},
                   out / f"{case}.rank{fabric.global_rank}.pt")  # fmt: skip
        fabric.strategy.teardown()


if __name__ == "__main__":
    main()
