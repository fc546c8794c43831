"""The one place lightning_zero touches Lightning's private API, each use with its reason.

Lightning offers no public way to ask these things. Keeping them here means an upgrade of Lightning
that renames one breaks one function, found by grepping this file, instead of glue spread around.
"""

from __future__ import annotations

from typing import Any

import torch


def is_accumulating(trainer: Any) -> bool:
    """True on a micro batch whose backward is not followed by an optimizer step.

    Lightning decides this in ``_FitLoop._should_accumulate`` (``accumulate_grad_batches`` and the
    end of the epoch); the monitor logs per optimizer step, so it must ask the loop itself.
    """
    return bool(trainer.fit_loop._should_accumulate())


def last_saved_step(checkpoint: Any) -> int:
    """The global step ``ModelCheckpoint`` last saved at (its private ``_last_global_step_saved``):
    the CLI's save-last-on-train-end callback must not save twice at the same step."""
    return int(checkpoint._last_global_step_saved)


def mark_saved(checkpoint: Any, step: int, path: str) -> None:
    """Tell ``ModelCheckpoint`` a checkpoint was saved at ``step`` outside of it, so it neither saves
    the same step again nor forgets ``last_model_path`` (what ``ckpt_path="last"`` resolves)."""
    checkpoint.last_model_path = path
    checkpoint._last_global_step_saved = step


def optimizers_to_device(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """Move optimizer state to ``device``: Lightning's ``_optimizers_to_device``, the helper its own
    strategies use after ``setup_optimizers`` (state created before setup may sit elsewhere)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def step_progress_bar() -> Any:
    """Lightning's progress bar, labelled by optimizer steps when a run is bounded by ``max_steps``.

    With ``max_steps`` and no ``max_epochs`` Lightning sets ``max_epochs=-1`` and its bar reads
    ``Epoch 0/-2``; the label comes from the private ``RichProgressBar._get_train_description``
    (TQDM's from ``on_train_epoch_start``), so that one method is replaced here.
    """
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    def label(trainer: Any, epoch: int) -> str:
        if trainer.max_steps is not None and trainer.max_steps > 0 and (trainer.max_epochs or -1) < 0:
            return f"Step {trainer.global_step}/{trainer.max_steps}"
        return f"Epoch {epoch}" + (f"/{trainer.max_epochs - 1}" if (trainer.max_epochs or -1) > 0 else "")

    if _RICH_AVAILABLE:

        class StepRichProgressBar(RichProgressBar):
            def _get_train_description(self, current_epoch: int) -> str:
                description = label(self.trainer, current_epoch)
                return f"{description:{len(self.validation_description)}}"

            def on_train_batch_end(
                self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
                if self.progress is not None and self.train_progress_bar_id is not None:
                    description = self._get_train_description(trainer.current_epoch)
                    self.progress.update(self.train_progress_bar_id, description=description)

        return StepRichProgressBar()

    class StepTQDMProgressBar(TQDMProgressBar):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.train_progress_bar.set_description(label(trainer, trainer.current_epoch))

    return StepTQDMProgressBar()


# [Note: replaced Lightning internals]
# Three attributes of Lightning's objects are changed on an instance, because Lightning has no public hook for
# either; both changes live here, and tests/test_lightning_compat.py fails when the installed
# Lightning moves the attribute or changes its call:
# - ``trainer._signal_connector``: the Trainer's signal handling (``_SignalConnector``) saves or
#   broadcasts from inside the handler (Lightning issue 21406); ours only records the signal and the
#   ranks agree at a step boundary ([Note: signals as events], runtime/signals.py). Lightning calls
#   ``trainer._signal_connector.register_signal_handlers()`` at the start of every entry point and
#   ``teardown()`` at its end; a callback's ``setup`` runs before the former, so installing there
#   is early enough.
# - ``ModelCheckpoint._link_checkpoint`` (a staticmethod ``(trainer, filepath, linkpath)``): with
#   ``save_last="link"`` Lightning links ``last.ckpt`` right after its ``save_checkpoint`` returns;
#   under a background save that target is not published yet, so the link waits for the lifecycle
#   (runtime/checkpoints.py). Shadowed on the user's callback instance, not on the class.
# - ``ModelCheckpoint.setup`` of a callback with ``save_last="link"`` and a URL ``dirpath``: run
#   with ``save_last=True`` for the one check that refuses links there ([Note: last links at URLs]).


def install_signal_connector(trainer: Any, connector: Any) -> None:
    """Make ``connector`` the Trainer's signal connector ([Note: replaced Lightning internals])."""
    trainer._signal_connector = connector


def signal_connector(trainer: Any) -> Any:
    """The Trainer's signal connector now installed."""
    return trainer._signal_connector


def route_checkpoint_links(callback: Any, link: Any) -> None:
    """``callback`` (a ``ModelCheckpoint``) links ``last`` through ``link(trainer, filepath, linkpath)``
    ([Note: replaced Lightning internals])."""
    callback._link_checkpoint = link


def allow_url_last_link(callback: Any) -> None:
    """Let ``ModelCheckpoint(save_last="link")`` keep ``last`` at a URL ``dirpath`` ([Note: replaced
    Lightning internals]).

    [Note: last links at URLs] Lightning's ``ModelCheckpoint.setup`` refuses ``save_last="link"``
    for a non-local ``dirpath`` because its ``_link_checkpoint`` makes an ``os.symlink``. Under
    ZeroStrategy that method is routed to the checkpoint lifecycle (``trainer/checkpoints.py``),
    which writes a link commit object at a URL ([Note: commit objects] in ``checkpoint/objstore.py``).
    So this instance's ``setup`` runs Lightning's with ``save_last=True`` (the only check that
    differs) and puts ``"link"`` back. tests/test_object_store.py saves with it; a Lightning that
    renames the attribute or moves the check fails there."""
    if getattr(callback, "_lightning_zero_url_link", False):
        return
    original = callback.setup

    def setup(*args: Any, **kwargs: Any) -> Any:
        callback.save_last = True
        try:
            return original(*args, **kwargs)
        finally:
            callback.save_last = "link"

    callback.setup = setup  # shadows the class's method on this instance only
    callback._lightning_zero_url_link = True
