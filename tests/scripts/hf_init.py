"""Pretrained (Hugging Face) init and strict resume on 2 CPU gloo ranks; each rank writes its results.

Usage: python tests/scripts/hf_init.py OUT_DIR HF_DIR CASE[=OTHER_HF_DIR] [...]
Launched by tests/test_hf.py (Lightning's launcher re-runs it for rank 1). Cases:
  first-zero1 / first-zero2 / first-zero3 / first-tp2z2 / first-tp2z3
               LlamaLM(init_from=HF_DIR) under that layout (tp2z<s>: tp=2, ZeRO-s over dp=1),
               1 step: first loss and batch per rank
  mem-zero3    LlamaLM(init_from=HF_DIR) under ZeRO-3: peak RSS from setup() to the last unit's
               load and to on_fit_start (model build + sharded load), what the engine keeps
  memrandom-zero3
               the same measurement for the same shape with random init (the baseline)
  tune-zero2   fine-tune HF_DIR for 3 steps under ZeRO-2, save OUT_DIR/tune/last.ckpt
  tied-ddp / tied-zero1 / tied-zero2 / tied-zero3 / tied-tp2z3
               fine-tune HF_DIR (a tied Llama 3.2-style checkpoint: pass tied-...=DIR) for 3 steps
               under Lightning's ddp or that layout: losses and batches per step, whether the head is
               still the embedding Parameter; tied-zero3 saves OUT_DIR/tied-zero3/last.ckpt
  qwen3-ddp / qwen2-ddp / mistral-ddp
               fine-tune DIR (pass qwen3-ddp=DIR) for 3 steps under Lightning's ddp: losses and batches
               per step (tests/test_hf_families.py compares them with TP=2 x ZeRO-2 on 4 ranks)
  deep-zero2   a random 2-layer model, 1 step, save OUT_DIR/deep/last.ckpt
  shallow-zero2
               a 1-layer model resuming from deep/last.ckpt: must fail strictly on every rank;
               writes the error and whether the masters changed
Each writes OUT_DIR/<case>.rank<r>.pt. Buckets: $HF_INIT_BUCKET_MB MiB (default 0.05).
"""

import os
import resource
import sys
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

FAMILIES = ("qwen3", "qwen2", "mistral")  # <family>-ddp=DIR: tests/test_hf_families.py's ddp reference
RANDOM = dict(name="strict", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Recorder(LlamaLM):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record = {"losses": [], "first_batch": None, "batches": []}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.record["first_batch"] is None:
            self.record["first_batch"] = batch.clone()
        self.record["batches"].append(batch.clone())
        self.record["losses"].append(loss.item())
        return loss

    def on_train_end(self) -> None:
        model = self.model
        self.record["tied"] = model.output.weight is model.tok_embeddings.weight
        engine = getattr(self.trainer.strategy, "engine", None)
        self.record["engine_params"] = engine.num_params() if engine is not None else None


class LoadMemory(L.Callback):
    """Peak RSS between ``setup`` (before configure_model) and ``on_fit_start`` (after the strategy
    built and sharded the model): what loading the pretrained weights cost this rank."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def setup(self, trainer, pl_module, stage) -> None:
        self.record["reset"] = reset_peak_rss()
        self.record["rss_before"] = rss_bytes()
        self.record["peak_before"] = peak_rss_bytes()
        self.record["peak_at_loads"] = 0  # peak RSS when each unit's weights were just read
        source = pl_module.pretrained
        if source is not None:
            load = source.load

            def measured_load(module, prefix):
                load(module, prefix)
                self.record["peak_at_loads"] = max(self.record["peak_at_loads"], peak_rss_bytes())

            source.load = measured_load

    def on_fit_start(self, trainer, pl_module) -> None:
        self.record["peak_load"] = peak_rss_bytes()
        self.record["rss_after"] = rss_bytes()
        engine = trainer.strategy.engine
        self.record["num_params"] = sum(s.numel for g in engine.groups for s in g.layout.slots)
        self.record["kept"] = engine.measured_bytes()  # params, grads, optimizer this rank now holds


class Masters(L.Callback):
    """The fp32 master ranges this rank owns, at on_fit_start (before a checkpoint is restored)."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def on_fit_start(self, trainer, pl_module) -> None:
        self.engine = trainer.strategy.engine  # kept: the strategy drops it when fit fails
        self.record["masters_before"] = masters(self.engine)


def masters(engine) -> list:
    return [owned.master[owned.chunk_lo : owned.chunk_hi].detach().clone() for owned in engine.owned_ranges()]


def run(case: str, out: str, hf_dir: str) -> None:
    kind, layout = case.split("-")  # layout: zero<s>, tp2z<s> or ddp
    stage = 0 if layout == "ddp" else int(layout[-1])
    tp = 2 if layout.startswith("tp2") else 1
    L.seed_everything(7, verbose=False)
    kwargs = dict(lr=1e-3, warmup_steps=1, max_steps=4)
    callbacks, ckpt_path, max_steps = [], None, 1
    if kind in ("first", "mem", "tune", "tied") + FAMILIES:
        model = Recorder(init_from=hf_dir, **kwargs)
    elif kind == "memrandom":  # the same shape, random init: the baseline of the load's cost
        from lightning_zero.models import LlamaConfig

        model = Recorder(config=LlamaConfig.from_hf(hf_dir), **kwargs)
    else:
        model = Recorder(config=dict(RANDOM, n_layers=1 if kind == "shallow" else 2), **kwargs)
    vocab = model.config.vocab_size
    if kind in ("mem", "memrandom"):
        callbacks.append(LoadMemory(model.record))
    checkpointing = kind in ("tune", "deep", "shallow") or case == "tied-zero3"
    if kind in ("tune", "deep", "tied") + FAMILIES:
        max_steps = 1 if kind == "deep" else 3
    if kind in ("tune", "deep") or case == "tied-zero3":
        dirpath = os.path.join(out, case if kind == "tied" else kind)
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0))
    if kind == "shallow":
        callbacks.append(watch := Masters(model.record))
        ckpt_path = os.path.join(out, "deep", "last.ckpt")
    bucket_mb = float(os.environ.get("HF_INIT_BUCKET_MB", 0.05))  # tiny: many buckets, every buffer touched
    strategy = "ddp" if layout == "ddp" else ZeroStrategy(stage=stage, tensor_parallel_size=tp, bucket_mb=bucket_mb,
                                                          timeout=timedelta(seconds=120))  # fmt: skip
    trainer = script_trainer(
        devices=2,
        max_steps=max_steps,
        strategy=strategy,
        enable_checkpointing=checkpointing,
        callbacks=callbacks,
        limit_val_batches=1.0,
    )
    data = TokenDataModule(
        "synthetic", seq_len=16, batch_size=2, vocab_size=vocab, val_fraction=0.0, synthetic_tokens=2000
    )
    if kind == "shallow":
        try:
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
            model.record["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test checks the message
            model.record["error"] = f"{type(exc).__name__}: {exc}"
        model.record["masters_after"] = masters(watch.engine)
        model.record["steps"] = trainer.global_step
    else:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    torch.save(model.record, os.path.join(out, f"{case}.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    out_dir, hf_dir = sys.argv[1], sys.argv[2]
    for arg in sys.argv[3:]:
        name, _, other_dir = arg.partition("=")
        run(name, out_dir, other_dir or hf_dir)
