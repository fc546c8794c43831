"""The rope scaling of a ``LlamaConfig``: its types and keys, read and checked into one canonical
dict (see [Note: rope scaling] in ``rope.py`` for what each type computes). Plain Python: the
config, config.json reading and the planner use it without importing torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
# rope_type -> (required keys, optional keys with their defaults; None: absent unless given)
_KEYS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "linear": (("factor",), {}),
    "dynamic": (("factor", "original_max_position_embeddings"), {}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "attention_factor": None,
            "truncate": True,
        },
    ),  # fmt: skip
}
# Keys a config.json's rope dict may carry that are not part of the scaling itself.
_IGNORED_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def normalize_rope_scaling(values: Optional[Mapping[str, Any]], where: str) -> Optional[dict[str, Any]]:
    """The canonical ``LlamaConfig.rope_scaling`` dict of ``values`` (or ``None`` for no scaling).

    ``values``: ``{"rope_type": ..., <keys of that type>}`` (``type`` is accepted for
    ``rope_type``, as old config.json files write it). Raises ``ValueError`` naming ``where``,
    the type and the key for an unknown type, a missing or unknown key, or a bad value.
    """
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: rope_scaling must be a mapping with a 'rope_type' or null, got {values!r}")
    rope_type = str(values.get("rope_type") or values.get("type") or "default")
    if rope_type == "default":
        return None
    if rope_type not in _KEYS:
        raise ValueError(
            f"{where}: rope scaling {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
            "(or none: the default rotary embedding)"
        )
    required, optional = _KEYS[rope_type]
    partial = values.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: rope partial_rotary_factor {partial!r} is not supported (Llama rotates all dims)")
    unknown = sorted(set(values) - set(required) - set(optional) - set(_IGNORED_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: rope scaling {rope_type!r} has unknown key(s) {unknown}; it takes {list(required)}"
            + (f" and optionally {list(optional)}" if optional else "")
        )
    missing = [key for key in required if values.get(key) is None]
    if missing:
        raise ValueError(f"{where}: rope scaling {rope_type!r} misses {missing}; it needs {list(required)}")
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for key in required:
        scaling[key] = int(values[key]) if key == "original_max_position_embeddings" else float(values[key])
    for key, default in optional.items():
        value = values.get(key, default)
        if value is not None:
            scaling[key] = bool(value) if key == "truncate" else float(value)
    if not scaling["factor"] > 0 or scaling.get("original_max_position_embeddings", 1) < 1:
        raise ValueError(
            f"{where}: rope scaling {rope_type!r} needs factor > 0 and original_max_position_embeddings >= 1"
        )
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0:
        raise ValueError(
            f"{where}: rope scaling 'llama3' needs high_freq_factor ({scaling['high_freq_factor']}) > "
            f"low_freq_factor ({scaling['low_freq_factor']}) > 0"
        )
    return scaling


def needs_dynamic_tables(scaling: Optional[Mapping[str, Any]], seq_len: int) -> bool:
    """True when a forward of ``seq_len`` tokens needs tables recomputed for its length (``dynamic``)."""
    return bool(scaling) and scaling["rope_type"] == "dynamic" and seq_len > scaling["original_max_position_embeddings"]
