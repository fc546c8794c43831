"""Stage-2 gradient pool size for a model whose first layer is registered last (2 gloo ranks, CPU).

Usage: PYTHONPATH=src python benchmarks/pool_late_layer.py
Prints, per step, the most bytes of stage-2 bucket buffers alive at once during backward
(``ShardedGradStorage.pool_bytes_high_water``), the bucket sizes, and the launch order. Runs
against whatever checkout is on PYTHONPATH, so the same script measures before and after a change.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class LateStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
        self.head = nn.Linear(256, 4096)
        self.stem = nn.Linear(1024, 256)  # used first in forward, registered last

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def run(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model = LateStem()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.5, max_buckets_in_flight=2))
    storage = engine.reducer.storage
    per_step = []
    for _ in range(4):
        storage.pool_bytes_high_water = storage._alive_bytes
        opt.zero_grad()
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
        per_step.append(storage.pool_bytes_high_water)
    if rank == 0:
        sizes = [b.layout.numel * 4 for b in engine.reducer.buckets]
        print(f"buckets: {len(sizes)}, bytes each (launch order): {sizes}")
        print(f"sum of all buckets: {sum(sizes)} B; largest: {max(sizes)} B")
        print(f"stage-2 pool high water per step (B): {per_step}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(run, args=(port,), nprocs=2)
