"""A Fabric hand loop with ``ZeroFabricStrategy(pp=2)``'s ``pipeline_step``, for tests/test_pipeline.py,
tests/test_pipeline_stage3.py and tests/test_pipeline_fabric.py.

Usage: python tests/scripts/fabric_pp.py OUT_DIR DEVICES CASE [CASE ...]
(CASE: "[<layout>-]<schedule>-zero<stage>", layout ``tp2``: tensor parallelism with sequence
parallelism inside each stage, ``tp2nosp`` without; ``cp2``: context parallelism inside each
stage (the loop cuts each batch with ``context_slice``); ``moe``: a MoETransformer with its experts over
ep=2 inside each stage, a balance loss, a z-loss and the selection-bias update; ``moetp2``: that
MoE at tp=2 with sequence parallelism, ep=1)

Every rank also runs the same loop on the whole model in one process (no process group: AdamW,
the global norm clipped to 0.05, 2 batches of 4 sequences accumulated per step, 3 steps) and
writes OUT_DIR/<case>.rank<r>.pt: both loops' losses and, for each parameter this rank's stages
hold, the largest difference between the two loops' trained values. With dp ranks (pp=2 x dp=2,
pp=2 x ep=2 on 4 devices) batches have 4 rows per dp rank, dp rank d takes rows d, d + dp, ... of
each: its losses are its rows', the test averages them. A MoE's loop is the whole model's over the
same micro-batches (each dp rank's rows cut into the schedule's micro-batches, each forward's loss
``ce + aux``: [Note: MoE pipeline stages] in models/moe/pipeline.py).
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero.fabric import ZeroFabricStrategy  # noqa: E402
from lightning_zero.models.llama.config import LlamaConfig  # noqa: E402
from lightning_zero.models.llama.model import build_llama  # noqa: E402
from lightning_zero.models.moe import build_moe, resolve_moe_config  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
MOE = dict(CONFIG, name="tiny_moe_fabric_pp", n_experts=4, top_k=2, expert_ffn_dim=32, n_dense_layers=1,
           router="sigmoid", router_bias=True, norm_topk_prob=True, bias_update_rate=1e-2, aux_loss_coef=0.05,
           z_loss_coef=0.01)  # fmt: skip
SCHEDULES = {"1f1b": {}, "gpipe": {}, "interleaved_1f1b": {"pp_virtual_stages": 2},
             "interleaved_zb": {"pp_virtual_stages": 2}, "zbv": {}}  # fmt: skip
TP_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {"": {}, "tp2": TP_SP, "tp2nosp": {"tensor_parallel_size": 2, "sequence_parallel": False},
           "cp2": {"cp": 2}, "moe": {"ep": 2}, "moetp2": TP_SP}  # fmt: skip
STEPS, ACCUMULATE, CLIP = 3, 2, 0.05


def batches(rows: int):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (rows, 17), generator=generator) for _ in range(STEPS * ACCUMULATE)]


def model_and_optimizer(moe: bool = False):
    torch.manual_seed(42)
    model = build_moe(resolve_moe_config(MOE)) if moe else build_llama(LlamaConfig(**CONFIG))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def reference(rows: int, moe: bool = False, dp: int = 1, micro: int = 1) -> tuple[list[float], dict]:
    """The whole model's loop; a MoE's over each dp rank's ``micro`` micro-batches (ddp on them)."""
    model, optimizer = model_and_optimizer(moe)
    losses = []
    for index, batch in enumerate(batches(rows)):
        pieces = [piece for rank in range(dp) for piece in batch[rank::dp].chunk(micro)] if moe else [batch]
        step = []
        for piece in pieces:
            loss = model.loss_fn(model(piece[:, :-1]), piece[:, 1:])
            loss = loss + model.aux_loss() if moe else loss
            (loss / (ACCUMULATE * len(pieces))).backward()
            step.append(float(loss))
        losses.append(sum(step) / len(step))
        if (index + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if moe:  # every rank runs this loop: the sum over the world keeps each load's sign
                model.update_router_bias()
    return losses, {name: param.detach().clone() for name, param in model.state_dict().items()}


def main(out: str, case: str, devices: int = 2) -> None:
    layout, _, rest = case.partition("-") if case.split("-")[0] in LAYOUTS else ("", "", case)
    schedule, stage = rest.rsplit("-zero", 1)
    moe, knobs = layout.startswith("moe"), {**SCHEDULES[schedule], **LAYOUTS[layout]}
    strategy = ZeroFabricStrategy(stage=int(stage), pp=2, pp_schedule=schedule, bucket_mb=0.01, **knobs)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=stage == "3"):  # stage 3 under pp: built whole all the same, then cut
        model, optimizer = model_and_optimizer(moe)
    model, optimizer = fabric.setup(model, optimizer)
    groups = fabric.strategy.mesh_groups
    dp = groups.dims.dp  # pp outermost: global rank r's dp rank within its pp block
    mine, rows = slice(groups.rank_in("dp"), None, dp), 4 * dp  # 4 rows (zbv's 4 pp micro-batches) per dp rank
    losses = []
    for index, batch in enumerate(batches(rows)):
        batch = batch[mine]
        stepping = (index + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            inputs, targets = fabric.strategy.context_slice(batch[:, :-1], batch[:, 1:])  # cp: this rank's T/cp
            loss = fabric.strategy.pipeline_step(inputs, targets, accumulate=ACCUMULATE)
            fabric.backward(loss)
        losses.append(float(loss))
        if stepping:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if moe:  # the selection biases, from every micro-batch's assignments over the stage's dp group
                model.update_router_bias(groups.dp_cp)
    with torch.no_grad():
        first = batches(rows)[0]
        evaluated = float(
            fabric.strategy.pipeline_step(*fabric.strategy.context_slice(first[mine, :-1], first[mine, 1:]))
        )
    micro = fabric.strategy.run.session.pipeline_layout.microbatches
    want_losses, want = reference(rows, moe, dp, micro)
    state = {name: value for name, value in model.state_dict().items()}
    gaps = {
        name: float((value.float() - _mine(want[name], value, groups)).abs().max()) for name, value in state.items()
    }
    with torch.no_grad():
        full, _ = model_and_optimizer(moe)
        full.load_state_dict(want)
        want_eval = float(full.loss_fn(full(first[:, :-1]), first[:, 1:]))
    torch.save({"losses": losses, "want": want_losses, "gaps": gaps, "eval": (evaluated, want_eval), "names": sorted(want)},
               os.path.join(out, f"{case}.rank{fabric.global_rank}.pt"))  # fmt: skip


def _mine(want: torch.Tensor, value: torch.Tensor, groups) -> torch.Tensor:
    """Of the whole model's ``want``, what this rank holds as ``value``: its ep rank's experts."""
    if want.shape == value.shape:
        return want
    rows = value.shape[0]
    return want[groups.rank_in("ep") * rows :][:rows]


if __name__ == "__main__":
    for case in sys.argv[3:]:
        main(sys.argv[1], case, int(sys.argv[2]))
