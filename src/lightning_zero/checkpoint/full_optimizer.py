"""An optimizer's state in torch's own format (``optimizer.state_dict()`` of the unsharded
optimizer) from the engine's shards, and back: ``fabric.save`` with ``state_dict_type="full"``
writes what Fabric's ``ddp`` writes, and either loads the other's file.

[Note: full optimizer state] torch keys an optimizer's state by the position of each parameter in
its param groups (0, 1, ... over the groups in order). The engine rewires the optimizer to step
views of master runs, so the positions are recorded from the user's param groups before that
(``param_names``: per group, the ``named_parameters`` names in the user's order). Saving: the
ranks first exchange which state keys each owned run has (kind, dtype, the scalar's value: one
small ``all_gather_object``), then per parameter and per tensor key the full tensor is assembled
as in [Note: full state dicts] (zeros, this rank's owned elements, one all-reduce): peak memory is
one parameter's state tensor. Loading needs no collective: each rank copies its owned elements
out of the full tensors (floating state in the dtype of what steps, ``step`` as saved), and the
param groups' hyperparameters (lr, betas, ...) are taken from the file as torch does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_zero.checkpoint.full import dense_experts, dense_tp, ep_rows, expert_domain_of, tp_part
from lightning_zero.checkpoint.targets import state_device


def record_param_names(optimizer: Optimizer, names: dict[int, str]) -> list[list[str]]:
    """Per param group, the names of its parameters in the user's order (before the engine rewires
    the optimizer). ``names``: ``{id(parameter): name}`` of the module's parameters."""
    recorded = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [tuple(param.shape) for param in group["params"] if id(param) not in names]
        if unknown:
            raise ValueError(
                f"ZeroFabricStrategy: param group {index} of {type(optimizer).__name__} holds {len(unknown)} tensor(s)"
                f" that are not parameters of the set-up model (shapes {unknown[:3]}); build the optimizer over"
                " model.parameters()."
            )
        recorded.append([names[id(param)] for param in group["params"]])
    return recorded


def _runs_with_state(optimizer: Optimizer, engine: Any) -> dict[str, list[tuple[Any, dict, bool]]]:
    """``{name: [(owned run, its live state, whether the state holds only this run), ...]}``."""
    runs: dict[str, list[tuple[Any, dict, bool]]] = {}
    for owned in engine.owned_ranges():
        stepped = engine.optimizer_tensor(owned)
        state = optimizer.state.get(stepped)
        if state:
            runs.setdefault(owned.name, []).append((owned, state, stepped is not owned.master))
    return runs


def gather_optimizer_state_dict(
    optimizer: Optimizer, param_names: list[list[str]], engine: Any, group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the unsharded optimizer would return it, on every rank of
    ``group`` (a collective; [Note: full optimizer state]). Tensors on the host; an expert
    parameter's state under expert parallelism is the whole layer's ([Note: dense experts in a
    full file] in ``checkpoint/full.py``). A matrix optimizer's momenta (Muon's, whole on their
    owners) are first sent to the ranks holding each run ([Note: Muon state in checkpoints])."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper, or the optimizer
    sharded = next((opt for opt in engine.optimizers if opt.optimizer is inner), None)
    staged = hasattr(sharded, "stage_range_state")
    if staged:
        sharded.stage_range_state()  # type: ignore[union-attr]
    try:
        return _gather_optimizer_state_dict(optimizer, param_names, engine, group)
    finally:
        if staged:
            sharded.drop_range_state()  # type: ignore[union-attr]


def _gather_optimizer_state_dict(
    optimizer: Optimizer, param_names: list[list[str]], engine: Any, group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    managed = engine.managed_parameters()
    shapes = {name: param.shape for name, param in managed.items()}
    runs = _runs_with_state(optimizer, engine)
    local: dict[str, dict[str, Any]] = {}
    for name, entries in runs.items():
        for _owned, state, _ in entries:
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    local.setdefault(name, {})[key] = ("chunk", str(value.dtype), None)
                elif torch.is_tensor(value):
                    local.setdefault(name, {})[key] = ("scalar", str(value.dtype), value.item())
                else:
                    local.setdefault(name, {})[key] = ("object", "", value)
    merged: dict[str, dict[str, Any]] = {}
    everyone: list[Any] = [local]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
    for part in everyone:
        for name, keys in part.items():
            merged.setdefault(name, {}).update(keys)
    flat_names = [name for names in param_names for name in names]
    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for index, name in enumerate(flat_names):
            for key, (kind, dtype_name, value) in merged.get(name, {}).items():
                if kind == "object":
                    state.setdefault(index, {})[key] = value
                    continue
                dtype = getattr(torch, dtype_name.removeprefix("torch."))
                if kind == "scalar":
                    state.setdefault(index, {})[key] = torch.tensor(value, dtype=dtype)
                    continue
                flat = torch.zeros(shapes[name].numel(), dtype=dtype, device=engine.device)
                for owned, live, own_run in runs.get(name, []):
                    tensor = live[key].detach()
                    flat[owned.param_lo : owned.param_hi] = (
                        tensor if own_run else tensor[owned.chunk_lo : owned.chunk_hi]
                    )
                param = managed[name]
                domain = expert_domain_of(param, engine)
                over = group if domain is None else domain.group  # an expert's chunks: its EDP group
                if dist.is_initialized() and dist.get_world_size(over) > 1:
                    dist.all_reduce(flat, group=over)
                whole = dense_tp(dense_experts(flat.view(shapes[name]), param, engine), param, engine)
                state.setdefault(index, {})[key] = whole.cpu()
    groups, start = [], 0
    for param_group, names in zip(optimizer.param_groups, param_names):
        groups.append({**{k: v for k, v in param_group.items() if k != "params"},
                       "params": list(range(start, start + len(names)))})  # fmt: skip
        start += len(names)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    optimizer: Optimizer, saved: dict[str, Any], param_names: list[list[str]], engine: Any
) -> None:
    """Install a torch-format optimizer state dict (Fabric ``ddp``'s, or ours) into the sharded
    optimizer: each rank its owned elements ([Note: full optimizer state]). No collective."""
    groups = saved["param_groups"]
    if len(groups) != len(param_names) or any(len(g["params"]) != len(n) for g, n in zip(groups, param_names)):
        raise ValueError(
            f"optimizer.load_state_dict: the saved state has param groups of sizes {[len(g['params']) for g in groups]},"
            f" this {type(optimizer).__name__} has {[len(names) for names in param_names]}."
        )
    index_of = {}
    for saved_group, names in zip(groups, param_names):
        index_of.update(zip(names, saved_group["params"]))
    for param_group, saved_group in zip(optimizer.param_groups, groups):
        param_group.update({k: v for k, v in saved_group.items() if k != "params"})
    saved_state = saved["state"]
    managed = engine.managed_parameters()
    with torch.no_grad():
        for owned in engine.owned_ranges():
            entry = saved_state.get(index_of.get(owned.name, -1))
            if not entry:
                continue
            stepped = engine.optimizer_tensor(owned)
            own_run = stepped is not owned.master
            state = optimizer.state.setdefault(stepped, {})
            for key, value in entry.items():
                if not torch.is_tensor(value):
                    state[key] = value
                    continue
                device = state_device(optimizer, stepped, key)
                if value.dim() == 0 or key == "step":
                    state[key] = value.detach().clone().to(device)
                    continue
                param = managed[owned.name]  # a whole expert tensor: this EP rank's; a dense one: this TP rank's
                rows = tp_part(ep_rows(value.detach(), param, engine), param, engine)
                source = rows.reshape(-1)[owned.param_lo : owned.param_hi]
                if own_run:
                    state[key] = source.to(device=device, dtype=stepped.dtype, copy=True)
                else:
                    if key not in state:
                        state[key] = torch.zeros(stepped.shape, dtype=stepped.dtype, device=device)
                    state[key][owned.chunk_lo : owned.chunk_hi].copy_(source)
