"""Where a flat layout's buckets end: one pure rule, shared by the engine and the planner.

[Note: bucket boundaries] Tensors are laid end to end in layout order (``zero/flat.py`` lays a
param group in reverse registration order). A bucket closes as soon as it holds at least
``bucket_numel`` elements, so a tensor never straddles two buckets and a tensor larger than a
bucket fills one alone. With ``first_bucket_numel`` the first bucket closes after
``min(first_bucket_numel, bucket_numel)`` elements ([Note: small first bucket] in flat.py).
Each bucket is then padded to a multiple of ``dp``. :class:`~lightning_zero.zero.flat.FlatLayout`
builds its buckets from :func:`bucket_sizes`, and the planner's step-time model
(``planner/workload.py``) cuts the same buckets from parameter counts alone, so both agree by
construction. Plain integers only: no torch, importable by the planner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

MIB = 2**20
FIRST_BUCKET_MB = 1.0  # stages 1-2: size of the first bucket in MiB ([Note: small first bucket])


def bucket_numel_for_bytes(bucket_mb: float, element_size: int) -> int:
    """Elements of ``element_size`` bytes in a bucket of ``bucket_mb`` MiB (at least 1)."""
    return max(1, int(bucket_mb * MIB) // element_size)


def grad_element_bytes(param_element_bytes: int, reduce_in_fp32: bool) -> int:
    """[Note: bucket_mb counts gradient bytes] ``bucket_mb`` (and ``"auto"``'s quarter of the
    gradient bytes) is MiB of *gradient* elements at every stage: of the dtype gradients are
    bucketed, accumulated and reduce-scattered in, i.e. fp32 under ``reduce_dtype="fp32"`` and the
    parameter's own compute dtype otherwise (a norm kept fp32 under bf16-mixed: 4 bytes). The
    engine's builders (stages 1-2: ``zero/build.py``; stage 3: ``zero/stage3/init.py``) and the
    planner (``planner/ledger.py`` ``grad_bytes_per_param``) size buckets through this function.
    (Stage 3 once counted compute-dtype bytes, so ``reduce_dtype="fp32"`` under bf16-mixed made its
    buckets twice the bytes the planner assumed.)"""
    return 4 if reduce_in_fp32 else param_element_bytes


def grad_bucket_numel(bucket_mb: float, param_element_bytes: int, reduce_in_fp32: bool) -> int:
    """Elements in a gradient bucket of ``bucket_mb`` MiB ([Note: bucket_mb counts gradient bytes])."""
    return bucket_numel_for_bytes(bucket_mb, grad_element_bytes(param_element_bytes, reduce_in_fp32))


def first_bucket_numel(bucket_numel: int, element_size: int) -> int:
    """Elements in the first bucket of a stage 1-2 layout: ``FIRST_BUCKET_MB``, at most a bucket."""
    return max(1, min(bucket_numel, int(FIRST_BUCKET_MB * MIB) // element_size))


def bucket_sizes(numels: Iterable[int], *, bucket_numel: int, first_bucket_numel: Optional[int] = None) -> list[int]:
    """How many consecutive tensors (``numels``, in layout order) each bucket takes
    ([Note: bucket boundaries]); the counts sum to the number of tensors."""
    sizes: list[int] = []
    count = used = 0
    for numel in numels:
        count += 1
        used += numel
        limit = bucket_numel if sizes or first_bucket_numel is None else min(first_bucket_numel, bucket_numel)
        if used >= limit:
            sizes.append(count)
            count = used = 0
    if count:
        sizes.append(count)
    return sizes


def padded_numel(numel: int, dp: int) -> int:
    """``numel`` rounded up to a multiple of ``dp`` (a bucket splits evenly over the dp ranks)."""
    return -(-numel // dp) * dp


def keeps_full_grads(stage: int, defer_grad_reduce: bool) -> bool:
    """[Note: deferred gradient reduction] Whether a rank keeps full-size gradients over the micro
    batches of a step and reduces once, at the last (``zero/grad_storage.py``'s ``FullGradStorage``):
    ddp (stage 0) and stage 1 always; stages 2 and 3 with ``defer_grad_reduce=True``, as FSDP2's
    ``set_requires_gradient_sync(False)``. Otherwise (stages 2-3 by default) every backward
    reduce-scatters into the persistent gradient shard, through a pool of bucket buffers. One rule:
    the engine picks its gradient storage by it, and the planner counts gradient bytes (``ledger.
    model_state_bytes``), reductions per step (``ledger.grad_syncs_per_step``), the bucket pool and
    the gradient timings by it. Under ``bf16-true`` deferring is what makes stages 2-3 equal ddp bit
    for bit under accumulation (docs/precision.md)."""
    return stage <= 1 or defer_grad_reduce


def defer_grad_reduce_at(stage: int, defer_grad_reduce: bool) -> bool:
    """The knob as it matters at ``stage``: only stages 2-3 choose (stages 0-1 always defer, so
    their ``defer_grad_reduce`` changes nothing: :func:`keeps_full_grads`). What the planner
    reports and replans with."""
    return bool(defer_grad_reduce) and stage >= 2


def pool_buffers(max_buckets_in_flight: int) -> int:
    """Stage 2/3: bucket buffers the gradient pool holds at most, one more than the reduce-scatters
    in flight, so the next bucket fills while ``max_buckets_in_flight`` are on the link ([Note:
    the bucket pool outlives backward] in ``zero/grad_storage.py``). With exactly as many buffers
    as reduce-scatters in flight, backward stalled on the oldest one before the next bucket could
    start filling (issue 24; measured in docs/benchmarks.md, sessions 9 and 10)."""
    return max_buckets_in_flight + 1
