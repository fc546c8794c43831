"""The Fabric door's part of the layout: what a Fabric loop does differently under context or expert parallelism.

The layout itself (``ParallelDims``, the groups, the parallelize step) is the run's
(``runtime/run.py``, ``runtime/parallelize.py``); a Fabric loop holds whole batches and builds its
own model, so this module holds what that loop needs from the door: the construction-time check of
what is known before launch (:func:`check_before_launch`), the cut of a batch
(:func:`context_slice`) and the dp split of a litdata dataset (:func:`split_dataloader`), and the
strategy's methods over them (:class:`FabricLayout`).

[Note: context parallelism under Fabric] With ``cp=C`` a Fabric loop, which holds whole batches,
changes one line:

- ``fabric.setup(model)`` makes the model's decoder context-parallel over the cp group
  (``cp/parallelize.py``: Ulysses all-to-alls around attention, rotary at global positions, and
  ``loss_fn`` the mean over the cp group's tokens, [Note: global token mean] in ``cp/loss.py``),
  before anything is broadcast or sharded; a model that does not declare it can
  (``check_parallel_dims``: ``Llama`` does) is refused there, naming cp.
- the loop cuts each batch: ``inputs, targets = fabric.strategy.context_slice(inputs, targets)``
  ([Note: slicing a whole batch] in ``cp/batch.py``: labels shifted before the cut, so a slice's
  last label is the next slice's first token). ``fabric.setup_dataloaders`` already gives the cp
  ranks of one dp rank the same batches (the sampler's replicas are the dp ranks).
- ``model.loss_fn(logits, targets)`` is the unsliced loss on every cp rank; the engine averages
  gradients over the ``dp x cp`` ranks. Losses and weights equal Fabric ``ddp``'s without cp.

Why the loop cuts the batch, not the model's forward: a forward hook could cut the input ids, but
the logits would come back ``T/cp`` long beside labels ``T`` long, so the loop would cut its labels
anyway, or the door would have to gather the logits over cp (``B x T x vocab``, the largest
activation of all: what cp exists to avoid). One explicit cut, the same for every tensor of the
batch, is exact and shows in the loop. The model config and ``seq_len`` given to the constructor
are checked before any process starts; the model's own check runs at ``fabric.setup``, the
sequence length's at each cut (both on every rank, before any collective that could hang).

[Note: expert parallelism under Fabric] With ``ep=E`` the loop of a ``MoETransformer``
(``lightning_zero.models.moe``) changes nothing but the bias update's group:

- ``fabric.setup(model, optimizer)`` splits the experts of the whole model every rank built (the
  same seed on every rank, as under ddp): each keeps ``n_experts / E`` rows of every stacked expert
  tensor, in place, so an optimizer built over ``model.parameters()`` before ``setup`` steps them,
  and its MoE layers exchange tokens over the ep group (``models/moe/parallelize.parallelize_experts``,
  the call ``MoELM.configure_model`` makes under the Trainer; ``ep/dispatch.py``). The model's
  ``check_parallel_dims`` refuses an ``ep`` that does not divide the experts, naming the fix.
  A model that splits its own experts (no whole ``MoETransformer`` inside) is left as it is.
- the loss is ``model.loss_fn(logits, targets) + model.aux_loss()``, as under ddp: each rank's
  balance and z losses are over its own tokens, and the gradients are averaged as ddp's.
- with a selection-bias update (``bias_update_rate > 0``), ``model.update_router_bias(group)``
  after ``optimizer.step()``: ``group`` the strategy's ``mesh_groups.dp_cp`` (``None`` under ddp).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from typing_extensions import override

from lightning_zero.cp.layout import check_context_parallel, layout_notice

if TYPE_CHECKING:
    from lightning_zero.runtime.run import ZeroRun


def check_before_launch(cp: int, *, model_config: Optional[Any], seq_len: Optional[int]) -> None:
    """[Note: context parallelism under Fabric]: what is known of the model and the data is checked
    at construction, before any process starts (the model itself arrives after the launch); a
    layout that works but costs (ring attention, a kv repeat) is stated in a warning."""
    notice = layout_notice(check_context_parallel(cp, model_config=model_config, seq_len=seq_len))
    if notice is not None:
        warnings.warn(f"lightning_zero: {notice}", stacklevel=3)


def cp_rank(run: "ZeroRun", global_rank: int) -> int:
    """This rank's index in its cp group (0 without context parallelism)."""
    return 0 if run.dims is None else run.dims.group_rank("cp", global_rank)


def context_slice(run: "ZeroRun", global_rank: int, tensors: tuple[torch.Tensor, ...], dim: int) -> Any:
    """This rank's slice of each of ``tensors`` ([Note: slicing a whole batch] in ``cp/batch.py``):
    one tensor in, one out; several in, a tuple."""
    from lightning_zero.cp.batch import context_slices

    sliced = context_slices(tensors, run.config.layout.cp, cp_rank(run, global_rank), dim)
    return sliced[0] if len(sliced) == 1 else sliced


def split_dataloader(run: "ZeroRun", dataloader: Any, *, world_size: int, dp_rank: int, num_nodes: int) -> None:
    """[Note: litdata's ranks] in ``fabric/_litdata_compat.py``: a litdata ``StreamingDataset``
    splits its items over the dp ranks, not over every process (the cp ranks of one dp rank read
    the same batches, as Fabric's sampler gives them)."""
    from lightning_zero.fabric._litdata_compat import split_streaming_over_dp

    dims = run.dims
    if dims is not None and dims.dp != world_size:
        split_streaming_over_dp(dataloader, dp_size=dims.dp, dp_rank=dp_rank, num_nodes=num_nodes)


class FabricLayout:
    """``ZeroFabricStrategy``'s layout methods: the dp split of a dataloader, this rank's cp index
    and size, and the cut of a batch ([Note: context parallelism under Fabric])."""

    run: "ZeroRun"
    zero_config: Any
    world_size: int
    global_rank: int
    dp_rank: int
    num_nodes: int

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """[Note: litdata's ranks]: a litdata dataset reads the dp rank's items."""
        split_dataloader(self.run, dataloader, world_size=self.world_size, dp_rank=self.dp_rank,
                                num_nodes=self.num_nodes)  # fmt: skip
        return super().process_dataloader(dataloader)  # type: ignore[misc]

    @property
    def cp_rank(self) -> int:
        """This rank's index in its cp group (0 without context parallelism)."""
        return cp_rank(self.run, self.global_rank)

    @property
    def cp_size(self) -> int:
        """Ranks that hold slices of the same sequences (the ``cp`` knob)."""
        return self.zero_config.cp

    def context_slice(self, *tensors: torch.Tensor, dim: int = 1) -> Any:
        """This rank's slice of a whole batch under context parallelism ([Note: context parallelism
        under Fabric]): each tensor (input ids, labels already shifted by one, a loss mask: all
        ``T`` long along ``dim``) cut at ``[c T/cp, (c+1) T/cp)`` for cp rank ``c``, as views
        ([Note: slicing a whole batch] in ``cp/batch.py``). One tensor in, one out; several in, a
        tuple. Without cp (``cp=1``) the tensors come back unchanged, so one loop serves both.
        A ``T`` that ``cp`` does not divide raises ``ValueError`` naming the fix (on every rank,
        before the step's first collective)."""
        return context_slice(self.run, self.global_rank, tensors, dim)
