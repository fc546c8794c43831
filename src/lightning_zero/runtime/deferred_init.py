"""A model built on the meta device before its engine exists: the init record, its RNG stream, stand-ins.

[Note: stage 3 init under Fabric] ``init_module(empty_init=True)`` gives, at every stage, the
values eager construction gives (Fabric ddp with ``empty_init=False``, same seed), and leaves the
caller's RNG stream where that eager run leaves it. Stages 1-2 hold the whole model on every rank
anyway: they build it eagerly (ddp's ``empty_init`` would leave the tensors a checkpoint does not
hold -- LoRA's, an adapter's -- uninitialized memory). Stage 3 builds on the meta device, recording
every initializer as it runs, in construction and after it (LitGPT's ``reset_parameters(model)``),
each random one with the RNG state of its own call; the engine materializes one unit at a time and
replays them ([Note: deferred init] in ``zero/stage3/deferred.py``). Tensors no recorded op made
(rare: a buffer recomputed by factory calls after construction) get the module's own initializers
([Note: buffer init]), drawing from a fork of the RNG state at ``init_module``'s exit. Without
``empty_init`` (``None`` or ``False``) the module is built for real and sharded at setup.

[Note: stand-ins for meta parameters] LitGPT's order sets up a model built under
``init_module(empty_init=True)`` (stage 3: on the meta device) before its optimizer exists, and
Fabric's ``setup_optimizers`` refuses an optimizer over meta parameters. Building the engine then
would materialize the shards, and the optimizer's engine later would have to gather the whole model
on every rank to rebuild. So each meta parameter gets a stand-in until the engine is built: a
Parameter of the same shape, dtype and ``requires_grad`` on the device, one element broadcast (NaN
for floats) -- no memory, and nothing that reads it can mistake it for weights. The optimizer is
built over the stand-ins; :meth:`DeferredInit.restore_meta_parameters` puts the meta parameters
back (in the module and in the optimizers' param groups) right before the engine materializes them,
one unit at a time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Generator, Optional

import torch
from torch import nn
from torch.optim import Optimizer


class DeferredInit:
    """What a meta-built model carries until its engine is built (one per run)."""

    def __init__(self) -> None:
        self._record: Optional[Any] = None  # [Note: deferred init] in zero/stage3/deferred.py
        self._rng: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        # id(stand-in) -> (stand-in, meta parameter): [Note: stand-ins for meta parameters]
        self._meta_parameters: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def building(self, device: torch.device, precision_context: AbstractContextManager) -> AbstractContextManager:
        """While open, modules are built on the meta device with every initializer recorded; at its
        exit the RNG state is kept for the fallback initializers ([Note: stage 3 init under Fabric])."""
        from lightning_zero.zero.stage3.deferred import InitRecord

        self._record = InitRecord(device)
        stack = ExitStack()
        stack.enter_context(precision_context)
        stack.enter_context(self._record.building())
        stack.callback(self._remember_rng, device)
        return stack

    def _remember_rng(self, device: torch.device) -> None:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._rng = (torch.get_rng_state(), cuda)

    @contextmanager
    def rng_stream(self, device: torch.device) -> Generator[None, None, None]:
        """The fallback initializers draw from the RNG state ``init_module`` closed with, in a fork
        ([Note: stage 3 init under Fabric]); once. The record is closed after."""
        saved, self._rng = self._rng, None
        record, self._record = self._record, None
        try:
            if saved is None:
                yield
                return
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.set_rng_state(saved[0])
                if saved[1] is not None:
                    torch.cuda.set_rng_state(saved[1], device)
                yield
        finally:
            if record is not None:
                record.close()

    def stand_in_for_meta_parameters(self, module: nn.Module, device: torch.device) -> None:
        """[Note: stand-ins for meta parameters]: each meta parameter of ``module`` replaced by a stand-in."""
        stand_ins: dict[int, nn.Parameter] = {}
        for child in module.modules():
            for key, param in child._parameters.items():
                if param is None or not param.is_meta:
                    continue
                stand_in = stand_ins.get(id(param))
                if stand_in is None:  # a tied parameter gets one stand-in
                    fill = float("nan") if param.is_floating_point() else 0
                    value = torch.full((), fill, dtype=param.dtype, device=device).expand(param.shape)
                    stand_in = stand_ins[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
                    self._meta_parameters[id(stand_in)] = (stand_in, param)
                child._parameters[key] = stand_in

    def restore_meta_parameters(self, module: nn.Module, optimizers: list[Optimizer]) -> None:
        """Back from the stand-ins to the meta parameters ([Note: stand-ins for meta parameters])."""
        if not self._meta_parameters:
            return
        original = {key: param for key, (_, param) in self._meta_parameters.items()}
        for child in module.modules():
            for key, param in child._parameters.items():
                if param is not None and id(param) in original:
                    child._parameters[key] = original[id(param)]
        for optimizer in optimizers:
            if any(id(param) in original for param in optimizer.state):
                raise RuntimeError(
                    "ZeroFabricStrategy: the optimizer stepped before the model's first forward; run the model"
                    " (forward, fabric.backward) before optimizer.step()."
                )
            for group in optimizer.param_groups:
                group["params"] = [original.get(id(param), param) for param in group["params"]]
        self._meta_parameters.clear()
