"""ZeroMonitor and the planner against a real 2-rank CPU run, for tests/test_monitor.py.

Usage: python tests/scripts/monitor_run.py OUT_DIR
Each case writes OUT_DIR/<case>.rank<r>.pt: the monitor's per-step metrics, the engine's own
per-step byte counts, the engine's measured model-state bytes at the end of training, and the
"no logger configured" warnings Lightning raised (the Trainer has ``logger=False``).
"""

import os
import sys
import warnings

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_zero import ZeroMonitor, ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.scripts.harness import script_trainer  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
CASES = {
    f"s{stage}_{precision}_{'overlap' if overlap else 'serial'}{f'_acc{accumulate}' if accumulate > 1 else ''}": (
        stage, precision, overlap, accumulate)
    for stage, precision, overlap, accumulate in [
        (1, "32-true", True, 1),
        (2, "32-true", True, 1),
        (2, "32-true", False, 1),
        (3, "32-true", True, 1),
        (1, "bf16-mixed", True, 1),
        (2, "bf16-mixed", True, 1),
        (3, "bf16-mixed", True, 1),
        (2, "32-true", True, 2),  # every micro batch of a step reduce-scatters: all of them count
        (3, "32-true", True, 2),
    ]
}  # fmt: skip


class EngineProbe(L.Callback):
    """Reads the engine directly: bytes sent per optimizer step (all its micro batches) and the
    measured bytes after the last step."""

    def __init__(self, accumulate: int = 1) -> None:
        self.accumulate = accumulate
        self.sent: list[dict] = []
        self.measured: dict = {}
        self._before: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % self.accumulate == 0:
            self._before = dict(trainer.strategy.engine.counter.bytes)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate:
            return
        after = trainer.strategy.engine.counter.bytes
        self.sent.append({k: v - self._before.get(k, 0.0) for k, v in after.items()})

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        self.measured = {
            **engine.measured_bytes(),
            "padding": engine.padding_numel(),
            "num_params": engine.num_params(),
        }


def run(name: str, out_dir: str) -> None:
    stage, precision, overlap, accumulate = CASES[name]
    L.seed_everything(42, verbose=False)
    model = LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=3)
    data = TokenDataModule(source="synthetic", seq_len=16, batch_size=2, vocab_size=64, val_fraction=0.2, seed=3)
    monitor, probe = ZeroMonitor(summary=False), EngineProbe(accumulate)
    trainer = script_trainer(
        devices=2,
        precision=precision,
        max_steps=3,
        strategy=ZeroStrategy(stage=stage, bucket_mb=0.004, overlap_comm=overlap),
        accumulate_grad_batches=accumulate,
        callbacks=[monitor, probe],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    no_logger = [str(w.message) for w in caught if "no logger configured" in str(w.message)]
    torch.save(
        {"history": monitor.history, "sent": probe.sent, "measured": probe.measured, "no_logger_warnings": no_logger},
        os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    for case in CASES:
        run(case, sys.argv[1])
