"""The Hugging Face Llama layout: config.json fields, tensor names and the q/k rotary permutation.

Everything Llama-specific about ``transformers``' ``LlamaForCausalLM`` checkpoints lives here (the
reading of config.json into ``LlamaConfig`` fields in ``hf_config.py``), import and export alike
(:func:`export_hf`); the reading, slicing, assembling and shard writing are model-agnostic
(``lightning_zero.checkpoint.hf``, ``lightning_zero.checkpoint.export``).

[Note: rotary permutation] Meta's Llama (and ours, see ``apply_rope``) rotates *adjacent* channel
pairs ``(0, 1), (2, 3), ...`` of each head; ``transformers`` rotates the two *halves*
``(i, i + head_dim / 2)``. Meta's conversion script therefore permutes the rows of ``wq`` and
``wk`` within every head so the half-split rotation computes the same attention:
``hf = w.view(heads, head_dim / 2, 2, dim).transpose(1, 2)``. Loading applies the inverse,
``w.view(heads, 2, head_dim / 2, dim).transpose(1, 2)``; export applies it forward. The
permutation never crosses a head, so a tensor-parallel slice of whole heads is permuted on its own.

Name map (``i`` = layer):

==========================================  ==================================
Hugging Face                                ``Llama``
==========================================  ==================================
model.embed_tokens.weight                   tok_embeddings.weight
model.layers.i.input_layernorm.weight       layers.i.attention_norm.weight
model.layers.i.self_attn.{q,k}_proj.weight  layers.i.attention.w{q,k}.weight (permuted)
model.layers.i.self_attn.{v,o}_proj.weight  layers.i.attention.w{v,o}.weight
model.layers.i.post_attention_layernorm     layers.i.ffn_norm.weight
model.layers.i.mlp.{gate,up,down}_proj      layers.i.feed_forward.w{1,3,2}.weight
model.norm.weight                           norm.weight
lm_head.weight                              output.weight (tied: model.embed_tokens.weight)
==========================================  ==================================

Tied embeddings (``tie_word_embeddings: true``, no ``lm_head.weight``: Llama 3.2 1B/3B) stay tied:
``LlamaConfig.tie_embeddings``, one Parameter ([Note: tied head] in ``model.py``); export writes
no ``lm_head.weight`` and ``tie_word_embeddings: true``.

Rope scaling (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4.x; [Note: rope scaling]
in ``rope.py``) is read into ``LlamaConfig.rope_scaling`` and written back in both spellings, so
either major version of ``transformers`` reads the exported directory with the same ``inv_freq``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_zero.checkpoint.dcp import CheckpointError, read_dcp_metadata
from lightning_zero.checkpoint.export import assemble
from lightning_zero.checkpoint.hf import (
    Source,
    TensorSpec,
    WeightFiles,
    check_plan,
    load_module_params,
    open_weight_files,
    parse_size,
    remove_stale_weights,
    upload_directory,
    write_safetensors_shards,
)
from lightning_zero.checkpoint.load import open_checkpoint
from lightning_zero.models.llama.config import LlamaConfig, preset_names, resolve_config
from lightning_zero.models.llama.hf_config import CONFIG_FILE, FAMILY_ARCHITECTURES, PathLike, read_hf_config
from lightning_zero.models.llama.rope_scaling import normalize_rope_scaling

if TYPE_CHECKING:
    from lightning_zero.checkpoint.hf_write import HFExport

# Keys some checkpoints carry that are derived, not learned (old transformers saved the RoPE table).
IGNORABLE_KEYS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
# LlamaConfig fields that config.json decides (max_seq_len, the rotary table length, may differ).
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta",
                "rope_scaling", "tie_embeddings", "head_dim", "qk_norm", "qkv_bias", "sliding_window",
                "family")  # fmt: skip


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def hf_rope_fields(config: LlamaConfig) -> dict[str, Any]:
    """The rope fields of config.json for ``config``: ``rope_parameters`` (transformers 5),
    ``rope_scaling`` and ``rope_theta`` (4.x), and for ``dynamic`` the ``max_position_embeddings``
    its scaling starts after."""
    scaling = dict(config.rope_scaling or {})
    fields: dict[str, Any] = {"rope_theta": config.rope_theta}
    if scaling.get("rope_type") == "dynamic":
        fields["max_position_embeddings"] = scaling.pop("original_max_position_embeddings")
    fields["rope_scaling"] = scaling or None
    fields["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}
    return fields


def config_from_hf(path: PathLike) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama directory (``LlamaConfig.from_hf``)."""
    return LlamaConfig.from_hf(path)


def hf_config_dict(config: LlamaConfig, dtype: torch.dtype, base: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """``config.json`` for ``config``; ``base`` (the source checkpoint's config.json, when known)
    contributes the fields we do not own (token ids, ``max_position_embeddings`` if larger)."""
    values = {
        k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype")
    }
    max_positions = max(config.max_seq_len, int((base or {}).get("max_position_embeddings", 0)))
    family = config.family
    values.update(architectures=[FAMILY_ARCHITECTURES[family]], model_type=family, **hf_decoder_fields(config, dtype))
    values.update(intermediate_size=config.ffn_dim, max_position_embeddings=max_positions)
    if family == "llama":
        values.update(mlp_bias=False)
    elif family == "mistral":
        values.update(sliding_window=config.sliding_window)
    else:  # qwen2 / qwen3: full attention in every layer ([Note] in hf_config._family_fields)
        values.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers,
                      layer_types=["full_attention"] * config.n_layers)  # fmt: skip
        if family == "qwen2":  # its q/k/v biases are not a config field
            del values["attention_bias"]
    values.update(hf_rope_fields(config))  # dynamic: max_position_embeddings is where scaling starts
    return values


def hf_decoder_fields(config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json fields of the decoder every Llama-style family shares (embeddings,
    attention, norms, dtype): a ``LlamaConfig`` or a config with the same fields (``MoEConfig``)."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        attention_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        torch_dtype=str(dtype).removeprefix("torch."),
    )


def pretrained_config(requested: Union[None, str, LlamaConfig, Mapping[str, Any]], path: PathLike) -> LlamaConfig:
    """The shape of ``path``'s config.json, checked against what the caller asked for.

    ``requested``: ``None`` or a name that is not a preset (``"hf"``): take config.json's shape;
    a preset name or mapping: every shape field it sets must agree with config.json (else
    ``ValueError`` listing the disagreements). ``max_seq_len`` (rotary table length) may differ.
    """
    loaded = config_from_hf(path)
    if requested is None:
        return loaded
    if isinstance(requested, LlamaConfig):
        requested = dataclasses.asdict(requested)
    if isinstance(requested, str):
        requested = {"name": requested}
    values = {str(k): v for k, v in requested.items() if v is not None}
    name = values.pop("name", None)
    if name is not None and str(name).lower() in preset_names():
        values = {**dataclasses.asdict(LlamaConfig.from_name(name)), **values}
        values.pop("name")
    max_seq_len = int(values.pop("max_seq_len", loaded.max_seq_len))
    unknown = sorted(set(values) - set(SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"model config: unknown field(s) {unknown}")
    disagree = []
    if "rope_scaling" in values:  # compare canonical forms
        values["rope_scaling"] = normalize_rope_scaling(values["rope_scaling"], where=f"model {name!r}")
    for field_name, wanted in values.items():
        have = getattr(loaded, field_name)
        numeric = isinstance(have, float) and not isinstance(wanted, (str, bool))
        same = math.isclose(float(wanted), float(have), rel_tol=1e-9) if numeric else wanted == have
        if not same:
            disagree.append(f"{field_name} {wanted!r} (config.json: {have!r})")
    if disagree:
        raise ValueError(
            f"model {name!r} disagrees with {Path(path) / CONFIG_FILE}: {', '.join(disagree)}. With init_from the "
            "shape comes from config.json: use model=hf (or the matching preset) and drop the shape overrides"
        )
    return dataclasses.replace(loaded, max_seq_len=max_seq_len)


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def permute_for_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Our (Meta) q/k rows -> Hugging Face's (see [Note: rotary permutation])."""
    rows = weight.shape[0]
    return weight.reshape(rows // head_dim, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_from_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face q/k rows -> ours (see [Note: rotary permutation])."""
    rows = weight.shape[0]
    return weight.reshape(rows // head_dim, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _rope_rows(tensor: torch.Tensor, dim: Optional[int], *, head_dim: int, to_hf: bool) -> torch.Tensor:
    """A :class:`Source` transform: (un)permute q/k rows; ``dim``: the TP split dim of the slice."""
    if dim not in (None, 0):
        raise ValueError(f"q/k projections split along dim {dim}: the rotary permutation needs whole heads (rows)")
    return permute_for_hf(tensor, head_dim) if to_hf else unpermute_from_hf(tensor, head_dim)


def _rows(tensor: torch.Tensor, dim: Optional[int], *, head_dim: int, to_hf: bool) -> torch.Tensor:
    """A :class:`Source` transform for a q/k bias or norm gain: (un)permuted as rows of ``wq``."""
    return _rope_rows(tensor.reshape(tensor.shape[0], 1), dim, head_dim=head_dim, to_hf=to_hf).reshape(tensor.shape)


# One row of a block's layout: (our name, Hugging Face name, which shape, permuted). In the order
# of transformers' ``state_dict()`` (its modules' registration order), which decides how
# ``save_pretrained`` groups tensors into files (``checkpoint.hf.plan_shards``).
_BLOCK_LAYOUT = (
    ("attention.wq.weight", "self_attn.q_proj.weight", "q", True),
    ("attention.wq.bias", "self_attn.q_proj.bias", "q_bias", True),
    ("attention.wk.weight", "self_attn.k_proj.weight", "kv", True),
    ("attention.wk.bias", "self_attn.k_proj.bias", "kv_bias", True),
    ("attention.wv.weight", "self_attn.v_proj.weight", "kv", False),
    ("attention.wv.bias", "self_attn.v_proj.bias", "kv_bias", False),
    ("attention.wo.weight", "self_attn.o_proj.weight", "o", False),
    ("attention.q_norm.weight", "self_attn.q_norm.weight", "head", True),
    ("attention.k_norm.weight", "self_attn.k_norm.weight", "head", True),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", "up", False),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", "up", False),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", "down", False),
    ("attention_norm.weight", "input_layernorm.weight", "dim", False),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "dim", False),
)


def _block_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim  # type: ignore[operator]
    return dict(q=(q_dim, config.dim), q_bias=(q_dim,), kv=(kv_dim, config.dim), kv_bias=(kv_dim,),
                o=(config.dim, q_dim), head=(config.head_dim,), up=(config.ffn_dim, config.dim),
                down=(config.dim, config.ffn_dim), dim=(config.dim,))  # fmt: skip


def _in_block(config: LlamaConfig, ours: str) -> bool:
    if ours.endswith(".bias"):
        return config.qkv_bias
    if ".q_norm." in ours or ".k_norm." in ours:
        return config.qk_norm
    return True


def tensor_plan(config: LlamaConfig, *, tied: bool = False, to_hf: bool = False) -> dict[str, Source]:
    """``{our parameter name: Source}`` in transformers' ``state_dict()`` order: the Hugging Face
    key, the dense shape, the q/k permutation of ``wq``/``wk`` rows, their biases and the q/k norm
    gains (towards ours when loading, towards Hugging Face's with ``to_hf``). ``tied``: the
    checkpoint has no ``lm_head.weight``; the head reads the embedding (``config.tie_embeddings``:
    the head *is* the embedding, so no entry)."""
    shapes = _block_shapes(config)
    rope = functools.partial(_rope_rows, head_dim=config.head_dim, to_hf=to_hf)  # picklable (spawn)
    rows = functools.partial(_rows, head_dim=config.head_dim, to_hf=to_hf)
    table = (config.vocab_size, config.dim)
    plan = {"tok_embeddings.weight": Source("model.embed_tokens.weight", table)}
    for i in range(config.n_layers):
        for ours, theirs, shape, permuted in _BLOCK_LAYOUT:
            if _in_block(config, ours):
                transform = (rope if shape in ("q", "kv") else rows) if permuted else None
                plan[f"layers.{i}.{ours}"] = Source(f"model.layers.{i}.{theirs}", shapes[shape], transform)
    plan["norm.weight"] = Source("model.norm.weight", (config.dim,))
    if not config.tie_embeddings:
        plan["output.weight"] = Source("model.embed_tokens.weight" if tied else "lm_head.weight", table)
    return plan


class HFLlamaWeights:
    """The weights of a Hugging Face Llama directory, checked against ``config`` and ready to fill
    ``Llama`` units one at a time (the source ``Llama.init_module`` reads from when set).

    Opening reads config.json and the file headers only; any missing or truncated shard, missing
    or unexpected tensor, or wrong shape raises ``CheckpointError`` naming the file and tensor.
    """

    def __init__(self, path: PathLike, config: LlamaConfig) -> None:
        self.path = Path(path)
        hf_config = read_hf_config(path)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))  # config.tie_embeddings follows it
        self.files: WeightFiles = open_weight_files(path)
        self.plan = tensor_plan(config, tied=self.tied)
        ignore = list(IGNORABLE_KEYS) + (["lm_head\\.weight"] if self.tied else [])
        check_plan(self.files, self.plan, ignore=ignore)
        self.bytes_read = 0

    def load(self, module: nn.Module, prefix: str) -> None:
        """Fill ``module`` (the model's submodule named ``prefix``) with its (TP-local) weights."""
        self.bytes_read += load_module_params(module, prefix, self.files, self.plan)

    def __repr__(self) -> str:
        return f"HFLlamaWeights({str(self.path)!r}, {len(self.files.infos)} tensors, {self.files.format})"


# --------------------------------------------------------------------------------------------
# Export (``lightning-zero export --format hf``)
# --------------------------------------------------------------------------------------------

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_export_dtype(dtype: Optional[str]) -> None:
    """``export --dtype``: one of :data:`EXPORT_DTYPES`, or ``None`` (the saved dtype)."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export --dtype {dtype!r}: expected one of {sorted(EXPORT_DTYPES)}")


def hf_export(config: LlamaConfig, base: Optional[Mapping[str, Any]] = None, prefix: str = "") -> "HFExport":
    """What the no-gather export writes for a ``Llama`` of ``config`` whose parameters are named
    ``prefix + name`` (``checkpoint.hf_write``): sources towards Hugging Face's layout, and its
    config.json (``base``: the source directory's, for the fields we do not own)."""
    from lightning_zero.checkpoint.hf_write import HFExport

    if not isinstance(config, LlamaConfig):
        raise ValueError(
            f"no-gather Hugging Face export: {type(config).__name__} {config.name!r} is not a dense Llama-family "
            "config; export a mixture of experts from its checkpoint with lightning-zero export --format hf"
        )
    sources = {prefix + name: source for name, source in tensor_plan(config, to_hf=True).items()}
    aliases = frozenset({prefix + "output.weight"}) if config.tie_embeddings else frozenset()
    return HFExport(sources, lambda dtype: hf_config_dict(config, dtype, base), aliases)


def write_hf_export(
    out: Union[str, os.PathLike],
    specs: list[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    *,
    max_shard_size: Union[str, int],
    checkpoint_format: Any,
    config_dict: Callable[[torch.dtype], dict[str, Any]],
    dtype: Optional[str],
) -> Path:
    """The streamed end of every family's ``export_hf``: stale shards removed from ``out``, the
    ``specs`` written one tensor at a time from ``produce``, and ``config.json`` for the written
    dtype (``dtype``, or the first tensor's saved dtype). ``out`` may be an fsspec URL: written
    locally, then uploaded (:func:`~lightning_zero.checkpoint.hf.upload_directory`)."""
    from lightning_zero.checkpoint import objstore

    if objstore.is_url(out):
        import tempfile

        with tempfile.TemporaryDirectory() as local:
            write_hf_export(local, specs, produce, max_shard_size=max_shard_size, checkpoint_format=checkpoint_format,
                            config_dict=config_dict, dtype=dtype)  # fmt: skip
            upload_directory(Path(local), str(out))
        return out  # type: ignore[return-value]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_weights(out)
    write_safetensors_shards(out, specs, produce, max_shard_bytes=parse_size(max_shard_size),
                             metadata={"lightning_zero_format": checkpoint_format})  # fmt: skip
    out_dtype = EXPORT_DTYPES[dtype] if dtype else specs[0].dtype
    (out / CONFIG_FILE).write_text(json.dumps(config_dict(out_dtype), indent=2) + "\n")
    return out


def describe_recorded_model(hparams: Any) -> str:
    """What a checkpoint's ``hyper_parameters`` say about its model, for an exporter's error: the
    family of the recorded ``config`` ([Note: the recorded config] in ``models/llama/lightning.py``)."""
    config = hparams.get("config") if isinstance(hparams, dict) else None
    if isinstance(config, dict) and "n_experts" in config:
        return (f"its hyper_parameters record a MoELM config (a mixture of experts: {config['n_experts']} experts,"
                f" {config.get('n_layers')} layers)")  # fmt: skip
    if isinstance(config, dict):
        return (
            f"its hyper_parameters record a LlamaLM config ({config.get('n_layers')} layers, dim {config.get('dim')})"
        )
    if isinstance(config, str):
        return f"its hyper_parameters record config {config!r}, a name that is no Llama preset ({', '.join(preset_names())})"
    keys = sorted(hparams) if isinstance(hparams, dict) else []
    return (f"its hyper_parameters record no model config (keys {keys}): a LightningModule other than LlamaLM or"
            " MoELM wrote it")  # fmt: skip


def export_hf(
    ckpt: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    *,
    dtype: Optional[str] = None,
    max_shard_size: Union[str, int] = "50GB",
) -> Path:
    """Write the ``LlamaLM`` checkpoint ``ckpt`` as a Hugging Face Llama directory at ``out``.

    ``out`` gets ``config.json``, ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
    shards of at most ``max_shard_size`` (``5GB`` = 5 * 10^9 bytes, as Hugging Face counts) and
    ``model.safetensors.index.json``. ``dtype``: ``fp32``, ``bf16`` or ``fp16``; ``None`` keeps the
    saved dtype (fp32 masters). Streams one tensor at a time (assembled from its saved
    rectangles, permuted to Hugging Face's rotary layout, cast, written), so peak memory is about
    one tensor. ``transformers.LlamaForCausalLM.from_pretrained(out)`` loads it strictly.
    """
    check_export_dtype(dtype)
    parse_size(max_shard_size)  # a bad size fails before anything is read
    opened = open_checkpoint(ckpt)
    hparams = opened.state.get("hyper_parameters")
    config_values = hparams.get("config") if isinstance(hparams, dict) else None
    if isinstance(config_values, str) and config_values.lower() in preset_names():
        config_values = dataclasses.asdict(resolve_config(config_values))  # a subclass's preset name (issue 61)
    if not isinstance(config_values, dict) or "n_experts" in config_values:
        raise CheckpointError(
            f"{opened.path}: {describe_recorded_model(hparams)}, not a LlamaLM's; this writes LlamaLM checkpoints"
            " as Hugging Face Llama directories (`lightning-zero export CKPT OUT --format hf` picks the exporter"
            " of a MoELM checkpoint itself; `--format plain` writes any model's weights as one state dict)"
        )
    config = resolve_config(config_values)
    base: Optional[dict[str, Any]] = None
    init_from = hparams.get("init_from")
    if init_from and Path(init_from, CONFIG_FILE).is_file():
        base = read_hf_config(init_from)  # keep the source's token ids and max_position_embeddings
    prefix = opened.meta.get("export_prefix", "")
    metadata = read_dcp_metadata(str(opened.path / ".metadata"))
    saved = opened.meta["params"]
    plan = tensor_plan(config, to_hf=True)
    missing = sorted(name for name in plan if prefix + name not in saved)
    alias = {"output.weight"} if config.tie_embeddings else set()  # the tied head is the embedding
    extra = sorted(
        name[len(prefix) :]
        for name in saved
        if name.startswith(prefix) and name[len(prefix) :] not in plan and name[len(prefix) :] not in alias
    )
    if missing or extra:
        raise CheckpointError(
            f"{opened.path}: parameters do not match a Llama {config}: missing {missing}, unexpected {extra}"
        )
    specs, sources = [], {}
    for name, source in plan.items():
        if list(saved[prefix + name]["shape"]) != list(source.shape):
            raise CheckpointError(
                f"{opened.path}: {name} has shape {saved[prefix + name]['shape']}, config gives {list(source.shape)}"
            )
        key = f"model.{prefix}{name}"
        saved_dtype = metadata.state_dict_metadata[key].properties.dtype
        specs.append(TensorSpec(source.key, tuple(source.shape), EXPORT_DTYPES[dtype] if dtype else saved_dtype))
        sources[source.key] = (key, source)

    def produce(spec: TensorSpec) -> torch.Tensor:
        key, source = sources[spec.name]
        tensor = assemble(opened.path, metadata, key).view(source.shape)
        return source.transform(tensor, None) if source.transform is not None else tensor

    return write_hf_export(out, specs, produce, max_shard_size=max_shard_size, checkpoint_format=opened.meta["format"],
                           config_dict=lambda out_dtype: hf_config_dict(config, out_dtype, base), dtype=dtype)  # fmt: skip
