"""gloo's collectives on this machine, one against another: why ``lightning_zero.comm.collectives``
reduce-scatters with an all-to-all on gloo ([Note: reduce-scatter on gloo]).

    python benchmarks/gloo_collectives.py [--sizes-mb 1 10 25] [--repeats 15] [--ranks 2] [--out gloo.json]

Per size (MiB of fp32 in the full tensor), the median wall time of: DDP's ``all_reduce``; gloo's
own reduce-scatter (``reduce_scatter_single`` / ``reduce_scatter_tensor``); ours
(``lightning_zero.comm.collectives.reduce_scatter``: an all-to-all, then the sum of this rank's chunk);
the all-gather stages 1-2 run after the step. Each rank is pinned to its own core with one torch
thread, as the other CPU benchmarks run. Per case, the slower rank's median.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _worker(rank: int, ranks: int, port: int, sizes_mb: list[float], repeats: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_zero.comm.collectives import all_gather, reduce_scatter

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def cases(full: torch.Tensor, chunk: torch.Tensor, gathered: torch.Tensor) -> dict:
        return {
            "all_reduce (ddp)": lambda: dist.all_reduce(full),
            "gloo reduce_scatter": lambda: native(chunk, full),
            "ours reduce_scatter": lambda: reduce_scatter(chunk, full, None),
            "all_gather": lambda: all_gather(gathered, chunk, None),
        }

    rows = []
    for size_mb in sizes_mb:
        numel = int(size_mb * 2**20) // 4 // ranks * ranks
        row = {"size_mb": size_mb}
        for name, run in cases(torch.randn(numel), torch.empty(numel // ranks), torch.empty(numel)).items():
            for _ in range(3):
                run()
            dist.barrier()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            row[name] = statistics.median(times)
        rows.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 10.0, 25.0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lz_gloo_") as out_dir:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        processes = [
            context.Process(target=_worker, args=(rank, args.ranks, port, args.sizes_mb, args.repeats, out_dir))
            for rank in range(args.ranks)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
            if process.is_alive():
                process.kill()
        if any(process.exitcode != 0 for process in processes):
            print("gloo_collectives: a worker failed", file=sys.stderr)
            return 1
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    rows = [
        {key: (max(r[i][key] for r in per_rank) if key != "size_mb" else row[key]) for key in row}
        for i, row in enumerate(per_rank[0])
    ]
    names = [key for key in rows[0] if key != "size_mb"]
    print(f"{args.ranks} gloo ranks, median of {args.repeats}, ms (slower rank)")
    print(f"{'MiB':>6}" + "".join(f"{name:>22}" for name in names))
    for row in rows:
        print(f"{row['size_mb']:>6g}" + "".join(f"{row[name] * 1e3:>22.2f}" for name in names))
    if args.out is not None:
        args.out.write_text(json.dumps({"benchmark": "gloo_collectives", "ranks": args.ranks, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
