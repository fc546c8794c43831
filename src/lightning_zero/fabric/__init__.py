"""The Fabric door: ``L.Fabric(strategy="zero1" | "zero2" | "zero3")`` or ``ZeroFabricStrategy(...)``
(``fabric/strategy.py``), its precision mapping (``fabric/precision.py``). Never imports
``lightning.pytorch``; what it shares with the Trainer door is ``runtime/``."""

from lightning_zero.fabric.strategy import ZeroFabricStrategy

__all__ = ["ZeroFabricStrategy"]
