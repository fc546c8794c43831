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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
) -> ModelStateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO ``stage``.

    ``stage=0`` is plain data parallelism. ``num_params`` is the count one data-parallel replica
    holds (with tensor parallelism: the parameters of one tp rank). Returns a
    :class:`ModelStateBytes` with ``params``, ``grads``, ``optimizer`` and ``total``; it also
    supports ``result["total"]``.

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
    params = param_bytes * num_params / (dp if stage >= 3 else 1)
    grads = grad_bytes * num_params / (dp if stage >= 2 else 1)
    optimizer = optim_bytes_per_param * num_params / (dp if stage >= 1 else 1)
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)
