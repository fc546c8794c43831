"""Muon's optimizer step under ZeRO against AdamW's at the same size, as an interleaved A/B (issue 65).

Both sides live in the same two gloo processes ([Note: interleaved A/B] in ``interleaved_ab.py``):
two copies of one Llama, each under its own ``ZeroEngine`` (stage ``--stage``), A stepping every
hidden matrix with AdamW, B with ``torch.optim.Muon`` (owners, ``zero/matrix_optimizer.py``); the
embeddings, head and norms take AdamW on both. Every step runs forward and backward on both
copies and times both ``optimizer.step()`` s (the step, the owner exchanges of B, the post-step
parameter all-gather, waited for), which side goes first flipping every ``--block`` steps. The
report is each side's median step and the bootstrap 95 % interval of B / A per rank, with the
bytes B's owner exchange counted per step beside ``MatrixOwnerOptimizer.planned_bytes()``.

    python benchmarks/bench_muon.py --dim 256 --layers 4 --ffn 688 --block 3 --pairs 6 --out muon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
WARMUP = 2

from interleaved_ab import main, parse_ab_args, ratio_interval  # noqa: E402


def _optimizers(model, muon: bool):
    import torch

    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embeddings" not in n and "output" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in hidden)]
    first = torch.optim.Muon(hidden, lr=0.02) if muon else torch.optim.AdamW(hidden, lr=1e-3)
    return [first, torch.optim.AdamW(rest, lr=1e-3)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from _probes import pin_rank_to_core

    pin_rank_to_core()
    from lightning_zero.config import ZeroConfig
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig.from_name("tiny", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                   n_kv_heads=args.heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                                   max_seq_len=args.seq)  # fmt: skip
    sides = {}
    for side, muon in (("A", False), ("B", True)):
        torch.manual_seed(0)
        model = Llama(config)
        optimizers = _optimizers(model, muon)
        sides[side] = (model, optimizers, ZeroEngine(model, optimizers, ZeroConfig(stage=args.stage)))
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"A": [], "B": []}
    steps = WARMUP + 2 * args.block * args.pairs
    muon_bytes = []
    for step in range(steps):
        order = ("B", "A") if ((step - WARMUP) // args.block) % 2 else ("A", "B")  # who goes first flips
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        for side in order:
            model, optimizers, engine = sides[side]
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            engine.backward(loss)
            before = dict(engine.counter.bytes)
            dist.barrier()
            started = time.perf_counter()
            for optimizer in optimizers:
                optimizer.step()
            engine.wait_param_gathers()
            elapsed = time.perf_counter() - started
            for optimizer in optimizers:
                optimizer.zero_grad()
            if step >= WARMUP:
                times[side].append(elapsed)
            if side == "B":
                after = engine.counter.bytes
                muon_bytes.append({k: after[k] - before.get(k, 0) for k in after if k.startswith("muon_")})
    planned = sides["B"][2].sharded_optimizer(sides["B"][1][0]).planned_bytes()
    out = Path(args.worker_dir) / f"rank{rank}.json"
    out.write_text(json.dumps({"rank": rank, "times": times, "measured": muon_bytes[-1], "planned": planned}))
    for _, _, engine in sides.values():
        engine.close()
    dist.destroy_process_group()


def driver(args: argparse.Namespace, argv: list[str]) -> int:
    from _harness import run_pair_json_from_src

    ranks = run_pair_json_from_src(Path(__file__).resolve(), argv, args.timeout)
    if ranks is None:
        return 1
    print(
        f"Muon (B) vs AdamW (A) optimizer step, stage {args.stage}, dim {args.dim} x {args.layers} layers,"
        f" ffn {args.ffn}; {args.pairs} pairs of {args.block}-step blocks, 2 gloo ranks"
    )
    print(f"{'rank':>4}  {'A median s':>10}  {'B median s':>10}  {'B / A':>6}  {'95% interval':>15}  bytes/step")
    rows = []
    for rank in ranks:
        a, b = rank["times"]["A"], rank["times"]["B"]
        ratio, low, high = ratio_interval(a, b)
        rows.append({"rank": rank["rank"], "a_median_s": statistics.median(a), "b_median_s": statistics.median(b),
                     "b_over_a": ratio, "interval_95": [low, high], "measured_bytes": rank["measured"],
                     "planned_bytes": rank["planned"]})  # fmt: skip
        print(
            f"{rank['rank']:>4}  {statistics.median(a):10.4f}  {statistics.median(b):10.4f}  {ratio:6.3f}"
            f"  {low:6.3f} - {high:6.3f}  measured {rank['measured']} planned {rank['planned']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "bench_muon", "args": vars(args), "rows": rows}, indent=1))
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    return parse_ab_args(parser, argv, block=3)


if __name__ == "__main__":
    sys.exit(main(parse, worker, driver))
