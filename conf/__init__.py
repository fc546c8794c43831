"""Hydra config groups of the ``lightning-zero`` CLI (a package so Hydra finds it as ``pkg://``)."""
