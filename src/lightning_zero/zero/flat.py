"""Flat buffers: parameters laid end to end, cut into buckets, each bucket split evenly over dp.

[Note: flat layout] A :class:`FlatLayout` places the parameters of one optimizer param group end
to end in *reverse* registration order (the order their gradients become ready in backward) and
cuts the run into buckets of about ``bucket_numel`` elements (``zero/bucketing.py``, [Note: bucket
boundaries]: the rule the planner uses too); a parameter never straddles two buckets. Each bucket is padded to a multiple of ``dp`` and every data-parallel rank owns one
contiguous chunk of every bucket (its *shard* of the bucket). Sharding per bucket, not per whole
buffer, means a bucket's reduce-scatter hands each rank exactly the gradients it owns, and the
all-gather after the step is the same cut in reverse. A rank's optimizer state is the list of its
bucket chunks; for an element-wise optimizer (SGD, Adam, AdamW, ...) the update is the same as
on the unsharded tensor.

[Note: small first bucket] A bucket launches once all its gradients arrived, so nothing is
communicated before the first bucket is full. With ``first_bucket_numel`` the first bucket of the
layout (its parameters are the last registered, whose gradients come first in backward) closes
after about that many elements, as DDP's first bucket closes at 1 MiB: the first reduce-scatter
starts early in backward whatever ``bucket_numel`` is, and a model smaller than one bucket still
gets two. Stages 1-2 use it (``FIRST_BUCKET_MB``); stage 3's per-unit layouts do not.

:class:`FlatParamGroup` owns the storage for one layout on one rank: the compute-dtype parameter
buffer (parameters become views into it) and the fp32 master chunks the optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter, all_gather
from lightning_zero.comm.compression import all_gather_compressed, is_lossy
from lightning_zero.zero.bucketing import FIRST_BUCKET_MB, bucket_sizes, first_bucket_numel, padded_numel

if TYPE_CHECKING:
    from lightning_zero.zero.domains import ExpertDomain

__all__ = [  # FIRST_BUCKET_MB and first_bucket_numel: the engine imports them from here
    "FIRST_BUCKET_MB",
    "BucketLayout",
    "ChunkedParamGroup",
    "FlatLayout",
    "FlatParamGroup",
    "ParamSlot",
    "first_bucket_numel",
    "fp32_parameter_ids",
    "keeps_fp32",
]


@dataclass
class ParamSlot:
    """Where one parameter lives inside its group's flat buffer."""

    param: nn.Parameter
    name: str
    offset: int  # first element in the group's flat buffer
    numel: int
    shape: torch.Size
    bucket_index: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class BucketLayout:
    """A contiguous run of the flat buffer, padded to split evenly over ``dp`` ranks."""

    index: int  # position inside its group
    start: int  # first element in the group's flat buffer
    numel: int  # padded: a multiple of dp
    dp: int
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    def shard_start(self, dp_rank: int) -> int:
        return self.start + dp_rank * self.shard_numel

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class FlatSpec:
    """What every flat group of one engine is cut by, at every stage: the module's parameter
    ``names`` and registration ``order`` (by id), the ``device``, the resolved ``bucket_mb``, this
    rank's place in the dense ZeRO group (``dp_size``, ``dp_rank``) and the expert domain's
    (``expert``, [Note: expert domain]; ``None``: every parameter dense), the dtypes (``compute``,
    ``master``: what the optimizer steps, ``reduce``: gradient buffers and reduce-scatters;
    ``norms_in_fp32``: norm layers with running statistics keep fp32 parameters under a lower
    compute dtype) and what parameter all-gathers send (``param_comm_dtype``)."""

    names: dict[int, str]
    order: dict[int, int]
    device: torch.device
    bucket_mb: float
    dp_size: int
    dp_rank: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    param_comm_dtype: Optional[str] = None
    master_dtype: torch.dtype = torch.float32
    norms_in_fp32: bool = True
    expert: Optional["ExpertDomain"] = None

    @property
    def reduce_in_fp32(self) -> bool:
        return self.reduce_dtype == torch.float32


class FlatLayout:
    """Offsets and buckets for one param group (see [Note: flat layout]); no storage."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        *,
        dp: int,
        bucket_numel: int,
        first_bucket_numel: Optional[int] = None,
    ) -> None:
        if dp < 1:
            raise ValueError(f"FlatLayout: dp must be >= 1, got {dp}")
        if bucket_numel < 1:
            raise ValueError(f"FlatLayout: bucket_numel must be >= 1, got {bucket_numel}")
        if first_bucket_numel is not None and first_bucket_numel < 1:
            raise ValueError(f"FlatLayout: first_bucket_numel must be >= 1, got {first_bucket_numel}")
        self.dp = dp
        self.slots: list[ParamSlot] = []
        self.buckets: list[BucketLayout] = []
        ordered = list(zip(reversed(params), reversed(names)))
        counts = bucket_sizes(
            (param.numel() for param, _ in ordered), bucket_numel=bucket_numel, first_bucket_numel=first_bucket_numel
        )
        offset = taken = 0
        for index, count in enumerate(counts):
            bucket = BucketLayout(index=index, start=offset, numel=0, dp=dp)
            for param, name in ordered[taken : taken + count]:
                slot = ParamSlot(param, name, offset, param.numel(), param.shape, index)
                bucket.slots.append(slot)
                self.slots.append(slot)
                offset += slot.numel
            taken += count
            bucket.numel = padded_numel(offset - bucket.start, dp)
            self.buckets.append(bucket)
            offset = bucket.end
        self.numel = offset

    @property
    def padding_numel(self) -> int:
        return self.numel - sum(slot.numel for slot in self.slots)

    def copy_range_from_params(self, start: int, end: int, out: torch.Tensor) -> None:
        """Fill ``out`` (``end - start`` elements) with the parameter values laid at ``[start, end)``.

        Padding reads as zero. Used to build fp32 master chunks straight from the original
        parameters, so no full fp32 flat copy is ever made.
        """
        self.copy_range_from(start, end, out, lambda slot: slot.param.detach())

    def copy_range_from(
        self, start: int, end: int, out: torch.Tensor, tensor_of: Callable[[ParamSlot], Optional[torch.Tensor]]
    ) -> None:
        """Fill ``out`` with the elements at ``[start, end)`` of the run made by laying
        ``tensor_of(slot)`` (shaped like the slot's parameter; ``None``: zeros) at each slot."""
        out.zero_()
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.end)
            if lo >= hi:
                continue
            tensor = tensor_of(slot)
            if tensor is None:
                continue
            flat = tensor.reshape(-1)
            out[lo - start : hi - start].copy_(flat[lo - slot.offset : hi - slot.offset])


class ChunkedParamGroup:
    """What every stage's storage shares: the layout, this rank's chunk of every bucket, and the
    fp32 master chunks the optimizer steps (``masters[b]`` for bucket ``b``).

    When ``compute_dtype`` equals ``master_dtype`` (fp32 training) the master *is* the compute
    chunk (no extra copy); otherwise (bf16-mixed) it is an fp32 copy taken from the original
    parameter values before they are cast. ``offload=True`` keeps the masters (and so the
    optimizer state made like them) as separate fp32 copies in CPU memory.
    Subclasses define where the chunks and the full buckets live (``param_shard``/``param_bucket``).
    """

    gathers_in_place = False  # the all-gather's input chunk is a view of its output

    def __init__(
        self,
        layout: FlatLayout,
        *,
        dp_rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
        offload: bool = False,
        param_comm_dtype: Optional[str] = None,
    ) -> None:
        self.layout = layout
        self.dp_rank = dp_rank  # rank in the group this one is sharded over (its domain's)
        # [Note: expert domain] in zero/domains.py: the builder sets the expert domain of a group of
        # expert parameters; None: dense (sharded over the engine's dp group).
        self.domain: Optional[ExpertDomain] = None
        self.compute_dtype = compute_dtype
        self.master_dtype = master_dtype
        self.master_device = torch.device("cpu") if offload else device
        # What the parameter all-gathers send (lightning_zero/comm/compression.py). A lossy one writes the
        # dequantized values into this rank's own chunk too (stages 1-2 gather in place), so the
        # fp32 masters must then be separate copies to stay exact.
        self.param_comm_dtype = param_comm_dtype
        lossy_in_place = is_lossy(param_comm_dtype, compute_dtype) and self.gathers_in_place
        self.masters_alias_params = compute_dtype == master_dtype and not offload and not lossy_in_place
        self.masters: list[nn.Parameter] = []
        self._allocate(device)

    def _allocate(self, device: torch.device) -> None:
        """Create the storage (compute buffers, masters) and point the parameters into it."""
        raise NotImplementedError

    def param_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        raise NotImplementedError

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        raise NotImplementedError

    def _masters_from_params(self) -> list[nn.Parameter]:
        """Separate fp32 master chunks read straight from the parameters (call before moving them)."""
        masters = []
        for bucket in self.layout.buckets:
            start = bucket.shard_start(self.dp_rank)
            chunk = torch.empty(bucket.shard_numel, dtype=self.master_dtype, device=self.master_device)
            self.layout.copy_range_from_params(start, start + bucket.shard_numel, chunk)
            masters.append(nn.Parameter(chunk))
        return masters

    def _masters_aliasing_chunks(self) -> list[nn.Parameter]:
        return [nn.Parameter(self.param_shard(bucket)) for bucket in self.layout.buckets]

    def copy_masters_to_params(self) -> None:
        """Write the updated master chunks into this rank's compute chunks (no-op when aliased)."""
        if self.masters_alias_params:
            return
        for bucket, master in zip(self.layout.buckets, self.masters):
            self.param_shard(bucket).copy_(master.detach())

    def start_all_gather(self, group: Optional[dist.ProcessGroup], counter: CommCounter) -> list:
        """Async all-gather of every bucket's chunks into the full buckets; returns the works.
        ``param_comm_dtype`` set: compressed (every rank, the owner too, gets the dequantized values)."""
        return [
            all_gather_compressed(
                self.param_bucket(bucket),
                self.param_shard(bucket),
                group,
                self.param_comm_dtype,
                async_op=True,
                counter=counter,
                label="all_gather_params",
            )
            for bucket in self.layout.buckets
        ]

    def restore_master_params(self, group: Optional[dist.ProcessGroup], counter: CommCounter, wait) -> None:
        """Make every parameter a view of the full fp32 masters (all-gathered over dp), so the module
        leaves the engine in the dtype it came in (bf16-mixed keeps fp32 weights outside training).
        ``wait(work)`` waits on one collective. No-op when the masters are the parameters."""
        if self.masters_alias_params:
            return
        device = self.comm_device
        full = torch.empty(self.layout.numel, dtype=self.master_dtype, device=device)
        works = [
            all_gather(
                full[bucket.start : bucket.end],
                master.detach().to(device),
                group,
                async_op=True,
                counter=counter,
                label="all_gather_masters",
            )
            for bucket, master in zip(self.layout.buckets, self.masters)
        ]
        for work in works:
            wait(work)
        for slot in self.layout.slots:
            slot.param.data = full[slot.offset : slot.end].view(slot.shape)
        self._restored(full)

    @property
    def comm_device(self) -> torch.device:
        """Where this group's collectives run (its compute chunks' device)."""
        raise NotImplementedError

    def _restored(self, full: torch.Tensor) -> None:
        """The parameters now view ``full`` (the fp32 masters, gathered)."""

    def master_bytes(self) -> int:
        """Bytes of fp32 master copies held *in addition* to the parameters (0 when they alias)."""
        if self.masters_alias_params:
            return 0
        return sum(master.numel() * master.element_size() for master in self.masters)


class FlatParamGroup(ChunkedParamGroup):
    """Stages 1 and 2: the full parameters stay, in one ``param_buffer`` of ``compute_dtype``;
    every parameter's ``.data`` is a view into it and this rank's chunks are slices of it."""

    gathers_in_place = True

    def _allocate(self, device: torch.device) -> None:
        layout = self.layout
        separate = [] if self.masters_alias_params else self._masters_from_params()
        self.param_buffer = torch.zeros(layout.numel, dtype=self.compute_dtype, device=device)
        for slot in layout.slots:
            view = self.param_buffer[slot.offset : slot.end]
            view.copy_(slot.param.detach().reshape(-1))
            slot.param.data = view.view(slot.shape)
        self.masters = self._masters_aliasing_chunks() if self.masters_alias_params else separate

    def param_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.param_buffer[bucket.start : bucket.end]

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        start = bucket.shard_start(self.dp_rank)
        return self.param_buffer[start : start + bucket.shard_numel]

    def param_bytes(self) -> int:
        return self.param_buffer.numel() * self.param_buffer.element_size()

    @property
    def comm_device(self) -> torch.device:
        return self.param_buffer.device

    def _restored(self, full: torch.Tensor) -> None:
        self.param_buffer = full


def keeps_fp32(module: nn.Module) -> bool:
    """Norm layers with running statistics keep fp32 parameters under bf16-mixed.

    Their running statistics stay fp32 (buffers are never cast); the layer needs its weight and
    bias in the statistics' dtype, as FSDP's MixedPrecision keeps ``_BatchNorm`` in fp32.
    """
    return isinstance(module, nn.modules.batchnorm._NormBase) or (
        "running_mean" in module._buffers and "running_var" in module._buffers
    )


def fp32_parameter_ids(module: nn.Module) -> set[int]:
    """Ids of the parameters held by :func:`keeps_fp32` modules."""
    return {id(p) for m in module.modules() if keeps_fp32(m) for p in m.parameters(recurse=False)}


@dataclass(frozen=True)
class OwnedRange:
    """A run of one parameter's flattened elements whose master (and optimizer state) this rank owns.

    ``master[chunk_lo:chunk_hi]`` holds elements ``[param_lo, param_hi)`` of
    ``param.reshape(-1)``; the optimizer state tensors of ``master`` (same shape as ``master``)
    slice the same way. Checkpoints save and reshard through these ranges.
    """

    name: str
    param: nn.Parameter
    shape: torch.Size
    param_lo: int
    param_hi: int
    master: nn.Parameter
    chunk_lo: int
    chunk_hi: int


@dataclass(frozen=True)
class OptimizerShards:
    """Where this rank's share of the optimizers' state lives: each owned run with the tensor its
    optimizer steps and keys the state by (``ZeroEngine.optimizer_tensor``: the master chunk itself
    where no optimizer steps a view of the run); ``optimizers``: the user's optimizer objects.

    [Note: optimizer state after the loop] The engine closes when a door's loop ends (the Trainer's
    teardown after ``fit``, ``validate``, ...; Fabric's ``strategy.teardown()``): the module gets its
    full parameters back, but the optimizers keep stepping views of the master runs, and their
    state stays sharded, as it was. The engine leaves these runs behind (:meth:`ZeroEngine.close`'s
    caller keeps them: ``ZeroSession.optimizer_shards``), so a save after the loop (most scripts end
    with ``trainer.save_checkpoint``) writes the optimizer state by element range, as a save inside
    the loop does, and a resume continues exactly where ddp's would.
    """

    runs: tuple[tuple[OwnedRange, torch.Tensor], ...]
    optimizers: tuple  # the user's torch optimizers, in the engine's order
    replicated: bool  # some optimizer steps replicated full masters (its state is not range-saved)
    whole_matrices: bool = False  # some optimizer keeps each state matrix whole on its owner (Muon)

    def serves(self, optimizers: list) -> bool:
        """Whether every one of ``optimizers`` (at least one) is an optimizer these runs belong to."""
        return bool(optimizers) and all(any(opt is mine for mine in self.optimizers) for opt in optimizers)


def owned_ranges(groups: list[FlatParamGroup]) -> Iterator[OwnedRange]:
    """Every (parameter, element range) whose master this rank owns, in layout order."""
    for group in groups:
        for bucket, master in zip(group.layout.buckets, group.masters):
            start = bucket.shard_start(group.dp_rank)
            end = start + bucket.shard_numel
            for slot in bucket.slots:
                lo, hi = max(start, slot.offset), min(end, slot.end)
                if lo < hi:
                    yield OwnedRange(
                        slot.name,
                        slot.param,
                        slot.shape,
                        lo - slot.offset,
                        hi - slot.offset,
                        master,
                        lo - start,
                        hi - start,
                    )
