"""Registers ``zero1``/``zero2``/``zero3`` in Lightning's strategy registry without importing the engine.

If ``lightning.pytorch`` is not imported yet, a meta-path finder waits for its strategies
package to load and registers right after, so ``import lightning_zero`` never pays for importing
Lightning itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TARGET = "lightning.pytorch.strategies"


def _make_factory(stage: int):
    def factory(**kwargs: Any):
        from lightning_zero.trainer.strategy import ZeroStrategy

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


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after ``lightning.pytorch.strategies`` finishes loading."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_now_or_on_import() -> None:
    if _TARGET in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
