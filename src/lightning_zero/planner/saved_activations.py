"""Bytes of activations a model keeps for backward, measured: the count the planner's
``llama_activation_bytes(...).saved_after_forward(mode)`` predicts (tests/test_planner.py,
tests/test_tp.py, benchmarks/bench_tp.py).

[Note: measuring saved activations] A dispatch mode records the storage of every tensor an op
creates during forward; after forward returned the loss, the storages still alive are exactly
what autograd (or checkpoint) keeps for backward, deduplicated, parameters excluded. This also
sees through non-reentrant checkpointing, which saved-tensor hooks do not.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# a collective's work object may hold its buffers for a moment after it completed (gloo releases
# them on its own thread): not what autograd keeps
_COLLECTIVE_RELEASE_S = 0.05


class CreatedStorages(TorchDispatchMode):
    """Every storage an op creates while active (those in ``exclude`` aside), held weakly."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                known = self.storages.get(key)
                if key not in self.exclude and (known is None or known[0].expired()):
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


class PeakStorages(CreatedStorages):
    """:class:`CreatedStorages` that also records the most bytes alive at once after any op
    (``peak``): the activation high-water mark of a forward and backward run inside it, parameter
    gradients and optimizer state aside when ``exclude`` names them (storages that already existed
    are never counted). Freed storages are dropped at each op, so a scan costs what is alive."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__(exclude)
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key in [key for key, (ref, _) in self.storages.items() if ref.expired()]:
            del self.storages[key]
        self.peak = max(self.peak, self.alive_bytes())
        return out


class SavedActivations:
    """Counts the activation bytes ``module`` keeps for backward, from :meth:`start` (before
    forward) to :meth:`stop` (after forward returned the loss; before backward, and before a
    ``zero_grad`` whose in-place writes would count the gradient buffers as created).

    ``start`` and ``stop`` may run in different hooks: ``benchmarks/_probes.py`` starts in a
    Lightning callback's ``on_train_batch_start`` and stops in ``on_before_zero_grad``.
    """

    def __init__(self, module: nn.Module) -> None:
        exclude = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
        self._tracker = CreatedStorages(exclude)
        self.active = False

    def start(self) -> "SavedActivations":
        self._tracker.__enter__()
        self.active = True
        return self

    def stop(self) -> int:
        """Leave the dispatch mode; the bytes of the storages created since :meth:`start` that
        are still alive."""
        if self.active:
            self._tracker.__exit__(None, None, None)
            self.active = False
        gc.collect()
        time.sleep(_COLLECTIVE_RELEASE_S)
        return self._tracker.alive_bytes()


def measure_saved_bytes(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, attention: str = "fused") -> int:
    """Bytes ``model`` (a Llama: ``model.loss_fn``) keeps for backward after the forward of
    ``idx`` ``(B, T)``; then runs backward (the graph was whole, the recompute ran the same kernel)."""
    backend = SDPBackend.MATH if attention == "math" else SDPBackend.FLASH_ATTENTION
    saved = SavedActivations(model)
    with sdpa_kernel(backend):
        saved.start()
        loss = model.loss_fn(model(idx), targets)
        measured = saved.stop()
        loss.backward()
    return measured
