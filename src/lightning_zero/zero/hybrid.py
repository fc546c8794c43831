"""Gradient reduction for hybrid sharding and hierarchical reduction (topology-aware ZeRO).

The reducer (``reducer.py``) reduce-scatters each bucket over the ZeRO *shard* group. This module
adds the hops the topology needs around that, per bucket, and nothing else:

[Note: hybrid gradient reduction] With ``shard_size < dp`` (``replicate = dp // shard_size``
groups, see [Note: hybrid layout] in ``mesh.py``), a bucket of ``N`` elements is

1. reduce-scattered inside the shard group: shard rank ``r`` gets chunk ``r`` summed over its
   group (``(shard-1)/shard * N`` elements sent per rank);
2. all-reduced across the replicate group, chunk only (``2 (replicate-1)/replicate * N/shard``);
3. divided by the full ``dp = replicate * shard`` once (:attr:`HybridGradReduce.divisor`).

Every replica then holds the same reduced chunk, so the fp32 masters and optimizer states of
the replicas stay identical without any further traffic.

[Note: hierarchical reduction] When a shard group of ``nodes * local`` ranks spans ``nodes``
nodes (``local`` ranks each; shard rank ``r = node * local + l``), ``hierarchical_reduce=True``
replaces step 1 by two reduce-scatters so each gradient byte crosses the slow link once:

a. permute the bucket ``[nodes, local, chunk] -> [local, nodes, chunk]`` (a copy), then
   reduce-scatter it inside the node: local rank ``l`` gets ``[nodes, chunk]``, the chunks
   ``(n, l)`` for every node ``n``, summed over its node (``(local-1)/local * N`` in-node);
b. reduce-scatter that slice across the ``nodes`` ranks with local position ``l``: node ``n``
   gets chunk ``(n, l)``, i.e. chunk ``r``, summed over the whole group
   (``(nodes-1)/nodes * N/local`` elements cross nodes, instead of ``(shard-1)/shard * N``).

The ownership layout is the one the rest of the engine expects (shard rank ``r`` owns chunk
``r``), so masters, optimizers, checkpoints and stage 3 do not know the reduction was
hierarchical. Parameter all-gathers stay flat over the shard group.

[Note: compression hook] The cross-node hops are each issued from one method, and
``grad_comm_dtype`` compresses exactly those: :meth:`HybridGradReduce.cross_node_reduce_scatter`
(step b) and :meth:`HybridGradReduce.replicate_all_reduce` (step 2); the hops inside a node stay
uncompressed. Without hybrid sharding or hierarchical reduction the flat bucket reduce-scatter is
the hop that crosses nodes, and ``grad_comm_dtype`` compresses it (``zero/reducer.py``).
``param_comm_dtype`` compresses the shard group's parameter all-gathers when that group spans
nodes (or when no hybrid layout is set); a shard group inside one node gathers uncompressed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import CommCounter, all_reduce, local_only, reduce_scatter
from lightning_zero.comm.compression import all_reduce_compressed, reduce_scatter_compressed

if TYPE_CHECKING:
    from lightning_zero.config import ZeroConfig

# wait(work, what): wait on ``work`` (a collective's handle) under the engine's timeout rules.
Wait = Callable[[Any, str], None]


class HybridGradReduce:
    """The replicate and hierarchical hops of one engine's gradient reduction.

    Args:
        config: the knobs (``lightning_zero.config.ZeroConfig``); read here: ``grad_comm_dtype``,
            what the cross-node hops send (the cross-node reduce-scatter of hierarchical
            reduction, the all-reduce across replicas); the hops inside a node stay uncompressed.
        shard_group: ZeRO's group (the reducer's ``dp_group``); ``shard_size`` ranks.
        replicate_group: ranks holding the same chunk (``dp // shard_size`` ranks); the reduced
            chunk is all-reduced over it.
        dp_group: every dp rank (all replicas) of this tp position: the bucket-order agreement of
            the first backward spans it, so all replicas launch buckets in one order.
        intra_group / inter_group: hierarchical reduction's in-node group (``local`` ranks) and
            cross-node group (``nodes`` ranks) inside the shard group; ``None`` for a flat
            reduce-scatter over ``shard_group``.
        counter: where logical bytes are counted, by kind and link class.
    """

    def __init__(
        self,
        config: "ZeroConfig",
        *,
        shard_group: Optional[dist.ProcessGroup],
        replicate_group: Optional[dist.ProcessGroup],
        dp_group: Optional[dist.ProcessGroup],
        intra_group: Optional[dist.ProcessGroup] = None,
        inter_group: Optional[dist.ProcessGroup] = None,
        counter: Optional[CommCounter] = None,
    ) -> None:
        if (intra_group is None) != (inter_group is None):
            raise ValueError("HybridGradReduce: give both intra_group and inter_group (hierarchical) or neither")
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.dp_group = dp_group
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.counter = counter if counter is not None else CommCounter()
        self.config = config
        self.shard_size = dist.get_world_size(shard_group)
        self.replicate_size = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.divisor = self.shard_size * self.replicate_size  # the full dp: gradients average over it
        self.dp_rank = dist.get_rank(dp_group)  # rank in the bucket-order agreement
        self.local = dist.get_world_size(intra_group) if intra_group is not None else 1
        self.nodes = dist.get_world_size(inter_group) if inter_group is not None else 1
        if self.hierarchical and self.local * self.nodes != self.shard_size:
            raise ValueError(
                f"HybridGradReduce: in-node group ({self.local}) x cross-node group ({self.nodes}) must be the"
                f" shard group ({self.shard_size})"
            )
        # output.data_ptr() -> node slice awaiting hop b
        self._slices: dict[int, torch.Tensor] = {}

    @property
    def hierarchical(self) -> bool:
        return self.intra_group is not None

    # -- hierarchical: hop a at launch, hop b at completion ---------------------------------------
    def launch_hierarchical(self, full: torch.Tensor, output: torch.Tensor) -> Any:
        """Start hop a of [Note: hierarchical reduction] for the bucket ``full``; its chunk lands in
        ``output`` once :meth:`finish` ran."""
        chunk = full.numel() // self.shard_size
        # (nodes, local, chunk) -> (local, nodes, chunk): local rank l's reduce-scatter chunk holds
        # the chunks (n, l) of every node n.
        permuted = full.view(self.nodes, self.local, chunk).transpose(0, 1).contiguous()
        local_rank = dist.get_rank(self.intra_group)
        node_slice = permuted[local_rank].view(-1)  # (nodes * chunk,)
        self._slices[output.data_ptr()] = node_slice
        return reduce_scatter(
            node_slice,
            permuted.view(-1),
            self.intra_group,
            async_op=True,
            counter=self.counter,
            label="reduce_scatter_grads_in_node",
        )

    def cross_node_reduce_scatter(self, output: torch.Tensor, node_slice: torch.Tensor, wait: Wait) -> None:
        """Hop b of [Note: hierarchical reduction]: the one cross-node gradient collective of a
        hierarchical reduction ([Note: compression hook])."""
        label = "reduce_scatter_grads_cross_node"
        comm_dtype = self.config.grad_comm_dtype
        if comm_dtype is not None:  # compressed: an all-to-all, pollable on any backend
            work = reduce_scatter_compressed(
                output, node_slice, self.inter_group, comm_dtype, async_op=True, counter=self.counter, label=label
            )
            wait(work, "the compressed cross-node gradient reduce-scatter (hierarchical_reduce)")
            return
        work = reduce_scatter(output, node_slice, self.inter_group, async_op=True, counter=self.counter, label=label)
        wait(work, "the cross-node gradient reduce-scatter (hierarchical_reduce)")

    def replicate_all_reduce(self, chunk: torch.Tensor, wait: Wait) -> None:
        """Step 2 of [Note: hybrid gradient reduction]: sum the reduced chunk over the replicas;
        the one cross-replica gradient collective ([Note: compression hook])."""
        comm_dtype = self.config.grad_comm_dtype
        if comm_dtype is not None:  # synchronous: a compressed reduce-scatter, then all-gather
            all_reduce_compressed(
                chunk, self.replicate_group, comm_dtype, counter=self.counter, label="all_reduce_grads_replicas"
            )
            return
        work = all_reduce(
            chunk, self.replicate_group, async_op=True, counter=self.counter, label="all_reduce_grads_replicas"
        )
        wait(work, "the gradient all-reduce across replicas (shard_size)")

    def finish(self, output: torch.Tensor, wait: Wait) -> None:
        """After the shard-group hop completed: the remaining hops, leaving this rank's chunk summed
        over every dp rank in ``output`` (the caller divides by :attr:`divisor`)."""
        if self.hierarchical:
            node_slice = self._slices.pop(output.data_ptr())
            self.cross_node_reduce_scatter(output, node_slice, wait)
        if not local_only(self.replicate_size):
            self.replicate_all_reduce(output, wait)
