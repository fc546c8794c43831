"""Every precision under ZeroStrategy against Lightning's ddp under the same precision (2 CPU ranks).

Usage: python tests/scripts/precision_parity.py OUT_DIR CASE [CASE ...]
Launched by tests/test_precision_parity.py; Lightning's launcher re-runs this script for rank 1.
Each case writes OUT_DIR/<case>.rank<r>.pt: per-step losses, the parameters' dtypes and values
after fit, the engine's measured model-state bytes at the last step beside the monitor's
prediction (the ledger's), and what the check needs to compare them exactly.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import checkpointed_trainer  # noqa: E402
from tests.scripts.precision_helpers import HFLlama  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
STEPS = 4


class HalfAdamLlamaLM(LlamaLM):
    """LlamaLM with AdamW's ``eps=1e-4``: under 16-true the optimizer state is fp16, where the
    default 1e-8 is 0 and a squared gradient below 6e-8 is too, so the update divides by zero (ddp
    and ZeRO alike; fp16 training keeps eps at 1e-4 or above for this reason)."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] = 1e-4
        return config


def zero(stage: int, **kwargs):
    return lambda: ZeroStrategy(stage=stage, bucket_mb=0.01, **kwargs)


# name -> (model, strategy factory, precision, same data on every rank)
CASES = {
    "llama_ddp_bf16t": ("llama", lambda: "ddp", "bf16-true", False),
    "llama_z1_bf16t": ("llama", zero(1), "bf16-true", False),
    "llama_z2_bf16t": ("llama", zero(2), "bf16-true", False),
    "llama_z3_bf16t": ("llama", zero(3), "bf16-true", False),
    # fp32 masters and state under bf16 compute, beside ddp's bf16-mixed
    "llama_ddp_bf16m": ("llama", lambda: "ddp", "bf16-mixed", False),
    "llama_z3_bf16t_fp32": ("llama", zero(3, master_weights="fp32"), "bf16-true", False),
    # bf16-mixed: bf16 parameters, fp32 masters in the shards (the default), and fp32 parameters
    # under autocast, as ddp holds them (mixed_params="fp32")
    "llama_z1_bf16m": ("llama", zero(1), "bf16-mixed", False),
    "llama_z2_bf16m": ("llama", zero(2), "bf16-mixed", False),
    "llama_z3_bf16m": ("llama", zero(3), "bf16-mixed", False),  # saves at step 2 (the resume below)
    "llama_z3_bf16m_resume": ("llama", zero(3), "bf16-mixed", False),
    "llama_z2_bf16mf": ("llama", zero(2, mixed_params="fp32"), "bf16-mixed", False),
    "llama_z3_bf16mf": ("llama", zero(3, mixed_params="fp32"), "bf16-mixed", False),
    "llama_ddp_16t": ("llama16", lambda: "ddp", "16-true", False),
    "llama_z2_16t": ("llama16", zero(2), "16-true", False),
    # tp=2 (dp=1): both ranks train on the batch ddp's ranks both see (ddp = one device then)
    "llama_ddp_same_bf16t": ("llama", lambda: "ddp", "bf16-true", True),
    "llama_tp2_bf16t": ("llama", lambda: ZeroStrategy(stage=1, tensor_parallel_size=2), "bf16-true", True),
    "hf_ddp_bf16t": ("hf", lambda: "ddp", "bf16-true", False),
    "hf_z2_bf16t": ("hf", zero(2), "bf16-true", False),
    "hf_z3_bf16t": ("hf", zero(3), "bf16-true", False),
    # save at step 2, resume: bf16 masters and state; fp32 masters beside bf16 parameters
    "llama_z2_bf16t_save": ("llama", zero(2), "bf16-true", False),
    "llama_z2_bf16t_resume": ("llama", zero(2), "bf16-true", False),
    "llama_z2_fp32_save": ("llama", zero(2, master_weights="fp32"), "bf16-true", False),
    "llama_z2_fp32_resume": ("llama", zero(2, master_weights="fp32"), "bf16-true", False),
}
SAVES = {"llama_z2_bf16t_save": "bf16t", "llama_z2_fp32_save": "fp32", "llama_z3_bf16m": "bf16m"}
RESUMES = {"llama_z2_bf16t_resume": "bf16t", "llama_z2_fp32_resume": "fp32", "llama_z3_bf16m_resume": "bf16m"}


class Record(L.Callback):
    """Per-step losses; at the last step the engine's measured bytes and the monitor's prediction."""

    reads_parameters_between_steps = False  # metrics only ([Note: parameter reads between steps])

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.bytes: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or trainer.global_step < STEPS:
            return
        from tests.engine_state import bytes_record

        self.bytes = bytes_record(engine)


class StateDicts(L.Callback):
    """bf16-mixed: ``pl_module.state_dict()`` at fit start and after every step (before the
    checkpoint of that step is saved): the dtypes and values the LightningModule hands out while it
    trains, where ddp holds fp32 weights and the engine bf16 compute copies beside fp32 masters."""

    def __init__(self) -> None:
        self.first: dict = {}
        self.last: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.first = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.last = {k: v.clone() for k, v in pl_module.state_dict().items()}


def run(name: str, out_dir: str) -> None:
    kind, make_strategy, precision, same_data = CASES[name]
    L.seed_everything(42, verbose=False)
    if kind == "hf":
        model = HFLlama()
    else:
        model = (HalfAdamLlamaLM if kind == "llama16" else LlamaLM)(CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    where = {"dp_rank": 0, "dp_size": 1} if same_data else {}
    batch = 4 if same_data else 2
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=batch, vocab_size=64, val_fraction=0.2, seed=3,
                           **where)  # fmt: skip
    record = Record()
    state_dicts = [StateDicts()] if precision == "bf16-mixed" else []
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, devices=2, strategy=make_strategy(), precision=precision, max_steps=STEPS,
        callbacks=[record, *state_dicts],
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    mesh = getattr(trainer.strategy, "device_mesh", None)
    inner = model.model
    if mesh is not None:
        from lightning_zero.tp import gather_tp_state_dict

        params = gather_tp_state_dict(inner, mesh["tp"].get_group())
    else:
        params = {n: p.detach() for n, p in inner.named_parameters()}
    torch.save(
        {
            "losses": record.losses,
            "dtypes": sorted({str(p.dtype) for p in inner.parameters()}),
            "params": {n: p.float().clone() for n, p in params.items()},
            "bytes": record.bytes,
            # during fit (bf16-mixed), and after it
            "state_dicts": {"first": state_dicts[0].first, "last": state_dicts[0].last} if state_dicts else {},
            "after_fit_dtypes": {k: str(v.dtype) for k, v in model.state_dict().items()},
        },
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    out = sys.argv[1]
    for case in sys.argv[2:] or list(CASES):
        run(case, out)
