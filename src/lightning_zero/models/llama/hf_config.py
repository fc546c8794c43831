"""A Hugging Face Llama, Mistral, Qwen2(.5) or Qwen3 directory's ``config.json``, read into
``LlamaConfig`` fields (the families that are a Llama decoder with flags: ``FAMILY_ARCHITECTURES``).

Plain data in, plain data out: ``LlamaConfig.from_hf`` (``config.py``) builds the config from
these fields, so the config module reads config.json without importing the rest of the Hugging
Face layout (``hf.py``: names, tensors, export), which imports ``LlamaConfig``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

from lightning_zero.models.llama.rope_scaling import normalize_rope_scaling

PathLike = Union[str, os.PathLike]
CONFIG_FILE = "config.json"
ARCHITECTURE = "LlamaForCausalLM"
# config.json's model_type -> its architecture: each a Llama decoder with flags (``LlamaConfig.family``).
FAMILY_ARCHITECTURES = {"llama": ARCHITECTURE, "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
# transformers' MistralConfig default when config.json names no sliding_window.
MISTRAL_DEFAULT_WINDOW = 4096


def read_hf_config(path: PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory ``path``."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(
            f"{config_path}: missing; init_from needs a Hugging Face model directory (config.json + weights)"
        )
    try:
        values = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: unreadable ({exc})") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{config_path}: expected a JSON object")
    return values


def _rope_scaling_from_hf(values: Mapping[str, Any], where: Path) -> Optional[dict[str, Any]]:
    """``LlamaConfig.rope_scaling`` from a config.json (``rope_scaling`` wins over
    ``rope_parameters``, as in transformers 5), with transformers' defaults filled in: the
    context ``original_max_position_embeddings`` of ``llama3``/``yarn`` defaults to
    ``max_position_embeddings``, which is always ``dynamic``'s; yarn's ``factor`` defaults to
    their ratio."""
    raw = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    rope_type = str(raw.get("rope_type") or raw.get("type") or "default")
    max_positions = values.get("max_position_embeddings")
    if rope_type == "dynamic" and max_positions is not None:
        raw["original_max_position_embeddings"] = int(max_positions)
    elif rope_type in ("llama3", "yarn") and max_positions is not None:
        raw.setdefault("original_max_position_embeddings", int(max_positions))
    if rope_type == "yarn" and raw.get("factor") is None and max_positions is not None:
        raw["factor"] = int(max_positions) / int(raw["original_max_position_embeddings"])
    return normalize_rope_scaling(raw, where=str(where))


def _family_fields(values: Mapping[str, Any], family: str, where: Path) -> dict[str, Any]:
    """The flags of ``family`` (``qk_norm``, ``qkv_bias``, ``sliding_window``) from config.json,
    refusing what its ``transformers`` class would compute differently from ``Llama``."""
    bias_key = {"llama": "attention_bias", "mistral": None, "qwen2": None, "qwen3": "attention_bias"}[family]
    refusals = {"hidden_act": (values.get("hidden_act", "silu"), "silu")}
    if bias_key is not None:
        refusals[bias_key] = (values.get(bias_key, False), False)
    if family == "llama":
        refusals["mlp_bias"] = (values.get("mlp_bias", False), False)
    for key, (got, want) in refusals.items():
        if got != want:
            raise ValueError(f"{where}: {key} = {got!r} is not supported ({family} here uses {want!r})")
    fields: dict[str, Any] = dict(family=family, qk_norm=family == "qwen3", qkv_bias=family == "qwen2")
    if family == "mistral":
        fields["sliding_window"] = values.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
    elif family in ("qwen2", "qwen3"):  # transformers applies their window only with use_sliding_window
        sliding = [i for i, kind in enumerate(values.get("layer_types") or []) if kind == "sliding_attention"]
        if values.get("use_sliding_window") or sliding:
            raise ValueError(
                f"{where}: use_sliding_window / sliding_attention layers {sliding} are not supported for {family} "
                "(only full attention in every layer, as the published Qwen2.5 and Qwen3 checkpoints have)"
            )
    return fields


def config_fields_from_hf(path: PathLike) -> dict[str, Any]:
    """The ``LlamaConfig`` fields of a Hugging Face Llama, Mistral, Qwen2(.5) or Qwen3 directory,
    refusing what ``Llama`` cannot compute (``LlamaConfig.from_hf`` builds the config from them)."""
    values = read_hf_config(path)
    where = Path(path) / CONFIG_FILE
    model_type = values.get("model_type")
    architecture = FAMILY_ARCHITECTURES.get(str(model_type))
    architectures = values.get("architectures") or [architecture]
    if architecture is None or any(arch != architecture for arch in architectures):
        known = ", ".join(f"{name!r} ({arch})" for name, arch in FAMILY_ARCHITECTURES.items())
        raise ValueError(
            f"{where}: model_type {model_type!r}, architectures {architectures}: only these dense families can be "
            f"loaded here: {known} (Mixtral and Qwen3-MoE: the MoE models, lightning_zero.models.moe)"
        )
    rope_scaling = _rope_scaling_from_hf(values, where)
    family = _family_fields(values, str(model_type), where)
    try:
        dim, n_heads = int(values["hidden_size"]), int(values["num_attention_heads"])
        head_dim = values.get("head_dim") or dim // n_heads
        theta = values.get("rope_theta") or (values.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return dict(
            name=f"hf:{Path(path).resolve().name}",
            vocab_size=int(values["vocab_size"]),
            dim=dim,
            n_layers=int(values["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(values.get("num_key_value_heads") or n_heads),
            ffn_dim=int(values["intermediate_size"]),
            max_seq_len=int(values.get("max_position_embeddings", 4096)),
            norm_eps=float(values.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            tie_embeddings=bool(values.get("tie_word_embeddings", False)),
            head_dim=int(head_dim),
            **family,
        )
    except KeyError as exc:
        raise ValueError(f"{where}: missing field {exc.args[0]!r}") from exc
