"""A mixture of experts under ZeroStrategy(ep=E) stages 1-3 and under Lightning's ddp (no EP).

Usage: python tests/scripts/moe_vs_ddp.py OUT_DIR CASE [CASE ...]   (launched on 2 or 4 ranks)
Launched by tests/test_moe_strategy.py. Every case trains ``MoELM`` (``tiny_moe_shared``: a dense
first layer, sigmoid routing with a selection bias, a shared expert, 8 routed experts top-2) in
fp32 with gradient accumulation 2 and clipping, for STEPS optimizer steps, and writes
OUT_DIR/<case>.rank<r>.pt: the per-micro-batch losses, this rank's parameters (an EP rank's experts
are its rows of the stacked tensors, with their offset), the all-to-all bytes counted per label and
the routing counts each micro-batch saw, and the monitor's ``moe/`` figures and the engine's
measured model-state bytes (``zero/measured_*``) per step.

The routing is steered through the selection bias (a buffer set inside ``training_step``, after
ddp's buffer broadcast, identically in every case) so that

- micro-batch 2 (step 1): the last ``8 / world`` experts get no token from any rank: under
  ``ep = world`` the last rank receives zero tokens for all of its experts;
- micro-batch 3 (step 1): expert 0 gets no token from global rank 0 (but from the others).

A case ``zero<S>_tp<T>_ep<E>`` adds tensor parallelism with sequence parallelism (``_nosp`` appended:
without it; ``T`` ranks per TP group, ``world / T`` data-parallel ranks, steered and fed as ddp on ``world / T`` ranks: it is
compared with the ddp case of that smaller launch); its parameters are written TP-gathered.

A case ending in ``_bias`` (``ddp_bias``, ``zero2_ep2_bias``, ...) trains without steering, with
DeepSeek-V3's auxiliary-loss-free bias update on (``bias_update_rate`` BIAS_UPDATE_RATE), and writes
the routers' final biases too.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

STEPS = 3
WORLD = int(os.environ["WORLD_SIZE"])  # read once: a Trainer's teardown drops it
ACCUMULATE = 2
BIAS_UPDATE_RATE = 0.01
SEQ = 16


class SteeredMoE(MoELM):
    def __init__(self, tp: int = 1, bias_update_rate: float = 0.0) -> None:
        config = {"name": "tiny_moe_shared", "bias_update_rate": bias_update_rate}
        super().__init__(config, lr=1e-3, warmup_steps=0, max_steps=STEPS, weight_decay=0.1)
        self.losses: list[float] = []
        self.loads: list[list[list[int]]] = []
        self.tp = tp

    def training_step(self, batch, batch_idx):
        if self.config.bias_update_rate > 0:  # the update moves the bias: no steering
            return self._record(batch, batch_idx)
        # steered by the data-parallel rank: the TP ranks of one dp rank route one micro-batch
        world, rank = self.trainer.world_size // self.tp, self.global_rank // self.tp
        for moe in self.model.moe_layers():
            bias = moe.router.bias
            bias.zero_()
            if batch_idx == 2:
                bias[-(bias.numel() // world) :] = -1e4
            if batch_idx == 3 and rank == 0:
                bias[0] = -1e4
        return self._record(batch, batch_idx)

    def _record(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        self.loads.append(torch.stack([moe.load for moe in self.model.moe_layers()]).tolist())
        return loss


def tokens(world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    rows = 2 * world * ACCUMULATE * STEPS  # batch size 2 per rank
    return torch.randint(0, 256, (rows, SEQ + 1), generator=gen)


def tensor_parallel(case: str) -> int:
    """``zero2_tp2_ep2``: 2; cases without ``_tp``: 1."""
    return int(case.split("_tp")[1].split("_")[0]) if "_tp" in case else 1


def strategy(case: str):
    if case.startswith("ddp"):
        return "ddp"
    stage, ep = case.removeprefix("zero").split("_")[0], case.split("_ep")[1].split("_")[0]
    tp = tensor_parallel(case)
    sequence_parallel = tp > 1 and not case.endswith("_nosp")
    return ZeroStrategy(stage=int(stage), ep=int(ep), bucket_mb=0.02, tensor_parallel_size=tp,
                        sequence_parallel=sequence_parallel)  # fmt: skip


def run(case: str, out_dir: str) -> None:
    world, tp = WORLD, tensor_parallel(case)
    L.seed_everything(42, verbose=False)
    model = SteeredMoE(tp, BIAS_UPDATE_RATE if case.endswith("_bias") else 0.0)
    loader = DataLoader(tokens(world // tp), batch_size=2, shuffle=False)  # the same rows per dp rank as ddp's
    trainer = script_trainer(
        devices=world,
        strategy=strategy(case),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=0.05,
        limit_val_batches=1.0,
    )
    trainer.fit(model, loader)
    strategy_ = trainer.strategy
    counted = dict(strategy_.comm_counter.snapshot()["bytes"]) if isinstance(strategy_, ZeroStrategy) else {}
    monitor = [cb for cb in trainer.callbacks if type(cb).__name__ == "ZeroMonitor"]
    kept = ("moe/", "zero/measured_")  # the moe figures, and the engine's model-state bytes (planner: test)
    history = [{k: v for k, v in step.items() if k.startswith(kept)} for step in monitor[0].history] if monitor else []
    params = {n: p.detach().float().clone() for n, p in model.model.named_parameters()}
    if tp > 1:  # the dense (TP-gathered) tensors; an EP rank's experts stay its rows
        from lightning_zero.tp import gather_tp_state_dict

        dense = gather_tp_state_dict(model.model, strategy_.mesh_groups.tp)
        params = {name: dense[name].float() for name in params}
    offsets = {i: moe.experts.expert_offset for i, moe in enumerate(model.model.moe_layers())}
    torch.save(
        {
            "losses": model.losses,
            "loads": model.loads,
            "params": params,
            "offsets": offsets,
            "counted": counted,
            "monitor": history,
            "biases": [moe.router.bias.clone() for moe in model.model.moe_layers()],
        },  # fmt: skip
        os.path.join(out_dir, f"{case}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(name, sys.argv[1])
