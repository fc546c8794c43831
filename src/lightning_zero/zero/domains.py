"""Expert parameters as a ZeRO domain of their own (issue 54: expert parallelism).

[Note: expert domain] Under expert parallelism (``ep > 1``, ``comm/mesh.py`` [Note: expert groups])
each rank of an EP group holds different experts, and the ``dp * cp / ep`` ranks of its EDP group
hold the same ones. The engine therefore keeps two *domains*: dense parameters are stored,
reduce-scattered, sharded (stages 1-3) and all-gathered over the dense (dp*cp, or hybrid shard)
group, as always; expert parameters over the EDP group. A model marks its expert parameters with
``param._lz_expert = True`` (and ``param._ep_shard_dim``: the dimension along which an EP rank's
tensor is one slice of the layer's experts, which checkpoints use to place it in dense
coordinates). Flat groups never mix the domains: the builders cut them per domain, and every
collective over a flat group runs on that group's domain (:func:`shard_group`).

What stays the same for both domains:

- the divisor of a reduced gradient, ``dp * cp`` ([Note: gradient averaging over dp_cp] in
  ``comm/mesh.py``): an expert's gradient sums the tokens every dp_cp rank routed to it (the EP
  all-to-all brought them to its rank, the EDP reduce-scatter sums the EP groups). The reduce
  therefore sums over EDP and divides by ``dp * cp`` (never an in-collective AVG, which would divide
  by the EDP size);
- the launch order of the buckets, agreed over the dense group: every rank has the same buckets
  (an EP rank's experts have the same shapes as another's), so one order serves both domains;
- the phase markers and their used-parameter flags ([Note: parameters nobody used] in
  ``reducer.py``), over the dense group. What "used" means follows what the parameter is under
  ddp: an EP rank's slice of one stacked tensor (``_ep_shard_dim`` set: the dense Parameter holds
  every expert) is used when any rank used any slice, so its flag is the plain one; an expert that
  is a Parameter of its own (no ``_ep_shard_dim``: one EP rank holds it whole) is used when a rank
  holding it used it, so its flag is ``ep`` flags wide and a rank raises only the one at its own
  EP rank: the MAX over the dense group then tells each rank whether *its* expert was used by its
  EDP group, not whether the expert at the same position on another EP rank was;
- clipping: the global norm sums every rank's owned chunks over the whole world, where each
  dense element is owned once per tp rank and each expert element once (EP ranks hold different
  experts, EDP ranks different chunks of them).

With ``ep == 1`` there is no expert domain (``ExpertDomain`` is ``None``): the EDP group is the dense
group, so expert parameters are plain dense parameters and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

EXPERT_ATTR = "_lz_expert"
"""``param._lz_expert = True`` marks an expert parameter ([Note: expert domain])."""
EP_SHARD_DIM_ATTR = "_ep_shard_dim"
"""``param._ep_shard_dim = d``: this EP rank's tensor is rows ``[ep_rank * n, (ep_rank + 1) * n)`` of
dimension ``d`` of the layer's dense tensor (checkpoints place it there). Without it an expert
parameter is one expert's own Parameter, held whole by one EP rank."""


def mark_expert_param(param: torch.Tensor, shard_dim: Optional[int] = None) -> None:
    """Mark ``param`` as an expert parameter ([Note: expert domain]): with ``shard_dim``, an EP rank's
    slice along that dimension of a layer's stacked experts; without, one expert's own Parameter.
    The one place the marks are written (models read them back with :func:`is_expert_param` and
    :func:`ep_shard_dim`)."""
    setattr(param, EXPERT_ATTR, True)
    if shard_dim is not None:
        setattr(param, EP_SHARD_DIM_ATTR, int(shard_dim))


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert parameter ([Note: expert domain])."""
    return bool(getattr(param, EXPERT_ATTR, False))


def ep_shard_dim(param: Optional[torch.Tensor]) -> Optional[int]:
    """The dimension of the dense tensor an EP rank's expert tensor is a slice of (``None``: not an
    expert parameter, or an expert's own Parameter)."""
    if param is None or not is_expert_param(param):
        return None
    dim = getattr(param, EP_SHARD_DIM_ATTR, None)
    return None if dim is None else int(dim)


@dataclass
class ExpertDomain:
    """Where expert parameters are sharded and reduced ([Note: expert domain]).

    ``group``: the EDP group (``size`` ranks holding the same experts; this rank is ``rank`` in
    it), over which expert parameters, gradients and optimizer state are sharded and expert
    gradients reduce-scattered. ``ep_size`` / ``ep_rank``: the EP group's size and this rank's
    position in it (the used flags and checkpoints read them); ``ep_group``: the EP group itself
    (full-file saves gather a layer's experts over it). ``grad_divisor``: what a reduced
    expert gradient is divided by (``dp * cp``: ``ParallelDims.grad_divisor``). ``gather_group``:
    stage 3's all-gathers of expert units run on it (a clone of ``group`` the engine creates, so
    they never interleave with the gradient reduce-scatters; ``None`` until then).
    """

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    ep_size: int
    ep_rank: int
    grad_divisor: int
    gather_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_mesh(cls, groups: Any) -> Optional["ExpertDomain"]:
        """The expert domain of a ``comm/mesh.py`` ``MeshGroups`` (``None`` when ``ep == 1``)."""
        dims = groups.dims
        if dims.ep == 1:
            return None
        return cls(
            groups.edp,
            dims.edp,
            groups.rank_in("edp"),
            dims.ep,
            groups.rank_in("ep"),
            dims.grad_divisor(expert=True),
            ep_group=groups.ep,
        )


def domain_of(flat_group: Any) -> Optional[ExpertDomain]:
    """The expert domain a flat group belongs to, or ``None`` (dense)."""
    return getattr(flat_group, "domain", None)


def shard_group(flat_group: Any, dense_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The process group ``flat_group`` is sharded, reduced and (stages 1-2) gathered over."""
    domain = domain_of(flat_group)
    return dense_group if domain is None else domain.group


def gather_group(flat_group: Any, dense_gather_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """Stage 3: the process group ``flat_group``'s unit all-gathers run on."""
    domain = domain_of(flat_group)
    return dense_gather_group if domain is None else domain.gather_group


def split_by_domain(params: list, expert: Optional[ExpertDomain]) -> list[tuple[list, Optional[ExpertDomain]]]:
    """``params`` cut into ``(dense, None)`` and ``(experts, expert)`` (only non-empty parts; all
    dense when ``expert`` is ``None``)."""
    if expert is None:
        return [(params, None)] if params else []
    dense = [p for p in params if not is_expert_param(p)]
    experts = [p for p in params if is_expert_param(p)]
    return [(members, domain) for members, domain in ((dense, None), (experts, expert)) if members]
