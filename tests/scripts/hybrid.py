"""Hybrid sharding, hierarchical reduction and link-class counting on 2 nodes x 2 CPU ranks.

Usage: python tests/scripts/hybrid.py OUT_DIR CASE [CASE ...], started once per rank by
tests/test_hybrid.py with the environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE=4,
LOCAL_WORLD_SIZE=2, GROUP_RANK, TORCHELASTIC_RUN_ID, ...), so Lightning sees num_nodes=2, devices=2.
Every rank writes OUT_DIR/<case>.rank<r>.pt: per-step losses (mean over all ranks), and for ZeRO
cases the bytes sent in step 2 by kind and by link class, the padded parameter count per
replica, the shard size and the engine's measured model-state bytes. Cases run in the order given
(hyb3_s2 writes the checkpoint the ckpt_* cases resume).
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.data import TokenDataModule  # noqa: E402
from lightning_zero.models import LlamaLM  # noqa: E402
from tests.engine_state import state_beyond_formula  # noqa: E402
from tests.scripts.harness import checkpointed_trainer  # noqa: E402

CONFIG = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
GLOBAL_BATCH = 8
STEPS = 4


def zero(**kwargs):
    return lambda: ZeroStrategy(bucket_mb=0.01, monitor=False, **kwargs)


CASES = {  # name: (strategy factory, tp)
    "ddp": (lambda: "ddp", 1),
    "world2": (zero(stage=2), 1),
    "hyb1_s2": (zero(stage=1, shard_size=2), 1),
    "hyb2_node": (zero(stage=2, shard_size="node"), 1),
    "hyb3_s2": (zero(stage=3, shard_size=2), 1),
    "hier2": (zero(stage=2, hierarchical_reduce=True), 1),
    "hier3": (zero(stage=3, hierarchical_reduce=True), 1),
    # tp=2 on 2 x 2: one dp rank per node, so "node" is shard_size 1, replicated over the 2 nodes.
    "tp2_hyb1_node": (zero(stage=1, tensor_parallel_size=2, shard_size="node"), 2),
    "tp2_hyb3_node": (zero(stage=3, tensor_parallel_size=2, shard_size="node"), 2),
    # compressed cross-node hops (grad_comm_dtype): the replica all-reduce of hybrid sharding and
    # the cross-node reduce-scatter of hierarchical reduction; the in-node hops stay fp32
    "hyb2_node_bf16": (zero(stage=2, shard_size="node", grad_comm_dtype="bf16"), 1),
    # param_comm_dtype is ignored here: the shard group's gathers stay inside a node
    "hyb2_node_int8": (zero(stage=2, shard_size="node", grad_comm_dtype="int8", param_comm_dtype="int8"), 1),
    "hier2_int8": (zero(stage=2, hierarchical_reduce=True, grad_comm_dtype="int8"), 1),
    # checkpoint round trip: hyb3_s2 saves at step 2; fresh runs resume it to step 4 in the same
    # layout and sharded over all 4 ranks (checkpoints are in dense coordinates)
    "ckpt_resume": (zero(stage=3, shard_size=2), 1),
    "ckpt_resume_world": (zero(stage=3), 1),
}
SAVES = {"hyb3_s2": "hybrid"}  # case: checkpoint directory it writes at step 2
RESUMES = {"ckpt_resume": "hybrid", "ckpt_resume_world": "hybrid"}


class Record(L.Callback):
    """Global mean loss per step; the engine's counters in step 2 (the first backward agrees on the
    bucket order, a one-off collective)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sent: dict = {}
        self._before: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self._before = engine.counter.snapshot()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float().clone()
        dist.all_reduce(loss)  # tp ranks hold the same loss: the mean over all ranks is dp's mean
        self.losses.append(float(loss) / dist.get_world_size())
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and trainer.global_step == 2:
            after = engine.counter.snapshot()
            self.sent = {
                key: {k: v - self._before[key].get(k, 0.0) for k, v in after[key].items()}
                for key in ("bytes", "bytes_by_link")
            }
            self.measured = engine.measured_bytes()
            self.step_counters = state_beyond_formula(engine)  # per-run `step`s, no padding moments
            self.padded = engine.num_params() + engine.padding_numel()  # elements one replica holds
            # stage 3: the head, held from its forward into its backward (gathered once a step)
            self.held = engine.stage3.held_numel() if engine.stage3 is not None else 0


def run(name: str, out_dir: str) -> None:
    make_strategy, tp = CASES[name]
    L.seed_everything(42, verbose=False)
    model = LlamaLM(CONFIG, lr=1e-2, warmup_steps=1, max_steps=STEPS)
    dp = 4 // tp
    data = TokenDataModule(
        source="synthetic", seq_len=16, batch_size=GLOBAL_BATCH // dp, vocab_size=64, val_fraction=0.2, seed=3
    )
    record = Record()
    trainer, ckpt_path = checkpointed_trainer(
        out_dir, name, SAVES, RESUMES, num_nodes=2, devices=2, strategy=make_strategy(), max_steps=STEPS,
        gradient_clip_val=0.05, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    result = {"losses": record.losses, "sent": record.sent}
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy) and hasattr(record, "measured"):
        dims = strategy._dims
        result.update(
            measured=record.measured,
            step_counters=record.step_counters,
            padded=record.padded,
            held=record.held,
            shard=dims.shard,
            replicate=dims.replicate,
            stage=strategy.stage,
        )
    torch.save(result, os.path.join(out_dir, f"{name}.rank{trainer.global_rank}.pt"))


def _engine_reduction(rank: int, world: int, stage: int, shard_size, hierarchical: bool, timeout) -> dict:
    """ZeroEngine without Lightning on the hybrid groups: each rank's master gradient chunk
    against the dense mean gradient over the 4 ranks' inputs."""
    import copy

    from torch import nn

    from lightning_zero.comm.mesh import ParallelDims, build_shard_groups
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import EngineGroups, ZeroEngine

    dims = ParallelDims(world_size=world, devices_per_node=2, shard_size=shard_size, hierarchical_reduce=hierarchical)
    groups = build_shard_groups(dims)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    dense = copy.deepcopy(model)
    inputs = torch.randn(world, 5, 7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=stage, bucket_mb=0.0002, collective_timeout=timeout)
    engine = ZeroEngine(model, [optimizer], config, groups=EngineGroups(shard=groups, ranks_per_node=2))
    for _ in range(2):  # the second backward runs in the learned bucket order
        optimizer.zero_grad()
        engine.backward(model(inputs[rank]).pow(2).sum())
    dense(inputs.view(-1, 7)).pow(2).sum().div(world).backward()  # the mean over the ranks' losses
    want = {name: param.grad.reshape(-1) for name, param in dense.named_parameters()}
    error = 0.0
    for owned in engine.owned_ranges():
        got = engine.optimizer_tensor(owned).grad  # the view the optimizer steps
        error = max(error, float((got - want[owned.name][owned.param_lo : owned.param_hi]).abs().max()))
    result = {
        "max_abs_error": error,
        "buckets": len(engine.reducer.buckets),
        "hierarchical": engine.reducer.hybrid is not None and engine.reducer.hybrid.hierarchical,
        "bytes_by_link": dict(engine.counter.bytes_by_link),
    }
    engine.close()
    for group in groups.all():
        dist.destroy_process_group(group)
    return result


def engine_paths(out_dir: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for timeout in (None, 60.0):
        results[("hier_stage2", timeout)] = _engine_reduction(rank, world, 2, None, True, timeout)
        results[("hybrid_stage1", timeout)] = _engine_reduction(rank, world, 1, "node", False, timeout)
    torch.save(results, os.path.join(out_dir, f"engine_paths.rank{rank}.pt"))


if __name__ == "__main__":
    out = sys.argv[1]
    for case in sys.argv[2:]:
        engine_paths(out) if case == "engine_paths" else run(case, out)
