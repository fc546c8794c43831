"""Tensor parallelism in plain torch (no Lightning): TP layers, vocab-parallel loss, the region hooks and
TP state dicts every family's plan uses (a family's plan lives beside its model: Llama's is
``lightning_zero.models.llama.parallelize_llama``).

See ``docs/tensor_parallel.md`` for what is split how and what each layer sends.
"""

from lightning_zero.tp.grad_norm import (
    grad_norm_sq_contributions,
    is_tp_sharded,
    tp_grad_norm,
    tp_grad_norm_weight,
)
from lightning_zero.tp.layers import (
    TP_SHARD_DIM_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    mark_tp_params,
    reduce_from_tp_region,
    tp_shard_dim,
    tp_shard_dims,
)
from lightning_zero.tp.loss import vocab_parallel_cross_entropy
from lightning_zero.tp.parallelize import (
    EnterTPRegion,
    GatherSequence,
    gather_tp_state_dict,
    resolve_tp_group,
    shard_dense_state_dict,
)

__all__ = [
    "TP_SHARD_DIM_ATTR",
    "ColumnParallelLinear",
    "EnterTPRegion",
    "GatherSequence",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "gather_tp_state_dict",
    "grad_norm_sq_contributions",
    "is_tp_sharded",
    "mark_tp_params",
    "reduce_from_tp_region",
    "resolve_tp_group",
    "shard_dense_state_dict",
    "tp_grad_norm",
    "tp_grad_norm_weight",
    "tp_shard_dim",
    "tp_shard_dims",
    "vocab_parallel_cross_entropy",
]
