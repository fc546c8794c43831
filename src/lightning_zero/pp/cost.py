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

[Note: receive buffers] torch's ``PipelineStage`` receives into buffers it allocates once, one per
micro-batch, and keeps from the first step on (``_setup_forward_recv_info``,
``_create_grad_recv_info`` in ``torch/distributed/pipelining/stage.py``): an activation buffer for
every stage but the first, a gradient buffer for every stage but the last, each one boundary
(:func:`boundary_bytes`). ZBV's hand-over inside a rank (stages ``pp-1`` and ``pp``) swaps them for
the tensors handed over (``set_local_fwd_input``: the previous stage's output, detached;
``set_local_bwd_input``: the next stage's input gradient), the same bytes, kept as long. Under the
split backward (``SPLIT_BACKWARD``) ``stage_backward_input`` sets each input buffer's ``.grad``
(``inp.grad = dinput``), held until the next step's ``clear_runtime_states``: one more boundary per
micro-batch for every stage but the first, except the stage after a hand-over, whose input
gradients are the previous stage's gradient buffers. A rank holds ``m`` of each for each of its
stages, between steps too (:func:`recv_buffer_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.pp.layout import SPLIT_BACKWARD, PipelineLayout


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


@dataclass(frozen=True)
class RecvBuffers:
    """Bytes of torch's receive buffers one pp rank keeps ([Note: receive buffers])."""

    activations: int
    gradients: int
    input_grads: int  # the activation buffers' ``.grad`` under the split backward

    @property
    def total(self) -> int:
        return self.activations + self.gradients + self.input_grads


def recv_buffer_bytes(layout: PipelineLayout, pp_rank: int, boundary: int) -> RecvBuffers:
    """[Note: receive buffers]: what ``pp_rank``'s stages keep for ``boundary`` bytes per micro-batch."""
    stages, last = layout.rank_stages(pp_rank), layout.num_stages - 1
    per_stage = layout.microbatches * boundary
    receiving = sum(1 for stage in stages if stage > 0)
    sending = sum(1 for stage in stages if stage < last)
    handed = sum(1 for stage in stages if stage > 0 and layout.stage_rank(stage - 1) == pp_rank)
    input_grads = receiving - handed if layout.schedule in SPLIT_BACKWARD else 0
    return RecvBuffers(receiving * per_stage, sending * per_stage, input_grads * per_stage)


def stage_holds(layout: PipelineLayout, stage: int) -> tuple[range, bool, bool]:
    """``(blocks, embeddings, head)``: the decoder blocks stage ``stage`` holds, and whether it
    also holds the embeddings (the first stage) and the final norm and head (the last)."""
    return layout.stage_blocks(stage), stage == 0, stage == layout.num_stages - 1
