"""Tensor parallel x ZeRO through ZeroStrategy, for tests/test_tp_strategy.py.

Usage: python tests/scripts/tp_parity.py OUT_DIR DEVICES CASE [CASE ...]
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-step losses, the dense (TP-gathered) parameters,
and a fingerprint of each batch it trained on. Cases run in the order given: the ones in SAVES
write a checkpoint at step 2 that the ones in RESUMES continue to step 4 in the other layout
(with and without sequence parallelism).
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import checkpointed_trainer  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
CLIP = {"gradient_clip_val": 0.05}
CASES = {
    "single": (lambda: "auto", {}),
    "tp2": (lambda: ZeroStrategy(stage=1, tensor_parallel_size=2), {}),
    "dp2_zero1": (lambda: ZeroStrategy(stage=1), CLIP),
    "dp2_zero2": (lambda: ZeroStrategy(stage=2, bucket_mb=0.01), CLIP),
    "tp2dp2_zero1": (lambda: ZeroStrategy(stage=1, tensor_parallel_size=2), CLIP),
    "tp2dp2_zero2": (lambda: ZeroStrategy(stage=2, tensor_parallel_size=2, bucket_mb=0.01), CLIP),
    "tp2dp2_zero3": (lambda: ZeroStrategy(stage=3, tensor_parallel_size=2, bucket_mb=0.01), CLIP),
    # sequence parallelism: the same runs with the norm/residual regions sharded over the sequence
    "tp2_sp": (lambda: ZeroStrategy(stage=1, tensor_parallel_size=2, sequence_parallel=True), {}),
    "tp2dp2_sp_zero1": (lambda: ZeroStrategy(stage=1, tensor_parallel_size=2, sequence_parallel=True), CLIP),
    "tp2dp2_sp_zero2": (
        lambda: ZeroStrategy(stage=2, tensor_parallel_size=2, bucket_mb=0.01, sequence_parallel=True),
        CLIP,
    ),
    "tp2dp2_sp_zero3": (
        lambda: ZeroStrategy(stage=3, tensor_parallel_size=2, bucket_mb=0.01, sequence_parallel=True),
        CLIP,
    ),
    # checkpoints cross the layouts: saved with sequence parallelism, resumed without, and back
    "resume_sp_ckpt_plain": (lambda: ZeroStrategy(stage=2, tensor_parallel_size=2, bucket_mb=0.01), CLIP),
    "resume_plain_ckpt_sp": (
        lambda: ZeroStrategy(stage=2, tensor_parallel_size=2, bucket_mb=0.01, sequence_parallel=True),
        CLIP,
    ),
}
SAVES = {"tp2dp2_zero2": "plain", "tp2dp2_sp_zero2": "sp"}  # case: checkpoint directory written at step 2
RESUMES = {"resume_sp_ckpt_plain": "sp", "resume_plain_ckpt_sp": "plain"}  # case: checkpoint it resumes


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(int((batch * torch.arange(1, batch.numel() + 1).view_as(batch)).sum()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def run(name: str, devices: int, out_dir: str) -> None:
    make_strategy, kwargs = CASES[name]
    L.seed_everything(42, verbose=False)
    model = LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=4)
    # The global batch is the same in every case: 4 samples per step.
    dp = {"single": 1, "tp2": 1, "tp2_sp": 1}.get(name, 2)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=4 // dp, vocab_size=64, val_fraction=0.2, seed=3)
    record = Record()
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, devices=devices, strategy=make_strategy(), max_steps=4, callbacks=[record],
        **kwargs,
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    mesh = getattr(trainer.strategy, "device_mesh", None)  # (ZeRO-3 unshards at the end of fit)
    if mesh is not None:
        from lightning_zero.tp import gather_tp_state_dict

        params = gather_tp_state_dict(model.model, mesh["tp"].get_group())
    else:
        params = model.model.state_dict()
    torch.save(
        {
            "losses": record.losses,
            "batches": record.batches,
            "params": {k: v.float() for k, v in params.items()},
            "sent": dict(getattr(trainer.strategy, "comm_counter", None).bytes) if name != "single" else {},
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out, devices = sys.argv[1], int(sys.argv[2])
    for case in sys.argv[3:]:
        run(case, devices, out)
