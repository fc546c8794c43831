"""One pipeline stage of a Llama: the blocks a stage holds, the embeddings on the first stage, the
final norm and head on the last ([Note: pipeline stages] in ``pp/layout.py``).

A stage holds the model's own modules (no copies), under the same names, so a stage's
``named_parameters()`` are the full model's names for the part it holds (``layers.5.attention.wq.weight``
stays ``layers.5...`` on whichever stage holds block 5): checkpoints keep dense coordinates and resume
on any split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.models.llama.model import Llama
from lightning_zero.tp.layers import gather_to_replicated_region, split_to_sequence_region


class LlamaStage(nn.Module):
    """Stage of a :class:`Llama` holding ``blocks`` (indices into ``model.layers``).

    ``forward`` takes token ids ``(B, T)`` on the first stage and hidden states ``(B, T, dim)``
    elsewhere; it returns hidden states, or logits ``(B, T, vocab)`` on the last stage.
    """

    def __init__(self, model: Llama, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        if model.config.tie_embeddings and first != last:
            raise ValueError(
                f"{model.config.name!r} ties its embedding to its head (tie_embeddings=True), and pipeline "
                "stages put them on different ranks: train it without pp, or untie the head"
            )
        self.config = model.config
        self.first, self.last = first, last
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(index): model.layers[index] for index in blocks})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        object.__setattr__(self, "_model", model)  # a plain reference (no submodule), for its tables
        self.context_parallel_size = model.context_parallel_size
        # [Note: sequence-parallel stages] under tp with sequence parallelism the residual stream
        # between blocks, so a stage's input and output, is this tp rank's T/tp slice: torch's
        # schedule sends it to the same tp rank of the next stage (the pp group joins equal tp ranks);
        # under cp it is this cp rank's T/cp slice (of which SP's T/(cp tp)), sent to the same cp rank.
        # Without sequence parallelism every tp rank holds the whole (B, T/cp, dim) residual stream, and
        # sending it whole would move tp copies of it over the pp link: each tp rank sends its 1/tp
        # slice of the sequence instead (the output cut by ``split_to_sequence_region``: no
        # communication, its gradient all-gathered back) and the next stage all-gathers the slices
        # over its tp group before its first block (``gather_to_replicated_region``, the gradient
        # sliced: it is the same on every tp rank). A boundary then moves B x T/cp x dim / tp bytes
        # per tp rank, one copy in all (Megatron's scatter-gather of pipeline tensors), as with
        # sequence parallelism (``pp/cost.boundary_bytes``), for one tp all-gather of B x T/cp x dim
        # per micro-batch and boundary each way (forward on the receiving stage, backward on the
        # sending one).
        wo = getattr(model.layers[blocks[0]].attention, "wo", None) if len(blocks) else None
        self.sequence_shards = getattr(wo, "tp_size", 1)  # (T/cp) / (the stage's input length)
        replicated = self.sequence_shards > 1 and not getattr(model, "tp_sequence_parallel", False)
        self.tp_boundary = (wo.group, getattr(model, "tp_comm_counter", None)) if replicated else None
        self.rope_shards = 1 if replicated else self.sequence_shards  # (T/cp) / (the blocks' input length)
        self.activation_checkpointing = model.activation_checkpointing

    # what the schedule's loss function multiplies each micro-batch's loss by (the pipelined step sets
    # it: 1 / accumulate_grad_batches); a stage with loss terms of its own scales them alike (models/moe)
    loss_scale = 1.0

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's tables as they are now: stage 3 materializes its meta tensors after the cut
        self.rope_cos, self.rope_sin = self._model.rope_cos, self._model.rope_sin
        return Llama.rope(self, seq_len)  # type: ignore[arg-type]  # reads config and the two tables only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.first else x  # (B, T, dim)
        if self.tp_boundary is not None and not self.first:  # [Note: sequence-parallel stages]
            h = gather_to_replicated_region(h, *self.tp_boundary)
        cos, sin = self.rope(h.size(1) * self.context_parallel_size * self.rope_shards)
        for layer in self.layers.values():
            if self.activation_checkpointing == "full" and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if self.last:
            return self.output(self.norm(h))  # (B, T, vocab)
        return split_to_sequence_region(h, *self.tp_boundary) if self.tp_boundary is not None else h


def llama_stages(model: Llama, layout: Any, pp_rank: int) -> dict[int, LlamaStage]:
    """The stages ``pp_rank`` runs under ``layout`` (a ``pp.layout.PipelineLayout``), by stage index."""
    if layout.n_layers != model.config.n_layers:
        raise ValueError(f"the pipeline layout splits {layout.n_layers} blocks, the model has {model.config.n_layers}")
    last = layout.num_stages - 1
    stage_class = getattr(model, "pipeline_stage_class", LlamaStage)  # a MoETransformer's: models/moe/pipeline.py
    return {
        stage: stage_class(model, layout.stage_blocks(stage), first=stage == 0, last=stage == last)
        for stage in layout.rank_stages(pp_rank)
    }


class HeldElsewhere(nn.Module):
    """What stands in a pipelined :class:`Llama` for a block another pp rank holds (no parameters,
    so this rank's ``named_parameters()`` are its stages' own, under the full model's names)."""

    def __init__(self, pp_rank: int) -> None:
        super().__init__()
        self.pp_rank = pp_rank

    def extra_repr(self) -> str:
        return f"held by pp rank {self.pp_rank}"


def cut_llama(model: Llama, layout: Any, pp_rank: int) -> dict[int, LlamaStage]:
    """The registry's pp step ([Note: the parallelize registry] in ``runtime/parallelize.py``): keep
    only what ``pp_rank``'s stages hold in ``model`` (the others' blocks become
    :class:`HeldElsewhere`, the embeddings, final norm and head ``None`` where no stage of this
    rank holds them) and return the stages, by index, also kept as ``model.pipeline_stages``.
    Parameter names stay the full model's (dense coordinates: a checkpoint resumes on any split)."""
    stages = llama_stages(model, layout, pp_rank)
    held = {block for stage in stages.values() for block in map(int, stage.layers)}
    for index in range(len(model.layers)):
        if index not in held:
            model.layers[index] = HeldElsewhere(next(r for r in range(layout.pp) if _holds(layout, r, index)))
    if not any(stage.first for stage in stages.values()):
        model.tok_embeddings = None
    if not any(stage.last for stage in stages.values()):
        model.norm = model.output = None
    model.pipeline_stages = stages  # a plain dict: the stages' modules stay registered once, in model
    return stages


def _holds(layout: Any, pp_rank: int, block: int) -> bool:
    return any(block in layout.stage_blocks(stage) for stage in layout.rank_stages(pp_rank))
