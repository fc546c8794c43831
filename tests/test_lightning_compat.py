"""The Lightning internals trainer/_lightning_compat.py relies on ([Note: replaced Lightning internals]):
each test fails when the installed Lightning renames the attribute or changes how it is called, so an
upgrade breaks here, by name, instead of silently dropping a signal or a ``last`` link."""

import inspect

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from lightning_zero.trainer._lightning_compat import install_signal_connector, route_checkpoint_links, signal_connector
from lightning_zero.trainer.checkpoints import (
    ZeroMultiProcessingLauncher,
    ZeroSubprocessScriptLauncher,
    resolving_launcher,
)


def test_trainer_calls_its_signal_connector_at_every_entry_point():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert isinstance(signal_connector(trainer), _SignalConnector)
    run_source = inspect.getsource(pl.Trainer._run)
    assert "self._signal_connector.register_signal_handlers()" in run_source
    assert "self._signal_connector.teardown()" in inspect.getsource(pl.Trainer._teardown)

    class Marker(_SignalConnector):
        pass

    mine = Marker(trainer)
    install_signal_connector(trainer, mine)
    assert signal_connector(trainer) is mine and trainer._signal_connector is mine


def test_model_checkpoint_links_last_through_its_static_link_checkpoint():
    link = inspect.getattr_static(ModelCheckpoint, "_link_checkpoint")
    assert isinstance(link, staticmethod)
    assert list(inspect.signature(link.__func__).parameters) == ["trainer", "filepath", "linkpath"]
    assert "self._link_checkpoint(trainer, " in inspect.getsource(ModelCheckpoint)

    calls = []
    callback = ModelCheckpoint(save_last="link")
    route_checkpoint_links(callback, lambda trainer, filepath, linkpath: calls.append((filepath, linkpath)))
    callback._link_checkpoint(None, "a.ckpt", "last.ckpt")
    assert calls == [("a.ckpt", "last.ckpt")]
    assert isinstance(inspect.getattr_static(ModelCheckpoint, "_link_checkpoint"), staticmethod)  # class untouched


def test_our_launchers_are_the_ones_ddp_builds_plus_the_restore():
    # DDPStrategy._configure_launcher builds one of these two per start method; ours are the same
    # classes with a restore before launch (trainer/checkpoints.py), built with the same arguments.
    for start_method, lightning_class, ours in (
        ("popen", _SubprocessScriptLauncher, ZeroSubprocessScriptLauncher),
        ("spawn", _MultiProcessingLauncher, ZeroMultiProcessingLauncher),
    ):
        strategy = DDPStrategy(start_method=start_method, cluster_environment=LightningEnvironment())
        strategy.num_nodes = 1
        strategy.parallel_devices = []
        strategy._configure_launcher()
        assert type(strategy.launcher) is lightning_class
        launcher = resolving_launcher(strategy, strategy._start_method)
        assert type(launcher) is ours and isinstance(launcher, lightning_class)
        assert vars(launcher).keys() == vars(strategy.launcher).keys()


def test_model_checkpoint_refuses_url_links_only_by_save_last():
    """[Note: last links at URLs]: Lightning's refusal of ``save_last="link"`` at a URL reads
    ``self.save_last`` in ``setup``; ``allow_url_last_link`` runs that setup with ``True`` and puts
    ``"link"`` back (a later save then routes the link to the lifecycle)."""
    import pytest

    from lightning_zero.trainer._lightning_compat import allow_url_last_link

    source = inspect.getsource(ModelCheckpoint.setup)
    assert 'self.save_last == "link"' in source and "_is_local_file_protocol" in source
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    callback = ModelCheckpoint(dirpath="memory://lz-compat/ckpts", save_last="link")
    with pytest.raises(ValueError, match="save_last='link'"):
        callback.setup(trainer, None, stage="fit")
    allow_url_last_link(callback)
    callback.setup(trainer, None, stage="fit")
    assert callback.save_last == "link"
