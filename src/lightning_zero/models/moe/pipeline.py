"""Pipeline stages of a :class:`~lightning_zero.models.moe.model.MoETransformer`.

A ``MoETransformer`` is a ``Llama`` whose blocks take the same ``(h, cos, sin)``: it is cut by
Llama's own step (``models/llama/pipeline.cut_llama``: ``LlamaStage`` holds the model's own
blocks under their dense names), after the ep step kept this rank's experts, so each stage's
MoE layers exchange tokens over the ep group of that stage's ranks (``comm/mesh.py``: every ep
and edp group lives inside one pp rank's block). What is the MoE family's own is which configs
a pipeline trains equal to ddp: :func:`check_moe_pipeline`.

[Note: MoE pipeline stages] A pipeline runs each training batch as ``pp_microbatches`` slices,
each through the stages separately. Three MoE terms depend on the tokens a forward sees together,
so they would differ from ddp's whole batch (and the balance loss is not linear in its tokens:
the mean of micro-batches' losses is not the batch's): the load-balancing and z losses (each
stage holds some MoE layers' terms, and the loss lives on the last stage), the selection bias
update (it sums the loads the training forwards routed) and a capacity factor (it caps each
micro-batch's assignments). So a pipelined MoE runs only with ``aux_loss_coef = z_loss_coef =
bias_update_rate = 0`` and no capacity factor (refused before launch, naming the fix); such a model
trains on the cross entropy alone, token by token, and equals ddp.
"""

from __future__ import annotations

from typing import Any

from lightning_zero.models.moe.config import MoEConfig


def check_moe_pipeline(config: MoEConfig, asked: str) -> None:
    """Refuse, naming the fix, a MoE config a pipeline would not train as ddp does ([Note: MoE
    pipeline stages]); ``asked``: the strategy's call, for the message."""
    dependent: dict[str, Any] = {
        "aux_loss_coef": config.aux_loss_coef,
        "z_loss_coef": config.z_loss_coef,
        "bias_update_rate": config.bias_update_rate,
    }
    wrong = [f"{name}={value}" for name, value in dependent.items() if value != 0]
    if config.capacity_factor is not None:
        wrong.append(f"capacity_factor={config.capacity_factor}")
    if wrong:
        raise ValueError(
            f"{asked}: the MoE config {config.name!r} has {', '.join(wrong)}, which pipeline stages do not run yet"
            " (each depends on the tokens of a whole batch, and a pipeline runs micro-batches; the auxiliary losses"
            " would live on other stages than the loss: docs/pipeline.md); set aux_loss_coef=0, z_loss_coef=0,"
            " bias_update_rate=0 and capacity_factor=None with pp > 1, or use pp=1"
        )
