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
- :class:`TrainerCheckpoints`: ``ZeroStrategy``'s checkpoint methods (Lightning's
  ``strategy_checkpoint`` calls), each translated into the run's events (``runtime/run.py``:
  ``save``, ``prepare_saves``, ``begin_restore``, ...).
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from typing_extensions import override

from lightning_zero.checkpoint.destinations import Location, location
from lightning_zero.checkpoint.objstore import is_url, newest_link
from lightning_zero.runtime.checkpoints import CheckpointLifecycle
from lightning_zero.trainer._lightning_compat import allow_url_last_link, route_checkpoint_links

if TYPE_CHECKING:
    from lightning_zero.runtime.run import ZeroRun


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


class TrainerCheckpoints:
    """``ZeroStrategy``'s checkpoint methods: Lightning's save, load and remove calls (and the
    optimizer step, after which background saves get their host buffers) as the run's events.
    Lightning's own ``strategy_checkpoint`` order: ``load_checkpoint``, then (after ``setup``:
    :attr:`restore_checkpoint_after_setup`) ``load_model_state_dict``, ``load_optimizer_state_dict``."""

    run: "ZeroRun"
    lightning_module: Any
    optimizers: list
    failed: bool
    is_global_zero: bool

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (masters, optimizer shards) must exist before a load

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # tensors are written shard by shard in save_checkpoint, never gathered

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # likewise: each rank writes the optimizer state it owns

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.run.check_storage_options("ZeroStrategy.save_checkpoint", filepath, storage_options)
        assert self.lightning_module is not None
        self.run.save(filepath, checkpoint, step=(checkpoint.get("epoch"), checkpoint.get("global_step")),
                      module=self.lightning_module, optimizers=self.optimizers, precision=self._precision_name(),
                      storage_options=storage_options)  # fmt: skip

    def save_hf_pretrained(self, path: Any, *, dtype: Optional[str] = None, max_shard_size: Any = "50GB") -> Any:
        """Write the model as a Hugging Face directory at ``path`` with no gather: every rank writes
        the bytes of the tensors it holds into their place in the ``model-0000k-of-0000n.safetensors``
        files ``save_pretrained`` would write ([Note: no-gather Hugging Face export] in
        ``checkpoint/hf_write.py``). Call it on every rank (a collective), e.g. from ``on_train_end``.
        ``dtype``: ``fp32``, ``bf16``, ``fp16`` or ``None`` (the fp32 masters); ``max_shard_size``
        as transformers counts it (``5GB`` = 5 * 10^9 bytes, default transformers 5's ``50GB``)."""
        assert self.lightning_module is not None
        if self.failed:  # [Note: failure path]: it needs every rank
            raise RuntimeError(f"ZeroStrategy.save_hf_pretrained({str(path)!r}): a rank failed; not written")
        return self.run.save_hf_pretrained(path, self.lightning_module, self._precision_name(), dtype=dtype,
                                           max_shard_size=max_shard_size)  # fmt: skip

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Optional[Any] = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.run.wants_host_buffers:  # [Note: host buffers before the first save] in checkpoint/background.py
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            callbacks = trainer.checkpoint_callbacks if trainer is not None else []
            weights_only = bool(callbacks) and all(getattr(cb, "save_weights_only", False) for cb in callbacks)
            self.run.prepare_saves(self.lightning_module, self.optimizers, self._precision_name(),
                                   with_optimizer=not weights_only)  # fmt: skip
        return output

    def wait_for_checkpoint(self) -> None:
        """Until a background save in flight is published ([Note: checkpoint lifecycle]); raises its error."""
        self.run.checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.run.begin_restore(checkpoint_path, self._precision_name(), self._leftovers_barrier)  # type: ignore[attr-defined]

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.run.restore_model(self.lightning_module, self.optimizers, self._precision_name(), strict=strict):
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self.run.restore_optimizers(self.optimizers):
            super().load_optimizer_state_dict(checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # once the newer one is published ([Note: checkpoint lifecycle])
            self.run.checkpoints.remove(filepath)
