"""What a ring collective sends from one rank, in one place (plain numbers: no torch, no planner).

[Note: ring bytes] For a group of ``n`` ranks and a *payload* of ``N`` elements or bytes (the full,
unsharded tensor: an all-gather's output, a reduce-scatter's or all-to-all's input), one rank
sends ``(n-1)/n * N`` in a reduce-scatter, all-gather, all-to-all or broadcast, and twice that,
``2 (n-1)/n * N``, in an all-reduce (a reduce-scatter followed by an all-gather). The
latency-bound ring steps are ``n - 1`` (twice for all-reduce). ``CommCounter``
(``collectives.py``, [Note: logical bytes]) counts these, the planner predicts them
(``planner/hardware.py``, ``planner/traffic.py``), the calibration fits time against them
(``planner/calibrate.py``) and the benchmark harness counts the tapped ``torch.distributed``
calls with them (``benchmarks/_probes.py``).
"""

from __future__ import annotations

RING_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def _rings(kind: str) -> int:
    if kind not in RING_KINDS:
        raise ValueError(f"collective kind must be one of {RING_KINDS}, got {kind!r}")
    return 2 if kind == "all_reduce" else 1


def ring_sent(kind: str, payload: float, ranks: int) -> float:
    """Elements (or bytes) one rank sends for a ``payload`` over ``ranks`` ([Note: ring bytes]):
    ``rings x payload x (n-1) / n``, evaluated in that order (exact for integer payloads)."""
    return _rings(kind) * payload * (ranks - 1) / ranks


def ring_steps(kind: str, ranks: int) -> int:
    """Latency-bound steps of a ring collective over ``ranks``: ``n - 1``; all-reduce twice that."""
    return _rings(kind) * (ranks - 1)
