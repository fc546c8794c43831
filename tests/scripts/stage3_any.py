"""Lightning cases for ZeRO-3 with any model, each run under ddp and zero3 on 2 CPU processes.

Usage: python tests/scripts/stage3_any.py OUT_DIR [CASE ...]
Launched by tests/test_stage3_anymodel.py; Lightning's launcher re-runs this script for rank 1.
Each case writes OUT_DIR/<case>.rank<r>.pt.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

torch.set_num_threads(1)

import lightning as L
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy

OUT = sys.argv[1]


def _data(n=48, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, torch.tanh(x.flip(-1)))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 8)  # beside the block list: its own unit

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class TeacherStudent(L.LightningModule):
    """A frozen teacher run under no_grad inside training_step; validation every 2 steps."""

    def __init__(self):
        super().__init__()
        self.student = Blocks()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.losses, self.val_losses = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            target = self.teacher(x)
        loss = F.mse_loss(self.student(x), y + 0.1 * target)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.mse_loss(self.student(x), y).item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)


class SampleEachBatch(L.Callback):
    """Runs the model outside the step methods, as a sampling callback does."""

    def __init__(self):
        self.samples = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            self.samples.append(float(pl_module.student(torch.ones(2, 8)).sum()))


class MLP(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, 16), nn.Linear(16, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class GAN(L.LightningModule):
    """Generator and discriminator MLPs (no repeated blocks: all in the root unit), two optimizers."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = MLP(8, 8), MLP(8, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        real, _ = batch
        z = torch.cos(real)
        opt_g, opt_d = self.optimizers()
        loss_g = -self.discriminator(self.generator(z)).mean()
        opt_g.zero_grad()
        opt_d.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        fake = self.generator(z).detach()  # the generator's updated weights
        loss_d = self.discriminator(fake).mean() - self.discriminator(real).mean()
        opt_g.zero_grad()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.losses += [loss_g.item(), loss_d.item()]

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2),
                torch.optim.SGD(self.discriminator.parameters(), lr=1e-1, momentum=0.9))  # fmt: skip


class HFLlama(L.LightningModule):
    """A transformers Llama built in configure_model (meta device under zero3: sharded init)."""

    def __init__(self):
        super().__init__()
        self.model = None
        self.losses = []

    def configure_model(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        if self.model is None:
            config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                 bos_token_id=0, eos_token_id=0)  # fmt: skip
            self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ShareInit(L.Callback):
    """zero3 writes its (sharded-init) starting weights; ddp starts from them."""

    def on_train_start(self, trainer, pl_module):
        path = os.path.join(OUT, "hf_init.pt")
        strategy = trainer.strategy
        if isinstance(strategy, ZeroStrategy):
            full = {n: torch.zeros(p.numel()) for n, p in pl_module.named_parameters()}
            for owned in strategy.engine.owned_ranges():
                full[owned.name][owned.param_lo : owned.param_hi] = owned.master.detach()[
                    owned.chunk_lo : owned.chunk_hi
                ]
            for value in full.values():
                dist.all_reduce(value)
            if trainer.global_rank == 0:
                torch.save(full, path)
            pl_module.buffers_seen = {n: b.clone() for n, b in pl_module.named_buffers()}
        else:
            full = torch.load(path)
            with torch.no_grad():
                for name, param in pl_module.named_parameters():
                    param.copy_(full[name].view(param.shape))
        trainer.strategy.barrier()


class UnevenVal(L.LightningModule):
    """Rank r gets 3 - r validation batches (no distributed sampler)."""

    def __init__(self):
        super().__init__()
        self.net = Blocks()
        self.val_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.mse_loss(self.net(x), y).item())

    def predict_step(self, batch, batch_idx):
        return self.net(batch)

    def val_dataloader(self):
        return DataLoader(_data(4 * (3 - self.global_rank), seed=9), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(strategy, **kwargs):
    defaults = dict(accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def _strategy(name):
    if name == "ddp_gan":
        return "ddp_find_unused_parameters_true"  # the detached fake leaves the generator out of loss_d
    return "ddp" if name.startswith("ddp") else ZeroStrategy(stage=3, bucket_mb=0.001)


def _save(name, trainer, **results):
    torch.save(results, os.path.join(OUT, f"{name}.rank{trainer.global_rank}.pt"))


def run(name):
    L.seed_everything(42, verbose=False)
    kind = name.split("_", 1)[1]
    if kind == "teacher":
        model, sampler = TeacherStudent(), SampleEachBatch()
        trainer = _trainer(_strategy(name), val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=1,
                           callbacks=[sampler])  # fmt: skip
        trainer.fit(model, DataLoader(_data(), batch_size=4), DataLoader(_data(16, seed=8), batch_size=4))
        with torch.no_grad():
            outside = model.student(torch.ones(2, 8))  # after fit: plain tensors again
        _save(name, trainer, losses=model.losses, val_losses=model.val_losses, samples=sampler.samples, outside=outside)
    elif kind == "gan":
        model = GAN()
        trainer = _trainer(_strategy(name), max_steps=8)  # 2 optimizer steps per batch
        trainer.fit(model, DataLoader(_data(), batch_size=4))
        _save(name, trainer, losses=model.losses)
    elif kind == "hf_llama":
        model = HFLlama()
        gen = torch.Generator().manual_seed(4)
        tokens = TensorDataset(torch.randint(0, 64, (24, 12), generator=gen))
        trainer = _trainer(_strategy(name), max_steps=4, callbacks=[ShareInit()])
        trainer.fit(model, DataLoader(tokens, batch_size=2))
        _save(name, trainer, losses=model.losses, buffers=getattr(model, "buffers_seen", None))
    elif kind == "uneven":
        model = UnevenVal()
        trainer = _trainer(_strategy(name), max_steps=2, use_distributed_sampler=False)
        groups = []
        trainer.validate(model)
        groups.append(len(dist.distributed_c10d._world.pg_map))
        trainer.validate(model)
        groups.append(len(dist.distributed_c10d._world.pg_map))
        trainer.fit(model, DataLoader(_data(16), batch_size=4), model.val_dataloader())
        groups.append(len(dist.distributed_c10d._world.pg_map))
        trainer.predict(model, DataLoader(torch.ones(8, 8), batch_size=4))
        groups.append(len(dist.distributed_c10d._world.pg_map))
        _save(name, trainer, val_losses=model.val_losses, groups=groups)
    else:
        raise ValueError(name)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        run(case)
