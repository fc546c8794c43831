"""The planner: what every rank holds, sends and spends per step, before anything launches.

Modules, with imports flowing one way (ledger -> hardware -> workload -> timing -> plan -> moe ->
traffic -> fit -> arithmetic -> search -> tables -> report; measure -> calibrate on their own):

- :mod:`~lightning_zero.planner.ledger`: the ZeRO paper's bytes per rank, Llama parameter counts
  and activation bytes (``lightning_zero.ledger`` re-exports it: public contract);
- :mod:`~lightning_zero.planner.hardware`: a collective's time on a link, ``conf/hardware`` configs;
- :mod:`~lightning_zero.planner.workload`: what a micro batch computes (FLOPs, seconds per tensor
  and unit) and the gradient buckets the engine cuts;
- :mod:`~lightning_zero.planner.timing`: the step-time model (the engine's overlap, simulated
  bucket by bucket; [Note: step-time model]);
- :mod:`~lightning_zero.planner.plan`: :class:`Plan` and the rows it holds (``MemoryPerRank``, ``TrafficPerRank``);
- :mod:`~lightning_zero.planner.moe`: expert parallelism's all-to-all bytes (from routing counts; balanced);
- :mod:`~lightning_zero.planner.traffic`: the bytes a rank sends per step (dp per link and hop, tp per collective);
- :mod:`~lightning_zero.planner.arithmetic`: ``plan`` (the run whole), :func:`plan_run` (keywords) / :func:`compare_stages`;
- :mod:`~lightning_zero.planner.fit`: the changes that would make a plan fit (``Plan.suggestions``);
- :mod:`~lightning_zero.planner.search`: :func:`search_layouts` (``plan.search=true``), planning
  its candidates as ``fit`` does;
- :mod:`~lightning_zero.planner.tables`: tables, JSON, the memory plot, the search ranking;
- :mod:`~lightning_zero.planner.report`: Hydra config in, those out (:func:`run_plan`);
- :mod:`~lightning_zero.planner.calibrate`: ``lightning-zero plan calibrate`` (fits what
  :mod:`~lightning_zero.planner.measure` times on this machine, writes the hardware YAML);
- :mod:`~lightning_zero.planner.bench_model`: the benchmark's run, shared by calibration and ``benchmarks/``.

[Note: planner imports] The names below load their module on first use (PEP 562), so importing
one module of the planner (``lightning_zero.ledger`` and the monitor read
:mod:`~lightning_zero.planner.ledger`'s formulas) does not pull the step-time model, the search,
the report or omegaconf behind it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {  # public name -> the planner module that defines it
    "PRECISIONS": "ledger",
    "STAGES": "arithmetic",
    "MemoryPerRank": "plan",
    "Plan": "plan",
    "PrecisionBytes": "ledger",
    "TrafficPerRank": "plan",
    "compare_stages": "arithmetic",
    "plan_run": "arithmetic",
    "precision_bytes": "ledger",
    "Hardware": "hardware",
    "available_hardware": "hardware",
    "default_hardware_name": "hardware",
    "load_hardware": "hardware",
    "plan_inputs_from_config": "report",
    "run_plan": "report",
    "Layout": "search",
    "SearchResult": "search",
    "search_layouts": "search",
    "StepTime": "timing",
    "collective_seconds": "hardware",
    "step_time": "timing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Load the module behind a public name on first use ([Note: planner imports])."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
