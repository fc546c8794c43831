"""Registers ``zero1``/``zero2``/``zero3`` in both of Lightning's strategy registries without importing the engine.

The Trainer's (``lightning.pytorch.strategies.StrategyRegistry``: ``ZeroStrategy``) and Fabric's
(``lightning.fabric.strategies.STRATEGY_REGISTRY``: ``ZeroFabricStrategy``). For each whose
package is not imported yet, a meta-path finder waits for it to load and registers right after,
so ``import lightning_zero`` never pays for importing Lightning itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TRAINER = "lightning.pytorch.strategies"
_FABRIC = "lightning.fabric.strategies"


def _make_factory(stage: int):
    def factory(**kwargs: Any):
        from lightning_zero.trainer.strategy import ZeroStrategy

        return ZeroStrategy(stage=stage, **kwargs)

    factory.__name__ = f"zero{stage}"
    return factory


def _make_fabric_factory(stage: int):
    def factory(**kwargs: Any):
        from lightning_zero.fabric.strategy import ZeroFabricStrategy

        return ZeroFabricStrategy(stage=stage, **kwargs)

    factory.__name__ = f"zero{stage}"
    return factory


def register_trainer() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for stage in (1, 2, 3):
        name = f"zero{stage}"
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name,
                _make_factory(stage),
                description=f"lightning_zero ZeRO stage {stage}",
            )


def register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for stage in (1, 2, 3):
        name = f"zero{stage}"
        if name not in STRATEGY_REGISTRY:
            STRATEGY_REGISTRY.register(
                name,
                _make_fabric_factory(stage),
                description=f"lightning_zero ZeRO stage {stage} (Fabric)",
            )


_REGISTER = {_TRAINER: register_trainer, _FABRIC: register_fabric}


def register() -> None:
    """Register in both registries now (imports Lightning)."""
    register_fabric()
    register_trainer()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs the registration of ``target`` (one of the two strategies packages) right after it
    finishes loading."""

    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            _REGISTER[fullname]()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_now_or_on_import() -> None:
    for target, register_in in _REGISTER.items():
        if target in sys.modules:
            register_in()
        elif not any(isinstance(f, _RegisterAfterImport) and f.target == target for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport(target))
