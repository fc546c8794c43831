"""Lightning + ZeroStrategy checkpoint cases on CPU gloo ranks; each rank writes its results.

Usage: python tests/scripts/ckpt_train.py OUT_DIR DEVICES CASE [CASE ...]
Launched by tests/test_checkpoint_lightning.py (Lightning's launcher re-runs it for the other
ranks). Cases:
  full<s>          stage s, 8 steps uninterrupted; ModelCheckpoint every 3 steps + last
  resume<s>        stage s from full<s>'s step-3 checkpoint to step 8
  last<s>          stage s from full<s>'s ckpt_path="last" (step 6) to step 8
  from<s>to<t>     stage t at DEVICES ranks from full<s>'s step-3 checkpoint, 1 step
  kill<s>          stage s like full<s> (checkpoints in ckpts/kill), but rank 1 SIGKILLs itself after
                   step 5; rank 0 must fail within the 30 s process-group timeout (tests/test_checkpoint_faults.py)
  after<s>         stage s from ckpts/kill's ckpt_path="last" (what kill<s> left) to step 8
  dropfull<s>, dropresume<s>
                   full<s> / resume<s> with LayerDrop drawn per rank and step (issue 20): the ranks
                   run different blocks, and in some steps a block runs on no rank
Each writes OUT_DIR/<case>.d<DEVICES>.rank<r>.pt: per-step losses, a global-RNG draw per step, first batch.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models.llama import LlamaLM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

CONFIG = dict(name="ckpt", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


class Recorder(LlamaLM):
    def __init__(self) -> None:
        super().__init__(CONFIG, lr=1e-2, warmup_steps=2, max_steps=8)
        self.record = {"losses": [], "draws": [], "first_batch": None}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.record["first_batch"] is None:
            self.record["first_batch"] = batch.clone()
        self.record["losses"].append(loss.item())
        self.record["draws"].append(torch.rand(1).item())  # the global RNG continues exactly too
        return loss


class DropRecorder(Recorder):
    """Each block skipped with probability 0.5 in a training step, drawn per rank and step (not
    from the global RNG): the ranks run different blocks; the blocks run are recorded per step."""

    def configure_model(self) -> None:
        super().configure_model()
        llama = self.model
        self.record["ran"] = []

        def forward(idx: torch.Tensor) -> torch.Tensor:
            h = llama.tok_embeddings(idx)
            cos, sin = llama.rope(idx.size(1))
            draw = torch.rand(len(llama.layers), generator=torch.Generator().manual_seed(
                1000 * self.global_rank + self.trainer.global_step))  # fmt: skip
            ran = [i for i in range(len(llama.layers)) if not (self.training and draw[i] < 0.5)]
            if self.training:
                self.record["ran"].append(ran)
            for index in ran:
                h = llama.layers[index](h, cos, sin)
            return llama.output(llama.norm(h))

        llama.forward = forward


class KillRank1(L.Callback):
    """SIGKILL rank 1 at the end of training step ``step`` (no cleanup, no goodbye to its peers)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker  # marker: file that gets the wall-clock time of the kill

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            with open(self.marker, "w") as handle:
                handle.write(repr(time.time()))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def data() -> TokenDataModule:
    # 24 windows of 8 tokens: 6 batches of 2 per rank per epoch at dp 2, so step 3 is mid-epoch
    return TokenDataModule("synthetic", seq_len=8, batch_size=2, vocab_size=64, val_fraction=0.0, synthetic_tokens=200)


def run(case: str, out: str, devices: int) -> None:
    kind = case.rstrip("0123456789")
    drop = kind.startswith("drop")
    kind = kind.removeprefix("drop")
    if drop:
        ckpt_dir = os.path.join(out, "ckpts", f"drop{case[-1]}")
    elif kind in ("kill", "after"):
        ckpt_dir = os.path.join(out, "ckpts", "kill")
    else:
        ckpt_dir = os.path.join(out, "ckpts", case[-1] if kind in ("full", "resume", "last") else case[4])
    stage = int(case[-1])
    max_steps, ckpt_path, callbacks, timeout = 8, None, [], timedelta(seconds=60)
    if kind in ("full", "kill"):
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, save_last=True)]
        if kind == "kill":
            callbacks.append(KillRank1(5, os.path.join(out, "killed_at")))
            timeout = timedelta(seconds=30)
    elif kind == "resume":
        ckpt_path = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
    elif kind in ("last", "after"):
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=True)]
        ckpt_path = "last"
    else:
        ckpt_path = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
        max_steps = 4
    L.seed_everything(7, verbose=False)
    model = DropRecorder() if drop else Recorder()
    trainer = script_trainer(
        devices=devices,
        max_steps=max_steps,
        strategy=ZeroStrategy(stage=stage, bucket_mb=0.01, timeout=timeout),
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        limit_val_batches=1.0,
    )
    trainer.fit(model, datamodule=data(), ckpt_path=ckpt_path)
    torch.save(model.record, os.path.join(out, f"{case}.d{devices}.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    out_dir, devices = sys.argv[1], int(sys.argv[2])
    for name in sys.argv[3:]:
        run(name, out_dir, devices)
