"""lightning_zero: ZeRO stages 1-3 and node-local tensor parallelism for PyTorch Lightning.

``import lightning_zero`` registers the strategies ``"zero1"``, ``"zero2"`` and ``"zero3"`` in
Lightning's strategy registry: at once when Lightning is already imported, else the moment it is
(so the engine, ``lightning_zero.zero``, can be used without importing Lightning at all).
Everything else is imported lazily, so the import stays cheap.
"""

from __future__ import annotations

from lightning_zero._lazy import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "ZeroStrategy": "lightning_zero.trainer.strategy",
    "ZeroFabricStrategy": "lightning_zero.fabric.strategy",
    "ZeroMonitor": "lightning_zero.trainer.monitor",
    "LlamaConfig": "lightning_zero.models",
    "Llama": "lightning_zero.models",
    "LlamaLM": "lightning_zero.models",
    "model_state_bytes": "lightning_zero.ledger",
    "GroupedMuon": "lightning_zero.zero.muon",
}

__all__ = sorted(_LAZY) + ["__version__"]

__getattr__ = lazy_attributes(__name__, _LAZY)


def _register_strategies() -> None:
    from lightning_zero._registry import register_now_or_on_import

    register_now_or_on_import()


_register_strategies()
