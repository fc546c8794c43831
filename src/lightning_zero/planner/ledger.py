"""Bytes per rank: the ZeRO paper's formulas (predicted) and what the engine holds (measured).

The paper (Rajbhandari et al., 2020, section 5) counts model states for mixed-precision Adam as
``2 + 2 + K`` bytes per parameter with ``K = 12`` (fp32 master, momentum, variance), and divides
them over ``Nd`` data-parallel ranks by stage:

====== ============ ============ ==================
stage  params       grads        optimizer states
====== ============ ============ ==================
0      2 P          2 P          K P
1      2 P          2 P          K P / Nd
2      2 P          2 P / Nd     K P / Nd
3      2 P / Nd     2 P / Nd     K P / Nd
====== ============ ============ ==================

For ``precision="32-true"`` with Adam the same table holds with ``param_bytes=4, grad_bytes=4,
optim_bytes_per_param=8`` (the parameter shard is its own master copy).

[Note: one ledger module] Every byte formula stays in this one module, although it runs past
500 lines: model states, bytes per parameter by precision, the Llama shapes (parameter counts,
activations) and the bytes per link class under hybrid sharding. They are one concern (bytes,
never seconds: no hardware, no simulation), and this module is the one light file the runtime
monitor and ``lightning_zero.ledger`` load ([Note: planner imports]); split, each of those
imports would load several planner modules, and a formula's neighbours (the activation bytes
beside the parameter counts they divide) would live apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, Union

from lightning_zero.comm.ring import ring_sent
from lightning_zero.cp.layout import RingLayout, attention_layout, kv_head_repeats
from lightning_zero.models.checkpointing import CheckpointingLike, checkpointing_mode
from lightning_zero.precision import DTYPE_BYTES, PrecisionPolicy, precision_policy
from lightning_zero.precision import PRECISIONS as PRECISION_NAMES
from lightning_zero.zero.bucketing import grad_element_bytes, keeps_full_grads
from lightning_zero.zero.matrix_owners import DEFAULT_NS_STEPS, assign_owners, ns_flops


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of model states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}

    def __getitem__(self, key: str) -> float:
        return self.as_dict()[key]


def model_state_bytes(
    num_params: int,
    *,
    stage: int,
    dp: int,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optim_bytes_per_param: int = 12,
    expert_params: int = 0,
    ep: int = 1,
    defer_grad_reduce: bool = False,
) -> ModelStateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO ``stage``.

    Gradients are full-size where the engine keeps them so (``zero.bucketing.keeps_full_grads``:
    stages 0-1, and stages 2-3 with ``defer_grad_reduce``), else sharded.

    ``stage=0`` is plain data parallelism. ``num_params`` is the count one data-parallel replica
    holds (with tensor parallelism: the parameters of one tp rank). Returns a
    :class:`ModelStateBytes` with ``params``, ``grads``, ``optimizer`` and ``total``; it also
    supports ``result["total"]``.

    Expert parallelism ([Note: expert domain] in ``zero/domains.py``): ``expert_params`` of the
    ``num_params`` are experts split over ``ep`` ranks; a rank holds ``expert_params / ep`` of them,
    sharded over the ``dp / ep`` ranks holding the same experts, and the other
    ``num_params - expert_params`` (dense) sharded over ``dp`` (here: the dense group, ``dp * cp``).

    Example (the paper's Figure 1: 7.5B parameters, 64 ranks, K = 12)::

        >>> model_state_bytes(7_500_000_000, stage=3, dp=64).total / 1e9
        1.875
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"model_state_bytes: stage must be 0, 1, 2 or 3, got stage={stage!r}")
    if dp < 1:
        raise ValueError(f"model_state_bytes: dp must be >= 1, got dp={dp!r}")
    if num_params < 0:
        raise ValueError(f"model_state_bytes: num_params must be >= 0, got {num_params!r}")
    if ep < 1 or dp % ep != 0 or not 0 <= expert_params <= num_params:
        raise ValueError(
            f"model_state_bytes: ep({ep}) must divide dp({dp}) and 0 <= expert_params({expert_params}) <="
            f" num_params({num_params})"
        )

    def per_rank(bytes_per_param: int, sharded: bool) -> float:
        """Bytes a rank holds of a state, ``sharded`` over dp or not."""
        dense_over, expert_over = (dp, dp // ep) if sharded else (1, 1)
        dense = bytes_per_param * (num_params - expert_params) / dense_over
        return dense + bytes_per_param * expert_params / ep / expert_over if expert_params else dense

    params = per_rank(param_bytes, stage >= 3)
    grads = per_rank(grad_bytes, not keeps_full_grads(stage, defer_grad_reduce))
    optimizer = per_rank(optim_bytes_per_param, stage >= 1)
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)


# --------------------------------------------------------------------------------------------
# Bytes per parameter: the one table the planner, the monitor and the tests read
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter (and per activation element) of a Lightning precision with Adam."""

    param: int  # compute copy
    grad: int
    master: int  # fp32 master copy, only as a shard inside the optimizer (0: the param is its own)
    moments: int  # Adam exp_avg + exp_avg_sq
    activation: int
    optimizer_step_bytes: int  # bytes the AdamW step moves per stepped parameter (timing)
    state: int = 4  # bytes per element of optimizer state (fp32, or the half dtype under -true)

    @property
    def optimizer(self) -> int:
        return self.master + self.moments

    def optimizer_bytes(self, fp32_state_bytes: int) -> int:
        """Optimizer bytes per parameter for an optimizer holding ``fp32_state_bytes`` of state per
        parameter in fp32 (:func:`optimizer_state_bytes`): the master plus that state in this
        precision's state dtype."""
        return self.master + fp32_state_bytes * self.state // 4


def policy_bytes(policy: PrecisionPolicy) -> PrecisionBytes:
    """Bytes per parameter where ``policy`` keeps them (``precision.py`` says where each byte
    lives; this says how many). Optimizer step traffic: AdamW reads/writes the param, exp_avg and
    exp_avg_sq and reads the grad (28 B in fp32, half that in a half-precision state); separate fp32
    masters add the grad-shard cast to fp32 (2 + 4 B) and the master -> half copy (4 + 2 B)."""
    state = policy.state_bytes
    master = state if policy.separate_masters else 0
    return PrecisionBytes(
        param=policy.param_bytes,
        grad=policy.param_bytes,
        master=master,
        moments=2 * state,
        activation=DTYPE_BYTES[policy.autocast or policy.params],
        optimizer_step_bytes=28 * state // 4 + (12 if policy.separate_masters else 0),
        state=state,
    )


PRECISIONS: dict[str, PrecisionBytes] = {name: policy_bytes(precision_policy(name)) for name in PRECISION_NAMES}
"""Bytes per parameter of every precision ZeroStrategy accepts, under the default knobs."""


def precision_bytes(precision: str, master_weights: str = "auto", mixed_params: str = "auto") -> PrecisionBytes:
    """Bytes per parameter of ``precision`` under the knobs ``master_weights`` and ``mixed_params``
    (``ZeroConfig``'s): the one rule the planner, the monitor and the tests read. The policy, and
    the knobs' validation, is ``precision.precision_policy`` ([Note: master_weights],
    [Note: mixed_params] there)."""
    try:
        return policy_bytes(precision_policy(precision, master_weights, mixed_params))
    except ValueError as error:
        raise ValueError(f"precision_bytes: {error} (trainer.precision=..., strategy.<knob>=...)") from None


def grad_bytes_per_param(precision: str, reduce_dtype: str = "compute", mixed_params: str = "auto") -> int:
    """Bytes per gradient element the engine holds and reduce-scatters: the precision's gradient
    bytes (``mixed_params``: ``ZeroConfig.mixed_params``), or 4 with
    ``ZeroStrategy(reduce_dtype="fp32")`` (fp32 bucket buffers and gradient shards under bf16-mixed;
    no effect where the gradients are fp32 already). The planner, the monitor and the tests read
    gradient bytes through this function."""
    if reduce_dtype not in ("compute", "bf16", "fp32"):
        raise ValueError(
            f'grad_bytes_per_param: reduce_dtype must be "compute", "bf16" or "fp32", got {reduce_dtype!r}'
        )
    # [Note: bucket_mb counts gradient bytes] in zero/bucketing.py
    return grad_element_bytes(precision_bytes(precision, mixed_params=mixed_params).grad, reduce_dtype == "fp32")


# Optimizer state bytes per (fp32) parameter, by optimizer class name: what the ledger's ``K``
# adds on top of the fp32 master copy. SGD holds momentum only when ``momentum != 0``.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "Adam": 8,
    "AdamW": 8,
    "NAdam": 8,
    "RAdam": 8,
    "Adamax": 8,
    "SGD": 0,
    "RMSprop": 4,
    "Adagrad": 4,
}


def optimizer_state_bytes(optimizer: Any) -> int:
    """State bytes per parameter ``optimizer`` keeps (fp32); unknown optimizers count as Adam."""
    name = type(optimizer).__name__
    if name == "SGD":
        return 4 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    return OPTIMIZER_STATE_BYTES.get(name, 8)


# 0-d state tensors per stepped tensor, by optimizer class name: torch keeps ``step`` as a 0-d fp32
# tensor (NAdam adds ``mu_product``); SGD keeps none. Unknown optimizers count as Adam.
OPTIMIZER_SCALAR_STATE: dict[str, int] = {"NAdam": 2, "SGD": 0}
SCALAR_STATE_BYTES = 4


def held_state_bytes(optimizer: Any, numels: Sequence[int], state_bytes: int = 4) -> int:
    """Bytes of state ``optimizer`` keeps for stepped tensors of ``numels`` elements (under ZeRO:
    this rank's runs of each parameter, its ``1/dp`` share): :func:`optimizer_state_bytes` per
    element in a ``state_bytes`` dtype, plus each tensor's 0-d counters. The monitor's prediction
    of what an element-wise optimizer holds; Muon's momenta are
    ``momenta_by_owner``."""
    per_element = optimizer_state_bytes(optimizer) * state_bytes // 4
    scalars = OPTIMIZER_SCALAR_STATE.get(type(optimizer).__name__, 1) * SCALAR_STATE_BYTES
    return sum(numel * per_element + scalars for numel in numels)


def momenta_by_owner(
    shapes: Sequence[tuple[int, int]],
    ranks: int,
    *,
    state_bytes: int = 4,
    ns_steps: int = DEFAULT_NS_STEPS,
    tp: Union[int, Sequence[int]] = 1,
) -> list[int]:
    """Bytes of momenta each of ``ranks`` ranks holds when Muon steps the whole matrices ``shapes``:
    every matrix's momentum whole on its owner ([Note: matrix owners]: the engine's assignment), in
    a ``state_bytes`` dtype; under tensor parallelism ``1/tp`` of it (``tp``: one for all, or each
    matrix's split count), the owner's shard. The one rule the Plan (``planner/muon.py`` ``with_muon``,
    through ``muon_cost``) and the run's monitor (``runtime/monitor.py``) count Muon's state by."""
    splits = [tp] * len(shapes) if isinstance(tp, int) else list(tp)
    owners = assign_owners([float(ns_flops(rows, cols, ns_steps)) for rows, cols in shapes], ranks)
    held = [0] * ranks
    for (rows, cols), owner, split in zip(shapes, owners, splits):
        held[owner] += rows * cols // split * state_bytes
    return held


# --------------------------------------------------------------------------------------------
# Llama shapes: parameter counts, activations, communication (used by the planner).
# Every function here is arithmetic on a config object; nothing allocates a tensor.
# The formulas are written out in docs/planner.md.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaParamCounts:
    """Parameter counts of a Llama model as one tensor-parallel rank holds them.

    With ``tp > 1`` every weight matrix (q/k/v/o, w1/w2/w3, embedding, output head) is split
    ``tp`` ways; the RMSNorm weights are replicated on every tp rank. A tied head
    (``tie_embeddings``) is the embedding's Parameter: ``output`` is 0 and the one table is
    counted (stored, reduced, gathered) once, in ``embedding``.
    """

    embedding: int  # tok_embeddings: vocab x dim (vocab-parallel)
    block: int  # one transformer block: attention + feed_forward + 2 RMSNorms
    n_layers: int
    final_norm: int
    output: int  # untied head: dim x vocab (column-parallel over vocab); 0 when tied to the embedding

    @property
    def blocks(self) -> int:
        return self.block * self.n_layers

    @property
    def total(self) -> int:
        return self.embedding + self.blocks + self.final_norm + self.output

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "blocks": self.blocks, "total": self.total}


def _kv_heads(config: Any) -> int:
    return getattr(config, "n_kv_heads", None) or config.n_heads


def llama_param_counts(config: Any, *, tp: int = 1) -> LlamaParamCounts:
    """Parameters of ``config`` (a ``LlamaConfig``: vocab_size, dim, n_layers, n_heads,
    n_kv_heads, ffn_dim) held by one of ``tp`` tensor-parallel ranks.

    Per block: ``wq, wo: dim x (n_heads * head_dim)``; ``wk, wv: dim x (n_kv_heads * head_dim)``
    (with ``qkv_bias`` their biases too); ``w1, w3: dim x ffn_dim``, ``w2: ffn_dim x dim``; two
    RMSNorm weights of ``dim`` (with ``qk_norm`` two of ``head_dim`` more). ``tp`` must divide the split sizes (``mesh.check_model_divisible`` says which).

        >>> # Llama 2 70B: 68,976,648,192 parameters; Llama 3.2 1B (tied): 1,235,814,400
    """
    if tp < 1:
        raise ValueError(f"llama_param_counts: tp must be >= 1, got tp={tp!r}")
    dim, head_dim = config.dim, getattr(config, "head_dim", None) or config.dim // config.n_heads
    q_dim, kv_dim = config.n_heads * head_dim, _kv_heads(config) * head_dim
    attention = 2 * dim * q_dim + 2 * dim * kv_dim
    attention += q_dim + 2 * kv_dim if getattr(config, "qkv_bias", False) else 0  # split with their rows
    feed_forward = 3 * dim * config.ffn_dim
    norms = 2 * dim + (2 * head_dim if getattr(config, "qk_norm", False) else 0)  # replicated
    return LlamaParamCounts(
        embedding=config.vocab_size * dim // tp,
        block=(attention + feed_forward) // tp + norms,
        n_layers=config.n_layers,
        final_norm=dim,
        output=0 if getattr(config, "tie_embeddings", False) else dim * config.vocab_size // tp,
    )


def llama_largest_block_param(config: Any, *, tp: int = 1) -> int:
    """Elements of a block's largest weight on one of ``tp`` ranks (``wq``/``wo`` or ``w1``/``w2``/``w3``)."""
    q_dim = config.n_heads * (getattr(config, "head_dim", None) or config.dim // config.n_heads)
    return max(config.dim * q_dim, config.dim * config.ffn_dim) // tp


ATTENTION_KERNELS = ("fused", "math")
CP_LOSS_SAVED = 8  # the cp loss's fp64 sum and count, two views of one [sum, count] tensor, counted once


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of activations one rank keeps for backward, for one micro batch.

    ``terms`` itemizes one transformer block without checkpointing and ``per_layer`` is their sum;
    ``checkpointed_per_layer`` is what a fully checkpointed block keeps (its input only) and
    ``selective_per_layer`` what a block keeps under selective checkpointing (``per_layer`` with
    attention's core, ``selective_recompute``, replaced by the projections' q, k, v). ``head`` is
    the final RMSNorm; ``loss_saved`` the fp32 log-probabilities the loss keeps for backward and
    ``logits_and_loss`` the peak around the loss (log-probabilities, their gradient and the
    logits' gradient, all fp32). The ``mode`` arguments take ``"none"`` / ``"selective"`` /
    ``"full"`` or a bool ([Note: checkpointing modes]). See docs/planner.md for each term.
    """

    terms: dict[str, float]
    per_layer: float
    checkpointed_per_layer: float
    n_layers: int
    head: float
    loss_saved: float
    logits_and_loss: float
    selective_per_layer: float = 0.0
    selective_recompute: float = 0.0  # attention core's saved tensors, rebuilt one block at a time

    def kept_per_layer(self, mode: CheckpointingLike) -> float:
        """What one block keeps between its forward and its backward under ``mode``."""
        return {
            "none": self.per_layer,
            "selective": self.selective_per_layer,
            "full": self.checkpointed_per_layer,
        }[checkpointing_mode(mode)]

    def saved_after_forward(self, mode: CheckpointingLike) -> float:
        """What autograd holds when forward has returned the loss (what a saved-tensor count sees)."""
        return self.n_layers * self.kept_per_layer(mode) + self.head + self.loss_saved

    def recompute_peak(self, mode: CheckpointingLike) -> float:
        """Bytes one block's recompute adds while its backward runs (``0`` without checkpointing)."""
        return {"none": 0.0, "selective": self.selective_recompute, "full": self.per_layer}[checkpointing_mode(mode)]

    def total(self, mode: CheckpointingLike) -> float:
        """Peak bytes: every block's kept tensors, plus one block's recompute in backward, the
        final norm, and the logits/loss peak."""
        return self.n_layers * self.kept_per_layer(mode) + self.recompute_peak(mode) + self.head + self.logits_and_loss

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rms_norm_saved_bytes(tokens: int, dim: int, act_bytes: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    # RMSNorm (computed in fp32) keeps: the fp32 input (the input itself in fp32, a copy
    # otherwise), rsqrt per token (fp32), the normalized value cast back (for the gain's grad) and
    # its output (kept by the Linear layers that read it). With sequence parallelism the first
    # three are on the rank's T/tp tokens and the output the Linear layers keep is the
    # all-gathered (B, T, dim).
    shard = tokens // tp if sequence_parallel else tokens
    return shard * dim * (4 + act_bytes) + shard * 4 + tokens * dim * act_bytes


def _moe_terms(config: Any, *, tokens: int, act_bytes: int, tp: int, ep: int) -> dict[str, float]:
    """A mixture of experts' feed-forward terms of :func:`llama_activation_bytes`, averaged over the
    layers: ``swiglu`` (dense layers' and shared experts'), ``moe_router``, ``moe_dispatched_rows``,
    ``moe_experts``, ``moe_indices``."""
    layers, moe = config.n_layers, config.n_layers - config.n_dense_layers
    shard = tokens // tp  # a MoE layer runs on the T/tp sequence shard (models/moe/parallelize.py)
    rows = shard * config.top_k  # the dispatched copies a balanced router gives a rank's experts
    per_moe = {
        "moe_router": 2 * shard * config.n_experts * 4,
        "moe_dispatched_rows": 2 * rows * config.dim * act_bytes,
        "moe_experts": 4 * rows * config.expert_ffn_dim * act_bytes,
        "moe_indices": rows * 8 * (4 if ep > 1 else 2),
    }
    dense_swiglu = 4 * tokens * (config.ffn_dim // tp) * act_bytes
    shared_swiglu = 4 * shard * config.shared_ffn_dim * act_bytes
    out = {name: value * moe / layers for name, value in per_moe.items()}
    out["swiglu"] = (config.n_dense_layers * dense_swiglu + moe * shared_swiglu) / layers
    return out


def llama_activation_bytes(
    config: Any,
    *,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    tp: int = 1,
    attention: str = "fused",
    sequence_parallel: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> ActivationBytes:
    """Activation bytes the ``lightning_zero.models.Llama`` block keeps for backward, per tp rank.

    Counts the tensors autograd saves in this implementation, for ``N = micro_batch * seq_len``
    tokens and ``act_bytes`` per element of the compute dtype (2 bf16, 4 fp32):

    - each RMSNorm: ``N * dim * (4 + 2 * act_bytes) + 4 N`` (fp32 input, normalized, output, rsqrt);
    - rotary: nothing (its cos/sin tables need no grad, so its products keep no input);
    - attention: the rotated q and the k, v that attention reads (repeated to the query heads under
      grouped-query attention), and the attention output (``wo``'s input); plus, for
      ``attention="fused"`` (SDPA's flash / memory-efficient kernels, what the model runs), a fp32
      log-sum-exp per head and token; for ``"math"`` (SDPA's reference path) the ``(B, heads, T, T)``
      softmax probabilities in the compute dtype;
    - SwiGLU: ``4 * N * ffn_dim * act_bytes`` (w1 x, silu(w1 x), w3 x, their product).

    With ``tp > 1`` everything between the column- and row-parallel layers is split by ``tp``; the
    norms' tensors are replicated (Megatron layout), or with ``sequence_parallel`` their input,
    normalized value and rsqrt are on ``N / tp`` tokens (only the gathered output the Linear
    layers read stays ``N * dim``), and a fully checkpointed block keeps ``N / tp`` tokens of input.
    Selective checkpointing keeps q, k, v as ``wq``/``wk``/``wv`` made them (``N (q + 2 kv) a``:
    not repeated) instead of the rotated/repeated copies and the kernel's log-sum-exp/probabilities.

    With context parallelism (``cp > 1``, [Note: Ulysses attention] in ``cp/ulysses.py``) a rank
    holds ``N / cp`` tokens of everything outside attention, and attention runs on all ``N``
    tokens of ``heads / (tp cp)`` heads: the same bytes as ``N / cp`` tokens of ``heads / tp``
    heads, so every term above is divided by ``cp`` (the exchanges keep nothing of their own),
    plus, for the fused kernel, its output in head layout (``attention_output_heads``: the kernel
    keeps it for backward, and ``wo`` keeps the copy exchanged back, ``attention_output``).
    Under selective checkpointing the kept q, k, v are the exchanged ones: key/value heads
    repeated for the exchange (``cp.layout.kv_head_repeats``) count repeated. Where the query heads
    do not split over ``tp * cp`` the layout runs ring attention (``cp.layout.attention_layout``,
    [Note: ring attention] in ``cp/ring_attention.py``), whatever ``attention`` says: it keeps its
    ``N / cp`` tokens of the rotated q and of k, v (not repeated), its output (built in q's token
    layout, so ``wo``'s input is a view of it: ``attention_output``) and a log-sum-exp per head and
    token in the compute dtype; selective checkpointing recomputes nothing of it (the ring replaces
    the core selective recomputes).

    A mixture of experts (``MoEConfig``: attention on ``n_heads x head_dim``) keeps, per MoE layer,
    instead of the SwiGLU: the router's fp32 logits and probabilities (``2 N E 4``); the
    dispatched copies of the tokens, ``M = N top_k`` rows of ``dim`` that a balanced router sends a
    rank's experts (kept by the experts' first matmuls) and the ``M`` rows combined back (kept by
    their weighting): ``2 M dim a``; the experts' SwiGLU on those rows, ``4 M expert_ffn a``; the
    int64 row indices of the sort and the gather back (``2 M 8``, with ``ep > 1`` two more: the
    regrouping by expert and back, ``ep/dispatch.py``); and the shared experts' SwiGLU. The
    ``terms`` are per layer averaged over the layers (dense layers keep their SwiGLU), so
    ``n_layers x per_layer`` is the model's total.
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"llama_activation_bytes: attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("act_bytes", act_bytes), ("tp", tp)):
        if value < 1:
            raise ValueError(f"llama_activation_bytes: {name} must be >= 1, got {value!r}")
    if cp < 1 or seq_len % cp != 0:
        raise ValueError(f"llama_activation_bytes: cp({cp}) must be >= 1 and divide seq_len({seq_len})")
    if sequence_parallel and (seq_len // cp) % tp != 0:
        raise ValueError(
            f"llama_activation_bytes: sequence_parallel needs tp({tp}) to divide seq_len({seq_len}) / cp({cp})"
        )
    tokens, dim, a = micro_batch * seq_len // cp, config.dim, act_bytes  # this rank's tokens
    head_dim = getattr(config, "head_dim", None) or dim // config.n_heads
    q_dim = config.n_heads * head_dim // tp  # this rank's query heads * head_dim
    kv_dim = _kv_heads(config) * head_dim // tp
    heads = config.n_heads // tp
    ring = cp > 1 and isinstance(attention_layout(cp, tp, config), RingLayout)
    exchanged_kv_dim = kv_dim * (kv_head_repeats(heads, _kv_heads(config) // tp, cp) if cp > 1 and not ring else 1)
    norm = _rms_norm_saved_bytes(tokens, dim, a, tp, sequence_parallel)
    terms: dict[str, float] = {
        "attention_norm": norm,
        "attention_q_k_v": tokens * (q_dim + 2 * (kv_dim if ring else max(q_dim, kv_dim))) * a,
        "attention_output": tokens * q_dim * a,
    }
    if ring:  # [Note: ring attention]: q, k, v, its output (wo's input, a view) and log-sum-exp
        terms["attention_logsumexp"] = tokens * heads * a
    elif attention == "fused":
        terms["attention_logsumexp"] = tokens * heads * 4
        if cp > 1:  # the kernel keeps its output; wo keeps the exchanged copy (attention_output)
            terms["attention_output_heads"] = tokens * q_dim * a
    else:
        terms["attention_probs"] = micro_batch * heads * seq_len * seq_len // cp * a
    terms["ffn_norm"] = norm
    terms["swiglu"] = 4 * tokens * (config.ffn_dim // tp) * a
    if getattr(config, "n_experts", 0):
        terms.update(_moe_terms(config, tokens=tokens, act_bytes=a, tp=tp, ep=ep))
    core = terms["attention_q_k_v"] + sum(
        terms.get(name, 0.0) for name in ("attention_logsumexp", "attention_probs", "attention_output_heads")
    )
    per_layer = float(sum(terms.values()))
    kept_q_k_v = tokens * (q_dim + 2 * exchanged_kv_dim) * a  # what selective keeps instead of the core
    if ring:  # selective checkpointing leaves the ring's saved tensors as they are
        core = kept_q_k_v = 0.0
    vocab = config.vocab_size // tp
    return ActivationBytes(
        terms=terms,
        per_layer=per_layer,
        # the block input, kept by checkpoint (a sequence shard under sequence parallelism)
        checkpointed_per_layer=float((tokens // tp if sequence_parallel else tokens) * dim * a),
        n_layers=config.n_layers,
        head=float(norm),
        # fp32 log-probs + int64 targets; under TP also the vocab-parallel embedding's local ids
        # (int64) and out-of-range mask, the loss's mask and the kept tokens' int64 indices; under
        # cp the global token mean's division keeps its fp64 sum and count ([Note: global token mean])
        loss_saved=float(
            tokens * vocab * 4
            + tokens * 8
            + (tokens * (8 + 1 + 1 + 8) if tp > 1 else 0)
            + (CP_LOSS_SAVED if cp > 1 else 0)
        ),
        logits_and_loss=float(3 * tokens * vocab * 4 + tokens * 8),
        selective_per_layer=per_layer - core + kept_q_k_v,
        selective_recompute=float(core),
    )


# --------------------------------------------------------------------------------------------
# Topology: bytes per link class under hybrid sharding, hierarchical reduction and compressed
# cross-node communication. Formulas written out in docs/topology.md.
# --------------------------------------------------------------------------------------------

LINK_CLASSES = ("intra_node", "inter_node")
COMM_DTYPES = (None, "fp32", "bf16", "int8")
# Block-wise int8: one fp32 scale per INT8_BLOCK_SIZE elements. Mirrors the block size constant of
# lightning_zero.comm.compression (the engine's); the planner keeps its own copy so it imports no engine.
INT8_BLOCK_SIZE = 256


def comm_element_bytes(comm_dtype: Optional[str], native_bytes: int) -> float:
    """Bytes one element takes on the wire: ``native_bytes`` uncompressed (``None``), 4 (fp32), 2
    (bf16), ``1 + 4 / INT8_BLOCK_SIZE`` (int8 plus its share of the block's fp32 scale)."""
    if comm_dtype is None:
        return float(native_bytes)
    if comm_dtype == "fp32":
        return 4.0
    if comm_dtype == "bf16":
        return 2.0
    if comm_dtype == "int8":
        return 1.0 + 4.0 / INT8_BLOCK_SIZE
    raise ValueError(f"comm dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")


@dataclass(frozen=True)
class Hop:
    """One collective a rank runs on a tensor of ``numel`` elements (a bucket, a unit, the model).

    ``fraction`` of the tensor is its payload (the full tensor, ``1 / g`` of it for the
    cross-node hop of a hierarchical reduce-scatter, the shard ``1 / shard_size`` for the replica
    all-reduce); ``link`` is ``"intra_node"`` or ``"inter_node"`` (a group spanning more than one
    node counts all its bytes as inter-node); ``comm_dtype`` the wire format.
    """

    kind: str  # "all_reduce", "reduce_scatter" or "all_gather"
    ranks: int
    fraction: float
    link: str
    comm_dtype: Optional[str]
    native_bytes: int

    def payload_bytes(self, numel: float) -> float:
        return numel * self.fraction * comm_element_bytes(self.comm_dtype, self.native_bytes)

    def sent_bytes(self, numel: float) -> float:
        """Ring algorithm (``lightning_zero/comm/ring.py``): all-reduce ``2 (n-1)/n x payload``, the
        others ``(n-1)/n x payload``."""
        return ring_sent(self.kind, self.payload_bytes(numel), self.ranks)


@dataclass(frozen=True)
class DpTopology:
    """How the ``dp`` data-parallel ranks of one tp position split into shard groups and replicas.

    dp ranks are numbered so that consecutive ones share a node (tp is innermost, inside the node):
    ``dp_per_node = min(dp, devices_per_node // tp)``. ZeRO shards over groups of ``shard_size``
    consecutive dp ranks; the ``replicas = dp / shard_size`` groups hold the same shard and
    all-reduce it. ``shard_size == dp``: ZeRO over the whole world (no replicas).
    """

    dp: int
    dp_per_node: int
    shard_size: int
    hierarchical_reduce: bool = False

    @property
    def replicas(self) -> int:
        return self.dp // self.shard_size

    @property
    def shard_spans_nodes(self) -> bool:
        return self.shard_size > self.dp_per_node

    @property
    def replica_spans_nodes(self) -> bool:
        return self.replicas > 1 and self.dp > self.dp_per_node

    @property
    def hierarchical(self) -> bool:
        """Hierarchical reduction applies: asked for, and the shard group spans nodes."""
        return self.hierarchical_reduce and self.shard_spans_nodes and self.dp_per_node > 1

    def link_of(self, spans: bool) -> str:
        return "inter_node" if spans else "intra_node"

    def grad_hops(self, *, stage: int, grad_bytes: int, grad_comm_dtype: Optional[str] = None) -> list[Hop]:
        """The collectives that turn one full gradient tensor into this rank's reduced shard.

        Stage 0 (Lightning DDP): one uncompressed all-reduce over dp. ZeRO: a reduce-scatter over
        the shard group (hierarchical: over the node's ``dp_per_node`` ranks, then over the
        ``shard_size / dp_per_node`` nodes on the node's slice), then, with replicas, an
        all-reduce of the shard over them. Cross-node hops go in ``grad_comm_dtype``.
        """

        def wire(spans: bool) -> Optional[str]:
            return grad_comm_dtype if spans else None

        if stage == 0:
            spans = self.dp > self.dp_per_node
            return _hops([Hop("all_reduce", self.dp, 1.0, self.link_of(spans), None, grad_bytes)])
        if self.hierarchical:
            g, nodes = self.dp_per_node, self.shard_size // self.dp_per_node
            hops = [
                Hop("reduce_scatter", g, 1.0, "intra_node", None, grad_bytes),
                Hop("reduce_scatter", nodes, 1.0 / g, "inter_node", wire(True), grad_bytes),
            ]
        else:
            spans = self.shard_spans_nodes
            hops = [Hop("reduce_scatter", self.shard_size, 1.0, self.link_of(spans), wire(spans), grad_bytes)]
        spans = self.replica_spans_nodes
        hops.append(
            Hop("all_reduce", self.replicas, 1.0 / self.shard_size, self.link_of(spans), wire(spans), grad_bytes)
        )
        return _hops(hops)

    def gather_hops(self, *, param_bytes: int, param_comm_dtype: Optional[str] = None) -> list[Hop]:
        """The all-gather of parameters over the shard group (stages 1-2 after the step, stage 3
        per unit); in ``param_comm_dtype`` when the group spans nodes."""
        spans = self.shard_spans_nodes
        return _hops(
            [
                Hop(
                    "all_gather",
                    self.shard_size,
                    1.0,
                    self.link_of(spans),
                    param_comm_dtype if spans else None,
                    param_bytes,
                )
            ]
        )


def _hops(hops: list[Hop]) -> list[Hop]:
    return [hop for hop in hops if hop.ranks > 1]  # a group of one rank sends nothing


def dp_topology(
    *,
    dp: int,
    devices_per_node: int,
    tp: int = 1,
    shard_size: Union[None, int, str] = None,
    hierarchical_reduce: bool = False,
) -> DpTopology:
    """Resolve and validate ``shard_size`` (``None``: all ``dp`` ranks; ``"node"``: the dp ranks of
    one node; an int: that many consecutive dp ranks) into a :class:`DpTopology`.

    Raises ``ValueError`` with every number when ``shard_size`` does not divide ``dp`` or a shard
    group would straddle a node boundary (it must divide, or be a multiple of, the dp ranks per node).
    """
    dp_per_node = max(1, min(dp, devices_per_node // max(1, tp)))
    if shard_size is None:
        size = dp
    elif shard_size == "node":
        size = dp_per_node
    elif isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be None, 'node' or a positive int, got shard_size={shard_size!r}")
    else:
        size = shard_size
    if dp % size:
        raise ValueError(
            f"shard_size({size}) does not divide dp({dp}) (world / tp): pick a divisor of {dp} "
            f"{[d for d in range(1, dp + 1) if dp % d == 0]}, 'node' ({dp_per_node}) or None"
        )
    if dp_per_node % size and size % dp_per_node:
        raise ValueError(
            f"shard_size({size}) neither divides nor is a multiple of the dp ranks per node({dp_per_node} = "
            f"devices_per_node({devices_per_node}) / tp({tp})): a shard group would straddle a node boundary"
        )
    return DpTopology(dp=dp, dp_per_node=dp_per_node, shard_size=size, hierarchical_reduce=bool(hierarchical_reduce))


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one rank sends per optimizer step on each link class, by collective kind."""

    intra_node: dict[str, float]
    inter_node: dict[str, float]

    @property
    def intra_node_total(self) -> float:
        return sum(self.intra_node.values())

    @property
    def inter_node_total(self) -> float:
        return sum(self.inter_node.values())

    def by_kind(self, kind: str) -> float:
        return self.intra_node.get(kind, 0.0) + self.inter_node.get(kind, 0.0)

    def plus(self, other: "LinkBytes") -> "LinkBytes":
        """Both rows' bytes, kind by kind (the dense and the expert domain's collectives)."""

        def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {kind: a.get(kind, 0.0) + b.get(kind, 0.0) for kind in {**a, **b}}

        return LinkBytes(add(self.intra_node, other.intra_node), add(self.inter_node, other.inter_node))

    def as_dict(self) -> dict[str, Any]:
        return {
            "intra_node": dict(self.intra_node),
            "inter_node": dict(self.inter_node),
            "intra_node_total": self.intra_node_total,
            "inter_node_total": self.inter_node_total,
        }


def grad_syncs_per_step(stage: int, micro_batches: int, defer_grad_reduce: bool = False) -> int:
    """Gradient reductions per optimizer step: stages 0-1 (and stages 2-3 with ``defer_grad_reduce``)
    accumulate full gradients and reduce once; stages 2-3 otherwise on every micro batch
    (``zero.bucketing.keeps_full_grads``, the engine's rule)."""
    return 1 if keeps_full_grads(stage, defer_grad_reduce) else micro_batches


def gathers_per_step(stage: int, micro_batches: int) -> int:
    """Parameter all-gathers of the whole model per optimizer step: stages 1-2 once after the
    step; stage 3 before each micro batch's forward and again before its backward; DDP none."""
    return {0: 0, 1: 1, 2: 1}.get(stage, 2 * micro_batches)


def dp_link_bytes(
    numel: int,
    *,
    stage: int,
    topology: DpTopology,
    micro_batches: int = 1,
    defer_grad_reduce: bool = False,
    grad_bytes: int = 2,
    param_bytes: int = 2,
    grad_comm_dtype: Optional[str] = None,
    param_comm_dtype: Optional[str] = None,
    gathered_once_numel: int = 0,
) -> LinkBytes:
    """Data-parallel bytes one rank sends per optimizer step on each link class, for ``numel``
    parameters per tp rank (padded to a multiple of ``shard_size``): every hop of
    :meth:`DpTopology.grad_hops` times :func:`grad_syncs_per_step`, plus every hop of
    :meth:`DpTopology.gather_hops` times :func:`gathers_per_step`, less (stage 3) one gather per
    micro batch of the ``gathered_once_numel`` elements kept gathered from forward into backward
    (``planner.workload.gathered_once_numel``: the unit held into backward, [Note: held into
    backward] in ``zero/stage3/schedule.py``, and a tied embedding stored in the root unit).
    Stage 0 ignores the topology knobs (Lightning's DDP all-reduces over all dp ranks)."""
    out: dict[str, dict[str, float]] = {link: {} for link in LINK_CLASSES}
    plan = [
        (
            topology.grad_hops(stage=stage, grad_bytes=grad_bytes, grad_comm_dtype=grad_comm_dtype),
            grad_syncs_per_step(stage, micro_batches, defer_grad_reduce),
        ),
    ]
    if stage > 0:
        plan.append(
            (
                topology.gather_hops(param_bytes=param_bytes, param_comm_dtype=param_comm_dtype),
                gathers_per_step(stage, micro_batches),
            )
        )
    for hops, count in plan:
        for hop in hops:
            kinds = out[hop.link]
            kinds[hop.kind] = kinds.get(hop.kind, 0.0) + count * hop.sent_bytes(numel)
    if stage == 3 and gathered_once_numel:
        for hop in topology.gather_hops(param_bytes=param_bytes, param_comm_dtype=param_comm_dtype):
            out[hop.link][hop.kind] -= micro_batches * hop.sent_bytes(gathered_once_numel)
    return LinkBytes(intra_node=out["intra_node"], inter_node=out["inter_node"])
