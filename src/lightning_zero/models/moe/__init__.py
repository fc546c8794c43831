"""A mixture-of-experts decoder family on Llama's attention and norms: ``config`` (``MoEConfig`` and
presets; plain Python), ``router`` (top-k softmax / sigmoid-with-bias routing, the balance and z
losses), ``experts`` (stacked experts, grouped matmul), ``model`` (``MoETransformer``),
``lightning`` (``MoELM``), ``parallelize`` (its experts split over ``ep``, its MoE layers under TP)
and ``hf`` (Mixtral and Qwen3-MoE layouts: import, export). The generic token exchange is
``lightning_zero.ep``.

Names are imported lazily: ``MoEConfig`` does not import torch (the planner reads it)."""

from __future__ import annotations

from lightning_zero._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "lightning_zero.models.moe.model": "MoE MoEBlock MoETransformer build_moe",
        "lightning_zero.models.moe.config": "MoEConfig moe_preset_names resolve_moe_config",
        "lightning_zero.models.moe.lightning": "MoELM",
        "lightning_zero.models.moe.parallelize": "parallelize_experts parallelize_moe_tp",
    },
)
