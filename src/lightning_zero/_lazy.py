"""Module-level ``__getattr__`` that imports a package's public names on first use.

Each package that keeps its import cheap (``lightning_zero``, ``models``, ``models.llama``,
``zero.stage3``: the plan path imports neither Lightning nor torch) maps a name to the module
that defines it and sets ``__getattr__ = lazy_attributes(__name__, _LAZY)``; or, listing the
names module by module, ``__all__, __getattr__ = lazy_exports(__name__, {module: "names ..."})``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package``: ``table[name]``'s module is imported when ``name`` is first taken."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def lazy_exports(package: str, names_by_module: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package`` from ``{module: "Name other_name ..."}`` (the
    names each module defines, space-separated): :func:`lazy_attributes` of the table they make."""
    table = {name: module for module, names in names_by_module.items() for name in names.split()}
    return sorted(table), lazy_attributes(package, table)
