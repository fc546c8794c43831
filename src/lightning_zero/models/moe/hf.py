"""The Hugging Face layouts of Mixtral (``MixtralForCausalLM``) and Qwen3-MoE
(``Qwen3MoeForCausalLM``): config.json, tensor names, import (a rank reads only the experts and
slices it keeps) and export (streamed, one tensor at a time).

Name map (``i`` = layer, ``e`` = expert; attention, norms, embeddings and head as Llama's,
``models/llama/hf.py``, q/k rows permuted to our interleaved rotary layout: [Note: rotary
permutation]; Qwen3's ``q_norm``/``k_norm`` gains are permuted the same way inside the head):

===========================================================  ========================================
Mixtral                                                      ``MoETransformer``
===========================================================  ========================================
model.layers.i.block_sparse_moe.gate.weight                  layers.i.moe.router.weight
model.layers.i.block_sparse_moe.experts.e.w1 / w3 / w2       layers.i.moe.experts.w1 / w3 / w2 [e]
===========================================================  ========================================

===========================================================  ========================================
Qwen3-MoE                                                    ``MoETransformer``
===========================================================  ========================================
model.layers.i.mlp.gate.weight                               layers.i.moe.router.weight
model.layers.i.mlp.experts.e.gate_proj / up_proj / down_proj layers.i.moe.experts.w1 / w3 / w2 [e]
model.layers.i.self_attn.q_norm / k_norm                     layers.i.attention.q_norm / k_norm
model.layers.i.mlp.gate_proj / up_proj / down_proj           layers.i.feed_forward.w1 / w3 / w2
                                                             (``mlp_only_layers`` = the first
                                                             ``n_dense_layers``)
===========================================================  ========================================

Stacked expert rows ([Note: stacked experts] in ``experts.py``) are read one expert at a time,
only the experts a rank holds under expert parallelism. DeepSeek-style shared experts and sigmoid
routing have no Hugging Face layout here (refused by name).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_zero.checkpoint.dcp import CheckpointError, read_dcp_metadata
from lightning_zero.checkpoint.export import assemble
from lightning_zero.checkpoint.hf import (
    Source,
    TensorSpec,
    check_plan,
    load_module_params,
    open_weight_files,
)
from lightning_zero.checkpoint.load import open_checkpoint
from lightning_zero.models.llama.hf import (
    EXPORT_DTYPES,
    _rope_rows,
    _rows,
    check_export_dtype,
    describe_recorded_model,
    hf_decoder_fields,
    hf_rope_fields,
    write_hf_export,
)
from lightning_zero.models.llama.hf_config import CONFIG_FILE, PathLike
from lightning_zero.models.moe.config import MoEConfig, moe_preset_names, resolve_moe_config
from lightning_zero.models.moe.experts import GroupedExperts

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# (ours -> theirs) per-expert projection names and the MoE module's name.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def read_config_json(path: PathLike) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}; expected a Hugging Face Mixtral or Qwen3-MoE directory")
    return json.loads(file.read_text())


def family_of(hf: dict[str, Any], where: str) -> str:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not a supported MoE layout; expected one of {sorted(ARCHITECTURES)}"
        )
    return model_type


def config_from_hf(path: PathLike, max_seq_len: Optional[int] = None) -> MoEConfig:
    """The :class:`MoEConfig` of a Hugging Face Mixtral or Qwen3-MoE directory."""
    hf = read_config_json(path)
    family = family_of(hf, str(path))
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    scaling = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    if hf.get("rope_scaling"):
        scaling = hf["rope_scaling"]
    dims = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    values: dict[str, Any] = dict(
        name=f"hf_{family}",
        vocab_size=hf["vocab_size"],
        dim=dims,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or dims // heads,
        max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 4096)),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        top_k=hf["num_experts_per_tok"],
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
        z_loss_coef=0.0,
    )
    if family == "mixtral":
        values.update(n_experts=hf["num_local_experts"], ffn_dim=hf["intermediate_size"],
                      expert_ffn_dim=hf["intermediate_size"], norm_topk_prob=True)  # fmt: skip
    else:
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{path}: decoder_sparse_step {hf['decoder_sparse_step']} != 1 is not supported")
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise ValueError(f"{path}: mlp_only_layers {dense} must be the first layers (0, 1, ...)")
        n_experts = hf.get("num_experts") or hf.get("num_local_experts")
        values.update(n_experts=n_experts, ffn_dim=hf["intermediate_size"], expert_ffn_dim=hf["moe_intermediate_size"],
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True,
                      n_dense_layers=len(dense))  # fmt: skip
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{path}: {key}=true is not supported (our projections have no bias)")
    return MoEConfig(**values)


def family_for(config: MoEConfig) -> str:
    """The Hugging Face layout a config exports to: Qwen3-MoE with q/k norms, else Mixtral."""
    if config.router != "softmax" or config.n_shared_experts:
        raise ValueError(
            f"MoE config {config.name!r}: sigmoid routing and shared experts (DeepSeek-style) have no Hugging Face "
            "export here; only Mixtral and Qwen3-MoE layouts are written"
        )
    if config.qk_norm:
        return "qwen3_moe"
    if not config.norm_topk_prob or config.n_dense_layers:
        raise ValueError(f"MoE config {config.name!r}: Mixtral renormalizes top-k and has no dense layers")
    return "mixtral"


def hf_config_dict(config: MoEConfig, dtype: torch.dtype) -> dict[str, Any]:
    family = family_for(config)
    values: dict[str, Any] = dict(architectures=[ARCHITECTURES[family]], model_type=family,
                                  **hf_decoder_fields(config, dtype))  # fmt: skip
    values.update(num_experts_per_tok=config.top_k, router_aux_loss_coef=config.aux_loss_coef)
    if family == "mixtral":
        values.update(num_local_experts=config.n_experts, intermediate_size=config.expert_ffn_dim)
    else:
        values.update(num_experts=config.n_experts, intermediate_size=config.ffn_dim,
                      moe_intermediate_size=config.expert_ffn_dim, norm_topk_prob=config.norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=list(range(config.n_dense_layers)))  # fmt: skip
    values.update(hf_rope_fields(config))  # type: ignore[arg-type]
    return values


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def tensor_plan(config: MoEConfig, family: str, *, to_hf: bool = False) -> dict[str, Source]:
    """``{our name: Source}`` for every non-expert tensor, and ``{our name + ".<e>": Source}`` for
    each expert's row of a stacked tensor (``layers.i.moe.experts.w1.7``)."""
    moe_name, projections = _EXPERT_NAMES[family]
    dim, head_dim = config.dim, config.head_dim
    q_dim, kv_dim = config.n_heads * head_dim, config.n_kv_heads * head_dim  # type: ignore[operator]
    rope = functools.partial(_rope_rows, head_dim=head_dim, to_hf=to_hf)
    gain = functools.partial(_rows, head_dim=head_dim, to_hf=to_hf)
    plan = {"tok_embeddings.weight": Source("model.embed_tokens.weight", (config.vocab_size, dim))}
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        plan |= {
            ours + "attention_norm.weight": Source(theirs + "input_layernorm.weight", (dim,)),
            ours + "attention.wq.weight": Source(theirs + "self_attn.q_proj.weight", (q_dim, dim), rope),
            ours + "attention.wk.weight": Source(theirs + "self_attn.k_proj.weight", (kv_dim, dim), rope),
            ours + "attention.wv.weight": Source(theirs + "self_attn.v_proj.weight", (kv_dim, dim)),
            ours + "attention.wo.weight": Source(theirs + "self_attn.o_proj.weight", (dim, q_dim)),
            ours + "ffn_norm.weight": Source(theirs + "post_attention_layernorm.weight", (dim,)),
        }
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                plan[ours + f"attention.{norm}.weight"] = Source(theirs + f"self_attn.{norm}.weight", (head_dim,), gain)
        if i < config.n_dense_layers:
            for our, their in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                shape = (dim, config.ffn_dim) if our == "w2" else (config.ffn_dim, dim)
                plan[ours + f"feed_forward.{our}.weight"] = Source(theirs + f"mlp.{their}.weight", shape)
            continue
        plan[ours + "moe.router.weight"] = Source(theirs + f"{moe_name}.gate.weight", (config.n_experts, dim))
        for our, their in projections.items():
            shape = (dim, config.expert_ffn_dim) if our == "w2" else (config.expert_ffn_dim, dim)
            for e in range(config.n_experts):
                plan[ours + f"moe.experts.{our}.{e}"] = Source(theirs + f"{moe_name}.experts.{e}.{their}.weight", shape)
    plan["norm.weight"] = Source("model.norm.weight", (dim,))
    if not config.tie_embeddings:
        plan["output.weight"] = Source("lm_head.weight", (config.vocab_size, dim))
    return plan


class HFMoEWeights:
    """The weights of a Hugging Face Mixtral / Qwen3-MoE directory, checked against ``config``
    (names, shapes, nothing missing or left over) when opened; ``load(module, prefix)`` fills one
    unit, reading only the experts this rank holds."""

    def __init__(self, path: PathLike, config: MoEConfig) -> None:
        self.path = Path(path)
        self.family = family_of(read_config_json(path), str(path))
        self.files = open_weight_files(path)
        self.plan = tensor_plan(config, self.family)
        check_plan(self.files, self.plan, ignore=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"])
        self.bytes_read = 0

    @torch.no_grad()
    def load(self, module: nn.Module, prefix: str) -> None:
        for name, sub in module.named_modules(prefix=prefix.rstrip(".")):
            if not any(True for _ in sub.parameters(recurse=False)):
                continue
            if isinstance(sub, GroupedExperts):
                self._load_experts(sub, name)
                continue
            if any(True for _ in sub.children()):
                raise CheckpointError(f"{self.path}: module {name} holds parameters and submodules")
            self.bytes_read += load_module_params(sub, name, self.files, self.plan)

    def _load_experts(self, experts: GroupedExperts, name: str) -> None:
        for projection in ("w1", "w3", "w2"):
            stacked = getattr(experts, projection)
            for row in range(stacked.shape[0]):
                source = self.plan[f"{name}.{projection}.{experts.expert_offset + row}"]
                self.bytes_read += self.files.read_into(source.key, stacked.data[row])  # byte ranges, in place


def pretrained_config(requested: Any, path: PathLike) -> MoEConfig:
    """config.json's shape; ``requested`` may only agree with it (or be ``None``/``"hf"``)."""
    loaded = config_from_hf(path)
    if requested is None or requested == "hf":
        return loaded
    wanted = dataclasses.asdict(resolve_moe_config(requested))
    have = dataclasses.asdict(loaded)
    skip = ("name", "max_seq_len", "aux_loss_coef", "z_loss_coef", "capacity_factor")
    disagree = [
        f"{k} {wanted[k]!r} (config.json: {have[k]!r})" for k in wanted if k not in skip and wanted[k] != have[k]
    ]
    if disagree:
        raise ValueError(f"MoE model disagrees with {Path(path) / CONFIG_FILE}: {', '.join(disagree)}")
    return dataclasses.replace(loaded, max_seq_len=wanted["max_seq_len"], aux_loss_coef=wanted["aux_loss_coef"],
                               z_loss_coef=wanted["z_loss_coef"], capacity_factor=wanted["capacity_factor"])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _recorded_moe_config(hparams: Any) -> Optional[dict[str, Any]]:
    """The ``MoEConfig`` fields a checkpoint's ``hyper_parameters`` record: the resolved config, or a
    MoE preset's name (what a subclass forwarding ``**kw`` recorded before [Note: the recorded
    config] in ``models/llama/lightning.py``); ``None`` for any other model."""
    config = hparams.get("config") if isinstance(hparams, dict) else None
    if isinstance(config, str) and config.lower() in moe_preset_names():
        return dataclasses.asdict(resolve_moe_config(config))
    return config if isinstance(config, dict) and "n_experts" in config else None


def hf_export(config: MoEConfig, prefix: str = "") -> Any:
    """What the no-gather export writes for a ``MoETransformer`` of ``config`` whose parameters are
    named ``prefix + name`` (``checkpoint.hf_write``): each stacked expert tensor feeds one Hugging
    Face tensor per expert (its rows, in expert order), whichever ep rank holds them."""
    from lightning_zero.checkpoint.hf_write import HFExport

    sources: dict[str, Any] = {}
    for name, source in tensor_plan(config, family_for(config), to_hf=True).items():
        if ".moe.experts." in name:
            sources.setdefault(prefix + name.rsplit(".", 1)[0], []).append(source)  # experts 0, 1, ...
        else:
            sources[prefix + name] = source
    sources = {name: tuple(entry) if isinstance(entry, list) else entry for name, entry in sources.items()}
    aliases = frozenset({prefix + "output.weight"}) if config.tie_embeddings else frozenset()
    return HFExport(sources, lambda dtype: hf_config_dict(config, dtype), aliases)


def is_moe_checkpoint(ckpt: Union[str, os.PathLike]) -> bool:
    """Whether ``ckpt`` was saved by an ``MoELM`` (its recorded config has experts)."""
    return _recorded_moe_config(open_checkpoint(ckpt).state.get("hyper_parameters")) is not None


def export_hf(
    ckpt: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    *,
    dtype: Optional[str] = None,
    max_shard_size: Union[str, int] = "50GB",
) -> Path:
    """Write the ``MoELM`` checkpoint ``ckpt`` (saved at any ``ep``) as a Hugging Face Mixtral or
    Qwen3-MoE directory, streaming: each stacked expert tensor is assembled from its saved
    rectangles once and cut into per-expert tensors, so peak memory is one stacked tensor."""
    check_export_dtype(dtype)
    opened = open_checkpoint(ckpt)
    hparams = opened.state.get("hyper_parameters")
    config_values = _recorded_moe_config(hparams)
    if config_values is None:
        raise CheckpointError(
            f"{opened.path}: {describe_recorded_model(hparams)}, not a MoELM's; this writes MoELM checkpoints as"
            " Hugging Face Mixtral or Qwen3-MoE directories (`lightning-zero export CKPT OUT --format hf` picks the"
            " Llama exporter for a LlamaLM checkpoint itself)"
        )
    config = resolve_moe_config(config_values)
    family = family_for(config)
    prefix = opened.meta.get("export_prefix", "")
    metadata = read_dcp_metadata(str(opened.path / ".metadata"))
    saved = opened.meta["params"]
    plan = tensor_plan(config, family, to_hf=True)
    stacked_of = {name: name.rsplit(".", 1) for name in plan if ".moe.experts." in name}
    wanted = {stacked_of[name][0] if name in stacked_of else name for name in plan}
    alias = {"output.weight"} if config.tie_embeddings else set()
    ours = {name[len(prefix) :] for name in saved if name.startswith(prefix)} - alias
    if wanted != ours:
        raise CheckpointError(
            f"{opened.path}: parameters do not match {config.name!r}: missing {sorted(wanted - ours)}, "
            f"unexpected {sorted(ours - wanted)}"
        )
    specs, sources = [], {}
    for name, source in plan.items():
        tensor_name, row = stacked_of.get(name, (name, None))
        key = f"model.{prefix}{tensor_name}"
        saved_dtype = metadata.state_dict_metadata[key].properties.dtype
        specs.append(TensorSpec(source.key, tuple(source.shape), EXPORT_DTYPES[dtype] if dtype else saved_dtype))
        sources[source.key] = (key, row, source)
    cache: dict[str, torch.Tensor] = {}

    def produce(spec: TensorSpec) -> torch.Tensor:
        key, row, source = sources[spec.name]
        if row is None:
            tensor = assemble(opened.path, metadata, key)
        else:
            if key not in cache:
                cache.clear()  # one stacked tensor at a time: the plan lists each one's experts together
                cache[key] = assemble(opened.path, metadata, key)
            tensor = cache[key][int(row)]
        tensor = tensor.reshape(source.shape)
        return source.transform(tensor, None) if source.transform is not None else tensor

    return write_hf_export(out, specs, produce, max_shard_size=max_shard_size, checkpoint_format=opened.meta["format"],
                           config_dict=lambda out_dtype: hf_config_dict(config, out_dtype), dtype=dtype)  # fmt: skip
