"""Tensor-parallel layers (Megatron-LM style) on one TP process group, in plain torch.

Each layer holds only this rank's slice of the dense weight as an ordinary ``nn.Parameter``
(ZeRO then flattens whatever each rank holds) and is built from a dense layer with
``from_dense(layer, group)`` so that a TP model starts numerically equal to the dense one.

[Note: TP regions] Activations between TP layers are either *replicated* (every TP rank holds the
full ``[B, T, dim]`` tensor: the residual stream, norm outputs) or *split* on the last dim (the
outputs of a column-parallel layer: heads of q/k/v, the FFN hidden units, the vocab logits).

- ``copy_to_tp_region`` enters a split region: identity forward, all-reduce(SUM) of the input
  gradient backward (each rank's columns contribute a partial ``dL/dx``).
- ``reduce_from_tp_region`` leaves it: all-reduce(SUM) of the partial outputs forward (each rank
  multiplied its slice of the input features), identity backward.

A column layer calls ``copy_to_tp_region`` itself unless built with ``reduce_input_grad=False``;
``parallelize_llama`` uses that to enter the region once for q/k/v (and once for w1/w3) through a
hook on the norm before them, so a transformer block costs 2 all-reduces forward and 2 backward.

[Note: sequence parallelism] With ``sequence_parallel`` (Korthikanti et al. 2022) the replicated
regions become *sequence-sharded*: each TP rank holds ``[B, T/tp, dim]``, tokens
``[r T/tp, (r+1) T/tp)`` of the sequence (dim 1), and runs the norms and residual adds on them.

- ``gather_from_sequence_region`` enters a split region: all-gather over the sequence forward
  (``[B, T/tp, dim] -> [B, T, dim]``), reduce-scatter of the gradient backward.
- ``reduce_scatter_to_sequence_region`` leaves it: reduce-scatter of the partial outputs over the
  sequence forward (``[B, T, dim] -> [B, T/tp, dim]``), all-gather of the gradient backward.

An all-reduce is a reduce-scatter plus an all-gather, so the bytes sent are those of the
all-reduces they replace (``(tp-1)/tp`` of ``B T dim`` each, twice per all-reduce), while the
activations of the norm/residual regions shrink by ``tp``. A parameter used inside a sequence
shard (norm gains, a row layer's bias) sees only its shard's tokens: ``sum_grad_over_tp`` (identity
forward, all-reduce of the gradient backward, labelled ``tp_all_reduce_norm_grad``) makes its
gradient the full one on every TP rank, so it stays a replicated parameter ([Note: TP grad norm]).
The column layers keep the gathered ``[B, T, dim]`` input for their weight gradients (no second
all-gather in backward, unlike Megatron-LM's option of saving the shard): same bytes as without
sequence parallelism, and the gathered input counted by the planner.

Every collective goes through ``lightning_zero.comm.collectives`` labelled (``tp_all_reduce``,
``tp_all_gather_seq``, ``tp_reduce_scatter_seq``) and counts its logical bytes in the layer's
``counter`` (a ``CommCounter`` or ``None``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero.comm.collectives import CommCounter, all_gather, all_reduce, reduce_scatter

TP_LABEL = "tp_all_reduce"
SP_GATHER_LABEL = "tp_all_gather_seq"
SP_SCATTER_LABEL = "tp_reduce_scatter_seq"
SP_GRAD_LABEL = "tp_all_reduce_norm_grad"
SEQ_DIM = 1  # activations are (B, T, dim): the sequence is dim 1
TP_SHARD_DIM_ATTR = "_tp_shard_dim"
"""Parameter attribute: the dim along which the dense tensor is split over TP (``0`` or ``1``),
or ``None`` for a replicated parameter (every TP rank holds the full tensor, e.g. norm weights)."""


def tp_shard_dim(param: torch.Tensor) -> Optional[int]:
    """The dim ``param`` is split along over the TP group, or ``None`` if it is replicated."""
    return getattr(param, TP_SHARD_DIM_ATTR, None)


def mark_tp_param(param: torch.Tensor, shard_dim: Optional[int]) -> None:
    """Record how ``param`` is laid out over TP (see ``TP_SHARD_DIM_ATTR``)."""
    setattr(param, TP_SHARD_DIM_ATTR, shard_dim)


# --------------------------------------------------------------------------------------------
# The two region functions


class _CopyToTPRegion(torch.autograd.Function):
    """Identity forward; all-reduce(SUM) of the gradient backward (counted under ``label``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter], label: str):
        ctx.group, ctx.counter, ctx.label = group, counter, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_in = grad_out.clone(memory_format=torch.contiguous_format)
        all_reduce(grad_in, ctx.group, counter=ctx.counter, label=ctx.label)
        return grad_in, None, None, None


class _ReduceFromTPRegion(torch.autograd.Function):
    """All-reduce(SUM) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter]):
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group, counter=counter, label=TP_LABEL)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None, None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None) -> torch.Tensor:
    """Enter a TP-split region (see [Note: TP regions])."""
    return _CopyToTPRegion.apply(x, group, counter, TP_LABEL)


def sum_grad_over_tp(
    param: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None
) -> torch.Tensor:
    """``param`` unchanged; its gradient summed over the TP group in backward (a parameter used on
    a sequence shard, see [Note: sequence parallelism])."""
    return _CopyToTPRegion.apply(param, group, counter, SP_GRAD_LABEL)


def reduce_from_tp_region(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None
) -> torch.Tensor:
    """Leave a TP-split region by summing the partial results (see [Note: TP regions])."""
    return _ReduceFromTPRegion.apply(x, group, counter)


def sequence_shard_len(seq_len: int, tp_size: int) -> int:
    """``T / tp``, or a ``ValueError`` naming both numbers and the fix."""
    if seq_len % tp_size != 0:
        raise ValueError(
            f"sequence_parallel: tp({tp_size}) does not divide the sequence length ({seq_len}); use a "
            f"sequence length that is a multiple of {tp_size} (data seq_len) or sequence_parallel=False"
        )
    return seq_len // tp_size


def _all_gather_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter], label: str
) -> torch.Tensor:
    """``(B, T/tp, ...)`` on each rank -> ``(B, T, ...)``, rank ``r``'s tokens at ``[r T/tp, (r+1) T/tp)``."""
    tp_size = dist.get_world_size(group)
    local = x.movedim(SEQ_DIM, 0).contiguous()  # (T/tp, B, ...): rank order = sequence order
    full = torch.empty((tp_size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather(full, local, group, counter=counter, label=label)  # (T, B, ...)
    return full.movedim(0, SEQ_DIM).contiguous()  # (B, T, ...)


def _reduce_scatter_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter], label: str
) -> torch.Tensor:
    """``(B, T, ...)`` partial sums on each rank -> this rank's ``(B, T/tp, ...)`` of their sum."""
    tp_size = dist.get_world_size(group)
    shard_len = sequence_shard_len(x.shape[SEQ_DIM], tp_size)
    full = x.movedim(SEQ_DIM, 0).contiguous()  # (T, B, ...)
    shard = torch.empty((shard_len, *full.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter(shard, full, group, counter=counter, label=label)  # (T/tp, B, ...)
    return shard.movedim(0, SEQ_DIM).contiguous()  # (B, T/tp, ...)


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> torch.Tensor:
    return _all_gather_sequence(x, group, counter, SP_GATHER_LABEL)


def _scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> torch.Tensor:
    return _reduce_scatter_sequence(x, group, counter, SP_SCATTER_LABEL)


def _split_sequence(x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> torch.Tensor:
    return sequence_shard(x, group).clone()  # no communication


class _SequenceRegion(torch.autograd.Function):
    """``there`` forward, ``back`` on the gradient backward: two of the sequence moves above
    (all-gather, reduce-scatter, this rank's slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter], there, back):
        ctx.group, ctx.counter, ctx.back = group, counter, back
        return there(x, group, counter)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return ctx.back(grad_out, ctx.group, ctx.counter), None, None, None, None


def gather_from_sequence_region(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    counter: Optional[CommCounter] = None,
    *,
    labels: tuple[str, str] = (SP_GATHER_LABEL, SP_SCATTER_LABEL),
) -> torch.Tensor:
    """Enter a TP-split region from a sequence shard: ``(B, T/tp, dim) -> (B, T, dim)``, the
    gradient reduce-scattered back (see [Note: sequence parallelism]). ``labels``: the counter's
    names of the all-gather and the reduce-scatter (another group's sequence, such as cp's, counts
    under its own)."""
    if labels == (SP_GATHER_LABEL, SP_SCATTER_LABEL):
        return _SequenceRegion.apply(x, group, counter, _gather_sequence, _scatter_sequence)
    gather = functools.partial(_all_gather_sequence, label=labels[0])
    scatter = functools.partial(_reduce_scatter_sequence, label=labels[1])
    return _SequenceRegion.apply(x, group, counter, gather, scatter)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None
) -> torch.Tensor:
    """Leave a TP-split region onto a sequence shard: partial ``(B, T, dim)`` -> summed
    ``(B, T/tp, dim)``, the gradient all-gathered back (see [Note: sequence parallelism])."""
    return _SequenceRegion.apply(x, group, counter, _scatter_sequence, _gather_sequence)


def split_to_sequence_region(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None
) -> torch.Tensor:
    """A replicated ``(B, T, dim)`` (every TP rank holds it and the same gradient) -> this rank's
    ``(B, T/tp, dim)`` to run on its own tokens; the gradient is all-gathered back to the replicated
    one (Megatron's scatter to the sequence-parallel region)."""
    return _SequenceRegion.apply(x, group, counter, _split_sequence, _gather_sequence)


def gather_to_replicated_region(
    x: torch.Tensor, group: dist.ProcessGroup, counter: Optional[CommCounter] = None
) -> torch.Tensor:
    """Every rank's ``(B, T/tp, dim)`` -> the replicated ``(B, T, dim)``; backward keeps this rank's
    slice of the replicated gradient (no sum: it is the same on every rank)."""
    return _SequenceRegion.apply(x, group, counter, _gather_sequence, _split_sequence)


def sequence_shard(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``(B, T/tp, ...)`` slice of a replicated ``(B, T, ...)`` (no communication)."""
    tp_size = dist.get_world_size(group)
    shard_len = sequence_shard_len(x.shape[SEQ_DIM], tp_size)
    return x.narrow(SEQ_DIM, dist.get_rank(group) * shard_len, shard_len)


# --------------------------------------------------------------------------------------------
# Layers


def shard_size(total: int, tp_size: int, what: str) -> int:
    """``total // tp_size``, or a ``ValueError`` with both numbers if it does not divide."""
    if total % tp_size != 0:
        raise ValueError(f"tp({tp_size}) does not divide {what}({total})")
    return total // tp_size


def local_slice(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim`` (a copy, contiguous)."""
    size = shard_size(full.shape[dim], tp_size, f"dim {dim} of a {tuple(full.shape)} tensor")
    return full.narrow(dim, tp_rank * size, size).clone()


class _TPModule(nn.Module):
    """Holds the TP group, this rank's index in it and the optional byte counter.

    [Note: TP init] ``reset_parameters`` draws the *dense* tensor with the dense layer's default
    init and keeps this rank's slice. Every TP rank runs the same RNG stream, so a TP model
    materialized from the meta device (Lightning calls ``to_empty`` then ``reset_parameters`` per
    module) equals the same dense model materialized with the same seed, and no two ranks hold
    identical slices. It costs one dense-sized temporary per layer, freed right after.
    It also re-marks the parameters: ``to_empty`` from meta makes new ``nn.Parameter`` objects.
    """

    shard_dims: dict[str, Optional[int]] = {}  # parameter name -> dim split over TP (None: replicated)

    def __init__(self, group: dist.ProcessGroup, counter: Optional[CommCounter]) -> None:
        super().__init__()
        self.group = group
        self.tp_rank = dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        self.counter = counter

    def mark_params(self) -> None:
        """Set ``_tp_shard_dim`` on this module's parameters (see ``TP_SHARD_DIM_ATTR``)."""
        for name, param in self.named_parameters(recurse=False):
            mark_tp_param(param, self.shard_dims[name])

    def _copy_dense_slices(self, dense: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of each dense tensor (``dense`` maps parameter name -> tensor)."""
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                dim = self.shard_dims[name]
                full = dense[name]
                param.copy_(full if dim is None else local_slice(full, dim, self.tp_rank, self.tp_size))
        self.mark_params()

    @classmethod
    def _build_from_dense(cls, dense: nn.Module, *args: Any, **kwargs: Any):
        """Construct on meta (no init), allocate like ``dense``, copy this rank's slices."""
        layer = cls(*args, device="meta", dtype=dense.weight.dtype, **kwargs)
        layer.to_empty(device=dense.weight.device)
        layer._copy_dense_slices(dict(dense.named_parameters(recurse=False)))
        return layer


class _ParallelLinear(_TPModule):
    """Storage shared by the column and row layers: this rank's slice of a dense ``nn.Linear``.

    ``weight`` is the dense ``[out_features, in_features]`` split along ``shard_dim``; ``bias``
    (``[out_features]``) is split with it for a column layer and replicated for a row layer.
    """

    shard_dim: int  # 0: column (out_features split), 1: row (in_features split)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup,
        *,
        bias: bool = False,
        counter: Optional[CommCounter] = None,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(group, counter)
        self.in_features = in_features
        self.out_features = out_features
        self.shard_dims = {"weight": self.shard_dim, "bias": 0 if self.shard_dim == 0 else None}
        shape = [out_features, in_features]
        split_name = ("out_features", "in_features")[self.shard_dim]
        shape[self.shard_dim] = shard_size(shape[self.shard_dim], self.tp_size, split_name)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup, **kwargs: Any):
        """A layer holding this rank's slice of ``linear`` (keyword args go to the constructor)."""
        return cls._build_from_dense(
            linear, linear.in_features, linear.out_features, group, bias=linear.bias is not None, **kwargs
        )

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init of the dense weight, sliced (see [Note: TP init])."""
        factory = dict(device=self.weight.device, dtype=self.weight.dtype)
        dense = {"weight": torch.empty(self.out_features, self.in_features, **factory)}
        nn.init.kaiming_uniform_(dense["weight"], a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            dense["bias"] = torch.empty(self.out_features, **factory).uniform_(-bound, bound)
        self._copy_dense_slices(dense)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, local weight "
            f"{tuple(self.weight.shape)} (tp {self.tp_rank}/{self.tp_size}), bias={self.bias is not None}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W`` (``[out_features, in_features]``) split on ``out_features``.

    Input ``[..., in_features]`` replicated; output ``[..., out_features / tp]``, this rank's slice
    of the output features (kept split: the next layer is row-parallel or the vocab-parallel loss).
    Holds ``weight [out_features / tp, in_features]`` and ``bias [out_features / tp]``.

    Args:
        reduce_input_grad: all-reduce ``dL/dx`` over TP in backward (``copy_to_tp_region``). Set
            ``False`` only when the caller enters the TP region itself (see [Note: TP regions]).
    """

    shard_dim = 0

    def __init__(self, *args: Any, reduce_input_grad: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_input_grad = reduce_input_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_input_grad:
            x = copy_to_tp_region(x, self.group, self.counter)
        return F.linear(x, self.weight, self.bias)  # [..., out_features / tp]


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W`` (``[out_features, in_features]``) split on ``in_features``.

    Input ``[..., in_features / tp]``, this rank's slice of the features (the output of a column
    layer); output ``[..., out_features]`` replicated, the all-reduced sum of the partial products.
    Holds ``weight [out_features, in_features / tp]`` and a replicated ``bias [out_features]``
    added once after the all-reduce.

    With ``sequence_parallel`` the partial products are reduce-scattered over the sequence
    instead: output ``[B, T/tp, out_features]`` (see [Note: sequence parallelism]); the bias, added
    on the shard, gets its gradient summed over TP.

    Args:
        sequence_parallel: leave the TP region onto a sequence shard (reduce-scatter) instead of
            replicating the output (all-reduce).
    """

    shard_dim = 1

    def __init__(self, *args: Any, sequence_parallel: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # [..., out_features], this rank's share of the sum
        if not self.sequence_parallel:
            out = reduce_from_tp_region(partial, self.group, self.counter)  # [..., out_features]
            return out if self.bias is None else out + self.bias
        out = reduce_scatter_to_sequence_region(partial, self.group, self.counter)  # [B, T/tp, out_features]
        return out if self.bias is None else out + sum_grad_over_tp(self.bias, self.group, self.counter)


class VocabParallelEmbedding(_TPModule):
    """Embedding table ``[num_embeddings, embedding_dim]`` split on rows (the vocabulary).

    Rank ``r`` holds rows ``[r * V/tp, (r+1) * V/tp)``. Forward looks up the ids that fall in its
    range, writes zeros for the others, and all-reduces(SUM): every id is found on exactly one
    rank, so the sum is the dense lookup, replicated. Backward is identity: each rank's rows get
    the gradient of the tokens it owns. With ``sequence_parallel`` the sum is reduce-scattered
    over the sequence instead: output ``[B, T/tp, dim]`` (see [Note: sequence parallelism]).
    """

    shard_dims = {"weight": 0}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup,
        *,
        counter: Optional[CommCounter] = None,
        sequence_parallel: bool = False,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(group, counter)
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        local_rows = shard_size(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * local_rows
        self.vocab_end = self.vocab_start + local_rows
        self.weight = nn.Parameter(torch.empty(local_rows, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    @classmethod
    def from_dense(
        cls,
        embedding: nn.Embedding,
        group: dist.ProcessGroup,
        *,
        counter: Optional[CommCounter] = None,
        sequence_parallel: bool = False,
    ) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding.weight``."""
        return cls._build_from_dense(
            embedding,
            embedding.num_embeddings,
            embedding.embedding_dim,
            group,
            counter=counter,
            sequence_parallel=sequence_parallel,
        )

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s default N(0, 1) init of the dense table, sliced (see [Note: TP init])."""
        dense = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        self._copy_dense_slices({"weight": nn.init.normal_(dense)})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)  # [B, T]
        local_idx = (idx - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_idx, self.weight)  # [B, T, dim]
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:  # [B, T/tp, dim]: enters the blocks sequence-sharded
            return reduce_scatter_to_sequence_region(partial, self.group, self.counter)
        return reduce_from_tp_region(partial, self.group, self.counter)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (local rows [{self.vocab_start}, "
            f"{self.vocab_end}), tp {self.tp_rank}/{self.tp_size})"
        )


def tp_shard_dims(model: nn.Module) -> dict[str, Optional[int]]:
    """Parameter name -> dim split over TP (``None``: replicated), from the module types.

    The source of truth (``_tp_shard_dim`` attributes are a cache on the parameter objects).
    """
    dims: dict[str, Optional[int]] = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            dims[full_name] = module.shard_dims[param_name] if isinstance(module, _TPModule) else None
    return dims


def mark_tp_params(model: nn.Module) -> None:
    """(Re)set ``_tp_shard_dim`` on every parameter of ``model`` from the module types.

    Call after anything that replaces parameter objects (e.g. ``to_empty`` from meta).
    """
    for module in model.modules():
        if isinstance(module, _TPModule):
            module.mark_params()
        else:
            for param in module.parameters(recurse=False):
                mark_tp_param(param, None)
