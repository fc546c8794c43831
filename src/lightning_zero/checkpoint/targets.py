"""Which tensors a rank holds, as DCP entries in dense coordinates (module state, fp32 masters,
optimizer state), for save and load alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.dcp import (
    DenseChunks,
    dense_shape,
    range_pieces,
    storage_shape,
)
from lightning_zero.zero.domains import ep_shard_dim, is_expert_param


@dataclass(frozen=True)
class RankPlacement:
    """Where this process sits in the run: world size, global rank, dp and tp coordinates, ZeRO
    stage, precision, ep coordinates (an EP rank's expert tensors are slices of the dense ones:
    :func:`split_of`). A save records the saver's (``meta.json``); a load reads into the loader's,
    whatever the saved one was."""

    world_size: int = 1
    rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    stage: int = 0
    precision: str = "32-true"
    ep_size: int = 1
    ep_rank: int = 0


def tp_dim_of(param: Optional[torch.Tensor], layout: RankPlacement) -> Optional[int]:
    if param is None or layout.tp_size == 1:
        return None
    if getattr(param, "_tp_segments", None) is not None:  # [Note: segmented TP split] in tp/segments.py
        raise ValueError(
            f"checkpoint: a parameter of shape {tuple(param.shape)} is split over TP per segment"
            f" ({param._tp_segments}, LitGPT's fused qkv), so its parts are no rectangles of the dense tensor and"
            " a sharded checkpoint cannot place them; save the full file (state_dict_type='full', the LitGPT"
            " wrapper's default), whose tensors are dense"
        )
    return getattr(param, "_tp_shard_dim", None)


def split_of(param: Optional[torch.Tensor], layout: RankPlacement) -> tuple[Optional[int], int, int]:
    """``(dim, rank, size)``: this rank's local tensor is the ``rank``-th of ``size`` slices of the
    dense one along ``dim`` (``None``: the whole tensor). TP-split parameters along their TP
    dimension; expert parameters under expert parallelism along ``_ep_shard_dim``, at the EP rank
    ([Note: expert domain] in ``zero/domains.py``), so any ep reads them back."""
    ep_dim = ep_shard_dim(param) if layout.ep_size > 1 else None
    if layout.ep_size > 1 and ep_dim is None and param is not None and is_expert_param(param):
        raise ValueError(
            f"checkpoint: an expert parameter of shape {tuple(param.shape)} has no _ep_shard_dim: under expert"
            " parallelism a checkpoint places each EP rank's experts in the dense tensor along that dimension;"
            " stack a layer's experts in one Parameter and set param._ep_shard_dim (models/moe does)"
        )
    tp_dim = tp_dim_of(param, layout)
    if ep_dim is not None and tp_dim is not None:
        raise ValueError(
            f"checkpoint: a parameter of shape {tuple(param.shape)} is split both over TP (dim {tp_dim}) and"  # type: ignore[union-attr]
            f" over EP (dim {ep_dim}); experts split by TP are not supported"
        )
    if ep_dim is not None:
        return ep_dim, layout.ep_rank, layout.ep_size
    return tp_dim, layout.tp_rank, layout.tp_size


def managed_names(engine: Any) -> set[str]:
    """Names of the parameters whose fp32 masters the engine's optimizers step."""
    return engine.managed_param_names()


def param_of_key(key: str) -> str:
    """The parameter name in a tensor key: ``model.<name>`` or ``optim.<i>.<name>.<state key>``."""
    if key.startswith("model."):
        return key[len("model.") :]
    return key.split(".", 2)[2].rsplit(".", 1)[0]


def add_chunks(state: dict[str, Any], key: str, size: tuple[int, ...], pieces: list) -> None:
    existing = state.get(key)
    if existing is None:
        state[key] = DenseChunks(size, pieces)
    else:
        existing.pieces.extend(pieces)


def pieces_over(flat: torch.Tensor, pieces: list) -> list:
    """(offsets, view) per piece: ``flat`` holds the run the pieces were cut from."""
    return [(piece.offsets, flat[piece.start : piece.start + piece.numel].view(piece.sizes)) for piece in pieces]


@dataclass
class Targets:
    """Tensors a rank saves or loads, plus where loaded values go afterwards."""

    tensors: dict[str, Any] = field(default_factory=dict)
    copies: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (name, destination, staged)
    optimizer_states: list[dict[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    # Saving: keep device tensors where they are (views of the live ones) instead of copying them
    # to pageable host memory here; a background save copies them into its pinned buffers
    # ([Note: background saves] in background.py), the shapes-only prepare reads no values at all.
    keep_device: bool = False

    def saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a save collects it: on the host, unless :attr:`keep_device`."""
        return tensor if self.keep_device else tensor.cpu()


def module_entries(module: nn.Module, skip: set[str], layout: RankPlacement, targets: Targets, *, load: bool) -> dict:
    """``model.<name>`` for every module state-dict entry not in ``skip`` (whole local tensors).

    A Parameter the state dict lists under several names (tied weights: GPT-2's ``lm_head.weight``
    is ``transformer.wte.weight``) is one tensor: when its canonical name is in ``skip`` (the
    engine saves its fp32 master), its aliases are skipped too. Under ZeRO-3 an alias has no
    storage outside a forward, and on load the canonical entry fills the one Parameter anyway.
    """
    params = dict(module.named_parameters())
    skipped_params = {id(param) for name, param in params.items() if name in skip}
    info = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in skip or not isinstance(tensor, torch.Tensor) or id(tensor) in skipped_params:
            continue
        tensor = tensor.detach()
        split_dim, split_rank, split_size = split_of(params.get(name), layout)
        size = storage_shape(dense_shape(tensor.shape, split_dim, split_size))
        pieces = range_pieces(tensor.shape, 0, tensor.numel(), tp_dim=split_dim, tp_rank=split_rank)
        if load:
            staged = torch.empty(tensor.numel(), dtype=tensor.dtype)
            targets.copies.append((name, tensor.reshape(-1) if tensor.is_contiguous() else tensor, staged))
            flat = staged
        else:
            flat = targets.saved(tensor.reshape(-1))
        add_chunks(targets.tensors, f"model.{name}", size, pieces_over(flat, pieces))
        info[name] = split_info(tensor.shape, params.get(name), layout)
    return info


def split_info(local_shape: torch.Size, param: Optional[torch.Tensor], layout: RankPlacement) -> dict[str, Any]:
    """What ``meta.json`` records of a saved tensor: its dense shape and the dimension TP (or EP,
    under expert parallelism) splits it along."""
    split_dim, _, split_size = split_of(param, layout)
    key = "ep_dim" if split_dim is not None and ep_shard_dim(param) is not None and layout.ep_size > 1 else "tp_dim"
    return {"shape": list(dense_shape(local_shape, split_dim, split_size)), key: split_dim}


def optimizer_index(optimizers: list[Optimizer]) -> dict[int, int]:
    return {id(p): i for i, opt in enumerate(optimizers) for group in opt.param_groups for p in group["params"]}


def state_device(optimizer: Optimizer, master: torch.Tensor, key: str) -> torch.device:
    """Where a loaded state tensor of ``master`` (what the optimizer steps) goes: as torch's own ``load_state_dict`` does,
    ``step`` stays on the host unless the master's param group is ``capturable`` or ``fused``
    (a ``step`` on the GPU of a plain Adam costs a host sync per chunk per step); every other
    state goes with the master."""
    if key != "step":
        return master.device
    for group in optimizer.param_groups:
        if any(param is master for param in group["params"]):
            if group.get("capturable") or group.get("fused"):
                return master.device
            break
    return torch.device("cpu")


def engine_entries(
    engine: Any,
    optimizers: list[Optimizer],
    layout: RankPlacement,
    targets: Targets,
    *,
    load: bool,
    state_kinds: list,
    with_state: bool = True,
) -> None:
    """``model.<name>`` from the fp32 masters and ``optim.<i>.<name>.<key>`` for owned ranges.

    ``state_kinds[i]``: ``{key: "chunk" | "scalar"}`` of optimizer ``i`` (when loading, from the
    checkpoint; when saving, filled in from the live state).
    """
    for owned in engine.owned_ranges():
        size, pieces = _dense_pieces(owned, layout)
        lo, hi = owned.chunk_lo, owned.chunk_hi
        master = owned.master.detach()
        if load:
            staged = torch.empty(hi - lo, dtype=master.dtype)
            targets.copies.append((owned.name, master[lo:hi], staged))
            add_chunks(targets.tensors, f"model.{owned.name}", size, pieces_over(staged, pieces))
        else:
            add_chunks(targets.tensors, f"model.{owned.name}", size, pieces_over(targets.saved(master[lo:hi]), pieces))
    if load or with_state:
        state_entries(engine.optimizer_shards(), optimizers, layout, targets, load=load, state_kinds=state_kinds)
    else:
        targets.optimizer_states = [{} for _ in optimizers]


def _dense_pieces(owned: Any, layout: RankPlacement) -> tuple[tuple[int, ...], list]:
    """The dense tensor's size and where ``owned``'s elements sit in it."""
    split_dim, split_rank, split_size = split_of(owned.param, layout)
    size = storage_shape(dense_shape(owned.shape, split_dim, split_size))
    pieces = range_pieces(owned.shape, owned.param_lo, owned.param_hi, tp_dim=split_dim, tp_rank=split_rank)
    return size, pieces


def state_entries(
    shards: Any, optimizers: list[Optimizer], layout: RankPlacement, targets: Targets, *, load: bool, state_kinds: list
) -> None:
    """``optim.<i>.<name>.<key>`` for the runs of ``shards`` (``zero/flat.py``'s ``OptimizerShards``:
    the running engine's, or those a closed engine left, [Note: optimizer state after the loop])."""
    which = optimizer_index(optimizers)
    targets.optimizer_states = [{} for _ in optimizers]
    for owned, stepped in shards.runs:
        # The optimizer's state is keyed by what it steps: a view of the owned run (its state
        # tensors are the run's own) or, for a frozen stage-3 shard, the master chunk.
        own_run = stepped is not owned.master  # its state tensors hold just this run
        index = which.get(id(stepped))
        if index is None:  # stage 3: a frozen parameter's shard (no optimizer steps it)
            continue
        size, pieces = _dense_pieces(owned, layout)
        lo, hi = owned.chunk_lo, owned.chunk_hi
        if load:
            state = targets.optimizer_states[index].setdefault(id(stepped), {})
            for key, (kind, dtype) in state_kinds[index].items():
                if key not in state:
                    shape = stepped.shape if kind == "chunk" else ()
                    device = state_device(optimizers[index], stepped, key)
                    state[key] = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                if kind == "chunk":
                    flat = state[key] if own_run else state[key][lo:hi]
                    add_chunks(targets.tensors, f"optim.{index}.{owned.name}.{key}", size, pieces_over(flat, pieces))
                else:
                    targets.tensors[f"optim.{index}.{owned.name}.{key}"] = state[key]
            continue
        for key, value in optimizers[index].state.get(stepped, {}).items():
            if not torch.is_tensor(value):
                raise TypeError(
                    f"lightning_zero checkpoint: optimizer {index} state {key!r} is a {type(value).__name__};"
                    " only tensor optimizer state can be sharded"
                )
            if value.shape == stepped.shape:
                kind = "chunk"
                flat = targets.saved(value.detach() if own_run else value.detach()[lo:hi])
                add_chunks(targets.tensors, f"optim.{index}.{owned.name}.{key}", size, pieces_over(flat, pieces))
            elif value.numel() == 1:
                kind = "scalar"
                targets.tensors[f"optim.{index}.{owned.name}.{key}"] = targets.saved(value.detach().reshape(()))
            else:
                raise TypeError(
                    f"lightning_zero checkpoint: optimizer {index} state {key!r} has shape {tuple(value.shape)},"
                    f" neither the run's {tuple(stepped.shape)} nor a scalar"
                )
            state_kinds[index][key] = [kind, str(value.dtype).removeprefix("torch.")]
