"""Context parallelism's arithmetic: which heads and tokens each cp rank holds (plain Python).

The engine (``cp/ulysses.py``, ``cp/parallelize.py``), the layout check before launch
(``runtime/setup.py``), the data module and the planner read these functions; none of them
imports torch, so ``lightning-zero plan`` can call them.

[Note: context-parallel layout] A cp group of ``cp`` ranks holds the same samples (same dp index,
same tp rank). Rank ``c`` holds tokens ``[c T/cp, (c+1) T/cp)`` of every sequence of length ``T``
(a contiguous slice) and their labels ``[c T/cp + 1, (c+1) T/cp + 1)``: a slice's last label is
the next slice's first token, so a stored window of ``T + 1`` tokens gives rank ``c`` its
``T/cp + 1`` tokens ``[c T/cp, (c+1) T/cp + 1)`` (:func:`context_slice_bounds`). Everything
outside attention is position-wise and runs on the slice. Attention (Ulysses,
[Note: Ulysses attention] in ``cp/ulysses.py``) swaps the sequence split for a head split: each
TP rank's ``n_heads / tp`` query heads split again over cp, so ``tp * cp`` must divide
``n_heads``. Key/value heads split the same way; where a TP rank's ``n_kv_heads / tp`` is not a
multiple of cp, each kv head is repeated :func:`kv_head_repeats` times first (as ALST does), the
smallest number that makes the repeated heads split evenly while every query head still meets
its own kv head.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, Optional

CP_RING_LABEL = "cp_ring_kv"  # the CommCounter label of ring attention's key/value hops (engine and planner)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_head_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many times each of a TP rank's ``kv_heads`` key/value heads is repeated before the
    Ulysses exchange so that the ``kv_heads * repeats`` heads split evenly over ``cp`` ranks
    (1: no repeat). Query head ``h`` of ``q_heads`` reads kv head ``h // (q_heads / kv_heads)``;
    ``repeats`` divides that group size whenever ``cp`` divides ``q_heads`` (see
    [Note: context-parallel layout])."""
    repeats = cp // gcd(kv_heads, cp)
    if q_heads % cp != 0 or q_heads % kv_heads != 0 or (q_heads // kv_heads) % repeats != 0:
        raise ValueError(
            f"context parallelism: {q_heads} query heads and {kv_heads} key/value heads per tensor-parallel "
            f"rank cannot split over cp({cp}); pick cp from the divisors of {q_heads} {_divisors(q_heads)}"
        )
    return repeats


@dataclass(frozen=True)
class UlyssesLayout:
    """The heads each rank of a ``(tp, cp)`` layout computes attention for."""

    cp: int
    tp: int
    n_heads: int
    n_kv_heads: int

    @property
    def q_heads_per_tp_rank(self) -> int:
        return self.n_heads // self.tp

    @property
    def kv_heads_per_tp_rank(self) -> int:
        return self.n_kv_heads // self.tp

    @property
    def kv_repeats(self) -> int:
        """Each TP rank's kv heads are repeated this many times before the exchange (1: none)."""
        return kv_head_repeats(self.q_heads_per_tp_rank, self.kv_heads_per_tp_rank, self.cp)

    @property
    def q_heads_per_rank(self) -> int:
        """Query heads one rank attends with over the whole sequence."""
        return self.q_heads_per_tp_rank // self.cp

    @property
    def kv_heads_exchanged(self) -> int:
        """Key (and value) heads one TP rank sends through the exchange, repeats included."""
        return self.kv_heads_per_tp_rank * self.kv_repeats

    def describe(self) -> str:
        """One line for the log before launch: the split, and the kv repeat if there is one."""
        line = (
            f"context parallelism (Ulysses): cp({self.cp}) x tp({self.tp}); each rank attends with "
            f"{self.q_heads_per_rank} of {self.n_heads} query heads over the whole sequence"
        )
        if self.kv_repeats > 1:
            line += (
                f"; n_kv_heads({self.n_kv_heads}) / tp({self.tp}) = {self.kv_heads_per_tp_rank} key/value head(s) per"
                f" TP rank is not a multiple of cp({self.cp}): each is repeated {self.kv_repeats}x before the"
                f" all-to-all (ALST's replication; {self.kv_repeats}x the key/value bytes exchanged)"
            )
        return line


def ulysses_layout(cp: int, tp: int, model_config: Any) -> UlyssesLayout:
    """The layout of ``model_config`` (``n_heads``, ``n_kv_heads``: ``None`` = ``n_heads``) over
    ``tp * cp`` ranks, or a ``ValueError`` naming the numbers and the fix."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context parallelism: cp must be a positive int, got {cp!r}")
    n_heads = model_config.n_heads
    n_kv_heads = getattr(model_config, "n_kv_heads", None) or n_heads
    if n_heads % (tp * cp) != 0:
        fits = [d for d in _divisors(n_heads) if (n_heads // tp) % d == 0] if n_heads % tp == 0 else []
        raise ValueError(
            f"context parallelism: tp({tp}) x cp({cp}) = {tp * cp} does not divide n_heads({n_heads}): Ulysses "
            f"attention splits each TP rank's query heads over the cp ranks; pick cp from {fits} "
            "(strategy.cp) or a model whose n_heads is a multiple of tp x cp"
        )
    if n_kv_heads % tp != 0:
        raise ValueError(
            f"context parallelism: tp({tp}) does not divide n_kv_heads({n_kv_heads}); pick tp from "
            f"{_divisors(n_kv_heads)}"
        )
    # raises if the kv heads cannot follow (they always can once tp * cp divides n_heads)
    kv_head_repeats(n_heads // tp, n_kv_heads // tp, cp)
    return UlyssesLayout(cp=cp, tp=tp, n_heads=n_heads, n_kv_heads=n_kv_heads)


@dataclass(frozen=True)
class RingLayout:
    """A ``(tp, cp)`` layout whose query heads do not split over ``tp * cp``: every rank attends
    with all of its TP rank's heads, key/value blocks pass around the cp ring ([Note: ring
    attention] in ``cp/ring_attention.py``)."""

    cp: int
    tp: int
    n_heads: int
    n_kv_heads: int
    kv_repeats: int = 1  # nothing is repeated for an exchange

    def describe(self) -> str:
        return (
            f"context parallelism (ring attention): tp({self.tp}) x cp({self.cp}) = {self.tp * self.cp} does not"
            f" divide n_heads({self.n_heads}), so Ulysses cannot split the heads; each rank attends with its TP"
            f" rank's {self.n_heads // self.tp} query heads while key/value blocks pass around the cp ring (not"
            f" load-balanced under the causal mask: the last cp rank attends to all {self.cp} blocks)"
        )

    def kv_block_numel(self, tokens: int, head_dim: int) -> int:
        """Elements of the key/value block one rank passes on per hop: k and v of its ``tokens / cp``
        (``tokens`` = ``B T``) for its TP rank's kv heads, not repeated."""
        return 2 * (tokens // self.cp) * (self.n_kv_heads // self.tp) * head_dim

    def kv_hops(self, recompute: bool = False) -> int:
        """Blocks one rank sends per attention layer and micro batch ([Note: ring attention]):
        forward ``cp - 1`` hops, backward ``cp - 1`` of the block and ``cp`` of its gradient, and
        under full recompute the forward's ``cp - 1`` again."""
        return (self.cp - 1) * (3 if recompute else 2) + self.cp


def ring_layout(cp: int, tp: int, model_config: Any) -> RingLayout:
    """The ring layout of ``model_config`` over ``tp * cp`` ranks: tp must divide the query and the
    key/value heads (each rank keeps its TP rank's heads whole); else a ``ValueError``."""
    n_heads = model_config.n_heads
    n_kv_heads = getattr(model_config, "n_kv_heads", None) or n_heads
    if n_heads % tp != 0 or n_kv_heads % tp != 0:
        raise ValueError(
            f"context parallelism (ring attention): tp({tp}) must divide n_heads({n_heads}) and"
            f" n_kv_heads({n_kv_heads}); pick tp from {[d for d in _divisors(n_kv_heads) if n_heads % d == 0]}"
        )
    return RingLayout(cp=cp, tp=tp, n_heads=n_heads, n_kv_heads=n_kv_heads)


def attention_layout(cp: int, tp: int, model_config: Any, attention: str = "auto") -> Any:
    """How a model's attention runs over ``tp * cp`` ranks: ``"ulysses"`` (:func:`ulysses_layout`:
    heads split by tp then cp, kv heads repeated where they do not split), ``"ring"``
    (:func:`ring_layout`), or ``"auto"``: Ulysses where ``tp * cp`` divides the query heads, the
    ring where it does not. Raises ``ValueError`` naming the fix."""
    if attention not in ("auto", "ulysses", "ring"):
        raise ValueError(f"context parallelism: attention must be 'auto', 'ulysses' or 'ring', got {attention!r}")
    if attention == "ring" or (attention == "auto" and cp > 1 and model_config.n_heads % (tp * cp) != 0):
        return ring_layout(cp, tp, model_config)
    return ulysses_layout(cp, tp, model_config)


def layout_notice(layout: Optional[Any]) -> Optional[str]:
    """The line to state before launch when a layout costs more than a plain split (kv heads
    repeated for Ulysses, or ring attention), else ``None``."""
    if layout is None or layout.cp == 1:
        return None
    return layout.describe() if layout.kv_repeats > 1 or isinstance(layout, RingLayout) else None


def context_shard_len(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """``T / cp``, the tokens of each sequence one cp rank holds, or a ``ValueError`` naming the
    numbers and the fix; with sequence parallelism the slice must split over tp too."""
    if seq_len % cp != 0:
        raise ValueError(
            f"context parallelism: cp({cp}) does not divide the sequence length ({seq_len}); each cp rank "
            f"holds a contiguous T/cp slice: use a sequence length that is a multiple of {cp} (data seq_len)"
        )
    shard = seq_len // cp
    if sequence_parallel and shard % tp != 0:
        raise ValueError(
            f"context parallelism with sequence_parallel: the cp slice of {shard} tokens (seq_len {seq_len} / "
            f"cp({cp})) does not split over tp({tp}); use a sequence length that is a multiple of "
            f"{cp * tp} (data seq_len) or sequence_parallel=False"
        )
    return shard


def context_slice_bounds(seq_len: int, cp: int, cp_rank: int) -> tuple[int, int]:
    """``(start, stop)`` of cp rank ``cp_rank``'s tokens within a stored window of ``seq_len + 1``
    tokens: its ``T/cp`` inputs and, one further, its ``T/cp`` labels (the last one is the next
    slice's first token; see [Note: context-parallel layout])."""
    shard = context_shard_len(seq_len, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context parallelism: cp_rank must be in [0, {cp}), got {cp_rank}")
    return cp_rank * shard, (cp_rank + 1) * shard + 1


def check_context_parallel(
    cp: int,
    *,
    tp: int = 1,
    model_config: Optional[Any] = None,
    seq_len: Optional[int] = None,
    sequence_parallel: bool = False,
) -> Optional[Any]:
    """Every context-parallel check before launch, the engine's doors' and the planner's: the
    attention layout (:func:`attention_layout` ``"auto"``: Ulysses where ``tp * cp`` divides the
    query heads, ring attention where it does not), the sequence length against ``cp`` (and
    ``tp`` under sequence parallelism). Returns the layout (``None`` without a model config);
    raises ``ValueError`` naming the fix."""
    layout = attention_layout(cp, tp, model_config) if model_config is not None else None
    if seq_len is not None:
        context_shard_len(seq_len, cp, tp, sequence_parallel)
    return layout
