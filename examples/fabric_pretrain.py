"""A LitGPT-shaped pretraining loop on Lightning Fabric with ZeRO (``strategy="zero3"``).

    python examples/fabric_pretrain.py --devices 2 --max-steps 4 --out out/fabric_pretrain
    torchrun --nproc-per-node 8 examples/fabric_pretrain.py --devices 8 --accelerator gpu --model litgpt

What LitGPT's ``pretrain.py`` does, with our strategy in place of ``FSDPStrategy``: the model is
built under ``fabric.init_module(empty_init=True)`` (stage 3: on the meta device, materialized one
unit at a time), set up before the optimizer exists, the optimizer is built over
``model.parameters()`` and set up after; each step accumulates micro batches under
``fabric.no_backward_sync``, clips by the global gradient norm over the shards and steps; the state
(``model``, ``optimizer``, ``scheduler``, ``iter_num``) is saved sharded every ``--save-every``
steps and resumed from ``OUT/last`` when it exists (on any number of devices or stage). The model
is this project's ``Llama`` (``--model llama``) or LitGPT's ``GPT`` (``--model litgpt``, needs
``pip install --no-deps litgpt``). Data: random tokens, seeded per step and rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch import nn

import lightning_zero  # noqa: F401  (registers "zero1"/"zero2"/"zero3" for Fabric too)

VOCAB, SEQ = 256, 32


def build_model(name: str) -> nn.Module:
    if name == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64,
                        n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128)  # fmt: skip
        return GPT(config)
    from lightning_zero.models import Llama, LlamaConfig

    return Llama(LlamaConfig.from_name("tiny", vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                       ffn_dim=128, max_seq_len=SEQ))  # fmt: skip


def batch(step: int, micro: int, rank: int, batch_size: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategy", default="zero3", choices=["zero1", "zero2", "zero3"])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--model", default="llama", choices=["llama", "litgpt"])
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--out", default="out/fabric_pretrain")
    parser.add_argument("--export-full", action="store_true", help="also write OUT/lit_model.pth (full weights)")
    args = parser.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(1)

    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
                      precision=args.precision)  # fmt: skip
    fabric.launch()
    fabric.seed_everything(1337)

    with fabric.init_module(empty_init=True):
        model = build_model(args.model)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}

    out = Path(args.out)
    if (out / "last").exists():
        fabric.load(out / "last", state)
        fabric.print(f"resumed from {out / 'last'} at step {state['iter_num']}")

    while state["iter_num"] < args.max_steps:
        step = state["iter_num"]
        total = 0.0
        for micro in range(args.micro_batches):
            tokens = batch(step, micro, fabric.global_rank, args.batch_size, fabric.device)
            with fabric.no_backward_sync(model, enabled=micro < args.micro_batches - 1):
                logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                fabric.backward(loss / args.micro_batches)
            total += loss.item() / args.micro_batches
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["iter_num"] += 1
        fabric.print(f"step {state['iter_num']}: loss {total:.4f}, grad norm {float(grad_norm):.4f}")
        if state["iter_num"] % args.save_every == 0:
            fabric.save(out / "last", state)  # sharded, atomic: a crash mid-save keeps the previous one

    with torch.no_grad():  # an evaluation forward (stage 3: one evaluation step)
        tokens = batch(args.max_steps, 0, fabric.global_rank, args.batch_size, fabric.device)
        val = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    fabric.print(f"val loss {fabric.all_reduce(val).item():.4f}")
    if args.export_full:  # one file with the full weights, what LitGPT's tools read
        fabric.strategy.state_dict_type = "full"
        fabric.save(out / "lit_model.pth", {"model": model})


if __name__ == "__main__":
    main()
