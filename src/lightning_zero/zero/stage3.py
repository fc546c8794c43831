"""ZeRO stage 3: parameters live only as each rank's shard; units are gathered just in time.

What stage 3 does differently from stage 2 is all in this file:

- **Units.** The module is cut into units (by default: every child of an ``nn.ModuleList`` -- the
  repeated blocks --, every ``nn.Embedding``, and every module with parameters beside a block
  list -- the final norm and the LM head); whatever is left belongs to the *root* unit. Each unit's
  parameters form :class:`ShardedFlatParamGroup` s (one per optimizer param group) with the same
  bucket layout as stages 1-2 ([Note: flat layout] in ``flat.py``), but only this rank's chunk of
  each bucket persists. Parameters are views into a full-size buffer whose *storage* is
  allocated (and all-gathered into) only while the unit runs, and resized to zero afterwards, so
  tensors autograd saved in forward see the re-gathered values in backward.
- **Forward.** A unit's forward pre-hook waits for its all-gather (or starts it) and starts the
  all-gathers of the next ``prefetch_blocks`` units; the post-hook frees it. The root unit is
  gathered by :meth:`Stage3Runtime.begin_step` and freed when backward (or the eval step) ends.
- **Backward.** A hook on the unit's outputs gathers it again before its backward runs and
  prefetches the units whose backward comes next; once every parameter of the unit has its
  gradient (post-accumulate-grad hooks) it is freed. Gradients go through the same bucketed
  async reduce-scatter as stage 2 (``reducer.ShardedGradStorage``).
- **After the step** nothing is gathered: the optimizer writes the updated chunk, and the next
  forward gathers it.

[Note: gather schedule] Every rank must issue the same all-gathers in the same order. The first
step of each kind (training forward, training backward, evaluation forward) *records* the order
units are gathered in, checking before every gather that all ranks agree (one tiny all-gather of
the unit index): a disagreement -- a module run a different number of times, or skipped, on one
rank -- raises an error naming the module on every rank instead of a hang. Later steps follow the
recorded schedule: a unit skipped on this rank is still gathered (and freed at once) when a later
unit is reached, units left at the end of backward are flushed, and a unit run more often than
recorded raises. All-gathers run on their own process group (a clone of the dp group), so their
order never interleaves with the gradient reduce-scatters'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lightning_zero.collectives import CommCounter, all_gather
from lightning_zero.zero.flat import BucketLayout, ChunkedParamGroup, FlatLayout

WrapPolicy = Callable[[nn.Module, nn.Module], bool]  # (module, parent) -> is a unit


def default_wrap_policy(module: nn.Module, parent: Optional[nn.Module]) -> bool:
    """Blocks of a ModuleList, embeddings, and every module with parameters that sits beside a
    block list (for a decoder: the embedding, the final norm and the LM head).

    Embeddings are recognized by shape (``num_embeddings``), so tensor-parallel versions count.
    """
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False  # containers have no forward to hook; their children may be units
    if isinstance(parent, nn.ModuleList):
        return True
    if isinstance(module, nn.Embedding) or hasattr(module, "num_embeddings"):
        return True
    if parent is not None and any(True for _ in module.parameters()):
        return any(isinstance(child, nn.ModuleList) for child in parent.children())
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
    return [(name, module) for name, module in units if any(True for _ in module.parameters())]


class ShardedFlatParamGroup(ChunkedParamGroup):
    """Stage-3 storage for a :class:`FlatLayout`: only this rank's chunk of every bucket persists.

    ``shard_buffer`` holds the rank's chunks (compute dtype) end to end; ``full_buffer`` is the
    whole group, its storage allocated only while gathered; parameters are views into it.
    """

    def __init__(
        self,
        layout: FlatLayout,
        *,
        dp_rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        master_dtype: torch.dtype = torch.float32,
        offload: bool = False,
    ) -> None:
        super().__init__(
            layout, dp_rank=dp_rank, compute_dtype=compute_dtype, device=device, master_dtype=master_dtype, offload=offload
        )
        self._shard_offsets: list[int] = []
        offset = 0
        for bucket in layout.buckets:
            self._shard_offsets.append(offset)
            offset += bucket.shard_numel
        self.shard_buffer = torch.zeros(offset, dtype=compute_dtype, device=device)
        if self.masters_alias_params:
            for bucket in layout.buckets:
                start = bucket.shard_start(dp_rank)
                layout.copy_range_from_params(start, start + bucket.shard_numel, self.param_shard(bucket))
            self.masters = self._masters_aliasing_chunks()
        else:
            self.masters = self._masters_from_params()
            self.copy_masters_to_params()

        self.full_buffer = torch.empty(layout.numel, dtype=compute_dtype, device=device)
        self.full_nbytes = self.full_buffer.untyped_storage().nbytes()
        for slot in layout.slots:
            slot.param.data = self.full_buffer[slot.offset : slot.end].view(slot.shape)
        self.free()

    # -- storage --------------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.full_buffer.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        if not self.is_allocated:
            self.full_buffer.untyped_storage().resize_(self.full_nbytes)

    def free(self) -> None:
        self.full_buffer.untyped_storage().resize_(0)

    def param_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.full_buffer[bucket.start : bucket.end]

    def param_shard(self, bucket: BucketLayout) -> torch.Tensor:
        offset = self._shard_offsets[bucket.index]
        return self.shard_buffer[offset : offset + bucket.shard_numel]

    def param_bytes(self) -> int:
        shard = self.shard_buffer.numel() * self.shard_buffer.element_size()
        return shard + self.full_buffer.untyped_storage().nbytes()


@dataclass
class Unit:
    """A module whose parameters are gathered and freed together, with its in-flight gathers."""

    index: int
    name: str
    module: Optional[nn.Module]  # None for the root unit (parameters outside every unit module)
    groups: list[ShardedFlatParamGroup] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    gathered: bool = False
    grads_pending: int = 0
    backward_started: bool = False

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [slot.param for group in self.groups for slot in group.layout.slots if slot.param.requires_grad]


@dataclass
class Schedule:
    """The order units were gathered in during the first step of a kind ([Note: gather schedule])."""

    order: list[int] = field(default_factory=list)
    recorded: bool = False
    position: int = 0


class Stage3Runtime:
    """Gathers, prefetches and frees units around forward and backward (see module docstring).

    Args:
        units: the units, root last.
        ag_group: process group for parameter all-gathers (a clone of the dp group).
        prefetch_blocks: units whose all-gather is started ahead of the one running.
        counter: logical bytes sent are added here.
    """

    def __init__(self, units: list[Unit], ag_group: dist.ProcessGroup, *, prefetch_blocks: int, counter: CommCounter) -> None:
        self.units = units
        self.root = units[-1]
        self.ag_group = ag_group
        self.prefetch_blocks = prefetch_blocks
        self.counter = counter
        self.schedules: dict[str, Schedule] = {}
        self.in_backward = False
        self.step = 0
        self.high_water_forward = 0  # most non-root units gathered at once during forward
        self.high_water_backward = 0
        self._handles: list[Any] = []
        for unit in units:
            if unit.module is not None:
                self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
                self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
            for param in unit.trainable:
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_grad_ready(unit)))

    # -- gathering ------------------------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        with record_function(f"lightning_zero::all_gather_unit::{unit.name}"):
            for group in unit.groups:
                group.allocate()
                unit.works.extend(group.start_all_gather(self.ag_group, self.counter))
        unit.gathered = True

    def _wait(self, unit: Unit) -> None:
        if unit.works:
            with record_function(f"lightning_zero::wait_all_gather::{unit.name}"):
                for work in unit.works:
                    work.wait()
            unit.works.clear()

    def _free(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        self._wait(unit)
        with record_function(f"lightning_zero::free_unit::{unit.name}"):
            for group in unit.groups:
                group.free()
        unit.gathered = False

    def _gathered_blocks(self) -> int:
        return sum(1 for unit in self.units[:-1] if unit.gathered)

    def _agree(self, unit: Unit, kind: str) -> None:
        """First step only: every rank must be about to gather the same unit."""
        mine = torch.tensor([unit.index], dtype=torch.int64, device=unit.groups[0].shard_buffer.device)
        size = dist.get_world_size(self.ag_group)
        everyone = torch.empty(size, dtype=torch.int64, device=mine.device)
        all_gather(everyone, mine, self.ag_group)
        if bool((everyone != unit.index).any()):
            names = ", ".join(
                f"dp rank {r}: {self.units[int(i)].name if 0 <= int(i) < len(self.units) else 'nothing'}"
                for r, i in enumerate(everyone.tolist())
            )
            raise RuntimeError(
                f"lightning_zero ZeRO-3: ranks disagree on the next module to gather during {kind} of step"
                f" {self.step} ({names}). Every rank must run the same modules the same number of times"
                " per step; a module skipped or run more often on one rank would deadlock the all-gathers."
                " Make the control flow identical on all ranks (e.g. run the module with zero-weight input)."
            )

    def _schedule(self, kind: str) -> Schedule:
        return self.schedules.setdefault(kind, Schedule())

    def _reach(self, unit: Unit, kind: str) -> None:
        """Gather ``unit`` following the schedule of ``kind``; prefetch the next ones."""
        schedule = self._schedule(kind)
        if not schedule.recorded:
            if not unit.gathered:
                self._agree(unit, kind)
                schedule.order.append(unit.index)
                self._start_gather(unit)
            self._wait(unit)
            return
        order = schedule.order
        try:
            found = order.index(unit.index, schedule.position)
        except ValueError:
            if unit.gathered:  # run again while still gathered: nothing to communicate
                self._wait(unit)
                return
            raise RuntimeError(
                f"lightning_zero ZeRO-3: module {unit.name!r} ran during {kind} of step {self.step} more often"
                " than in the first step (or out of the recorded order). Every rank must run the same modules"
                " the same number of times per step."
            ) from None
        for skipped in order[schedule.position : found]:  # ran on other ranks, not here: keep in step
            skipped_unit = self.units[skipped]
            self._start_gather(skipped_unit)
            self._free(skipped_unit)
        schedule.position = found + 1
        self._start_gather(unit)
        for ahead in order[found + 1 : found + 1 + self.prefetch_blocks]:
            self._start_gather(self.units[ahead])
        self._wait(unit)

    def _finish(self, kind: str) -> None:
        """End of a phase: flush what the schedule still expects, free everything, mark recorded."""
        schedule = self._schedule(kind)
        if schedule.recorded:
            for index in schedule.order[schedule.position :]:
                unit = self.units[index]
                if not unit.gathered:
                    self._start_gather(unit)
                self._free(unit)
        schedule.recorded = True
        schedule.position = 0

    # -- hooks ----------------------------------------------------------------------------------
    def _forward_kind(self) -> str:
        return "training forward" if torch.is_grad_enabled() else "evaluation forward"

    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any) -> None:
            if self.in_backward:  # activation-checkpoint recompute inside backward
                if not unit.gathered:
                    self._start_gather(unit)
                self._wait(unit)
                return
            self._reach(unit, self._forward_kind())
            self.high_water_forward = max(self.high_water_forward, self._gathered_blocks())

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.in_backward:
                return output
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._make_pre_backward(unit))
            self._free(unit)
            return output

        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            if not self.in_backward:
                self.in_backward = True
                self._finish("training forward")
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            if not unit.backward_started:
                unit.backward_started = True
                unit.grads_pending = len(unit.trainable)
                self._reach(unit, "training backward")
            self.high_water_backward = max(self.high_water_backward, self._gathered_blocks())

        return hook

    def _make_grad_ready(self, unit: Unit):
        def hook(param: torch.Tensor) -> None:
            if unit is self.root or not self.in_backward:
                return
            unit.grads_pending -= 1
            if unit.grads_pending == 0:
                self._free(unit)

        return hook

    def _on_backward_end(self) -> None:
        self._finish("training backward")
        for unit in self.units:
            self._free(unit)
            unit.backward_started = False
        self.in_backward = False
        self.step += 1

    # -- step boundaries (called by the strategy around each step) -----------------------------
    def begin_step(self) -> None:
        """Gather the root unit (its parameters are used outside any unit module)."""
        if self.in_backward:
            return
        if self.root.groups and not self.root.gathered:
            self._start_gather(self.root)
            self._wait(self.root)

    def end_eval_step(self) -> None:
        """After a forward without backward: free everything and close the evaluation schedule."""
        if self.in_backward:
            return
        self._finish("evaluation forward")
        for unit in self.units:
            self._free(unit)

    def unshard(self) -> None:
        """Give every parameter its own full tensor again (after training; collective over dp)."""
        for unit in self.units:
            self._start_gather(unit)
            self._wait(unit)
            for group in unit.groups:
                for slot in group.layout.slots:
                    slot.param.data = slot.param.data.clone()
            self._free(unit)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def clone_dp_group(dp_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """A new process group with the same ranks as ``dp_group`` (collective over the world)."""
    mine = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(dist.get_world_size()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unique = sorted({tuple(ranks) for ranks in everyone})
    clone = None
    for ranks in unique:
        group = dist.new_group(list(ranks))
        if tuple(mine) == ranks:
            clone = group
    assert clone is not None
    return clone


# -- building units -----------------------------------------------------------------------------
def _direct_tensors(module: nn.Module) -> list[tuple[dict, str]]:
    """(owner dict, key) of the parameters and buffers ``module`` holds directly."""
    return [(module._parameters, k) for k, v in module._parameters.items() if v is not None] + [
        (module._buffers, k) for k, v in module._buffers.items() if v is not None
    ]


def _materialize(modules: list[nn.Module], device: torch.device) -> bool:
    """Give meta parameters/buffers held directly by ``modules`` real (uninitialized) storage."""
    any_meta = False
    for module in modules:
        for owner, key in _direct_tensors(module):
            tensor = owner[key]
            if tensor.is_meta:
                any_meta = True
                if isinstance(tensor, nn.Parameter):
                    # Same Python object (the optimizer holds it), new device: swap the tensors.
                    real = nn.Parameter(torch.empty(tensor.shape, dtype=tensor.dtype, device=device), tensor.requires_grad)
                    real.__dict__.update(tensor.__dict__)  # keep marks such as _tp_shard_dim
                    torch.utils.swap_tensors(tensor, real)
                else:
                    owner[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return any_meta


def _init(modules: list[nn.Module], init_owner: Optional[nn.Module]) -> None:
    """Initialize freshly materialized modules in pre-order, as a single process would.

    A model that defines ``init_module(module) -> bool`` (see ``Llama.init_module``) initializes
    the modules it knows (returning True when it covered the whole subtree); any other module
    with a ``reset_parameters`` resets its own tensors.
    """
    covered: set[int] = set()
    with torch.no_grad():
        for module in modules:
            if id(module) in covered:
                continue
            handled = init_owner is not None and init_owner.init_module(module)
            if handled:
                covered.update(id(m) for m in module.modules())
            elif callable(getattr(module, "reset_parameters", None)) and _direct_tensors(module):
                module.reset_parameters()


def _broadcast(modules: list[nn.Module], group: Optional[dist.ProcessGroup]) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for module in modules:
            for owner, key in _direct_tensors(module):
                dist.broadcast(owner[key].data, src=src, group=group)


def build_units(
    module: nn.Module,
    optimizers: list[Any],
    *,
    names: dict[int, str],
    order: dict[int, int],
    dp_group: Optional[dist.ProcessGroup],
    dp_size: int,
    dp_rank: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    bucket_numel: int,
    policy: WrapPolicy = default_wrap_policy,
    offload: bool = False,
) -> tuple[list[Unit], list[list[list[ShardedFlatParamGroup]]], int]:
    """Cut ``module`` into units and shard each one's parameters, one unit at a time.

    Meta-device parameters are materialized, initialized and broadcast from dp rank 0 one unit at
    a time, then reduced to this rank's shard, so no process ever holds more than one unit in
    full (sharded initialization). Returns the units (root last) and, per optimizer and param
    group, the sharded groups the optimizer steps.
    """
    unit_modules = find_units(module, policy)
    unit_of: dict[int, int] = {}
    for index, (_, unit_module) in enumerate(unit_modules):
        for param in unit_module.parameters():
            unit_of.setdefault(id(param), index)
    root_index = len(unit_modules)
    inside_units = {id(m) for _, unit_module in unit_modules for m in unit_module.modules()}
    root_modules = [m for m in module.modules() if id(m) not in inside_units]
    init_owner = next((m for m in module.modules() if callable(getattr(m, "init_module", None))), None)

    slot_of: dict[int, tuple[int, int]] = {}  # param id -> (optimizer, param group)
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, param_group in enumerate(optimizer.param_groups):
            for param in param_group["params"]:
                if param.requires_grad:
                    slot_of[id(param)] = (opt_index, group_index)
    per_optimizer: list[list[list[ShardedFlatParamGroup]]] = [
        [[] for _ in optimizer.param_groups] for optimizer in optimizers
    ]

    # [Note: init order] Materialize and initialize in module pre-order, as a single process
    # building the model would: a unit when its module comes up, root modules as they come up
    # (the root stays whole until the end), so random draws happen in the same order.
    unit_at = {id(unit_module): index for index, (_, unit_module) in enumerate(unit_modules)}
    root_ids = {id(m) for m in root_modules}
    ready: set[int] = set()
    peak_bytes = 0

    def materialize(modules: list[nn.Module]) -> None:
        if _materialize(modules, device):
            _init(modules, init_owner)
            _broadcast(modules, dp_group)

    walk: list[tuple[int, Optional[nn.Module]]] = []
    for candidate in module.modules():
        if id(candidate) in unit_at:
            walk.append((unit_at[id(candidate)], None))
        elif id(candidate) in root_ids:
            walk.append((root_index, candidate))
    walk.append((root_index, None))  # the root is sharded last

    units: list[Optional[Unit]] = [None] * (root_index + 1)
    for index, root_module in walk:
        if root_module is not None:
            materialize([root_module])
            peak_bytes = max(peak_bytes, live_parameter_bytes(module))
            continue
        if index in ready:
            continue
        ready.add(index)
        if index < root_index:
            name, unit_module = unit_modules[index]
            modules = list(unit_module.modules())
            params = list(unit_module.parameters())
            materialize(modules)
        else:
            name, unit_module, modules = "<root>", None, root_modules
            params = [p for p in module.parameters() if id(p) not in unit_of]
        peak_bytes = max(peak_bytes, live_parameter_bytes(module))
        unit = Unit(index=index, name=name, module=unit_module)
        by_key: dict[Any, list[nn.Parameter]] = {}
        for param in params:
            by_key.setdefault(slot_of.get(id(param), "unmanaged"), []).append(param)
        for key, members in by_key.items():
            members.sort(key=lambda p: order[id(p)])
            layout = FlatLayout(members, [names[id(p)] for p in members], dp=dp_size, bucket_numel=bucket_numel)
            managed = key != "unmanaged"
            group = ShardedFlatParamGroup(
                layout,
                dp_rank=dp_rank,
                compute_dtype=compute_dtype if managed or members[0].is_floating_point() else members[0].dtype,
                device=device,
                master_dtype=torch.float32 if managed else (compute_dtype if members[0].is_floating_point() else members[0].dtype),
                offload=offload and managed,
            )
            unit.groups.append(group)
            if managed:
                opt_index, group_index = key
                per_optimizer[opt_index][group_index].append(group)
        units[index] = unit
    return [unit for unit in units if unit is not None], per_optimizer, peak_bytes


def live_parameter_bytes(module: nn.Module) -> int:
    """Bytes of real (non-meta) storage behind ``module``'s parameters, each storage counted once."""
    seen: dict[int, int] = {}
    for param in module.parameters():
        if not param.is_meta:
            storage = param.untyped_storage()
            seen[storage.data_ptr() if storage.nbytes() else id(storage)] = storage.nbytes()
    return sum(seen.values())
