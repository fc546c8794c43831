"""Pipeline parallelism at the doors: the split checked before launch, and a LightningModule's own
step run through torch's schedule over this rank's stages.

[Note: the pipelined step] Under ``pp > 1`` every rank holds only its stages of the model (the
registry's pp step, ``runtime/parallelize.py``, cut it in ``configure_model``), so no rank can run
the module's ``forward``. The module's ``training_step`` still runs unchanged, on every rank: while
it runs, its model is a :class:`PipelinedModel`, whose ``forward(inputs)`` only records the
inputs and whose ``loss_fn(pending, targets)`` runs one step of torch's schedule over the batch's
micro-batches (``pp_microbatches`` equal slices of dim 0) and returns the batch's mean loss,
broadcast from the rank holding the last stage over the pp group. So the step logs and returns
what ddp's would (the mean of equal micro-batches' means is the batch mean), on every rank. In
training the schedule's backwards run inside the engine's ``gradients_by_hand`` ([Note: gradients
handed in] in ``zero/engine.py``), which keeps their gradients aside; the strategy's ``backward``
(the loss Lightning backwards is a value only) hands them in, where ddp's backward would run:
after Lightning's ``zero_grad`` (which comes after the training step), under its ``no_sync`` on
accumulating batches, so ZeRO (stages 1-2) reduces once per optimizer step over the stage's dp
group. At stage 3 the stage's parameters are gathered once at the schedule's start and kept for
every micro-batch ([Note: stage 3 under a pipeline] in ``zero/stage3/runtime.py``). Each micro-batch's loss is divided by ``accumulate_grad_batches`` as Lightning divides
ddp's, and torch divides the gradients by the micro-batch count (``scale_grads``). Gradient clipping needs nothing more: the
engine's norm group is every rank (each holds a distinct shard of a distinct stage), so the
global norm covers every stage and shard (under tp, each replicated norm gain weighted ``1/tp``:
[Note: TP grad norm]). Under tp a stage's input and output are this tp rank's sequence shard (with or
without sequence parallelism: [Note: sequence-parallel stages] in ``models/llama/pipeline.py``), and the
last stage's loss is the model's own (the vocab-parallel cross entropy). Under cp likewise: each
rank's batch is its cp slice of every sequence (the data module's), a stage sends its ``T/cp``
slice to the same cp rank of the next stage, attention runs over the stage's cp group, and the
last stage's loss is the global token mean over its cp group ([Note: global token mean]): every
rank returns ddp's loss, and the engine averages gradients over the stage's ``dp x cp`` ranks. A training batch of another shape (the last, smaller
one) gets its own schedule (torch infers the stages' shapes once per schedule). Evaluation
(``torch.is_grad_enabled()`` false) runs the whole batch forward through the stages in order, each
activation sent point to point to the next stage's rank (torch's ``schedule.eval`` of ``zbv``
fails: its V's local hand-over asks for a backward), one micro-batch's rows at a time (the whole
batch's logits would not fit where a training micro-batch's do), the loss the rows' mean cross
entropy, as ddp's. Under the Trainer's ``predict`` the model's
forward returns the logits themselves, the same forward's output broadcast from the last stage.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from lightning_zero.comm.mesh import MeshGroups, ParallelDims
    from lightning_zero.config import ZeroConfig
    from lightning_zero.pp.layout import PipelineLayout
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.waits import FailureChannel


def pipeline_layout(config: "ZeroConfig", dims: "ParallelDims", module: Any) -> Optional["PipelineLayout"]:
    """Before any process group starts: the checked split of ``module``'s decoder (``None`` when
    ``pp == 1``); raises ``ValueError`` naming the fix for a layout the doors cannot run yet or a
    split that cannot work (``pp/layout.py``)."""
    if dims.pp == 1:
        return None
    from lightning_zero.pp.layout import PipelineLayout

    asked = f"ZeroStrategy(pp={dims.pp})"
    from lightning_zero.models.llama.model import Llama
    from lightning_zero.models.moe.model import MoETransformer

    model_config = getattr(module, "config", None)
    # a LightningModule names its model's class (LlamaLM, MoELM); under Fabric the model itself arrives
    model_class = type(module) if isinstance(module, Llama) else getattr(module, "model_class", None)
    moe = isinstance(model_class, type) and issubclass(model_class, MoETransformer)
    # ep runs inside each stage's ranks for a MoE model ([Note: MoE pipeline stages] in models/moe/pipeline.py),
    # tp inside a Llama's and a MoE's stages (with or without sequence parallelism), cp inside a Llama's
    # ([Note: sequence-parallel stages] in models/llama/pipeline.py)
    inside = ("tp", "ep") if moe else ("tp", "cp")
    others = [f"{name}={getattr(dims, name)}" for name in ("tp", "cp", "ep") if getattr(dims, name) > 1]
    others = [other for other in others if other.split("=")[0] not in inside]
    if others:
        kind = "a MoETransformer's (MoELM's)" if moe else "a Llama's (LlamaLM's)"
        raise ValueError(
            f"{asked} with {', '.join(others)}: {kind} pipeline stages run ZeRO data parallelism and"
            f" {' and '.join(inside)} inside them only so far (docs/pipeline.md); use"
            f" {' and '.join(o.split('=')[0] + '=1' for o in others)} with pp > 1, or pp=1"
        )
    if config.hierarchical_reduce:  # hybrid sharding (shard_size) runs: the norm's replica spans the stages
        raise ValueError(
            f"{asked} with hierarchical_reduce=True: two-hop gradient reduction inside a pipeline stage is not run"
            " yet; use hierarchical_reduce=False with pp > 1 (shard_size runs; docs/pipeline.md)"
        )
    if model_class is None or not hasattr(model_config, "n_layers"):
        raise ValueError(
            f"{asked}: {type(module).__name__} is no model the runtime cuts into stages; pipeline stages run"
            " lightning_zero.models.Llama and MoETransformer (LlamaLM, MoELM under the Trainer) so far"
            " (docs/pipeline.md); use pp=1"
        )
    if model_class is not Llama and not moe:
        raise ValueError(
            f"{asked}: {type(module).__name__} trains a {model_class.__name__}, whose blocks are not cut into"
            " pipeline stages yet (only Llama's and MoETransformer's are); use pp=1 (docs/pipeline.md)"
        )
    if getattr(model_config, "tie_embeddings", False):
        raise ValueError(
            f"{asked}: {model_config.name!r} ties its embedding to its head (tie_embeddings=True), and pipeline stages"
            " put them on different ranks: train it with pp=1, or untie the head"
        )
    local = 2 if config.pp_schedule == "zbv" else config.pp_virtual_stages
    return PipelineLayout(
        pp=dims.pp,
        schedule=config.pp_schedule,
        n_layers=model_config.n_layers,
        microbatches=config.pp_microbatches or dims.pp * local,
        virtual_stages=config.pp_virtual_stages,
        pp_layers=tuple(config.pp_layers) if config.pp_layers is not None else None,
    )


def refuse_loss_scaling(pp: int, precision: Any, door: str) -> None:
    """Before any process group: ``precision="16-mixed"`` (a plugin with a gradient scaler) is refused
    under ``pp > 1``. The door scales the loss it backwards (``scaler.scale(loss)``) and unscales the
    gradients before the step, but under a pipeline the schedule's backwards already ran inside the
    training step on the unscaled micro-batch losses ([Note: the pipelined step]): the unscale would
    divide every gradient by the scale."""
    if pp > 1 and getattr(precision, "scaler", None) is not None:
        raise ValueError(
            f"{door}(pp={pp}) with precision='16-mixed': the pipeline's backwards run inside the training step,"
            " before the loss scaling 16-mixed needs; use precision='bf16-mixed' (or '32-true') with pp > 1"
        )


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what logits may come in


class _Pending:
    """The inputs :meth:`PipelinedModel.forward` was given, waiting for their targets."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs


class PipelinedModel(nn.Module):
    """What a LightningModule's step sees as its model under ``pp > 1`` ([Note: the pipelined step])."""

    def __init__(self, run: "PipelineRun") -> None:
        super().__init__()
        self.run = run

    def forward(self, inputs: torch.Tensor) -> Any:
        if self.run.predicting:  # predict uses the output itself: the logits, on every rank
            return self.run.logits(inputs)
        return _Pending(inputs)

    def loss_fn(self, pending: _Pending, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if not isinstance(pending, _Pending) or reduction != "mean":
            raise RuntimeError(
                "lightning_zero: under pp > 1 the step's model is a pipeline: compute the loss as"
                " model.loss_fn(model(inputs), targets) (the mean), as LlamaLM does (docs/pipeline.md)"
            )
        return self.run.loss(pending.inputs, targets)

    def aux_loss(self) -> torch.Tensor:
        """A MoE's weighted auxiliary losses of the last training step, what ``MoETransformer.aux_loss``
        returns after a forward: the mean over the step's micro-batches of every stage's terms
        ([Note: MoE pipeline stages] in ``models/moe/pipeline.py``), on every rank of the pp group."""
        if self.run.aux is None:
            raise RuntimeError(
                "lightning_zero: under pp > 1 the auxiliary losses are those of a training step's schedule:"
                " call model.aux_loss() after model.loss_fn(model(inputs), targets), with an aux_loss_coef or"
                " z_loss_coef != 0"
            )
        return self.run.aux


class PipelineRun:
    """This rank's schedules over its stages, for the doors ([Note: the pipelined step]).

    Args:
        layout: the checked split (:func:`pipeline_layout`).
        groups: the layout's groups (``groups.pp``: this rank's pipeline group).
        device: where the stages run.
        failure: the run's failure channel, through which a transfer that failed names the rank
            that is gone ([Note: a pipeline neighbour gone]).
    """

    def __init__(
        self,
        layout: "PipelineLayout",
        groups: "MeshGroups",
        device: torch.device,
        failure: Optional["FailureChannel"] = None,
    ) -> None:
        self.layout, self.groups, self.device, self.failure = layout, groups, device, failure
        self.pp_rank = groups.rank_in("pp")
        self.engine: Optional["ZeroEngine"] = None
        self.decoder: Optional[nn.Module] = None
        self.grad_divisor = 1  # Lightning's accumulate_grad_batches, set per step by the door
        self.predicting = False  # the Trainer's predict: the model's output is wanted, not a loss
        self._schedules: dict[tuple, Any] = {}
        self._losses: list[torch.Tensor] = []
        self._held: Optional[dict[nn.Parameter, torch.Tensor]] = None  # a training step's gradients
        self.aux: Optional[torch.Tensor] = None  # a MoE's auxiliary losses of the last training step
        self.held_grad_bytes = 0  # most bytes of gradients a schedule kept aside so far (docs/pipeline.md)

    def attach(self, module: nn.Module, engine: Optional["ZeroEngine"]) -> None:
        """``module``'s cut decoder (the one with ``pipeline_stages``) and the engine over its stages."""
        from lightning_zero.runtime.parallelize import find_decoders

        cut = [decoder for decoder, _ in find_decoders(module) if getattr(decoder, "pipeline_stages", None)]
        if len(cut) != 1:
            raise RuntimeError(
                f"lightning_zero: pp={self.layout.pp} but {type(module).__name__} holds {len(cut)} decoders cut into"
                " stages; its configure_model must apply the strategy's plan (receive_parallel_plan), as LlamaLM does"
            )
        self.decoder, self.engine = cut[0], engine

    @contextmanager
    def stepping(self, module: nn.Module, accumulate: int = 1) -> Iterator[None]:
        """While ``module``'s step runs, its cut decoder is a :class:`PipelinedModel`; each
        micro-batch's training loss is divided by ``accumulate`` (Lightning's
        ``accumulate_grad_batches``, as it divides ddp's loss)."""
        owner, attribute = next(
            (parent, name)
            for parent in module.modules()
            for name, child in parent._modules.items()
            if child is self.decoder
        )
        self.grad_divisor = accumulate
        self.predicting = bool(getattr(getattr(module, "_trainer", None), "predicting", False))
        owner._modules[attribute] = PipelinedModel(self)
        try:
            yield
        finally:
            owner._modules[attribute] = self.decoder

    def hand_in_grads(self) -> None:
        """Where Lightning's backward would run (after its ``zero_grad``): the gradients of the last
        training step's schedule reach the engine ([Note: gradients handed in])."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("lightning_zero: a pipelined backward without a training step before it")
        assert self.engine is not None
        self.engine.hand_in_grads(held)

    def _schedule(self, inputs: torch.Tensor) -> Any:
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._schedules:
            from lightning_zero.pp.schedule import build_schedule

            assert self.decoder is not None
            self._schedules[key] = build_schedule(self.layout, self.decoder.pipeline_stages, self.groups.pp,
                                                  self.device, self._loss_of_microbatch)  # fmt: skip
        return self._schedules[key]

    def _loss_of_microbatch(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.decoder is not None
        loss = self.decoder.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss / self.grad_divisor

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step of the schedule over ``inputs`` (training when grad is enabled, else forward
        only); the batch's mean loss on every rank of the pp group."""
        from torch.profiler import record_function

        from lightning_zero.pp.schedule import holds_first_stage, holds_last_stage

        layout, m = self.layout, self.layout.microbatches
        if not torch.is_grad_enabled():
            return self._evaluate(inputs, targets)
        if inputs.size(0) % m != 0:
            raise ValueError(
                f"ZeroStrategy(pp_microbatches={m}): a batch of {inputs.size(0)} samples does not split into {m} equal"
                f" micro-batches; use a batch size that is a multiple of {m}, or set pp_microbatches to a divisor of"
                f" {inputs.size(0)}"
            )
        schedule = self._schedule(inputs)
        args = (inputs,) if holds_first_stage(layout, self.pp_rank) else ()
        last = holds_last_stage(layout, self.pp_rank)
        kwargs = {"target": targets} if last else {}
        self._losses = []
        assert self.decoder is not None and self.engine is not None
        for stage in self.decoder.pipeline_stages.values():  # a stage's own loss terms, scaled as the loss
            stage.loss_scale = 1.0 / self.grad_divisor
        with record_function("lightning_zero::pp_schedule_step"), self.engine.gradients_by_hand() as held:
            try:
                with self._naming_lost_peers("the training schedule's"):
                    schedule.step(*args, **kwargs)
            except RuntimeError as error:
                # torch's stage wraps a forward's or backward's own exception ("[Stage 1] failed to run
                # forward"): raise the model's own, which the failure path posts for the other ranks
                cause = error.__cause__
                if cause is not None and "failed to run" in str(error):
                    raise cause from None
                raise
        self._held = held  # handed in by hand_in_grads, where Lightning's backward would run
        held_bytes = sum(grad.numel() * grad.element_size() for grad in held.values())
        self.held_grad_bytes = max(self.held_grad_bytes, held_bytes)
        # the last m: torch's first step of a schedule also calls the loss on uninitialized outputs (its shapes)
        loss = torch.stack(self._losses[-m:]).mean() if last else torch.zeros((), device=self.device)
        step_done = getattr(self.decoder, "pipeline_step_done", None)  # a MoE's routing of the step
        self.aux = step_done(m) if step_done is not None else None
        if self.aux is None:
            return self._share(loss)
        # every stage's auxiliary losses summed over the pp ranks, with the loss (0 off the last stage)
        both = torch.stack([loss.float(), self.aux.float()])
        with record_function("lightning_zero::pp_loss_all_reduce"):
            dist.all_reduce(both, group=self.groups.pp)
        self.aux = both[1]
        return both[0].to(loss.dtype)

    def _evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, one micro-batch at a time (a batch of the training's size holds
        ``pp_microbatches`` of them: its whole logits at once would not fit where the training's
        do): the batch's loss, each slice's mean weighted by its rows (the batch's mean when every row
        counts the same tokens, as the data module's windows do), on every rank of the pp group."""
        assert self.decoder is not None
        size = -(-inputs.size(0) // self.layout.microbatches)  # rows per slice, the last may hold fewer
        loss = torch.zeros((), device=self.device)
        for rows, row_targets in zip(inputs.split(size), targets.split(size)):
            hidden = self._forward_stages(rows)
            if hidden is not None:
                loss = loss + self.decoder.loss_fn(hidden, row_targets).float() * (rows.size(0) / inputs.size(0))
        return self._share(loss)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Forward only: the model's output (``(B, T, vocab)`` logits) on every rank of the pp group,
        what ``predict`` returns ([Note: the pipelined step])."""
        from torch.profiler import record_function

        hidden = self._forward_stages(inputs)
        source = self.groups.dims.pp_ranks(self.groups.rank)[self.layout.stage_rank(self.layout.num_stages - 1)]
        meta = torch.zeros(4, dtype=torch.int64, device=self.device)  # the logits' dtype and width
        if hidden is not None:
            meta[0], meta[1] = _DTYPES.index(hidden.dtype), hidden.size(-1)
        with record_function("lightning_zero::pp_logits_broadcast"):
            dist.broadcast(meta, src=source, group=self.groups.pp)
            if hidden is None:
                shape = (*inputs.shape, int(meta[1]))
                hidden = torch.empty(shape, dtype=_DTYPES[int(meta[0])], device=self.device)
            hidden = hidden.contiguous()
            dist.broadcast(hidden, src=source, group=self.groups.pp)
        return hidden

    def _forward_stages(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole batch through the stages in order, each activation sent to the next stage's
        rank (torch's ``eval`` of ``zbv`` fails, and a forward needs no micro-batches); the last
        stage's output on the rank holding it, ``None`` elsewhere."""
        from torch.profiler import record_function

        assert self.decoder is not None
        layout, stages = self.layout, self.decoder.pipeline_stages
        peers = self.groups.dims.pp_ranks(self.groups.rank)
        hidden: Any = inputs
        for index in range(layout.num_stages):
            owner = layout.stage_rank(index)
            if owner != self.pp_rank:
                continue
            stage = stages[index]
            if index > 0 and layout.stage_rank(index - 1) != owner:
                dtype = next(stage.parameters()).dtype
                batch, seq = inputs.shape
                shape = (batch, seq // stage.sequence_shards, stage.config.dim)  # this rank's sequence shard
                hidden = torch.empty(shape, dtype=dtype, device=self.device)
                with record_function("lightning_zero::pp_eval_recv"), self._naming_lost_peers("a forward's"):
                    dist.recv(hidden, src=peers[layout.stage_rank(index - 1)], group=self.groups.pp)
            hidden = stage(hidden)
            if index < layout.num_stages - 1 and layout.stage_rank(index + 1) != owner:
                with record_function("lightning_zero::pp_eval_send"), self._naming_lost_peers("a forward's"):
                    dist.send(hidden.contiguous(), dst=peers[layout.stage_rank(index + 1)], group=self.groups.pp)
        return hidden if layout.stage_rank(layout.num_stages - 1) == self.pp_rank else None

    def _neighbours(self) -> list[int]:
        """The pp ranks this rank's stages send to and receive from (the stages next to its own)."""
        layout = self.layout
        near = {layout.stage_rank(stage + step) for stage in layout.rank_stages(self.pp_rank) for step in (-1, 1)
                if 0 <= stage + step < layout.num_stages}  # fmt: skip
        return sorted(near - {self.pp_rank})

    @contextmanager
    def _naming_lost_peers(self, transfer: str) -> Iterator[None]:
        """[Note: a pipeline neighbour gone] A point-to-point transfer fails at once when its peer's
        process ends (gloo: the socket closes): "Connection reset by peer", which names no rank. A
        peer that raised posted its error before it ended ([Note: failure channel] in
        ``zero/waits.py``): look for it (at most ``MESSAGE_AFTER_ERROR_S``) and raise it. A peer that
        posted nothing was killed (SIGKILL, the OOM killer, a crashed node): when this rank's stages
        have one neighbouring pp rank, that rank is the one gone, and its line is posted in its name
        (``FailureChannel.post_for``) so every rank's error names it; with two neighbours (a middle
        stage of pp > 2) the error names both as candidates."""
        from lightning_zero.runtime.failure import is_collective_error
        from lightning_zero.zero.waits import PeerFailedError

        try:
            yield
        except RuntimeError as error:
            channel = self.failure
            own = error.__cause__ is not None and "failed to run" in str(error)  # a stage's own exception
            if channel is None or own or isinstance(error, PeerFailedError) or not is_collective_error(error):
                raise
            posted = channel.peer_error() or channel.await_peer_error()
            if posted is not None:
                raise posted from error
            peers = self.groups.dims.pp_ranks(self.groups.rank)
            gone = [(peers[rank], rank) for rank in self._neighbours()]
            names = " or ".join(f"global rank {g} (pp rank {r}, stages {list(self.layout.rank_stages(r))})"
                                for g, r in gone)  # fmt: skip
            what = (
                f"{names} left the pipeline without a word (killed, or its process crashed): {transfer} transfer"
                f" between it and global rank {self.groups.rank} failed: {error}"
            )
            if len(gone) != 1:
                raise RuntimeError(f"lightning_zero: {what}") from error
            channel.post_for(gone[0][0], what)
            raise channel.peer_error() or RuntimeError(f"lightning_zero: {what}") from error

    def _share(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every rank of the pp group."""
        from torch.profiler import record_function

        layout = self.layout
        source = self.groups.dims.pp_ranks(self.groups.rank)[layout.stage_rank(layout.num_stages - 1)]
        with record_function("lightning_zero::pp_loss_broadcast"):
            dist.broadcast(loss, src=source, group=self.groups.pp)
        return loss
