"""Fabric loops under Fabric's ddp and ZeroFabricStrategy on 2 CPU processes; each rank writes its results.

Usage: python tests/scripts/fabric_run.py OUT_DIR MODE:CASE [MODE:CASE ...]
Launched torchrun-style by tests/test_fabric.py; one launch runs several cases in turn. Modes:

- ``parity``: CASE = ``<model>_<strategy>`` (models: llama, gpt2, litgpt, moe; strategies: ddp,
  zero1, zero2, zero3): 4 steps of 2 micro batches under ``no_backward_sync``, ``clip_gradients``,
  AdamW with weight decay, a LambdaLR; writes the per-step losses, the gradient norms and the
  trained weights. Also ``litgpt_order_<strategy>``: LitGPT's order (``init_module(empty_init=True)``,
  ``setup(model)``, the optimizer over ``model.parameters()``, ``setup_optimizers``), one step.
- ``save``: CASE = ``<strategy>``: 3 steps, ``fabric.save`` (sharded, and a full file), 3 more.
- ``resume``: CASE = ``<strategy>@<saved by>`` reads the step-3 checkpoint written by ``save`` under
  ``<saved by>``, then 3 steps (on 1 rank: both ranks' batches), and the full file back.
- ``fail``: CASE = ``<strategy>``: rank 1 raises at step 3, rank 0 trains on.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402,F401  (registers zero1/zero2/zero3)

VOCAB, SEQ, BATCH, MICRO = 64, 8, 2, 2
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: a strategy's teardown deletes it


def llama() -> nn.Module:
    from lightning_zero.models import Llama, LlamaConfig

    config = LlamaConfig.from_name(
        "tiny", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ
    )
    return Llama(config)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def litgpt() -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                    n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)  # fmt: skip
    return GPT(config)


class MoE(nn.Module):
    """Embedding, two residual top-1 MoE blocks of 4 experts; an expert no token chose is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.gates = nn.ModuleList(nn.Linear(16, 4, bias=False) for _ in range(2))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16)) for _ in range(4))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

        self.idle = 0  # experts skipped so far on this rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for gate, experts in zip(self.gates, self.experts):
            tokens = x.reshape(-1, 16)  # (B*T, D)
            weight, chosen = torch.softmax(gate(tokens), dim=-1).max(dim=-1)
            out = torch.zeros_like(tokens)
            for index, expert in enumerate(experts):
                rows = torch.where(chosen == index)[0]
                if rows.numel() == 0:
                    self.idle += 1
                    continue  # idle expert: skipped on this rank
                out.index_add_(0, rows, expert(tokens[rows]) * weight[rows, None])
            x = x + out.reshape(x.shape)
        return self.head(self.norm(x))


MODELS = {"llama": llama, "gpt2": gpt2, "litgpt": litgpt, "moe": MoE}


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def batch(step: int, micro: int, ranks: list[int], model: str = "") -> torch.Tensor:
    """Rank ``r``'s tokens of a micro batch; several ranks' concatenated (a dp=1 run sees both)."""
    parts = []
    for rank in ranks:
        gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        high = 8 if model == "moe" else VOCAB  # few token kinds: the ranks route to different experts
        parts.append(torch.randint(0, high, (BATCH, SEQ + 1), generator=gen))
    return torch.cat(parts)


def make_fabric(strategy_name: str, model_name: str = "", **knobs) -> L.Fabric:
    """``ddp`` or ``zero<stage>``, with a ``bf16`` suffix for ``precision="bf16-mixed"``, ``defer`` for
    ``defer_grad_reduce=True``."""
    precision = "bf16-mixed" if strategy_name.endswith("bf16") else "32-true"
    strategy_name = strategy_name.removesuffix("bf16")
    if strategy_name.endswith("defer"):
        knobs["defer_grad_reduce"] = True
        strategy_name = strategy_name.removesuffix("defer")
    if strategy_name == "ddp":
        strategy = DDPStrategy(find_unused_parameters=model_name == "moe")
    else:
        strategy = lightning_zero.ZeroFabricStrategy(stage=int(strategy_name[-1]), **knobs)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def full_weights(fabric: L.Fabric, model) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone().float() for k, v in fabric.strategy.get_module_state_dict(model._forward_module).items()
    }


def _grad_collectives(fabric) -> dict[str, int]:
    engine = getattr(fabric.strategy, "engine", None)
    if engine is None:
        return {}
    return {kind: n for kind, n in engine.counter.calls.items() if "grad" in kind or "reduce" in kind}


def train_steps(fabric, model, optimizer, scheduler, steps: range, model_name: str, ranks: list[int], skipped=None):
    """``skipped``: a list that gets the gradient collectives issued during each skipped micro batch."""
    losses, norms = [], []
    for step in steps:
        step_losses = []
        for micro in range(MICRO):
            before = _grad_collectives(fabric)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = loss_of(model, batch(step, micro, ranks, model_name)) / MICRO
                fabric.backward(loss)
            if skipped is not None and micro < MICRO - 1:
                after = _grad_collectives(fabric)
                skipped.append({k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)})
            step_losses.append(loss.item() * MICRO)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(step_losses)
    return losses, norms


def build(fabric, model_name: str):
    L.seed_everything(42, verbose=False)
    module = MODELS[model_name]()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(module, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def litgpt_order(out: str, strategy_name: str) -> None:
    """LitGPT's pretrain order: ``init_module(empty_init=True)``, ``setup(model)``, the optimizer over
    ``model.parameters()``, ``setup_optimizers``, ``load_raw`` of a plain state dict; 2 steps; then
    ``model.load_state_dict`` of the initial weights (through to the shards), an evaluation loss
    under ``no_grad`` and one more step."""
    fabric = make_fabric(strategy_name, "litgpt")
    init_path = os.path.join(out, "litgpt_init.pth")
    if fabric.global_rank == 0 and not os.path.exists(init_path):
        L.seed_everything(42, verbose=False)
        torch.save(litgpt().state_dict(), init_path + ".partial")
        os.replace(init_path + ".partial", init_path)
    fabric.barrier()
    with fabric.init_module(empty_init=True):
        module = litgpt()
    model = fabric.setup(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    # [Note: stand-ins for meta parameters]: no engine (no gather) before the first call needing one
    deferred = getattr(fabric.strategy, "engine", None) is None and not any(p.is_meta for p in model.parameters())
    fabric.load_raw(init_path, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0)
    ranks = [fabric.global_rank]
    losses, norms = train_steps(fabric, model, optimizer, scheduler, range(2), "litgpt", ranks)
    model.load_state_dict(torch.load(init_path, weights_only=True))
    with torch.no_grad():
        eval_loss = loss_of(model, batch(0, 0, ranks)).item()
    more, more_norms = train_steps(fabric, model, optimizer, scheduler, range(2, 3), "litgpt", ranks)
    # stage 3 holds shards only: state_dict() gathers the full values, one parameter at a time
    plain_state_dict = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # greedy generation, one forward (stage 3: one evaluation step) per token
        tokens = batch(9, 0, ranks)[:1, :3]
        for _ in range(4):
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    result = {"losses": losses + more, "norms": norms + more_norms, "eval_loss": eval_loss,
              "generated": tokens, "deferred": deferred, "state_dict": plain_state_dict, "params": full_weights(fabric, model)}  # fmt: skip
    torch.save(result, os.path.join(out, f"litgpt_order_{strategy_name}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


def parity(out: str, case: str) -> None:
    if case.startswith("litgpt_order_"):
        return litgpt_order(out, case.removeprefix("litgpt_order_"))
    model_name, strategy_name = case.rsplit("_", 1)
    fabric = make_fabric(strategy_name, model_name)
    model, optimizer, scheduler = build(fabric, model_name)
    skipped: list = []
    losses, norms = train_steps(
        fabric, model, optimizer, scheduler, range(4), model_name, [fabric.global_rank], skipped
    )
    result = {"losses": losses, "norms": norms, "params": full_weights(fabric, model), "skipped": skipped}
    if model_name == "moe":
        result["idle"] = model._forward_module.module.idle if strategy_name == "ddp" else model._forward_module.idle
    if strategy_name.endswith("bf16"):
        result["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    engine = getattr(fabric.strategy, "engine", None)
    if engine is not None:
        from tests.engine_state import state_beyond_formula

        result["bytes"] = {"measured": engine.measured_bytes(), "num_params": engine.num_params(),
                           "padding": engine.padding_numel(), "beyond_formula": state_beyond_formula(engine)}  # fmt: skip
    torch.save(result, os.path.join(out, f"{case}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


def save(out: str, strategy_name: str) -> None:
    """3 steps, ``fabric.save`` (sharded, and the weights as one full file), 3 more steps."""
    fabric = make_fabric(strategy_name, "llama")
    model, optimizer, scheduler = build(fabric, "llama")
    ranks = [fabric.global_rank]
    train_steps(fabric, model, optimizer, scheduler, range(3), "llama", ranks)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 3}
    fabric.save(os.path.join(out, f"ckpt_{strategy_name}"), state)
    fabric.strategy.state_dict_type = "full"  # the same weights as one file, for LitGPT's tools
    fabric.save(os.path.join(out, f"full_{strategy_name}.pth"), {"model": model, "iter_num": 3})
    fabric.strategy.state_dict_type = "sharded"
    params_at_save = full_weights(fabric, model)
    rest, _ = train_steps(fabric, model, optimizer, scheduler, range(3, 6), "llama", ranks)
    mean = [fabric.all_reduce(torch.tensor(sum(s) / len(s))).item() for s in rest]
    result = {"losses": rest, "mean_losses": mean, "params": full_weights(fabric, model),
              "params_at_save": params_at_save, "layout": sorted(os.listdir(os.path.join(out, f"ckpt_{strategy_name}")))}  # fmt: skip
    torch.save(result, os.path.join(out, f"save_{strategy_name}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


def resume(out: str, strategy_name: str) -> None:
    """``<strategy>@<saved by>``: load the step-3 checkpoint into a fresh run, then 3 steps; a dp=1
    run takes both ranks' batches."""
    strategy_name, source = strategy_name.split("@")
    fabric = make_fabric(strategy_name, "llama")
    model, optimizer, scheduler = build(fabric, "llama")
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    remainder = fabric.load(os.path.join(out, f"ckpt_{source}"), state)
    assert state["iter_num"] == 3 and remainder == {}, (state["iter_num"], remainder)
    ranks = [fabric.global_rank] if fabric.world_size == 2 else [0, 1]
    rest, _ = train_steps(fabric, model, optimizer, scheduler, range(3, 6), "llama", ranks)
    mean = [fabric.all_reduce(torch.tensor(sum(s) / len(s))).item() for s in rest]
    result = {"losses": rest, "mean_losses": mean, "params": full_weights(fabric, model)}
    # the full file written at step 3, read back into the sharded model
    fabric.load(os.path.join(out, f"full_{source}.pth"), {"model": model})
    result["params_from_full"] = full_weights(fabric, model)
    tag = f"resume_{strategy_name}_from_{source}_w{fabric.world_size}"
    torch.save(result, os.path.join(out, f"{tag}.rank{fabric.global_rank}.pt"))
    fabric.strategy.teardown()


def fail(out: str, strategy_name: str) -> None:
    fabric = make_fabric(strategy_name, "llama", collective_timeout=60.0)
    model, optimizer, scheduler = build(fabric, "llama")
    for step in range(100):
        if step == 3 and fabric.global_rank == 1:
            with open(os.path.join(out, "raised_at"), "w") as handle:
                handle.write(json.dumps(time.time()))
            raise RuntimeError("boom at step 3 on rank 1")
        loss = loss_of(model, batch(step, 0, [fabric.global_rank]))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    out, *cases = sys.argv[1:]
    for item in cases:
        mode, case = item.split(":")
        {"parity": parity, "save": save, "resume": resume, "fail": fail}[mode](out, case)
