"""Apply context parallelism to ``lightning_zero.models.Llama`` (after tensor parallelism, if any).

What changes, on a cp group of ``cp`` ranks (see [Note: context-parallel layout] in
``cp/layout.py``):

- each ``Attention`` gets a :class:`~lightning_zero.cp.ulysses.UlyssesExchange` as
  ``sequence_exchange``: its q/k/v leave the slice for a head shard and its output comes back
  ([Note: Ulysses attention]);
- ``Llama.context_parallel_size`` becomes ``cp``: the model reads its input as a ``T/cp`` slice
  of a ``T``-token sequence, so the rotary tables cover ``T`` positions (attention runs on the whole
  sequence, at global positions) and ``max_seq_len`` is checked against ``T``;
- ``Llama.loss_fn`` becomes the global token mean over the cp group ([Note: global token mean]),
  around whatever per-token loss it had (the dense one, or TP's vocab-parallel one).

Parameters are untouched (every cp rank holds the same weights, or the same TP slices), so
parameter names, shapes, values and checkpoints are those of the model without cp. Gradients
must then be averaged over ``dp x cp`` ranks: the engine's ZeRO group.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import CommCounter
from lightning_zero.cp.layout import RingLayout, attention_layout
from lightning_zero.cp.loss import context_parallel_loss
from lightning_zero.cp.ring_attention import RingAttention
from lightning_zero.cp.ulysses import UlyssesExchange


def parallelize_context(
    model: nn.Module,
    group: dist.ProcessGroup,
    *,
    counter: Optional[CommCounter] = None,
    tp: int = 1,
    attention: str = "auto",
) -> nn.Module:
    """Make ``model`` (a ``Llama``, tensor-parallel or not) context-parallel over ``group``;
    returns ``model``. A group of one rank leaves it unchanged.

    ``attention``: ``"ulysses"`` ([Note: Ulysses attention]), ``"ring"`` ([Note: ring attention]),
    or ``"auto"``: Ulysses where ``tp * cp`` divides the query heads, the ring where it does not
    (``cp.layout.attention_layout``).

    ``counter``: where the cp all-to-alls and the loss all-reduce count their bytes; default the
    model's ``tp_comm_counter`` (so tp and cp bytes land in one counter the strategy adopts), else
    a new :class:`CommCounter` kept there. ``tp``: the tensor-parallel size the model was split
    with (for the head check).
    """
    cp = dist.get_world_size(group)
    if cp == 1:
        return model
    if getattr(model, "context_parallel_size", 1) != 1:
        raise ValueError("parallelize_context: the model is already context-parallel; call it once per model")
    config = getattr(model, "config", None)
    layout = attention_layout(cp, tp, config, attention) if config is not None else None
    if counter is None:
        counter = getattr(model, "tp_comm_counter", None) or CommCounter()
    model.tp_comm_counter = counter  # the model-parallel counter the session adopts (runtime/setup.py)
    ring = isinstance(layout, RingLayout) or (layout is None and attention == "ring")
    exchange = RingAttention(group, counter) if ring else UlyssesExchange(group, counter)
    for block in model.layers:
        block.attention.sequence_exchange = exchange
    model.context_parallel_size = cp
    model.loss_fn = functools.partial(context_parallel_loss, token_loss=model.loss_fn, group=group, counter=counter)
    return model
