"""The Trainer door of [Note: checkpoint lifecycle] (``runtime/checkpoints.py``): Lightning glue only.

- The launchers: Lightning resolves ``ckpt_path="last"`` (and SLURM's ``hpc_ckpt_<N>``) in
  ``_fit_impl`` / ``_validate_impl`` / ..., before the strategy's ``setup`` and before any process
  group exists. The strategy's launcher is the first of its code every entry point runs, on every
  rank, so ours restores what a killed publish moved aside (and hides staging names of earlier
  releases) there, in the run's directory and every ``ModelCheckpoint``'s, then launches as
  Lightning's does.
- ``ckpt_path="last"`` where a ``ModelCheckpoint``'s ``dirpath`` is a URL: Lightning's own lookup
  lists ``last*.ckpt`` through ``os.path.normpath``, which drops the ``s3://``, and finds nothing.
  The same launchers (every entry point, torchrun and SLURM included) replace ``"last"`` with the newest ``last*.ckpt`` there whose commit
  resolves ([Note: commit objects] in ``checkpoint/objstore.py``) before the entry point runs.
- ``ModelCheckpoint(save_last="link")``: its ``_link_checkpoint`` is routed to the lifecycle, so
  ``last.ckpt`` is linked to a checkpoint only once it is published (under ``async_checkpoint``
  that is after the background write), in one rename.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_zero.checkpoint.destinations import Location, location
from lightning_zero.checkpoint.objstore import is_url, newest_link
from lightning_zero.runtime.checkpoints import CheckpointLifecycle
from lightning_zero.trainer._lightning_compat import allow_url_last_link, route_checkpoint_links


def checkpoint_directories(trainer: Any) -> list[Location]:
    """Where Lightning looks for checkpoints: the run's directory and every ``ModelCheckpoint``'s."""
    directories = [location(str(trainer.default_root_dir))]
    directories += [location(str(cb.dirpath)) for cb in trainer.checkpoint_callbacks
                    if isinstance(cb, ModelCheckpoint) and cb.dirpath]  # fmt: skip
    return directories


def _before_launch(function: Callable, args: tuple, kwargs: dict, trainer: Any) -> tuple[tuple, dict]:
    """What every launcher of ours does before the entry point: moved-aside checkpoints restored,
    ``ckpt_path="last"`` resolved through commits where a checkpoint directory is a URL."""
    if trainer is None:
        return args, kwargs
    CheckpointLifecycle.restore_before_resolve(checkpoint_directories(trainer))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last == "link" and is_url(str(callback.dirpath)):
            allow_url_last_link(callback)  # [Note: last links at URLs] in _lightning_compat.py
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    urls = [str(cb.dirpath) for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and is_url(str(cb.dirpath or ""))]  # fmt: skip
    if not urls:
        return args, kwargs
    names = {
        re.escape(cb.CHECKPOINT_NAME_LAST) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
    }
    pattern = re.compile(rf"^({'|'.join(sorted(names))})(-v\d+)?{re.escape(ModelCheckpoint.FILE_EXTENSION)}$")
    storage = trainer.strategy.checkpoints.storage
    newest = newest_link([location(url) for url in urls], storage, pattern)
    if newest is not None:
        bound.arguments["ckpt_path"] = newest
    return bound.args, bound.kwargs


class ZeroSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, after :func:`_before_launch` on each rank."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = _before_launch(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork`` launcher, after :func:`_before_launch` in the main process."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = _before_launch(function, args, kwargs, trainer)
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
