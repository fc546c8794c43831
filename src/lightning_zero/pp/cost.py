"""What a pipeline layout costs each pp rank, by rule: the bytes its point-to-point sends and
receives move per step and which parts of the model each stage holds (the activations in flight
and the bubble are ``pp/simulate.py``'s, played out in torch's order). The planner
(``planner/pipeline.py``) calls these; the measurement (``pp/measure.py``, tests/test_pipeline.py)
is held equal to them.

[Note: pipeline bytes] Between two consecutive stages on different pp ranks, each micro-batch
crosses once forward (the stage's output, ``B x T x dim`` hidden states in the activation dtype)
and once backward (the gradient of that output, same shape and dtype). Stages of one rank that
touch (ZBV's V turns at the last rank: stages ``pp-1`` and ``pp``) pass them in memory (torch's
``set_local_fwd_input``): no bytes. Per step a rank sends and receives ``m`` of each boundary it
sits on. Under tensor parallelism every tp rank of a stage sends its ``T/tp`` slice of the
sequence (``B x T/(cp tp) x dim``), with or without sequence parallelism: without it the next stage
all-gathers the slices over its tp group ([Note: sequence-parallel stages] in
``models/llama/pipeline.py``; that all-gather is tp traffic, not counted here).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.pp.layout import PipelineLayout


@dataclass(frozen=True)
class P2PBytes:
    """Bytes one pp rank sends and receives point to point in one step."""

    sent: int
    received: int


def boundary_bytes(
    *,
    micro_batch: int,
    seq_len: int,
    dim: int,
    act_bytes: int,
    tp: int = 1,
    cp: int = 1,
) -> int:
    """Bytes of one micro-batch's hidden states at a stage boundary on one rank ([Note: pipeline bytes])."""
    tokens = micro_batch * seq_len // cp
    return tokens * dim * act_bytes // tp


def p2p_bytes_per_step(layout: PipelineLayout, pp_rank: int, boundary: int) -> P2PBytes:
    """[Note: pipeline bytes]: what ``pp_rank`` sends and receives in one step of ``layout``, for
    ``boundary`` bytes (:func:`boundary_bytes`) per micro-batch and boundary crossed."""
    sent = received = 0
    last = layout.num_stages - 1
    for stage in layout.rank_stages(pp_rank):
        if stage < last and layout.stage_rank(stage + 1) != pp_rank:
            sent += boundary  # the activation forward
            received += boundary  # its gradient back
        if stage > 0 and layout.stage_rank(stage - 1) != pp_rank:
            received += boundary
            sent += boundary
    return P2PBytes(sent * layout.microbatches, received * layout.microbatches)


def stage_holds(layout: PipelineLayout, stage: int) -> tuple[range, bool, bool]:
    """``(blocks, embeddings, head)``: the decoder blocks stage ``stage`` holds, and whether it
    also holds the embeddings (the first stage) and the final norm and head (the last)."""
    return layout.stage_blocks(stage), stage == 0, stage == layout.num_stages - 1
