"""The planner: what every rank holds, sends and spends per step, before anything launches.

Modules, with imports flowing one way (ledger -> timing -> hardware -> plan -> fit -> arithmetic ->
search -> report; calibrate on its own):

- :mod:`~lightning_zero.planner.ledger`: the ZeRO paper's bytes per rank, Llama parameter counts
  and activation bytes (``lightning_zero.ledger`` re-exports it: public contract);
- :mod:`~lightning_zero.planner.timing`: the step-time model (FLOPs, collectives, the engine's
  overlap, simulated bucket by bucket; [Note: step-time model]);
- :mod:`~lightning_zero.planner.hardware`: ``conf/hardware`` configs;
- :mod:`~lightning_zero.planner.plan`: :class:`Plan` and the rows it holds (``MemoryPerRank``, ``TrafficPerRank``);
- :mod:`~lightning_zero.planner.arithmetic`: :func:`plan_run` / :func:`compare_stages`;
- :mod:`~lightning_zero.planner.fit`: the changes that would make a plan fit (``Plan.suggestions``);
- :mod:`~lightning_zero.planner.search`: :func:`search_layouts` (``plan.search=true``), planning
  its candidates as ``fit`` does;
- :mod:`~lightning_zero.planner.report`: Hydra config in, tables / JSON / plot out (:func:`run_plan`);
- :mod:`~lightning_zero.planner.calibrate`: ``lightning-zero plan calibrate`` (measures this machine);
- :mod:`~lightning_zero.planner.bench_model`: the benchmark's run, shared by calibration and ``benchmarks/``.
"""

from lightning_zero.planner.arithmetic import (
    PRECISIONS,
    STAGES,
    MemoryPerRank,
    Plan,
    PrecisionBytes,
    TrafficPerRank,
    compare_stages,
    plan_run,
    precision_bytes,
)
from lightning_zero.planner.hardware import Hardware, available_hardware, default_hardware_name, load_hardware
from lightning_zero.planner.report import plan_kwargs_from_config, run_plan
from lightning_zero.planner.search import Layout, SearchResult, search_layouts
from lightning_zero.planner.timing import StepTime, collective_seconds, step_time

__all__ = [
    "PRECISIONS",
    "STAGES",
    "Hardware",
    "Layout",
    "MemoryPerRank",
    "Plan",
    "PrecisionBytes",
    "SearchResult",
    "StepTime",
    "TrafficPerRank",
    "available_hardware",
    "collective_seconds",
    "compare_stages",
    "default_hardware_name",
    "load_hardware",
    "plan_kwargs_from_config",
    "plan_run",
    "precision_bytes",
    "run_plan",
    "search_layouts",
    "step_time",
]
