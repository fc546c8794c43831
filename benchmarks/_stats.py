"""The benchmark's numbers from the ranks' results: per-case rows, step-time ratios, the tables.

A case's step time is the median over all its measured steps in every round (a step takes as long
as its slower rank); its ratio to the baseline is the median over rounds of the ratio of the two
cases' medians within that round (:func:`step_ratio`, [Note: benchmark shape] in ``_harness.py``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

MIB = 2**20


def _round_medians(rounds: list[dict], key: str, combine: Any) -> list[Optional[float]]:
    """Per round: the median over its steps of ``combine`` over the ranks' ``key`` values for that
    step; ``None`` for a round that failed or whose ranks did not record ``key``."""
    return [
        statistics.median(combine(values) for values in zip(*(rank[key] for rank in r["ranks"])))
        if "ranks" in r and all(rank.get(key) for rank in r["ranks"])
        else None
        for r in rounds
    ]


def summarize(case: str, rounds: list[dict]) -> dict[str, Any]:
    """Merge the rounds and ranks of one case into the row the table and JSON show."""
    good = [r["ranks"] for r in rounds if "ranks" in r]
    if not good:
        return {"case": case, "error": rounds[0].get("error", "no result") if rounds else "not run"}
    # A step takes as long as its slower rank; median over every timed step of every round.
    step_times = [max(times) for ranks in good for times in zip(*(rank["step_s"] for rank in ranks))]
    round_medians = _round_medians(rounds, "step_s", max)
    # CPU seconds of a step: the mean of the ranks (each has a core of its own), median per round.
    cpu_round_medians = _round_medians(rounds, "cpu_s", statistics.fmean)
    faults_round_medians = _round_medians(rounds, "minor_faults", statistics.fmean)  # per rank and step
    first = good[-1]
    row: dict[str, Any] = {
        "case": case,
        "label": first[0]["label"],
        "step_s_median": statistics.median(step_times) if step_times else float("nan"),
        "step_s_round_medians": round_medians,
        "step_s_all": step_times,
        "cpu_s_round_medians": cpu_round_medians,
        "minor_faults_round_medians": faults_round_medians,
        "peak_rss_bytes": [max(ranks[r]["peak_rss_bytes"] for ranks in good) for r in range(2)],
        "rss_before_fit_bytes": [ranks_r["rss_before_fit_bytes"] for ranks_r in first],
        "state_bytes": [rank["state_bytes"] for rank in first],
        "state_points": [rank["state_points"] for rank in first],
        "predicted_state_bytes": first[0].get("predicted_state_bytes"),
        "sent_bytes_per_step": [rank["sent_bytes_per_step"] for rank in first],
        "sent_source": first[0].get("sent_source", "wrapped torch.distributed collectives"),
        "engine_sent_bytes_per_step": first[0].get("engine_sent_bytes_per_step"),
        "engine_control_bytes_per_step": first[0].get("engine_control_bytes_per_step"),
        "predicted_sent_bytes_per_step": first[0].get("predicted_sent_bytes_per_step"),
        "live_tensor_bytes_before_step": [rank["live_tensor_bytes_before_step"] for rank in first],
        "saved_activation_bytes": [rank.get("saved_activation_bytes") for rank in first],
        "engine_sent_bytes_per_step_by_kind": [rank.get("engine_sent_bytes_per_step_by_kind") for rank in first],
        "num_params": first[0]["num_params"],
        "notes": first[0].get("notes", ""),
        "extra": overlap_summary([e for ranks in good for e in ranks[0]["extra"] if "comm_s" in e]),
        "engine_sent_calls_per_step": first[0].get("engine_sent_calls_per_step"),
        "failed_rounds": len(rounds) - len(good),
    }
    # Per-step end-of-backward wait (bench_zero12's timer): a step waits for its slower rank.
    tails = [
        max(steps)
        for ranks in good
        for steps in zip(*([e.get("backward_tail_s") for e in rank["extra"]] for rank in ranks))
        if all(t is not None for t in steps)
    ]
    if tails:
        row["backward_tail_s_median"] = statistics.median(tails)
    return row


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def round_ratios(row: dict, base: dict, key: str = "step_s_round_medians") -> list[float]:
    """This case's round median over the baseline's in the same round, for every round both ran
    (``key``: ``"step_s_round_medians"``, wall, or ``"cpu_s_round_medians"``, CPU seconds)."""
    return [
        mine / theirs
        for mine, theirs in zip(row.get(key) or [], base.get(key) or [])
        if mine is not None and theirs is not None
    ]


def step_ratio(row: dict, base: dict, key: str = "step_s_round_medians") -> float:
    """Median over rounds of (this case's median step time / the baseline's) in the same round.

    The load of a shared machine drifts over minutes; a ratio within one round compares cases
    that ran a minute apart, and the median over rounds drops the round a burst of load hit.
    """
    ratios = round_ratios(row, base, key)
    return statistics.median(ratios) if ratios else float("nan")


def format_table(rows: list[dict], baseline: str) -> str:
    """The side-by-side table: one row per case; step-time ratios to ``baseline`` by :func:`step_ratio`."""
    base = next((r for r in rows if r["case"] == baseline and "error" not in r), None)
    header = (
        f"{'case':<18}{'step s':>8}{'x ' + baseline:>9}{'CPU s':>8}{'faults':>8}{'peak RSS MiB r0/r1':>20}"
        f"{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}{'formula':>9}{'sent MiB/step':>15}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['case']:<18}  did not run: {row['error']}")
            continue
        state = row["state_bytes"][0]
        ratio = step_ratio(row, base) if base else float("nan")
        rss = "/".join(f"{b / MIB:,.0f}" for b in row["peak_rss_bytes"])
        predicted = row.get("predicted_state_bytes")
        sent = sum(row["sent_bytes_per_step"][0].values())
        cpus = [c for c in row.get("cpu_s_round_medians") or [] if c is not None]
        cpu = f"{statistics.median(cpus):.3f}" if cpus else "-"
        fault_counts = [f for f in row.get("minor_faults_round_medians") or [] if f is not None]
        faults = f"{statistics.median(fault_counts):,.0f}" if fault_counts else "-"
        lines.append(
            f"{row['case']:<18}{row['step_s_median']:>8.3f}{ratio:>9.2f}{cpu:>8}{faults:>8}{rss:>20}"
            f"{_mb(state.get('params')):>9}{_mb(state.get('grads')):>9}{_mb(state.get('optimizer')):>9}"
            f"{_mb(state.get('total')):>9}{_mb(predicted['total'] if predicted else None):>9}{sent / MIB:>15,.1f}"
        )
    return "\n".join(lines)


def machine_note() -> dict[str, Any]:
    import platform

    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "loadavg_at_end": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def overlap_summary(extra: list[dict[str, float]]) -> dict[str, float]:
    """Medians of our engine's per-step gradient collective time and its exposed part."""
    comm = statistics.median(e["comm_s"] for e in extra) if extra else 0.0
    exposed = statistics.median(e["exposed_wait_s"] for e in extra) if extra else 0.0
    return {
        "comm_s_median": comm,
        "exposed_wait_s_median": exposed,
        "overlap_fraction": (1 - exposed / comm) if comm > 0 else 0.0,
    }


def comm_table(rows: list[dict]) -> str:
    """Our cases: bytes sent per step by the engine's counter, by the tap, by the formula; overlap."""
    header = (
        f"{'case':<18}{'engine MiB/step':>16}{'tapped MiB/step':>16}{'formula':>10}"
        f"{'comm s':>9}{'exposed s':>10}{'hidden':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row or row.get("engine_sent_bytes_per_step") is None:
            continue
        extra = row["extra"]
        tapped = sum(row["sent_bytes_per_step"][0].values())
        lines.append(
            f"{row['case']:<18}{row['engine_sent_bytes_per_step'] / MIB:>16,.2f}{tapped / MIB:>16,.2f}"
            f"{row['predicted_sent_bytes_per_step'] / MIB:>10,.2f}{extra.get('comm_s_median', 0):>9.3f}"
            f"{extra.get('exposed_wait_s_median', 0):>10.3f}{extra.get('overlap_fraction', 0):>8.0%}"
        )
    return "\n".join(lines)


def state_vs_formula(row: dict) -> str:
    """``<case>: model-state bytes N vs formula M (+x%)`` for rank 0 of ``row``."""
    got, want = row["state_bytes"][0]["total"], row["predicted_state_bytes"]["total"]
    return f"{row['case']}: model-state bytes {got:,} vs formula {want:,.0f} ({got / want - 1:+.2%})"
