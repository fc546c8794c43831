"""RunViews: what both doors' strategies read from their one :class:`~lightning_zero.runtime.run.ZeroRun`.

A strategy lists it first among its bases, so its properties (``engine``, ``session``, the groups,
``dp_size``/``dp_rank``, ``distributed_sampler_kwargs``, ``failed``) are the run's, read in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_zero.runtime.checkpoints import CheckpointLifecycle
from lightning_zero.runtime.run import ZeroRun
from lightning_zero.runtime.session import ZeroSession

if TYPE_CHECKING:
    from lightning_zero.comm.collectives import CommCounter
    from lightning_zero.comm.mesh import MeshGroups
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.waits import FailureChannel


class RunViews:
    """What both doors' strategies read from their :class:`ZeroRun` (``self.run``), for a strategy
    class that also has ``world_size`` and ``global_rank`` (Lightning's and Fabric's
    ``DDPStrategy``); listed first among the bases, so ``distributed_sampler_kwargs`` is this one."""

    run: ZeroRun
    world_size: int
    global_rank: int

    @property
    def session(self) -> ZeroSession:
        """Layout, groups, failure channel, engine (``runtime/session.py``)."""
        return self.run.session

    @property
    def checkpoints(self) -> CheckpointLifecycle:
        """Every save from request to publish and link ([Note: checkpoint lifecycle] in runtime/checkpoints.py)."""
        return self.run.checkpoints

    @property
    def engine(self) -> Optional["ZeroEngine"]:
        return self.run.engine

    @property
    def comm_counter(self) -> "CommCounter":
        """Logical bytes sent by the engine (dp) and by tensor-parallel layers (tp), per kind."""
        return self.run.session.comm_counter

    @property
    def failure_channel(self) -> Optional["FailureChannel"]:
        """[Note: failure path] in runtime/failure.py."""
        return self.run.session.failure_channel

    @property
    def wrap_policy(self) -> Optional[Any]:
        return self.run.session.wrap_policy

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self.run.session.dp_group

    @property
    def mesh_groups(self) -> Optional["MeshGroups"]:
        """The layout's process groups (``comm/mesh.py`` :class:`MeshGroups`: tp, cp, dp_cp, ep,
        edp, ...), once the process group is up; what a model's parallelize function reads."""
        return self.run.session.groups

    @property
    def dp_size(self) -> int:
        """Ranks that take different samples (``world_size / (tp * cp)``)."""
        return self.run.session.dp_size(self.world_size)

    @property
    def dp_rank(self) -> int:
        return self.run.session.dp_rank(self.global_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one TP group see the same batch; the data is split over dp only.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @property
    def failed(self) -> bool:
        """This rank failed, or knows another rank did: it issues no collective any more."""
        return self.run.failed
