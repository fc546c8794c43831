"""The run's monitor, one for both doors: bytes held and sent, overlap, throughput, no device sync.

[Note: the monitor] :class:`Monitor` is fed where a door sees a step: the start of each training
micro batch (:meth:`Monitor.micro_batch`) and the end of each optimizer step
(:meth:`Monitor.step_end`, which returns the step's metrics and keeps them in ``history``). The
Trainer door's ``ZeroMonitor`` (``trainer/monitor.py``) logs them through the LightningModule's
``log_dict``; the Fabric door (``ZeroFabricStrategy(monitor=True)``, the default) measures at its
forward pre-hook and optimizer-step hook and reports through ``fabric.log_dict`` once a loop called
``fabric.strategy.report_to(fabric)`` (else ``fabric.strategy.monitor_metrics()`` is the last
step's). Nothing here reads a device value on the host: peak memory is the allocator's counter,
times on CUDA are the previous step's events (done by then), throughput is host time.

The metrics, per optimizer step (every rank computes its own):

- ``zero/measured_{params,grads,optimizer,total}_bytes``: what the engine holds now;
- ``zero/predicted_{params,grads,optimizer,total}_bytes``: ``ledger.model_state_bytes`` for the
  same stage, dp and precision, the optimizer state of every optimizer the engine holds on this
  rank (Muon's momenta by ownership, the Plan's rule: :func:`predicted_state_bytes`);
- ``zero/peak_memory_bytes``: peak CUDA memory, or the process's peak RSS on CPU;
- ``zero/sent_bytes/<kind>``: logical bytes this rank sent in the step, per collective kind
  (see [Note: logical bytes] in ``collectives.py``);
- ``zero/sent_bytes_by_link/{intra_node,inter_node}``: the same bytes by the link they cross (a
  collective whose group spans nodes counts as ``inter_node``; [Note: link classes]);
- ``zero/comm_s``, ``zero/exposed_comm_s``, ``zero/overlap_fraction``: gradient collective time
  (each bucket's launch to completion), the part of it after backward ended (not hidden behind
  backward compute), and the hidden fraction ``(comm - exposed) / comm`` (see
  ``zero.timeline.SyncTimeline``). Measured on the device's own clock: CUDA events on CUDA (host
  times mean nothing there: NCCL's launch and wait return at once), host time on CPU, where gloo
  shares the cores with backward, so the figure checks ordering more than speed. On CUDA they are
  the previous step's (0 at the first): reading this step's events would make the host wait for
  the device every step;
- ``zero/first_launch_before_backward_end``: 1 when the first bucket's reduce-scatter started
  while backward was still running;
- ``zero/step_time_s``, ``zero/tokens_per_s`` (this rank), ``zero/tokens_per_s_total`` (x dp x cp) and
  ``zero/mfu`` (model FLOPs / step time / the hardware config's peak; only with a hardware
  config: ``ZeroMonitor(hardware=...)``, or detected from the CUDA device's name), see
  [Note: throughput] in ``throughput.py``;
- for a mixture of experts (a model with ``take_moe_stats``, ``models/moe``):
  ``moe/layer<i>/tokens_{min,mean,max}`` (assignments per expert of this rank's micro-batches in
  the step) and ``moe/balance_loss``, ``moe/z_loss``, read without a device sync ([Note: expert
  load without a sync] in ``runtime/expert_load.py``; on CUDA the previous step's).

Warnings (:meth:`Monitor.overlap_warning`, once): every parameter group's gradients fit in one
bucket (nothing can overlap; it says which ``bucket_mb`` would), or, on CUDA, ``overlap_comm=True``
but less than half of the collective time was hidden; :meth:`Monitor.summary_lines` is the table a
door prints when the run ends.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Optional

import torch

from lightning_zero.comm.collectives import LINK_CLASSES
from lightning_zero.planner.ledger import (
    grad_bytes_per_param,
    held_state_bytes,
    model_state_bytes,
    momenta_by_owner,
    optimizer_state_bytes,
    policy_bytes,
)
from lightning_zero.precision import engine_policy
from lightning_zero.runtime.expert_load import ExpertLoadMeter
from lightning_zero.runtime.throughput import (
    ThroughputMeter,
    batch_tokens,
    hardware_for_device,
    peak_flops_for,
    training_flops_of,
)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory on ``device``, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def predicted_bytes(engine: Any, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, float]:
    """The ledger's per-rank model-state bytes for what ``engine`` manages (the bytes per
    parameter come from the ledger's one rule: ``precision_bytes`` and ``optimizer_state_bytes``).

    ``optimizer``: count every parameter's state as that optimizer's, ``1/dp`` each (the plan's
    figure); ``None`` (the monitor's): the state of every optimizer the engine holds, on this
    rank, by :func:`predicted_state_bytes`, so a Muon run's momenta count by ownership."""
    policy = engine_policy(engine.compute_dtype, getattr(engine, "master_dtype", torch.float32))
    per_param = policy_bytes(policy)
    reduce_dtype = "fp32" if getattr(engine, "reduce_dtype", None) == torch.float32 else "compute"
    local_experts, ep = engine.expert_split()  # [Note: expert domain]: experts / ep, sharded over edp
    state = 0 if optimizer is None else optimizer_state_bytes(optimizer)
    predicted = model_state_bytes(
        engine.num_params() + (ep - 1) * local_experts,
        expert_params=ep * local_experts,
        ep=ep,
        stage=engine.stage,
        defer_grad_reduce=engine.defer_grad_reduce,
        dp=engine.dp_size,
        param_bytes=per_param.param,
        grad_bytes=grad_bytes_per_param(policy.name, reduce_dtype, policy.mixed_params),
        optim_bytes_per_param=per_param.optimizer_bytes(state),
    ).as_dict()
    if optimizer is None:
        predicted["optimizer"] += predicted_state_bytes(engine, per_param.state)
        predicted["total"] = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    return predicted


def predicted_state_bytes(engine: Any, state_bytes: int) -> int:
    """Optimizer-state bytes this rank holds by the planner's rules, over every optimizer of
    ``engine`` (``state_bytes``: bytes per state element): a matrix optimizer's momenta by
    ownership (``ledger.momenta_by_owner``: the matrices this rank owns, whole, per
    domain), any other's state on this rank's runs of its parameters (its ``1/dp`` share,
    ``ledger.held_state_bytes``). Every parameter counts as stepped: one that no rank's forward
    reached has no state yet (torch skips it)."""
    total = 0
    for sharded in engine.optimizers:
        if not hasattr(sharded, "plan"):  # element-wise: the runs the optimizer steps
            numels = [tensor.numel() for group in sharded.optimizer.param_groups for tensor in group["params"]]
            total += held_state_bytes(sharded.optimizer, numels, state_bytes)
            continue
        matrices, domains = sharded.plan()  # [Note: owner step]
        ns_steps = sharded.optimizer.param_groups[0]["ns_steps"]
        for index, domain in enumerate(domains):
            members = [m for m in matrices if m.domain == index]
            shapes = [m.full_shape for m in members]
            tp = [rows * cols // (m.hi - m.lo) for m, (rows, cols) in zip(members, shapes)]  # tp-split shards
            held = momenta_by_owner(shapes, domain.size, state_bytes=state_bytes, ns_steps=ns_steps, tp=tp)
            total += held[domain.rank]
    return total


def context_parallel_size(module: Any) -> int:
    """The cp ranks ``module``'s sequences are split over: a ``Llama``'s ``context_parallel_size``,
    or its LightningModule's (``module.model``); 1 for anything else."""
    for candidate in (module, getattr(module, "model", None)):
        size = getattr(candidate, "context_parallel_size", None)
        if isinstance(size, int):
            return size
    return 1


class Monitor:
    """[Note: the monitor]: per-step metrics of one rank's engine (see the module docstring).

    Args:
        warn_overlap_below: :meth:`overlap_warning` fires once when overlap was requested and the
            hidden fraction of collective time is below this (CUDA only).
        hardware: the ``conf/hardware`` config name (or YAML path, or mapping) whose peak FLOP/s
            MFU is measured against; ``None``: detected from the CUDA device's name (H100, H200,
            A100), no MFU on CPU.
    """

    def __init__(self, warn_overlap_below: float = 0.5, hardware: Optional[Any] = None) -> None:
        self.warn_overlap_below = warn_overlap_below
        self.hardware = hardware
        self.throughput: Optional[ThroughputMeter] = None
        self.history: list[dict[str, float]] = []
        self._num_params: Optional[int] = None
        self._warned = False
        self._sent_before: dict[str, float] = {}
        self._link_before: dict[str, float] = {}
        self._step_open = False  # a micro batch of the current optimizer step has started
        self._previous_timeline: Optional[Any] = None  # CUDA: the figures logged lag one step
        self._expert_load = ExpertLoadMeter()

    def micro_batch(self, engine: Any, module: Any, batch: Any, *, dims: Optional[Any] = None) -> None:
        """A training micro batch starts on this rank (``batch``: what the module runs on).
        ``dims``: the run's layout (``comm/mesh.py`` ``ParallelDims``: dp, cp and tp for tokens/s in
        total and the FLOPs, [Note: throughput]); ``None``: every rank of the engine's group takes
        different samples, whole. The step's bytes count from its first micro batch: under
        accumulation every micro batch of a stage 2-3 step sends its own reduce-scatters (and
        stage 3 its gathers)."""
        if not self._step_open:
            self._step_open = True
            self._sent_before = dict(engine.counter.bytes)
            self._link_before = dict(engine.counter.bytes_by_link)
        cp = dims.cp if dims is not None else context_parallel_size(module)
        if self.throughput is None:
            hardware = self.hardware if self.hardware is not None else hardware_for_device(engine.device)
            dp = dims.dp if dims is not None else engine.dp_size // cp
            peak = peak_flops_for(hardware, engine.compute_dtype)
            self.throughput = ThroughputMeter(dp=dp, peak_flops=peak, cp=cp)
        sequences, length = batch_tokens(module, batch)  # length: the T/cp slice under cp
        if self._num_params is None:
            self._num_params = engine.num_params()
        tp = dims.tp if dims is not None else 1
        config = getattr(module, "config", None)
        flops = training_flops_of(config, self._num_params, sequences, length, tp, cp)
        self.throughput.micro_batch(sequences * length, flops)

    def step_end(self, engine: Any, module: Any = None) -> dict[str, float]:
        """An optimizer step ended: its metrics (also appended to ``history``); ``module``: the
        model the step trained (a mixture of experts reports its expert load)."""
        self._step_open = False
        metrics: dict[str, float] = {}
        measured = engine.measured_bytes()
        predicted = predicted_bytes(engine)
        for key in ("params", "grads", "optimizer", "total"):
            metrics[f"zero/measured_{key}_bytes"] = float(measured[key])
            metrics[f"zero/predicted_{key}_bytes"] = float(predicted[key])
        metrics["zero/peak_memory_bytes"] = float(peak_memory_bytes(engine.device))
        sent_total = 0.0
        for kind, value in engine.counter.bytes.items():
            sent = value - self._sent_before.get(kind, 0.0)
            metrics[f"zero/sent_bytes/{kind}"] = sent
            sent_total += sent
        metrics["zero/sent_bytes_total"] = sent_total
        for link in LINK_CLASSES:
            sent = engine.counter.bytes_by_link.get(link, 0.0) - self._link_before.get(link, 0.0)
            metrics[f"zero/sent_bytes_by_link/{link}"] = sent
        timeline = engine.timeline
        if engine.device.type == "cuda":  # the previous step's events: done, so no device sync ([Note: device clock])
            timeline, self._previous_timeline = self._previous_timeline, timeline.snapshot()
        comm, exposed = (timeline.comm_s, timeline.exposed_s) if timeline is not None else (0.0, 0.0)
        metrics["zero/comm_s"] = comm
        metrics["zero/exposed_comm_s"] = exposed
        metrics["zero/overlap_fraction"] = (timeline.hidden_s / comm) if comm > 0 else 0.0
        timeline = engine.timeline  # host order of this step's events
        launch, end = timeline.index_of("launch"), timeline.index_of("backward_end")
        metrics["zero/first_launch_before_backward_end"] = float(0 <= launch < end)
        if self.throughput is not None:
            step = self.throughput.step_end()
            metrics["zero/step_time_s"] = step.seconds
            metrics["zero/tokens_per_s"] = step.tokens_per_s
            metrics["zero/tokens_per_s_total"] = step.tokens_per_s_total
            if step.mfu is not None:
                metrics["zero/mfu"] = step.mfu
        take_moe_stats = getattr(getattr(module, "model", None), "take_moe_stats", None)
        if callable(take_moe_stats):  # a mixture of experts ([Note: expert load without a sync])
            metrics.update(self._expert_load.step(take_moe_stats()))
        self.history.append(metrics)
        return metrics

    def overlap_warning(self, engine: Any, metrics: dict[str, float], comm: float, step: int) -> Optional[str]:
        """The warning to give once, or ``None`` (see the module docstring)."""
        if not engine.overlap_comm or self._warned or comm <= 0 or len(self.history) < 2:
            return None
        if not engine.overlap_possible():
            # One bucket per group fills only when backward ends: a layout fact, on any device. Said
            # only to a user who set bucket_mb: "auto" gives a model under 4 MiB of gradients one bucket
            # on purpose (lightning_zero.config.resolve_bucket_mb), and the advice would be to set it.
            self._warned = True
            if engine.bucket_mb_auto:
                return None
            grad_mib = engine.num_params() * getattr(engine, "reduce_dtype", engine.compute_dtype).itemsize / 2**20
            return (
                f"lightning_zero: every parameter group's gradients fit in one bucket (bucket_mb="
                f"{engine.bucket_mb:g}, {grad_mib:.1f} MiB of gradients), so no reduce-scatter can start"
                f" before backward ends. For overlap, set bucket_mb to about {max(grad_mib / 4, 0.25):.2g}"
                " or leave it at 'auto'."
            )
        # On CUDA the fraction comes from CUDA events (collectives run beside compute on the
        # device); on CPU gloo shares the cores with backward, so the fraction is logged, not judged.
        if engine.device.type == "cuda" and metrics["zero/overlap_fraction"] < self.warn_overlap_below:
            self._warned = True
            return (
                f"lightning_zero: overlap_comm=True but only {metrics['zero/overlap_fraction']:.0%} of the"
                f" gradient collective time ({comm * 1e3:.1f} ms) was hidden behind backward in step"
                f" {step}. Smaller buckets (bucket_mb) start collectives earlier."
            )
        return None

    def summary_lines(self) -> list[str]:
        """The end-of-run table (model-state bytes, bytes sent, overlap, throughput), or ``[]``."""
        if not self.history:
            return []
        last = self.history[-1]
        rows = [
            (key, last[f"zero/measured_{key}_bytes"], last[f"zero/predicted_{key}_bytes"])
            for key in ("params", "grads", "optimizer", "total")
        ]
        lines = ["lightning_zero: model-state bytes per rank (last step)", f"{'':<10}{'measured':>16}{'predicted':>16}"]
        lines += [f"{key:<10}{got:>16,.0f}{want:>16,.0f}" for key, got, want in rows]
        lines.append(f"{'sent/step':<10}{last['zero/sent_bytes_total']:>16,.0f}")
        for link in LINK_CLASSES:
            lines.append(f"{'  ' + link:<12}{last.get(f'zero/sent_bytes_by_link/{link}', 0.0):>14,.0f}")
        lines.append(f"{'overlap':<10}{last['zero/overlap_fraction']:>16.0%}")
        return lines + self._throughput_lines()

    def _throughput_lines(self) -> list[str]:
        """tokens/s per rank and in total, and MFU, over the steps after the first."""
        steady = self.throughput.summary() if self.throughput is not None else None
        if steady is None:
            return []
        lines = [
            f"{'tokens/s':<10}{steady.tokens_per_s:>16,.1f}  per rank",
            f"{'':<10}{steady.tokens_per_s_total:>16,.1f}  {steady.total_label()}",
        ]
        mfu = steady.mfu
        lines.append(f"{'MFU':<10}{mfu:>16.2%}" if mfu is not None else f"{'MFU':<10}{'n/a':>16}  (no hardware config)")
        return lines
