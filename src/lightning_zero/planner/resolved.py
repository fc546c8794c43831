"""The run as the planner's steps share it: knobs, layout, shape and hardware resolved once.

``arithmetic.plan`` resolves a run (:func:`~lightning_zero.planner.arithmetic.resolve_run`) into a
:class:`ResolvedRun`, then takes its steps on it whole: the memory, the step-time simulation
(``timing.step_time`` with the schedule and machine built here), the traffic
(``traffic.traffic_per_rank``) and the :class:`~lightning_zero.planner.plan.Plan` they make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_zero.comm.mesh import ParallelDims
from lightning_zero.config import ZeroConfig
from lightning_zero.planner.hardware import Hardware, Link
from lightning_zero.planner.ledger import DpTopology, PrecisionBytes
from lightning_zero.planner.timing import DomainHops, MachineCosts, StepCount, ZeroSchedule
from lightning_zero.planner.workload import Workload


def spans_nodes(dims: ParallelDims, ranks: list[int]) -> bool:
    return len({rank // dims.devices_per_node for rank in ranks}) > 1


@dataclass(frozen=True)
class ResolvedRun:
    """One planned run, resolved: ``config`` and ``dims`` (Lightning's DDP already mapped onto
    them, ``stage`` 0), the run's shape (``run``: a ``RunShape``) with ``seq_len`` and the
    checkpointing mode resolved, the bytes per element (``dtype``, gradients in ``reduce_dtype``),
    the hardware with its ``mfu`` and ``peak`` FLOPs, the micro batch's ``workload``, the dense
    ZeRO domain's ``topology`` and ``padded`` elements, the expert domain's (``experts``,
    ``expert_padded``; ``None`` / 0 without expert parallelism), the resolved ``bucket_mb`` and
    the context-parallel attention layout (``cp_layout``, ``None`` without cp)."""

    model: Any
    config: ZeroConfig
    dims: ParallelDims
    run: Any
    tp: int
    checkpointing: str  # run.activation_checkpointing: "none" | "selective" | "full"
    micro_batch: int
    micro_batches: int  # run.accumulate_grad_batches
    stage: int
    defer_grad_reduce: bool
    seq_len: int
    dtype: PrecisionBytes
    hw: Hardware
    mfu: float
    peak: float
    workload: Workload
    topology: DpTopology
    experts: Optional[DpTopology]
    padded: int
    expert_padded: int
    bucket_mb: float
    bucket_numel: int
    cp_layout: Any
    reserved_bytes: int  # not available to tensors (PlanOptions.reserved_gib)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.micro_batches * self.dims.dp

    @property
    def expert_params(self) -> int:
        """This rank's expert parameters (``ep > 1``: a ZeRO domain of their own over edp)."""
        return self.workload.expert_numel if self.dims.ep > 1 else 0

    def link_name(self, ranks: list[int]) -> str:
        return "inter_node" if spans_nodes(self.dims, ranks) else "intra_node"

    @property
    def cp_link(self) -> str:
        return self.link_name(self.dims.cp_ranks(0))

    @property
    def ep_link(self) -> str:
        return self.link_name(self.dims.ep_ranks(0))

    def machine(self) -> MachineCosts:
        """What this run's hardware charges (``timing.step_time``)."""
        hw = self.hw
        crosses_nodes = self.dims.stage_world > self.dims.devices_per_node and self.dims.dp_cp > 1  # one pp rank's
        links: dict[str, Link] = {"intra_node": hw.link(inter_node=False), "inter_node": hw.link(inter_node=True)}
        return MachineCosts(
            dp_link=hw.link(inter_node=crosses_nodes),
            links=links,
            efficiency=hw.overlap_efficiency,
            memory_bytes_per_s=hw.memory_bytes_per_s,
            optimizer_bytes_per_s=hw.optimizer_bytes_per_s or hw.memory_bytes_per_s,
            overhead_s=hw.step_overhead_s,
            peak_flops=self.peak,
        )

    def _hops(self, topology: DpTopology) -> DomainHops:
        comm = self.config.communication
        grads = topology.grad_hops(stage=self.stage, grad_bytes=self.dtype.grad, grad_comm_dtype=comm.grad_comm_dtype)
        gathers = topology.gather_hops(param_bytes=self.dtype.param, param_comm_dtype=comm.param_comm_dtype)
        return DomainHops(topology.shard_size, grads, gathers)

    def schedule(self) -> ZeroSchedule:
        """What the engine does with this run's gradients and parameters (``timing.step_time``)."""
        return ZeroSchedule(
            stage=self.stage,
            dp=self.dims.dp_cp,
            grad_bytes=self.dtype.grad,
            param_bytes=self.dtype.param,
            bucket_numel=self.bucket_numel,
            defer_grad_reduce=self.defer_grad_reduce,
            prefetch_blocks=self.config.prefetch_blocks,
            optimizer_bytes_per_param=self.dtype.optimizer_step_bytes,
            dense=self._hops(self.topology),
            experts=self._hops(self.experts) if self.experts is not None else None,
        )

    def produced(self, model_flops: float) -> StepCount:
        return StepCount(self.tokens_per_step, model_flops, self.dims.world_size)
