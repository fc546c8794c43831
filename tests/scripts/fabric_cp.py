"""Context parallelism through the Fabric door (``ZeroFabricStrategy(cp=C)``) against Fabric's ddp.

Usage: python tests/scripts/fabric_cp.py OUT_DIR CASE [CASE ...]
Launched torchrun-style by tests/test_fabric_cp.py; one launch runs its cases in turn. Every case
trains the same tiny Llama (4 heads, 2 kv heads) on the same global micro batches (2 windows of
2049 tokens) for 3 steps of 2 micro batches (``no_backward_sync``, ``clip_gradients``, AdamW with
weight decay): ``ddp`` gives each of its ranks one sequence; ``cp<C>_zero<S>`` gives its one dp
rank both sequences and cuts them with ``fabric.strategy.context_slice`` (the loop's one change).
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-step losses, clipped norms, the trained weights,
the bytes its strategy counted, the monitor's tokens/s, the shapes it trained on. ``refusals``
records what ``fabric.setup`` and ``context_slice`` raise for a model and a length cp cannot run.
``cp2_zero2`` saves a sharded checkpoint (``fabric.save``) after 2 steps; ``resume_cp1_zero2``
loads it under ZeRO-2 without cp (dp=2, one sequence per rank) and trains the third step.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

from lightning_zero import ZeroFabricStrategy  # noqa: E402
from lightning_zero.models import Llama, LlamaConfig  # noqa: E402

SEQ, SEQUENCES, STEPS, MICRO, CLIP = 2048, 2, 3, 2, 0.05
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: a strategy's teardown deletes it
# 3 query heads do not split over cp=2: the *_heads3 cases run ring attention ([Note: ring attention])
HEADS3 = dict(CONFIG, n_heads=3, n_kv_heads=1, dim=48)


def config_of(case: str) -> LlamaConfig:
    return LlamaConfig(**(HEADS3 if case.endswith("_heads3") else CONFIG))


def windows(step: int, micro: int) -> torch.Tensor:
    """The global micro batch: ``SEQUENCES`` stored windows of ``SEQ + 1`` tokens."""
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, CONFIG["vocab_size"], (SEQUENCES, SEQ + 1), generator=gen)


SAVES = {"cp2_zero2": "ckpt_cp2"}  # a sharded fabric.save after step SAVED_AFTER ...
RESUMES = {"resume_cp1_zero2": "ckpt_cp2"}  # ... that this case loads without cp and continues
SAVED_AFTER = 2


def make_strategy(case: str):
    if case.startswith("ddp"):
        return DDPStrategy()
    parts = case.removesuffix("_heads3").split("_")[-2:]
    cp, stage = (int(part[2:]) if part.startswith("cp") else int(part[4:]) for part in parts)
    return ZeroFabricStrategy(stage=stage, cp=cp, bucket_mb=0.01, model_config=config_of(case), seq_len=SEQ)


def run(out: str, case: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=make_strategy(case))
    fabric.launch()
    L.seed_everything(42, verbose=False)
    model = Llama(config_of(case))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    first = 0
    if case in RESUMES:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(os.path.join(out, RESUMES[case]), state)
        first = state["step"]
    ddp = case.startswith("ddp")
    rank, dp = fabric.global_rank, WORLD if ddp else WORLD // fabric.strategy.cp_size
    per_dp_rank = SEQUENCES // dp
    losses, norms, shapes = [], [], []
    for step in range(first, STEPS):
        if case in SAVES and step == SAVED_AFTER:
            fabric.save(os.path.join(out, SAVES[case]), {"model": model, "optimizer": optimizer, "step": step})
        total = 0.0
        for micro in range(MICRO):
            window = windows(step, micro)
            dp_rank = rank if ddp else fabric.strategy.dp_rank
            window = window[dp_rank * per_dp_rank : (dp_rank + 1) * per_dp_rank]
            inputs, targets = window[:, :-1], window[:, 1:]
            if not ddp:  # the loop's one change under cp
                inputs, targets = fabric.strategy.context_slice(inputs, targets)
            shapes.append(tuple(inputs.shape))
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = model.loss_fn(model(inputs), targets) / MICRO
                fabric.backward(loss)
            total += loss.item()
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    params = {
        k: v.detach().clone().float() for k, v in fabric.strategy.get_module_state_dict(model._forward_module).items()
    }
    result = {"losses": losses, "norms": norms, "params": params, "shapes": shapes}
    engine = getattr(fabric.strategy, "engine", None)
    if engine is not None:
        result["sent"] = dict(engine.counter.bytes)
        result["monitor"] = fabric.strategy.step_monitor.history
        result["summary"] = fabric.strategy.step_monitor.summary_lines()
    torch.save(result, os.path.join(out, f"{case}.rank{rank}.pt"))
    fabric.strategy.teardown()


def refusals(out: str, case: str) -> None:
    """What a cp=2 run refuses after the launch: a model without a cp-capable decoder at
    ``fabric.setup``, a sequence length cp does not divide at ``context_slice``."""
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=ZeroFabricStrategy(stage=2, cp=2))
    fabric.launch()
    messages = {}
    plain = torch.nn.Linear(4, 4)
    try:
        fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    except ValueError as error:
        messages["setup"] = str(error)
    try:
        fabric.strategy.context_slice(torch.zeros(2, 2047, dtype=torch.long))
    except ValueError as error:
        messages["slice"] = str(error)
    torch.save(messages, os.path.join(out, f"{case}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


if __name__ == "__main__":
    out, *cases = sys.argv[1:]
    for case in cases:
        (refusals if case == "refusals" else run)(out, case)
