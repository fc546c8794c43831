"""Saves after the Trainer's loops end (issue 61), ZeroStrategy beside Lightning's ``ddp``, CPU gloo.

Usage: python tests/scripts/after_loop_saves.py OUT_DIR [STRATEGY ...]
Launched by tests/test_after_loop_saves.py with 2 ranks. STRATEGY: ``ddp``, ``z1``-``z3``
(sync saves), ``a1``-``a3`` (``async_checkpoint=True``); default: all of them. For each one:

- ``full``: 10 steps uninterrupted (ddp and the sync stages: the knob changes no number);
- fit 4 steps, ``trainer.save_checkpoint`` (``fit``), then validate, test and predict on the same
  Trainer, a save after each (``validate``, ``test``, ``predict``: the test compares their tensors
  with ``fit``'s);
- ``resume_fit``: a new Trainer's ``fit(ckpt_path=...)`` of the ``fit`` save to step 10;
- ``bare`` (sync): a new Trainer that never fits: validate, test, predict, a save after each
  (``bare_validate``, ...); ddp and stage 3 then ``fit(ckpt_path=bare_predict)`` to step 5, which
  must warn that the optimizer starts without state (``bare_resume``).

Writes OUT_DIR/results.rank<r>.json: per strategy the losses of each run, the seconds each save
took, and the optimizer-state warnings each resume gave. The checkpoints stay in OUT_DIR/<strategy>/.
"""

import json
import os
import sys
import time
import warnings

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models.llama import LlamaLM  # noqa: E402

CONFIG = dict(name="after", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
STRATEGIES = ("ddp", "z1", "z2", "z3", "a1", "a2", "a3")


# [rank, step] -> the batch: a resumed run sees the uninterrupted run's batches whatever position
# Lightning restores its (non-stateful) loader to after a fit that stopped at max_steps
BATCHES = torch.randint(0, 64, (2, 10, 2, 9), generator=torch.Generator().manual_seed(2))


class Recorder(LlamaLM):
    def __init__(self) -> None:
        super().__init__(CONFIG, lr=1e-2, warmup_steps=2, max_steps=10)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(BATCHES[self.global_rank, self.trainer.global_step], batch_idx)
        self.losses.append(loss.item())
        return loss


def train_loader() -> DataLoader:
    return DataLoader(list(BATCHES[0, :4].reshape(8, 9)), batch_size=2)  # the cadence: 4 steps per epoch


def eval_loader() -> DataLoader:
    tokens = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(3))
    return DataLoader(list(tokens), batch_size=2)


def make_trainer(name: str, max_steps: int) -> L.Trainer:
    if name == "ddp":
        strategy = "ddp"
    else:
        strategy = ZeroStrategy(stage=int(name[1]), bucket_mb=0.01, async_checkpoint=name[0] == "a")
    return L.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
    )  # fmt: skip


def run_loop(trainer: L.Trainer, loop: str, model: Recorder) -> None:
    if loop == "predict":
        trainer.predict(model, eval_loader())
    else:
        getattr(trainer, loop)(model, eval_loader(), verbose=False)


def path_of(out: str, name: str, save: str) -> str:
    return os.path.join(out, name, f"{save}.ckpt")


def timed_save(trainer: L.Trainer, path: str, record: dict, save: str) -> None:
    started = time.perf_counter()
    trainer.save_checkpoint(path)
    record["save_s"][save] = time.perf_counter() - started


def fit(name: str, max_steps: int, ckpt_path=None) -> tuple[L.Trainer, Recorder, list[str]]:
    L.seed_everything(7, verbose=False)
    model = Recorder()
    trainer = make_trainer(name, max_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_loader(), ckpt_path=ckpt_path)
    said = [str(w.message) for w in caught if "optimizer" in str(w.message) and "state" in str(w.message)]
    return trainer, model, said


def run(out: str, name: str) -> dict:
    record: dict = {"save_s": {}, "losses": {}, "warnings": {}}
    if name[0] != "a":  # the knob changes no number: the async runs compare with the sync stage's
        _, model, _ = fit(name, 10)
        record["losses"]["full"] = model.losses
    trainer, model, _ = fit(name, 4)
    timed_save(trainer, path_of(out, name, "fit"), record, "fit")
    for loop in ("validate", "test", "predict"):
        run_loop(trainer, loop, model)
        timed_save(trainer, path_of(out, name, loop), record, loop)
    _, resumed, said = fit(name, 10, ckpt_path=path_of(out, name, "fit"))
    record["losses"]["resume_fit"] = resumed.losses
    record["warnings"]["resume_fit"] = said
    if name[0] == "a":
        return record
    L.seed_everything(7, verbose=False)
    model = Recorder()
    trainer = make_trainer(name, 4)
    for loop in ("validate", "test", "predict"):
        run_loop(trainer, loop, model)
        timed_save(trainer, path_of(out, name, f"bare_{loop}"), record, f"bare_{loop}")
    if name in ("ddp", "z3"):
        try:  # a refusal raises on every rank alike
            _, resumed, said = fit(name, 5, ckpt_path=path_of(out, name, "bare_predict"))
            record["losses"]["bare_resume"] = resumed.losses
            record["warnings"]["bare_resume"] = said
        except Exception as exc:  # noqa: BLE001 - recorded for the test to read
            record["errors"] = {"bare_resume": f"{type(exc).__name__}: {exc}"}
    return record


if __name__ == "__main__":
    out_dir = sys.argv[1]
    names = sys.argv[2:] or list(STRATEGIES)
    results = {}
    rank = int(os.environ.get("RANK", "0"))
    for strategy_name in names:
        started = time.perf_counter()
        results[strategy_name] = run(out_dir, strategy_name)
        results[strategy_name]["total_s"] = time.perf_counter() - started
        with open(os.path.join(out_dir, f"results.rank{rank}.json"), "w") as handle:
            json.dump(results, handle, indent=1)
