"""Context parallelism x TP x ZeRO through ZeroStrategy(cp=C), for tests/test_cp_strategy.py.

Usage: python tests/scripts/cp_parity.py OUT_DIR DEVICES CASE [CASE ...]
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-step losses, the dense (TP-gathered) parameters,
a fingerprint of each batch it trained on, the bytes its strategy counted, and the shape of its
batches. Every case trains on the same global batch (2 sequences of 2048 tokens per step): ddp
with one sequence per rank, the cp runs with each sequence split over the cp ranks. The case in
SAVES writes a checkpoint at step 2 that the one in RESUMES continues to step 4 without cp.
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

SEQ = 2048
CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
# 3 query heads do not split over cp=2: ZeroStrategy(cp=2) runs ring attention ([Note: ring attention])
HEADS3 = dict(CONFIG, n_heads=3, n_kv_heads=1, dim=48)
# 6 query heads are 3 per TP rank at tp=2: they do not split over cp=2 either (ring under TP)
HEADS6 = dict(CONFIG, n_heads=6, n_kv_heads=2, dim=48)
CLIP = {"gradient_clip_val": 0.05}
STEPS = 4


def zero(stage: int, **knobs):
    return lambda: ZeroStrategy(stage=stage, bucket_mb=0.01, **knobs)


# case: (strategy, samples per dp rank, trainer kwargs)
CASES = {
    "ddp": (lambda: "ddp", 1, CLIP),
    "cp2_zero1": (zero(1, cp=2), 2, CLIP),
    "cp2_zero2": (zero(2, cp=2), 2, CLIP),
    "cp2_zero3": (zero(3, cp=2), 2, CLIP),
    "cp4_zero1": (zero(1, cp=4), 2, CLIP),
    "cp4_zero2": (zero(2, cp=4), 2, CLIP),
    "cp4_zero3": (zero(3, cp=4), 2, CLIP),
    "cp2dp2_zero2": (zero(2, cp=2), 1, CLIP),
    # heads split by tp, then by cp; the 2 kv heads are 1 per TP rank: repeated for cp=2 (ALST)
    "tp2cp2_zero1": (zero(1, cp=2, tensor_parallel_size=2), 2, CLIP),
    "tp2cp2_zero2": (zero(2, cp=2, tensor_parallel_size=2), 2, CLIP),
    "tp2cp2_zero3": (zero(3, cp=2, tensor_parallel_size=2), 2, CLIP),
    "tp2cp2_sp_zero2": (zero(2, cp=2, tensor_parallel_size=2, sequence_parallel=True), 2, CLIP),
    "ddp_heads3": (lambda: "ddp", 1, CLIP),
    "cp2_zero2_heads3": (zero(2, cp=2), 2, CLIP),
    "cp2_zero3_heads3": (zero(3, cp=2), 2, CLIP),
    "ddp_heads6": (lambda: "ddp", 1, CLIP),
    "tp2cp2_zero2_heads6": (zero(2, cp=2, tensor_parallel_size=2), 2, CLIP),
    "tp2cp2_sp_zero3_heads6": (zero(3, cp=2, tensor_parallel_size=2, sequence_parallel=True), 2, CLIP),
    # a step-2 checkpoint of cp2_zero2 resumed without cp (ZeRO over the same 2 ranks, dp=2)
    "resume_cp2_ckpt_cp1": (zero(2), 1, CLIP),
}
SAVES = {"cp2_zero2": "cp2"}
RESUMES = {"resume_cp2_ckpt_cp1": "cp2"}


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[int] = []
        self.shapes: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(int((batch * torch.arange(1, batch.numel() + 1).view_as(batch)).sum()))
        self.shapes.append(tuple(batch.shape))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def run(name: str, devices: int, out_dir: str) -> None:
    make_strategy, per_dp_rank, kwargs = CASES[name]
    L.seed_everything(42, verbose=False)
    config = {"heads3": HEADS3, "heads6": HEADS6}.get(name.rsplit("_", 1)[-1], CONFIG)
    model = LlamaLM(config, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    data = TokenDataModule(
        source="synthetic", seq_len=SEQ, batch_size=per_dp_rank, vocab_size=64, val_fraction=0.0, seed=3,
        synthetic_tokens=16 * SEQ + 1,
    )  # fmt: skip
    record = Record()
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, devices=devices, strategy=make_strategy(), max_steps=STEPS, callbacks=[record],
        **kwargs,
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    mesh = getattr(trainer.strategy, "device_mesh", None)  # (ZeRO-3 unshards at the end of fit)
    if mesh is not None and mesh["tp"].size() > 1:
        from lightning_zero.tp import gather_tp_state_dict

        params = gather_tp_state_dict(model.model, mesh["tp"].get_group())
    else:
        params = model.model.state_dict()
    counter = getattr(trainer.strategy, "comm_counter", None)
    torch.save(
        {
            "losses": record.losses,
            "batches": record.batches,
            "shapes": record.shapes,
            "params": {k: v.float() for k, v in params.items()},
            "sent": dict(counter.bytes) if counter is not None else {},
            "calls": dict(counter.calls) if counter is not None else {},
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out, devices = sys.argv[1], int(sys.argv[2])
    for case in sys.argv[3:]:
        run(case, devices, out)
