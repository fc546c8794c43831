"""Interleaved A/B: one engine switch flipped every few steps inside one process pair (issue 24).

[Note: interleaved A/B] On the 2-core machines this project runs on, the same code moves 5-10%
between launches (docs/benchmarks.md, sessions 12-17): a change worth 1-2% of a step never shows
in ``bench_zero12.py --baseline-src``, whose A and B run in different process pairs minutes
apart. Here A and B run in the *same* two processes, alternating every ``--block`` steps, so they
share the host's state, the heap and the page cache. Both ranks flip the switch at the same step
(a collective pattern may differ between A and B; it never differs between ranks). A step is
timed from ``on_train_batch_start`` to ``on_train_batch_end``: everything of that step (its
forward, backward, the optimizer step, the post-step all-gather's launch); the gather's wait
lands in the next step's forward, whose side may be the other one at a block boundary (one step
in ``--block``). The report is the median step of each side with a bootstrap 95% interval of the
ratio B / A (2,000 resamples of each side's steps), per rank, wall and CPU seconds
(``time.process_time``: every thread of the rank).

Switches (``SWITCHES``: ``(trainer, on)``, called at every step's start on both ranks; A is main's
behaviour, B the alternative):

- ``polled_waits``: B waits on the engine's collectives by polling ``is_completed()`` with sleeps
  growing to 1 ms, as before [Note: sliced waits] (``zero/waits.py``); A blocks in slices.
- ``one_bucket_in_flight``: B launches a bucket's reduce-scatter only once the one before it
  finished (``max_buckets_in_flight=1``; A: 2, the default).

    python benchmarks/interleaved_ab.py --switch polled_waits --stage 1 --models issue24 \\
        --block 4 --pairs 8 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WARMUP = 3  # steps before any is timed


def model_shape(name: str, quick: bool) -> dict[str, int]:
    """``bench_zero12.py --models NAME`` (``--quick``: its tiny stand-in) as ``LlamaConfig`` fields."""
    from _harness import MODEL_FLAGS
    from bench_zero12 import MODELS, QUICK_MODELS

    flags = (QUICK_MODELS if quick else MODELS)[name]
    return {MODEL_FLAGS[flag.removeprefix("--")]: int(value) for flag, value in zip(flags[::2], flags[1::2])}


def _polled_waits(trainer: Any, on: bool) -> None:
    import lightning_zero.zero.waits as waits

    if not hasattr(waits, "_sliced_wire_work"):
        waits._sliced_wire_work = waits.wire_work
    waits.wire_work = (lambda work: None) if on else waits._sliced_wire_work


def _one_bucket_in_flight(trainer: Any, on: bool) -> None:
    """B: ``max_buckets_in_flight=1`` (A: the default, 2); the reducer reads it at every launch,
    and stage 2/3's pool, sized for the default, only uses fewer buffers."""
    import dataclasses

    reducer = trainer.strategy.engine.reducer
    if not hasattr(reducer, "_config_a"):
        reducer._config_a = reducer.config
    reducer.config = dataclasses.replace(reducer._config_a, max_buckets_in_flight=1) if on else reducer._config_a


SWITCHES: dict[str, Callable[[Any, bool], None]] = {
    "polled_waits": _polled_waits,
    "one_bucket_in_flight": _one_bucket_in_flight,
}


def ratio_interval(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """``median(b) / median(a)`` and its bootstrap 95% interval (seeded: the same steps, the same interval)."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a)))
        for _ in range(resamples)
    )
    return statistics.median(b) / statistics.median(a), ratios[resamples // 40], ratios[resamples - 1 - resamples // 40]


def worker(args: argparse.Namespace) -> None:
    from _probes import pin_rank_to_core

    pin_rank_to_core()
    import lightning as L

    from lightning_zero import ZeroStrategy
    from lightning_zero.planner.bench_model import (
        bench_config,
        bench_datamodule,
        bench_module,
        bench_trainer,
        seed_bench,
    )

    flip = SWITCHES[args.switch]
    steps = WARMUP + 2 * args.block * args.pairs

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.wall: dict[str, list[float]] = {"A": [], "B": []}
            self.cpu: dict[str, list[float]] = {"A": [], "B": []}
            self.side = "A"

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            self.side = "B" if (index // args.block) % 2 else "A"
            flip(trainer, self.side == "B")
            self.started = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if index >= WARMUP:
                self.wall[self.side].append(time.perf_counter() - self.started[0])
                self.cpu[self.side].append(time.process_time() - self.started[1])

    timer = Timer()
    config = bench_config(**model_shape(args.models, args.quick), max_seq_len=max(args.seq, 16))
    seed_bench()
    module = bench_module(config)
    data = bench_datamodule(config, seq_len=args.seq, batch_size=args.batch, max_steps=steps)
    trainer = bench_trainer(devices=2, max_steps=steps, callbacks=[timer], strategy=ZeroStrategy(stage=args.stage))
    trainer.fit(module, datamodule=data)
    out = Path(args.worker_dir) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps({"rank": trainer.global_rank, "wall": timer.wall, "cpu": timer.cpu}))


def driver(args: argparse.Namespace, argv: list[str]) -> int:
    from _harness import run_pair_json

    ranks = run_pair_json(Path(__file__).resolve(), argv, dict(os.environ), args.timeout)
    if ranks is None:
        return 1
    print(
        f"switch {args.switch} (B) against main (A): stage {args.stage}, model {args.models}"
        f"{' (quick)' if args.quick else ''}, batch {args.batch} x"
        f" seq {args.seq}; {args.pairs} pairs of {args.block}-step blocks after {WARMUP} warm-up steps"
    )
    print(f"{'rank':>4}  {'clock':5}  {'A median s':>10}  {'B median s':>10}  {'B / A':>6}  {'95% interval':>15}")
    rows = []
    for rank in ranks:
        for clock in ("wall", "cpu"):
            a, b = rank[clock]["A"], rank[clock]["B"]
            ratio, low, high = ratio_interval(a, b)
            rows.append({"rank": rank["rank"], "clock": clock, "a_median_s": statistics.median(a),
                         "b_median_s": statistics.median(b), "b_over_a": ratio, "interval_95": [low, high],
                         "a_steps_s": a, "b_steps_s": b})  # fmt: skip
            print(
                f"{rank['rank']:>4}  {clock:5}  {statistics.median(a):10.4f}  {statistics.median(b):10.4f}"
                f"  {ratio:6.3f}  {low:6.3f} - {high:6.3f}"
            )
    if args.out:
        payload = {"benchmark": "interleaved_ab", "args": {k: v for k, v in vars(args).items() if k != "worker_dir"}}
        Path(args.out).write_text(json.dumps({**payload, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", choices=sorted(SWITCHES), required=True, help="what B changes")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=1)
    parser.add_argument("--models", choices=("bench", "issue24", "small"), default="issue24", help="bench_zero12's")
    parser.add_argument("--quick", action="store_true", help="the model's tiny stand-in (a smoke test)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    return parse_ab_args(parser, argv, block=4)


def parse_ab_args(parser: argparse.ArgumentParser, argv: list[str], *, block: int) -> argparse.Namespace:
    """The arguments every interleaved A/B takes (blocks, pairs, timeout, output, the worker's
    directory), added to ``parser``, then ``argv`` parsed and checked."""
    parser.add_argument("--block", type=int, default=block, help="steps per side before the switch flips")
    parser.add_argument("--pairs", type=int, default=6, help="A blocks (and as many B blocks) timed")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds the pair may run")
    parser.add_argument("--out", default=None, help="write the steps and ratios as JSON here")
    parser.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.block < 1 or args.pairs < 1:
        parser.error(f"--block ({args.block}) and --pairs ({args.pairs}) must be at least 1")
    return args


def main(parse=None, worker=None, driver=None) -> int:
    """Run as the driver, or (``--worker-dir`` given) as one rank of the pair."""
    parse, worker, driver = parse or globals()["parse"], worker or globals()["worker"], driver or globals()["driver"]
    argv = sys.argv[1:]
    args = parse(argv)
    if args.worker_dir is not None:
        worker(args)
        return 0
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
