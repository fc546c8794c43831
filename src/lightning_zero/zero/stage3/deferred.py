"""Deferred initialization: a model built on the meta device, its initializers recorded, replayed later.

[Note: deferred init] A model built under ``fabric.init_module(empty_init=True)`` at stage 3 lives
on the meta device until the engine materializes it one unit at a time (``init.py``). Its weights
must be the ones eager construction gives (Fabric ddp with ``empty_init=False``, same seed), in
whatever order the script calls its initializers, and the caller's RNG stream must be left where
the eager run leaves it. As torchdistx's ``deferred_init`` does, every operation on the model's meta
tensors is recorded, in order, from construction until materialization:

- while the model is built (:meth:`InitRecord.building`), a dispatch mode records every aten op
  that touches a meta tensor, and every meta tensor created is a :class:`DeferredTensor`; after
  that, any call on a ``DeferredTensor`` (LitGPT's ``reset_parameters(model)``, an ``nn.init`` call
  in the script, ``model.to(dtype)``) records itself the same way. Nothing global outlives the
  ``init_module`` block.
- an op that draws random numbers (aten's ``nondeterministic_seeded`` tag) records the state of the
  generator it draws from at its own call, then runs once on a scratch tensor of the same shape,
  dtype and strides on the real device, so the generator moves exactly as the eager op would move
  it (one tensor at a time: the eager run's draws, never its memory). A seed set between
  construction and an initializer is therefore honoured, and the draws after it (dropout, data
  shuffles) are ddp's.
- each storage is produced by one op (its *producer*: ``empty``, ``arange``, ``randn``,
  ``_to_copy``...) and then changed in place by others (``uniform_``, ``copy_``, ``fill_``...);
  views share their base's storage. :meth:`InitRecord.value_of` replays a tensor's producer and
  the in-place ops on its storage in recorded order, each random one from its own recorded state
  (a fork of the generator: nothing the caller holds moves), reading other storages at the
  version they had when the op ran. The order in which tensors are materialized no longer matters.
- [Note: nn.init's meta shortcuts] a few of torch's initializers (``trunc_normal_``, ``orthogonal_``,
  ``dirac_``, ``sparse_``) return at once for a meta tensor and take no ``__torch_function__``
  detour, so no op of theirs reaches the record (``trunc_normal_`` also draws a data-dependent number
  of values: rejection sampling). From a record's ``building()`` until its ``close()``,
  ``torch.nn.init`` holds wrappers of these (:data:`META_SHORTCUTS`) that record the whole call as one op on its tensor: run once on a
  scratch tensor to move the generator, replayed whole. They call the original for any other
  tensor. tests/test_deferred_init.py fails if another ``torch.nn.init`` function records nothing.
- ``empty`` storages replay as the sentinel (NaN; the integer minimum) that ``init.py`` checks: a
  tensor nothing initialized keeps the old fallbacks (the model's ``init_module``, a Hugging Face
  ``_init_weights``, ``reset_parameters()``) or the error naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
# [Note: nn.init's meta shortcuts]: torch.nn.init functions that do nothing on a meta tensor
META_SHORTCUTS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def fill_sentinel(tensor: torch.Tensor) -> None:
    """The value ``init.py`` reads as "nothing initialized this" ([Note: buffer init])."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A meta tensor an op read or wrote: its storage at ``version`` (in-place ops applied so far)."""

    key: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class _Op:
    func: Any
    args: Any  # (args, kwargs) with meta tensors as _Ref, meta devices as the real one
    written: frozenset  # indices (in the flattened args) of the tensors the op writes
    rng: Optional[tuple[torch.Tensor, bool]]  # (generator state before the call, explicit generator)
    empty: bool


class DeferredTensor(torch.Tensor):
    """A meta tensor of a model built under :meth:`InitRecord.building`: every call on it is
    recorded in its ``_lz_record`` ([Note: deferred init]). ``nn.Parameter`` of one stays one
    (``isinstance(p, nn.Parameter)`` holds); materialization swaps it for a real Parameter."""

    _lz_record: "InitRecord"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        record = next(
            (getattr(x, "_lz_record", None) for x in tree_flatten((args, kwargs))[0] if isinstance(x, DeferredTensor)),
            None,
        )
        with torch._C.DisableTorchFunctionSubclass():
            if record is None or record.recording or record.closed:
                out = func(*args, **kwargs)
            else:
                with record.dispatching():
                    out = func(*args, **kwargs)
        return out if record is None or record.closed else record.adopt(out)


class _Building(TorchFunctionMode):
    """While the model is built: meta tensors that calls create become :class:`DeferredTensor`."""

    def __init__(self, record: "InitRecord") -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.record.adopt(func(*args, **(kwargs or {})))


class _Dispatch(TorchDispatchMode):
    def __init__(self, record: "InitRecord") -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.record.dispatch(func, args, kwargs or {})


class InitRecord:
    """Every op on a model's meta tensors, from construction to materialization, and their replay
    on ``device`` ([Note: deferred init])."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.ops: list[_Op] = []
        self.producer: dict[int, tuple[int, int]] = {}  # storage key -> (op index, output position)
        self.mutations: dict[int, list[int]] = {}  # storage key -> indices of the ops writing it, in order
        self._storages: dict[int, Any] = {}  # keeps each meta storage (and so its key) alive
        self.recording = False
        self.closed = False
        self._wraps_initializers = False  # [Note: nn.init's meta shortcuts]: until close()

    # -- recording ------------------------------------------------------------------------------
    @contextmanager
    def building(self) -> Generator[None, None, None]:
        """Build on the meta device, recording ([Note: deferred init])."""
        if not self._wraps_initializers:
            self._wraps_initializers = True
            _wrap_initializers(+1)
        with ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            stack.enter_context(_Building(self))
            stack.enter_context(self.dispatching())
            yield

    def call(self, func: Any, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """``func(tensor, *args, **kwargs)`` recorded whole as one op writing ``tensor`` ([Note:
        nn.init's meta shortcuts]); run once on a scratch tensor on the real device, so the
        generator moves as the eager call moves it."""
        flat, spec = tree_flatten(((tensor, *args), kwargs))
        explicit = next((x for x in flat if isinstance(x, torch.Generator)), None)
        generator = explicit if explicit is not None else _default_generator(self.device)
        before = generator.get_state()
        self._scratch_call(func, flat, spec)
        moved = not torch.equal(generator.get_state(), before)
        refs = [
            self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else _real_device(x, self.device) for x in flat
        ]
        index = len(self.ops)
        rng = (before, explicit is not None) if moved else None
        self.ops.append(_Op(func, tree_unflatten(refs, spec), frozenset({0}), rng, False))
        self.mutations.setdefault(_key(tensor), []).append(index)
        return tensor

    def _scratch_call(self, func: Any, flat: list, spec: Any) -> None:
        """``func`` on scratch tensors of the meta ones' shapes, dtypes and strides on the real
        device (factories inside it too), its result dropped."""
        scratch = [
            torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=self.device)
            if isinstance(x, torch.Tensor) and x.is_meta
            else _real_device(x, self.device)
            for x in flat
        ]
        scratch_args, scratch_kwargs = tree_unflatten(scratch, spec)
        with torch._C.DisableTorchFunctionSubclass(), torch.device(self.device):
            func(*scratch_args, **scratch_kwargs)

    @contextmanager
    def dispatching(self) -> Iterator[None]:
        self.recording = True
        try:
            with _Dispatch(self):
                yield
        finally:
            self.recording = False

    def adopt(self, out: Any) -> Any:
        """Meta tensors in ``out`` as :class:`DeferredTensor` of this record."""

        def adopt_one(value: Any) -> Any:
            if type(value) is torch.Tensor and value.is_meta:
                value = value.as_subclass(DeferredTensor)
                value._lz_record = self
            return value

        return tree_map(adopt_one, out) if isinstance(out, (tuple, list, dict)) else adopt_one(out)

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        if not any(_is_meta(x) for x in flat):
            return func(*args, **kwargs)
        written = _written_positions(func, args, kwargs, flat)
        random = torch.Tag.nondeterministic_seeded in func.tags
        rng = self._advance(func, flat, spec) if random else None
        refs = [
            self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else _real_device(x, self.device) for x in flat
        ]
        out = func(*args, **kwargs)
        index = len(self.ops)
        outputs = tree_flatten(out)[0]
        call = tree_unflatten(refs, spec)
        if not any(isinstance(x, torch.Tensor) for x in flat) and call[1].get("dtype") is None:
            # a factory (``empty``, ``randn``): the dtype it resolved from the default now, not at replay
            made = next((x for x in outputs if isinstance(x, torch.Tensor)), None)
            if made is not None and any(argument.name == "dtype" for argument in func._schema.arguments):
                call = (call[0], {**call[1], "dtype": made.dtype})
        name = func._schema.name.split("::")[-1]
        self.ops.append(_Op(func, call, frozenset(written), rng, name in _EMPTY))
        for position in written:
            self.mutations.setdefault(_key(flat[position]), []).append(index)
        for position, value in enumerate(outputs):
            if isinstance(value, torch.Tensor) and value.is_meta:
                key = _key(value)
                if key not in self._storages:
                    self._storages[key] = value.untyped_storage()
                    self.producer[key] = (index, position)
        return out

    def _ref(self, tensor: torch.Tensor) -> _Ref:
        key = _key(tensor)
        self._storages.setdefault(key, tensor.untyped_storage())
        return _Ref(key, len(self.mutations.get(key, ())), tuple(tensor.size()), tuple(tensor.stride()),
                    tensor.storage_offset(), tensor.dtype)  # fmt: skip

    def _advance(self, func: Any, flat: list, spec: Any) -> tuple[torch.Tensor, bool]:
        """The generator's state before the op, then the op once on scratch tensors on the real
        device: the generator moves as the eager op moves it."""
        explicit = next((x for x in flat if isinstance(x, torch.Generator)), None)
        state = explicit.get_state() if explicit is not None else _default_generator(self.device).get_state()
        self._scratch_call(func, flat, spec)
        return state, explicit is not None

    # -- replay ---------------------------------------------------------------------------------
    def knows(self, tensor: torch.Tensor) -> bool:
        return not self.closed and tensor.is_meta and _key(tensor) in self.producer

    def value_of(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """``tensor``'s value after every recorded op, on the real device (a view of a fresh
        storage), or None when this record did not see its storage made."""
        if not self.knows(tensor):
            return None
        key = _key(tensor)
        try:
            storage = self._storage_at(key, len(self.mutations.get(key, ())), {})
        except _Unrecorded:
            return None
        return _view(storage, tensor.dtype, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()),
                     self.device)  # fmt: skip

    def _storage_at(self, key: int, version: int, memo: dict) -> Any:
        if (key, version) in memo:
            return memo[key, version]
        if key not in self.producer:
            raise _Unrecorded(key)
        index, position = self.producer[key]
        produced = tree_flatten(self._run(index, memo, None, None))[0][position]
        if self.ops[index].empty:
            fill_sentinel(produced)
        storage = produced.untyped_storage()
        for mutation in self.mutations.get(key, ())[:version]:
            self._run(mutation, memo, key, storage)
        memo[key, version] = storage
        return storage

    def _run(self, index: int, memo: dict, target: Optional[int], storage: Any) -> Any:
        """Op ``index`` on real values; the written tensors of storage ``target`` are views of
        ``storage`` (written into), other written tensors are copies."""
        op = self.ops[index]
        flat, spec = tree_flatten(op.args)
        values = []
        for position, item in enumerate(flat):
            if not isinstance(item, _Ref):
                values.append(item)
            elif position in op.written and item.key == target:
                values.append(_view(storage, item.dtype, item.offset, item.size, item.stride, self.device))
            else:
                value = self._storage_at(item.key, item.version, memo)
                view = _view(value, item.dtype, item.offset, item.size, item.stride, self.device)
                values.append(view.clone() if position in op.written else view)
        generator = None
        if op.rng is not None and op.rng[1]:  # an explicit generator: a copy of it at the recorded state
            generator = torch.Generator(device=self.device)
            generator.set_state(op.rng[0])
            values = [generator if isinstance(x, torch.Generator) else x for x in values]
        args, kwargs = tree_unflatten(values, spec)
        with torch._C.DisableTorchFunctionSubclass(), torch.device(self.device):
            if op.rng is None or generator is not None:
                return op.func(*args, **kwargs)
            with _forked(self.device, op.rng[0]):
                return op.func(*args, **kwargs)

    def close(self) -> None:
        """Forget every op (after materialization; the real tensors a ``copy_`` read go with them)."""
        self.closed = True
        if self._wraps_initializers:
            self._wraps_initializers = False
            _wrap_initializers(-1)
        self.ops.clear()
        self.producer.clear()
        self.mutations.clear()
        self._storages.clear()


class _Unrecorded(LookupError):
    """A storage this record did not see made (a meta tensor from outside the ``init_module`` block)."""


def _is_meta(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.is_meta) or (
        isinstance(value, torch.device) and value.type == "meta"
    )


def _real_device(value: Any, device: torch.device) -> Any:
    return device if isinstance(value, torch.device) and value.type == "meta" else value


def _written_positions(func: Any, args: tuple, kwargs: dict, flat: list) -> list[int]:
    """Positions in ``flat`` of the meta tensors ``func`` writes (its schema's ``(a!)`` arguments)."""
    written_ids: set[int] = set()
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, torch.Tensor) and item.is_meta:
                written_ids.add(id(item))
    return [position for position, item in enumerate(flat) if id(item) in written_ids]


def _view(
    storage: Any, dtype: torch.dtype, offset: int, size: tuple, stride: tuple, device: torch.device
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


@contextmanager
def _forked(device: torch.device, state: torch.Tensor) -> Iterator[None]:
    """The device's default generator at ``state`` for one op, then back where it was."""
    generator = _default_generator(device)
    saved = generator.get_state()
    generator.set_state(state)
    try:
        yield
    finally:
        generator.set_state(saved)


def _recording(original: Any) -> Any:
    """``original`` (a ``torch.nn.init`` function), recorded whole for a tensor of an open record."""

    @functools.wraps(original)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record = getattr(tensor, "_lz_record", None) if isinstance(tensor, DeferredTensor) else None
        if record is None or record.closed or not tensor.is_meta:
            return original(tensor, *args, **kwargs)
        return record.call(original, tensor, args, kwargs)

    init.__lz_original__ = original  # type: ignore[attr-defined]
    return init


_open_records: list[int] = [0]  # records between building() and close()


def _wrap_initializers(change: int) -> None:
    """``torch.nn.init``'s meta-shortcut functions wrapped while any record is open ([Note: nn.init's
    meta shortcuts]); put back when the last one closes."""
    import torch.nn.init as init_module

    _open_records[0] += change
    for name in META_SHORTCUTS:
        current = getattr(init_module, name)
        original = getattr(current, "__lz_original__", current)
        setattr(init_module, name, _recording(original) if _open_records[0] > 0 else original)
