"""``LlamaLM``: the LightningModule around :class:`~lightning_zero.models.llama.model.Llama`
(AdamW with warmup + cosine, validation loss and perplexity, activation checkpointing, pretrained
init through ``init_from``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from torch import nn
from torchmetrics.aggregation import MeanMetric

from lightning_zero.models.checkpointing import checkpointing_mode
from lightning_zero.models.llama.config import LlamaConfig, resolve_config
from lightning_zero.models.llama.model import Llama, build_llama, check_llama_layout


@dataclass
class WarmupCosine:
    """LR multiplier per optimizer step: linear warmup to 1 over ``warmup_steps``, then cosine
    decay to ``min_lr_ratio`` at ``max_steps``, flat after. A plain object, so ``LambdaLR``
    saves and restores it in checkpoints."""

    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PerplexityFromLoss(MeanMetric):
    """``exp`` of the (token-weighted) mean cross entropy, over all ranks."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T+1]`` token ids -> inputs ``[:, :-1]`` and targets ``[:, 1:]``."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.size(1) < 2 or batch.is_floating_point():
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(
            f"LlamaLM expects an integer token batch of shape [B, T+1] with T >= 1, got {shape}; "
            "use lightning_zero.data.TokenDataModule or yield such tensors"
        )
    return batch[:, :-1], batch[:, 1:]


class LlamaLM(L.LightningModule):
    """Next-token language modelling on a :class:`Llama`.

    Args:
        config: a preset name (``tiny``, ``7b``, ``13b``, ``70b``), a ``LlamaConfig``, or a mapping
            (preset ``name`` plus overrides, or every field); ``None``: ``tiny``, or with
            ``init_from`` the shape in its ``config.json``.
        lr: peak learning rate of AdamW, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW decoupled decay on matrices and embeddings (never on norm gains).
        betas: AdamW (beta1, beta2).
        warmup_steps: optimizer steps of linear warmup.
        max_steps: optimizer step where the cosine decay reaches ``min_lr_ratio * lr``; ``None``
            takes the trainer's estimate of total steps.
        min_lr_ratio: final learning rate as a fraction of ``lr``, in [0, 1].
        activation_checkpointing: ``False`` (keep every activation), ``"selective"`` (recompute
            attention's core in backward: rotary, GQA repeat, SDPA) or ``"full"`` / ``True``
            (recompute each transformer block); see [Note: checkpointing modes] in
            ``lightning_zero/models/checkpointing.py``.
        init_from: a Hugging Face Llama directory (``config.json`` + safetensors/``.bin``) to
            start from instead of random init. The shape comes from its ``config.json``; a
            ``config`` that sets a disagreeing shape field raises ``ValueError`` (``max_seq_len``
            may differ). Config, file headers, names and shapes are checked here, before
            anything trains; the tensors are read when the model is built, each rank reading
            only what it keeps, one unit at a time (see docs/pretrained.md).

    The model is built in ``configure_model`` (so a strategy can build it on the meta device or
    sharded) and parallelized there by the plan the strategy handed over
    (:meth:`receive_parallel_plan`, [Note: the parallelize registry]): the family's step
    (``models/llama/parallelize.apply_layout``) applies tensor parallelism
    (:func:`lightning_zero.models.llama.parallelize_llama`, sequence-parallel under
    ``ZeroStrategy(sequence_parallel=True)``), then context parallelism (``ZeroStrategy(cp=C)``,
    :func:`lightning_zero.cp.parallelize.parallelize_context`: each batch is then this rank's slice
    of every sequence, which ``TokenDataModule`` hands out), see docs/context_parallel.md.
    """

    model_class: type = Llama  # a model family built on Llama's decoder sets its own (``MoELM``)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> "LlamaLM":  # type: ignore[override]
        """Lightning's ``load_from_checkpoint`` for single-file checkpoints; a sharded
        lightning_zero checkpoint directory raises an error naming ``lightning-zero export``."""
        from lightning_zero.checkpoint import refuse_plain_load

        refuse_plain_load(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def __init__(
        self,
        config: Union[None, LlamaConfig, str, Mapping[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: Union[bool, str] = False,
        init_from: Optional[str] = None,
    ) -> None:
        super().__init__()
        checkpointing_mode(activation_checkpointing, "LlamaLM(activation_checkpointing)")  # fail early
        init_from = None if init_from is None else str(init_from)
        self.config, self.pretrained = self._resolve_config(config, init_from)
        betas = tuple(float(beta) for beta in betas)
        if not lr > 0:
            raise ValueError(f"LlamaLM: lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"LlamaLM: weight_decay must be >= 0, got {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"LlamaLM: betas must be two numbers in [0, 1), got {betas}")
        if warmup_steps < 0:
            raise ValueError(f"LlamaLM: warmup_steps must be >= 0, got {warmup_steps}")
        if max_steps is not None and max_steps < max(1, warmup_steps):
            raise ValueError(
                f"LlamaLM: max_steps ({max_steps}) must be >= warmup_steps ({warmup_steps}) and >= 1; "
                "lower warmup_steps or pass max_steps=None to follow the trainer"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"LlamaLM: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        # save_hyperparameters() records the constructor's locals: rebind them to plain types so
        # checkpoints, loggers' hparams and load_from_checkpoint see a dict and a list.
        config, betas = dataclasses.asdict(self.config), list(betas)
        self.save_hyperparameters()
        # [Note: the recorded config] Lightning collects every __init__ frame's arguments, a
        # subclass's last: one that forwards **kw records the config it was given (a preset name,
        # a partial mapping) over the one resolved here. Record the resolved one whatever the
        # subclass passed (a second call updates those entries and the frozen hparams_initial), so
        # load_from_checkpoint and `export --format hf` read the model's whole shape.
        if self.hparams.get("config") != config or self.hparams.get("betas") != betas:
            self.save_hyperparameters({"config": config, "betas": betas})
        self.model: Optional[Llama] = None
        self._parallel_plan: Optional[Any] = None  # handed over by the strategy (receive_parallel_plan)
        self.eval_metrics = nn.ModuleDict(
            {f"{stage}_loss": MeanMetric() for stage in ("val", "test")}
            | {f"{stage}_ppl": PerplexityFromLoss() for stage in ("val", "test")}
        )

    def _resolve_config(self, config: Any, init_from: Optional[str]) -> tuple[Any, Optional[Any]]:
        """``(config, pretrained weights or None)`` from the constructor's arguments (a model
        family's LightningModule built on this one overrides it)."""
        if init_from is None:
            return resolve_config("tiny" if config is None else config), None
        from lightning_zero.models.llama.hf import HFLlamaWeights, pretrained_config

        resolved = pretrained_config(config, init_from)
        return resolved, HFLlamaWeights(init_from, resolved)  # read when the model is built

    def receive_parallel_plan(self, plan: Any) -> None:
        """[Note: the parallelize registry] in ``runtime/parallelize.py``: the strategy hands the
        layout's groups and knobs here (``ParallelPlan``) before ``configure_model``; the model reads
        nothing from its strategy."""
        self._parallel_plan = plan

    def configure_model(self) -> None:
        plan = self._parallel_plan
        if self.model is None:
            target = torch.get_default_device()
            if self.pretrained is not None and plan is not None and plan.dims.tp > 1 and target.type != "meta":
                # Pretrained under TP: split on the meta device, then read only this rank's slices.
                from lightning_zero.tp.layers import mark_tp_params

                with torch.device("meta"):
                    self.model = build_llama(self.config, self.pretrained, self.model_class)
                plan.apply(self.model, dims=("tp",))
                self.model.to_empty(device=target)
                mark_tp_params(self.model)  # to_empty made new Parameter objects
                self.model.init_weights()
            else:
                self.model = build_llama(self.config, self.pretrained, self.model_class)
        self.model.activation_checkpointing = self.hparams.activation_checkpointing
        if plan is not None:  # the family's step: tp (unless done above), ep, cp, each once
            plan.apply(self.model)

    def check_parallel_dims(self, dims: Any) -> None:
        """[Note: layouts a model declares] in ``runtime/parallelize.py``: Llama runs ``cp > 1`` (Ulysses
        attention: ``tp * cp`` must divide the heads, ``cp`` the data module's ``seq_len``; with
        sequence parallelism the runtime checks that the slice splits over ``tp``) and has no experts
        (``ep`` must be 1). Raises ``ValueError`` naming the fix; states a key/value head repeat
        before launch."""
        seq_len = getattr(getattr(self._trainer, "datamodule", None), "seq_len", None)
        check_llama_layout(self.config, dims, owner=type(self).__name__,
                           seq_len=seq_len if isinstance(seq_len, int) else None)  # fmt: skip

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._built_model()(idx)

    def hf_export(self) -> Any:
        """The Hugging Face layout of this model's family for the no-gather export
        (``ZeroStrategy.save_hf_pretrained``; ``checkpoint/hf_write.py``); the ``init_from``
        directory's config.json, when it still exists, contributes the fields we do not own."""
        from pathlib import Path

        from lightning_zero.models.llama.hf import hf_export, read_hf_config

        init_from = self.hparams.get("init_from")
        base = read_hf_config(init_from) if init_from and Path(init_from, "config.json").is_file() else None
        return hf_export(self.config, base, prefix="model.")

    def _built_model(self) -> Llama:
        if self.model is None:
            raise RuntimeError("LlamaLM.model is not built yet; the Trainer calls configure_model(), or call it")
        return self.model

    def _loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        inputs, targets = split_batch(batch)
        model = self._built_model()
        return model.loss_fn(model(inputs), targets), targets.numel()

    def batch_tokens(self, batch: torch.Tensor) -> tuple[int, int]:
        """``(sequences, tokens per sequence)`` a training step on ``batch`` runs on (ZeroMonitor's
        tokens/s and MFU): the inputs, one token shorter than the stored rows."""
        inputs, _ = split_batch(batch)
        return int(inputs.shape[0]), int(inputs.shape[1])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: torch.Tensor, stage: str) -> None:
        loss, num_tokens = self._loss(batch)
        for kind in ("loss", "ppl"):
            metric = self.eval_metrics[f"{stage}_{kind}"]
            metric.update(loss.detach(), weight=num_tokens)
            # Logging the metric object lets Lightning compute (synced over ranks) and reset it per epoch.
            self.log(f"{stage}_{kind}", metric, prog_bar=kind == "loss")

    def configure_optimizers(self) -> dict[str, Any]:
        decay, no_decay = [], []
        for param in self._built_model().parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
        )
        schedule = WarmupCosine(self.hparams.warmup_steps, self._total_steps(), self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.hparams.max_steps is not None:
            return self.hparams.max_steps
        estimate = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimate):
            raise ValueError(
                "LlamaLM: max_steps=None needs a finite training length; set Trainer(max_steps=...) "
                "or max_epochs, or pass LlamaLM(max_steps=...)"
            )
        return max(1, int(estimate))
