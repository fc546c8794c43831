"""What one micro batch computes on one rank, in the engine's order: FLOPs, per-tensor backward
and per-unit forward seconds (:class:`Workload`), and the gradient buckets the engine cuts
(:func:`engine_buckets`). The step-time model (``timing.py``, [Note: step-time model]) simulates
the collectives against this.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Sequence

from lightning_zero.cp.layout import RingLayout, attention_layout, ulysses_layout
from lightning_zero.models.checkpointing import CheckpointingLike, checkpointing_mode
from lightning_zero.planner.hardware import Link, collective_seconds
from lightning_zero.zero.bucketing import bucket_sizes, first_bucket_numel, padded_numel
from lightning_zero.zero.stage3.gather_order import gathered_high_water, held_entries

# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


def head_dim(config: Any) -> int:
    """Per-head width: ``config.head_dim`` where the model sets it apart (Qwen3, DeepSeek), else
    ``dim // n_heads``."""
    return getattr(config, "head_dim", None) or config.dim // config.n_heads


def is_moe(config: Any) -> bool:
    """Whether ``config`` is a mixture of experts (a ``MoEConfig``: ``n_experts`` routed experts)."""
    return bool(getattr(config, "n_experts", 0))


@dataclass(frozen=True)
class LayerTensor:
    """One parameter tensor of a decoder layer as one rank holds it: ``numel`` held, ``active``
    elements one token's matmuls touch (``0``: a norm gain, no matmul), its optimizer param group
    (0 matrices with weight decay, 1 norm gains) and whether it is an expert parameter."""

    name: str
    numel: int
    active: int
    group: int = 0
    expert: bool = False


def layer_tensors(config: Any, layer: int, *, tp: int = 1, ep: int = 1) -> tuple[LayerTensor, ...]:
    """See :func:`_layer_tensors`."""
    return model_layers(config, tp=tp, ep=ep)[layer]


def model_layers(config: Any, *, tp: int = 1, ep: int = 1) -> tuple[tuple[LayerTensor, ...], ...]:
    """:func:`_layer_tensors` of every layer (memoized: the layout search asks for the same layers
    many times)."""
    key = (repr(config), tp, ep)
    layers = _LAYERS.get(key)
    if layers is None:
        if len(_LAYERS) > 1024:
            _LAYERS.clear()
        layers = _LAYERS[key] = tuple(
            tuple(_layer_tensors(config, layer, tp=tp, ep=ep)) for layer in range(config.n_layers)
        )
    return layers


_LAYERS: dict[tuple, tuple[tuple[LayerTensor, ...], ...]] = {}


def _layer_tensors(config: Any, layer: int, *, tp: int = 1, ep: int = 1) -> list[LayerTensor]:
    """Layer ``layer``'s parameters on one rank, in registration order: Llama's block (attention
    norm, ``wq wk wv wo``, FFN norm, SwiGLU ``w1 w3 w2``, matrices split over ``tp``), or a
    ``MoEConfig``'s (q/k norms after ``wo`` with ``qk_norm``; after the first ``n_dense_layers`` the
    SwiGLU replaced by the router ``(E, dim)``, the stacked experts ``w1 w3 w2`` of which a rank
    holds ``E / ep`` while a token runs ``top_k`` of them, and the shared experts' SwiGLU). Under
    tensor parallelism a MoE layer is not split: it runs on the rank's ``T / tp`` sequence shard
    ([Note: experts and tensor parallelism] in ``models/moe/parallelize.py``), so it holds whole tensors and
    computes ``1 / tp`` of the tokens (its ``active`` elements divided by ``tp``)."""
    dim, hd = config.dim, head_dim(config)
    q_dim, kv_dim = config.n_heads * hd, (getattr(config, "n_kv_heads", None) or config.n_heads) * hd
    tensors = [LayerTensor("attention_norm.weight", dim, 0, 1)]
    bias = getattr(config, "qkv_bias", False)  # Qwen2.5: after each of wq, wk, wv's weight
    for name, numel in (("wq", dim * q_dim), ("wk", dim * kv_dim), ("wv", dim * kv_dim), ("wo", q_dim * dim)):
        tensors.append(LayerTensor(f"attention.{name}.weight", numel // tp, numel // tp))
        if bias and name != "wo":
            tensors.append(LayerTensor(f"attention.{name}.bias", numel // dim // tp, 0, 1))  # no decay, no matmul
    if getattr(config, "qk_norm", False):
        tensors += [LayerTensor("attention.q_norm.weight", hd, 0, 1), LayerTensor("attention.k_norm.weight", hd, 0, 1)]
    tensors.append(LayerTensor("ffn_norm.weight", dim, 0, 1))

    def swiglu(prefix: str, width: int) -> list[LayerTensor]:
        return [
            LayerTensor(f"{prefix}.{name}.weight", dim * width // tp, dim * width // tp) for name in ("w1", "w3", "w2")
        ]

    if not is_moe(config) or layer < config.n_dense_layers:
        return tensors + swiglu("feed_forward", config.ffn_dim)
    experts, width = config.n_experts, config.expert_ffn_dim
    tensors.append(LayerTensor("moe.router.weight", experts * dim, experts * dim // tp))
    for name in ("w1", "w3", "w2"):
        held, active = experts // ep * width * dim, config.top_k * width * dim // tp
        tensors.append(LayerTensor(f"moe.experts.{name}", held, active, 0, True))
    shared = dim * config.shared_ffn_dim
    if shared:
        tensors += [LayerTensor(f"moe.shared.{name}.weight", shared, shared // tp) for name in ("w1", "w3", "w2")]
    return tensors


def _matmul_active(config: Any, tp: int) -> int:
    """Matmul elements one token runs through in every layer on one tp rank (memoized)."""
    key = (repr(config), tp)
    if key not in _ACTIVE:
        if len(_ACTIVE) > 1024:
            _ACTIVE.clear()
        _ACTIVE[key] = sum(tensor.active for layer in model_layers(config, tp=tp) for tensor in layer)
    return _ACTIVE[key]


_ACTIVE: dict[tuple, int] = {}


def attention_forward_flops(config: Any, *, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1) -> float:
    """Causal ``softmax(q k^T) v`` of one block: ``2 B T^2 d / tp`` (half of the full ``4 B T^2 d``;
    ``d`` the query heads' width, ``n_heads x head_dim``); with context parallelism a rank attends
    over all ``T`` tokens with ``1/cp`` of the heads."""
    return 2.0 * micro_batch * seq_len * seq_len * config.n_heads * head_dim(config) / (tp * cp)


def recompute_flops(
    config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    activation_checkpointing: CheckpointingLike = False,
    cp: int = 1,
) -> float:
    """FLOPs backward recomputes per micro batch on one tp (and cp) rank ([Note: checkpointing
    modes]): ``"full"`` every block's forward, ``"selective"`` every block's attention core
    (:func:`attention_forward_flops`: no linear layer), ``"none"`` nothing."""
    mode = checkpointing_mode(activation_checkpointing)
    attention = attention_forward_flops(config, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp)
    if mode == "selective":
        return config.n_layers * attention
    if mode == "full":
        matmuls = _matmul_active(config, tp)
        return 2.0 * micro_batch * seq_len / cp * matmuls + config.n_layers * attention
    return 0.0


def training_flops(
    config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    activation_checkpointing: CheckpointingLike = False,
    cp: int = 1,
) -> float:
    """Matmul FLOPs of one forward + backward of one micro batch on one tp rank (the model's
    ``6 x matmul params x tokens`` + attention, the matmul parameters being those a token runs
    through: a mixture of experts' ``top_k`` routed experts, its router and shared experts,
    :func:`layer_tensors`; + :func:`recompute_flops` under checkpointing);
    with context parallelism (``cp``) on one of the cp ranks, which holds ``T/cp`` tokens of each
    sequence and attends over all ``T`` with ``1/cp`` of the heads: ``1/cp`` of the whole."""
    tokens = micro_batch * seq_len / cp
    matmuls = _matmul_active(config, tp)
    attention = attention_forward_flops(config, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp)
    head_forward = 2.0 * tokens * config.dim * config.vocab_size / tp
    forward = 2.0 * tokens * matmuls + config.n_layers * attention + head_forward
    recompute = recompute_flops(
        config,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=tp,
        activation_checkpointing=activation_checkpointing,
        cp=cp,
    )
    return 3 * forward + recompute


def cp_all_to_all_payloads(config: Any, *, tokens: int, cp: int, tp: int, act_bytes: int) -> tuple[float, float]:
    """Bytes each of one attention layer's two all-to-alls (q/k/v there, the output back) carries
    from one rank, ``tokens`` being ``B T`` of the rank's samples ([Note: Ulysses attention] in
    ``cp/ulysses.py``): its ``B T / cp`` tokens of a TP rank's query heads, kv heads (repeated
    ``kv_repeats`` times where they do not split over cp, ``cp/layout.py``), and query heads back."""
    layout = ulysses_layout(cp, tp, config)
    per_head = tokens // cp * head_dim(config) * act_bytes
    qkv = per_head * (layout.q_heads_per_tp_rank + 2 * layout.kv_heads_exchanged)
    return float(qkv), float(per_head * layout.q_heads_per_tp_rank)


# --------------------------------------------------------------------------------------------
# The engine's schedule, in plain numbers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as one tp rank holds it, with the compute its backward costs."""

    name: str
    numel: int
    reg_index: int  # registration order (``model.named_parameters()``)
    unit: int  # stage-3 unit, in forward order: 0 embedding, 1..L blocks, L+1 final norm, L+2 head
    group: int  # optimizer param group: 0 weight matrices (decay), 1 norm gains (no decay)
    backward_s: float  # compute (and blocking tp collectives) of its backward, recompute included
    expert: bool = False  # an expert parameter: its own ZeRO domain ([Note: expert domain] in zero/domains.py)


@dataclass(frozen=True)
class Workload:
    """What one micro batch computes on one rank, in seconds, in the engine's order."""

    tensors: tuple[Tensor, ...]  # in registration order
    unit_forward_s: tuple[float, ...]  # per unit, forward order (tp all-reduces included)
    compute_forward_s: float
    compute_backward_s: float
    tp_s: float  # part of the two above spent in tp all-reduces (blocking)
    shape_key: tuple = ()  # equal for workloads with the same tensors (bucket layouts can be shared)
    # units whose parameters the engine stores in its root unit (a tied embedding: [Note: shared
    # parameters] in zero/stage3/units.py): gathered when a step begins, kept until backward ends
    root_units: frozenset[int] = frozenset()
    cp_s: float = 0.0  # part of compute_forward_s + compute_backward_s spent in cp all-to-alls (blocking)
    ep_s: float = 0.0  # part of compute_forward_s + compute_backward_s spent in ep all-to-alls (blocking)

    @cached_property
    def numel(self) -> int:
        """Parameter elements one rank holds (every tensor)."""
        return sum(tensor.numel for tensor in self.tensors)

    @cached_property
    def expert_numel(self) -> int:
        """Of :attr:`numel`, the expert parameters'."""
        return sum(tensor.numel for tensor in self.tensors if tensor.expert)

    @cached_property
    def largest_numel(self) -> int:
        """Elements of the largest parameter tensor."""
        return max(tensor.numel for tensor in self.tensors)


def recorded_schedule(workload: Workload) -> tuple[list[int], list[bool]]:
    """The stage-3 schedule the engine records for this workload ([Note: gather schedule] in
    ``zero/stage3/schedule.py``): unit indices and whether each entry is a backward gather. The
    root (gathered when the step begins and kept) is the first entry, when there is one; then the
    other units in forward order, and in reverse for backward."""
    units = sorted({tensor.unit for tensor in workload.tensors} - workload.root_units)
    order = sorted(workload.root_units)[:1] + units + units[::-1]
    return order, [False] * (len(order) - len(units)) + [True] * len(units)


def held_units(workload: Workload) -> frozenset[int]:
    """Stage-3 units that stay gathered from their forward into their backward, by the engine's
    rule (``held_entries``, [Note: held into backward] in ``zero/stage3/schedule.py``) applied to
    :func:`recorded_schedule`. For a decoder, the head (the final norm when the head is tied)."""
    order, in_backward = recorded_schedule(workload)
    return frozenset(unit for unit, held in zip(order, held_entries(order, in_backward)) if held)


def gathered_once_units(workload: Workload) -> frozenset[int]:
    """Stage-3 units all-gathered once per micro batch instead of twice: those held from forward
    into backward (:func:`held_units`) and those stored in the root (``Workload.root_units``)."""
    return held_units(workload) | workload.root_units


def gathered_once_numel(workload: Workload, expert: bool = False) -> int:
    """Elements of one domain (dense, or ``expert``) one rank's stage-3 backward does not
    all-gather again (:func:`gathered_once_units`)."""
    once = gathered_once_units(workload)
    return sum(tensor.numel for tensor in workload.tensors if tensor.unit in once and tensor.expert == expert)


def gathered_numel(workload: Workload, prefetch: int) -> int:
    """Most parameter elements one rank's stage 3 holds gathered at once with ``prefetch_blocks =
    prefetch``: the engine's walk (``gathered_high_water``, [Note: gathered working set] in
    ``zero/stage3/gather_order.py``) of :func:`recorded_schedule`, plus the root units, gathered for
    the whole step. Memoized by tensor shapes, as :func:`engine_buckets`."""
    if not workload.shape_key:
        return _gathered_numel(workload, prefetch)
    key = (workload.shape_key, prefetch)
    if key not in _GATHERED:
        if len(_GATHERED) > 1024:
            _GATHERED.clear()
        _GATHERED[key] = _gathered_numel(workload, prefetch)
    return _GATHERED[key]


_GATHERED: dict[tuple, int] = {}


def _gathered_numel(workload: Workload, prefetch: int) -> int:
    numel: dict[int, int] = {}
    for tensor in workload.tensors:
        numel[tensor.unit] = numel.get(tensor.unit, 0) + tensor.numel
    root = sum(numel.pop(unit, 0) for unit in workload.root_units)
    order, in_backward = recorded_schedule(workload)
    return root + gathered_high_water(order, in_backward, numel, prefetch)


_WORKLOADS: dict[tuple, "Workload"] = {}


@dataclass(frozen=True)
class WorkloadShape:
    """What one rank computes per micro batch, and on which links its blocking collectives run:
    ``micro_batch`` samples of ``seq_len`` tokens, the ``tp`` / ``cp`` / ``ep`` splits (with
    ``sequence_parallel``), the checkpointing mode, the FLOP rate, the activation bytes per
    element; ``cp_link`` / ``ep_link`` default to ``tp_link``. Hashable: the memo key."""

    micro_batch: int
    seq_len: int
    tp: int
    activation_checkpointing: CheckpointingLike
    flops_per_s: float
    tp_link: Link
    act_bytes: int
    sequence_parallel: bool = False
    cp: int = 1
    cp_link: Optional[Link] = None
    ep: int = 1
    ep_link: Optional[Link] = None


def llama_workload(config: Any, **shape: Any) -> Workload:
    """Per-tensor backward time and per-unit forward time of the project's Llama on one tp rank
    (memoized on every input: the layout search asks for the same one many times). Keywords:
    the fields of :class:`WorkloadShape`; :func:`_llama_workload` says what is counted."""
    key = (repr(config), WorkloadShape(**shape))
    workload = _WORKLOADS.get(key)
    if workload is None:
        if len(_WORKLOADS) > 256:
            _WORKLOADS.clear()
        workload = _WORKLOADS[key] = _llama_workload(config, key[1])
    return workload


def _llama_workload(config: Any, shape: WorkloadShape) -> Workload:
    """Per-tensor backward time and per-unit forward time of the project's Llama (or mixture of
    experts, ``MoEConfig``: :func:`layer_tensors`) on one rank.

    ``tp_all_reduce`` is one activation all-reduce of ``B T dim``, or under ``sequence_parallel``
    the reduce-scatter plus all-gather that replace it (same bytes and ring steps); the norm
    gains' gradient sums of sequence parallelism (``dim`` elements) are left out (latency only).
    With context parallelism (``cp > 1``) the rank holds ``T/cp`` tokens of each sequence (``B T``
    below is ``B T/cp``) and each block's attention adds its two all-to-alls on ``cp_link``
    forward and two backward (``cp_exchange``, blocking: attention waits for them), and the
    recomputed ones under full checkpointing ([Note: Ulysses attention] in ``cp/ulysses.py``).
    Where the query heads do not split over ``tp * cp`` the layout runs ring attention
    (``cp.layout.attention_layout``): forward ``cp - 1`` hops of its key/value block, backward
    ``2 cp - 1`` (the block's and its gradient's), each one step of ``latency + block / bandwidth``
    on ``cp_link``, blocking; its attention FLOPs are those of the last cp rank, which attends to
    all ``cp`` blocks (as many as a Ulysses rank; [Note: ring attention] in
    ``cp/ring_attention.py``), and selective checkpointing recomputes none of it.
    A MoE layer runs its ``top_k`` experts' matmuls per token (a balanced router gives a rank's
    experts ``B T k`` rows), and with expert parallelism (``ep > 1``) its token exchange: dispatch
    and combine forward, their mirrors backward, each an all-to-all of ``B T k`` rows of ``dim``
    on ``ep_link`` (``ep_exchange``, blocking), the forward pair again under full recompute
    ([Note: all-to-all bytes] in ``planner/moe.py``)."""
    micro_batch, seq_len, tp, cp, ep = shape.micro_batch, shape.seq_len, shape.tp, shape.cp, shape.ep
    flops_per_s, tp_link, act_bytes = shape.flops_per_s, shape.tp_link, shape.act_bytes
    cp_link, ep_link, sequence_parallel = shape.cp_link, shape.ep_link, shape.sequence_parallel
    mode = checkpointing_mode(shape.activation_checkpointing)
    tokens = micro_batch * seq_len // cp
    attention = attention_forward_flops(config, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp) / flops_per_s
    cp_exchange = cp_backward = 0.0  # one block's two all-to-alls (q/k/v there, the output back), or ring hops
    layout = attention_layout(cp, tp, config) if cp > 1 else None
    ring = isinstance(layout, RingLayout)
    link = cp_link if cp_link is not None else tp_link
    if ring:
        block = layout.kv_block_numel(micro_batch * seq_len, head_dim(config)) * act_bytes
        hop = link.latency_s + block / link.bytes_per_s
        cp_exchange, cp_backward = (cp - 1) * hop, (layout.kv_hops() - (cp - 1)) * hop
    elif cp > 1:
        cp_exchange = cp_backward = sum(
            collective_seconds("all_to_all", payload, cp, link)
            for payload in cp_all_to_all_payloads(
                config, tokens=micro_batch * seq_len, cp=cp, tp=tp, act_bytes=act_bytes
            )
        )
    ep_exchange = 0.0  # one MoE layer's dispatch (or combine): B T k rows of dim (of the T/tp shard)
    if ep > 1:
        rows = tokens // tp * config.top_k * config.dim * act_bytes
        ep_exchange = collective_seconds("all_to_all", rows, ep, ep_link if ep_link is not None else tp_link)
    payload = tokens * config.dim * act_bytes
    if sequence_parallel:
        tp_gather = collective_seconds("all_gather", payload, tp, tp_link)
        tp_all_reduce = collective_seconds("reduce_scatter", payload, tp, tp_link) + tp_gather
        recomputed_tp = tp_all_reduce + tp_gather  # both gathers and wo's reduce-scatter
    else:
        tp_all_reduce = recomputed_tp = collective_seconds("all_reduce", payload, tp, tp_link)  # wo's
    head_forward = 2.0 * tokens * config.dim * config.vocab_size / tp / flops_per_s

    tensors: list[Tensor] = []

    def add(name: str, numel: int, unit: int, group: int, backward_s: float, expert: bool = False) -> None:
        tensors.append(Tensor(name, numel, len(tensors), unit, group, backward_s, expert))

    add("tok_embeddings.weight", config.vocab_size * config.dim // tp, 0, 0, 0.0)  # its input needs no grad
    block_forwards = []
    ep_s = tp_s = 0.0
    for layer, members in enumerate(model_layers(config, tp=tp, ep=ep)):
        unit = layer + 1
        moe = any(member.expert for member in members)
        exchanges = 2 * ep_exchange if moe else 0.0  # dispatch + combine (backward: their mirrors)
        # the FFN's TP collective forward and backward, and the gradients summed over TP: a MoE layer
        # runs whole on the T/tp shard ([Note: experts and tensor parallelism] in models/moe/parallelize.py)
        ffn_tp, recompute_tp, grad_sum = tp_all_reduce, recomputed_tp, 0.0
        if moe and tp > 1:
            ffn_tp = 0.0 if sequence_parallel else collective_seconds("all_gather", payload, tp, tp_link)
            recompute_tp = tp_all_reduce  # attention's collectives only
            summed = sum(m.numel for m in members if m.name.startswith("moe.")) * act_bytes
            grad_sum = collective_seconds("all_reduce", summed, tp, tp_link)
        block_forward = (
            sum(2.0 * tokens * member.active for member in members) / flops_per_s
            + attention
            + tp_all_reduce
            + ffn_tp
            + cp_exchange
            + exchanges
        )
        block_forwards.append(block_forward)
        recompute = {"none": 0.0, "selective": 0.0 if ring else attention, "full": block_forward}[mode]
        ep_s += exchanges * (3 if mode == "full" else 2)
        tp_s += 2 * tp_all_reduce + 2 * ffn_tp + grad_sum + (recompute_tp if mode == "full" else 0.0)
        # backward runs the tensors in reverse: the last registered (the FFN's output projection)
        # first, after the block's recompute; attention's core between wo and wv
        backward = [4.0 * tokens * member.active / flops_per_s for member in members]
        backward[-1] += recompute + ffn_tp + exchanges + grad_sum
        names = [member.name for member in members]
        backward[names.index("attention.wv.weight")] += 2 * attention + cp_backward
        backward[names.index("attention.wo.weight")] += tp_all_reduce
        for member, seconds in zip(members, backward):
            add(f"layers.{layer}.{member.name}", member.numel, unit, member.group, seconds, member.expert)
    head_backward = 2 * head_forward + tp_all_reduce
    if getattr(config, "tie_embeddings", False):
        # A tied head has no tensor of its own (its gradient completes at the embedding, the
        # last tensor of backward): its backward compute precedes the final norm's gradient.
        add("norm.weight", config.dim, config.n_layers + 1, 1, head_backward)
    else:
        add("norm.weight", config.dim, config.n_layers + 1, 1, 0.0)
        add("output.weight", config.dim * config.vocab_size // tp, config.n_layers + 2, 0, head_backward)
    unit_forward = (tp_all_reduce, *block_forwards, 0.0, head_forward)
    # full recompute stops before w2 (non-reentrant checkpoint): see planner.traffic.tp_bytes_by_kind
    return Workload(
        tensors=tuple(tensors),
        unit_forward_s=unit_forward,
        compute_forward_s=sum(unit_forward),
        compute_backward_s=sum(t.backward_s for t in tensors),
        tp_s=(tp_s + 2 * tp_all_reduce) if tp > 1 else 0.0,
        shape_key=(repr(config), tp, ep),
        root_units=frozenset({0}) if getattr(config, "tie_embeddings", False) else frozenset(),
        cp_s=config.n_layers * (cp_exchange * (2 if mode == "full" else 1) + cp_backward),
        ep_s=ep_s,
    )


@dataclass(frozen=True)
class PlannedBucket:
    """A run of tensors reduced by one collective (``FlatLayout``'s buckets: [Note: bucket boundaries])."""

    tensors: tuple[int, ...]  # indices into Workload.tensors, in the order their grads arrive
    numel: int  # padded to a multiple of its domain's shard group (dp, or edp for experts)
    first_reg_index: int  # the reducer launches later-registered buckets first
    expert: bool = False  # of the expert domain: reduced and sharded over the edp group


def flat_buckets(
    tensors: Sequence[Tensor],
    indices: Sequence[int],
    *,
    bucket_numel: int,
    dp: int,
    first_bucket_numel: Optional[int] = None,
    expert: bool = False,
) -> list[PlannedBucket]:
    """``zero/flat.py``'s layout of ``indices`` (registration order): laid in reverse and cut by
    :func:`~lightning_zero.zero.bucketing.bucket_sizes`, the engine's own rule; ``expert``: the
    layout is of the expert domain."""
    laid = list(reversed(list(indices)))  # registration order, reversed: the earliest comes last
    counts = bucket_sizes(
        (tensors[index].numel for index in laid), bucket_numel=bucket_numel, first_bucket_numel=first_bucket_numel
    )
    buckets: list[PlannedBucket] = []
    taken = 0
    for count in counts:
        members = tuple(laid[taken : taken + count])
        taken += count
        used = sum(tensors[index].numel for index in members)
        buckets.append(PlannedBucket(members, padded_numel(used, dp), tensors[members[-1]].reg_index, expert))
    return buckets


_BUCKETS: dict[tuple, list[PlannedBucket]] = {}


def engine_buckets(
    workload: Workload, *, stage: int, bucket_numel: int, dp: int, grad_bytes: int, expert_dp: Optional[int] = None
) -> list[PlannedBucket]:
    """Buckets in launch order. ZeRO: one layout per optimizer param group and domain (per unit
    too under stage 3; expert parameters apart, padded to ``expert_dp``, the edp group: [Note:
    expert domain] in ``zero/domains.py``, as ``zero/build.py`` cuts them), launched by descending
    first registration index (``reducer.GradReducer``); stages 1-2 close their first bucket at
    ``FIRST_BUCKET_MB`` of ``grad_bytes`` elements, as the engine's ``FlatLayout`` does. DDP
    (stage 0): one layout over every parameter in reverse order. ``expert_dp=None``: no expert
    domain (``ep == 1``: expert parameters are dense ones). Memoized by tensor shapes (the search
    asks for the same layouts for every micro batch and checkpointing choice)."""
    key = (workload.shape_key or id(workload), stage, bucket_numel, dp, grad_bytes, expert_dp)
    if not workload.shape_key or key not in _BUCKETS:
        if len(_BUCKETS) > 1024:
            _BUCKETS.clear()
        _BUCKETS[key] = _engine_buckets(
            workload, stage=stage, bucket_numel=bucket_numel, dp=dp, grad_bytes=grad_bytes, expert_dp=expert_dp
        )
    return _BUCKETS[key]


def _engine_buckets(
    workload: Workload, *, stage: int, bucket_numel: int, dp: int, grad_bytes: int, expert_dp: Optional[int]
) -> list[PlannedBucket]:
    tensors = workload.tensors
    if stage == 0:
        return flat_buckets(tensors, range(len(tensors)), bucket_numel=bucket_numel, dp=1)
    first = first_bucket_numel(bucket_numel, grad_bytes) if stage in (1, 2) else None
    layouts: dict[tuple[int, int, bool], list[int]] = {}
    for index, tensor in enumerate(tensors):
        domain = tensor.expert and expert_dp is not None
        layouts.setdefault((tensor.unit if stage == 3 else 0, tensor.group, domain), []).append(index)
    buckets: list[PlannedBucket] = []
    for key in sorted(layouts):
        ranks = expert_dp if key[2] else dp
        buckets.extend(
            flat_buckets(
                tensors,
                layouts[key],
                bucket_numel=bucket_numel,
                dp=ranks,
                first_bucket_numel=first,  # type: ignore[arg-type]
                expert=key[2],
            )  # fmt: skip
        )
    return sorted(buckets, key=lambda b: -b.first_reg_index)
