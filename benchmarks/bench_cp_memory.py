"""Memory at length on 2 CPU ranks: the longest sequence that trains within a fixed activation
budget per rank, without context parallelism and with cp=2 (issue 55).

    python benchmarks/bench_cp_memory.py --out results/cp_memory.json
    python benchmarks/bench_cp_memory.py --budget-mib 8 --lengths 512 1024 2048   # quick

Each rank trains a small Llama (fp32, AdamW, gradients averaged over both ranks as the engine's
``dp x cp`` average does) one step per case, lengths doubling. ``cp=1``: each rank holds one whole
sequence (dp=2); ``cp=2``: the two ranks hold the halves of one sequence
(``cp.parallelize_context``, each rank its ``T/2 + 1`` tokens). Per case and rank:

- ``saved``: the activation bytes kept for backward when forward returned the loss, measured
  ([Note: measuring saved activations] in ``planner/saved_activations.py``), beside the planner's
  ``llama_activation_bytes(..., cp=C).saved_after_forward("none")``;
- ``peak``: the most bytes of storages created in the step alive at once, forward and backward
  (``PeakStorages``; the parameters, their gradients and the optimizer state made before the step
  are not counted), beside the planner's ``.total("none")`` (which leaves out the transient
  activation gradients of backward: ``plan.reserved_gib`` covers those in a plan).

A case *fits* when its measured peak is within ``--budget-mib`` on every rank; each cp's ladder
stops at the first length that does not. Everything runs in one launch of 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MIB = 2**20
MODEL = dict(name="tiny", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def one_step(config, cp: int, seq_len: int) -> dict:
    """Train one step at ``seq_len`` with ``cp`` ranks per sequence; bytes measured and planned."""
    from lightning_zero.cp import context_slice_bounds
    from lightning_zero.cp.parallelize import parallelize_context
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.models.llama.model import build_llama
    from lightning_zero.planner.saved_activations import PeakStorages, SavedActivations

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_llama(config)
    if cp > 1:
        parallelize_context(model, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():  # gradients and optimizer state exist before the step
        param.grad = torch.zeros_like(param)
    optimizer.step()
    sample = rank // cp  # dp rank: cp=1 each rank its own sequence, cp=2 one shared sequence
    tokens = torch.randint(0, config.vocab_size, (world // cp, seq_len + 1), generator=torch.Generator().manual_seed(1))
    start, stop = context_slice_bounds(seq_len, cp, rank % cp)
    piece = tokens[sample : sample + 1, start:stop]
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [t for group in optimizer.state.values() for t in group.values() if isinstance(t, torch.Tensor)]
    exclude = {t.untyped_storage().data_ptr() for t in tensors}

    peak = PeakStorages(exclude)
    saved = SavedActivations(model)
    with peak:
        saved.start()
        loss = model.loss_fn(model(piece[:, :-1]), piece[:, 1:])
        saved_bytes = saved.stop()
        loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world
    optimizer.step()
    planned = llama_activation_bytes(config, micro_batch=1, seq_len=seq_len, act_bytes=4, cp=cp)
    return {
        "cp": cp,
        "seq_len": seq_len,
        "rank": rank,
        "loss": float(loss),
        "saved_bytes": saved_bytes,
        "planned_saved_bytes": planned.saved_after_forward("none"),
        "peak_bytes": peak.peak,
        "planned_peak_bytes": planned.total("none"),
    }


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    from lightning_zero.models import LlamaConfig

    config = LlamaConfig(**MODEL, max_seq_len=max(args.lengths))
    budget = args.budget_mib * MIB
    try:
        for cp in args.cps:
            for seq_len in sorted(args.lengths):
                row = one_step(config, cp, seq_len)
                peaks = [None] * world
                dist.all_gather_object(peaks, row["peak_bytes"])
                row["fits"] = max(peaks) <= budget
                queue.put(row)
                if not row["fits"]:
                    break
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=32.0, help="activation budget per rank (MiB)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=str, default=None, help="write the rows and the summary as JSON")
    args = parser.parse_args()

    from lightning_zero.ports import free_port

    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    rows.sort(key=lambda row: (row["cp"], row["seq_len"], row["rank"]))
    print(f"budget {args.budget_mib:g} MiB of activations per rank; model {MODEL}; fp32, 2 ranks")
    header = f"{'cp':>3} {'seq':>7} {'rank':>4} {'saved MiB':>10} {'planned':>9} {'peak MiB':>9} {'planned':>9}  fits"
    print(header)
    for row in rows:
        print(
            f"{row['cp']:>3} {row['seq_len']:>7} {row['rank']:>4} {row['saved_bytes'] / MIB:>10.2f}"
            f" {row['planned_saved_bytes'] / MIB:>9.2f} {row['peak_bytes'] / MIB:>9.2f}"
            f" {row['planned_peak_bytes'] / MIB:>9.2f}  {row['fits']}"
        )
    longest = {
        cp: max((row["seq_len"] for row in rows if row["cp"] == cp and row["fits"]), default=0) for cp in args.cps
    }
    for cp, length in longest.items():
        print(f"longest sequence within {args.budget_mib:g} MiB per rank at cp={cp}: {length} tokens")
    if args.out:
        Path(args.out).write_text(json.dumps({"budget_mib": args.budget_mib, "model": MODEL, "rows": rows,
                                              "longest": longest}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
