"""Choosing stage-3 units and deciding which unit stores each parameter.

[Note: shared parameters] A Parameter registered in more than one unit (GPT-2's ``lm_head.weight``
*is* ``transformer.wte.weight``; T5's one embedding is held by ``shared``, the encoder, the decoder
and the head) is stored once, in the *root* unit -- the lowest common ancestor of its holders,
which is what FSDP2 asks of tied weights. The root unit is gathered at the start of each step and
kept until backward ends (FSDP2 does not reshard the root after forward either), so every module
using the tie finds it gathered, in forward and in backward; it is all-gathered once per step and
its gradient -- summed by autograd over every use into one ``.grad`` -- is reduce-scattered once.
Bytes per step stay exact: ``(dp-1)/dp`` of the root's elements are gathered once and
reduce-scattered once, those of every other unit gathered twice (once for a unit held from its
forward into its backward: [Note: held into backward] in ``schedule.py``) and reduce-scattered once.
A module that directly registers a root parameter (a *root holder*: the tie's users, and every
module outside all units that holds parameters) re-gathers the root on demand if it finds it freed
(after an ``optimizer.step()``, or a forward outside the step methods).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from lightning_zero.zero.stage3.storage import ShardedFlatParamGroup


@dataclass
class Unit:
    """A module whose parameters are gathered and freed together, with its in-flight gathers."""

    index: int
    name: str
    module: Optional[nn.Module]  # None for the root unit (parameters outside every unit module)
    groups: list[ShardedFlatParamGroup] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    gathered: bool = False
    prefetched: bool = False  # gathered ahead by the schedule; its entry not consumed yet
    backward_uses: int = 0  # forward calls whose post-backward has not run yet (this backward)
    # One entry per forward of the unit in progress (outside backward), innermost last: whether its
    # post-forward frees the unit (True/False: an on-demand no_grad forward that did / did not
    # gather it; None: the usual rule).
    forward_frees: list[Optional[bool]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters when gathered (padding included)."""
        return sum(group.layout.numel for group in self.groups)

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [slot.param for group in self.groups for slot in group.layout.slots if slot.param.requires_grad]


WrapPolicy = Callable[[nn.Module, Optional[nn.Module]], bool]  # (module, parent) -> is a unit

# A model above this many parameters whose default wrap policy finds no unit besides the root
# gets a warning: stage 3 would hold the whole model gathered during each step.
SINGLE_UNIT_WARN_NUMEL = 50_000_000
_warned_single_unit: set[str] = set()  # model class names already warned about (once per process)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def is_block_container(module: nn.Module) -> bool:
    """A container of repeated blocks: any ``ModuleList``; a ``ModuleDict`` or ``Sequential`` whose
    parameter-holding children include at least two of the same class (torchtitan keeps its blocks
    in a ``ModuleDict``; many models in a ``Sequential``)."""
    if isinstance(module, nn.ModuleList):
        return True
    if not isinstance(module, (nn.ModuleDict, nn.Sequential)):
        return False
    seen: set[type] = set()
    for child in module.children():
        if _has_params(child):
            if type(child) in seen:
                return True
            seen.add(type(child))
    return False


def default_wrap_policy(module: nn.Module, parent: Optional[nn.Module]) -> bool:
    """Every parameter-holding child of a block container (:func:`is_block_container`), embeddings,
    and every module with parameters that sits beside a block container (for a decoder: the
    embedding, the final norm and the LM head).

    Embeddings are recognized by shape (``num_embeddings``), so tensor-parallel versions count.
    """
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False  # containers have no forward to hook; their children may be units
    if parent is not None and is_block_container(parent):
        return _has_params(module)  # a block (even a Sequential of repeated layers itself)
    if isinstance(module, nn.Sequential) and is_block_container(module):
        return False  # its blocks become the units
    if isinstance(module, nn.Embedding) or hasattr(module, "num_embeddings"):
        return True
    if parent is not None and _has_params(module):
        return any(is_block_container(child) for child in parent.children())
    return False


def find_units(root: nn.Module, policy: WrapPolicy = default_wrap_policy) -> list[tuple[str, nn.Module]]:
    """Unit modules in registration (pre-)order; a unit's descendants are never units themselves."""
    units: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if policy(child, module):
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    raise ValueError(
                        f"ZeRO-3 wrap policy chose {path!r}, a {type(child).__name__}: containers are never"
                        " called, so their parameters would never be gathered. Choose their children."
                    )
                units.append((path, child))
            else:
                visit(child, path)

    visit(root, "")
    return [(name, module) for name, module in units if _has_params(module)]


def assign_params(
    root: nn.Module, unit_modules: list[tuple[str, nn.Module]]
) -> tuple[dict[int, int], list[nn.Module], list[nn.Module]]:
    """Which unit stores each parameter ([Note: shared parameters]).

    Returns ``owner`` (param id -> index into ``unit_modules``, or ``len(unit_modules)`` for the
    root), the modules outside every unit (pre-order), and the root holders: modules that
    directly register a root-stored parameter.
    """
    root_index = len(unit_modules)
    holders: dict[int, set[int]] = {}
    for index, (_, unit_module) in enumerate(unit_modules):
        for param in unit_module.parameters():
            holders.setdefault(id(param), set()).add(index)
    inside_units = {id(m) for _, unit_module in unit_modules for m in unit_module.modules()}
    root_modules = [m for m in root.modules() if id(m) not in inside_units]
    for module in root_modules:
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(root_index)
    owner = {pid: (next(iter(units)) if len(units) == 1 else root_index) for pid, units in holders.items()}
    root_holders = [
        m
        for m in root.modules()
        if any(p is not None and owner.get(id(p)) == root_index for p in m._parameters.values())
    ]
    return owner, root_modules, root_holders


def warn_if_single_unit(root: nn.Module, unit_count: int, policy: WrapPolicy) -> None:
    """Warn once (global rank 0) when the default policy left a large model in the root unit."""
    if unit_count or policy is not default_wrap_policy:
        return
    numel = sum(p.numel() for p in root.parameters())
    if numel < SINGLE_UNIT_WARN_NUMEL:
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if type(root).__name__ in _warned_single_unit:
        return
    _warned_single_unit.add(type(root).__name__)
    warnings.warn(
        f"lightning_zero ZeRO-3: the default wrap policy found no repeated blocks in"
        f" {type(root).__name__} ({numel:,} parameters): everything is one root unit, gathered whole for"
        " each step, so stage 3 saves no parameter memory. Hold the blocks in an nn.ModuleList,"
        " nn.ModuleDict or nn.Sequential, or pass ZeroStrategy(wrap_policy=...).",
        stacklevel=3,
    )
