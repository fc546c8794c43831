"""ZeroStrategy's grad_comm_dtype / param_comm_dtype through Lightning (2 CPU ranks), for
tests/test_compression.py.

Usage: python tests/scripts/compression_run.py OUT_DIR
Each case writes OUT_DIR/<case>.rank<r>.pt: the comm dtypes the engine got, the bucket chunk
sizes, the bytes sent per step, the losses and the compute parameters after the last step.
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from monitor_run import CONFIG, EngineProbe  # noqa: E402  (tests/scripts: this script's folder)

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

CASES = {  # name: (stage, precision, grad_comm_dtype, param_comm_dtype)
    "s2_fp32_gbf16_pint8": (2, "32-true", "bf16", "int8"),
    "s3_bf16_gint8_pint8": (3, "bf16-mixed", "int8", "int8"),
}


class Probe(EngineProbe):
    """monitor_run's probe (bytes sent per step) plus the losses and what the engine was given."""

    reads_parameters_between_steps = False  # metrics only ([Note: parameter reads between steps])

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine  # released when fit ends: read it now
        self.engine = {
            "grad_comm_dtype": engine.reducer.config.grad_comm_dtype,
            "param_comm_dtype": sorted({str(group.param_comm_dtype) for group in engine.groups}),
            "shards": [bucket.layout.shard_numel for bucket in engine.reducer.buckets],
            "params": [group.param_buffer.clone() for group in engine.groups] if engine.stage != 3 else [],
        }


def run(name: str, out_dir: str) -> None:
    stage, precision, grad_comm_dtype, param_comm_dtype = CASES[name]
    L.seed_everything(42, verbose=False)
    model = LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=3)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=2, vocab_size=64, val_fraction=0.2, seed=3)
    probe = Probe()
    strategy = ZeroStrategy(
        stage=stage, bucket_mb=0.004, grad_comm_dtype=grad_comm_dtype, param_comm_dtype=param_comm_dtype, monitor=False
    )
    trainer = script_trainer(devices=2, precision=precision, max_steps=3, strategy=strategy, callbacks=[probe])
    trainer.fit(model, data)
    torch.save(
        {**probe.engine, "sent": probe.sent, "losses": probe.losses},
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    for case in CASES:
        run(case, sys.argv[1])
