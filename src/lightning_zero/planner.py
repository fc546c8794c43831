"""Predict, before launch, the bytes every rank holds and sends for a Llama run under ZeRO.

:func:`plan_run` is pure arithmetic on a :class:`~lightning_zero.models.LlamaConfig` (formulas in
:mod:`lightning_zero.ledger` and docs/planner.md): it never builds the model, so a 70B plan takes
milliseconds. :func:`compare_stages` lays stages 0-3 side by side for one run; :func:`run_plan`
is what ``lightning-zero plan [overrides]`` calls with the composed Hydra config, and renders a
table, JSON or a bar chart (:mod:`lightning_zero.planner_report`).

[Note: what a plan counts] Per rank, at the peak of one training step (the start of backward):
model states (ZeRO paper), the engine's extra buffers (stage 2/3 gradient buckets in flight,
stage 3 gathered blocks), activations saved for backward (or checkpointed block inputs plus
one recomputed block) and the loss. Not counted: the CUDA context and allocator slack
(``plan.reserved_gib`` is set aside for them), transient activation gradients (a few
``B x T x dim`` tensors), temporaries of the optimizer step, and the data loader.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_zero.ledger import (
    ActivationBytes,
    llama_activation_bytes,
    llama_param_counts,
    model_state_bytes,
)
from lightning_zero.mesh import ParallelDims

HARDWARE_DIR = Path(__file__).parent / "conf" / "hardware"
DEFAULT_HARDWARE = "h100_80gb"
STAGES = (0, 1, 2, 3)
GiB = 1024**3
MiB = 1024**2


# --------------------------------------------------------------------------------------------
# Inputs: hardware and precision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its usual node. Bandwidths are per GPU, one direction, bytes/s."""

    name: str
    memory_bytes: int
    intra_node_bytes_per_s: float  # NVLink: what TP collectives (and single-node dp) run at
    inter_node_bytes_per_s: float  # network per GPU: what dp collectives across nodes run at
    peak_bf16_flops: float
    peak_fp32_flops: float
    devices_per_node: int = 8

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Hardware":
        """From a ``conf/hardware/*.yaml`` mapping (GB/s and TFLOP/s, as written there)."""
        required = ("name", "memory_bytes", "intra_node_gb_per_s", "inter_node_gb_per_s", "peak_bf16_tflops")
        missing = [key for key in required if values.get(key) is None]
        if missing:
            raise ValueError(f"hardware config misses {missing}; see {HARDWARE_DIR}/h100_80gb.yaml for the keys")
        return cls(
            name=str(values["name"]),
            memory_bytes=int(values["memory_bytes"]),
            intra_node_bytes_per_s=float(values["intra_node_gb_per_s"]) * 1e9,
            inter_node_bytes_per_s=float(values["inter_node_gb_per_s"]) * 1e9,
            peak_bf16_flops=float(values["peak_bf16_tflops"]) * 1e12,
            peak_fp32_flops=float(values.get("peak_fp32_tflops") or values["peak_bf16_tflops"] / 16) * 1e12,
            devices_per_node=int(values.get("devices_per_node") or 8),
        )


def available_hardware() -> list[str]:
    return sorted(path.stem for path in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(hardware: Union[str, Hardware, Mapping[str, Any]]) -> Hardware:
    """A :class:`Hardware` from a name in ``conf/hardware`` (``h100_80gb``), a mapping, or itself."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Mapping):
        return Hardware.from_mapping(hardware)
    path = HARDWARE_DIR / f"{hardware}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown hardware {hardware!r}; pick one of {available_hardware()} (hardware=NAME)")
    from omegaconf import OmegaConf

    return Hardware.from_mapping(OmegaConf.to_container(OmegaConf.load(path)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter (and per activation element) of a Lightning precision with Adam."""

    param: int  # compute copy
    grad: int
    master: int  # fp32 master copy, only as a shard inside the optimizer (0: the param is its own)
    moments: int  # Adam exp_avg + exp_avg_sq
    activation: int

    @property
    def optimizer(self) -> int:
        return self.master + self.moments


PRECISIONS: dict[str, PrecisionBytes] = {
    "32-true": PrecisionBytes(param=4, grad=4, master=0, moments=8, activation=4),
    "32": PrecisionBytes(param=4, grad=4, master=0, moments=8, activation=4),
    "bf16-mixed": PrecisionBytes(param=2, grad=2, master=4, moments=8, activation=2),
    "16-mixed": PrecisionBytes(param=2, grad=2, master=4, moments=8, activation=2),
}


def precision_bytes(precision: str) -> PrecisionBytes:
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not planned; use one of {sorted(PRECISIONS)}")
    return PRECISIONS[str(precision)]


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPerRank:
    """Bytes one rank holds at the peak of a step (see [Note: what a plan counts]).

    Names follow the engine's ``measured_bytes()``: ``optimizer`` = ``master_weights`` (its
    ``"master"``) + ``optimizer_moments`` (its ``"optimizer_state"``).
    """

    params: float
    grads: float
    master_weights: float  # fp32 master shard (part of the optimizer state)
    optimizer_moments: float  # Adam exp_avg + exp_avg_sq shard
    bucket_buffers: float  # stage 2/3: gradient buckets in flight
    prefetch_buffers: float  # stage 3: full params of the gathered blocks
    activations: float  # saved for backward by the transformer blocks and the final norm
    logits_and_loss: float
    step_grad_shard: float  # bf16-mixed: the fp32 copy of the grad shard the optimizer steps on

    @property
    def optimizer(self) -> float:
        return self.master_weights + self.optimizer_moments

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Model states and engine buffers, plus the larger of the two peaks that never meet:
        backward's (activations, loss) and the optimizer step's (fp32 grad shard)."""
        backward_peak = self.activations + self.logits_and_loss
        return self.model_states + self.bucket_buffers + self.prefetch_buffers + max(backward_peak,
                                                                                      self.step_grad_shard)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "optimizer": self.optimizer, "model_states": self.model_states, "total": self.total}


@dataclass(frozen=True)
class TrafficPerRank:
    """Bytes one rank sends per optimizer step (ring algorithm) and the time they take."""

    dp_reduce_scatter_bytes: float
    dp_all_gather_bytes: float
    dp_all_reduce_bytes: float  # stage 0 (plain DDP) only
    tp_all_reduce_bytes: float
    dp_link: str  # "intra_node" or "inter_node"
    dp_bytes_per_s: float
    tp_bytes_per_s: float
    flops_per_rank: float
    compute_s: float  # flops / (peak * mfu)

    @property
    def dp_bytes(self) -> float:
        return self.dp_reduce_scatter_bytes + self.dp_all_gather_bytes + self.dp_all_reduce_bytes

    @property
    def dp_s(self) -> float:
        return self.dp_bytes / self.dp_bytes_per_s

    @property
    def tp_s(self) -> float:
        return self.tp_all_reduce_bytes / self.tp_bytes_per_s if self.tp_all_reduce_bytes else 0.0

    @property
    def step_s(self) -> float:
        """Estimate: compute + TP (blocking) + the part of dp traffic compute cannot hide."""
        return self.compute_s + self.tp_s + max(0.0, self.dp_s - self.compute_s)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dp_bytes": self.dp_bytes, "dp_s": self.dp_s, "tp_s": self.tp_s, "step_s": self.step_s}


@dataclass(frozen=True)
class Plan:
    """Everything :func:`plan_run` predicts for one rank of one run; ``as_dict()`` is JSON-ready."""

    model: str
    num_params: int  # the whole model
    params_per_tp_rank: int  # what one tp rank (and its dp group) holds and shards
    padded_params_per_tp_rank: int  # rounded up so it splits evenly over dp
    stage: int
    world_size: int
    num_nodes: int
    devices_per_node: int
    dp: int
    tp: int
    precision: str
    micro_batch: int
    seq_len: int
    accumulate_grad_batches: int
    tokens_per_step: int  # over all dp ranks and micro batches
    activation_checkpointing: bool
    attention: str
    bucket_mb: float
    prefetch_blocks: int
    hardware: str
    memory_bytes: int
    reserved_bytes: int
    mfu: float
    memory: MemoryPerRank
    traffic: TrafficPerRank
    activation_detail: ActivationBytes
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def available_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.available_bytes

    @property
    def verdict(self) -> str:
        used = f"{self.memory.total / GiB:.1f} GiB of {self.available_bytes / GiB:.1f} GiB usable on {self.hardware}"
        if self.fits:
            return f"fits: {used}"
        fixes = "; ".join(self.suggestions) if self.suggestions else "no single change found"
        return f"does NOT fit: {used}. Would fit with: {fixes}"

    def as_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(
            memory=self.memory.as_dict(),
            traffic=self.traffic.as_dict(),
            activation_detail=self.activation_detail.as_dict(),
            suggestions=list(self.suggestions),
            notes=list(self.notes),
            available_bytes=self.available_bytes,
            fits=self.fits,
            verdict=self.verdict,
        )
        return values


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def plan_run(
    model_config: Any,
    *,
    stage: int,
    world_size: int,
    devices_per_node: int,
    tp: Union[int, str] = 1,
    precision: str = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    activation_checkpointing: bool = False,
    bucket_mb: float = 25.0,
    prefetch_blocks: int = 1,
    hardware: Union[str, Hardware, Mapping[str, Any]] = DEFAULT_HARDWARE,
    mfu: float = 0.4,
    accumulate_grad_batches: int = 1,
    attention: str = "fused",
    reserved_gib: float = 2.0,
    suggest: bool = True,
) -> Plan:
    """Predict one rank's bytes (held and sent) for a Llama run; allocates nothing.

    Args:
        model_config: a ``LlamaConfig`` (or a preset name such as ``"70b"``).
        stage: ZeRO stage 1, 2 or 3 (0 = plain data parallel, for comparison).
        world_size: total ranks; ``devices_per_node`` ranks per node.
        tp: tensor-parallel size (inside a node) or ``"auto"`` (= devices_per_node); dp = world // tp.
        precision: ``"bf16-mixed"`` (2 + 2 + 12 bytes/param) or ``"32-true"`` (4 + 4 + 8).
        micro_batch: samples per rank per forward; ``seq_len`` tokens each (default: the model's).
        activation_checkpointing: keep only each block's input and recompute it in backward.
        bucket_mb: gradient bucket size (MiB); stage 2/3 hold two buckets in flight.
        prefetch_blocks: stage 3 holds ``prefetch_blocks + 1`` gathered blocks.
        hardware: a name in ``conf/hardware`` (memory, link bandwidths, peak FLOP/s).
        mfu: model FLOPs utilization assumed for the compute time.
        accumulate_grad_batches: micro batches per optimizer step.
        attention: ``"fused"`` (SDPA flash kernels, what the model runs) or ``"math"``.
        reserved_gib: per-GPU memory not available to tensors (CUDA context, allocator slack).
        suggest: when it does not fit, search for changes that would make it fit.

    Raises ``ValueError`` naming the argument for a bad value, and (via ``ParallelDims``) for a
    layout whose sizes do not divide, with the numbers.
    """
    from lightning_zero.models import resolve_config

    config = resolve_config(model_config)
    if stage not in STAGES:
        raise ValueError(f"plan_run: stage must be one of {STAGES} (0 = plain DDP), got stage={stage!r}")
    dims = ParallelDims(world_size=world_size, devices_per_node=devices_per_node, tp=tp).validate(config)
    tp, dp = int(dims.tp), dims.dp
    seq_len = int(seq_len or config.max_seq_len)
    _check_positive(micro_batch=micro_batch, seq_len=seq_len, accumulate_grad_batches=accumulate_grad_batches)
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"plan_run: seq_len({seq_len}) exceeds the model's max_seq_len({config.max_seq_len}); "
            "lower data.seq_len or raise model.max_seq_len"
        )
    if not 0 < mfu <= 1:
        raise ValueError(f"plan_run: mfu must be in (0, 1], got mfu={mfu!r}")
    if bucket_mb <= 0 or prefetch_blocks < 0:
        raise ValueError(
            f"plan_run: bucket_mb must be > 0 and prefetch_blocks >= 0, got bucket_mb={bucket_mb!r}, "
            f"prefetch_blocks={prefetch_blocks!r}"
        )
    hw = load_hardware(hardware)
    dtype = precision_bytes(precision)
    counts = llama_param_counts(config, tp=tp)
    local_params = counts.total
    padded = math.ceil(local_params / dp) * dp
    shard = padded // dp

    states = model_state_bytes(padded, stage=stage, dp=dp, param_bytes=dtype.param, grad_bytes=dtype.grad,
                               optim_bytes_per_param=dtype.optimizer)
    optimizer_numel = shard if stage >= 1 else padded
    bucket_bytes = bucket_mb * MiB
    buckets = min(2 * bucket_bytes, padded * dtype.grad) if stage >= 2 else 0.0
    gathered_unit = max(counts.block, counts.embedding, counts.output)
    prefetch = (prefetch_blocks + 1) * gathered_unit * dtype.param if stage == 3 else 0.0

    acts = llama_activation_bytes(config, micro_batch=micro_batch, seq_len=seq_len, act_bytes=dtype.activation,
                                  tp=tp, attention=attention)
    memory = MemoryPerRank(
        params=states.params,
        grads=states.grads,
        master_weights=optimizer_numel * dtype.master,
        optimizer_moments=optimizer_numel * dtype.moments,
        bucket_buffers=float(buckets),
        prefetch_buffers=float(prefetch),
        activations=acts.total(activation_checkpointing) - acts.logits_and_loss,
        logits_and_loss=acts.logits_and_loss,
        step_grad_shard=float(optimizer_numel * 4) if stage >= 1 and dtype.master else 0.0,
    )
    traffic = _traffic(config, stage=stage, dims=dims, padded=padded, dtype=dtype, micro_batch=micro_batch,
                       seq_len=seq_len, micro_batches=accumulate_grad_batches,
                       activation_checkpointing=activation_checkpointing, hw=hw, mfu=mfu,
                       precision=str(precision))
    plan = Plan(
        model=config.name,
        num_params=config.num_params(),
        params_per_tp_rank=local_params,
        padded_params_per_tp_rank=padded,
        stage=stage,
        world_size=world_size,
        num_nodes=max(1, world_size // devices_per_node),
        devices_per_node=devices_per_node,
        dp=dp,
        tp=tp,
        precision=str(precision),
        micro_batch=micro_batch,
        seq_len=seq_len,
        accumulate_grad_batches=accumulate_grad_batches,
        tokens_per_step=micro_batch * seq_len * accumulate_grad_batches * dp,
        activation_checkpointing=bool(activation_checkpointing),
        attention=attention,
        bucket_mb=float(bucket_mb),
        prefetch_blocks=prefetch_blocks,
        hardware=hw.name,
        memory_bytes=hw.memory_bytes,
        reserved_bytes=int(reserved_gib * GiB),
        mfu=mfu,
        memory=memory,
        traffic=traffic,
        activation_detail=acts,
        notes=_notes(stage, dp, attention, precision, accumulate_grad_batches),
    )
    if suggest and not plan.fits:
        plan = dataclasses.replace(plan, suggestions=tuple(_suggestions(plan, config, hw)))
    return plan


def compare_stages(model_config: Any, stages: tuple[int, ...] = STAGES, **kwargs: Any) -> list[Plan]:
    """:func:`plan_run` for each stage with everything else equal (the side-by-side view)."""
    return [plan_run(model_config, stage=stage, **kwargs) for stage in stages]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_run: {name} must be a positive int, got {name}={value!r}")


def _traffic(
    config: Any,
    *,
    stage: int,
    dims: ParallelDims,
    padded: int,
    dtype: PrecisionBytes,
    micro_batch: int,
    seq_len: int,
    micro_batches: int,
    activation_checkpointing: bool,
    hw: Hardware,
    mfu: float,
    precision: str,
) -> TrafficPerRank:
    dp, tp = dims.dp, int(dims.tp)
    ring = (dp - 1) / dp
    grad_bytes, param_bytes = padded * dtype.grad, padded * dtype.param
    reduce_scatter = all_gather = all_reduce = 0.0
    if stage == 0:
        all_reduce = 2 * ring * grad_bytes
    elif stage == 1:  # full grads accumulate locally; one reduce-scatter + one all-gather per step
        reduce_scatter, all_gather = ring * grad_bytes, ring * param_bytes
    elif stage == 2:  # only a grad shard exists: reduce-scatter every micro batch
        reduce_scatter, all_gather = ring * grad_bytes * micro_batches, ring * param_bytes
    else:  # gather for forward and again for backward, reduce-scatter, every micro batch
        reduce_scatter, all_gather = ring * grad_bytes * micro_batches, 2 * ring * param_bytes * micro_batches
    tokens = micro_batch * seq_len
    # Per block: 2 all-reduces forward (after wo, w2), 2 backward (grads of the column-parallel
    # inputs); recomputation repeats the forward ones; plus the embedding (fwd) and output head (bwd).
    per_layer = 6 if activation_checkpointing else 4
    tp_all_reduces = (per_layer * config.n_layers + 2) * micro_batches
    tp_bytes = tp_all_reduces * 2 * (tp - 1) / tp * tokens * config.dim * dtype.activation
    flops = (8 if activation_checkpointing else 6) * config.num_params() * tokens * micro_batches / tp
    peak = hw.peak_fp32_flops if precision.startswith("32") else hw.peak_bf16_flops
    crosses_nodes = dims.world_size > dims.devices_per_node and dp > 1
    return TrafficPerRank(
        dp_reduce_scatter_bytes=reduce_scatter,
        dp_all_gather_bytes=all_gather,
        dp_all_reduce_bytes=all_reduce,
        tp_all_reduce_bytes=tp_bytes,
        dp_link="inter_node" if crosses_nodes else "intra_node",
        dp_bytes_per_s=hw.inter_node_bytes_per_s if crosses_nodes else hw.intra_node_bytes_per_s,
        tp_bytes_per_s=hw.intra_node_bytes_per_s,
        flops_per_rank=flops,
        compute_s=flops / (peak * mfu),
    )


def _notes(stage: int, dp: int, attention: str, precision: str, micro_batches: int) -> tuple[str, ...]:
    notes = []
    if dp == 1 and stage > 0:
        notes.append("dp=1: ZeRO has nothing to shard over; every stage holds full states")
    if attention == "math":
        notes.append("attention=math keeps the (B, heads, T, T) probabilities of every block")
    if micro_batches > 1 and stage >= 2:
        notes.append(f"stage {stage} reduce-scatters gradients on each of the {micro_batches} micro batches")
    return tuple(notes)


# --------------------------------------------------------------------------------------------
# Verdict: what would make it fit
# --------------------------------------------------------------------------------------------


def _knobs(plan: Plan) -> dict[str, Any]:
    """The :func:`plan_run` arguments that produced ``plan`` (but the model and the hardware)."""
    arguments = inspect.signature(plan_run).parameters
    knobs = {name: getattr(plan, name) for name in arguments if name != "hardware" and hasattr(plan, name)}
    knobs["reserved_gib"] = plan.reserved_bytes / GiB
    return knobs


def _candidates(plan: Plan) -> list[tuple[str, dict[str, Any]]]:
    """Single changes first, in the order a user would try them, then combinations."""
    out: list[tuple[str, dict[str, Any]]] = []
    for stage in range(plan.stage + 1, 4):
        out.append((f"stage={stage}", {"stage": stage}))
    if not plan.activation_checkpointing:
        out.append(("activation_checkpointing=true", {"activation_checkpointing": True}))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node:
        out.append((f"tensor_parallel_size={tp}", {"tp": tp}))
        tp *= 2
    micro_batch = plan.micro_batch // 2
    while micro_batch >= 1:
        accumulate = plan.accumulate_grad_batches * plan.micro_batch // micro_batch
        out.append((f"micro_batch={micro_batch} (accumulate_grad_batches={accumulate})",
                    {"micro_batch": micro_batch, "accumulate_grad_batches": accumulate}))
        micro_batch //= 2
    combined = {"stage": 3, "activation_checkpointing": True}
    out.append(("stage=3 + activation_checkpointing=true", combined))
    tp = plan.tp * 2
    while tp <= plan.devices_per_node:
        out.append((f"stage=3 + activation_checkpointing=true + tensor_parallel_size={tp}", {**combined, "tp": tp}))
        tp *= 2
    if plan.micro_batch > 1:
        out.append((f"stage=3 + activation_checkpointing=true + tensor_parallel_size={plan.devices_per_node} + "
                    f"micro_batch=1", {**combined, "tp": plan.devices_per_node, "micro_batch": 1}))
    return out


def _suggestions(plan: Plan, config: Any, hardware: Hardware, limit: int = 4) -> list[str]:
    found: list[str] = []
    knobs = _knobs(plan)
    for label, change in _candidates(plan):
        try:
            other = plan_run(config, hardware=hardware, suggest=False, **{**knobs, **change})
        except ValueError:  # e.g. a tp that does not divide the heads
            continue
        if other.fits:
            found.append(f"{label} ({other.memory.total / GiB:.1f} GiB)")
            if len(found) >= limit:
                break
    if not found:
        found.append(_no_single_fix(plan, config, hardware))
    return found


def _no_single_fix(plan: Plan, config: Any, hardware: Hardware, max_nodes: int = 512) -> str:
    """When no change on this cluster fits: the fewest nodes, or another GPU, where stage 3 with
    checkpointing at this tp would."""
    knobs = {**_knobs(plan), "stage": 3, "activation_checkpointing": True}
    nodes = plan.world_size // plan.devices_per_node
    options = [f"nothing on {nodes} node(s) of {plan.hardware} fits"]
    while nodes < max_nodes:
        nodes *= 2
        bigger = plan_run(config, hardware=hardware, suggest=False,
                          **{**knobs, "world_size": nodes * plan.devices_per_node})
        if bigger.fits:
            options.append(f"stage=3 + activation_checkpointing=true on {nodes} nodes "
                           f"({bigger.memory.total / GiB:.1f} GiB)")
            break
    for name in available_hardware():
        if name != plan.hardware:
            other = plan_run(config, hardware=name, suggest=False, **knobs)
            if other.fits:
                options.append(f"stage=3 + activation_checkpointing=true on hardware={name} "
                               f"({other.memory.total / GiB:.1f} GiB)")
    return "; ".join(options)


# --------------------------------------------------------------------------------------------
# CLI entry: `lightning-zero plan [overrides]`
# --------------------------------------------------------------------------------------------


def run_plan(cfg: Any, *, console: Any = None) -> dict[str, Any]:
    """``lightning-zero plan``: plan the configured run and, side by side, every stage.

    Prints a rich table (``plan.format=table``) or JSON (``plan.format=json``) and, with
    ``plan.plot=PATH.png``, writes the per-rank memory of each stage as a stacked bar chart.
    Returns the JSON-ready dict (``{"plan": ..., "stages": [...]}``).
    """
    from lightning_zero import planner_report

    model_config, kwargs, options = planner_report.plan_kwargs_from_config(cfg)
    plan = plan_run(model_config, **kwargs)
    only = str(options.get("stages", "all")) == "only"
    stage_kwargs = {k: v for k, v in kwargs.items() if k != "stage"}
    stages = [plan] if only else [plan if s == plan.stage else plan_run(model_config, stage=s, **stage_kwargs)
                                  for s in STAGES]
    output_format = str(options.get("format", "table"))
    if output_format not in ("table", "json"):
        raise ValueError(f"plan.format must be 'table' or 'json', got {output_format!r}")
    result: dict[str, Any] = {"plan": plan.as_dict(), "stages": [p.as_dict() for p in stages]}
    if options.get("plot"):
        result["plot"] = str(planner_report.plot_memory(stages, options["plot"]))
    if output_format == "json":
        planner_report.print_json(result, console=console)
    else:
        planner_report.print_tables(plan, stages, console=console)
        if "plot" in result:
            planner_report.print_line(f"plot: {result['plot']}", console=console)
    return result
