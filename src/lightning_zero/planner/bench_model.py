"""The benchmark's run, in one place: its model, its ``Trainer`` flags, its data and its core pinning.

[Note: benchmark run] The CPU benchmarks (``benchmarks/_harness.py`` and the scripts on it) and
the calibration (``lightning-zero plan calibrate``, :mod:`lightning_zero.planner.calibrate`)
measure the same thing: a small ``LlamaLM`` (:data:`BENCH_MODEL`) trained in fp32 with AdamW,
each rank pinned to its own core with one torch thread, under a Lightning ``Trainer`` that logs,
checkpoints, validates and prints nothing, on synthetic tokens. The calibration's numbers feed
the planner's prediction of the benchmark (``benchmarks/planner_check.py``), so both build the
run from here; Lightning and the data module are imported only when a run is built.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

# dim, layers, heads, KV heads, SwiGLU width, vocab of the benchmark's Llama (about 33M parameters)
BENCH_MODEL = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=8192, max_seq_len=128)
BENCH_LR = 3e-4
BENCH_SEED = 1234


def pin_to_core(slot: int, cores: Optional[Sequence[int]] = None) -> int:
    """Pin this process to core ``cores[slot % len(cores)]`` (default: the cores it may use now)
    and use one torch thread; returns the core (``-1`` where affinity is not available)."""
    import torch

    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    core = -1
    if cores:
        core = cores[slot % len(cores)]
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def bench_config(**shape: int) -> Any:
    """A benchmark ``LlamaConfig``: the ``tiny`` preset overridden by ``shape`` (``LlamaConfig``
    fields; none given: :data:`BENCH_MODEL`)."""
    from lightning_zero.models import LlamaConfig

    return LlamaConfig.from_name("tiny", **(shape or BENCH_MODEL))


def bench_module(config: Any, activation_checkpointing: Any = False) -> Any:
    """The LightningModule every benchmark case trains (unless a case brings its own);
    ``activation_checkpointing``: ``LlamaLM``'s (``False`` / ``"selective"`` / ``"full"``)."""
    from lightning_zero.models import LlamaLM

    return LlamaLM(config, lr=BENCH_LR, warmup_steps=1, activation_checkpointing=activation_checkpointing)


def bench_datamodule(config: Any, *, seq_len: int, batch_size: int, max_steps: int) -> Any:
    """Synthetic tokens, enough for ``max_steps`` steps of ``batch_size`` x ``seq_len`` on every rank."""
    from lightning_zero.data import TokenDataModule

    return TokenDataModule(
        source="synthetic",
        seq_len=seq_len,
        batch_size=batch_size,
        vocab_size=config.vocab_size,
        val_fraction=0.0,
        synthetic_tokens=max(2 * (max_steps + 2) * batch_size * (seq_len + 1), 4096),
    )


def seed_bench() -> None:
    """Seed every generator with :data:`BENCH_SEED` (before the module is built)."""
    import lightning as L

    L.seed_everything(BENCH_SEED, verbose=False)


# Trainer flags of a run that only trains: no logger, checkpoints, progress bar, model summary or
# validation (the benchmarks and the GPU check time steps, nothing else).
STEPS_ONLY: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


def bench_trainer(*, devices: int, max_steps: int, callbacks: list, strategy: Any = "auto") -> Any:
    """A CPU ``Trainer`` in fp32 that runs ``max_steps`` steps and nothing else (no logger,
    checkpoints, progress bar, model summary or validation)."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=max_steps,
        callbacks=callbacks,
        **STEPS_ONLY,
    )
