"""Expert parallelism on 2 CPU ranks: step seconds with and without EP, bytes per rank beside the
ledger, and the all-to-all bytes beside the planner's formula (issue 54's closing numbers).

    python benchmarks/bench_moe.py --out moe.json [--rounds 2] [--steps 12] [--stage 2]

Runs a 4-layer MoE (dim 256, 8 experts of width 512, top-2; fp32, micro batch 4 x 128 tokens)
under ``ZeroStrategy(stage, ep=1)`` and ``ep=2`` alternately (A B A B ...: separate fits in the
same two processes, so they share the host's state; [Note: interleaved A/B] in
interleaved_ab.py flips a switch inside one fit, which a model layout cannot). Reports per side
the median step seconds (after 3 warm-up steps), the engine's measured model-state bytes against
the ledger's prediction (``zero/measured_total_bytes`` / ``zero/predicted_total_bytes`` of the
monitor) and the planner's (``planner.arithmetic.plan`` of the same run: params + grads +
optimizer), and the all-to-all bytes counted from the split sizes against
``planner.moe.all_to_all_bytes`` of the routing counts of the same micro-batches and against the
planner's (a balanced router). On 2 shared cores the step times say little about a GPU cluster;
the bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models.moe import MoELM  # noqa: E402
from lightning_zero.planner.moe import MOE_EXCHANGES, all_to_all_bytes  # noqa: E402

CONFIG = dict(name="tiny_moe", vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=512,
              max_seq_len=128, n_experts=8, top_k=2, expert_ffn_dim=512)  # fmt: skip
WARMUP = 3


class Timed(MoELM):
    def __init__(self) -> None:
        super().__init__(CONFIG, lr=1e-3, warmup_steps=0, max_steps=1000)
        self.step_s: list[float] = []
        self.loads: list[list[list[int]]] = []

    def on_train_batch_start(self, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx >= WARMUP:
            self.step_s.append(time.perf_counter() - self._started)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.loads.append(torch.stack([moe.load for moe in self.model.moe_layers()]).tolist())
        return loss


def run(ep: int, stage: int, steps: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = Timed()
    rows = 2 * 4 * steps
    data = torch.randint(0, CONFIG["vocab_size"], (rows, 129), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, ep=ep), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=4))
    monitor = next(cb for cb in trainer.callbacks if type(cb).__name__ == "ZeroMonitor")
    last = monitor.history[-1]
    counted = {label: trainer.strategy.comm_counter.bytes.get(label, 0.0) for label in MOE_EXCHANGES}
    return {
        "ep": ep,
        "rank": trainer.global_rank,
        "median_step_s": statistics.median(model.step_s),
        "measured_total_bytes": last["zero/measured_total_bytes"],
        "predicted_total_bytes": last["zero/predicted_total_bytes"],
        "counted_all_to_all": counted,
        "loads": model.loads,
    }


def planned(ep: int, stage: int, steps: int) -> dict:
    """What ``planner.arithmetic.plan`` predicts for one rank of ``run``'s fit: model-state bytes
    and the all-to-all bytes of its ``steps`` optimizer steps (a balanced router)."""
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.moe import MoEConfig
    from lightning_zero.planner.arithmetic import PlanOptions, RunShape, plan

    config = ZeroConfig(stage=stage, ep=ep)
    dims = ParallelDims.from_config(config, world_size=2, devices_per_node=2)
    run = RunShape("32-true", micro_batch=4, seq_len=128)
    planned_run = plan(MoEConfig(**CONFIG), config, dims, run, PlanOptions(simulate=False, suggest=False))
    memory = planned_run.memory
    return {
        "planned_state_bytes": memory.params + memory.grads + memory.optimizer,
        "planned_all_to_all": {k: steps * v for k, v in planned_run.traffic.ep_bytes_by_kind.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="moe.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    results = [run(ep, args.stage, args.steps) for _ in range(args.rounds) for ep in (1, 2)]
    rank = results[0]["rank"]
    path = f"{args.out}.rank{rank}"
    with open(path, "w") as handle:
        json.dump(results, handle)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    if rank != 0:
        return
    while not os.path.exists(f"{args.out}.rank1"):
        time.sleep(0.5)
    time.sleep(1.0)
    peer = json.load(open(f"{args.out}.rank1"))
    summary = []
    for mine, theirs in zip(results, peer):
        row_bytes = CONFIG["dim"] * 4
        predicted = dict.fromkeys(MOE_EXCHANGES, 0.0)
        if mine["ep"] > 1:
            for a, b in zip(mine["loads"], theirs["loads"]):
                for label, value in all_to_all_bytes([a, b], rank=0, ep=2, row_bytes=row_bytes).items():
                    predicted[label] += value
        summary.append({
            "ep": mine["ep"], "median_step_s": [mine["median_step_s"], theirs["median_step_s"]],
            "measured_total_bytes": [mine["measured_total_bytes"], theirs["measured_total_bytes"]],
            "predicted_total_bytes": [mine["predicted_total_bytes"], theirs["predicted_total_bytes"]],
            "all_to_all_rank0": {"counted": mine["counted_all_to_all"], "from_counts": predicted},
            **planned(mine["ep"], args.stage, args.steps),
        })  # fmt: skip
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=2)
    for row in summary:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
