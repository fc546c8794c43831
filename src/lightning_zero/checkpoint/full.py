"""One plain (full) state dict from a sharded model, and one into it: ``fabric.save`` with
``state_dict_type="full"``, ``fabric.load_raw``, and a set-up model's ``state_dict`` and
``load_state_dict``.

[Note: full state dicts] The engine's masters are the truth for every parameter it manages (each
element owned by one shard rank: ``engine.owned_ranges()``). Gathering: per parameter, a zero
tensor of its full size gets this rank's owned elements and is summed over the shard group (each
element is non-zero on one rank only, so the sum is exact); peak memory is one parameter. The
value is handed out in the dtype ddp would hold the parameter in (``value_dtype``: fp32 under
``32-true`` and the ``-mixed`` precisions, the half dtype under ``-true``), so a file we write is
the file ddp writes. Buffers and parameters outside the engine are whole on every rank and taken
as they are; a tied alias gets its canonical parameter's value.

[Note: torch's load traversal] Loading runs torch's own ``load_state_dict`` on the module: every
module's ``_load_from_state_dict`` (LitGPT's LoRA remaps ``attn.weight`` to ``attn.linear.weight``
there) and load-state-dict pre-hooks run, ``strict`` reports torch's missing and unexpected keys
with torch's error text. For the call's duration each engine-owned parameter is replaced in its
module by a receiver: a tensor of the parameter's shape and dtype backed by one broadcast element
whose ``copy_`` writes the value through to this rank's owned master elements at once. So a value
torch's loader accepts -- a tensor, an ``mmap``-ed one, LitGPT's lazily loaded
``_NotYetLoadedTensor`` -- is materialized one at a time, and a 70B load holds one tensor beyond
the shards. Buffers and parameters outside the engine are torch's business as usual. Afterwards
the engine refreshes the compute parameters from the masters (stages 1-2 all-gather, stage 3
refreshes the shard), also when torch raised (``strict``), so a rank is never half loaded. The
optimizer state is not part of it (a fresh load, as ``load_state_dict`` is under ddp).

[Note: dense experts in a full file] Under expert parallelism a rank holds its EP rank's rows of
each stacked expert tensor (``_ep_shard_dim``, [Note: expert domain] in ``zero/domains.py``). A full
file (``fabric.save`` with ``state_dict_type="full"``) is the file ddp writes, so its expert tensors
are the layers' whole ones: each is gathered over the EDP group (this EP rank's rows, whole), then
all-gathered over the EP group along ``_ep_shard_dim`` (``ep_gather_full``; peak memory one layer's
tensor), for the parameters and for their optimizer state alike. Loading takes either shape: a
whole tensor gives each rank its EP rank's rows (``ep_rows``), a tensor of the rank's own shape
(``model.state_dict()`` under the same ep) loads as it is. Experts that are Parameters of their own
(no ``_ep_shard_dim``: one EP rank holds each) have no whole tensor, so a full file is refused for
them (save the sharded checkpoint).

[Note: dense TP tensors in a full file] Under tensor parallelism a rank holds its TP rank's part
of each split parameter (``_tp_shard_dim``; LitGPT's fused ``qkv`` per segment: [Note: segmented
TP split] in ``tp/segments.py``). A full file is the one ddp writes, so each split tensor is
gathered over the dp group first (this TP rank's part, whole), then all-gathered over the TP group
(:func:`dense_tp`), for the parameters and their optimizer state alike, and for the parameters
the engine does not manage (LoRA's frozen base weights). Loading takes either shape: the model's
family step registers a load pre-hook that cuts a dense tensor to the rank's part (LitGPT's:
``models/litgpt/tensor_parallel.py``), and the optimizer state is cut here (:func:`tp_part`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lightning_zero.comm.collectives import all_gather
from lightning_zero.tp.segments import gather_dense, local_part, tp_segments
from lightning_zero.zero.domains import ep_shard_dim, is_expert_param

ValueDtype = Callable[[nn.Parameter], torch.dtype]


def _fp32(param: nn.Parameter) -> torch.dtype:
    return torch.float32 if param.is_floating_point() else param.dtype


def owned_runs_by_name(engine: Any) -> dict[str, list]:
    """``{parameter name: [OwnedRange, ...]}`` of what this rank owns."""
    owned: dict[str, list] = {}
    for run in engine.owned_ranges():
        owned.setdefault(run.name, []).append(run)
    return owned


def expert_domain_of(param: nn.Parameter, engine: Any) -> Optional[Any]:
    """The engine's ``ExpertDomain`` when ``param`` is an expert parameter under expert parallelism,
    else ``None`` ([Note: expert domain] in ``zero/domains.py``)."""
    domain = getattr(engine, "expert_domain", None)
    return domain if domain is not None and is_expert_param(param) else None


def dense_experts(local: torch.Tensor, param: nn.Parameter, engine: Any) -> torch.Tensor:
    """[Note: dense experts in a full file]: this EP rank's rows ``local`` of a stacked expert
    tensor -> the layer's whole tensor, every EP rank's rows in EP-rank order along the
    parameter's ``_ep_shard_dim`` (an all-gather over the EP group, ``ep_gather_full``); ``local``
    itself without expert parallelism. A collective over the EP group."""
    domain = expert_domain_of(param, engine)
    if domain is None or domain.ep_size == 1:
        return local
    dim = ep_shard_dim(param)
    if dim is None:
        raise ValueError(
            f"a full state dict under ep={domain.ep_size}: an expert parameter of shape {tuple(param.shape)} has no"
            " _ep_shard_dim (one expert's own Parameter, held by one EP rank), so no rank holds a dense tensor for"
            " its name; stack a layer's experts in one Parameter (zero/domains.mark_expert_param(p, shard_dim=0)),"
            " or save the sharded checkpoint"
        )
    rows = local.movedim(dim, 0).contiguous().to(engine.device)
    gathered = rows.new_empty((domain.ep_size * rows.shape[0], *rows.shape[1:]))
    all_gather(gathered, rows, domain.ep_group, label="ep_gather_full")
    return gathered.movedim(0, dim).contiguous().cpu()


def ep_rows(dense: torch.Tensor, param: nn.Parameter, engine: Any) -> torch.Tensor:
    """The inverse of :func:`dense_experts`: this EP rank's rows of a whole stacked expert tensor
    (a view; ``dense`` itself when it already has the parameter's shape or without expert
    parallelism). No collective."""
    domain = expert_domain_of(param, engine)
    dim = ep_shard_dim(param)
    if domain is None or domain.ep_size == 1 or dim is None or tuple(dense.shape) == tuple(param.shape):
        return dense
    rows = param.shape[dim]
    return dense.narrow(dim, domain.ep_rank * rows, rows)


def _tp_split(param: Any, engine: Any) -> Optional[tuple[int, dist.ProcessGroup]]:
    group, dim = getattr(engine, "tp_group", None), getattr(param, "_tp_shard_dim", None)
    if group is None or dim is None or dist.get_world_size(group) == 1:
        return None
    return dim, group


def dense_tp(local: torch.Tensor, param: Any, engine: Any) -> torch.Tensor:
    """[Note: dense TP tensors in a full file]: this TP rank's part ``local`` of a split parameter
    (or of its optimizer state) -> the dense tensor, on the host; ``local`` itself for a replicated
    one. A collective over the TP group for a split one."""
    split = _tp_split(param, engine)
    if split is None:
        return local
    dim, group = split
    return gather_dense(local.to(engine.device), dim, tp_segments(param), group).cpu()


def tp_part(dense: torch.Tensor, param: Any, engine: Any) -> torch.Tensor:
    """The inverse of :func:`dense_tp` (no collective): this TP rank's part of a dense tensor;
    ``dense`` itself when it already has the parameter's (local) shape."""
    split = _tp_split(param, engine)
    if split is None or tuple(dense.shape) == tuple(param.shape):
        return dense
    dim, group = split
    return local_part(dense, dim, tp_segments(param), dist.get_rank(group), dist.get_world_size(group))


def gather_param(param: nn.Parameter, runs: list, engine: Any, group: Optional[dist.ProcessGroup],
                 dtype: torch.dtype, *, dense: bool = False) -> torch.Tensor:  # fmt: skip
    """One parameter's full value on every rank of ``group`` (a collective), on the host. An expert
    parameter under expert parallelism is gathered over the engine's EDP group instead: this EP
    rank's experts, whole ([Note: expert domain] in ``zero/domains.py``), and with ``dense`` then
    every EP rank's (:func:`dense_experts`)."""
    domain = expert_domain_of(param, engine)
    if domain is not None:
        group = domain.group
    flat = torch.zeros(param.shape.numel(), dtype=torch.float32 if dtype.is_floating_point else dtype,
                       device=engine.device)  # fmt: skip
    for run in runs:
        flat[run.param_lo : run.param_hi] = run.master.detach()[run.chunk_lo : run.chunk_hi].to(flat.dtype)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    value = flat.view(param.shape).to(dtype)
    return (dense_tp(dense_experts(value, param, engine), param, engine) if dense else value).cpu()


def gather_full_state_dict(
    module: nn.Module,
    engine: Any,
    group: Optional[dist.ProcessGroup],
    *,
    value_dtype: ValueDtype = _fp32,
    keep: Optional[Callable[[str, Any], bool]] = None,
    dense: bool = False,
) -> dict[str, torch.Tensor]:
    """The module's state dict with full master values, on every rank (collective over ``group``,
    the engine's shard group). ``keep(key, tensor)``: only the keys it accepts (Fabric's
    ``filter``); a parameter no kept key names is not gathered. ``dense``: stacked expert
    parameters under expert parallelism hold every EP rank's experts (the whole layer's tensor, as
    ddp's model holds it: [Note: dense experts in a full file]); else this EP rank's."""
    entries = {k: t for k, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    if keep is not None:
        entries = {k: t for k, t in entries.items() if keep(k, t)}
    wanted = {id(t) for t in entries.values()}
    managed = engine.managed_parameters()
    owned = owned_runs_by_name(engine)
    full: dict[int, torch.Tensor] = {}
    with torch.no_grad(), record_function("lightning_zero::gather_full_state_dict"):
        for name, param in managed.items():  # the same order on every rank: one collective each
            if id(param) in wanted:
                full[id(param)] = gather_param(param, owned.get(name, []), engine, group, value_dtype(param),
                                               dense=dense)  # fmt: skip
    with torch.no_grad():  # outside the engine (LoRA's frozen weights): whole over dp; dense: gathered over tp
        for tensor in entries.values():
            if id(tensor) not in full:
                local = tensor.detach()
                full[id(tensor)] = (dense_tp(local, tensor, engine) if dense else local).cpu().clone()
    return {k: full[id(t)] for k, t in entries.items()}


def fill_gathered_values(
    state_dict: dict[str, Any], prefix: str, module: nn.Module, engine: Any, group: Optional[dist.ProcessGroup],
    value_dtype: ValueDtype, *, dense: bool = False,
) -> None:  # fmt: skip
    """``module.state_dict()``'s entries for the engine-owned parameters ``module`` holds directly
    (stage 3: no storage outside a forward) replaced by their gathered full values, one parameter at
    a time (a collective). An entry that is the parameter itself (``keep_vars=True``) stays.
    ``dense``: tp-split parameters, the engine's and the others, whole ([Note: dense TP tensors in
    a full file])."""
    name_of = {id(param): name for name, param in engine.managed_parameters().items()}
    owned = None
    with torch.no_grad(), record_function("lightning_zero::gather_state_dict"):
        for key, param in module._parameters.items():
            entry = prefix + key
            if param is None or entry not in state_dict or state_dict[entry] is param:
                continue
            if id(param) not in name_of:
                if dense and isinstance(state_dict[entry], torch.Tensor):
                    state_dict[entry] = dense_tp(state_dict[entry], param, engine)
                continue
            owned = owned if owned is not None else owned_runs_by_name(engine)
            state_dict[entry] = gather_param(param, owned.get(name_of[id(param)], []), engine, group,
                                             value_dtype(param), dense=dense)  # fmt: skip


class _Receiver(torch.Tensor):
    """Stands in for an engine-owned parameter during torch's ``load_state_dict``: its ``copy_``
    writes the value through to this rank's owned master elements ([Note: torch's load traversal])."""

    _runs: list
    _loaded: list
    _rows: Optional[tuple[int, int, int]]  # (dim, first, count): this EP rank's rows of a whole tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and args and isinstance(args[0], _Receiver):
            args[0]._write(args[1])
            return args[0]
        if func is torch.Tensor.module_load:
            raise ValueError(
                "load_state_dict on a ZeRO-sharded model under torch.__future__.set_swap_module_params_on_conversion"
                "(True): the engine owns the parameters' storage and cannot swap them; turn the flag off."
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def _write(self, source: Any) -> None:
        if not isinstance(source, torch.Tensor) and callable(getattr(source, "_load_tensor", None)):
            source = source._load_tensor()  # LitGPT / Fabric's lazily loaded tensor: read now, one at a time
        with torch._C.DisableTorchFunctionSubclass():
            if self._rows is not None:  # a whole stacked expert tensor: this EP rank's rows
                dim, start, count = self._rows
                source = source.narrow(dim, start, count)
            flat = source.detach().reshape(-1)
            for run in self._runs:
                run.master.detach()[run.chunk_lo : run.chunk_hi].copy_(flat[run.param_lo : run.param_hi])
        self._loaded.append(True)


def _receiver(param: nn.Parameter, runs: list, engine: Any, saved: Any = None) -> _Receiver:
    """Under expert parallelism a stacked expert parameter whose ``saved`` value is the layer's
    whole tensor receives that shape (the one torch's load checks) and keeps this EP rank's rows
    ([Note: dense experts in a full file]); a value of this rank's shape loads as it is."""
    shape, rows = param.shape, None
    domain, dim = expert_domain_of(param, engine), ep_shard_dim(param)
    if domain is not None and domain.ep_size > 1 and dim is not None:
        whole = (*param.shape[:dim], domain.ep_size * param.shape[dim], *param.shape[dim + 1 :])
        if tuple(getattr(saved, "shape", ())) == whole:
            shape, rows = whole, (dim, domain.ep_rank * param.shape[dim], param.shape[dim])
    one = torch.empty((), dtype=param.dtype, device="cpu").expand(shape)
    receiver = torch.Tensor._make_subclass(_Receiver, one, False)
    receiver._runs, receiver._loaded, receiver._rows = runs, [], rows
    return receiver


def load_full_state_dict(
    module: nn.Module, engine: Any, state_dict: Any, *, strict: bool = True, assign: bool = False
) -> Any:
    """``module.load_state_dict(state_dict, strict)`` with torch's semantics, written through to the
    engine's masters ([Note: torch's load traversal]). Returns torch's ``_IncompatibleKeys``; raises
    torch's ``RuntimeError`` when ``strict``. A collective (the masters' refresh): every rank calls it
    with the same keys."""
    if assign:
        raise ValueError(
            "load_state_dict(assign=True) on a ZeRO-sharded model: the engine owns the parameters' storage, so"
            " they cannot be replaced by the state dict's tensors; use assign=False (the values are copied in)."
        )
    managed = engine.managed_parameters()
    owned = owned_runs_by_name(engine)
    saved = state_dict if isinstance(state_dict, dict) else {}
    receivers = {
        id(param): _receiver(param, owned.get(name, []), engine, saved.get(name)) for name, param in managed.items()
    }
    swapped: list[tuple[dict, str, nn.Parameter]] = []
    for child in module.modules():
        for key, param in child._parameters.items():
            if param is not None and id(param) in receivers:
                swapped.append((child._parameters, key, param))
    try:
        for owner, key, param in swapped:
            owner[key] = receivers[id(param)]
        with record_function("lightning_zero::load_full_state_dict"):
            return type(module).load_state_dict(module, state_dict, strict=strict)
    finally:
        for owner, key, param in swapped:
            owner[key] = param
        engine.refresh_params_from_masters()
