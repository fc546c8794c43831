"""Run Lightning's ddp and ZeroStrategy variants on 2 CPU processes; each rank writes its results.

Usage: python tests/scripts/parity.py OUT_DIR [CASE ...]
Launched by tests/test_strategy_parity.py; Lightning's launcher re-runs this script for rank 1.
Each case writes OUT_DIR/<case>.rank<r>.pt with the per-step losses and the final parameters.
"""

import os
import sys

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers zero1/zero2/zero3)
from lightning_zero import ZeroStrategy  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402


class TinyLM(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(32, 16), nn.Flatten(), nn.Linear(64, 48), nn.GELU(), nn.LayerNorm(48), nn.Linear(48, 32)
        )
        self.losses: list[float] = []
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}],
            lr=1e-2,
            betas=(0.9, 0.95),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TwoOptimizers(L.LightningModule):
    """GAN-style manual optimization: two optimizers over disjoint parameters, both stepped after
    one backward (the second steps before any forward), a parameter of the LightningModule itself
    read directly (no module forward covers it), and a validation loop between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(64, 48), nn.GELU())
        self.head = nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 32))
        self.scale = nn.Parameter(torch.ones(32))
        self.automatic_optimization = False
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.encoder(x)) * self.scale, y)

    def training_step(self, batch, batch_idx):
        opt_encoder, opt_head = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        opt_encoder.step()
        opt_head.step()  # the second optimizer steps while the first one's gathers may be in flight
        opt_encoder.zero_grad()
        opt_head.zero_grad()
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        encoder = torch.optim.AdamW(self.encoder.parameters(), lr=1e-2)
        head = torch.optim.SGD([*self.head.parameters(), self.scale], lr=5e-2, momentum=0.9)
        return encoder, head


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 32, (96, 4), generator=gen)
    y = (x.sum(1) * 7) % 32
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


# name -> (strategy factory, trainer kwargs)
ACC = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
CASES = {
    "ddp": (lambda: "ddp", {}),
    "zero1": (lambda: ZeroStrategy(stage=1), {}),
    "zero2": (lambda: "zero2", {}),
    "zero1_small": (lambda: ZeroStrategy(stage=1, bucket_mb=0.004), {}),
    "zero2_small": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), {}),
    "zero2_small_no_overlap": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004, overlap_comm=False), {}),
    "ddp_acc": (lambda: "ddp", ACC),
    "zero1_acc": (lambda: ZeroStrategy(stage=1, bucket_mb=0.004), ACC),
    "zero2_acc": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), ACC),
    "zero2_acc_defer": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004, defer_grad_reduce=True), ACC),
    "ddp_value_clip": (lambda: "ddp", {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "zero2_value_clip": (lambda: "zero2", {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "zero3": (lambda: ZeroStrategy(stage=3, bucket_mb=0.004), {}),
    "zero3_acc": (lambda: ZeroStrategy(stage=3, bucket_mb=0.004, prefetch_blocks=2), ACC),
    "zero3_acc_defer": (lambda: ZeroStrategy(stage=3, bucket_mb=0.004, defer_grad_reduce=True), ACC),
    # bf16-true under accumulation: ddp sums the micro batches' bf16 gradients locally and reduces once
    # (no clipping: torch's clip_grad_norm_ rounds each bf16 norm, docs/precision.md)
    "ddp_bf16t_acc": (lambda: "ddp", {"precision": "bf16-true", "accumulate_grad_batches": 2}),
    "zero3_bf16t_acc_defer": (
        lambda: ZeroStrategy(stage=3, bucket_mb=0.004, defer_grad_reduce=True),
        {"precision": "bf16-true", "accumulate_grad_batches": 2},
    ),
    "zero3_value_clip": (lambda: "zero3", {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "zero2_offload": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004, offload_optimizer=True), {}),
    "zero3_offload_acc": (lambda: ZeroStrategy(stage=3, offload_optimizer=True), ACC),
    "ddp_bf16": (lambda: "ddp", {"precision": "bf16-mixed"}),
    "zero1_bf16": (lambda: ZeroStrategy(stage=1, bucket_mb=0.004), {"precision": "bf16-mixed"}),
    "zero2_bf16": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), {"precision": "bf16-mixed"}),
    "zero3_bf16": (lambda: ZeroStrategy(stage=3, bucket_mb=0.004), {"precision": "bf16-mixed"}),
    "zero2_bf16_fp32_reduce": (
        lambda: ZeroStrategy(stage=2, bucket_mb=0.004, reduce_dtype="fp32"),
        {"precision": "bf16-mixed", **ACC},
    ),
    "ddp_bf16_acc": (lambda: "ddp", {"precision": "bf16-mixed", **ACC}),
    "ddp_manual": (lambda: "ddp", {"manual": True}),
    "zero2_manual": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), {"manual": True}),
    # [Note: overlapped parameter gather]: the default (overlap on) is in every case above; these
    # turn it off, and count the offload copies under accumulation.
    "zero2_acc_gather_sync": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004, overlap_param_gather=False), ACC),
    "zero2_offload_acc": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004, offload_optimizer=True), ACC),
    # a callback reading the weights between steps (EMA): the barrier makes them whole first
    "ddp_ema": (lambda: "ddp", {"ema": True}),
    "zero2_ema": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), {"ema": True}),
    "ddp_two_opt": (lambda: "ddp", {"two_optimizers": True}),
    "zero2_two_opt": (lambda: ZeroStrategy(stage=2, bucket_mb=0.004), {"two_optimizers": True}),
}

# Both optimizers count in global_step: 12 steps = 6 batches; validation after batches 3 and 6.
TWO_OPT = {"max_steps": 12, "val_check_interval": 3, "limit_val_batches": 2}


class EngineStats(L.Callback):
    """What the engine did about the parameter all-gather and offload, read before teardown."""

    reads_parameters_between_steps = False  # metrics only ([Note: parameter reads between steps])

    def __init__(self) -> None:
        self.stats: dict = {"pending_after_step": [], "optimizer_steps": 0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.stats["pending_after_step"].append(engine.pending_param_gathers())

    def on_train_end(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        self.stats.update(
            waits=engine.param_gather_waits(),
            offload=engine.offload_copy_counts(),
            chunks=engine.bucket_count(),
            optimizer_steps=trainer.global_step,
        )


class WeightEMA(L.Callback):
    """An exponential moving average of the weights, updated after every training batch (as EMA
    callbacks do): reads every parameter between the optimizer step and the next forward."""

    def __init__(self, decay: float = 0.5) -> None:
        self.decay, self.ema = decay, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for name, param in pl_module.named_parameters():
            value = param.detach().float()
            old = self.ema.get(name)
            self.ema[name] = value.clone() if old is None else old * self.decay + value * (1 - self.decay)


class RecordLosses(L.Callback):
    reads_parameters_between_steps = False  # metrics only ([Note: parameter reads between steps])

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class RecordGradDtypes(L.Callback):
    """The dtypes of the engine's reduced gradient chunks (``reduce_dtype``), while it trains."""

    reads_parameters_between_steps = False  # metrics only ([Note: parameter reads between steps])

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.dtypes = sorted({str(bucket.grad_chunk.dtype) for bucket in engine.reducer.buckets})


def run_llama(name: str, out_dir: str) -> None:
    """A tiny Llama (blocks, embeddings, head: real ZeRO-3 units), then validate and predict."""
    from lightning_zero.data import TokenDataModule
    from lightning_zero.models import LlamaLM

    make_strategy, kwargs = LLAMA_CASES[name]
    kwargs = dict(kwargs)
    checkpointing = kwargs.pop("activation_checkpointing", False)
    L.seed_everything(42, verbose=False)
    config = dict(name="tiny", vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    model = LlamaLM(config, lr=1e-2, warmup_steps=1, max_steps=4, activation_checkpointing=checkpointing)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=2, vocab_size=64, val_fraction=0.2, seed=3)
    record = RecordLosses()
    trainer = script_trainer(
        devices=2, strategy=make_strategy(), max_steps=4, limit_val_batches=2, callbacks=[record], **kwargs
    )
    trainer.fit(model, data)
    val = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5))
    predicted = torch.cat(trainer.predict(model, DataLoader(tokens, batch_size=2)))  # sharded predict
    with torch.no_grad():
        outside = model.model(tokens)  # a forward outside the Trainer, after fit
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    torch.save(
        {"losses": record.losses, "params": params, "val_loss": float(val), "predict": predicted, "outside": outside},
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


LLAMA_CASES = {
    "llama_ddp": (lambda: "ddp", {}),
    "llama_zero3": (lambda: ZeroStrategy(stage=3, bucket_mb=0.01), {}),
    "llama_zero3_p0_acc": (
        lambda: ZeroStrategy(stage=3, prefetch_blocks=0),
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
    ),
    "llama_ddp_acc": (lambda: "ddp", {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    "llama_ddp_ckpt": (lambda: "ddp", {"activation_checkpointing": True}),
    "llama_zero3_ckpt": (lambda: ZeroStrategy(stage=3, prefetch_blocks=2), {"activation_checkpointing": True}),
}


def run(name: str, out_dir: str) -> None:
    if name in LLAMA_CASES:
        run_llama(name, out_dir)
        return
    make_strategy, kwargs = CASES[name]
    kwargs = dict(kwargs)
    manual = kwargs.pop("manual", False)
    two_optimizers = kwargs.pop("two_optimizers", False)
    ema = WeightEMA() if kwargs.pop("ema", False) else None
    L.seed_everything(42, verbose=False)
    model = TwoOptimizers() if two_optimizers else TinyLM(manual=manual)
    stats = EngineStats()
    kwargs = {"max_steps": 6, **(TWO_OPT if two_optimizers else {}), **kwargs}
    grad_dtypes = RecordGradDtypes()
    trainer = script_trainer(
        devices=2,
        strategy=make_strategy(),
        callbacks=[stats, grad_dtypes, *([ema] if ema is not None else [])],
        limit_val_batches=1.0,
        **kwargs,
    )
    trainer.fit(model, data(), *([data()] if two_optimizers else []))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    strategy = trainer.strategy
    extra = {"stats": stats.stats}
    if ema is not None:
        extra["ema"] = ema.ema
    if two_optimizers:
        extra["val_losses"] = model.val_losses
    if isinstance(strategy, ZeroStrategy) and model.losses:
        extra["lr"] = [g["lr"] for g in trainer.optimizers[0].param_groups]
        extra["grad_chunk_dtypes"] = grad_dtypes.dtypes
    torch.save(
        {"losses": model.losses, "params": params, **extra},
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out = sys.argv[1]
    names = sys.argv[2:] or [*CASES, *LLAMA_CASES]
    for case in names:
        run(case, out)
