"""What fabric/_compat.py relies on ([Note: replaced attributes at the Fabric door]): each test fails
when the installed torch, Lightning or LitGPT changes it, so an upgrade breaks here, by name."""

import inspect
import sys
from pathlib import Path

import lightning
import pytest
from torch import nn

from lightning_zero.fabric._compat import (
    fabric_class_replaced,
    install_excepthook,
    restore_excepthook,
    route_load_state_dict,
    unroute_load_state_dict,
)


def test_the_excepthook_chains_and_leaves_a_later_hook_in_place():
    original = sys.excepthook

    def ours(*args):
        pass

    def later(*args):
        pass

    try:
        previous = install_excepthook(ours)
        assert previous is original and sys.excepthook is ours
        restore_excepthook(ours, previous)
        assert sys.excepthook is original
        install_excepthook(ours)
        sys.excepthook = later  # someone installed a hook after ours: theirs stays
        restore_excepthook(ours, original)
        assert sys.excepthook is later
    finally:
        sys.excepthook = original


def test_load_state_dict_keeps_the_signature_the_route_serves():
    # the route is called as torch's method is: load_state_dict(state_dict, strict=True, assign=False)
    assert list(inspect.signature(nn.Module.load_state_dict).parameters) == ["self", "state_dict", "strict", "assign"]
    module = nn.Linear(2, 2)
    calls = []
    route_load_state_dict(module, lambda state_dict, strict=True, assign=False: calls.append((strict, assign)))
    module.load_state_dict({}, strict=False)
    assert calls == [(False, False)]
    unroute_load_state_dict(module)
    assert module.load_state_dict.__func__ is nn.Module.load_state_dict
    assert "load_state_dict" not in vars(nn.Linear)  # the class was never touched


@pytest.mark.parametrize("script", ["finetune/lora.py", "finetune/adapter.py", "finetune/full.py", "pretrain.py"])
def test_litgpt_builds_its_fabric_through_the_module_attribute(script):
    # ``import lightning as L`` ... ``L.Fabric(...)`` looks Fabric up when the script runs, so the
    # wrapper's replacement reaches it; ``from lightning import Fabric`` would bind it at import.
    litgpt = pytest.importorskip("litgpt")
    source = (Path(litgpt.__file__).parent / script).read_text()
    assert "import lightning as L" in source and "L.Fabric(" in source
    assert "from lightning import Fabric" not in source


def test_the_fabric_class_is_restored_after_the_block():
    original = lightning.Fabric

    class Mine(original):
        pass

    with fabric_class_replaced(Mine) as found:
        assert found is original and lightning.Fabric is Mine
    assert lightning.Fabric is original
    with pytest.raises(RuntimeError), fabric_class_replaced(Mine):
        raise RuntimeError("a failing script")
    assert lightning.Fabric is original
