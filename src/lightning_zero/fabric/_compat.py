"""The one place the Fabric door replaces an attribute of an object it does not own, each with its reason.

[Note: replaced attributes at the Fabric door] Three, each installed and removed here and nowhere
else; ``tests/test_fabric_compat.py`` fails when the installed torch, Lightning or LitGPT changes
what each relies on:

- ``sys.excepthook``: Fabric has no exception hook (the Trainer has ``on_exception``), and a script
  that ends with an uncaught exception on one rank must post it to the failure channel before the
  interpreter exits, so its peers raise ``PeerFailedError`` naming it instead of waiting out
  ``collective_timeout`` ([Note: failure path]). The hook chains to the one it found and is put back
  at teardown only if it is still ours (a hook installed after ours stays).
- ``load_state_dict`` of the set-up model (shadowed on the instance, the class untouched): torch's
  load-state-dict pre- and post-hooks run around torch's copy into the module's parameters, which
  at stage 3 hold no storage and under -mixed hold the bf16 compute copies; the values must reach
  the fp32 masters and shards instead ([Note: torch's load traversal] in checkpoint/full.py, which
  still runs the module's own ``_load_from_state_dict`` and hooks). Removed at teardown.
- ``lightning.Fabric`` while the LitGPT wrapper runs LitGPT's own script: LitGPT builds its Fabric
  itself (``L.Fabric(strategy=...)``, looked up on the module at call time), and has no knob for a
  strategy object, so the wrapper hands it a subclass that swaps the strategy in; restored on exit.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Generator

from torch import nn


def install_excepthook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``hook`` ``sys.excepthook``; returns the hook it replaced (``hook`` should chain to it)."""
    previous = sys.excepthook
    sys.excepthook = hook
    return previous


def restore_excepthook(hook: Callable[..., Any], previous: Callable[..., Any]) -> None:
    """Put ``previous`` back, unless a hook installed after ``hook`` replaced it since."""
    if sys.excepthook == hook:
        sys.excepthook = previous


def route_load_state_dict(module: nn.Module, load: Callable[..., Any]) -> None:
    """``module.load_state_dict(state_dict, strict=True, assign=False)`` calls ``load`` instead."""
    module.load_state_dict = load  # type: ignore[method-assign]


def unroute_load_state_dict(module: nn.Module) -> None:
    """``module.load_state_dict`` is torch's again."""
    module.__dict__.pop("load_state_dict", None)


@contextmanager
def fabric_class_replaced(subclass: type) -> Generator[type, None, None]:
    """While open, ``lightning.Fabric`` is ``subclass`` (a subclass of it); yields the original."""
    import lightning

    original = lightning.Fabric
    lightning.Fabric = subclass
    try:
        yield original
    finally:
        lightning.Fabric = original
