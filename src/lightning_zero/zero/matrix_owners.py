"""Which rank owns each matrix of a matrix optimizer (Muon): plain Python, shared with the planner.

[Note: matrix owners] Muon orthogonalizes each weight matrix's whole momentum (Newton-Schulz), so
under ZeRO, whose element-range shards cut matrices anywhere, one rank of the group the matrix is
sharded over (dp, or the EDP group for experts) *owns* it: it assembles the matrix, runs the
update and sends each rank its slice back (``zero/matrix_optimizer.py``). The owners are chosen
here so that the Newton-Schulz work is balanced: longest-processing-time first (matrices by
decreasing FLOPs, each to the rank with the least work so far, ties to the lower rank), which is
within 4/3 of the best possible maximum and, for the many equal matrices of a transformer, exact.
The engine and the planner both call :func:`assign_owners`, so the planner's owner FLOPs are the
engine's by construction. No torch here: ``lightning-zero plan`` imports this module.
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_NS_STEPS = 5  # torch.optim.Muon's default ns_steps


def ns_flops(rows: int, cols: int, steps: int = DEFAULT_NS_STEPS) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a ``rows x cols`` matrix (as
    ``torch.optim.Muon`` runs them: on the wide orientation, ``m = min, n = max``): per step the
    Gram matrix ``X X^T`` (``2 m^2 n``), ``b G + c G G`` (``2 m^3``) and ``a X + B X``
    (``2 m^2 n``)."""
    if rows < 1 or cols < 1 or steps < 0:
        raise ValueError(f"ns_flops(rows={rows}, cols={cols}, steps={steps}): need rows, cols >= 1, steps >= 0")
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m * m * m)


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The owner rank (``0 .. ranks - 1``) of each matrix, given each matrix's cost: the most
    expensive first, each to the least-loaded rank (ties: the lower rank; equal costs keep their
    order), so every rank computes the same answer from the same list ([Note: matrix owners])."""
    if ranks < 1:
        raise ValueError(f"assign_owners(ranks={ranks}): need at least one rank")
    owners = [0] * len(costs)
    loads = [0.0] * ranks
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def owner_loads(costs: Sequence[float], owners: Sequence[int], ranks: int) -> list[float]:
    """The summed cost on each rank for an assignment (``assign_owners``'s result)."""
    loads = [0.0] * ranks
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads
