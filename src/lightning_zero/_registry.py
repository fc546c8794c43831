"""Registers ``zero1``/``zero2``/``zero3`` in both of Lightning's strategy registries without importing the engine.

The Trainer's (``lightning.pytorch.strategies.StrategyRegistry``: ``ZeroStrategy``) and Fabric's
(``lightning.fabric.strategies.STRATEGY_REGISTRY``: ``ZeroFabricStrategy``). For each whose
package is not imported yet, a meta-path finder waits for it to load and registers right after,
so ``import lightning_zero`` never pays for importing Lightning itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_TRAINER = "lightning.pytorch.strategies"
_FABRIC = "lightning.fabric.strategies"


def _make_factory(stage: int, module_name: str, class_name: str):
    def factory(**kwargs: Any):
        strategy_class = getattr(importlib.import_module(module_name), class_name)
        return strategy_class(stage=stage, **kwargs)

    factory.__name__ = f"zero{stage}"
    return factory


def _register_in(registry: Any, module_name: str, class_name: str, door: str) -> None:
    for stage in (1, 2, 3):
        name = f"zero{stage}"
        if name not in registry:
            registry.register(
                name,
                _make_factory(stage, module_name, class_name),
                description=f"lightning_zero ZeRO stage {stage}{door}",
            )


def register_trainer() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    _register_in(StrategyRegistry, "lightning_zero.trainer.strategy", "ZeroStrategy", "")


def register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    _register_in(STRATEGY_REGISTRY, "lightning_zero.fabric.strategy", "ZeroFabricStrategy", " (Fabric)")


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
