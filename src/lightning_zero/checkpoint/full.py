"""One plain (full) state dict from a sharded model, and one into it: ``fabric.save`` with
``state_dict_type="full"``, ``fabric.load_raw`` and a set-up model's ``load_state_dict``.

[Note: full state dicts] The engine's fp32 masters are the truth for every parameter it manages
(each element owned by one shard rank: ``engine.owned_ranges()``). Gathering: per parameter, a
zero tensor of its full size gets this rank's owned elements and is summed over the shard group
(each element is non-zero on one rank only, so the sum is exact); peak memory is one parameter.
Buffers and parameters outside the engine are whole on every rank and taken as they are; a tied
alias gets its canonical parameter's value. Loading writes each rank's owned elements into its
masters and the rest into the module, then the engine refreshes the compute parameters from the
masters (stages 1-2 all-gather, stage 3 refreshes the shard): nothing is lost at the next step.
The optimizer state is not part of it (a fresh load, as ``load_state_dict`` is under ddp).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function


def gather_full_state_dict(
    module: nn.Module, engine: Any, group: Optional[dist.ProcessGroup]
) -> dict[str, torch.Tensor]:
    """The module's state dict with full fp32 master values, on every rank (collective over ``group``,
    the engine's shard group)."""
    managed = engine.managed_parameters()
    owned: dict[str, list] = {}
    for run in engine.owned_ranges():
        owned.setdefault(run.name, []).append(run)
    full: dict[int, torch.Tensor] = {}
    with torch.no_grad(), record_function("lightning_zero::gather_full_state_dict"):
        for name, param in managed.items():
            flat = torch.zeros(param.shape.numel(), dtype=torch.float32, device=engine.device)
            for run in owned.get(name, []):
                flat[run.param_lo : run.param_hi] = run.master.detach()[run.chunk_lo : run.chunk_hi].float()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            full[id(param)] = flat.view(param.shape).cpu()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        out[key] = full[id(tensor)] if id(tensor) in full else tensor.detach().cpu().clone()
    return out


def load_full_state_dict(
    module: nn.Module, engine: Any, state_dict: dict[str, torch.Tensor], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Write a full ``state_dict`` into the sharded ``module`` (see [Note: full state dicts]);
    returns ``(missing, unexpected)`` keys, raising on either when ``strict``. A collective (the
    masters' refresh): every rank calls it with the same values."""
    expected = {k: t for k, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    managed = engine.managed_parameters()
    name_of = {id(param): name for name, param in managed.items()}
    # a tied parameter's alias may stand in for its canonical name
    by_param = {name_of[id(t)]: state_dict[k] for k, t in expected.items() if id(t) in name_of and k in state_dict}
    missing = [k for k in missing if not (id(expected[k]) in name_of and name_of[id(expected[k])] in by_param)]
    wrong = [f"{k}: {tuple(state_dict[k].shape)} vs {tuple(t.shape)}" for k, t in expected.items()
             if k in state_dict and tuple(state_dict[k].shape) != tuple(t.shape)]  # fmt: skip
    if wrong:
        raise ValueError(f"load_state_dict on a ZeRO-sharded model: shape mismatch: {'; '.join(wrong)}")
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_state_dict on a ZeRO-sharded model (strict=True): missing keys {missing}, unexpected keys"
            f" {unexpected}. Pass strict=False to load the matching entries only."
        )
    with torch.no_grad(), record_function("lightning_zero::load_full_state_dict"):
        for run in engine.owned_ranges():
            value = by_param.get(run.name)
            if value is not None:
                source = value.detach().reshape(-1)[run.param_lo : run.param_hi]
                run.master.detach()[run.chunk_lo : run.chunk_hi].copy_(source)
        for key, tensor in expected.items():
            if id(tensor) not in name_of and key in state_dict:
                tensor.detach().copy_(state_dict[key])
    engine.refresh_params_from_masters()
    return missing, unexpected
