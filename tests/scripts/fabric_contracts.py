"""Fabric's and torch's contracts at the ZeroFabricStrategy door, against Fabric's ddp, on 2 CPU processes.

Usage: python tests/scripts/fabric_contracts.py OUT_DIR MODE:STRATEGY [MODE:STRATEGY ...]
(STRATEGY: ddp, zero1, zero2, zero3; each rank writes ``OUT_DIR/<mode>_<strategy>.rank<r>.pt``). Modes:

- ``lora``: LitGPT's LoRA setup order (``init_module(empty_init=True)``, ``mark_only_lora_as_trainable``,
  ``setup_module``, the optimizer, ``litgpt.utils.load_checkpoint(strict=False)`` of a base checkpoint
  read lazily, whose keys need LoRA's ``_load_from_state_dict`` remap), ``model.state_dict()``, 3 steps,
  then ``fabric.save(filter={"model": lora_filter})`` (one file under every strategy, read back with
  LitGPT's ``lazy_load``) and LitGPT's own ``save_lora_checkpoint``.
- ``torchload``: ``load_state_dict`` on a module with a ``_load_from_state_dict`` remap and a load pre-hook,
  strict True and False, ``assign=True``: the results and error texts, beside plain torch's.
- ``refuse``: a save of a state without the model, one with a filter naming no state entry, one with
  ``storage_options``: each raises; the strategy is not failed and the next save writes.
- ``init``: a transformers ``LlamaForCausalLM`` built under ``fabric.init_module()`` after ``manual_seed``:
  its state dict and first loss.
- at exit (every case): which stage 1-2 parameter all-gathers are still in flight and which of our
  threads still run when the interpreter finalizes (``exit.rank<r>.json``); no case tears down.
- ``mixedsd``: ``model.state_dict()`` under bf16-mixed after setup and after 2 steps.
- ``compiled``: ``torch.compile(model)`` set up with Fabric (stage 3 from the meta device): 3 losses.
- ``full``: ``state_dict_type="full"``: 2 steps, ``fabric.save`` of model, optimizer, scheduler and a step
  count in one torch file, 2 more steps. ``fullresume:<loader>@<saver>``: the file of ``<saver>``'s run
  loaded by a fresh Fabric, 2 steps (ddp loads ours, we load ddp's).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import lightning_zero  # noqa: E402,F401

VOCAB, SEQ, BATCH = 64, 8, 2
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
STRATEGIES: list = []  # every strategy built, none torn down (as in LitGPT's scripts)


def record_exit(out: str, rank: int) -> None:
    """The last ``atexit`` hook (registered first): what still runs when the interpreter finalizes."""
    pending = [s.engine.pending_param_gathers() for s in STRATEGIES if getattr(s, "engine", None) is not None]
    alive = [t.name for t in threading.enumerate() if t.name.startswith("lightning_zero") and t.is_alive()]
    with open(os.path.join(out, f"exit.rank{rank}.json"), "w") as handle:
        json.dump({"pending_param_gathers": pending, "alive_threads": alive, "strategies": len(STRATEGIES)}, handle)


def make_fabric(strategy_name: str, precision: str = "32-true", **kwargs) -> L.Fabric:
    strategy = (
        "ddp" if strategy_name == "ddp" else lightning_zero.ZeroFabricStrategy(stage=int(strategy_name[-1]), **kwargs)
    )
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision)
    fabric.launch()
    STRATEGIES.append(fabric.strategy)
    return fabric


def gpt_config(**lora):
    from litgpt.lora import Config

    return Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                  n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=True,
                  norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64, **lora)  # fmt: skip


LORA = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True, lora_mlp=True,
            lora_head=True)  # fmt: skip


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    logits = logits.logits if hasattr(logits, "logits") else logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def train(fabric, model, optimizer, steps, scheduler=None) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, batch(step, fabric.global_rank))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def once(path: Path, fabric, write) -> Path:
    """``write(path)`` on rank 0 if the file is not there yet; every rank waits for it."""
    if fabric.global_rank == 0 and not path.exists():
        write(path.with_name(path.name + ".partial"))
        os.replace(path.with_name(path.name + ".partial"), path)
    fabric.barrier()
    return path


def floats(state: dict) -> dict:
    return {k: v.detach().float().clone() for k, v in state.items() if torch.is_tensor(v)}


def lora_model(fabric):
    """LitGPT's LoRA setup order: ``init_module(empty_init=True)``, ``mark_only_lora_as_trainable``,
    ``setup_module``, AdamW over ``model.parameters()``, ``setup_optimizers``."""
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=True):
        model = GPT(gpt_config(**LORA))
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, optimizer


def lora(out: Path, strategy_name: str) -> dict:
    from litgpt.lora import GPT, lora_filter
    from litgpt.model import GPT as BaseGPT
    from litgpt.utils import load_checkpoint

    fabric = make_fabric(strategy_name)

    def write_base(path: Path) -> None:
        # a base checkpoint (base keys: LoRA's remap) plus LoRA tensors, so every run starts from the same
        # LoRA weights (under ddp, init_module(empty_init=True) leaves them uninitialized memory)
        torch.manual_seed(7)
        state = BaseGPT(gpt_config()).state_dict()
        for key, value in GPT(gpt_config(**LORA)).state_dict().items():
            if "lora_" in key:
                state[key] = torch.randn_like(value) * 0.1
        torch.save(state, path)

    base = once(out / "lora_base.pth", fabric, write_base)
    model, optimizer = lora_model(fabric)
    load_checkpoint(fabric, model, base, strict=False)  # lazy_load + model.load_state_dict (not FSDP)
    loaded = floats(model.state_dict())
    losses = train(fabric, model, optimizer, range(3))
    trained = floats(model.state_dict())
    filtered = out / f"lora_filtered_{strategy_name}.pth"
    fabric.save(filtered, {"model": model}, filter={"model": lora_filter})
    from litgpt.finetune.lora import save_lora_checkpoint

    saved = out / f"lora_saved_{strategy_name}.pth"
    save_lora_checkpoint(fabric, model, saved)
    fabric.barrier()
    result = {"loaded": loaded, "losses": losses, "trained": trained}
    if fabric.global_rank == 0:
        from litgpt.utils import lazy_load

        plain = GPT(gpt_config(**LORA))
        for name, path in (("filtered", filtered), ("saved", saved)):
            if path.is_file():  # read by LitGPT's own loader, as merge_lora and load_checkpoint read it
                checkpoint = lazy_load(path)["model"]
                incompatible = plain.load_state_dict(checkpoint, strict=False)
                values = {key: value for key, value in plain.state_dict().items() if key in checkpoint}
                result[name] = {"keys": sorted(checkpoint), "unexpected": incompatible.unexpected_keys,
                                "values": floats(values), "bytes": path.stat().st_size}  # fmt: skip
            else:
                result[name] = {"directory": sorted(p.name for p in path.iterdir())}
    if strategy_name != "ddp":  # the filtered file loads back into the set-up model
        fabric.load(filtered, {"model": model}, strict=False)
        result["filtered_reloaded"] = floats(model.state_dict())
    return result


def lorabf16(out: Path, case: str) -> dict:
    """LoRA under bf16-true in a loop that accumulates 2 micro batches and clips (issue 53's fault 6).
    ``case``: ddp, zero1, zero2, zero3, zero2defer and zero3defer (``defer_grad_reduce=True``),
    zero2fp32 (``reduce_dtype="fp32"``)."""
    deferred = {"defer_grad_reduce": True}
    knobs = {"zero2defer": deferred, "zero3defer": deferred, "zero2fp32": {"reduce_dtype": "fp32"}}.get(case, {})
    fabric = make_fabric(case[:5] if case != "ddp" else "ddp", "bf16-true", **knobs)
    base = out / "lora_base.pth"  # written by the lora case
    model, optimizer = lora_model(fabric)
    model.load_state_dict(torch.load(base, weights_only=True), strict=False)
    losses = []
    for step in range(4):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = loss_of(model, batch(10 * step + micro, fabric.global_rank))
                fabric.backward(loss / 2)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    lora = {k: v for k, v in floats(model.state_dict()).items() if "lora_" in k}
    buffers = {name: str(buffer.dtype) for name, buffer in model.module.named_buffers()}  # LitGPT's rope cache
    return {"losses": losses, "lora": lora, "buffer_dtypes": buffers}


class Remapped(nn.Module):
    """A module whose ``_load_from_state_dict`` renames ``old.weight`` to ``inner.weight`` (as LitGPT's LoRA
    does) and whose load pre-hook scales ``scale`` by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("count", torch.zeros(()))
        self.register_load_state_dict_pre_hook(self._double)

    @staticmethod
    def _double(module, state_dict, prefix, *args) -> None:
        if prefix + "scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"] * 2

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        if prefix + "old.weight" in state_dict:
            state_dict[prefix + "inner.weight"] = state_dict.pop(prefix + "old.weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        return self.inner(x) * self.scale


class RemapNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Remapped()
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x))


def _attempt(load) -> dict:
    try:
        result = load()
        return {"missing": sorted(result.missing_keys), "unexpected": sorted(result.unexpected_keys)}
    except Exception as error:  # noqa: BLE001
        return {"error": type(error).__name__, "text": str(error)}


def torchload(out: Path, strategy_name: str) -> dict:
    fabric = make_fabric(strategy_name)
    torch.manual_seed(3)
    source = RemapNet().state_dict()
    source["a.old.weight"] = source.pop("a.inner.weight") + 1.0
    cases = {
        "full": dict(source),
        "extra": {**source, "a.ghost": torch.zeros(2)},
        "short": {k: v for k, v in source.items() if k != "b.bias"},
        "shape": {**source, "b.bias": torch.zeros(5)},
    }
    torch.manual_seed(4)
    model = fabric.setup_module(RemapNet())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    del optimizer
    result: dict = {}
    for name, state in cases.items():
        for strict in (True, False):
            plain = RemapNet()
            expected = _attempt(
                lambda plain=plain, state=state, strict=strict: plain.load_state_dict(dict(state), strict=strict)
            )
            got = _attempt(lambda state=state, strict=strict: model.load_state_dict(dict(state), strict=strict))
            values = floats(
                fabric.strategy.get_module_state_dict(model) if strategy_name != "ddp" else model.state_dict()
            )
            result[f"{name}_{strict}"] = {"torch": expected, "ours": got, "torch_values": floats(plain.state_dict()),
                                          "values": values}  # fmt: skip
    result["assign"] = _attempt(lambda: model.load_state_dict(dict(cases["full"]), assign=True))
    return result


def refuse(out: Path, strategy_name: str) -> dict:
    fabric = make_fabric(strategy_name)
    torch.manual_seed(5)
    model = fabric.setup_module(RemapNet())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    errors = []
    attempts = [
        lambda path: fabric.save(path, {"iter_num": 3}),  # no model in the state
        lambda path: fabric.save(path, {"model": model}, filter={"weights": lambda k, v: True}),  # no such entry
        lambda path: fabric.strategy.save_checkpoint(path, {"model": model}, storage_options={"x": 1}),
    ]
    for attempt in attempts:
        try:
            attempt(out / f"refused_{strategy_name}")
            errors.append(None)
        except Exception as error:  # noqa: BLE001
            errors.append(type(error).__name__)
    failed = bool(getattr(fabric.strategy, "failed", False))
    path = out / f"after_refusal_{strategy_name}"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.barrier()
    return {"errors": errors, "failed": failed, "written": path.exists()}


def init(out: Path, strategy_name: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    fabric = make_fabric(strategy_name)
    torch.manual_seed(11)
    with fabric.init_module():
        module = LlamaForCausalLM(config)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch.manual_seed(11)
    reference = floats(LlamaForCausalLM(config).state_dict())
    weights = floats(model.state_dict())
    losses = train(fabric, model, optimizer, range(2))
    return {"weights": weights, "reference": reference, "losses": losses}


def _small(fabric):
    from litgpt.model import GPT

    fabric.seed_everything(21)
    with fabric.init_module(empty_init=False):
        module = GPT(gpt_config())
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(
            [
                {"params": list(model.parameters())[::2], "weight_decay": 0.1},
                {"params": list(model.parameters())[1::2], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )  # fmt: skip
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def full(out: Path, strategy_name: str) -> dict:
    fabric = make_fabric(strategy_name, state_dict_type="full") if strategy_name != "ddp" else make_fabric("ddp")
    model, optimizer, scheduler = _small(fabric)
    losses = train(fabric, model, optimizer, range(2), scheduler)
    path = out / f"full_{strategy_name}.pth"
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step_count": 2})
    losses += train(fabric, model, optimizer, range(2, 4), scheduler)
    fabric.barrier()
    saved = torch.load(path, weights_only=True)
    summary = {"keys": sorted(saved), "model": floats(saved["model"]),
               "optimizer_state": {i: floats(s) for i, s in saved["optimizer"]["state"].items()},
               "param_groups": saved["optimizer"]["param_groups"], "scheduler": saved["scheduler"],
               "bytes": path.stat().st_size}  # fmt: skip
    return {"losses": losses, "saved": summary}


def fullresume(out: Path, case: str) -> dict:
    loader, saver = case.split("@")
    fabric = make_fabric(loader, state_dict_type="full") if loader != "ddp" else make_fabric("ddp")
    model, optimizer, scheduler = _small(fabric)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step_count": 0}
    fabric.load(out / f"full_{saver}.pth", state)
    losses = train(fabric, model, optimizer, range(2, 4), scheduler)
    return {"losses": losses, "step_count": state["step_count"]}


def mixedsd(out: Path, strategy_name: str) -> dict:
    """bf16-mixed: ``model.state_dict()`` (ddp: fp32 weights under autocast; we: bf16 compute copies
    at stages 1-2, shards at stage 3) right after setup and after 2 steps: dtypes and values."""
    from litgpt.model import GPT

    fabric = make_fabric(strategy_name, "bf16-mixed")
    fabric.seed_everything(21)
    module = GPT(gpt_config())
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))  # builds the engine
    first = model.state_dict()  # ddp hands out the parameters' own storage: copied now
    first_values = floats(first)
    losses = train(fabric, model, optimizer, range(2))
    last = model.state_dict()
    compute = sorted({str(p.dtype) for p in model.parameters()})
    dtypes = [{k: str(v.dtype) for k, v in state.items()} for state in (first, last)]
    return {"first": first_values, "last": floats(last), "dtypes": dtypes, "losses": losses, "compute_dtypes": compute}


def compiled(out: Path, strategy_name: str) -> dict:
    """``torch.compile(model)`` before ``fabric.setup`` (LitGPT's pretrain order; ``backend="aot_eager"``:
    dynamo and AOT autograd without an inductor build), built under ``init_module(empty_init=True)``
    at stage 3 (materialized at the first forward with the values its recorded initializers give:
    ddp's weights, [Note: deferred init]): 3 steps' losses."""
    from litgpt.model import GPT

    # dynamo does not guard on module hooks (skip_nnmodule_hook_guards): without a reset, this case
    # would reuse the graphs an earlier case in this process compiled for GPT before our hooks existed
    torch._dynamo.reset()
    fabric = make_fabric(strategy_name)
    fabric.seed_everything(21)
    with fabric.init_module(empty_init=strategy_name == "zero3"):
        module = GPT(gpt_config())
    model = fabric.setup(torch.compile(module, backend="aot_eager"))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return {"losses": train(fabric, model, optimizer, range(3))}


MODES = {
    "compiled": compiled,
    "mixedsd": mixedsd,
    "lorabf16": lorabf16,
    "lora": lora,
    "torchload": torchload,
    "refuse": refuse,
    "init": init,
    "full": full,
    "fullresume": fullresume,
}

if __name__ == "__main__":
    out, *cases = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    atexit.register(record_exit, out, rank)  # runs after every hook registered later (the strategies')
    for item in cases:
        mode, case = item.split(":")
        try:
            result = MODES[mode](Path(out), case)
        except Exception:  # noqa: BLE001  (the test reads the error; the next case still runs)
            result = {"exception": traceback.format_exc()}
            print(result["exception"], file=sys.stderr, flush=True)
        torch.save(result, os.path.join(out, f"{mode}_{case}.rank{rank}.pt"))
