"""A Fabric hand loop with ``ZeroFabricStrategy(pp=2)``'s ``pipeline_step``, for tests/test_pipeline.py.

Usage: python tests/scripts/fabric_pp.py OUT_DIR DEVICES CASE [CASE ...]     (CASE: "<schedule>-zero<stage>")

Every rank also runs the same loop on the whole model in one process (no process group: AdamW,
the global norm clipped to 0.05, 2 batches of 4 sequences accumulated per step, 3 steps) and
writes OUT_DIR/<case>.rank<r>.pt: both loops' losses and, for each parameter this rank's stages
hold, the largest difference between the two loops' trained values. On 4 devices (pp=2 x dp=2)
batches have 8 rows, dp rank d takes rows d, d + 2, ... of each: its losses are its rows', the test averages them.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero.fabric import ZeroFabricStrategy  # noqa: E402
from lightning_zero.models.llama.config import LlamaConfig  # noqa: E402
from lightning_zero.models.llama.model import build_llama  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
SCHEDULES = {"1f1b": {}, "interleaved_1f1b": {"pp_virtual_stages": 2}, "zbv": {}}
STEPS, ACCUMULATE, CLIP = 3, 2, 0.05


def batches(rows: int):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (rows, 17), generator=generator) for _ in range(STEPS * ACCUMULATE)]


def model_and_optimizer():
    torch.manual_seed(42)
    model = build_llama(LlamaConfig(**CONFIG))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def reference(rows: int) -> tuple[list[float], dict]:
    model, optimizer = model_and_optimizer()
    losses = []
    for index, batch in enumerate(batches(rows)):
        loss = model.loss_fn(model(batch[:, :-1]), batch[:, 1:])
        (loss / ACCUMULATE).backward()
        losses.append(float(loss))
        if (index + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def main(out: str, case: str, devices: int = 2) -> None:
    schedule, stage = case.rsplit("-zero", 1)
    strategy = ZeroFabricStrategy(stage=int(stage), pp=2, pp_schedule=schedule, bucket_mb=0.01, **SCHEDULES[schedule])
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=stage == "3"):  # stage 3 under pp: built whole all the same, then cut
        model, optimizer = model_and_optimizer()
    model, optimizer = fabric.setup(model, optimizer)
    dp = devices // 2  # pp outermost: global rank r is dp rank r % dp
    mine, rows = slice(fabric.global_rank % dp, None, dp), 4 * dp  # 4 rows (zbv's 2 pp micro-batches) per dp rank
    losses = []
    for index, batch in enumerate(batches(rows)):
        batch = batch[mine]
        stepping = (index + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            loss = fabric.strategy.pipeline_step(batch[:, :-1], batch[:, 1:], accumulate=ACCUMULATE)
            fabric.backward(loss)
        losses.append(float(loss))
        if stepping:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        first = batches(rows)[0]
        evaluated = float(fabric.strategy.pipeline_step(first[mine, :-1], first[mine, 1:]))
    want_losses, want = reference(rows)
    state = {name: value for name, value in model.state_dict().items()}
    gaps = {name: float((value.float() - want[name]).abs().max()) for name, value in state.items()}
    with torch.no_grad():
        full, _ = model_and_optimizer()
        full.load_state_dict(want)
        want_eval = float(full.loss_fn(full(first[:, :-1]), first[:, 1:]))
    torch.save({"losses": losses, "want": want_losses, "gaps": gaps, "eval": (evaluated, want_eval)},
               os.path.join(out, f"{case}.rank{fabric.global_rank}.pt"))  # fmt: skip


if __name__ == "__main__":
    for case in sys.argv[3:]:
        main(sys.argv[1], case, int(sys.argv[2]))
