"""Tensor parallelism (with or without sequence parallelism) of LitGPT's ``GPT`` and LoRA's ``GPT``.

[Note: LitGPT under tensor parallelism] LitGPT's scripts stay unchanged: the model takes the whole
``(B, T)`` batch and gives back the whole ``(B, T, vocab)`` logits, as under ddp, so the scripts'
own loss (``chunked_cross_entropy``) runs as it is. LitGPT's modules keep their classes, names
and forwards; what changes is the tensors they hold and the collectives around them (Megatron-LM's
layout, as Lightning's ``ModelParallelStrategy`` examples and torchtitan apply it to Llama):

===============================  ============  ===============================================
module                           split         this rank holds
===============================  ============  ===============================================
attn.qkv (Linear / LoRA's)       rows          its ``n_head/tp`` query heads, then its
                                               ``n_query_groups/tp`` key and value heads
                                               ([Note: segmented TP split] in ``tp/segments.py``)
attn.proj                        columns       the inputs of its heads
mlp.fc / fc_1 / fc_2             rows          ``intermediate_size/tp`` hidden units
mlp.proj                         columns       the inputs of those units
LoRA's lora_B (column layers)    rows          the rows of its outputs (qkv: per segment)
LoRA's lora_A (row layers)       columns       the columns of its inputs
wte, lm_head, norms, other LoRA  replicated
===============================  ============  ===============================================

Each attention keeps LitGPT's forward with a config of its own holding the local head counts, so
every head of a rank meets its own key/value group (ranks hold whole groups: ``tp`` divides
``n_query_groups``). With ``sequence_parallel`` the residual stream between the layers is
``(B, S, n_embd)``, ``S = ceil(T / tp)`` on each TP rank (the tail padded with zeros up to ``tp S``):

- the embedding's output (whole, every rank) is cut to the rank's ``S`` tokens
  (``split_to_sequence_region``: backward all-gathers, so ``wte`` gets the whole gradient);
- a forward pre-hook on ``attn`` and on ``mlp`` all-gathers the sequence and drops the padding;
  their last layers (``proj``) reduce-scatter their partial sums back onto the ``S`` tokens and add
  the bias after;
- ``ln_f``'s output is all-gathered to the whole sequence (``gather_to_replicated_region``:
  backward keeps the rank's slice, no sum: every rank's ``lm_head`` and loss are the same), so
  ``lm_head`` runs on every token, replicated, as under context parallelism.

Without it the same hooks enter and leave the TP region (``copy_to_tp_region``, an all-reduce).
Parameters used on a sequence shard (norm gains and biases, a row layer's bias) and LoRA's
replicated factor (``lora_A`` of a column layer reads the whole input but feeds this rank's
outputs only; ``lora_B`` of a row layer multiplies a partial sum) get their gradients summed over
the TP group in backward (``sum_grad_over_tp``, swapped in for the parameter for the forward's
duration by the class :func:`tensor_parallel_module` makes); so every parameter's gradient on
every TP rank is the dense model's (the replicated ones: the same on each TP rank), and the
engine's average over dp is ddp's. A padded token is zero in the residual stream and is cut off
before attention, the MLP and the head read anything: it changes nothing. Each TP rank draws
dropout for its own part (LoRA's ``lora_dropout``): compare with ddp at ``--lora_dropout 0``.

Under context parallelism too (tp first, then cp: ``models/litgpt/parallelize.py``), the cp
rank's slice of the sequence is what the TP ranks split further; cp's attention reads the local
head counts from the same per-attention config.

Every split parameter is marked ``_tp_shard_dim`` (and ``_tp_segments`` for ``qkv``'s rows), every
other ``_tp_shard_dim = None``: the gradient norm counts each element once ([Note: TP grad norm]),
and full state dicts, optimizer state and loads speak the dense layout ([Note: dense TP tensors in
a full file] in ``checkpoint/full.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager
from typing import Any, Generator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.tp.layers import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_to_replicated_region,
    mark_tp_param,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    split_to_sequence_region,
    sum_grad_over_tp,
)
from lightning_zero.tp.segments import TP_SEGMENTS_ATTR, local_part


class TPRegions:
    """The collectives around the split layers of one model ([Note: LitGPT under tensor
    parallelism]); ``tokens``: ``T`` of the forward in progress (set where the embedding runs)."""

    def __init__(self, group: dist.ProcessGroup, counter: CommCounter, sequence_parallel: bool) -> None:
        self.group, self.counter, self.sequence_parallel = group, counter, sequence_parallel
        self.size = dist.get_world_size(group)
        self.tokens = 0

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        padded = -(-x.size(1) // self.size) * self.size  # T rounded up to a multiple of tp
        return F.pad(x, (0, 0, 0, padded - x.size(1))) if padded > x.size(1) else x

    def after_embedding(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        self.tokens = output.size(1)
        if not self.sequence_parallel:
            return output
        return split_to_sequence_region(self._padded(output), self.group, self.counter)  # (B, S, n_embd)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of ``attn`` and ``mlp``: their input whole on every TP rank."""
        x = args[0]
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group, self.counter)[:, : self.tokens]
        else:
            x = copy_to_tp_region(x, self.group, self.counter)
        return (x, *args[1:]), kwargs

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """A row layer's partial sums: summed over the TP ranks (onto the ``S`` tokens under SP)."""
        if not self.sequence_parallel:
            return reduce_from_tp_region(partial, self.group, self.counter)
        return reduce_scatter_to_sequence_region(self._padded(partial), self.group, self.counter)

    def after_final_norm(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return output
        return gather_to_replicated_region(output, self.group, self.counter)[:, : self.tokens]

    def summed(self, param: torch.Tensor) -> torch.Tensor:
        return sum_grad_over_tp(param, self.group, self.counter)


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for parent in parents:
        module = getattr(module, parent)
    return module, name


@contextmanager
def _shadowed(module: nn.Module, values: dict[str, Optional[torch.Tensor]]) -> Generator[None, None, None]:
    """For the forward's duration ``module.<path>`` reads ``values[path]`` (an instance attribute is
    found before ``nn.Module.__getattr__`` looks in ``_parameters``); the parameters stay registered."""
    owners = [(*_owner(module, path), value) for path, value in values.items()]
    for owner, name, value in owners:
        owner.__dict__[name] = value
    try:
        yield
    finally:
        for owner, name, _ in owners:
            owner.__dict__.pop(name, None)


class TensorParallelForward(nn.Module):
    """The forward of a LitGPT module under tensor parallelism, placed before the module's own
    class by :func:`tensor_parallel_module`: the parameters in ``tp_summed`` (paths such as
    ``lora_A``) have their gradients summed over the TP group; a row layer (``tp_row``) hands its
    partial sum (without its bias ``tp_bias``) to the TP regions and adds the bias after."""

    tp_regions: TPRegions
    tp_summed: tuple[str, ...]
    tp_row: bool
    tp_bias: Optional[str]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        regions = self.tp_regions
        values: dict[str, Optional[torch.Tensor]] = {}
        for path in self.tp_summed:
            param = getattr(*_owner(self, path))
            if param is not None:
                values[path] = regions.summed(param)
        bias = getattr(*_owner(self, self.tp_bias)) if self.tp_row and self.tp_bias else None
        if bias is not None:
            values[self.tp_bias] = None  # type: ignore[index]
        with _shadowed(self, values):
            out = super().forward(*args, **kwargs)
        if not self.tp_row:
            return out
        out = regions.leave(out)
        if bias is None:
            return out
        return out + (regions.summed(bias) if regions.sequence_parallel else bias)


_CLASSES: dict[type, type] = {}


def tensor_parallel_module(
    module: nn.Module, regions: TPRegions, *, summed: Sequence[str] = (), row: bool = False, bias: Optional[str] = None
) -> nn.Module:
    """``module`` as a new module of the class ``(TensorParallelForward, type(module))`` holding the
    same state (children, parameters, hooks): names, values and LitGPT's load-time key renames
    unchanged. The caller puts it where ``module`` was."""
    base = type(module)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"TensorParallel{base.__name__}", (TensorParallelForward, base),
                              {"__module__": __name__})  # fmt: skip
    parallel = _CLASSES[base].__new__(_CLASSES[base])
    parallel.__dict__.update(module.__dict__)
    parallel.tp_regions, parallel.tp_summed, parallel.tp_row, parallel.tp_bias = regions, tuple(summed), row, bias
    return parallel


def split_parameter(
    param: nn.Parameter, dim: int, rank: int, size: int, segments: Optional[Sequence[int]] = None
) -> None:
    """``param`` (the same object: optimizers and ties keep it) holds rank ``rank``'s part of its
    dense value along ``dim`` (per segment: [Note: segmented TP split]), marked for the gradient
    norm and the checkpoints. A meta tensor of a deferred init records the cut ([Note: deferred init])."""
    with torch.no_grad():
        param.data = local_part(param.data, dim, segments, rank, size)
    mark_tp_param(param, dim)
    if segments is not None and len(segments) > 1:
        setattr(param, TP_SEGMENTS_ATTR, tuple(segments))


def is_split(param: torch.Tensor) -> bool:
    return getattr(param, "_tp_shard_dim", None) is not None


def _linear_of(module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` of a LitGPT projection (itself, or LoRA's ``.linear``)."""
    return module.linear if isinstance(getattr(module, "linear", None), nn.Linear) else module


def _lora(module: nn.Module) -> bool:
    return getattr(module, "r", 0) > 0 and hasattr(module, "lora_A")


def _column(module: nn.Module, regions: TPRegions, rank: int, segments: Optional[Sequence[int]] = None) -> nn.Module:
    """Output features split: the weight's rows and bias, LoRA's ``lora_B`` rows; ``lora_A`` (the
    whole input to this rank's outputs) keeps its gradient summed over TP."""
    linear, size = _linear_of(module), regions.size
    split_parameter(linear.weight, 0, rank, size, segments)
    if linear.bias is not None:
        split_parameter(linear.bias, 0, rank, size, segments)
    linear.out_features //= size
    if not _lora(module):
        return module
    lora_segments = getattr(module, "qkv_shapes", None)  # LoRA's qkv: its enabled q/k/v rows only
    split_parameter(module.lora_B, 0, rank, size, lora_segments)
    if lora_segments is not None:
        module.qkv_shapes = [shape // size for shape in lora_segments]
        module.n_head //= size
        module.n_query_groups //= size
        module.__dict__.pop("_lora_ind", None)
        module._buffers.pop("_lora_ind", None)  # LoRA's cached index of the enabled rows: rebuilt for the local ones
    return tensor_parallel_module(module, regions, summed=("lora_A",))


def _row(module: nn.Module, regions: TPRegions, rank: int) -> nn.Module:
    """Input features split: the weight's columns, LoRA's ``lora_A`` columns (``lora_B`` multiplies a
    partial sum: summed over TP); the output summed over the TP ranks, the bias added once after."""
    linear, size = _linear_of(module), regions.size
    split_parameter(linear.weight, 1, rank, size)
    linear.in_features //= size
    summed: tuple[str, ...] = ()
    if _lora(module):
        split_parameter(module.lora_A, 1, rank, size)
        summed = ("lora_B",)
    bias = None if linear.bias is None else ("bias" if linear is module else "linear.bias")
    return tensor_parallel_module(module, regions, summed=summed, row=True, bias=bias)


def _on_shard(module: Optional[nn.Module], regions: TPRegions) -> Optional[nn.Module]:
    """A norm that runs on this rank's tokens (or heads): its parameters' gradients summed over TP."""
    if module is None or not any(True for _ in module.parameters(recurse=False)):
        return module
    names = tuple(name for name, param in module.named_parameters(recurse=False) if param is not None)
    return tensor_parallel_module(module, regions, summed=names)


def check_tensor_parallel(config: Any, model: nn.Module, tp: int) -> None:
    """What LitGPT's TP step needs of the model (``ValueError`` naming the fix)."""
    from litgpt.model import CausalSelfAttention, GptNeoxMLP, LLaMAMLP

    where = f"ZeroFabricStrategy(tensor_parallel_size={tp})"
    for name, value in (("n_head", config.n_head), ("n_query_groups", config.n_query_groups),
                        ("intermediate_size", config.intermediate_size)):  # fmt: skip
        if value % tp:
            raise ValueError(f"{where}: tp does not divide LitGPT's {name}({value}); pick tp from its divisors")
    if config.norm_qk and config.norm_qk_type != "default":
        raise ValueError(f"{where}: norm_qk_type={config.norm_qk_type!r} normalizes every head at once; use tp=1")
    for name, module in model.named_modules():
        if name.endswith(".mlp") and not isinstance(module, (GptNeoxMLP, LLaMAMLP)):
            raise ValueError(
                f"{where}: {name} is a {type(module).__name__}; LitGPT's TP step splits GptNeoxMLP, LLaMAMLP and"
                " GemmaMLP (LoRA's too); use tp=1"
            )
        if name.endswith(".attn") and not isinstance(module, CausalSelfAttention):
            raise ValueError(
                f"{where}: {name} is a {type(module).__name__}; LitGPT's TP step splits CausalSelfAttention"
            )


def parallelize_tensor(
    model: nn.Module, group: dist.ProcessGroup, counter: CommCounter, sequence_parallel: bool
) -> None:
    """Apply [Note: LitGPT under tensor parallelism] to ``model`` (a LitGPT ``GPT``) over ``group``."""
    if getattr(model, "tp_regions", None) is not None:
        raise ValueError("parallelize_litgpt: the model is already tensor-parallel; call it once per model")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    regions = TPRegions(group, counter, sequence_parallel)
    model.tp_regions = regions
    config = model.config
    local_config = dataclasses.replace(config, n_head=config.n_head // size,
                                       n_query_groups=config.n_query_groups // size)  # fmt: skip
    qkv_rows = tuple(
        size_ * config.head_size for size_ in (config.n_head, config.n_query_groups, config.n_query_groups)
    )
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.qkv = _column(attn.qkv, regions, rank, qkv_rows)
        attn.proj = _row(attn.proj, regions, rank)
        attn.config = local_config
        for name in ("norm_q", "norm_k"):  # per head: this rank's heads only
            if getattr(attn, name, None) is not None:
                setattr(attn, name, _on_shard(getattr(attn, name), regions))
        for name in ("fc", "fc_1", "fc_2"):
            if hasattr(mlp, name):
                setattr(mlp, name, _column(getattr(mlp, name), regions, rank))
        mlp.proj = _row(mlp.proj, regions, rank)
        attn.register_forward_pre_hook(regions.enter, with_kwargs=True)
        mlp.register_forward_pre_hook(regions.enter, with_kwargs=True)
        if sequence_parallel:
            for name in ("norm_1", "norm_2", "post_attention_norm", "post_mlp_norm"):
                setattr(block, name, _on_shard(getattr(block, name), regions))
    if sequence_parallel:
        model.transformer.ln_f = _on_shard(model.transformer.ln_f, regions)
    model.transformer.wte.register_forward_hook(regions.after_embedding)
    model.transformer.ln_f.register_forward_hook(regions.after_final_norm)
    model.register_forward_pre_hook(_refuse_generation, with_kwargs=True)
    for param in model.parameters():
        if not is_split(param):
            mark_tp_param(param, None)
    for module in model.modules():
        splits = {name: (param._tp_shard_dim, tuple(param.shape), getattr(param, TP_SEGMENTS_ATTR, None))
                  for name, param in module.named_parameters(recurse=False) if is_split(param)}  # fmt: skip
        if splits:
            module.register_load_state_dict_pre_hook(functools.partial(_cut_dense_values, splits, rank, size))


def _cut_dense_values(
    splits: dict[str, tuple[int, tuple[int, ...], Optional[tuple[int, ...]]]],
    rank: int,
    size: int,
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    *args: Any,
) -> None:
    """Load pre-hook ([Note: dense TP tensors in a full file] in ``checkpoint/full.py``): a dense
    value of a split parameter (``splits``: name -> dim, local shape, segments; a ddp checkpoint,
    LitGPT's base weights) becomes this rank's part; a value of the part's shape
    (``model.state_dict()`` under the same tp) loads as it is."""
    for name, (dim, shape, segments) in splits.items():
        value = state_dict.get(prefix + name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) and callable(getattr(value, "_load_tensor", None)):
            value = value._load_tensor()  # LitGPT / Fabric's lazily loaded tensor: read now
        if tuple(value.shape) != shape and value.shape[dim] == shape[dim] * size:
            state_dict[prefix + name] = local_part(value, dim, segments, rank, size)


def _refuse_generation(model: nn.Module, args: tuple, kwargs: dict) -> None:
    input_pos = args[1] if len(args) > 1 else kwargs.get("input_pos")
    if input_pos is not None:
        raise ValueError(
            f"tensor parallelism (tp={model.tp_regions.size}): LitGPT's GPT was called with input_pos (a KV-cache"
            " generation, such as finetune_lora's generate_example on rank 0), which needs every TP rank; generate"
            " after training with tp=1 (litgpt generate on the saved checkpoint), or set --eval.interval beyond the run"
        )
