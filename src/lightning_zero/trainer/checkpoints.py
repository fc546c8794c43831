"""The Trainer door of [Note: checkpoint lifecycle] (``runtime/checkpoints.py``): Lightning glue only.

- The launchers: Lightning resolves ``ckpt_path="last"`` (and SLURM's ``hpc_ckpt_<N>``) in
  ``_fit_impl`` / ``_validate_impl`` / ..., before the strategy's ``setup`` and before any process
  group exists. The strategy's launcher is the first of its code every entry point runs, on every
  rank, so ours restores what a killed publish moved aside (and hides staging names of earlier
  releases) there, in the run's directory and every ``ModelCheckpoint``'s, then launches as
  Lightning's does.
- ``ModelCheckpoint(save_last="link")``: its ``_link_checkpoint`` is routed to the lifecycle, so
  ``last.ckpt`` is linked to a checkpoint only once it is published (under ``async_checkpoint``
  that is after the background write), in one rename.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_zero.runtime.checkpoints import CheckpointLifecycle
from lightning_zero.trainer._lightning_compat import route_checkpoint_links


def checkpoint_directories(trainer: Any) -> list[Path]:
    """Where Lightning looks for checkpoints: the run's directory and every ``ModelCheckpoint``'s."""
    directories = [Path(trainer.default_root_dir)]
    directories += [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
                    and cb.dirpath]  # fmt: skip
    return directories


def _restore(trainer: Any) -> None:
    if trainer is not None:
        CheckpointLifecycle.restore_before_resolve(checkpoint_directories(trainer))


class ZeroSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher; each rank restores moved-aside checkpoints before it runs."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _restore(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork`` launcher; the main process restores before it starts any rank."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _restore(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def resolving_launcher(strategy: Any, start_method: str) -> Any:
    """The launcher ``DDPStrategy._configure_launcher`` builds for ``start_method``, as the subclass
    that restores first (``isinstance`` checks against Lightning's launchers still hold)."""
    if start_method == "popen":
        return ZeroSubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    return ZeroMultiProcessingLauncher(strategy, start_method=start_method)


def route_links(trainer: Any, lifecycle: CheckpointLifecycle) -> None:
    """Every ``ModelCheckpoint``'s ``last`` link goes through ``lifecycle.link`` (published targets only)."""

    def link_after_publish(trainer: Any, filepath: str, linkpath: str) -> None:
        import os

        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            lifecycle.link(filepath, linkpath)
        trainer.strategy.barrier()

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            route_checkpoint_links(callback, link_after_publish)
