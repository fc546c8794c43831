"""Conformance matrix: third-party and odd-shaped models x {ddp, zero1, zero2, zero3}, 2 CPU ranks.

Usage: python tests/scripts/conformance.py OUT_DIR [RUN ...]      (RUN = "<case>-<strategy>")

Launched by tests/scripts/conformance_check.py (``run_matrix``, which tests/test_conformance.py
uses): it starts both ranks itself with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_PORT set, as torchrun
does, so Lightning starts no processes. Each rank opens the gloo process group once and every
Trainer reuses it (runs in sequence). For every run each rank writes ``OUT_DIR/<run>.rank<r>.pt``:

    {"ok": True, "losses": [...per step...], "val_losses": [...], "probe": Tensor,
     "params": {name: Tensor}, "ties": {name: bool}, "extra": {...}, "seconds": float}
or  {"ok": False, "error": "<traceback>", "seconds": float}

A failed run must not poison the runs after it (a rank that raised while its peer waits in a
collective leaves the process group mid-collective). After each run the ranks compare verdicts
through files (``OUT_DIR/.status``); after a failure both destroy every process group (which
also frees a peer stuck in a collective: its sockets close) and meet again on a new port. A
run that takes longer than ``CONFORMANCE_RUN_TIMEOUT_S`` (default 150 s) is a hang: the rank
writes its threads' stacks as the error and exits; the driver relaunches for the runs left.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback
import zlib
from typing import Any, Optional

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers zero1/zero2/zero3)
from lightning_zero import ZeroStrategy
from tests.scripts.harness import script_trainer

STEPS = 4
VOCAB = 64
SEQ = 12
BATCH = 2  # per rank
WORLD = 2
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
RUN_TIMEOUT_S = float(os.environ.get("CONFORMANCE_RUN_TIMEOUT_S", "150"))


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def token_data(seed: int = 3, samples: int = STEPS * BATCH * WORLD) -> TensorDataset:
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=_gen(seed))
    ids[:, 1::2] = (ids[:, 0::2] * 3 + 1) % VOCAB  # something learnable
    return TensorDataset(ids)


def probe_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=_gen(11))


def loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=False)


# ------------------------------------------------------------------------------------------
# LightningModules
# ------------------------------------------------------------------------------------------
class Recorded(L.LightningModule):
    """Records this rank's loss per training step and per validation batch.

    Subclasses define ``loss(batch)``, ``probe()`` (a plain forward on fixed inputs) and may
    define ``ties()`` (parameter identities that must survive fit) and ``extra()``.
    """

    def __init__(self, optimizer: str = "adamw", lr: float = 1e-2) -> None:
        super().__init__()
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.optimizer_name = optimizer
        self.lr = lr

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(self.loss(batch).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        if self.optimizer_name == "adagrad":
            return torch.optim.Adagrad(params, lr=0.05)
        if self.optimizer_name == "sgd_momentum":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
        if self.optimizer_name == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-2, momentum=0.5, centered=True)
        raise ValueError(self.optimizer_name)

    def probe(self) -> torch.Tensor:
        raise NotImplementedError

    def ties(self) -> dict[str, bool]:
        return {}

    def extra(self) -> dict[str, Any]:
        return {}


# The tiny transformers models of the matrix: family -> (config class, model class, config keywords).
# transformers 5 Mixtral fuses a layer's experts into one module (``gate_up_proj`` and ``down_proj``
# stacked over experts), top-2 of 4, so every rank touches every expert tensor.
HF_TINY = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
}  # fmt: skip


def hf_tiny(family: str) -> Any:
    """A freshly initialized tiny transformers model of ``family`` (:data:`HF_TINY`)."""
    import transformers

    config_class, model_class, keywords = HF_TINY[family]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**keywords))


class TokenLM(Recorded):
    """A transformers language model in ``self.model`` trained on token batches (:func:`token_data`): its loss and probe."""

    def loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def probe(self) -> torch.Tensor:
        return self.model(input_ids=probe_ids()).logits


class CausalLM(TokenLM):
    """A transformers causal LM (GPT-2 or Llama), built in ``__init__``."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.model = hf_tiny(family)

    def ties(self) -> dict[str, bool]:
        if self.family != "gpt2":
            return {}
        return {
            "lm_head.weight is transformer.wte.weight": self.model.lm_head.weight is self.model.transformer.wte.weight
        }

    def extra(self) -> dict[str, Any]:
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        return {"inv_freq": rotary.inv_freq.detach().clone()} if rotary is not None else {}


def _stable_seed(name: str) -> int:
    return zlib.crc32(name.encode())


class MetaLlama(TokenLM):
    """A transformers Llama built in ``configure_model`` (on the meta device under stage 3).

    Weights get an init that does not depend on the order modules are initialized in (each
    parameter seeded by its name), through the engine's ``init_module`` hook, so every strategy
    starts from the same numbers. ``init_module`` declines modules without parameters (the
    rotary embedding): their buffers are the engine's job (issue 11: ``inv_freq`` came out as
    garbage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        self._module_names: dict[int, str] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = hf_tiny("llama")
        if not any(p.is_meta for p in self.model.parameters()):  # ddp, zero1, zero2: init here
            for module in self.modules():
                self.init_module(module)

    def init_module(self, module: nn.Module) -> bool:
        """Initialize ``module``'s own parameters; True when it has no children (subtree done)."""
        if not self._module_names:
            self._module_names = {id(m): name for name, m in self.named_modules()}
        own = [(name, p) for name, p in module.named_parameters(recurse=False)]
        if not own or any(True for _ in module.children()) or len(list(module.buffers(recurse=False))):
            return False
        prefix = self._module_names[id(module)]
        with torch.no_grad():
            for name, param in own:
                if param.is_meta:
                    return False
                gen = _gen(_stable_seed(f"{prefix}.{name}"))
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
                else:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        return True

    def extra(self) -> dict[str, Any]:
        return {"inv_freq": self.model.model.rotary_emb.inv_freq.detach().clone()}


class T5(Recorded):
    """Encoder-decoder whose one embedding is shared by encoder, decoder and LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_tiny("t5")

    def loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids.flip(1)).loss

    def probe(self) -> torch.Tensor:
        ids = probe_ids()
        return self.model(input_ids=ids, decoder_input_ids=ids.flip(1)).logits

    def ties(self) -> dict[str, bool]:
        shared = self.model.shared.weight
        return {
            "encoder.embed_tokens.weight is shared.weight": self.model.encoder.embed_tokens.weight is shared,
            "decoder.embed_tokens.weight is shared.weight": self.model.decoder.embed_tokens.weight is shared,
            "lm_head.weight is shared.weight": self.model.lm_head.weight is shared,
        }


class BatchNormCNN(Recorded):
    """A small CNN with BatchNorm (running statistics are fp32 buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
        )  # fmt: skip

    def loss(self, batch: Any) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images).float(), labels)

    def probe(self) -> torch.Tensor:
        return self.net(torch.randn(3, 1, 8, 8, generator=_gen(11))).float()

    def extra(self) -> dict[str, Any]:
        bn = self.net[1]
        return {
            "running_mean_dtype": str(bn.running_mean.dtype),
            "running_mean": bn.running_mean.detach().float().clone(),
        }


def image_data(samples: int = STEPS * BATCH * WORLD) -> TensorDataset:
    gen = _gen(5)
    images = torch.randn(samples, 1, 8, 8, generator=gen)
    labels = (images.mean((1, 2, 3)) * 20).long().clamp(-5, 4) + 5
    return TensorDataset(images, labels)


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with a frozen ``base`` and trainable rank-``r`` A, B."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(0.1 * torch.randn(rank, base.in_features))
        self.lora_b = nn.Parameter(0.1 * torch.randn(base.out_features, rank))  # nonzero: A gets gradients at step 0
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class LoRALlama(TokenLM):
    """Frozen transformers Llama base + LoRA on q/v projections, reentrant checkpointing per block."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_tiny("llama")
        self.model.requires_grad_(False)
        for layer in self.model.model.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
        # transformers runs each decoder layer's __call__ (hooks included) inside
        # torch.utils.checkpoint.checkpoint(use_reentrant=True), and makes the (frozen) embedding's
        # output require grad so gradients reach the adapters, as PEFT users do.
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": True})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            self.model.enable_input_require_grads()

    def extra(self) -> dict[str, Any]:
        return {"trainable": sorted(n for n, p in self.named_parameters() if p.requires_grad)}


class TeacherStudent(Recorded):
    """A student Llama trained against a frozen teacher copy run under ``torch.no_grad()`` inside
    ``training_step`` at every step, and a ``no_grad`` forward of the student itself after its
    training forward at every other step (as generating a sample does)."""

    def __init__(self) -> None:
        super().__init__()
        self.agreement: list[float] = []
        self.student = hf_tiny("llama")
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        with torch.no_grad():  # a teacher that differs from the student
            for param in self.teacher.parameters():
                param.mul_(0.9)

    def loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=ids).logits
        out = self.student(input_ids=ids, labels=ids)
        distill = nn.functional.mse_loss(out.logits, teacher_logits)
        if self.training and self.global_step % 2 == 1:  # every other step, as sample generation would
            with torch.no_grad():
                greedy = self.student(input_ids=ids[:, : SEQ // 2]).logits.argmax(-1)
            self.agreement.append((greedy == ids[:, 1 : SEQ // 2 + 1]).float().mean().item())
        return out.loss + 0.5 * distill

    def probe(self) -> torch.Tensor:
        return self.student(input_ids=probe_ids()).logits

    def extra(self) -> dict[str, Any]:
        return {"agreement": self.agreement}


class SampleEveryStep(L.Callback):
    """Runs the model outside the step methods (as sample generation in a callback does)."""

    def __init__(self) -> None:
        self.samples: list[torch.Tensor] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        with torch.no_grad():
            self.samples.append(pl_module.model(input_ids=probe_ids()[:1, :6]).logits.float().clone())


class CallbackForward(CausalLM):
    def __init__(self) -> None:
        super().__init__("llama")


class GAN(Recorded):
    """Generator/discriminator MLPs, two optimizers, manual optimization with separate zero_grad.

    The generator accumulates gradients over two halves of the batch while the discriminator
    steps (and zeroes its gradients) after each half: zeroing one optimizer must leave the
    other's accumulated gradients alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z1, z2 = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        opt_g.zero_grad()
        total = 0.0
        for z in (z1, z2):
            opt_d.zero_grad()
            fake = self.generator(z)
            d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
            self.manual_backward(d_loss)
            opt_d.step()
            g_loss = bce(self.discriminator(self.generator(z)), ones) / 2
            self.manual_backward(g_loss)
            total += d_loss.item() + g_loss.item()
        opt_g.step()
        self.train_losses.append(total)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
        )

    def probe(self) -> torch.Tensor:
        z = torch.randn(4, 8, generator=_gen(11))
        return torch.cat([self.generator(z), self.discriminator(torch.randn(4, 16, generator=_gen(12)))], dim=1)


def gan_data(samples: int = STEPS * BATCH * WORLD) -> TensorDataset:
    gen = _gen(9)
    real = torch.randn(samples, 16, generator=gen) * 0.5 + torch.linspace(-1, 1, 16)
    return TensorDataset(real, torch.randn(samples, 8, generator=gen), torch.randn(samples, 8, generator=gen))


class Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class VectorClassifier(Recorded):
    """A classifier of 16-wide vectors into 8 classes (:func:`vector_data`): its loss and probe."""

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def probe(self) -> torch.Tensor:
        return self(torch.randn(3, 16, generator=_gen(11)))


class BlockMLP(VectorClassifier):
    """Input layer, blocks in an ``nn.ModuleList``, head: a model for optimizer cases."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer=optimizer)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def vector_data(dim_in: int = 16, classes: int = 8, samples: int = STEPS * BATCH * WORLD) -> TensorDataset:
    gen = _gen(13)
    x = torch.randn(samples, dim_in, generator=gen)
    return TensorDataset(x, (x[:, :classes].argmax(1)))


class QuantLinear(nn.Module):
    """A frozen int8 weight with a frozen fp32 per-row scale (a quantized base layer), plus
    trainable low-rank adapters."""

    def __init__(self, dim: int = 16, rank: int = 4) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.randint(-127, 128, (dim, dim), dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.full((dim, 1), 0.01), requires_grad=False)
        self.lora_a = nn.Parameter(0.1 * torch.randn(rank, dim))
        self.lora_b = nn.Parameter(0.1 * torch.randn(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.qweight.to(x.dtype) * self.scale.to(x.dtype)
        return torch.tanh(x @ weight.t() + x @ self.lora_a.t().to(x.dtype) @ self.lora_b.t().to(x.dtype))


class Int8Base(VectorClassifier):
    """Frozen int8 base layers (in a ModuleList) with adapters and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(QuantLinear() for _ in range(2))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def extra(self) -> dict[str, Any]:
        # Frozen parameters are never cast (int8 stays int8, the fp32 scale stays fp32 under
        # bf16-mixed, as under ddp) and never change.
        return {
            "frozen": {n: (str(p.dtype), p.detach().clone()) for n, p in self.named_parameters() if not p.requires_grad}
        }


class HeldBlocks(Recorded):
    """Every parameter lives in one of three blocks held by an ``nn.ModuleDict`` or ``nn.Sequential``
    (torchtitan's layout): stage 3 should shard per block and send 3 P (dp-1)/dp per step."""

    def __init__(self, container: str) -> None:
        super().__init__()
        blocks = [Block() for _ in range(3)]
        if container == "moduledict":
            self.blocks = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        else:
            self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        for block in blocks:
            x = block(x)
        return x

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def probe(self) -> torch.Tensor:
        return self(torch.randn(3, 32, generator=_gen(11)))


def regression_data(samples: int = STEPS * BATCH * WORLD) -> TensorDataset:
    gen = _gen(17)
    x = torch.randn(samples, 32, generator=gen)
    return TensorDataset(x, torch.tanh(x.roll(1, dims=1)))


# ------------------------------------------------------------------------------------------
# models whose ranks run different modules in one step (issue 20)
# ------------------------------------------------------------------------------------------
class Dynamic(Recorded):
    """Records which modules ran in each training step (``extra()["ran"]``): a test of these
    models must show that the ranks really ran different modules in some step."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ran_now: set[str] = set()
        self.ran: list[list[str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.ran_now = set()
        loss = super().training_step(batch, batch_idx)
        self.ran.append(sorted(self.ran_now))
        return loss

    def extra(self) -> dict[str, Any]:
        return {"ran": self.ran}


class SparseMoE(nn.Module):
    """A transformers-4.x-Mixtral-style sparse block: top-2 routing over ``experts`` (an
    ``nn.ModuleList``), and an expert that received no token is skipped (``continue``)."""

    def __init__(self, dim: int, experts: int, owner: Dynamic, name: str) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(experts)
        )
        self.owner, self.name = [owner], name  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (B*T, D)
        weights, chosen = torch.topk(torch.softmax(self.gate(tokens), dim=-1), 2, dim=-1)  # (B*T, 2)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if rows.shape[0] == 0:
                continue  # an idle expert is skipped, as transformers 4.x Mixtral does
            self.owner[0].ran_now.add(f"{self.name}.experts.{index}")
            out.index_add_(0, rows, (expert(tokens[rows]) * weights[rows, slot, None]).to(out.dtype))
        return out.reshape(x.shape)


class MoEDecoder(Dynamic):
    """Embedding, two residual MoE blocks (``experts`` each, top-2), head; 6 tokens per rank."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(SparseMoE(16, experts, self, f"blocks.{i}") for i in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))

    def loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        ids = ids[:, :4]  # few tokens: the ranks route to different experts
        return nn.functional.cross_entropy(self.logits(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def probe(self) -> torch.Tensor:
        return self.logits(probe_ids())


class LayerDrop(Dynamic, BlockMLP):
    """:class:`BlockMLP` with four blocks, each skipped with probability 0.4 in a training step,
    drawn per rank (a generator seeded by rank and step): the ranks differ from the first step on."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.training:
            draw = torch.rand(len(self.blocks), generator=_gen(1000 * self.global_rank + len(self.ran)))
        for index, block in enumerate(self.blocks):
            if self.training and draw[index] < 0.4:
                continue
            self.ran_now.add(f"blocks.{index}")
            x = block(x)
        return self.head(x)


class OptionalTower(Dynamic):
    """A decoder with a "vision tower" beside its blocks that runs only for batches with an image:
    rank ``step % 2`` has one in each step (including the first), so the pattern changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.tower = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def logits(self, ids: torch.Tensor, image: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.emb(ids)
        if image is not None:
            self.ran_now.add("tower")
            x = x + self.tower(image)[:, None, :]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        has_image = self.training and len(self.ran) % 2 == self.global_rank
        image = ids[:, :8].float() / VOCAB if has_image else None
        return nn.functional.cross_entropy(self.logits(ids[:, :-1], image).flatten(0, 1), ids[:, 1:].flatten())

    def probe(self) -> torch.Tensor:
        ids = probe_ids()
        return self.logits(ids, ids[:, :8].float() / VOCAB)


# ------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------
class Case:
    """How to build one case: module, data, trainer arguments, the ddp reference's strategy."""

    def __init__(self, build, data, *, val: bool = False, precision: str = "32-true", ddp=lambda: "ddp",
                 callbacks=list, zero_kwargs: dict | None = None, checkpoint: bool = False,
                 trainer: dict | None = None) -> None:  # fmt: skip
        self.build, self.data, self.val, self.precision = build, data, val, precision
        self.trainer = trainer or {}  # more Trainer arguments (accumulation, clipping)
        self.ddp, self.callbacks, self.zero_kwargs = ddp, callbacks, zero_kwargs or {}
        self.checkpoint = checkpoint  # ZeRO runs save a sharded checkpoint after fit; rank 0 exports it


def _ddp_unused() -> DDPStrategy:
    return DDPStrategy(find_unused_parameters=True)


CASES: dict[str, Case] = {
    "gpt2_tied": Case(lambda: CausalLM("gpt2"), token_data, val=True, checkpoint=True),
    "llama": Case(lambda: CausalLM("llama"), token_data, val=True),
    "llama_configure_model": Case(MetaLlama, token_data),
    "t5_shared_embedding": Case(T5, token_data, val=True, checkpoint=True),
    "cnn_batchnorm": Case(BatchNormCNN, image_data),
    "cnn_batchnorm_bf16": Case(BatchNormCNN, image_data, precision="bf16-mixed"),
    "lora_frozen_base_reentrant_ckpt": Case(LoRALlama, token_data, checkpoint=True),
    "no_grad_teacher_in_step": Case(TeacherStudent, token_data, val=True),
    "callback_forward": Case(CallbackForward, token_data, callbacks=lambda: [SampleEveryStep()]),
    "gan_two_optimizers_manual": Case(GAN, gan_data, ddp=lambda: DDPStrategy(find_unused_parameters=True)),
    "adagrad": Case(lambda: BlockMLP("adagrad"), vector_data),
    "sgd_momentum": Case(lambda: BlockMLP("sgd_momentum"), vector_data),
    "rmsprop": Case(lambda: BlockMLP("rmsprop"), vector_data),
    "int8_frozen_base": Case(Int8Base, vector_data, checkpoint=True),
    "int8_frozen_base_bf16": Case(Int8Base, vector_data, precision="bf16-mixed"),
    "blocks_in_moduledict": Case(lambda: HeldBlocks("moduledict"), regression_data),
    "blocks_in_sequential": Case(lambda: HeldBlocks("sequential"), regression_data),
    "moe_skip_idle_experts": Case(MoEDecoder, token_data, ddp=_ddp_unused),
    "moe_accumulate_clip": Case(
        lambda: MoEDecoder(experts=16),
        lambda seed=3, samples=2 * STEPS * BATCH * WORLD: token_data(seed, samples),
        ddp=_ddp_unused,
        trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),  # fmt: skip
    "moe_bf16": Case(MoEDecoder, token_data, ddp=_ddp_unused, precision="bf16-mixed"),
    "layerdrop_per_rank": Case(LayerDrop, vector_data, ddp=_ddp_unused),
    "optional_tower": Case(OptionalTower, token_data, ddp=_ddp_unused, checkpoint=True),
    "hf_mixtral_fused_experts": Case(lambda: CausalLM("mixtral"), token_data, ddp=_ddp_unused),
}

RUNS = [f"{case}-{strategy}" for case in CASES for strategy in STRATEGIES]


class CountSent(L.Callback):
    """Elements this rank sent per training step (the engine's CommCounter), and the padding."""

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.by_kind: list[dict[str, float]] = []
        self.padding_numel: int | None = None
        self.held_numel = 0  # stage 3: elements held from forward into backward (gathered once)
        self._before: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        counter = getattr(trainer.strategy, "comm_counter", None)
        self._before = dict(counter.elements) if counter is not None else {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counter = getattr(trainer.strategy, "comm_counter", None)
        if counter is None:
            return
        step = {kind: value - self._before.get(kind, 0.0) for kind, value in counter.elements.items()}
        self.by_kind.append({k: v for k, v in step.items() if v})
        self.sent.append(sum(step.values()))
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and hasattr(engine, "padding_numel"):
            self.padding_numel = int(engine.padding_numel())
        if engine is not None and getattr(engine, "stage3", None) is not None:
            self.held_numel = int(engine.stage3.held_numel())


def make_strategy(case: Case, strategy: str):
    if strategy == "ddp":
        return case.ddp()
    return ZeroStrategy(stage=int(strategy[-1]), bucket_mb=0.004, **case.zero_kwargs)


def _checkpoint_round_trip(trainer: L.Trainer, run: str) -> dict[str, torch.Tensor] | None:
    """Save a sharded checkpoint of the fitted run, consolidate it on rank 0 (``export``), and
    return what it holds per parameter name (rank 0; ``None`` elsewhere)."""
    from lightning_zero.checkpoint import export

    path = os.path.join(_OUT[0], "ckpts", f"{run}.ckpt")
    trainer.save_checkpoint(path)
    # ``export`` verifies the files spread over the ranks when a process group is up: every rank calls it
    plain = torch.load(export(path, f"{path}.rank{trainer.global_rank}.pt", prefix=""), weights_only=True)
    return {name: tensor.float() for name, tensor in plain.items()} if trainer.global_rank == 0 else None


class SaveAtLastStep(L.Callback):
    """The round trip mid-fit, after the last optimizer step: ZeRO-3 still holds its shards there
    (after fit every parameter is a plain tensor again), and the parameters are the final ones."""

    def __init__(self, run: str) -> None:
        self.run, self.saved = run, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == trainer.max_steps:
            self.saved = _checkpoint_round_trip(trainer, self.run)


def run_one(run: str) -> dict[str, Any]:
    case_name, strategy = run.rsplit("-", 1)
    case = CASES[case_name]
    L.seed_everything(42, verbose=False)
    module = case.build()
    counter, callbacks = CountSent(), case.callbacks()
    saver = SaveAtLastStep(run) if case.checkpoint and strategy != "ddp" else None
    callbacks += [saver] if saver is not None else []
    trainer = script_trainer(
        devices=WORLD,
        strategy=make_strategy(case, strategy),
        precision=case.precision,
        max_steps=STEPS,
        callbacks=[counter, *callbacks],
        num_sanity_val_steps=2 if case.val else 0,  # Lightning's default: validation before training
        limit_val_batches=2 if case.val else 0,
        val_check_interval=2 if case.val else 1.0,
        **case.trainer,
    )
    data = case.data()
    val = loader(case.data(seed=4, samples=2 * BATCH * WORLD)) if case.val else None
    trainer.fit(module, loader(data), val)
    saved = saver.saved if saver is not None else None
    module.eval()
    # A bf16-mixed model is run as Lightning runs it: under autocast (ZeRO keeps bf16 parameters).
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed")
    with torch.no_grad(), autocast:
        probe = module.probe().float().clone()
        extra = dict(module.extra())
    extra["sent_per_step"] = counter.sent
    extra["sent_by_kind"] = counter.by_kind
    extra["padding_numel"] = counter.padding_numel
    extra["held_numel"] = counter.held_numel
    extra["num_params"] = sum(p.numel() for p in module.parameters())
    extra["num_trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    extra["manual"] = not module.automatic_optimization
    extra["accumulate"] = trainer.accumulate_grad_batches
    for callback in callbacks:
        if isinstance(callback, SampleEveryStep):
            extra["samples"] = callback.samples
    params = {name: p.detach().float().clone() for name, p in module.named_parameters()}
    if saved is not None:
        extra["saved"] = saved
    return {"ok": True, "losses": module.train_losses, "val_losses": module.val_losses, "probe": probe,
            "params": params, "ties": module.ties(), "extra": extra}  # fmt: skip


# ------------------------------------------------------------------------------------------
# one launch, many runs; a failure gets a fresh process group, a hang ends the launch
# ------------------------------------------------------------------------------------------
_RANK = [int(os.environ.get("RANK", "0"))]
_OUT = [""]  # the launch's output directory (main sets it)
PG_TIMEOUT_S = float(os.environ.get("CONFORMANCE_PG_TIMEOUT_S", "60"))
FAIL_WAIT_S = 60.0  # how long a failed rank waits for its peer's verdict before giving up


def _write(out: str, run: str, record: dict) -> None:
    path = os.path.join(out, f"{run}.rank{_RANK[0]}.pt")
    torch.save(record, path + ".tmp")
    os.replace(path + ".tmp", path)


def _status(out: str, run: str, rank: int) -> str:
    return os.path.join(out, ".status", f"{run}.rank{rank}")


def _exit(code: int = 0) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watchdog(out: str, run: str, done: threading.Event, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Unless ``done`` is set within ``timeout_s``, record run ``run`` as a hang on this rank, with
    every thread's stack, and exit (hang_cases.py watches its runs with it too)."""
    if done.wait(timeout_s):
        return
    with tempfile.TemporaryFile("w+") as stacks:
        faulthandler.dump_traceback(stacks, all_threads=True)
        stacks.seek(0)
        dump = stacks.read()
    error = f"hang: run {run} did not finish within {timeout_s:.0f}s on rank {_RANK[0]}\n{dump}"
    _write(out, run, {"ok": False, "hang": True, "error": error})
    with open(_status(out, run, _RANK[0]), "w") as status:
        status.write("fail")
    _exit(3)


def _wait_for(path: str, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    time.sleep(0.02)
    with open(path) as handle:
        return handle.read().strip()


def _peer_verdict(out: str, run: str, timeout_s: float) -> str:
    """Every other rank's verdict on ``run``: "ok", "fail" or "timeout"."""
    verdicts = [_wait_for(_status(out, run, rank), timeout_s) for rank in range(WORLD) if rank != _RANK[0]]
    if any(v is None for v in verdicts):
        return "timeout"
    return "ok" if all(v == "ok" for v in verdicts) else "fail"


def init_process_group(port: int) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=_RANK[0], world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )  # fmt: skip


def _fresh_process_group(out: str, run: str) -> None:
    """After a failed run: drop every group (closing its sockets unblocks a peer stuck in a
    collective) and meet again on a new port, so no stale collective can pair with a new one."""
    import gc
    import socket

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if _peer_verdict(out, run, FAIL_WAIT_S) == "timeout":
        _exit(4)  # the peer is stuck: exiting closes our sockets; the driver relaunches the rest
    port_file = os.path.join(out, ".status", f"{run}.port")
    if _RANK[0] == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with open(port_file + ".tmp", "w") as handle:
            handle.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    else:
        port_text = _wait_for(port_file, FAIL_WAIT_S)
        if port_text is None:
            _exit(4)
        port = int(port_text)
    init_process_group(port)


def main(out: str, runs: list[str]) -> None:
    """Run ``runs`` in order on this rank (the driver starts every rank with RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_PORT set, as torchrun does; Lightning then starts no processes itself)."""
    os.makedirs(os.path.join(out, ".status"), exist_ok=True)
    _OUT[0] = out
    init_process_group(int(os.environ["MASTER_PORT"]))
    for run in runs:
        if _RANK[0] == 0:
            open(os.path.join(out, ".status", f"{run}.started"), "w").close()
        done = threading.Event()
        threading.Thread(target=_watchdog, args=(out, run, done), daemon=True).start()
        started = time.monotonic()
        try:
            record = run_one(run)
        except BaseException:  # noqa: BLE001 - every failure becomes this run's record
            record = {"ok": False, "error": traceback.format_exc()}
        done.set()
        record["seconds"] = time.monotonic() - started
        _write(out, run, record)
        with open(_status(out, run, _RANK[0]), "w") as status:
            status.write("ok" if record["ok"] else "fail")
        print(
            f"[conformance] rank {_RANK[0]} {run}: {'ok' if record['ok'] else 'FAILED'} ({record['seconds']:.1f}s)",
            flush=True,
        )
        ok, record = record["ok"], None
        if not ok:
            _fresh_process_group(out, run)
            continue
        verdict = _peer_verdict(out, run, RUN_TIMEOUT_S + 30)
        if verdict == "timeout":
            _exit(4)
        if verdict == "fail":
            _fresh_process_group(out, run)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or RUNS)
