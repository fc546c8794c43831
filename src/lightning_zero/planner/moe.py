"""Expert parallelism's all-to-all bytes, from routing counts (measured) or from a balanced
router (planned). Plain Python: the planner imports no torch.

[Note: all-to-all bytes] One MoE layer's exchanges on an ``ep`` group ([Note: token exchange] in
``ep/dispatch.py``), for ep rank ``r`` holding experts ``L(r)``, with ``count[s][e]`` the
assignments rank ``s`` routed to expert ``e`` and ``row`` the bytes of one token row
(``dim x`` the compute dtype's bytes):

- ``moe_dispatch`` (forward) and ``moe_combine_grad`` (backward, its mirror): rank ``r`` sends
  ``sum over e not in L(r) of count[r][e]`` rows (its tokens for other ranks' experts);
- ``moe_combine`` (forward) and ``moe_dispatch_grad`` (backward): rank ``r`` sends back
  ``sum over s != r, e in L(r) of count[s][e]`` rows (the other ranks' tokens its experts ran).

What stays on the rank is not sent (the own split). The per-(rank, expert) counts go first in
a small all-to-all (``moe_counts``: ``(ep - 1) x E/ep`` int64 a layer, a control exchange).
Under "full" activation checkpointing a block's forward runs again in backward, exchanges included:
forward labels count twice. Balanced routing (the planner's assumption): every expert gets
``tokens x top_k / E`` of a rank's assignments, so a rank sends ``(ep - 1) / ep`` of its
``tokens x top_k`` rows in each of the four exchanges.

[Note: planning a mixture of experts] :func:`plan_moe` plans a rank of an MoE run (tp = cp = 1):
model states by the ZeRO formulas per domain (``ledger.model_state_bytes(expert_params=, ep=)``:
dense parameters over ``dp * cp``, a rank's ``experts / ep`` over the ``dp * cp / ep`` EDP ranks);
stage 3's gathered units (``prefetch + 1`` blocks, each with this rank's experts); activations and
FLOPs of the *active* model (a dense decoder whose SwiGLU is ``top_k`` experts (+ shared) wide:
what one token runs through; the dispatched copies of a token's row are not counted apart); the
four all-to-alls per MoE layer with a balanced router, on the intra-node link when the ep group
fits in a node, not overlapped with compute; ZeRO's reduce-scatter and all-gather per domain,
hidden behind backward up to the hardware's overlap efficiency. It is coarser than ``plan_run``'s
bucket-by-bucket simulation of a Llama step; docs/moe.md says what it leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

MOE_EXCHANGES = ("moe_dispatch", "moe_combine", "moe_dispatch_grad", "moe_combine_grad")


def _flat_layers(counts: Any) -> list[list[float]]:
    """``counts`` ``(layers, E)`` (nested lists or a tensor) as a list of rows."""
    rows = counts.tolist() if hasattr(counts, "tolist") else counts
    return [list(map(float, row)) for row in rows]


def all_to_all_bytes(counts_by_rank: Sequence[Any], *, rank: int, ep: int, row_bytes: float,
                     recomputed: bool = False) -> dict[str, float]:  # fmt: skip
    """Bytes ep rank ``rank`` sends per exchange label for one forward + backward, given every ep
    rank's counts ``(moe layers, E)`` ([Note: all-to-all bytes]). ``recomputed``: "full"
    activation checkpointing (forward exchanges twice)."""
    layers = [_flat_layers(counts) for counts in counts_by_rank]
    n_experts = len(layers[rank][0])
    n_local = n_experts // ep
    mine = range(rank * n_local, (rank + 1) * n_local)
    out_rows = sum(c for layer in layers[rank] for e, c in enumerate(layer) if e not in mine)
    back_rows = sum(
        layer[e] for source, per_layer in enumerate(layers) if source != rank for layer in per_layer for e in mine
    )
    forward = 2.0 if recomputed else 1.0
    sent = {
        "moe_dispatch": forward * out_rows * row_bytes,
        "moe_combine": forward * back_rows * row_bytes,
        "moe_dispatch_grad": back_rows * row_bytes,
        "moe_combine_grad": out_rows * row_bytes,
    }
    return {label: value for label, value in sent.items() if value or ep > 1}


def balanced_all_to_all_bytes(tokens: int, *, top_k: int, ep: int, moe_layers: int, row_bytes: float,
                              recomputed: bool = False) -> float:  # fmt: skip
    """Bytes one rank sends per step in all four exchanges of ``moe_layers`` layers when the
    router balances perfectly: ``(2 + 2 or 4 with recompute) x (ep-1)/ep x tokens x k x row``."""
    if ep == 1:
        return 0.0
    per_exchange = moe_layers * tokens * top_k * row_bytes * (ep - 1) / ep
    return per_exchange * (6.0 if recomputed else 4.0)


# --------------------------------------------------------------------------------------------
# A plan for a mixture of experts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEPlan:
    """What one rank of a mixture-of-experts run holds, sends and spends per optimizer step
    ([Note: planning a mixture of experts]). Bytes per rank; seconds per optimizer step."""

    model: str
    stage: int
    world_size: int
    devices_per_node: int
    ep: int
    micro_batch: int
    seq_len: int
    accumulate_grad_batches: int
    activation_checkpointing: str
    precision: str
    dense_params: int
    expert_params: int
    model_state_bytes: float
    gathered_bytes: float
    activation_bytes: float
    usable_bytes: float
    all_to_all_bytes: float
    all_to_all_link: str
    grad_sync_bytes: float
    compute_s: float
    all_to_all_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.gathered_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    @property
    def edp(self) -> int:
        return self.world_size // self.ep

    def describe(self) -> str:
        gib = 2.0**30
        return (
            f"{self.model}: {self.world_size} GPUs ({self.nodes} node(s) x {self.devices_per_node}), ZeRO-{self.stage},"
            f" ep={self.ep} (edp={self.edp}), micro batch {self.micro_batch} x {self.seq_len} tokens x"
            f" {self.accumulate_grad_batches} accumulation, checkpointing {self.activation_checkpointing},"
            f" {self.precision}\n"
            f"  per GPU: {self.total_bytes / gib:.1f} GiB of {self.usable_bytes / gib:.1f} usable"
            f" ({'fits' if self.fits else 'does NOT fit'}): model states {self.model_state_bytes / gib:.1f},"
            f" gathered {self.gathered_bytes / gib:.1f}, activations {self.activation_bytes / gib:.1f}"
            f" (dense {self.dense_params / 1e9:.2f}B params over dp*cp={self.world_size},"
            f" experts {self.expert_params / 1e9:.2f}B / ep={self.ep} over edp={self.edp})\n"
            f"  per step: {self.step_s:.2f} s = compute {self.compute_s:.2f} + all-to-all {self.all_to_all_s:.2f}"
            f" ({self.all_to_all_bytes / 1e9:.2f} GB, {self.all_to_all_link}) + exposed ZeRO comm"
            f" {self.exposed_comm_s:.2f}; {self.tokens_per_s:,.0f} tokens/s"
        )


def _active_proxy(config: Any) -> Any:
    """A dense ``LlamaConfig`` whose FLOPs and saved activations per token are the MoE model's
    active ones: each MoE layer as a SwiGLU of width ``top_k x expert_ffn + shared`` (what one
    token runs through), dense layers averaged in ([Note: planning a mixture of experts])."""
    from lightning_zero.models.llama.config import LlamaConfig

    moe_width = config.top_k * config.expert_ffn_dim + config.shared_ffn_dim
    width = round((config.n_dense_layers * config.ffn_dim + config.n_moe_layers * moe_width) / config.n_layers)
    heads_dim = config.n_heads * config.head_dim
    return LlamaConfig(
        name=f"{config.name}_active", vocab_size=config.vocab_size, dim=heads_dim, n_layers=config.n_layers,
        n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, ffn_dim=width * heads_dim // config.dim or 1,
        max_seq_len=config.max_seq_len,
    )  # fmt: skip


def plan_moe(
    model_config: Any,
    *,
    stage: int,
    world_size: int,
    devices_per_node: int,
    ep: int,
    precision: str = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: Optional[int] = None,
    accumulate_grad_batches: int = 1,
    activation_checkpointing: Any = False,
    hardware: Any = None,
    mfu: Optional[float] = None,
    reserved_gib: float = 2.0,
    prefetch_blocks: int = 1,
) -> MoEPlan:
    """Plan one rank of a mixture-of-experts run under ZeRO ``stage`` with ``ep`` expert-parallel
    ranks (tp = cp = 1): see [Note: planning a mixture of experts]. Raises ``ValueError`` for a
    layout that does not divide (``check_moe_layout``, ``ParallelDims``), naming the fix."""
    from lightning_zero.comm.mesh import ParallelDims
    from lightning_zero.models.checkpointing import checkpointing_mode
    from lightning_zero.models.moe.config import check_moe_layout, resolve_moe_config
    from lightning_zero.planner.hardware import collective_seconds, load_hardware
    from lightning_zero.planner.ledger import llama_activation_bytes, model_state_bytes, precision_bytes
    from lightning_zero.planner.workload import training_flops

    config = resolve_moe_config(model_config)
    check_moe_layout(config, ep=ep)
    dims = ParallelDims(world_size=world_size, devices_per_node=devices_per_node, ep=ep)
    if stage not in (1, 2, 3):
        raise ValueError(f"plan_moe: stage must be 1, 2 or 3, got {stage!r}")
    seq_len = int(seq_len or config.max_seq_len)
    checkpointing = checkpointing_mode(activation_checkpointing, "plan_moe: activation_checkpointing")
    hw = load_hardware(hardware)
    mfu = mfu if mfu is not None else (hw.mfu if hw.mfu is not None else 0.4)
    dtype = precision_bytes(precision)
    total, experts = config.num_params(), config.expert_params()
    states = model_state_bytes(total, stage=stage, dp=dims.dp_cp, param_bytes=dtype.param, grad_bytes=dtype.grad,
                               optim_bytes_per_param=dtype.optimizer, expert_params=experts, ep=ep)  # fmt: skip
    # Stage 3 holds the gathered units in flight: a block with this rank's experts, prefetch + 1 of them.
    block = (total - experts - 2 * config.vocab_size * config.dim) / config.n_layers
    block += config.expert_params_per_layer() / ep
    gathered = (prefetch_blocks + 1) * block * dtype.param if stage == 3 else 0.0
    proxy = _active_proxy(config)
    acts = llama_activation_bytes(proxy, micro_batch=micro_batch, seq_len=seq_len, act_bytes=dtype.activation)
    kept = {"none": acts.per_layer, "selective": acts.selective_per_layer, "full": acts.checkpointed_per_layer}
    activation = config.n_layers * kept[checkpointing] + acts.head + acts.logits_and_loss
    if checkpointing == "full":
        activation += acts.per_layer  # one block recomputed in backward
    tokens = micro_batch * seq_len
    peak = hw.peak_fp32_flops if str(precision).startswith("32") else hw.peak_bf16_flops
    flops = training_flops(proxy, micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=checkpointing)
    compute = accumulate_grad_batches * flops / (peak * mfu)
    # The token exchange: ep consecutive ranks; inside a node when the group fits in one.
    a2a_link = "inter_node" if ep > devices_per_node else "intra_node"
    a2a_bytes = accumulate_grad_batches * balanced_all_to_all_bytes(
        tokens, top_k=config.top_k, ep=ep, moe_layers=config.n_moe_layers, row_bytes=config.dim * dtype.activation,
        recomputed=checkpointing == "full",
    )  # fmt: skip
    link = hw.link(inter_node=a2a_link == "inter_node")
    exchanges = accumulate_grad_batches * config.n_moe_layers * (6 if checkpointing == "full" else 4)
    a2a_s = exchanges * (ep - 1) * link.latency_s + a2a_bytes / link.bytes_per_s if ep > 1 else 0.0
    # ZeRO's gradient reduce-scatter and parameter all-gather, per domain (ring bytes and time).
    spans = world_size > devices_per_node
    dense_bytes = (total - experts) * dtype.grad
    expert_bytes = experts / ep * dtype.grad
    edp_spans = spans and dims.edp > devices_per_node // ep if ep <= devices_per_node else spans
    sync_s = collective_seconds("reduce_scatter", dense_bytes, dims.dp_cp, hw.link(spans))
    sync_s += collective_seconds("reduce_scatter", expert_bytes, dims.edp, hw.link(edp_spans))
    gathers = 2 * accumulate_grad_batches if stage == 3 else 1
    sync_s += gathers * collective_seconds(
        "all_gather", dense_bytes / dtype.grad * dtype.param, dims.dp_cp, hw.link(spans)
    )
    sync_s += gathers * collective_seconds(
        "all_gather", expert_bytes / dtype.grad * dtype.param, dims.edp, hw.link(edp_spans)
    )
    grad_sync_bytes = (dense_bytes * (dims.dp_cp - 1) / dims.dp_cp) + (expert_bytes * (dims.edp - 1) / max(dims.edp, 1))
    backward = compute * 2 / 3
    exposed = max(0.0, sync_s - hw.overlap_efficiency * backward)
    step = compute + a2a_s + exposed + hw.step_overhead_s
    return MoEPlan(
        model=config.name, stage=stage, world_size=world_size, devices_per_node=devices_per_node, ep=ep,
        micro_batch=micro_batch, seq_len=seq_len, accumulate_grad_batches=accumulate_grad_batches,
        activation_checkpointing=checkpointing, precision=str(precision), dense_params=total - experts,
        expert_params=experts, model_state_bytes=states.total, gathered_bytes=gathered, activation_bytes=activation,
        usable_bytes=hw.memory_bytes - reserved_gib * 2**30, all_to_all_bytes=a2a_bytes, all_to_all_link=a2a_link,
        grad_sync_bytes=grad_sync_bytes, compute_s=compute, all_to_all_s=a2a_s, exposed_comm_s=exposed,
        step_s=step, tokens_per_s=world_size * accumulate_grad_batches * tokens / step,
    )  # fmt: skip


def search_moe(
    model_config: Any,
    *,
    world_size: int,
    devices_per_node: int,
    global_batch_tokens: Optional[int] = None,
    seq_len: Optional[int] = None,
    micro_batches: Sequence[int] = (1, 2, 4),
    **options: Any,
) -> list[MoEPlan]:
    """Every (ep, stage, micro batch, checkpointing) layout of ``world_size`` ranks that fits,
    fastest first (tokens/s). ``ep`` runs over the divisors of ``n_experts`` that divide
    ``world_size``; with ``global_batch_tokens`` the accumulation keeps the global batch."""
    from lightning_zero.models.moe.config import resolve_moe_config

    config = resolve_moe_config(model_config)
    seq_len = int(seq_len or config.max_seq_len)
    plans = []
    for ep in (d for d in range(1, config.n_experts + 1) if config.n_experts % d == 0 and world_size % d == 0):
        for stage in (1, 2, 3):
            for micro_batch in micro_batches:
                accumulate = 1
                if global_batch_tokens is not None:
                    accumulate = max(1, global_batch_tokens // (world_size * micro_batch * seq_len))
                for checkpointing in ("none", "selective", "full"):
                    plan = plan_moe(config, stage=stage, world_size=world_size, devices_per_node=devices_per_node,
                                    ep=ep, micro_batch=micro_batch, seq_len=seq_len, activation_checkpointing=checkpointing,
                                    accumulate_grad_batches=accumulate, **options)  # fmt: skip
                    if plan.fits:
                        plans.append(plan)
    return sorted(plans, key=lambda plan: -plan.tokens_per_s)


def run_moe_plan(container: dict[str, Any], *, console: Any = None) -> dict[str, Any]:
    """``lightning-zero plan`` for a mixture-of-experts model (``model.name`` a MoE preset): the
    configured layout (``strategy.stage``, ``strategy.ep``, ``trainer.devices`` x
    ``trainer.num_nodes``, ``data.batch_size`` x ``data.seq_len``, accumulation, precision,
    checkpointing) with :func:`plan_moe`, and with ``plan.search=true`` the fastest layouts of the
    same world and global batch (:func:`search_moe`). Prints text (or JSON with
    ``plan.format=json``); returns the JSON-ready dict."""
    import dataclasses
    import json

    from lightning_zero.models.moe.config import MoEConfig, check_moe_layout, resolve_moe_config
    from lightning_zero.planner.hardware import load_hardware

    model = dict(container.get("model") or {})
    checkpointing = model.pop("activation_checkpointing", False)
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    config = resolve_moe_config({k: v for k, v in model.items() if k in fields and v is not None})
    strategy = container.get("strategy") or {}
    trainer = container.get("trainer") or {}
    data = container.get("data") or {}
    options = container.get("plan") or {}
    hardware = load_hardware(container.get("hardware"))
    devices = trainer.get("devices", hardware.devices_per_node)
    devices = devices if isinstance(devices, int) and not isinstance(devices, bool) else hardware.devices_per_node
    world = devices * int(trainer.get("num_nodes") or 1)
    tp = strategy.get("tensor_parallel_size", 1)
    check_moe_layout(config, ep=int(strategy.get("ep", 1)), tp=devices if tp == "auto" else int(tp))
    common = dict(
        world_size=world, devices_per_node=devices, precision=str(trainer.get("precision") or "bf16-mixed"),
        seq_len=int(data.get("seq_len") or config.max_seq_len), hardware=hardware,
        mfu=None if options.get("mfu") is None else float(options["mfu"]),
        reserved_gib=float(options.get("reserved_gib", 2.0)),
        prefetch_blocks=int(strategy.get("prefetch_blocks", 1)),
    )  # fmt: skip
    plan = plan_moe(config, stage=int(strategy.get("stage", 2)), ep=int(strategy.get("ep", 1)),
                    micro_batch=int(data.get("batch_size") or 1), activation_checkpointing=checkpointing,
                    accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1), **common)  # fmt: skip
    result: dict[str, Any] = {"plan": dataclasses.asdict(plan) | {"fits": plan.fits, "nodes": plan.nodes}}
    lines = [plan.describe()]
    if options.get("search"):
        tokens = plan.world_size * plan.micro_batch * plan.accumulate_grad_batches * plan.seq_len
        found = search_moe(config, global_batch_tokens=tokens, **common)
        top = found[: int(options.get("top") or 5)]
        result["search"] = [dataclasses.asdict(p) for p in top]
        lines.append(f"search: {len(found)} layouts fit; the fastest:")
        lines += [f"{i + 1}. {p.describe()}" for i, p in enumerate(top)]
    text = json.dumps(result, indent=2) if options.get("format") == "json" else "\n".join(lines)
    (console.print if console is not None else print)(text)
    return result
