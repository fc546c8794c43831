"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` under ZeRO: Fabric's state dicts onto ``checkpoint/``.

Fabric hands a strategy a dict such as LitGPT's ``{"model": model, "optimizer": optimizer,
"scheduler": scheduler, "iter_num": 3}``. :class:`FabricState` maps it onto the sharded
checkpoint of ``checkpoint/`` (docs/checkpoints.md): the set-up model and its optimizers are
written as every rank's shards (any dp size or stage reads them back), stateful objects as their
``state_dict()`` and plain values as they are, both in the checkpoint's JSON state, with a record
of which key was the model and which the optimizers. ``state_dict_type="full"`` writes one
``torch.save`` file instead (global rank 0, atomically), and a single file -- that one, or any
plain state dict -- loads into the sharded model through ``checkpoint/full.py``.

[Note: filtered saves are one file] ``fabric.save(path, state, filter={"model": lora_filter})`` is
how LitGPT writes its adapters and LoRA weights (``lit_model.pth.lora``), and its tools read the
result with ``torch.load`` / ``lazy_load``: a file. A filter picks a small set (the adapter
tensors), so a filtered save is written as Fabric's ``ddp`` writes it whatever
``state_dict_type`` says: one ``torch.save`` file of the filtered entries, full values gathered
from the shards, written by global rank 0 (before, the default sharded type wrote a directory,
and LitGPT's ``merge_lora`` failed on it with ``IsADirectoryError``, far from the cause).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.destinations import location, parent_of

if TYPE_CHECKING:
    from lightning_zero.checkpoint import RankPlacement
    from lightning_zero.precision import PrecisionPolicy
    from lightning_zero.runtime.checkpoints import CheckpointLifecycle
    from lightning_zero.runtime.forward_steps import ForwardSteps
    from lightning_zero.runtime.run import ZeroRun
    from lightning_zero.zero.engine import ZeroEngine

FABRIC_KEYS = "fabric_keys"  # where a checkpoint records which state entry was the model and the optimizers
_DROPPED = object()  # an entry Fabric's filter keeps nothing of


def _filtered(key: str, value: Any, filter: dict[str, Callable[[str, Any], bool]]) -> Any:
    """Fabric's ``_apply_filter``: a filtered dict keeps the items its predicate accepts, and is
    dropped when that is none; anything else is saved as it is."""
    if key not in filter or not isinstance(value, dict):
        return value
    kept = {k: v for k, v in value.items() if filter[key](k, v)}
    return kept if kept else _DROPPED


Filter = Optional[dict[str, Callable[[str, Any], bool]]]


@dataclass
class FabricState:
    """Saves and loads Fabric state dicts for one set-up ``module`` (and its ``optimizers``, every
    one set up) on this rank's ``layout``. Every rank calls each method (collectives).

    ``param_names``: per optimizer, per param group, its parameters' names in the user's order
    ([Note: full optimizer state] in ``checkpoint/full_optimizer.py``); ``value_dtype``: the dtype
    ddp holds a parameter in ([Note: full state dicts] in ``checkpoint/full.py``). After the
    strategy's teardown ``engine`` is ``None``: the module holds its full parameters and
    ``optimizer_shards`` the optimizers' state ([Note: optimizer state after the loop] in
    ``zero/flat.py``); only sharded saves are possible then."""

    module: nn.Module
    optimizers: list[Optimizer]
    engine: Optional["ZeroEngine"]
    layout: "RankPlacement"
    param_names: list[list[list[str]]] = field(default_factory=list)
    value_dtype: Optional[Callable[[nn.Parameter], torch.dtype]] = None
    optimizer_shards: Any = None
    storage: Any = None  # a StoragePolicy: how a path that is a URL is reached (None: the defaults)

    def split(self, state: dict[str, Any]) -> tuple[str, list[str], dict[str, Any]]:
        """(key of the set-up module, keys of its optimizers, the other entries as saved)."""
        module_key, optimizer_keys, others = None, [], {}
        for key, value in state.items():
            if isinstance(value, nn.Module):
                self._check_module(value, key)
                module_key = key
            elif isinstance(value, Optimizer):
                if value not in self.optimizers:
                    raise ValueError(f"ZeroFabricStrategy: state[{key!r}] is an optimizer that was not set up.")
                optimizer_keys.append(key)
            elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                others[key] = value.state_dict()
            else:
                others[key] = value
        if module_key is None:
            raise ValueError("ZeroFabricStrategy.save: the state holds no set-up model; add it: {'model': model, ...}.")
        return module_key, optimizer_keys, others

    def check_save(self, state: dict[str, Any], filter: Filter, full: bool) -> None:
        """Refuse a bad ``state`` or ``filter`` before any collective (no rank is marked failed)."""
        module_key, optimizer_keys, _ = self.split(state)
        if full and self.engine is None:
            raise ValueError(
                "ZeroFabricStrategy: fabric.save after strategy.teardown() cannot gather a full file"
                " (state_dict_type='full', or a save with a filter: [Note: filtered saves are one file]); the engine"
                " that held the shards is closed. Save it before the teardown, or save the sharded checkpoint"
                " (state_dict_type='sharded', no filter), which holds everything after it too."
            )
        if full and getattr(self.engine, "expert_domain", None) is not None:
            from lightning_zero.zero.domains import ep_shard_dim, is_expert_param

            own = [
                name
                for name, p in self.engine.managed_parameters().items()
                if is_expert_param(p) and ep_shard_dim(p) is None
            ]
            if own:
                raise ValueError(
                    f"ZeroFabricStrategy(state_dict_type='full') with ep > 1: {len(own)} expert parameter(s) are"
                    f" Parameters of their own ({own[:3]}), held by one EP rank each, so a full file has no whole"
                    " tensor for them ([Note: dense experts in a full file] in checkpoint/full.py); stack a layer's"
                    " experts in one Parameter with _ep_shard_dim, or save the sharded checkpoint"
                    " (state_dict_type='sharded')."
                )
        for key, predicate in (filter or {}).items():
            if key not in state:
                raise ValueError(
                    f"ZeroFabricStrategy.save(filter={{{key!r}: ...}}): the state has no entry {key!r}; its keys are"
                    f" {sorted(state)}."
                )
            if not callable(predicate):
                raise TypeError(
                    f"ZeroFabricStrategy.save(filter={{{key!r}: ...}}): a filter is a callable (key, value) -> bool."
                )

    def _check_module(self, module: nn.Module, key: Any = "model") -> nn.Module:
        if module is not self.module:
            raise ValueError(
                f"ZeroFabricStrategy: state[{key!r}] is a {type(module).__name__} that was not set up with this"
                " strategy; save and load the model returned by fabric.setup."
            )
        return module

    def _names_of(self, optimizer: Optimizer) -> list[list[str]]:
        return self.param_names[self.optimizers.index(optimizer)]

    # -- save ------------------------------------------------------------------------------------
    def save_sharded(
        self, path: Any, state: dict[str, Any], lifecycle: "CheckpointLifecycle", *, step: int,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:  # fmt: skip
        """Through ``lifecycle`` ([Note: checkpoint lifecycle]): in the background under
        ``async_checkpoint``; ``step`` (optimizer steps, the same on every rank) is the agreed step.
        A save with a ``filter`` is a full file instead ([Note: filtered saves are one file])."""
        module_key, optimizer_keys, others = self.split(state)
        optimizers = [state[key] for key in optimizer_keys]
        if self.engine is not None:
            self.engine.wait_param_gathers()
        checkpoint: dict[str, Any] = {"state": others, FABRIC_KEYS: {"model": module_key, "optimizers": optimizer_keys}}
        if optimizers:
            checkpoint["optimizer_states"] = []  # the optimizers' shards are written too
        shards = self.optimizer_shards if optimizers and self.optimizer_shards is not None else None
        lifecycle.save(path, checkpoint, step=step, module=self.module, engine=self.engine, optimizers=optimizers,
                       layout=self.layout, optimizer_shards=shards, storage_options=storage_options)  # fmt: skip

    def full_payload(self, state: dict[str, Any], filter: Filter = None) -> dict[str, Any]:
        """What Fabric's ``ddp`` would ``torch.save`` for ``state``: the model's full state dict, each
        optimizer's torch-format state dict, the other entries' state dicts and values, with Fabric's
        ``filter`` applied as ``ddp`` applies it (a collective: every rank gets it)."""
        from lightning_zero.checkpoint.full import gather_full_state_dict
        from lightning_zero.checkpoint.full_optimizer import gather_optimizer_state_dict

        module_key, optimizer_keys, others = self.split(state)
        filter = filter or {}
        self.engine.wait_param_gathers()
        payload: dict[str, Any] = {}
        for key, value in state.items():
            if key == module_key:
                keep = filter.get(key)
                extra = {"value_dtype": self.value_dtype} if self.value_dtype is not None else {}
                entry = gather_full_state_dict(self.module, self.engine, self.engine.dp_group, keep=keep, dense=True,
                                               **extra)  # fmt: skip
                if keep is not None and not entry:
                    continue  # Fabric's filter drops an entry it keeps nothing of
            elif key in optimizer_keys:
                entry = gather_optimizer_state_dict(value, self._names_of(value), self.engine, self.engine.dp_group)
                entry = _filtered(key, entry, filter)
            else:
                entry = _filtered(key, others[key], filter)
            if entry is not _DROPPED:
                payload[key] = entry
        return payload

    def save_full(
        self, path: Any, state: dict[str, Any], lifecycle: "CheckpointLifecycle", filter: Filter = None,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:  # fmt: skip
        payload = self.full_payload(state, filter)
        # global rank 0 writes, atomically; its error is raised on every rank ([Note: checkpoint lifecycle])
        lifecycle.save_file(path, lambda handle: torch.save(payload, handle), storage_options)

    # -- load ------------------------------------------------------------------------------------
    def load(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]], *, strict: bool,
        weights_only: Optional[bool],
    ) -> dict[str, Any]:  # fmt: skip
        """Restore ``state`` in place from ``path`` (a sharded checkpoint or a single file); returns
        the saved entries ``state`` did not ask for."""
        from lightning_zero.checkpoint import is_checkpoint

        if state is None or isinstance(state, Optimizer) or (isinstance(state, dict) and not state):
            raise ValueError(
                f"ZeroFabricStrategy: pass the objects to restore from {path}: fabric.load(path, {{'model': model,"
                " 'optimizer': optimizer, ...}) or fabric.load_raw(path, model). Optimizer state is restored with"
                " its model."
            )
        from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, is_url, read_bytes

        storage = self.storage or DEFAULT_POLICY
        if is_checkpoint(path, storage):
            return self._load_sharded(path, state, strict)
        if is_url(path):  # one torch file in object storage: read whole (no memory map there)
            return self._load_file(io.BytesIO(read_bytes(path, storage)), state, strict, weights_only, name=path)
        return self._load_file(Path(path), state, strict, weights_only)

    def _load_file(
        self, path: Any, state: Union[nn.Module, dict[str, Any]], strict: bool, weights_only: Optional[bool],
        name: Any = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A single file (``state_dict_type="full"``, or any plain ``torch.save`` of a state dict)."""
        from lightning_zero.checkpoint.full import load_full_state_dict
        from lightning_zero.checkpoint.full_optimizer import load_optimizer_state_dict

        # memory-mapped: each tensor is read when it is copied into the shards, one at a time
        loaded = torch.load(path, map_location="cpu", mmap=isinstance(path, Path),
                            weights_only=True if weights_only is None else weights_only)  # fmt: skip
        path = path if name is None else name
        if isinstance(state, nn.Module):  # load_raw: the file is the module's state dict
            load_full_state_dict(self._check_module(state), self.engine, loaded, strict=strict)
            return {}
        remainder = dict(loaded)
        for key, value in list(state.items()):
            if key not in remainder:
                if strict:
                    raise KeyError(f"The requested state contains a key '{key}' that does not exist in {path}.")
                continue
            saved = remainder.pop(key)
            if isinstance(value, nn.Module):
                load_full_state_dict(self._check_module(value, key), self.engine, saved, strict=strict)
            elif isinstance(value, Optimizer):
                if value not in self.optimizers:
                    raise ValueError(f"ZeroFabricStrategy: state[{key!r}] is an optimizer that was not set up.")
                load_optimizer_state_dict(value, saved, self._names_of(value), self.engine)
            elif hasattr(value, "load_state_dict"):
                value.load_state_dict(saved)
            else:
                state[key] = saved
        return remainder

    def _load_sharded(self, path: Any, state: Union[nn.Module, dict[str, Any]], strict: bool) -> dict[str, Any]:
        from lightning_zero.checkpoint import apply_optimizer_state, load_model, open_checkpoint
        from lightning_zero.checkpoint.objstore import DEFAULT_POLICY

        opened = open_checkpoint(path, self.layout, self.storage or DEFAULT_POLICY)
        keys = opened.state.get(FABRIC_KEYS, {"model": None, "optimizers": []})
        saved = dict(opened.state.get("state", {}))
        if isinstance(state, nn.Module):  # load_raw of a sharded checkpoint: the weights
            state = {keys["model"] or "model": state}
        missing = sorted(set(state) - (set(saved) | {keys["model"]} | set(keys["optimizers"])))
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in {path}.")
        module_key = next((key for key, value in state.items() if isinstance(value, nn.Module)), None)
        if module_key is not None:
            module = self._check_module(state[module_key], module_key)
            optimizers = [state[key] for key in keys["optimizers"] if key in state]
            if len(optimizers) != len(keys["optimizers"]):  # weights only: the optimizers' state stays
                optimizers = []
                opened.meta["optimizers"] = []
            states = load_model(opened, module, engine=self.engine, optimizers=optimizers, layout=self.layout,
                                strict=strict)  # fmt: skip
            apply_optimizer_state(opened, optimizers, states, rank=self.layout.rank)
        for key, value in list(state.items()):
            if key not in saved or isinstance(value, (nn.Module, Optimizer)):
                continue
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(saved.pop(key))
            else:
                state[key] = saved.pop(key)
        return saved


class FabricCheckpoints:
    """``ZeroFabricStrategy``'s ``fabric.save`` / ``fabric.load`` / ``load_raw`` / HF export: each
    call mapped onto a :class:`FabricState` of the set-up model and optimizers and the run's
    checkpoint lifecycle ([Note: checkpoint lifecycle] in ``runtime/checkpoints.py``)."""

    run: "ZeroRun"
    loop: "ForwardSteps"
    state_dict_type: str
    precision_policy: "PrecisionPolicy"
    _torn_down: bool

    def _value_dtype(self, param: nn.Parameter) -> torch.dtype:
        """The dtype ddp holds ``param`` in ([Note: full state dicts]): ``PrecisionPolicy.ddp_dtype``."""
        return self.precision_policy.ddp_dtype(param)

    def _state_io(self) -> FabricState:
        loop = self.loop
        assert loop.module is not None
        # after teardown the module holds its full parameters, the optimizers' state stays sharded
        shards = self.run.session.optimizer_shards(loop.optimizers) if self._torn_down else None
        engine = None if self._torn_down else loop.ensure_engine()
        return FabricState(loop.module, loop.optimizers, engine, self.run.layout(self.precision_policy.name),
                           param_names=loop.param_names, value_dtype=self._value_dtype, optimizer_shards=shards,
                           storage=self.run.checkpoints.storage)  # fmt: skip

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``fabric.save``: sharded (default) or one torch file (``state_dict_type="full"``: what
        Fabric's ddp writes, optimizer state included); ``filter`` as Fabric's strategies take it, and
        a save with a filter is one file whatever the type ([Note: filtered saves are one file] in
        ``fabric/checkpoint.py``). A bad argument raises here and leaves the strategy usable; a save
        that cannot write raises."""
        self.run.check_storage_options("ZeroFabricStrategy.save", path, storage_options, " or save without them")
        self.run.refuse_when_failed(f"the checkpoint {str(path)!r} was not saved")
        state_io = self._state_io()
        full = self.state_dict_type == "full" or bool(filter)  # [Note: filtered saves are one file]
        state_io.check_save(state, filter, full=full)  # before any collective: refusing marks nothing failed
        with self.run.noting_failures():
            self.run.checkpoints.clean_once(parent_of(location(path)), self.barrier)  # type: ignore[attr-defined]  # what killed saves left there
            if full:
                state_io.save_full(location(path), state, self.run.checkpoints, filter, storage_options)
            else:
                state_io.save_sharded(path, state, self.run.checkpoints, step=self.loop.steps,
                                      storage_options=storage_options)  # fmt: skip

    def save_hf_pretrained(self, path: Any, *, dtype: Optional[str] = None, max_shard_size: Any = "50GB") -> Any:
        """``fabric.strategy.save_hf_pretrained(OUT)``: the set-up model (a ``Llama``, any family) as a
        Hugging Face directory, written with no gather: each rank writes the ranges it holds into
        ``save_pretrained``'s files ([Note: no-gather Hugging Face export] in
        ``checkpoint/hf_write.py``). A collective: every rank calls it. ``dtype``: ``fp32``, ``bf16``,
        ``fp16`` or ``None`` (the fp32 masters)."""
        self.run.refuse_when_failed(f"the Hugging Face export {str(path)!r} was not written")
        self.loop.ensure_engine()
        return self.run.save_hf_pretrained(path, self.loop.module, self.precision_policy.name, dtype=dtype,
                                           max_shard_size=max_shard_size)  # fmt: skip

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        self.run.refuse_when_failed(f"{str(path)!r} was not loaded")
        if self._torn_down:
            raise RuntimeError(
                f"ZeroFabricStrategy: fabric.load({str(path)!r}) after strategy.teardown(): the engine that held the"
                " shards is closed. Load into a new Fabric's set-up model and optimizers (as a resumed script does)."
            )
        state_io = self._state_io()
        with self.run.noting_failures():
            self.run.before_load(path, self.barrier)  # type: ignore[attr-defined]
            return state_io.load(path, state, strict=strict, weights_only=weights_only)

    def _load_module_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``model.load_state_dict`` on the set-up model: torch's own traversal, written through to
        the masters and the shards ([Note: torch's load traversal] in ``checkpoint/full.py``)."""
        from lightning_zero.checkpoint.full import load_full_state_dict

        engine = self.loop.ensure_engine()
        return load_full_state_dict(self.loop.module, engine, state_dict, strict=strict, assign=assign)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict on every rank, in the dtypes ddp holds: a collective, every rank calls it."""
        engine = self.run.engine
        if engine is None:
            return super().get_module_state_dict(module)  # type: ignore[misc]
        from lightning_zero.checkpoint.full import gather_full_state_dict

        return gather_full_state_dict(module, engine, engine.dp_group, value_dtype=self._value_dtype)
