"""How ZeroStrategy answers Lightning's checkpoint calls (Lightning glue; the logic is in ``checkpoint/``).

Saving: Lightning builds the checkpoint dict from ``lightning_module_state_dict()`` and
``optimizer_state(opt)``, both empty under ZeRO (no rank holds the whole model or the whole
optimizer state), then calls ``save_checkpoint(checkpoint, path)``, where every rank writes the
shards it owns (:func:`lightning_zero.checkpoint.save_checkpoint`).

Loading: after setup (``restore_checkpoint_after_setup``: the engine's fp32 masters and optimizer
shards must exist first), Lightning makes three calls, ``load_checkpoint(path)`` for the dict of
non-tensor state, then ``load_model_state_dict`` and ``load_optimizer_state_dict``;
:class:`CheckpointRestore` is what the three share.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_zero.checkpoint import RankPlacement, apply_optimizer_state, load_model, open_checkpoint, restore_rng
from lightning_zero.checkpoint.objstore import DEFAULT_POLICY, StoragePolicy


class CheckpointRestore:
    """One load of a sharded checkpoint at ``path`` into this rank's ``layout``, across Lightning's
    three restore calls: :meth:`lightning_dict` (``load_checkpoint``), :meth:`load_model` (the
    module's tensors and the engine's masters; it also reads the optimizer states this rank
    owns) and :meth:`load_optimizers` (those states, then the RNG)."""

    def __init__(self, path: Any, layout: RankPlacement, storage: StoragePolicy = DEFAULT_POLICY) -> None:
        self.opened = open_checkpoint(path, layout, storage)  # files verified before anything is read
        self.rank = layout.rank
        self.optimizer_states: list = []

    def lightning_dict(self) -> dict[str, Any]:
        """Lightning's non-tensor state (loops, callbacks, schedulers, hyperparameters)."""
        return self.opened.lightning_dict()

    def load_model(
        self, module: nn.Module, *, engine: Any, optimizers: list, layout: RankPlacement, strict: bool
    ) -> None:
        self.optimizer_states = load_model(
            self.opened, module, engine=engine, optimizers=optimizers, layout=layout, strict=strict
        )

    def load_optimizers(self, optimizers: list) -> None:
        apply_optimizer_state(self.opened, optimizers, self.optimizer_states, rank=self.rank)
        restore_rng(self.opened)  # last restore step before the loop runs
