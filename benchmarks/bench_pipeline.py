"""The pipeline bubble measured on CPU beside the planned one, per schedule (issue 63).

Two gloo ranks run torch's schedules over Llama stages (``pp/schedule.py`` over
``models/llama/pipeline.py``) with ``pp/measure.py``'s ``MeasuredStage``, which timestamps every
forward, backward and weight-gradient action a rank computes. One step's measured bubble is the
idle share of both ranks between the first action's start and the last one's end:
``1 - sum(busy) / (pp * span)`` (``time.perf_counter`` is one monotonic clock for both processes
of a machine). Beside it: the bubble ``pp/simulate.py`` plans for the schedule with equal stages
(forward 1, backward 2) and with the stage costs this run measured (each stage's median forward
and backward), which is what the planner's step time carries. The loss the last stage computes
after its forward counts as idle here (it is not a stage action). Numbers on 2 shared cores are
noisy: each row is the median of ``--steps`` steps.

    python benchmarks/bench_pipeline.py --dim 256 --layers 8 --microbatches 8 --steps 5 --out pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "src"))  # this checkout's package, for the driver too

from interleaved_ab import main  # noqa: E402

CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from lightning_zero.models.llama.config import LlamaConfig
    from lightning_zero.models.llama.model import Llama, cross_entropy_loss
    from lightning_zero.models.llama.pipeline import llama_stages
    from lightning_zero.pp.layout import PipelineLayout
    from lightning_zero.pp.measure import MeasuredStage, schedule_stages
    from lightning_zero.pp.schedule import build_schedule, run_step

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig.from_name("tiny", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                   n_kv_heads=args.heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                                   max_seq_len=args.seq)  # fmt: skip
    torch.manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.microbatches * args.batch, args.seq))
    targets = torch.randint(0, args.vocab, batch.shape)
    results = {}
    for schedule, virtual in CASES:
        if schedule not in args.schedules:
            continue
        torch.manual_seed(0)
        model = Llama(config)
        layout = PipelineLayout(pp=2, schedule=schedule, n_layers=args.layers, microbatches=args.microbatches,
                                virtual_stages=virtual)  # fmt: skip
        stages = llama_stages(model, layout, rank)
        pipeline = build_schedule(layout, stages, None, torch.device("cpu"), cross_entropy_loss, MeasuredStage)
        steps = []
        for step in range(args.warmup + args.steps):
            for stage in schedule_stages(pipeline):
                stage.reset()
            dist.barrier()
            run_step(pipeline, layout, rank, batch, targets)
            for stage in stages.values():
                stage.zero_grad(set_to_none=True)
            if step >= args.warmup:
                steps.append({str(s.stage_index): s.spans for s in schedule_stages(pipeline)})
        results[schedule] = steps
    (Path(args.worker_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": results}))
    dist.destroy_process_group()


def step_bubble(ranks_spans: list[dict]) -> float:
    """Measured bubble of one step from each rank's ``{stage: [(start, end, kind)]}``."""
    spans = [[span for stage in rank.values() for span in stage] for rank in ranks_spans]
    start = min(s for rank in spans for s, _, _ in rank)
    end = max(e for rank in spans for _, e, _ in rank)
    busy = sum(e - s for rank in spans for s, e, _ in rank)
    return 1.0 - busy / (len(spans) * (end - start))


def planned_bubbles(schedule: str, virtual: int, args: argparse.Namespace, ranks_steps: list) -> tuple:
    """The bubble ``pp/simulate.py`` plans: equal stages (F 1, B 2), and this run's median stage costs."""
    from lightning_zero.pp.layout import PipelineLayout
    from lightning_zero.pp.simulate import StageCosts, trace_schedule

    layout = PipelineLayout(pp=2, schedule=schedule, n_layers=args.layers, microbatches=args.microbatches,
                            virtual_stages=virtual)  # fmt: skip
    durations: dict[tuple[int, str], list[float]] = {}
    for steps in ranks_steps:
        for step in steps:
            for stage, spans in step.items():
                for start, end, kind in spans:
                    durations.setdefault((int(stage), kind), []).append(end - start)

    def median(stage: int, kind: str) -> float:
        return statistics.median(durations.get((stage, kind), [0.0]))

    stages = range(layout.num_stages)
    split = any(kind == "W" for _, kind in durations)
    forward = tuple(median(s, "F") for s in stages)
    if split:  # "B" is then the input gradient, "W" the weight gradient
        costs = StageCosts(forward, tuple(median(s, "B") for s in stages), tuple(median(s, "W") for s in stages))
    else:
        costs = StageCosts(
            forward, tuple(median(s, "B") / 2 for s in stages), tuple(median(s, "B") / 2 for s in stages)
        )
    return trace_schedule(layout).bubble_fraction, trace_schedule(layout, costs).bubble_fraction


def driver(args: argparse.Namespace, argv: list[str]) -> int:
    from _harness import run_pair_json_from_src

    ranks = run_pair_json_from_src(Path(__file__).resolve(), argv, args.timeout, OMP_NUM_THREADS="1")
    if ranks is None:
        return 1
    print(
        f"pipeline bubble, pp=2 on 2 gloo ranks: dim {args.dim} x {args.layers} layers, {args.microbatches}"
        f" micro-batches of {args.batch} x {args.seq} tokens, median of {args.steps} steps"
    )
    print(f"{'schedule':>17}  {'planned (equal)':>15}  {'planned (measured costs)':>24}  {'measured':>8}  range")
    rows = []
    for schedule, virtual in CASES:
        if schedule not in args.schedules:
            continue
        per_rank = [rank["steps"][schedule] for rank in ranks]
        measured = [step_bubble([rank_steps[i] for rank_steps in per_rank]) for i in range(args.steps)]
        equal, costed = planned_bubbles(schedule, virtual, args, per_rank)
        row = {"schedule": schedule, "virtual_stages": virtual, "planned_equal_stages": equal,
               "planned_measured_costs": costed, "measured_median": statistics.median(measured),
               "measured_steps": measured}  # fmt: skip
        rows.append(row)
        print(
            f"{schedule:>17}  {equal:15.3f}  {costed:24.3f}  {row['measured_median']:8.3f}"
            f"  {min(measured):.3f} - {max(measured):.3f}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"benchmark": "bench_pipeline", "args": vars(args), "rows": rows}, indent=1)
        )
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1, help="samples per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", default=[name for name, _ in CASES])
    parser.add_argument("--timeout", type=float, default=1200, help="seconds the pair may run")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse, worker, driver))
