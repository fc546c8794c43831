"""torch.optim.Muon + AdamW under Lightning's ddp, ZeroStrategy and ZeroFabricStrategy, for tests/test_muon_parity.py.

Usage: python tests/scripts/muon_parity.py OUT_DIR CASE [CASE ...]   (launched on 2 or 4 ranks)
Every case trains a tiny Llama (``moe`` in its name: a tiny mixture of experts, whose expert
stacks GroupedMuon steps one matrix at a time) for STEPS optimizer steps in fp32 with gradient
accumulation 2 and clipping per optimizer, as a user writes it: two optimizers need manual
optimization in Lightning (Muon for the hidden matrices, AdamW for embeddings, head, norms and
routers). Case names: ``ddp`` or ``zero<stage>``, then ``_tp2`` / ``_ep2`` / ``_moe`` / ``_bf16``
(bf16-mixed), ``_offload`` (``offload_optimizer``); ``_exact``: no accumulation, no clipping; ``_1step``: one step; ``_dp4``: only a
name for the 4-rank launch; ``fabric_`` first: the Fabric door (``setup`` then
``setup_optimizers``). Every dp size trains on the same global batches. Each rank writes
OUT_DIR/<case>.rank<r>.pt: the per-micro-batch losses, the dense parameters (TP-gathered; an EP
rank's experts are its rows, with their offset), the bytes counted per label, the Muon optimizer's
planned bytes per step and its momentum bytes beside the owned matrices'. ``save_zero2`` writes a
checkpoint after SAVE_AT steps (and trains on); ``resume_<layout>_from_save_zero2`` loads it in
any layout and trains on to STEPS.
"""

import os
import sys
from contextlib import nullcontext

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from lightning_zero.zero.muon import GroupedMuon  # noqa: E402

STEPS = 10  # a case ending in ``_1step``: one
SAVE_AT = 4
ACCUMULATE = 2
CLIP = float(os.environ.get("MUON_PARITY_CLIP", 0.5))
SEQ = 16
GLOBAL_ROWS = 4  # rows of a micro batch over all dp ranks (dp = 1, 2 or 4)
WORLD = int(os.environ["WORLD_SIZE"])  # read once: a Trainer's teardown drops it
TOKENS = torch.empty(0)  # tokens(dp, accumulate) of the case running
LLAMA = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def split_params(model: torch.nn.Module) -> tuple[list, list]:
    """(matrices for Muon, the rest for AdamW): hidden 2-D and 3-D (expert stack) weights go to
    Muon; embeddings, the head, norms and routers to AdamW, as Muon's docs advise."""
    matrices, rest = [], []
    for name, param in model.named_parameters():
        hidden = param.ndim in (2, 3) and not any(k in name for k in ("embed", "output", "router", "gate.weight"))
        (matrices if hidden else rest).append(param)
    return matrices, rest


class MuonTraining:
    """Manual optimization with two optimizers, accumulation and per-optimizer norm clipping."""

    def configure_optimizers(self):
        matrices, rest = split_params(self._built_model())
        grouped = any(p.ndim == 3 for p in matrices)
        muon = (GroupedMuon if grouped else torch.optim.Muon)(matrices, lr=0.02, weight_decay=0.1, momentum=0.9)
        adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0)
        return [muon, adamw]

    def on_train_start(self) -> None:
        # the micro batch is picked by the optimizer step (each of the 2 optimizers counts one), so a
        # resumed run (whose loader restarts the epoch) trains on what the uninterrupted run did
        self.micro = self.trainer.global_step // 2 * self.accumulate

    def training_step(self, batch, batch_idx):
        batch = batch.new_tensor(TOKENS[self.trainer.global_rank // self.tp, self.micro])
        self.micro += 1
        optimizers = self.optimizers()
        loss, _ = self._loss(batch)
        last = self.micro % self.accumulate == 0
        # ddp's order: micro batches before the last under no_sync (as Lightning's automatic
        # optimization and Fabric's no_backward_sync run them); ``_syncall``: every one synced
        with self.trainer.strategy.block_backward_sync() if not (last or self.sync_all) else nullcontext():
            self.manual_backward(loss / self.accumulate)
        if last:
            for optimizer in optimizers if self.clip else []:
                self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            for optimizer in optimizers:
                optimizer.step()
            for optimizer in optimizers:
                optimizer.zero_grad()
        self.losses.append(loss.item())
        return loss


class MuonLlama(MuonTraining, LlamaLM):
    def __init__(self) -> None:
        super().__init__(LLAMA, lr=1e-3, warmup_steps=0, max_steps=STEPS)
        self.automatic_optimization = False
        self.losses: list[float] = []


class MuonMoE(MuonTraining, MoELM):
    def __init__(self) -> None:
        super().__init__({"name": "tiny_moe_shared"}, lr=1e-3, warmup_steps=0, max_steps=STEPS)
        self.automatic_optimization = False
        self.losses: list[float] = []


def layout(case: str) -> dict:
    """``zero2_tp2`` -> stage 2, tp 2; ``zero3_ep2_moe`` -> stage 3, ep 2; ``ddp...`` -> {}."""
    parts = case.removeprefix("resume_").removeprefix("save_").split("_from_")[0].split("_")
    parts = [
        part for part in parts if part not in ("exact", "dp4", "1step", "acconly", "cliponly", "syncall")
    ]  # dp4: a name for the 4-rank launch
    if parts[0].startswith("ddp"):
        return {}
    knobs = {"stage": int(parts[0].removeprefix("zero")), "bucket_mb": 0.01}
    for part in parts[1:]:
        if part.startswith("tp"):
            knobs["tensor_parallel_size"] = int(part[2:])
        if part.startswith("ep"):
            knobs["ep"] = int(part[2:])
        if part == "offload":
            knobs["offload_optimizer"] = True
        if part == "defer":
            knobs["defer_grad_reduce"] = True
        if part == "xnorm":
            knobs["exact_grad_norm"] = True
    return knobs


def tokens(dp: int, accumulate: int) -> torch.Tensor:
    """(dp rank, micro batch, rows, SEQ + 1 tokens): one global batch of GLOBAL_ROWS rows per micro
    batch, split over the dp ranks, so every dp size trains on the same global batches (a
    checkpoint resumes across dp onto the same training)."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 64, (accumulate * STEPS, GLOBAL_ROWS, SEQ + 1), generator=gen)
    return rows.view(accumulate * STEPS, dp, GLOBAL_ROWS // dp, SEQ + 1).transpose(0, 1)


def steps_of(case: str) -> int:
    return 1 if case.endswith("_1step") else STEPS


SAVES = ("save_zero2",)  # write OUT_DIR/ckpt_<case>/ after SAVE_AT steps, and train on to STEPS


class EngineFigures(L.Callback):
    """The Muon optimizer's planned bytes per step and the momentum bytes this rank holds, and the
    owners' expected bytes, read before teardown."""

    reads_parameters_between_steps = False  # figures only

    def __init__(self) -> None:
        self.figures: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        muon = engine.sharded_optimizer(trainer.optimizers[0])
        matrices, domains = muon.plan()
        owned = sum((m.hi - m.lo) * 4 for m in matrices if m.owner == domains[m.domain].rank)
        norm = engine.sharded_optimizer(trainer.optimizers[1]).planned_norm_bytes()  # AdamW's, per clip
        self.figures = {
            "planned": muon.planned_bytes(), "state_bytes": muon.state_bytes(), "owned_bytes": owned, "norm": norm,
        }  # fmt: skip


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` after SAVE_AT optimizer steps, mid-training (optimizer state included)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2 * SAVE_AT and not os.path.exists(self.path):
            trainer.save_checkpoint(self.path)


def run(case: str, out_dir: str) -> None:
    knobs = layout(case)
    tp = knobs.get("tensor_parallel_size", 1)
    precision = "bf16-mixed" if "bf16" in case else "32-true"
    L.seed_everything(42, verbose=False)
    model = MuonMoE() if "moe" in case else MuonLlama()
    # ``exact`` cases: no accumulation, no clipping, where ZeRO's gradients are ddp's bit for bit
    exact = "exact" in case
    accumulate = 1 if exact or "cliponly" in case else ACCUMULATE
    model.tp, model.accumulate, model.clip = tp, accumulate, not (exact or "acconly" in case)
    model.sync_all = "syncall" in case
    global TOKENS
    TOKENS = tokens(WORLD // tp, model.accumulate)  # STEPS' worth: a 1-step case uses the first
    strategy = ZeroStrategy(**knobs) if knobs else "ddp"
    resume = case.startswith("resume_")
    saving = case in SAVES
    figures = EngineFigures()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision,
        max_steps=2 * steps_of(case),  # each optimizer's step counts
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[figures, *([SaveAt(os.path.join(out_dir, f"ckpt_{case}"))] if saving else [])],
    )  # fmt: skip
    loader = DataLoader(TOKENS.reshape(-1, SEQ + 1), batch_size=TOKENS.shape[2], shuffle=False)  # its length only
    ckpt = os.path.join(out_dir, f"ckpt_{case.split('_from_')[-1]}") if resume else None
    trainer.fit(model, loader, ckpt_path=ckpt)
    strategy_ = trainer.strategy
    counted = dict(strategy_.comm_counter.snapshot()["bytes"]) if isinstance(strategy_, ZeroStrategy) else {}
    params = {n: p.detach().float().clone() for n, p in model.model.named_parameters()}
    if tp > 1:
        from lightning_zero.tp import gather_tp_state_dict

        dense = gather_tp_state_dict(model.model, strategy_.mesh_groups.tp)
        params = {name: dense[name].float() for name in params}
    offsets = {}
    if "moe" in case:
        offsets = {i: moe.experts.expert_offset for i, moe in enumerate(model.model.moe_layers())}
    torch.save(
        {"losses": model.losses, "params": params, "counted": counted, "offsets": offsets, **figures.figures},
        os.path.join(out_dir, f"{case}.rank{trainer.global_rank}.pt"),
    )


def fabric_setup(knobs: dict) -> tuple:
    """A Fabric with ``ZeroFabricStrategy(**knobs)`` (``{}``: Fabric's ddp), in LitGPT's order:
    ``setup(model)``, then ``setup_optimizers(muon, adamw)``."""
    from lightning.fabric.strategies import DDPStrategy

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.models import Llama, LlamaConfig

    fabric = L.Fabric(
        accelerator="cpu", devices=WORLD, strategy=ZeroFabricStrategy(**knobs) if knobs else DDPStrategy()
    )
    fabric.launch()
    L.seed_everything(42, verbose=False)
    config = {k: v for k, v in LLAMA.items() if k != "name"}
    model = fabric.setup(Llama(LlamaConfig.from_name(LLAMA["name"], **config)))
    matrices, rest = split_params(model)
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.9)
    muon, adamw = fabric.setup_optimizers(muon, torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0))
    return fabric, model, muon, adamw


def run_fabric(case: str, out_dir: str) -> None:
    """The Fabric door: accumulation under ``no_backward_sync`` and ``clip_gradients`` per optimizer
    (``exact``: neither). ``_reload``: after SAVE_AT steps ``fabric.save`` a full file (torch's own
    optimizer state dicts, ``state_dict_type="full"``), then a fresh Fabric, model and optimizers
    ``fabric.load`` it and train on to STEPS."""
    knobs = layout(case.removeprefix("fabric_").removesuffix("_reload"))
    exact, reload = "exact" in case, case.endswith("_reload")
    accumulate = 1 if exact else ACCUMULATE
    fabric, model, muon, adamw = fabric_setup({**knobs, "state_dict_type": "full"} if knobs and reload else knobs)
    data = tokens(WORLD, accumulate)[fabric.global_rank]
    losses = []
    for step in range(STEPS):
        if reload and step == SAVE_AT:
            path = os.path.join(out_dir, f"full_{case}.pt")
            fabric.save(path, {"model": model, "muon": muon, "adamw": adamw})
            fabric, model, muon, adamw = fabric_setup({**knobs, "state_dict_type": "full"} if knobs else knobs)
            fabric.load(path, {"model": model, "muon": muon, "adamw": adamw})
        for micro in range(accumulate):
            ids = data[step * accumulate + micro]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        for optimizer in (muon, adamw) if not exact else ():
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
    params = fabric.strategy.get_module_state_dict(model._forward_module)
    params = {name: value.detach().float().clone() for name, value in params.items()}
    torch.save(
        {"losses": losses, "params": params, "offsets": {}},
        os.path.join(out_dir, f"{case}.rank{fabric.global_rank}.pt"),
    )


if __name__ == "__main__":
    for name in sys.argv[2:]:
        (run_fabric if name.startswith("fabric_") else run)(name, sys.argv[1])
