"""Lightning + ZeroStrategy checkpoints in object storage (launched by tests/test_object_store.py).

Usage: LZ_CKPT_URL=s3://bucket python tests/scripts/objstore_train.py OUT_DIR CASE [CASE ...]
(torchrun-style ranks; the local S3 server's address and dummy credentials come from the
environment, as s3fs reads real ones). Cases, tests/scripts/ckpt_train.py's model and data:
  full<s>       stage s, dp 2, 8 steps (stage 2; else 4); ModelCheckpoint(dirpath=<url>/s<s>, every 3 steps,
                save_last="link"); ``full2`` saves with async_checkpoint=True
  last<s>       stage s from ckpt_path="last" (resolved through the commits: step 6) to step 8
  tp<s>to<t>    stage t, tensor_parallel_size=2 (dp 1), from <url>/s<s>/epoch=0-step=3.ckpt, 1 step
Each writes OUT_DIR/<case>.rank<r>.pt: per-step losses, a global-RNG draw per step, first batch.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.scripts.ckpt_train import Recorder, data  # noqa: E402


def run(case: str, out: str, url: str) -> None:
    kind, stage = case.rstrip("0123456789"), int(case[-1])
    max_steps, ckpt_path, callbacks, knobs = 8, None, [], {}
    if kind == "full":
        max_steps = 8 if stage == 2 else 4  # last2 resumes full2 at step 6
        directory = f"{url}/s{stage}"
        callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1, save_last="link")]
        knobs["async_checkpoint"] = stage == 2
    elif kind == "last":
        callbacks = [ModelCheckpoint(dirpath=f"{url}/s{stage}", save_top_k=0, save_last=True)]
        ckpt_path = "last"
    else:  # tp<s>to<t>
        ckpt_path, max_steps = f"{url}/s{case[2]}/epoch=0-step=3.ckpt", 4
        knobs["tensor_parallel_size"] = 2
    L.seed_everything(7, verbose=False)
    model = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps,
        strategy=ZeroStrategy(stage=stage, bucket_mb=0.01, upload_threads=3, **knobs),
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks), callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=data(), ckpt_path=ckpt_path)
    torch.save(model.record, os.path.join(out, f"{case}.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(name, sys.argv[1], os.environ["LZ_CKPT_URL"])
