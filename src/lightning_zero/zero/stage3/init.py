"""Sharded initialization: build stage-3 units from a (possibly meta-device) module.

[Note: init order] Materialize and initialize in module pre-order, as a single process building
the model would: a unit when its module comes up, root modules as they come up (the root stays
whole until the end), so random draws happen in the same order for models that initialize in
that order (``Llama.init_module``).

[Note: buffer init] Buffers are state too. A tensor built under ``fabric.init_module(empty_init=True)``
takes the value its recorded initializers give ([Note: deferred init] in ``deferred.py``: eager
construction's values, whatever the order). Any other tensor materialized from the meta device
(built under the Trainer's ``configure_model``, or made after construction by factory calls no
recorded tensor took part in, as LitGPT's rotary cache is) is first filled with a sentinel (NaN for
floats, the dtype's minimum for integers), then initialized by, in this order: the model's
``init_module(module)`` (this project's Llama; always, when it reads pretrained weights from its
``weight_source``); the ``_init_weights`` of the nearest Hugging Face ``PreTrainedModel`` above it
(which recomputes rotary ``inv_freq`` and BatchNorm statistics); the module's own
``reset_parameters()``. Those fallbacks write only sentinel tensors: a tensor the record gave a
value keeps it. A tensor still holding the sentinel afterwards had no initializer: setup fails
naming it, instead of training on garbage.
Initialization never changes a tensor's dtype: one that an initializer replaced by a tensor of
another dtype (LitGPT's ``reset_parameters`` recomputes its rotary ``cos``/``sin`` in fp32) is cast
back to the dtype it had on the meta device, where the precision converted it (``bf16-true``:
ddp's module holds those buffers in bf16, converted with the rest of it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.zero.bucketing import grad_bucket_numel
from lightning_zero.zero.domains import ExpertDomain, is_expert_param
from lightning_zero.zero.flat import FlatLayout, FlatSpec, fp32_parameter_ids
from lightning_zero.zero.stage3.deferred import fill_sentinel
from lightning_zero.zero.stage3.storage import ShardedFlatParamGroup
from lightning_zero.zero.stage3.units import (
    Unit,
    WrapPolicy,
    assign_params,
    default_wrap_policy,
    find_units,
    warn_if_single_unit,
)


def _direct_tensors(module: nn.Module) -> list[tuple[dict, str]]:
    """(owner dict, key) of the parameters and buffers ``module`` holds directly."""
    return [(module._parameters, k) for k, v in module._parameters.items() if v is not None] + [
        (module._buffers, k) for k, v in module._buffers.items() if v is not None
    ]


def _still_sentinel(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == torch.iinfo(tensor.dtype).min).all())


_DEFERRED_MARKS = ("_lz_record", "_is_param")  # a DeferredTensor's own attributes, not the model's


def _materialize(modules: list[nn.Module], device: torch.device) -> list[tuple[nn.Module, str]]:
    """Give meta parameters/buffers held directly by ``modules`` real storage holding their
    recorded value, or else a sentinel ([Note: buffer init]); returns (module, key) of each tensor
    materialized."""
    fresh: list[tuple[nn.Module, str]] = []
    with torch.no_grad():
        for module in modules:
            for owner, key in _direct_tensors(module):
                tensor = owner[key]
                if not tensor.is_meta:
                    continue
                record = getattr(tensor, "_lz_record", None)  # [Note: deferred init] in deferred.py
                recorded = record.value_of(tensor) if record is not None else None
                value = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                if recorded is not None:
                    value.copy_(recorded)
                else:
                    fill_sentinel(value)
                if isinstance(tensor, nn.Parameter):
                    # Same Python object (optimizers and ties hold it), new device: swap the tensors.
                    real = nn.Parameter(value, tensor.requires_grad)
                    marks = {k: v for k, v in tensor.__dict__.items() if k not in _DEFERRED_MARKS}
                    real.__dict__.update(marks)  # keep marks such as _tp_shard_dim
                    torch.utils.swap_tensors(tensor, real)
                else:
                    owner[key] = value
                fresh.append((module, key))
    return fresh


def _tensor(module: nn.Module, key: str) -> torch.Tensor:
    return module._parameters[key] if key in module._parameters else module._buffers[key]


def _hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """module id -> the nearest Hugging Face PreTrainedModel at or above it (duck-typed: ``_init_weights``,
    ``post_init`` and a ``config``; LitGPT's ``GPT`` has an ``_init_weights`` too, which its own scripts
    never apply -- they call ``reset_parameters`` -- so without ``post_init`` a model is not one)."""
    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: Optional[nn.Module]) -> None:
        if (
            callable(getattr(module, "_init_weights", None))
            and callable(getattr(module, "post_init", None))
            and hasattr(module, "config")
        ):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return owners


def _init(
    modules: list[nn.Module],
    fresh: list[tuple[nn.Module, str]],
    init_owner: Optional[nn.Module],
    hf_owners: dict[int, nn.Module],
    qualified: dict[int, str],
) -> None:
    """Initialize freshly materialized modules in pre-order ([Note: buffer init])."""
    covered: set[int] = set()
    fresh_by_module: dict[int, list[str]] = {}
    built_dtypes = [_tensor(module, key).dtype for module, key in fresh]  # the meta tensors' (converted) dtypes
    for module, key in fresh:
        fresh_by_module.setdefault(id(module), []).append(key)
    # a model reading pretrained weights (its weight_source) initializes every unit it knows itself
    reads = init_owner is not None and getattr(init_owner, "weight_source", None) is not None
    with torch.no_grad():
        for module in modules:
            if id(module) in covered:
                continue
            subtree = [(m, k) for m in module.modules() for k in fresh_by_module.get(id(m), [])]
            if not reads and not any(_still_sentinel(_tensor(m, k)) for m, k in subtree):
                continue  # every tensor here has its recorded value ([Note: deferred init])
            with _keeping_initialized(subtree if not reads else []):
                if init_owner is not None and init_owner.init_module(module):
                    covered.update(id(m) for m in module.modules())
                    continue
                hf = hf_owners.get(id(module))
                if hf is not None and _direct_tensors(module):
                    hf._init_weights(module)
                keys = fresh_by_module.get(id(module), [])
                pending = [k for k in keys if _still_sentinel(_tensor(module, k))]
                if pending and callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    for (module, key), dtype in zip(fresh, built_dtypes):
        _keep_dtype(module, key, dtype)
    for module, key in fresh:
        if _still_sentinel(_tensor(module, key)):
            kind = "parameter" if key in module._parameters else "buffer"
            name = f"{qualified.get(id(module), '?')}.{key}".lstrip(".")
            raise RuntimeError(
                f"lightning_zero ZeRO-3 sharded init: {kind} {name!r} ({type(module).__name__}) was created on the"
                " meta device and nothing initialized it (no init_module, no Hugging Face _init_weights case, no"
                f" reset_parameters() that sets it). Give {type(module).__name__} a reset_parameters() that fills"
                f" {key!r}, or build this module outside configure_model."
            )


@contextmanager
def _keeping_initialized(tensors: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """The fallback initializers run inside write only the tensors still holding the sentinel:
    the others (recorded values) are put back after them ([Note: buffer init])."""
    kept = [(module, key, _tensor(module, key).clone()) for module, key in tensors]
    kept = [(module, key, value) for module, key, value in kept if not _still_sentinel(value)]
    try:
        yield
    finally:
        for module, key, value in kept:
            tensor = _tensor(module, key)
            if tensor.shape == value.shape:
                tensor.data.copy_(value.to(tensor.dtype))
            elif key in module._parameters:
                tensor.data = value
            else:
                module._buffers[key] = value


def _keep_dtype(module: nn.Module, key: str, dtype: torch.dtype) -> None:
    """An initializer that replaced ``module.<key>`` by a tensor of another dtype: cast it back to
    ``dtype``, the one it was built (and converted) with ([Note: buffer init])."""
    tensor = _tensor(module, key)
    if tensor.dtype == dtype:
        return
    with torch.no_grad():
        if key in module._parameters:
            tensor.data = tensor.data.to(dtype)
        else:
            module._buffers[key] = tensor.to(dtype)


def _broadcast(modules: list[nn.Module], group: Optional[dist.ProcessGroup], expert: Optional[ExpertDomain]) -> None:
    """Every rank of ``group`` gets rank 0's values; expert parameters only within ``expert``'s
    group (the EP ranks hold different experts: [Note: expert domain])."""
    with torch.no_grad():
        for module in modules:
            for owner, key in _direct_tensors(module):
                over = expert.group if expert is not None and is_expert_param(owner[key]) else group
                src = dist.get_global_rank(over, 0) if over is not None else 0
                dist.broadcast(owner[key].data, src=src, group=over)


def build_units(
    module: nn.Module,
    optimizers: list[Any],
    spec: FlatSpec,
    *,
    dp_group: Optional[dist.ProcessGroup],
    policy: WrapPolicy = default_wrap_policy,
    offload: bool = False,
) -> tuple[list[Unit], list[list[list[ShardedFlatParamGroup]]], int, list[nn.Module]]:
    """Cut ``module`` into units and shard each one's parameters, one unit at a time.

    Meta-device parameters and buffers are materialized, initialized and broadcast from dp rank 0
    one unit at a time, then reduced to this rank's shard, so no process ever holds more than one
    unit in full (sharded initialization). Parameters shared by several units go to the root
    ([Note: shared parameters]). Each unit keeps one flat group per (optimizer, param group) for
    trainable parameters and one per dtype for frozen ones (never cast, never stepped), each cut
    once more by domain: expert parameters are sharded over ``expert``'s group ([Note: expert
    domain] in ``zero/domains.py``). Returns the
    units (root last), per optimizer and param group the sharded groups the optimizer steps, the
    peak parameter bytes during init, and the root holders.
    """
    names, order, device, expert = spec.names, spec.order, spec.device, spec.expert
    compute_dtype, master_dtype, param_comm_dtype = spec.compute_dtype, spec.master_dtype, spec.param_comm_dtype
    found = find_units(module, policy)
    warn_if_single_unit(module, len(found), policy)
    owner, root_modules, root_holders = assign_params(module, found)
    root_index = len(found)
    init_owner = next((m for m in module.modules() if callable(getattr(m, "init_module", None))), None)
    hf_owners = _hf_owners(module)
    qualified = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}

    slot_of: dict[int, tuple[int, int]] = {}  # param id -> (optimizer, param group)
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, param_group in enumerate(optimizer.param_groups):
            for param in param_group["params"]:
                if param.requires_grad:
                    slot_of[id(param)] = (opt_index, group_index)
    per_optimizer: list[list[list[ShardedFlatParamGroup]]] = [
        [[] for _ in optimizer.param_groups] for optimizer in optimizers
    ]

    unit_at = {id(unit_module): index for index, (_, unit_module) in enumerate(found)}
    root_ids = {id(m) for m in root_modules}
    peak_bytes = 0

    def materialize(modules: list[nn.Module]) -> None:
        fresh = _materialize(modules, device)
        if fresh:
            _init(modules, fresh, init_owner, hf_owners, qualified)
            _broadcast(modules, dp_group, expert)

    walk: list[tuple[int, Optional[nn.Module]]] = []
    for candidate in module.modules():
        if id(candidate) in unit_at:
            walk.append((unit_at[id(candidate)], None))
        elif id(candidate) in root_ids:
            walk.append((root_index, candidate))
    walk.append((root_index, None))  # the root is sharded last

    built: dict[int, Unit] = {}
    for index, root_module in walk:
        if root_module is not None:
            materialize([root_module])
            peak_bytes = max(peak_bytes, live_parameter_bytes(module))
            continue
        if index in built:
            continue
        if index < root_index:
            name, unit_module = found[index]
            materialize(list(unit_module.modules()))
            candidates = list(unit_module.parameters())
        else:
            name, unit_module = "<root>", None
            candidates = list(module.parameters())
        params = [p for p in candidates if owner.get(id(p)) == index]
        peak_bytes = max(peak_bytes, live_parameter_bytes(module))
        unit = Unit(index=index, name=name, module=unit_module)
        by_key: dict[Any, list[nn.Parameter]] = {}
        keep_fp32 = (
            fp32_parameter_ids(unit_module or module)
            if compute_dtype != torch.float32 and spec.norms_in_fp32
            else set()
        )
        for param in params:
            key = slot_of.get(id(param), ("frozen", param.dtype))
            if key[0] != "frozen" and id(param) in keep_fp32:
                key = (*key, torch.float32)  # norm layers with running stats stay fp32 (as in stages 1-2)
            domain = expert if expert is not None and is_expert_param(param) else None
            by_key.setdefault((domain is not None, key), []).append(param)
        for (in_expert_domain, key), members in by_key.items():
            members.sort(key=lambda p: order[id(p)])
            domain = expert if in_expert_domain else None
            size, rank = (spec.dp_size, spec.dp_rank) if domain is None else (domain.size, domain.rank)
            managed = key[0] != "frozen"
            dtype = (key[2] if len(key) == 3 else compute_dtype) if managed else members[0].dtype
            # [Note: bucket_mb counts gradient bytes]: bytes of the gradient dtype (frozen: of their own)
            bucket_numel = grad_bucket_numel(spec.bucket_mb, dtype.itemsize, spec.reduce_in_fp32 and managed)
            layout = FlatLayout(members, [names[id(p)] for p in members], dp=size, bucket_numel=bucket_numel)
            group = ShardedFlatParamGroup(
                layout,
                dp_rank=rank,
                compute_dtype=dtype,
                device=device,
                master_dtype=(master_dtype if dtype == compute_dtype else torch.float32) if managed else dtype,
                offload=offload and managed,
                param_comm_dtype=param_comm_dtype if managed else None,  # frozen weights travel exact
            )
            group.domain = domain
            unit.groups.append(group)
            if managed:
                opt_index, group_index = key[:2]
                per_optimizer[opt_index][group_index].append(group)
        built[index] = unit
    # Units left without parameters (all theirs were shared) disappear; indices are positions.
    units = [built[index] for index in sorted(built) if built[index].groups or index == root_index]
    for position, unit in enumerate(units):
        unit.index = position
    return units, per_optimizer, peak_bytes, root_holders


def live_parameter_bytes(module: nn.Module) -> int:
    """Bytes of real (non-meta) storage behind ``module``'s parameters, each storage counted once."""
    seen: dict[int, int] = {}
    for param in module.parameters():
        if not param.is_meta:
            storage = param.untyped_storage()
            seen[storage.data_ptr() if storage.nbytes() else id(storage)] = storage.nbytes()
    return sum(seen.values())
