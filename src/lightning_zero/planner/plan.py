"""What a plan holds: one rank's bytes (held and sent) and step time, as :func:`plan_run` returns them.

:class:`Plan` is the result of :func:`lightning_zero.planner.arithmetic.plan_run`; its
``as_dict()`` is the JSON the CLI prints (``plan.format=json``, docs/planner.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_zero.planner.ledger import ActivationBytes, LinkBytes, grad_bytes_per_param, precision_bytes
from lightning_zero.planner.timing import StepTime

GiB = 1024**3


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
    bucket_buffers: float  # stage 2/3: the gradient bucket pool (kept between backwards)
    prefetch_buffers: float  # stage 3: full params of the gathered blocks
    activations: float  # saved for backward by the transformer blocks and the final norm
    logits_and_loss: float
    step_grad_shard: float  # bf16-mixed: the fp32 copy of the grad shard the optimizer steps on
    param_grad: float = 0.0  # stages 2/3: autograd's gradient of the largest parameter, before its bucket copy;
    # pp > 1, every stage: what the schedule's gradients add to the activations' peak (planner/pipeline.py)
    recv_buffers: float = 0.0  # pp > 1: torch's receive buffers, kept between steps ([Note: receive buffers])

    @property
    def optimizer(self) -> float:
        return self.master_weights + self.optimizer_moments

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Model states and engine buffers, plus the larger of the two peaks that never meet:
        backward's (activations, loss, one parameter's gradient) and the optimizer step's (fp32
        grad shard)."""
        backward_peak = self.activations + self.logits_and_loss + self.param_grad
        return (
            self.model_states
            + self.bucket_buffers
            + self.prefetch_buffers
            + self.recv_buffers
            + max(backward_peak, self.step_grad_shard)
        )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "optimizer": self.optimizer, "model_states": self.model_states, "total": self.total}


@dataclass(frozen=True)
class TrafficPerRank:
    """Bytes one rank sends per optimizer step (ring algorithm) and the time they take.

    Seconds come from the step-time model (:class:`~lightning_zero.planner.timing.StepTime`,
    [Note: step-time model]): ``dp_s`` is every dp collective's time on its link,
    ``exposed_comm_s`` the part compute does not hide, ``step_s`` the predicted step.
    """

    dp_reduce_scatter_bytes: float
    dp_all_gather_bytes: float
    dp_all_reduce_bytes: float  # stage 0 (plain DDP) only
    tp_all_reduce_bytes: float  # every TP collective's bytes (by kind: tp_bytes_by_kind)
    dp_link: str  # "intra_node" or "inter_node"
    dp_bytes_per_s: float
    tp_bytes_per_s: float
    flops_per_rank: float  # matmul FLOPs per step, recompute included
    compute_s: float  # flops / (peak * mfu), tp all-reduces included
    dp_s: float
    tp_s: float
    exposed_comm_s: float
    step_s: float
    # dp bytes by link class ([Note: link classes] in docs/topology.md) and each class's busy time
    dp_link_bytes: LinkBytes = field(default_factory=lambda: LinkBytes({}, {}))
    intra_node_s: float = 0.0  # dp collectives on intra-node links (tp excluded: see tp_s)
    inter_node_s: float = 0.0
    # TP bytes by CommCounter label: "tp_all_reduce", or under sequence parallelism
    # "tp_all_gather_seq" + "tp_reduce_scatter_seq" (same total) + "tp_all_reduce_norm_grad"
    tp_bytes_by_kind: dict[str, float] = field(default_factory=dict)
    # context parallelism: the all-to-alls' bytes per step (Ulysses), every cp byte by CommCounter
    # label ("cp_all_to_all", or ring attention's "cp_ring_kv"), the link the cp group crosses, and
    # their seconds (blocking, inside compute_s like tp_s)
    cp_all_to_all_bytes: float = 0.0
    cp_bytes_by_kind: dict[str, float] = field(default_factory=dict)
    cp_link: str = "intra_node"
    cp_s: float = 0.0
    # expert parallelism: the tokens' all-to-alls by CommCounter label (a balanced router), the link
    # the ep group crosses, and their seconds (blocking, inside compute_s like tp_s)
    ep_bytes_by_kind: dict[str, float] = field(default_factory=dict)
    ep_link: str = "intra_node"
    ep_s: float = 0.0
    # pipeline parallelism: activations and their gradients this rank sends to (and receives from)
    # its neighbouring stages per step ([Note: pipeline bytes] in pp/cost.py), and the link they take
    pp_sent_bytes: float = 0.0
    pp_received_bytes: float = 0.0
    pp_link: str = "intra_node"

    @property
    def cp_bytes(self) -> float:
        """Every byte one rank sends in its cp group per step (Ulysses' all-to-alls or the ring's hops)."""
        return sum(self.cp_bytes_by_kind.values())

    @property
    def ep_all_to_all_bytes(self) -> float:
        return sum(self.ep_bytes_by_kind.values())

    @property
    def dp_bytes(self) -> float:
        return self.dp_reduce_scatter_bytes + self.dp_all_gather_bytes + self.dp_all_reduce_bytes

    @property
    def intra_node_bytes(self) -> float:
        """Every byte this rank sends inside its node per step: dp collectives whose group stays in
        the node, the tp all-reduces (tp lives inside a node), and cp bytes whose group does."""
        cp = self.cp_bytes if self.cp_link == "intra_node" else 0.0
        ep = self.ep_all_to_all_bytes if self.ep_link == "intra_node" else 0.0
        pp = self.pp_sent_bytes if self.pp_link == "intra_node" else 0.0
        return self.dp_link_bytes.intra_node_total + self.tp_all_reduce_bytes + cp + ep + pp

    @property
    def inter_node_bytes(self) -> float:
        cp = self.cp_bytes if self.cp_link == "inter_node" else 0.0
        ep = self.ep_all_to_all_bytes if self.ep_link == "inter_node" else 0.0
        pp = self.pp_sent_bytes if self.pp_link == "inter_node" else 0.0
        return self.dp_link_bytes.inter_node_total + cp + ep + pp

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.update(
            dp_bytes=self.dp_bytes,
            dp_link_bytes=self.dp_link_bytes.as_dict(),
            intra_node_bytes=self.intra_node_bytes,
            inter_node_bytes=self.inter_node_bytes,
            ep_all_to_all_bytes=self.ep_all_to_all_bytes,
            cp_bytes=self.cp_bytes,
        )
        return values


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
    dp: int  # ranks that take different samples (world = dp * cp * tp)
    tp: int
    precision: str
    micro_batch: int
    seq_len: int
    accumulate_grad_batches: int
    tokens_per_step: int  # over all dp ranks and micro batches
    activation_checkpointing: bool  # full recompute ("full"); the mode is `checkpointing`
    attention: str
    bucket_mb: float
    prefetch_blocks: int
    defer_grad_reduce: bool
    overlap_comm: bool
    max_buckets_in_flight: int
    overlap_param_gather: bool
    shard_size: int  # dp ranks ZeRO shards over (resolved: dp for None, the node's dp ranks for "node")
    replicas: int  # dp / shard_size groups holding the same shard
    hierarchical_reduce: bool
    grad_comm_dtype: Optional[str]
    param_comm_dtype: Optional[str]
    hardware: str
    memory_bytes: int
    reserved_bytes: int
    mfu: float
    memory: MemoryPerRank
    traffic: TrafficPerRank
    timing: Optional[StepTime]
    activation_detail: ActivationBytes
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    reduce_dtype: str = "compute"  # gradient buffers and reduce-scatters: "compute" or "fp32"
    mixed_params: str = "auto"  # -mixed precisions: fp32 or half parameters ([Note: mixed_params])
    checkpointing: str = "none"  # "none" | "selective" | "full" ([Note: checkpointing modes])
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel size: ranks one sequence is split over (dp counts samples)
    # cp > 1: how attention runs, "ulysses" or "ring" (cp.layout.attention_layout), and the line
    # the engine states before launch for a kv repeat or the ring (cp.layout.layout_notice)
    cp_attention: str = ""
    cp_notice: str = ""
    ep: int = 1  # expert-parallel size: ranks a mixture of experts' experts are split over
    expert_params_per_rank: int = 0  # of params_per_tp_rank: this rank's experts (ep > 1), sharded over edp
    # "adamw" or "muon" (planner/muon.py with_muon: the figures below, 0 under AdamW)
    optimizer: str = "adamw"
    muon_owner_flops: float = 0.0  # Newton-Schulz FLOPs of the busiest owner per step
    muon_exchange_bytes: float = 0.0  # owner exchange bytes one rank sends per step (to owners, back, over tp)
    muon_momentum_bytes: float = 0.0  # momenta the busiest owner holds (whole matrices it owns)
    muon_step_s: float = 0.0  # the optimizer step with Muon (NS + exchange + element-wise)
    adamw_step_s: float = 0.0  # the same step with AdamW on every parameter
    # pipeline parallelism (pp > 1): the schedule, stages per rank, micro-batches per batch, blocks per
    # stage, the bubble, which pp rank the memory and time above are of (the fullest), and every rank's
    # stage plan (planner/pipeline.py); dp, tokens and world count every pp rank
    pp: int = 1
    pp_schedule: str = ""
    pp_virtual_stages: int = 1
    pp_microbatches: int = 1
    pp_layers: tuple[int, ...] = ()
    bubble_fraction: float = 0.0
    pp_rank: int = 0
    pipeline: Any = None  # a planner.pipeline.PipelinePlan

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (``dp * cp / ep``): expert states are sharded over them."""
        return self.dp * self.cp // self.ep

    @property
    def available_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.available_bytes

    @property
    def lossless(self) -> bool:
        """No collective sends fewer bits than the tensor it carries: a ``grad_comm_dtype`` /
        ``param_comm_dtype`` of ``"int8"``, or ``"bf16"`` for fp32 gradients (``32-true``,
        ``reduce_dtype="fp32"``) or fp32 parameters, is lossy (docs/compression.md)."""
        param_bytes = precision_bytes(self.precision, mixed_params=self.mixed_params).param
        grad_bytes = grad_bytes_per_param(self.precision, self.reduce_dtype, self.mixed_params)
        wire_bytes = {None: 4, "fp32": 4, "bf16": 2, "int8": 1}
        native = ((self.grad_comm_dtype, grad_bytes), (self.param_comm_dtype, param_bytes))
        return all(wire_bytes[comm] >= need for comm, need in native)

    @property
    def step_s(self) -> float:
        return self.traffic.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

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
            timing=self.timing.as_dict() if self.timing is not None else None,
            activation_detail=self.activation_detail.as_dict(),
            pipeline=self.pipeline.as_dict() if self.pipeline is not None else None,
            suggestions=list(self.suggestions),
            notes=list(self.notes),
            available_bytes=self.available_bytes,
            fits=self.fits,
            verdict=self.verdict,
        )
        return values
