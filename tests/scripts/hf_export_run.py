"""No-gather Hugging Face export and the dense families under TP=2 x ZeRO-2, on 4 CPU gloo ranks.

Usage: python tests/scripts/hf_export_run.py OUT_DIR NAME=HF_DIR [...]
Launched by tests/test_hf_families.py (4 ranks, torchrun-style). For each NAME (a family: llama,
qwen3, qwen2, mistral) LlamaLM(init_from=HF_DIR) fine-tunes 3 steps under ZeroStrategy(stage=2,
tensor_parallel_size=2) (dp=2), saves OUT_DIR/NAME.ckpt, then every rank calls
``strategy.save_hf_pretrained`` into OUT_DIR/NAME-hf (small shards, so the files split tensors
between ranks' pieces). Each rank writes
OUT_DIR/NAME.rank<r>.pt: losses, batches and the export's wall time. With ``LZ_HF_URL`` set (an
``s3://`` bucket on the tests' moto server, reached through the ``AWS_*`` environment) the llama
run also exports to ``LZ_HF_URL/llama-hf`` (multipart uploads, each part by its owner rank). ``fabric-NAME=HF_DIR``:
through the Fabric door instead, ZeRO-3 over dp=4 (Fabric has no TP yet): Llama.from_pretrained,
fabric.setup, then fabric.strategy.save_hf_pretrained into OUT_DIR/fabric-NAME-hf, no step.
``moe-NAME=HF_DIR``: MoELM(init_from=HF_DIR) (Mixtral / Qwen3-MoE) under ZeRO-2 with ep=2 (each
rank holds half the experts), exported at on_train_start (the pretrained weights) into
OUT_DIR/moe-NAME-hf, then one step.
"""

import os
import sys
import time
from datetime import timedelta

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import lightning_zero  # noqa: E402,F401
from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models.llama import LlamaLM  # noqa: E402

SHARD = "40KB"  # tiny models (~90K parameters): several files, tensors cut by ZeRO ranges


class Recorder(LlamaLM):
    def __init__(self, out: str, name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record = {"losses": [], "batches": []}
        self.export_dir = os.path.join(out, f"{name}-hf")

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.record["batches"].append(batch.clone())
        self.record["losses"].append(loss.item())
        return loss

    def on_train_end(self) -> None:
        self.trainer.save_checkpoint(self.export_dir.removesuffix("-hf") + ".ckpt")  # for the offline export
        start = time.perf_counter()
        self.trainer.strategy.save_hf_pretrained(self.export_dir, max_shard_size=SHARD)
        self.record["export_s"] = time.perf_counter() - start
        url = os.environ.get("LZ_HF_URL")
        if url and os.path.basename(self.export_dir) == "llama-hf":
            start = time.perf_counter()
            self.trainer.strategy.save_hf_pretrained(f"{url}/llama-hf", max_shard_size=SHARD)
            self.record["url_export_s"] = time.perf_counter() - start


def moe_recorder(out: str, name: str, **kwargs):
    from lightning_zero.models.moe import MoELM

    class MoERecorder(MoELM):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.record: dict = {}

        def on_train_start(self) -> None:  # the pretrained weights, before any step
            start = time.perf_counter()
            self.trainer.strategy.save_hf_pretrained(os.path.join(out, f"{name}-hf"), max_shard_size=SHARD)
            self.record["export_s"] = time.perf_counter() - start

    return MoERecorder(**kwargs)


def run(name: str, hf_dir: str, out: str) -> None:
    L.seed_everything(7, verbose=False)
    if name.startswith("moe-"):
        model = moe_recorder(out, name, init_from=hf_dir, lr=1e-3, warmup_steps=1, max_steps=4)
        strategy = ZeroStrategy(stage=2, ep=2, bucket_mb=0.05, timeout=timedelta(seconds=120))
    else:
        model = Recorder(out, name, init_from=hf_dir, lr=1e-3, warmup_steps=1, max_steps=4)
        strategy = ZeroStrategy(stage=2, tensor_parallel_size=2, bucket_mb=0.05, timeout=timedelta(seconds=120))
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=1 if name.startswith("moe-") else 3, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
    )  # fmt: skip
    data = TokenDataModule("synthetic", seq_len=16, batch_size=2, vocab_size=model.config.vocab_size,
                           val_fraction=0.0, synthetic_tokens=2000)  # fmt: skip
    trainer.fit(model, datamodule=data)
    torch.save(model.record, os.path.join(out, f"{name}.rank{trainer.global_rank}.pt"))


def run_fabric(case: str, hf_dir: str, out: str) -> None:
    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.models import Llama

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=ZeroFabricStrategy(stage=3, bucket_mb=0.05))
    fabric.launch()
    model = fabric.setup(Llama.from_pretrained(hf_dir))
    start = time.perf_counter()
    fabric.strategy.save_hf_pretrained(os.path.join(out, f"{case}-hf"), max_shard_size=SHARD)
    record = {"export_s": time.perf_counter() - start}
    torch.save(record, os.path.join(out, f"{case}.rank{fabric.global_rank}.pt"))
    del model


if __name__ == "__main__":
    out_dir = sys.argv[1]
    for arg in sys.argv[2:]:
        case, _, directory = arg.partition("=")
        (run_fabric if case.startswith("fabric-") else run)(case, directory, out_dir)
