"""The (dp, tp) parallel sizes, their validation, and the 2-D ``DeviceMesh`` built from them.

[Note: mesh layout] Global ranks are laid out row-major on a ``(dp, tp)`` grid::

    mesh = arange(world_size).view(dp, tp)

so a TP group is one row (``tp`` consecutive global ranks, i.e. ranks of one node, which talk over
NVLink) and a DP group is one column (the same local position on every node). With
``world_size=8, tp=4``: TP groups ``[0,1,2,3] [4,5,6,7]``; DP groups ``[0,4] [1,5] [2,6] [3,7]``.
TP never crosses a node, so ``tp`` must divide ``devices_per_node``. ZeRO shards over ``dp`` only.

:class:`ParallelDims` is pure arithmetic: it validates a 64-rank layout in one process without any
process group (the planner uses it). Only :func:`build_mesh` needs ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("dp", "tp")


@dataclass
class ParallelDims:
    """How ``world_size`` ranks split into data-parallel and tensor-parallel groups.

    Args:
        world_size: total number of ranks (processes, one per device).
        devices_per_node: ranks per node; a TP group lives inside one node.
        tp: tensor-parallel size (ranks that split each weight matrix), or ``"auto"`` for
            ``devices_per_node`` (one TP group per node). Resolved to an int here.

    ``dp = world_size // tp`` ranks hold the same TP shard and split the batch (and, under ZeRO,
    the optimizer state / gradients / parameters of that shard).
    """

    world_size: int
    devices_per_node: int
    tp: Union[int, str] = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be a positive int, got {value!r}")
        if self.tp == "auto":
            self.tp = self.devices_per_node
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(
                f"ParallelDims: tp (tensor_parallel_size) must be a positive int or 'auto', got {self.tp!r}"
            )
        if self.devices_per_node % self.tp != 0:
            raise ValueError(
                f"tp({self.tp}) does not divide devices_per_node({self.devices_per_node}): tensor "
                f"parallelism stays inside one node; pick tp from the divisors of "
                f"{self.devices_per_node} {_divisors(self.devices_per_node)}"
            )
        if self.world_size % self.tp != 0:
            raise ValueError(
                f"tp({self.tp}) does not divide world_size({self.world_size}): "
                f"dp * tp must equal world_size; pick tp from {_divisors(self.world_size)}"
            )
        if self.world_size % self.devices_per_node != 0 and self.world_size > self.devices_per_node:
            raise ValueError(
                f"world_size({self.world_size}) is not a whole number of nodes of "
                f"devices_per_node({self.devices_per_node})"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that hold the same TP shard."""
        return self.world_size // self.tp  # type: ignore[operator]

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1  # type: ignore[operator]

    def validate(self, model_config: Optional[Any] = None) -> "ParallelDims":
        """Check that ``tp`` splits the model evenly; returns ``self``.

        ``model_config`` is any object with ``n_heads``, ``n_kv_heads`` (``None`` means
        ``n_heads``), ``vocab_size`` and optionally ``ffn_dim`` (a ``LlamaConfig``).
        Raises ``ValueError`` naming every size that ``tp`` does not divide.
        """
        if model_config is not None:
            check_model_divisible(self.tp, model_config)  # type: ignore[arg-type]
        return self

    def tp_ranks(self, rank: int) -> list[int]:
        """Global ranks in ``rank``'s TP group (see [Note: mesh layout])."""
        start = (rank // self.tp) * self.tp  # type: ignore[operator]
        return list(range(start, start + self.tp))  # type: ignore[operator]

    def dp_ranks(self, rank: int) -> list[int]:
        """Global ranks in ``rank``'s DP group (see [Note: mesh layout])."""
        return list(range(rank % self.tp, self.world_size, self.tp))  # type: ignore[operator]

    def __str__(self) -> str:
        return (
            f"ParallelDims(world_size={self.world_size}, devices_per_node={self.devices_per_node}, "
            f"dp={self.dp}, tp={self.tp})"
        )


def check_model_divisible(tp: int, model_config: Any) -> None:
    """Raise ``ValueError`` if ``tp`` does not divide the heads, KV heads, vocab or FFN width."""
    n_heads = model_config.n_heads
    n_kv_heads = getattr(model_config, "n_kv_heads", None) or n_heads
    sizes = {
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": model_config.vocab_size,
    }
    ffn_dim = getattr(model_config, "ffn_dim", None)
    if ffn_dim is not None:
        sizes["ffn_dim"] = ffn_dim
    bad = [f"{name}({value})" for name, value in sizes.items() if value % tp != 0]
    if bad:
        common = _divisors(_gcd_all(list(sizes.values())))
        raise ValueError(
            f"tp({tp}) does not divide {', '.join(bad)}: tensor parallelism splits attention heads, "
            f"KV heads, the vocabulary and the FFN width evenly across ranks; tp sizes that divide "
            f"all of {', '.join(f'{k}({v})' for k, v in sizes.items())} are {common}"
        )


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """Build the 2-D ``DeviceMesh`` with dims ``("dp", "tp")`` (see [Note: mesh layout]).

    Needs an initialized default process group of ``dims.world_size`` ranks; creates one
    sub-group per row (tp) and per column (dp).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"{dims} but the process group has world_size({world})")
    layout = torch.arange(dims.world_size, dtype=torch.int).view(dims.dp, dims.tp)  # (dp, tp)
    return DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIM_NAMES)


def tp_group_and_rank(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, int]:
    """The TP process group of this rank and its rank inside it (the index of its weight slice)."""
    return mesh.get_group("tp"), mesh.get_local_rank("tp")


def dp_group_and_rank(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, int]:
    """The DP process group of this rank (ZeRO shards over it) and its rank inside it."""
    return mesh.get_group("dp"), mesh.get_local_rank("dp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gcd_all(values: list[int]) -> int:
    result = 0
    for value in values:
        result = gcd(result, value)
    return result
