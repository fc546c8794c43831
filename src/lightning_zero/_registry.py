"""Registers ``zero1``/``zero2``/``zero3`` in Lightning's strategy registry without importing the engine."""

from __future__ import annotations

from typing import Any


def _make_factory(stage: int):
    def factory(**kwargs: Any):
        from lightning_zero.strategy import ZeroStrategy

        return ZeroStrategy(stage=stage, **kwargs)

    factory.__name__ = f"zero{stage}"
    return factory


def register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2, 3):
        name = f"zero{stage}"
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name,
                _make_factory(stage),
                description=f"lightning_zero ZeRO stage {stage}",
            )
