"""Tensor parallel (tp=2), with and without sequence parallelism, against data parallel (dp=2)
on 2 CPU ranks, through ZeroStrategy (issues 5, 23).

    python benchmarks/bench_tp.py --out results_tp.json

Cases: ``tp2`` is ``ZeroStrategy(stage=2, tensor_parallel_size=2)`` (tp=2, dp=1: each rank holds
half of every block and of the vocabulary; both ranks see the same batch), ``tp2_sp`` the same
with ``sequence_parallel=True`` (the norms and residuals on T/tp tokens per rank), each also with
``LlamaLM(activation_checkpointing="selective" | "full")`` (``tp2_selective``, ``tp2_sp_full``,
...), and ``dp2``: ``ZeroStrategy(stage=2, tensor_parallel_size=1)`` (each rank its own batch).

Per case: the activation bytes each rank keeps for backward, measured in the probe step
([Note: measuring saved activations] in ``lightning_zero/planner/saved_activations.py``), beside the
planner's ``llama_activation_bytes(...).saved_after_forward(mode)``; logical bytes sent per step
per collective kind as the strategy's ``CommCounter`` labels them (tp: the activations'
all-reduces, or all-gathers and reduce-scatters with sequence parallelism, beside the planner's
``tp_bytes_by_kind``; the vocab-parallel loss's all-reduces; dp: gradient reduce-scatter +
parameter all-gather beside the ZeRO formula, ``lightning_zero/comm/ring.py``); step time, its
same-round ratio to ``tp2``, and tokens per second over both ranks (dp=2 trains on twice the
tokens per step at the same per-rank batch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple, Union

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import bench_main, drive, model_config, run_worker  # noqa: E402
from _stats import MIB, step_ratio  # noqa: E402
from bench_zero12 import zero_at_end, zero_state_bytes, zero_step_extra  # noqa: E402


class Case(NamedTuple):
    tp: int  # tensor_parallel_size (dp = 2 // tp)
    sequence_parallel: bool
    checkpointing: Union[bool, str]  # LlamaLM(activation_checkpointing=...)


CASES = {
    "tp2": Case(2, False, False),
    "tp2_sp": Case(2, True, False),
    "tp2_selective": Case(2, False, "selective"),
    "tp2_sp_selective": Case(2, True, "selective"),
    "tp2_full": Case(2, False, "full"),
    "tp2_sp_full": Case(2, True, "full"),
    "dp2": Case(1, False, False),
}


def worker(args: argparse.Namespace) -> None:
    case = CASES[args.worker]

    def make_strategy() -> Any:
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(  # collective_timeout=None: the path GPUs run (see bench_zero12.py)
            stage=2,
            tensor_parallel_size=case.tp,
            sequence_parallel=case.sequence_parallel,
            bucket_mb=args.bucket_mb,
            monitor=False,
            collective_timeout=None,
        )

    def make_module(config: Any) -> Any:
        from lightning_zero.planner.bench_model import bench_module

        return bench_module(config, activation_checkpointing=case.checkpointing)

    run_worker(
        args,
        label=f"ZeroStrategy(stage=2, tensor_parallel_size={case.tp}, sequence_parallel={case.sequence_parallel}),"
        f" activation_checkpointing={case.checkpointing!r}",
        stage=2,
        make_strategy=make_strategy,
        make_module=make_module,
        state_bytes=zero_state_bytes,
        extra_step=zero_step_extra,
        at_end=tp_at_end,
        measure_activations=True,
    )


def tp_at_end(trainer: Any, max_steps: int) -> dict[str, Any]:
    """``zero_at_end`` plus the strategy's counter per kind: every step sends the same (the tp
    layers and the dp engine count into one ``CommCounter``, ``strategy_setup.find_tp_counter``)."""
    counter = trainer.strategy.engine.counter
    return {
        **zero_at_end(trainer, max_steps),
        "engine_sent_bytes_per_step_by_kind": {kind: sent / max_steps for kind, sent in counter.bytes.items()},
    }


def predicted(args: argparse.Namespace, case: Case) -> dict[str, Any]:
    """What the planner says one rank keeps for backward and sends per step in ``case``: its
    activation bytes (``llama_activation_bytes``) and tp bytes per kind (``tp_bytes_by_kind``);
    the loss's all-reduces (which the planner leaves out) and the dp ring formula."""
    from lightning_zero.ledger import llama_activation_bytes
    from lightning_zero.planner.traffic import tp_bytes_by_kind

    config = model_config(args)
    tp, dp = case.tp, 2 // case.tp
    tokens = args.batch * args.seq
    ring = 2 * (tp - 1) / tp
    norm_params = (2 * config.n_layers + 1) * config.dim  # replicated over tp
    params_per_rank = (config.num_params() - norm_params) / tp + norm_params
    activations = llama_activation_bytes(
        config, micro_batch=args.batch, seq_len=args.seq, act_bytes=4, tp=tp, sequence_parallel=case.sequence_parallel
    )
    tp_by_kind = tp_bytes_by_kind(
        config,
        tokens=tokens,
        tp=tp,
        act_bytes=4,
        activation_checkpointing=case.checkpointing,
        sequence_parallel=case.sequence_parallel,
    )
    return {
        "saved_activation_bytes": activations.saved_after_forward(case.checkpointing),
        "activation_peak_bytes": activations.total(case.checkpointing),
        "tp_by_kind": tp_by_kind,
        "tp_activations": sum(tp_by_kind.values()),
        "tp_loss": ring * 3 * tokens * 4,  # max, then (sum of exp, target logit) per token, fp32
        "dp": 2 * (dp - 1) / dp * 4 * params_per_rank,
    }


TP_KINDS = (  # the CommCounter labels of the tp group (tp/layers.py, tp/loss.py), in table order
    "tp_all_reduce",
    "tp_all_gather_seq",
    "tp_reduce_scatter_seq",
    "tp_all_reduce_norm_grad",
    "tp_all_reduce_loss",
)


def report(rows: list[dict], args: argparse.Namespace) -> list[str]:
    by_case = {row["case"]: row for row in rows if "error" not in row}
    for name, row in by_case.items():
        want = predicted(args, CASES[name])
        row["predicted_sent_bytes_per_step_by_group"] = want
        row["predicted_saved_activation_bytes"] = want["saved_activation_bytes"]
        row["predicted_activation_peak_bytes"] = want["activation_peak_bytes"]
        row["predicted_tp_sent_bytes_per_step_by_kind"] = {**want["tp_by_kind"], "tp_all_reduce_loss": want["tp_loss"]}
    return [
        *sent_table(by_case, args),
        "",
        *activation_table(by_case),
        "",
        *tp_kind_table(by_case),
        "",
        *sp_lines(by_case),
    ]


def sent_table(by_case: dict[str, dict], args: argparse.Namespace) -> list[str]:
    """Bytes on the tp group (every ``tp_*`` kind of rank 0's counter) and on the dp group."""
    header = (
        f"{'case':<18}{'tp MiB/step':>13}{'formula':>10}{'dp MiB/step':>13}{'formula':>10}"
        f"{'step s':>9}{'tokens/s':>10}{'params MiB/rank':>17}"
    )
    lines = [header, "-" * len(header)]
    for name, row in by_case.items():
        want = row["predicted_sent_bytes_per_step_by_group"]
        sent = row["engine_sent_bytes_per_step_by_kind"][0] or {}
        tp_sent = sum(v for kind, v in sent.items() if kind.startswith("tp_"))
        dp_sent = sum(v for kind, v in sent.items() if not kind.startswith("tp_"))
        tokens_per_step = args.batch * args.seq * (2 // CASES[name].tp)
        lines.append(
            f"{name:<18}{tp_sent / MIB:>13,.2f}{(want['tp_activations'] + want['tp_loss']) / MIB:>10,.2f}"
            f"{dp_sent / MIB:>13,.2f}{want['dp'] / MIB:>10,.2f}{row['step_s_median']:>9.3f}"
            f"{tokens_per_step / row['step_s_median']:>10,.0f}{row['state_bytes'][0]['params'] / MIB:>17,.1f}"
        )
    return lines


def activation_table(by_case: dict[str, dict]) -> list[str]:
    """Activation bytes each rank keeps for backward (probe step) beside the planner's."""
    from lightning_zero.models.checkpointing import checkpointing_mode

    header = (
        f"{'case':<18}{'sp':>4}{'ckpt':>11}{'saved MiB r0':>14}{'r1':>9}{'planner':>10}{'diff':>8}"
        f"{'planner peak':>14}{'step s':>9}{'x tp2':>8}"
    )
    lines = ["activations kept for backward per rank (after forward), measured vs planner", header]
    lines.append("-" * len(header))
    base = by_case.get("tp2")
    for name, row in by_case.items():
        case = CASES[name]
        measured = row["saved_activation_bytes"]
        want = row["predicted_saved_activation_bytes"]
        diff = max(abs(m / want - 1) for m in measured) if None not in measured else float("nan")
        ratio = step_ratio(row, base) if base is not None else float("nan")
        r0, r1 = (f"{m / MIB:,.2f}" if m is not None else "-" for m in measured)
        sp, mode = "yes" if case.sequence_parallel else "no", checkpointing_mode(case.checkpointing)
        lines.append(
            f"{name:<18}{sp:>4}{mode:>11}{r0:>14}{r1:>9}"
            f"{want / MIB:>10,.2f}{diff:>8.2%}{row['predicted_activation_peak_bytes'] / MIB:>14,.2f}"
            f"{row['step_s_median']:>9.3f}{ratio:>8.2f}"
        )
    return lines


def tp_kind_table(by_case: dict[str, dict]) -> list[str]:
    """Rank 0's tp bytes per step per ``CommCounter`` kind: counted / planner, in KiB."""
    header = f"{'case':<18}" + "".join(f"{kind[3:]:>24}" for kind in TP_KINDS)
    lines = ["tp KiB sent per step per kind, counted / planner (loss: 2 (tp-1)/tp * 3 * B * T * 4)", header]
    lines.append("-" * len(header))
    for name, row in by_case.items():
        if CASES[name].tp == 1:
            continue
        sent = row["engine_sent_bytes_per_step_by_kind"][0] or {}
        want = row["predicted_tp_sent_bytes_per_step_by_kind"]
        cells = [f"{sent.get(kind, 0.0) / 1024:,.1f} / {want.get(kind, 0.0) / 1024:,.1f}" for kind in TP_KINDS]
        lines.append(f"{name:<18}" + "".join(f"{cell:>24}" for cell in cells))
    return lines


def sp_lines(by_case: dict[str, dict]) -> list[str]:
    """Sequence parallelism against plain TP at each checkpointing mode, same-round step ratios."""
    lines = []
    for suffix in ("", "_selective", "_full"):
        plain, sp = by_case.get(f"tp2{suffix}"), by_case.get(f"tp2_sp{suffix}")
        if plain is None or sp is None or None in plain["saved_activation_bytes"] + sp["saved_activation_bytes"]:
            continue
        kept, kept_plain = sp["saved_activation_bytes"][0], plain["saved_activation_bytes"][0]
        sent = sum((sp["engine_sent_bytes_per_step_by_kind"][0] or {}).values())
        sent_plain = sum((plain["engine_sent_bytes_per_step_by_kind"][0] or {}).values())
        lines.append(
            f"tp2_sp{suffix} vs tp2{suffix}: keeps {kept / MIB:,.2f} MiB of activations per rank instead of"
            f" {kept_plain / MIB:,.2f} ({kept / kept_plain - 1:+.1%}), sends {sent / MIB:,.2f} MiB per step instead of"
            f" {sent_plain / MIB:,.2f}, step time {step_ratio(sp, plain):.3f}x (same-round median)"
        )
    if "tp2" in by_case and "dp2" in by_case:
        ratio = step_ratio(by_case["tp2"], by_case["dp2"])
        lines.append(f"tp=2 step time {ratio:.3f}x dp=2 at the same per-rank batch (half the tokens per step)")
    return lines


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    drive(
        "tp",
        str(Path(__file__).resolve()),
        args,
        argv,
        known_cases=CASES,
        baseline="dp2",
        report=lambda rows: report(rows, args),
    )


if __name__ == "__main__":
    bench_main(__doc__.split("\n\n")[0], CASES, worker, driver)
