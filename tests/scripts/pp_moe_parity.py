"""A MoE with its batch-dependent terms under pipeline parallelism, for tests/test_pipeline_moe.py.

Usage: python tests/scripts/pp_moe_parity.py OUT_DIR DEVICES CASE [CASE ...]
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-batch losses, the parameters it holds
(the routers' selection biases among them) and what its expert-load monitor read
(this rank's MoE layers, by index). Every case trains the same tiny MoE (4 blocks, the first dense; a sigmoid router
with a selection bias moved by the bias update, a balance loss and a z-loss) on the same 16
sequences per optimizer step, with norm clipping, for 4 steps: pp=2 x ep=2 on 4 ranks (2 dp ranks
of 4 sequences, each cut into 4 micro-batches of one, accumulating 2 batches), against Lightning
ddp on 4 ranks with batches of one sequence accumulating 4 ([Note: MoE pipeline stages] in
models/moe/pipeline.py: a pipelined MoE equals ddp run on its micro-batches). ``_cap`` cases add
a capacity factor to both.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402
from tests.scripts.pp_parity import CONFIG, SCHEDULES, SEQ, Record, zero  # noqa: E402

MOE = dict(CONFIG, name="tiny_moe_pp_aux", n_experts=4, top_k=2, expert_ffn_dim=32, n_dense_layers=1,
           router="sigmoid", router_bias=True, norm_topk_prob=True, bias_update_rate=1e-2, aux_loss_coef=0.05,
           z_loss_coef=0.01)  # fmt: skip
STEPS, MICRO, PP_BATCH, PP_ACCUMULATE = 4, 4, 4, 2  # pp: 2 dp ranks x 4 sequences x 2 batches a step
DDP_ACCUMULATE = 4  # ddp: 4 ranks x 1 sequence x 4 batches, the same 16 sequences a step

CASES = {"ddp": (lambda: "ddp", 1, DDP_ACCUMULATE), "ddp_cap": (lambda: "ddp", 1, DDP_ACCUMULATE)}
for _stage in (1, 2, 3):
    for _name in ("1f1b", "interleaved", "zb", "zbv"):
        for _cap in ("", "_cap"):
            _strategy = zero(_stage, pp=2, ep=2, pp_microbatches=MICRO, **SCHEDULES[_name])
            CASES[f"pp2ep2_{_name}_zero{_stage}{_cap}"] = (_strategy, PP_BATCH, PP_ACCUMULATE)
# pp=2 x tp=2 on 4 ranks (dp=1: 8 sequences a batch, 8 micro-batches of one), with and without sequence parallelism
for _name, _split in (("1f1b", False), ("zbv", True)):
    _strategy = zero(1, pp=2, tensor_parallel_size=2, sequence_parallel=_split, pp_microbatches=8, **SCHEDULES[_name])
    CASES[f"pp2tp2_{_name}_zero1"] = (_strategy, 2 * PP_BATCH, PP_ACCUMULATE)

# the same tp=2 without pp (2 dp ranks of one sequence, accumulating 8): tp's own distance from ddp
CASES["tp2_zero1"] = (zero(1, tensor_parallel_size=2), 1, 2 * DDP_ACCUMULATE)


class RecordRouting(Record):
    """Also what the expert-load monitor reads each batch (``take_moe_stats``; this callback runs
    before ZeroStrategy's monitor, appended at fit): assignments and ``(balance, z)`` summed over batches."""

    def __init__(self) -> None:
        super().__init__()
        self.load, self.aux = 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        load, aux = pl_module.model.take_moe_stats()
        self.load, self.aux = self.load + load, self.aux + aux


def run(name: str, devices: int, out_dir: str) -> None:
    make_strategy, batch_size, accumulate = CASES[name]
    L.seed_everything(42, verbose=False)
    config = dict(MOE, capacity_factor=1.0) if name.endswith("_cap") else MOE
    model = MoELM(config, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    data = TokenDataModule(source="synthetic", seq_len=SEQ, batch_size=batch_size, vocab_size=64, val_fraction=0.25,
                           seed=3, synthetic_tokens=96 * SEQ + 1)  # fmt: skip
    record = RecordRouting()
    trainer = script_trainer(devices=devices, strategy=make_strategy(), max_steps=STEPS, callbacks=[record],
                             gradient_clip_val=0.05, accumulate_grad_batches=accumulate)  # fmt: skip
    trainer.fit(model, data)
    params = model.model.state_dict()  # with each router's selection bias
    mesh = getattr(trainer.strategy, "device_mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):  # the dense parameters
        from lightning_zero.tp import gather_tp_state_dict

        params = gather_tp_state_dict(model.model, mesh["tp"].get_group())
    params = {k: v.float() for k, v in params.items()}
    layers = [index for index, block in enumerate(model.model.layers) if getattr(block, "moe", None) is not None]
    result = {"losses": record.losses, "params": params, "moe_stats": (record.load, record.aux), "layers": layers}
    torch.save(result, os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    out, devices = sys.argv[1], int(sys.argv[2])
    for case in sys.argv[3:]:
        run(case, devices, out)
