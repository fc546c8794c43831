"""``MoELM``: ``LlamaLM``'s training loop (AdamW, warmup + cosine, evaluation metrics) on a
:class:`~lightning_zero.models.moe.model.MoETransformer`, with the MoE auxiliary losses added to
the training loss and the experts split over the strategy's ``ep`` group."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from lightning_zero.models.llama.lightning import LlamaLM, split_batch
from lightning_zero.models.moe.config import MoEConfig, check_moe_layout, resolve_moe_config
from lightning_zero.models.moe.model import MoETransformer, build_moe


class MoELM(LlamaLM):
    """Next-token language modelling on a mixture-of-experts decoder.

    Args: as :class:`~lightning_zero.models.llama.lightning.LlamaLM`'s, with ``config`` a MoE
    preset (``tiny_moe``, ``tiny_moe_shared``, ``mixtral_8x7b``, ``qwen3_30b_a3b``,
    ``deepseek_v3_671b``), a ``MoEConfig`` or a mapping (default ``tiny_moe``), and ``init_from``
    a Hugging Face Mixtral or Qwen3-MoE directory.

    The training loss is ``cross entropy + aux_loss_coef * balance + z_loss_coef * z`` (summed
    over MoE layers; [Note: balance loss] in ``models/moe/router.py``); validation and test report
    the cross entropy alone. Under expert parallelism (the strategy's ``expert_parallel_group``,
    set when ``ep > 1``) ``configure_model`` keeps this rank's experts
    (``lightning_zero.models.moe.parallelize.parallelize_experts``).
    """

    def __init__(
        self,
        config: Union[None, MoEConfig, str, Mapping[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Any = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: Union[bool, str] = False,
        init_from: Optional[str] = None,
    ) -> None:
        # save_hyperparameters() records this frame's locals too: plain types (a dict, a list).
        config, betas = dataclasses.asdict(self._resolve_config(config, init_from, read_weights=False)[0]), list(betas)
        super().__init__(config, lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio,
                         activation_checkpointing, init_from)  # fmt: skip

    def hf_export(self) -> Any:
        """The Mixtral / Qwen3-MoE layout for ``ZeroStrategy.save_hf_pretrained`` (no gather, any ep)."""
        from lightning_zero.models.moe.hf import hf_export

        return hf_export(self.config, prefix="model.")

    def _resolve_config(self, config: Any, init_from: Optional[str], read_weights: bool = True) -> tuple[Any, Any]:
        if init_from is None:
            return resolve_moe_config("tiny_moe" if config is None else config), None
        from lightning_zero.models.moe.hf import HFMoEWeights, pretrained_config

        resolved = pretrained_config(config, str(init_from))
        return resolved, HFMoEWeights(str(init_from), resolved) if read_weights else None

    model_class = MoETransformer

    def configure_model(self) -> None:
        plan = self._parallel_plan
        target = torch.get_default_device()
        splits = plan is not None and (plan.dims.ep > 1 or plan.dims.tp > 1)
        if self.model is None and splits and target.type != "meta":
            # Keep this rank's experts on the meta device, then initialize (or read) only them; TP
            # then splits the dense layers of the materialized model (super().configure_model).
            with torch.device("meta"):
                self.model = build_moe(self.config, self.pretrained)
            plan.apply(self.model, dims=("ep",))
            self.model.to_empty(device=target)
            self.model.mark_expert_params()  # to_empty made new Parameter objects
            self.model.init_weights()
        super().configure_model()  # builds the model if not yet; the family's step: tp, ep, cp, each once

    def check_parallel_dims(self, dims: Any) -> None:
        """[Note: layouts a model declares] in ``runtime/parallelize.py``: experts divisible by ``ep``,
        with tensor parallelism no capacity factor (``check_moe_layout``) and a data module's
        sequence length divisible by ``tp``, and context
        parallelism as Llama's attention runs it. Raises ``ValueError`` naming the fix, before any
        process group starts."""
        check_moe_layout(self.config, ep=dims.ep, tp=dims.tp)
        seq_len = getattr(getattr(self._trainer, "datamodule", None), "seq_len", None)
        if dims.tp > 1 and isinstance(seq_len, int) and seq_len % dims.tp:  # each TP rank routes T / tp tokens
            raise ValueError(
                f"tensor_parallel_size({dims.tp}) does not divide the data module's seq_len({seq_len}): each TP rank"
                f" of a MoE model routes its slice of the sequence; use a seq_len that is a multiple of {dims.tp}"
            )
        super().check_parallel_dims(dataclasses.replace(dims, ep=1))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the auxiliary-loss-free bias update from the step's assignments
        over every data-parallel rank ([Note: bias update] in ``models/moe/router.py``)."""
        super().optimizer_step(*args, **kwargs)
        self._built_model().update_router_bias(self._dense_group())  # counted in the model's counter

    def _dense_group(self) -> Optional[Any]:
        """The group data-parallel ranks of one TP rank form (``ZeroStrategy``'s dp_cp; ``None``: the
        default group, as under ddp)."""
        plan = self._parallel_plan  # handed over by the strategy ([Note: the parallelize registry])
        return None if plan is None else plan.groups.dp_cp

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = split_batch(batch)
        model = self._built_model()
        loss = model.loss_fn(model(inputs), targets)
        if self.config.aux_loss_coef or self.config.z_loss_coef:  # under pp every stage's terms, per micro-batch
            loss = loss + model.aux_loss()  # ([Note: MoE pipeline stages] in models/moe/pipeline.py)
        self.log("train_loss", loss, prog_bar=True)
        return loss
