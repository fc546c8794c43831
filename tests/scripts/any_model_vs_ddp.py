"""Models nobody on this project wrote, under ZeroStrategy stages 1-2 (and stage 3 for Adafactor)
and Lightning's ddp (2 CPU ranks).

Usage: python tests/scripts/any_model_vs_ddp.py OUT_DIR [CASE ...]
Launched by tests/test_any_model_vs_ddp.py; Lightning's launcher re-runs this script for rank 1.
Each case writes OUT_DIR/<case>.rank<r>.pt: per-step losses, final parameters, a plain forward
after fit, and (zero cases) the number of gradient reduce-scatters per step and per bucket.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

STEPS = 4


class LoRABlock(nn.Module):
    """A frozen int8 base weight (with a frozen fp32 scale) plus a trainable low-rank adapter."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        weight = torch.randn(dim, dim) / dim**0.5
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        self.base_q = nn.Parameter(torch.round(weight / scale).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        base = F.linear(h, self.base_q.to(h.dtype) * self.scale.to(h.dtype))
        return torch.tanh(base + self.lora_b(self.lora_a(h)))


def build(kind: str) -> nn.ModuleDict:
    if kind in ("mlp", "unused"):
        return nn.ModuleDict(
            {"net": nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))}
        )
    if kind == "lora":
        return nn.ModuleDict(
            {
                "inp": nn.Linear(8, 32),
                "blocks": nn.ModuleList([LoRABlock(32) for _ in range(3)]),
                "head": nn.Linear(32, 4),
            }
        )
    if kind == "gan":
        return nn.ModuleDict(
            {
                "gen": nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8)),
                "disc": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
            }
        )
    if kind == "bn":
        return nn.ModuleDict(
            {
                "net": nn.Sequential(
                    nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
                )
            }
        )  # fmt: skip
    if kind == "late":  # the layer used first in forward is registered last
        return nn.ModuleDict(
            {
                "body": nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh()),
                "head": nn.Linear(32, 4),
                "stem": nn.Linear(8, 32),
            }
        )
    raise KeyError(kind)


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=5e-2, initial_accumulator_value=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    # not element-wise (factored second moments of 2-D weights): replicated full-master step
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=5e-2, weight_decay=1e-3),
}


class AnyModel(L.LightningModule):
    def __init__(self, kind: str, optimizer: str = "adamw", ckpt: str = "", reference: bool = False) -> None:
        super().__init__()
        self.kind, self.optimizer_name, self.ckpt, self.reference = kind, optimizer, ckpt, reference
        self.m = build(kind)
        self.losses: list[float] = []
        self.automatic_optimization = kind != "gan"

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        if self.kind == "lora":
            h = m["inp"](x)
            for block in m["blocks"]:
                if self.ckpt:
                    h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
                else:
                    h = block(h)
            return m["head"](h)
        if self.kind == "late":
            return m["head"](m["body"](m["stem"](x)))
        return m["net"](x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "gan":
            return self._gan_step(x)
        loss = F.cross_entropy(self.logits(x), y)
        if self.kind == "unused" and self.global_rank == 1:
            loss = self._unused_loss(x, y, loss, batch_idx)
        self.losses.append(loss.item())
        return loss

    def _unused_loss(self, x, y, full, batch_idx):
        """Rank 1: odd steps reach no parameter at all, even steps only the first layer.

        The ddp reference reaches every parameter with zero weight: the same gradients."""
        if batch_idx % 2 == 1:
            leaf = torch.zeros((), requires_grad=True)
            return leaf * 1.0 + (0.0 * full if self.reference else 0.0)
        partial = self.m["net"][0](x).pow(2).mean()
        return partial + 0.0 * full if self.reference else partial

    def _gan_step(self, x):
        """Generator loss reaches the discriminator too; opt_d.zero_grad() must leave G's grads."""
        opt_g, opt_d = self.optimizers()
        gen, disc = self.m["gen"], self.m["disc"]
        fake = gen(x[:, :4])
        loss_g = F.softplus(-disc(fake)).mean()
        self.manual_backward(loss_g)
        opt_d.zero_grad()
        loss_d = F.softplus(-disc(x)).mean() + F.softplus(disc(fake.detach())).mean()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_g.step()
        opt_g.zero_grad()
        self.losses.append(loss_g.item() + loss_d.item())

    def configure_optimizers(self):
        if self.kind == "gan":
            return [
                torch.optim.Adam(self.m["gen"].parameters(), lr=1e-2),
                torch.optim.SGD(self.m["disc"].parameters(), lr=5e-2, momentum=0.9),
            ]
        return OPTIMIZERS[self.optimizer_name](self.parameters())

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gan":
            return self.m["disc"](self.m["gen"](x[:, :4]))
        return self.logits(x)


def data(kind: str):
    gen = torch.Generator().manual_seed(7)
    n = 4 * 2 * STEPS
    x = torch.randn(n, 3, 6, 6, generator=gen) if kind == "bn" else torch.randn(n, 8, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    return x, y


class CountReduceScatters(L.Callback):
    """Gradient reduce-scatters issued per step, and how many buckets the engine has."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.num_buckets = 0
        self.train_dtypes: dict[str, str] = {}  # parameter and buffer dtypes during training
        self._seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_dtypes = {n: str(t.dtype) for n, t in [*pl_module.named_parameters(), *pl_module.named_buffers()]}
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return
        calls = strategy.comm_counter.calls.get("reduce_scatter_grads", 0)
        self.per_step.append(calls - self._seen)
        self._seen = calls
        self.num_buckets = len(strategy.engine.reducer.buckets)


def zero(stage: int, **kwargs):
    return lambda: ZeroStrategy(stage=stage, bucket_mb=kwargs.pop("bucket_mb", 0.0006), **kwargs)


# name -> (strategy factory, model kwargs, trainer kwargs)
BF16 = {"precision": "bf16-mixed"}
CLIP = {"gradient_clip_val": 0.1}  # small enough to clip every step
ACCUM = {"accumulate_grad_batches": 2}
CASES = {
    "ddp_mlp_adagrad": (lambda: "ddp", dict(kind="mlp", optimizer="adagrad"), {}),
    "zero1_mlp_adagrad": (zero(1), dict(kind="mlp", optimizer="adagrad"), {}),
    "zero2_mlp_adagrad": (zero(2), dict(kind="mlp", optimizer="adagrad"), {}),
    "ddp_mlp_sgd_momentum": (lambda: "ddp", dict(kind="mlp", optimizer="sgd_momentum"), {}),
    "zero2_mlp_sgd_momentum": (zero(2), dict(kind="mlp", optimizer="sgd_momentum"), {}),
    "ddp_mlp_rmsprop": (lambda: "ddp", dict(kind="mlp", optimizer="rmsprop"), {}),
    "zero2_mlp_rmsprop": (zero(2), dict(kind="mlp", optimizer="rmsprop"), {}),
    "ddp_mlp_adam_fused": (lambda: "ddp", dict(kind="mlp", optimizer="adam_fused"), {}),
    "zero1_mlp_adam_fused": (zero(1), dict(kind="mlp", optimizer="adam_fused"), {}),
    "ddp_unused": (lambda: "ddp", dict(kind="unused", reference=True), {}),
    "zero1_unused": (zero(1), dict(kind="unused"), {}),
    "zero2_unused": (zero(2), dict(kind="unused"), {}),
    "ddp_gan": (lambda: "ddp_find_unused_parameters_true", dict(kind="gan"), {}),
    "zero1_gan": (zero(1), dict(kind="gan"), {}),
    "zero2_gan": (zero(2), dict(kind="gan"), {}),
    "ddp_lora": (lambda: "ddp", dict(kind="lora"), {}),
    "zero1_lora_reentrant": (zero(1), dict(kind="lora", ckpt="reentrant"), {}),
    "zero2_lora_reentrant": (zero(2), dict(kind="lora", ckpt="reentrant"), {}),
    "zero2_lora_nonreentrant": (zero(2), dict(kind="lora", ckpt="nonreentrant"), {}),
    "zero1_lora_bf16": (zero(1), dict(kind="lora"), BF16),
    "zero2_lora_reentrant_bf16": (zero(2), dict(kind="lora", ckpt="reentrant"), BF16),
    "ddp_bn": (lambda: "ddp", dict(kind="bn"), {}),
    "zero1_bn": (zero(1), dict(kind="bn"), {}),
    "zero2_bn": (zero(2), dict(kind="bn"), {}),
    "ddp_bn_bf16": (lambda: "ddp", dict(kind="bn"), BF16),
    "zero1_bn_bf16": (zero(1), dict(kind="bn"), BF16),
    "zero2_bn_bf16": (zero(2), dict(kind="bn"), BF16),
    "ddp_mlp_adafactor": (lambda: "ddp", dict(kind="mlp", optimizer="adafactor"), CLIP),
    "zero1_mlp_adafactor": (zero(1), dict(kind="mlp", optimizer="adafactor"), CLIP),
    "zero2_mlp_adafactor": (zero(2), dict(kind="mlp", optimizer="adafactor"), CLIP),
    "zero1_mlp_adafactor_bf16": (zero(1), dict(kind="mlp", optimizer="adafactor"), {**BF16, **CLIP}),
    "zero2_mlp_adafactor_bf16": (zero(2), dict(kind="mlp", optimizer="adafactor"), {**BF16, **CLIP}),
    # stage 3: full fp32 masters gathered and stepped one unit (here: one Linear) at a time
    "zero3_mlp_adafactor": (zero(3), dict(kind="mlp", optimizer="adafactor"), CLIP),
    "ddp_mlp_adafactor_accum": (lambda: "ddp", dict(kind="mlp", optimizer="adafactor"), {**CLIP, **ACCUM}),
    "zero3_mlp_adafactor_accum": (zero(3), dict(kind="mlp", optimizer="adafactor"), {**CLIP, **ACCUM}),
    "ddp_late": (lambda: "ddp", dict(kind="late"), {}),
    "zero2_late": (zero(2), dict(kind="late"), {}),
}


def run(name: str, out_dir: str) -> None:
    make_strategy, model_kwargs, trainer_kwargs = CASES[name]
    L.seed_everything(42, verbose=False)
    model = AnyModel(**model_kwargs)
    x, y = data(model.kind)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    counter = CountReduceScatters()
    trainer = script_trainer(
        devices=2,
        strategy=make_strategy(),
        max_steps=STEPS,
        callbacks=[counter],
        limit_val_batches=1.0,
        **trainer_kwargs,
    )
    strategy = trainer.strategy
    trainer.fit(model, loader)
    extra = {}
    if isinstance(strategy, ZeroStrategy):
        extra["reduce_scatters_per_step"] = counter.per_step
        extra["num_buckets"] = counter.num_buckets
        extra["sent_elements"] = dict(strategy.comm_counter.snapshot()["elements"])
    model.eval()
    with torch.no_grad():
        outside = model.plain_forward(x[:8]).float()  # a plain forward after fit, outside the Trainer
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
    buffers = {n: b.detach().float().clone() for n, b in model.named_buffers()}
    dtypes.update({n: str(b.dtype) for n, b in model.named_buffers()})
    torch.save(
        {
            "losses": model.losses,
            "params": params,
            "dtypes": dtypes,
            "train_dtypes": counter.train_dtypes,
            "buffers": buffers,
            "outside": outside,
            **extra,
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out = sys.argv[1]
    for case in sys.argv[2:] or list(CASES):
        run(case, out)
