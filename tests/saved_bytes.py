"""Bytes of activations a model keeps for backward, measured (tests/test_planner.py, tests/test_tp.py).

[Note: measuring saved activations] A dispatch mode records the storage of every tensor an op
creates during forward; after forward returned the loss, the storages still alive are exactly
what autograd (or checkpoint) keeps for backward, deduplicated, parameters excluded. This also
sees through non-reentrant checkpointing, which saved-tensor hooks do not.
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CreatedStorages(TorchDispatchMode):
    """Every storage an op creates while active (those in ``exclude`` aside), held weakly."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


def measure_saved_bytes(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, attention: str = "fused") -> int:
    """Bytes ``model`` (a Llama: ``model.loss_fn``) keeps for backward after the forward of
    ``idx`` ``(B, T)``; then runs backward (the graph was whole, the recompute ran the same kernel)."""
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    backend = SDPBackend.MATH if attention == "math" else SDPBackend.FLASH_ATTENTION
    tracker = CreatedStorages(exclude)
    with sdpa_kernel(backend):
        with tracker:
            loss = model.loss_fn(model(idx), targets)
        # a collective's work object may hold its buffers for a moment after it completed (gloo
        # releases them on its own thread): not what autograd keeps
        gc.collect()
        time.sleep(0.05)
        measured = tracker.alive_bytes()
        loss.backward()
    return measured
