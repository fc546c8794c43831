"""16-mixed with a dynamic loss scale under ZeroStrategy and ddp, the same plugin (2 CPU ranks).

Usage: python tests/scripts/loss_scale.py OUT_DIR CASE [CASE ...]
Launched by tests/test_precision_parity.py. Every case trains a model for 10 steps with
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", init_scale=2**20, growth_interval=3))``
and ``gradient_clip_val=1.0``, and writes OUT_DIR/<case>.rank<r>.pt: per-step losses, the scale
after every step, the optimizer's step counts, the parameters around the step an ``_inf`` case
poisons, and (ZeRO) each step's overflow flags (this rank's shard, any rank's).

Case names: ``[hf_]<strategy>_<kind>[_inf|_save|_resume]``: ``hf_`` trains the transformers Llama
(``precision_helpers.HFLlama``), else the tiny LlamaLM; ``<kind>`` is ``16m`` (the default
``mixed_params``: fp32 parameters under fp16 autocast, as ddp) or ``16mh`` (``mixed_params="half"``:
fp16 parameters and gradients, fp32 masters in the shards).
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import checkpointed_trainer  # noqa: E402
from tests.scripts.precision_helpers import HFLlama, poison_grad  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
STEPS = 10
POISONED_BATCH = 6  # the _inf cases put an inf into one element of rank 1's gradient here


def make_strategy(name: str):
    """``ddp``, or ``z<stage>`` with the case's ``mixed_params``."""
    parts = name.removeprefix("hf_").split("_")
    if parts[0] == "ddp":
        return "ddp"
    mixed_params = "half" if parts[1] == "16mh" else "auto"
    return ZeroStrategy(stage=int(parts[0][1]), bucket_mb=0.01, mixed_params=mixed_params)


CASES = (
    ["ddp_16m", "z1_16m", "z2_16m", "z3_16m", "z1_16mh", "z2_16mh", "z3_16mh"]
    + ["hf_ddp_16m", "hf_z1_16m", "hf_z2_16m", "hf_z3_16m", "hf_z1_16mh", "hf_z2_16mh", "hf_z3_16mh"]
    + ["ddp_16m_inf", "z2_16m_inf", "z2_16mh_inf"]
    + ["z2_16m_save", "z2_16m_resume"]  # saves at step 5; the second resumes there
    # across mixed_params: a checkpoint of fp16 parameters resumed with fp32 ones, and back
    + ["z2_16mh_save", "z2_16m_resume_from_half", "z2_16mh_resume_from_fp32"]
)
SAVES = {"z2_16m_save": "scale", "z2_16mh_save": "scale_half"}
RESUMES = {"z2_16m_resume": "scale", "z2_16m_resume_from_half": "scale_half", "z2_16mh_resume_from_fp32": "scale"}


class Record(L.Callback):
    reads_parameters_between_steps = True  # the poisoned step's parameters, before and after

    def __init__(self, poison: bool) -> None:
        self.poison = poison
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.around: dict = {}
        self.bytes: dict = {}
        self._hook = None

    def _params(self, pl_module) -> dict:
        return {n: p.detach().float().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.poison or batch_idx != POISONED_BATCH:
            return
        self.around["before"] = self._params(pl_module)
        self.around["steps_before"] = _adam_steps(trainer)
        if trainer.global_rank == 1:
            self._hook = poison_grad(pl_module.model.layers[0].attention.wq.weight)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and batch_idx == STEPS - 1:
            from tests.engine_state import bytes_record

            self.bytes = bytes_record(engine)
        if self.poison and batch_idx == POISONED_BATCH:
            if self._hook is not None:
                self._hook.remove()
            self.around["after"] = self._params(pl_module)
            self.around["steps_after"] = _adam_steps(trainer)


def _adam_steps(trainer) -> list[float]:
    optimizer = trainer.optimizers[0]
    return sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})


def run(name: str, out_dir: str) -> None:
    L.seed_everything(42, verbose=False)
    model = HFLlama() if name.startswith("hf_") else LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=2, vocab_size=64, val_fraction=0.2, seed=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    record = Record(poison=name.endswith("_inf"))
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, step=5, devices=2, strategy=make_strategy(name),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], gradient_clip_val=1.0, max_steps=STEPS,
        callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    torch.save(
        {
            "losses": record.losses,
            "scales": record.scales,
            "around": record.around,
            "steps": _adam_steps(trainer),
            "overflows": list(getattr(trainer.precision_plugin, "overflows", [])),
            "bytes": record.bytes,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out = sys.argv[1]
    for case in sys.argv[2:] or CASES:
        run(case, out)
