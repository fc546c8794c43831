"""Context parallelism: each cp rank holds a slice of every sequence; Ulysses all-to-alls around
attention (plain torch.distributed, no Lightning). See docs/context_parallel.md."""

from lightning_zero.cp.layout import (
    UlyssesLayout,
    check_context_parallel,
    context_shard_len,
    context_slice_bounds,
    kv_head_repeats,
    ulysses_layout,
)

__all__ = [
    "UlyssesLayout",
    "check_context_parallel",
    "context_shard_len",
    "context_slice_bounds",
    "kv_head_repeats",
    "ulysses_layout",
]
