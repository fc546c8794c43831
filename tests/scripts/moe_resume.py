"""A mixture of experts resumed on another expert-parallel size (issue 54 item 7), 4 CPU ranks.

Usage: python tests/scripts/moe_resume.py OUT_DIR   (launched on 4 ranks by tests/test_moe_strategy.py)

- ``straight``: ZeroStrategy(stage=2, ep=1), 6 optimizer steps uninterrupted;
- ``ep2``: stage 2, ep=2 (two EP groups, experts sharded over EDP groups of 2), checkpoint at step 2;
- ``ep1``: stage 2, ep=1, resumed from ``ep2``'s step-2 checkpoint, checkpoint at step 4;
- ``ep4``: stage 3, ep=4 (every rank a quarter of the experts), resumed from ``ep1``'s step 4 to 6;
- ``tp_straight``: stage 2, ep=4, micro-batches of 2 on dp 4, 6 steps, without auxiliary losses, lr 1e-3;
- ``tp2_ep2``: stage 2, tp=2 (sequence-parallel) x ep=2, micro-batches of 4 on dp 2 (the same global
  batch of 8), checkpoint at step 2;
- ``tp1_ep4``: stage 3, ep=4, micro-batches of 2 on dp 4, resumed from ``tp2_ep2``'s step 2 to 6.

(Each segment runs one step past its checkpoint, which is then a mid-run one, as
tests/scripts/ckpt_train.py's resume cases use.) Each writes OUT_DIR/<case>.rank<r>.pt
(per-micro-batch losses, the parameters at the end with the expert offsets); ``ep4``'s last
checkpoint (saved at ep=4) stays in OUT_DIR/ckpts/ep4 for the export test.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

CONFIG = dict(name="tiny_moe", n_experts=8, vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, expert_ffn_dim=16,
              max_seq_len=16, qk_norm=True)  # fmt: skip
# case: (ep, stage, first step, steps run to, resume from, tp, batch size)
SEGMENTS = {"straight": (1, 2, 0, 6, None, 1, 2), "ep2": (2, 2, 0, 3, None, 1, 2), "ep1": (1, 2, 2, 5, "ep2", 1, 2),
            "ep4": (4, 3, 4, 6, "ep1", 1, 2),
            # across tp (and with it dp: 2 -> 4) at the same global batch of 8: no auxiliary losses, whose
            # per-micro-batch statistics would change with the micro-batch
            "tp_straight": (4, 2, 0, 6, None, 1, 2), "tp2_ep2": (2, 2, 0, 3, None, 2, 4),
            "tp1_ep4": (4, 3, 2, 6, "tp2_ep2", 1, 2)}  # fmt: skip


class Recorder(MoELM):
    def __init__(self, across_tp: bool = False) -> None:
        # across tp: no auxiliary losses, and lr 1e-3 (AdamW magnifies TP's summation-order noise in
        # near-zero gradients by the learning rate: docs/moe.md, "Measured")
        config = {**CONFIG, "aux_loss_coef": 0.0, "z_loss_coef": 0.0} if across_tp else CONFIG
        super().__init__(config, lr=1e-3 if across_tp else 1e-2, warmup_steps=1, max_steps=6)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def data(batch_size: int = 2) -> TokenDataModule:
    # 96 windows of 8 tokens: 12 batches of 2 per rank per epoch at dp 4 (6 steps of 2 micro-batches)
    return TokenDataModule("synthetic", seq_len=8, batch_size=batch_size, vocab_size=64, val_fraction=0.0,
                           synthetic_tokens=800)  # fmt: skip


def run(case: str, out: str) -> None:
    ep, stage, first, last, resume, tp, batch_size = SEGMENTS[case]
    ckpt_dir = os.path.join(out, "ckpts", case)
    L.seed_everything(7, verbose=False)
    model = Recorder(across_tp=case.startswith("tp"))
    strategy = ZeroStrategy(stage=stage, ep=ep, bucket_mb=0.01, tensor_parallel_size=tp, sequence_parallel=tp > 1)
    trainer = script_trainer(
        devices=4,
        max_steps=last,
        strategy=strategy,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=True)],
        limit_val_batches=1.0,
        enable_checkpointing=True,
    )
    ckpt_path = os.path.join(out, "ckpts", resume, f"epoch=0-step={first}.ckpt") if resume else None
    trainer.fit(model, datamodule=data(batch_size), ckpt_path=ckpt_path)
    params = {n: p.detach().float().clone() for n, p in model.model.named_parameters()}
    if tp > 1:  # the dense (TP-gathered) tensors
        from lightning_zero.tp import gather_tp_state_dict

        dense = gather_tp_state_dict(model.model, trainer.strategy.mesh_groups.tp)
        params = {name: dense[name].float() for name in params}
    offsets = {i: moe.experts.expert_offset for i, moe in enumerate(model.model.moe_layers())}
    torch.save({"losses": model.losses, "params": params, "offsets": offsets},
               os.path.join(out, f"{case}.rank{trainer.global_rank}.pt"))  # fmt: skip


if __name__ == "__main__":
    for name in sys.argv[2:] or SEGMENTS:
        run(name, sys.argv[1])
