"""The parallel layout (pp, dp, cp, ep, tp), its validation, and the process groups built from it.

[Note: mesh layout] Global ranks are laid out row-major on a ``(dp, cp, tp)`` grid::

    mesh = arange(world_size).view(dp, cp, tp)

so a TP group is ``tp`` consecutive global ranks (ranks of one node, which talk over NVLink), a CP
group the ``cp`` ranks of one dp index and one tp rank (slices of the same samples), and a DP group
the ranks of one cp index and one tp rank (different samples). With ``cp == 1`` (the default) this
is the ``(dp, tp)`` grid: with ``world_size=8, tp=4``, TP groups ``[0,1,2,3] [4,5,6,7]``; DP groups
``[0,4] [1,5] [2,6] [3,7]``. TP never crosses a node, so ``tp`` must divide ``devices_per_node``.

The *dense* group ``dp_cp`` is every rank of one tp rank (``dp * cp`` of them): ZeRO shards dense
parameters, gradients and optimizer state over it, and dense gradients are averaged over it (cp
ranks saw different tokens of the same samples). With ``cp == 1`` it is the DP group.

Experts ([Note: expert groups]): an EP group is ``ep`` consecutive members of the dp_cp group
(tokens go to their experts' ranks by all-to-all over it; each EP rank holds ``num_experts / ep``
experts); an EDP group (expert data parallel) the ``dp * cp / ep`` members holding the same experts
(stride ``ep`` inside dp_cp): ZeRO shards expert parameters over it. With ``world_size=8, tp=2,
ep=2`` (dp_cp = 4): dp_cp ``[0,2,4,6] [1,3,5,7]``; EP ``[0,2] [4,6] [1,3] [5,7]``; EDP ``[0,4]
[2,6] [1,5] [3,7]``.

[Note: pipeline ranks] Pipeline parallelism is the outermost dimension: ``world_size = pp *
stage_world`` and pp rank ``i`` owns the ``stage_world`` consecutive global ranks ``[i *
stage_world, (i + 1) * stage_world)``, laid out inside as above (every dp, cp, ep, tp and shard
group lives inside one pp rank's block; a hybrid layout's replica, the group a gradient norm sums
over, takes its place in every block: the stages hold the model together). A pp group is the ``pp`` ranks with the same position in
their blocks (stride ``stage_world``), so stages cross nodes and TP stays inside one. With
``world_size=8, pp=2, tp=2``: pp blocks ``[0..3] [4..7]``, TP ``[0,1] [2,3] [4,5] [6,7]``, DP ``[0,2]
[1,3] [4,6] [5,7]``, PP ``[0,4] [1,5] [2,6] [3,7]``.

[Note: gradient averaging over dp_cp] A dense gradient is summed over the dp_cp group; an expert's
gradient is a sum over the tokens routed to it from every dp_cp rank (the all-to-all brings them to
its EP rank, the EDP reduction sums the EP groups), so with each rank's loss averaged over its own
tokens both end up divided by ``dp * cp``, as under ddp. :meth:`ParallelDims.grad_divisor` is that
rule, for the engine and the planner.

[Note: hybrid layout] With ``shard_size`` the dp dimension splits further into
``(replicate, shard)``, so the full layout is ``(replicate, shard, tp)``::

    mesh = arange(world_size).view(replicate, shard, tp)    # dp index = replicate_idx * shard + shard_idx

A shard group is ``shard`` consecutive dp ranks (one row of the ``(replicate, shard)`` grid); ZeRO
shards parameters, gradients and optimizer state over it. A replicate group is the ``replicate``
ranks holding the same chunk (one column); they all-reduce their reduced gradient chunk. With
``world_size=8, devices_per_node=4, tp=1, shard_size="node"`` (``shard=4``): shard groups
``[0,1,2,3] [4,5,6,7]`` (one per node), replicate groups ``[0,4] [1,5] [2,6] [3,7]``.
A shard group either fits inside one node or is a whole number of nodes. When it spans
``nodes_per_shard`` nodes of ``local = devices_per_node // tp`` dp ranks each, hierarchical
reduction splits it once more into ``(nodes_per_shard, local)``: an in-node group (same node) and a
cross-node group (same local position), see ``zero/hybrid.py``.

:class:`ParallelDims` is pure arithmetic: it validates a 64-rank layout in one process without any
process group (the planner uses it). Only the builders (:func:`build_mesh`,
:func:`build_shard_groups`) need ``torch.distributed``, and import it when called, so the planner
(``lightning-zero plan``) reads :class:`ParallelDims` without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("dp", "tp")
GROUP_KINDS = ("pp", "tp", "dp", "cp", "dp_cp", "ep", "edp", "shard", "replicate", "replica", "shard_intra",
               "shard_inter")  # fmt: skip
"""What :meth:`ParallelDims.rank_groups` takes."""


@dataclass
class ParallelDims:
    """How ``world_size`` ranks split into data-, context-, expert- and tensor-parallel groups.

    Args:
        world_size: total number of ranks (processes, one per device).
        devices_per_node: ranks per node; a TP group lives inside one node.
        tp: tensor-parallel size (ranks that split each weight matrix), or ``"auto"`` for
            ``devices_per_node`` (one TP group per node). Resolved to an int here.
        shard_size: dp ranks ZeRO shards over (consecutive dp ranks, see [Note: hybrid layout]);
            ``None`` shards over all ``dp`` ranks, ``"node"`` over the dp ranks of one node
            (``devices_per_node // tp``). Must divide ``dp``; ``replicate = dp // shard``.
        hierarchical_reduce: reduce gradients in two hops when a shard group spans nodes (in-node
            reduce-scatter, then a cross-node one of the node's slice); ignored (``hierarchical``
            is False) when the shard group fits inside one node or a node holds one dp rank.
        cp: context-parallel size: ranks holding contiguous slices of the same sequences.
        ep: expert-parallel size: consecutive members of the dp_cp group that split the experts
            (each holds ``num_experts / ep``); must divide ``dp * cp``.
        pp: pipeline-parallel size, the outermost dimension ([Note: pipeline ranks]): each pp rank
            owns ``stage_world = world_size // pp`` consecutive ranks, where the groups above live.

    ``dp_cp = stage_world // tp`` ranks hold the same TP shard (the dense group: under ZeRO they
    split its optimizer state / gradients / parameters, over groups of ``shard`` of them);
    ``dp = dp_cp // cp`` of them take different samples. See [Note: mesh layout].
    """

    world_size: int
    devices_per_node: int
    tp: Union[int, str] = 1
    shard_size: Optional[Union[int, str]] = None
    hierarchical_reduce: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1

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
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"ParallelDims: pp must be a positive int, got {self.pp!r}")
        if self.world_size % self.pp != 0:
            raise ValueError(
                f"pp({self.pp}) does not divide world_size({self.world_size}): pp * dp * cp * tp must equal"
                f" world_size; pick pp from {_divisors(self.world_size)}"
            )
        if self.stage_world % self.tp != 0:
            raise ValueError(
                f"tp({self.tp}) does not divide world_size({self.world_size}) / pp({self.pp}) = {self.stage_world}:"
                f" pp * dp * tp must equal world_size; pick tp from {_divisors(self.stage_world)}"
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
        self._check_cp_ep()
        self._check_shard_size()

    @classmethod
    def from_config(cls, config: Any, *, world_size: int, devices_per_node: int) -> "ParallelDims":
        """The layout a :class:`~lightning_zero.config.ZeroConfig` asks for on ``world_size`` ranks of
        ``devices_per_node`` each: its ``tensor_parallel_size``, ``shard_size``,
        ``hierarchical_reduce``, ``cp`` and ``ep``. The runtime (``runtime/setup.py``) and the
        planner (``planner/arithmetic.py`` ``plan``) build the layout through this one function."""
        layout = config.layout  # a LayoutPolicy ([Note: policies] in config.py)
        return cls(
            world_size=world_size,
            devices_per_node=devices_per_node,
            tp=layout.tensor_parallel_size,
            pp=layout.pp,
            shard_size=layout.shard_size,
            hierarchical_reduce=layout.hierarchical_reduce,
            cp=layout.cp,
            ep=layout.ep,
        )

    def _check_cp_ep(self) -> None:
        for name in ("cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be a positive int, got {value!r}")
        dp_cp = self.dp_cp
        if dp_cp % self.cp != 0:
            raise ValueError(
                f"cp({self.cp}) does not divide world_size({self.world_size}) / tp({self.tp}) = {dp_cp}: "
                f"dp * cp * tp must equal world_size; pick cp from {_divisors(dp_cp)}"
            )
        if dp_cp % self.ep != 0:
            raise ValueError(
                f"ep({self.ep}) does not divide {self._dense_size()}: expert-parallel groups are ep consecutive"
                f" ranks of the dense (dp*cp) group; pick ep from {_divisors(dp_cp)}"
            )
        if self.ep > 1 and (self.shard_size is not None or self.hierarchical_reduce):
            raise ValueError(
                f"ep({self.ep}) with shard_size({self.shard_size!r}) / hierarchical_reduce({self.hierarchical_reduce}):"
                " hybrid sharding of expert parameters over the expert-data-parallel group is not supported yet;"
                " use shard_size=None and hierarchical_reduce=False with ep > 1, or ep=1"
            )

    def _dense_size(self) -> str:
        """``dp_cp`` spelled out with where it comes from, for error messages."""
        world = f"world_size({self.world_size})" + (f" / pp({self.pp})" if self.pp > 1 else "")
        if self.cp == 1:
            return f"dp({self.dp_cp}) = {world} / tp({self.tp})"
        return f"dp*cp({self.dp_cp}) = {world} / tp({self.tp}), cp({self.cp})"

    def _check_shard_size(self) -> None:
        shard, dp, local = self.shard_size, self.dp_cp, self.dp_per_node
        where = f"{self._dense_size()}, {local} dp rank(s) per node"
        if shard is None:
            return
        if shard == "node":
            return  # dp_per_node divides dp: whole nodes were checked above
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
            raise ValueError(f"ParallelDims: shard_size must be None, 'node' or a positive int, got {shard!r}")
        if dp % shard != 0:
            raise ValueError(
                f"shard_size({shard}) does not divide {where}: shard groups of consecutive dp ranks must tile"
                f" dp; pick shard_size from {_divisors(dp)}"
            )
        if local % shard != 0 and shard % local != 0:
            fits = [d for d in _divisors(dp) if local % d == 0 or d % local == 0]
            raise ValueError(
                f"shard_size({shard}) with {where}: a shard group must fit inside one node (divide {local}) or"
                f" be whole nodes (a multiple of {local}); pick shard_size from {fits}"
            )

    @property
    def dp_per_node(self) -> int:
        """dp_cp ranks inside one node (``devices_per_node // tp``, at most ``dp_cp``)."""
        return min(self.devices_per_node // self.tp, self.dp_cp)  # type: ignore[operator]

    @property
    def shard(self) -> int:
        """dp_cp ranks one ZeRO shard group holds (``shard_size`` resolved; ``dp_cp`` when ``None``)."""
        if self.shard_size is None:
            return self.dp_cp
        if self.shard_size == "node":
            return self.dp_per_node
        return self.shard_size  # type: ignore[return-value]

    @property
    def replicate(self) -> int:
        """Shard groups, i.e. ranks holding the same chunk (``dp_cp // shard``)."""
        return self.dp_cp // self.shard

    @property
    def shard_spans_nodes(self) -> bool:
        """Whether one shard group holds dp ranks of more than one node."""
        return self.shard > self.dp_per_node

    @property
    def hierarchical(self) -> bool:
        """Two-hop gradient reduction in effect: asked for, the shard group spans nodes, and a node
        holds more than one of its ranks (else the in-node hop would be a no-op)."""
        return bool(self.hierarchical_reduce) and self.shard_spans_nodes and self.dp_per_node > 1

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """``(replicate, shard, tp)``: see [Note: hybrid layout]."""
        return (self.replicate, self.shard, self.tp)  # type: ignore[return-value]

    def shard_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s ZeRO shard group, in shard-rank order."""
        first = (rank // (self.shard * self.tp)) * self.shard * self.tp + rank % self.tp  # type: ignore[operator]
        return [first + i * self.tp for i in range(self.shard)]  # type: ignore[operator]

    def replicate_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same chunk as ``rank`` (one per shard group)."""
        stride, start = self.shard * self.tp, self._block_start(rank)  # type: ignore[operator]
        return list(range(start + rank % stride, start + self.stage_world, stride))

    def replica_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s replica (its shard group times tp, in every pp block at the same
        place): together they hold every gradient element once, so a global gradient norm sums over
        them (under pp each block holds other stages: [Note: pipeline ranks])."""
        size = self.shard * self.tp  # type: ignore[operator]
        start = (rank % self.stage_world) // size * size
        return [block + start + i for block in range(0, self.world_size, self.stage_world) for i in range(size)]

    def shard_intra_ranks(self, rank: int) -> list[int]:
        """Hierarchical reduction: the ranks of ``rank``'s shard group on its own node."""
        shard = self.shard_ranks(rank)
        position = shard.index(rank) // self.dp_per_node
        return shard[position * self.dp_per_node : (position + 1) * self.dp_per_node]

    def shard_inter_ranks(self, rank: int) -> list[int]:
        """Hierarchical reduction: the ranks of ``rank``'s shard group with its local position, one
        per node."""
        shard = self.shard_ranks(rank)
        return shard[shard.index(rank) % self.dp_per_node :: self.dp_per_node]

    def rank_groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (one of :data:`GROUP_KINDS`), each once, as lists of global ranks."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"ParallelDims.rank_groups({kind!r}): kind must be one of {GROUP_KINDS}")
        of = getattr(self, f"{kind}_ranks")
        groups: list[list[int]] = []
        for rank in range(self.world_size):
            ranks = of(rank)
            if ranks not in groups:
                groups.append(ranks)
        return groups

    @property
    def stage_world(self) -> int:
        """Ranks of one pp rank (``world_size // pp``; [Note: pipeline ranks])."""
        return self.world_size // self.pp

    def _block_start(self, rank: int) -> int:
        """The first global rank of ``rank``'s pp block."""
        return (rank // self.stage_world) * self.stage_world

    def pp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s pipeline group: one per pp rank, same place in each block."""
        return list(range(rank % self.stage_world, self.world_size, self.stage_world))

    @property
    def dp_cp(self) -> int:
        """The dense group's size (``dp * cp``): ranks of one pp rank that hold the same TP shard;
        ZeRO shards dense parameters over them and averages dense gradients over them."""
        return self.stage_world // self.tp  # type: ignore[operator]

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that take different samples (``world_size // (tp * cp)``)."""
        return self.dp_cp // self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size (``dp * cp // ep``): ranks holding the same experts; ZeRO shards
        expert parameters over them."""
        return self.dp_cp // self.ep

    def grad_divisor(self, expert: bool = False) -> int:
        """[Note: gradient averaging over dp_cp]: what a summed gradient is divided by, dense
        (``expert=False``: summed over dp_cp) or expert (summed over edp after the ep all-to-alls
        brought every dp_cp rank's tokens to it): ``dp * cp`` for both, as under ddp."""
        return self.dp_cp

    def dp_cp_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s dense group: every rank of its tp rank, in dp_cp-rank order."""
        start = self._block_start(rank) + rank % self.tp  # type: ignore[operator]
        return list(range(start, self._block_start(rank) + self.stage_world, self.tp))  # type: ignore[arg-type]

    def cp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding slices of the same samples as ``rank`` (same dp index, same tp rank)."""
        dense = self.dp_cp_ranks(rank)
        start = (dense.index(rank) // self.cp) * self.cp
        return dense[start : start + self.cp]

    def ep_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s expert-parallel group (``ep`` consecutive dp_cp members)."""
        dense = self.dp_cp_ranks(rank)
        start = (dense.index(rank) // self.ep) * self.ep
        return dense[start : start + self.ep]

    def edp_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same experts as ``rank`` (stride ``ep`` inside dp_cp)."""
        dense = self.dp_cp_ranks(rank)
        return dense[dense.index(rank) % self.ep :: self.ep]

    def group_rank(self, kind: str, rank: int) -> int:
        """``rank``'s index inside its group of ``kind``."""
        return getattr(self, f"{kind}_ranks")(rank).index(rank)

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
        """Global ranks in ``rank``'s DP group: same cp index and tp rank, different samples (see
        [Note: mesh layout]; with ``cp == 1`` the dense group)."""
        dense = self.dp_cp_ranks(rank)
        return dense[dense.index(rank) % self.cp :: self.cp]

    def __str__(self) -> str:
        return (
            f"ParallelDims(world_size={self.world_size}, devices_per_node={self.devices_per_node}, "
            f"dp={self.dp}, tp={self.tp}"
            + (f", pp={self.pp}" if self.pp > 1 else "")
            + (f", cp={self.cp}" if self.cp > 1 else "")
            + (f", ep={self.ep}" if self.ep > 1 else "")
            + (f", replicate={self.replicate}, shard={self.shard}" if self.shard_size is not None else "")
            + ")"
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
    """Build the ``DeviceMesh`` the model's parallelize functions read (see [Note: mesh layout]):
    ``("dp", "tp")`` (``"dp"`` is the dense group) when ``cp == 1``, ``("dp", "cp", "tp")`` otherwise,
    ``("pp", "dp", "tp")`` or ``("pp", "dp", "cp", "tp")`` under ``pp > 1`` (every dp, cp and tp group
    inside one pp rank's block).

    Needs an initialized default process group of ``dims.world_size`` ranks; creates one
    sub-group per row and column of each dimension.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"{dims} but the process group has world_size({world})")
    if dims.pp > 1:  # cp and tp inside each pp rank's block ([Note: pipeline ranks])
        if dims.cp == 1:
            layout = torch.arange(dims.world_size, dtype=torch.int).view(dims.pp, dims.dp, dims.tp)  # (pp, dp, tp)
            return DeviceMesh(device_type, layout, mesh_dim_names=("pp", *MESH_DIM_NAMES))
        layout = torch.arange(dims.world_size, dtype=torch.int).view(dims.pp, dims.dp, dims.cp, dims.tp)
        return DeviceMesh(device_type, layout, mesh_dim_names=("pp", "dp", "cp", "tp"))
    if dims.cp == 1:
        layout = torch.arange(dims.world_size, dtype=torch.int).view(dims.dp, dims.tp)  # (dp, tp)
        return DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIM_NAMES)
    layout = torch.arange(dims.world_size, dtype=torch.int).view(dims.dp, dims.cp, dims.tp)  # (dp, cp, tp)
    return DeviceMesh(device_type, layout, mesh_dim_names=("dp", "cp", "tp"))


@dataclass
class ShardGroups:
    """The process groups of the hybrid layout for this rank (see [Note: hybrid layout]).

    ``shard``: ZeRO shards over it (``shard`` ranks). ``replicate``: ranks holding the same chunk
    (they all-reduce the reduced gradient chunk). ``replica``: shard x tp ranks (a gradient norm
    sums over them). ``dp``: the dense group, every dp_cp rank of this tp position (agreements
    such as the bucket order span all replicas). ``shard_intra`` / ``shard_inter``: hierarchical reduction's in-node
    and cross-node groups inside the shard group (``None`` unless ``dims.hierarchical``).
    """

    dims: ParallelDims
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup
    replica: dist.ProcessGroup
    dp: dist.ProcessGroup
    shard_intra: Optional[dist.ProcessGroup] = None
    shard_inter: Optional[dist.ProcessGroup] = None

    def all(self) -> list[dist.ProcessGroup]:
        """Every group built here, each once (to destroy them)."""
        groups = [self.shard, self.replicate, self.replica, self.dp, self.shard_intra, self.shard_inter]
        return [group for group in groups if group is not None]


def build_shard_groups(dims: ParallelDims) -> ShardGroups:
    """Create the groups of :class:`ShardGroups` (a collective: every rank calls it, once).

    Needs an initialized default process group of ``dims.world_size`` ranks.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_shard_groups needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"{dims} but the process group has world_size({world})")

    def mine(kind: str) -> dist.ProcessGroup:
        group, _ = dist.new_subgroups_by_enumeration(dims.rank_groups(kind))
        return group

    groups = ShardGroups(dims, mine("shard"), mine("replicate"), mine("replica"), mine("dp_cp"))
    if dims.hierarchical:
        groups.shard_intra, groups.shard_inter = mine("shard_intra"), mine("shard_inter")
    return groups


@dataclass
class MeshGroups:
    """This rank's process groups for ``dims`` (:func:`build_groups`: built once per run, passed
    whole to the engine, the model's parallelize functions and the checkpoints).

    ``None`` for a group means: ``dp_cp``, the default group (``tp == pp == 1``: every rank); ``tp``,
    ``cp``, ``ep``, ``pp``, no such group (size 1). ``edp`` is the ``dp_cp`` object itself when ``ep == 1``.
    ``device_mesh`` is :func:`build_mesh`'s, when ``tp > 1`` or ``cp > 1`` (else ``None``);
    ``shard`` the hybrid layout's groups (:func:`build_shard_groups`) when ZeRO shards over less
    than the dense group or reduces hierarchically (else ``None``). Sizes and this rank's
    coordinates come from the arithmetic: ``dims.dp_cp``, ``groups.rank_in("ep")``, ...
    """

    dims: ParallelDims
    rank: int
    device_mesh: Optional[DeviceMesh] = None
    tp: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    edp: Optional[dist.ProcessGroup] = None
    shard: Optional[ShardGroups] = None
    pp: Optional[dist.ProcessGroup] = None  # the pipeline group ([Note: pipeline ranks])

    def rank_in(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (``"dp"``, ``"cp"``, ``"ep"``, ``"edp"``, ...)."""
        return self.dims.group_rank(kind, self.rank)

    def size(self, kind: str) -> int:
        """Ranks in a group of ``kind``."""
        return len(self.dims.rank_groups(kind)[0])

    def all(self) -> list[dist.ProcessGroup]:
        """Every group built here, each once (the collective timeout is set on each)."""
        groups: list[dist.ProcessGroup] = []
        if self.device_mesh is not None:
            groups += [self.device_mesh.get_group(name) for name in self.device_mesh.mesh_dim_names or ()]
        groups += [self.tp, self.dp_cp, self.cp, self.ep, self.edp, self.pp]
        if self.shard is not None:
            groups += self.shard.all()
        unique: list[dist.ProcessGroup] = []
        for group in groups:
            if group is not None and all(group is not seen for seen in unique):
                unique.append(group)
        return unique


def build_groups(dims: ParallelDims, device_type: str = "cpu") -> MeshGroups:
    """Create :class:`MeshGroups` for this rank (a collective: every rank calls it, once, with the
    same ``dims``). With ``cp == ep == 1`` it creates what the ``(dp, tp)`` layout always did: the
    mesh when ``tp > 1``, the shard groups under hybrid sharding or hierarchical reduction."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"{dims} but the process group has world_size({world})")
    rank = dist.get_rank()

    def mine(kind: str) -> dist.ProcessGroup:
        group, _ = dist.new_subgroups_by_enumeration(dims.rank_groups(kind))
        return group

    groups = MeshGroups(dims, rank)
    if dims.pp > 1:  # the dense group is one pp block's, not every rank ([Note: pipeline ranks])
        groups.pp, groups.dp_cp = mine("pp"), mine("dp_cp")
    if dims.tp > 1 or dims.cp > 1:  # type: ignore[operator]
        mesh = groups.device_mesh = build_mesh(dims, device_type)
        groups.tp = mesh.get_group("tp") if dims.tp > 1 else None  # type: ignore[operator]
        groups.cp = mesh.get_group("cp") if dims.cp > 1 else None
        if dims.tp > 1 and (dims.cp == 1 or groups.dp_cp is None):  # type: ignore[operator]
            groups.dp_cp = mesh.get_group("dp") if dims.cp == 1 else mine("dp_cp")
    if dims.ep > 1:
        groups.ep, groups.edp = mine("ep"), mine("edp")
    else:
        groups.edp = groups.dp_cp
    if dims.replicate > 1 or dims.hierarchical:
        groups.shard = build_shard_groups(dims)
    return groups


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
