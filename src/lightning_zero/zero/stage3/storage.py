"""Stage-3 storage: only this rank's chunk of every bucket persists; the full group exists only
while its unit is gathered."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.zero.flat import BucketLayout, ChunkedParamGroup


class ShardedFlatParamGroup(ChunkedParamGroup):
    """Stage-3 storage for a :class:`FlatLayout`: only this rank's chunk of every bucket persists.

    ``shard_buffer`` holds the rank's chunks (compute dtype) end to end; ``full_buffer`` is the
    whole group, its storage allocated only while gathered; parameters are views into it.
    A frozen group (no optimizer steps it) keeps its parameters' own dtype -- int8 included --
    and its "masters" are plain, gradient-free views of the chunks (what checkpoints read).
    """

    def _allocate(self, device: torch.device) -> None:
        layout, dp_rank, compute_dtype = self.layout, self.dp_rank, self.compute_dtype
        self._shard_offsets: list[int] = []
        offset = 0
        for bucket in layout.buckets:
            self._shard_offsets.append(offset)
            offset += bucket.shard_numel
        self.shard_buffer = torch.zeros(offset, dtype=compute_dtype, device=device)
        if self.masters_alias_params:
            for bucket in layout.buckets:
                start = bucket.shard_start(dp_rank)
                layout.copy_range_from_params(start, start + bucket.shard_numel, self.param_shard(bucket))
            self.masters = self._masters_aliasing_chunks()
        else:
            self.masters = self._masters_from_params()
            self.copy_masters_to_params()

        self.full_buffer = torch.empty(layout.numel, dtype=compute_dtype, device=device)
        self.full_nbytes = self.full_buffer.untyped_storage().nbytes()
        for slot in layout.slots:
            slot.param.data = self.full_buffer[slot.offset : slot.end].view(slot.shape)
        self.free()

    def _masters_aliasing_chunks(self) -> list[nn.Parameter]:
        floating = self.compute_dtype.is_floating_point
        return [nn.Parameter(self.param_shard(bucket), requires_grad=floating) for bucket in self.layout.buckets]

    # -- storage --------------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.full_buffer.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        if not self.is_allocated:
            self.full_buffer.untyped_storage().resize_(self.full_nbytes)

    def free(self) -> None:
        self.full_buffer.untyped_storage().resize_(0)

    @property
    def comm_device(self) -> torch.device:
        return self.shard_buffer.device

    def param_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.full_buffer[bucket.start : bucket.end]

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        offset = self._shard_offsets[bucket.index]
        return self.shard_buffer[offset : offset + bucket.shard_numel]

    def param_bytes(self) -> int:
        shard = self.shard_buffer.numel() * self.shard_buffer.element_size()
        return shard + self.full_buffer.untyped_storage().nbytes()
