"""The Hydra side of the configuration: structured-config schemas, recipe discovery, composition.

The YAML files under ``conf/`` and ``recipes/`` are plain Hydra configs; after Hydra composes them,
:func:`validate` merges each group into its dataclass schema below, so a misspelled key or a value
of the wrong type fails with the key's full name (``trainer.max_stepz``) and the allowed keys.

The engine's knobs are not defined here: :class:`ZeroStrategyConf` is generated from
:class:`lightning_zero.config.ZeroConfig` (plain Python, no omegaconf), and a ``strategy`` node is
validated by constructing one, so the engine, the strategy and the planner never load Hydra.

Recipes live in ``lightning_zero/recipes/*.yaml`` (a ``# @package _global_`` file whose defaults
``override`` groups, the usual Hydra "experiment" pattern). :func:`register_recipes` stores them in
Hydra's ``ConfigStore`` under the group ``recipe`` so ``recipe=NAME`` selects one.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig

CONF_MODULE = "lightning_zero.conf"
RECIPES_DIR = Path(__file__).parent / "recipes"


# --------------------------------------------------------------------------------------------
# Schemas, one per config group
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConf:
    """``model/``: a Llama-family preset (Llama 2/3.x, Mistral, Qwen2.5, Qwen3) plus optional field
    overrides (``None`` keeps the preset's).

    ``init_from``: a Hugging Face Llama, Mistral, Qwen2 or Qwen3 directory to start from
    (``model=hf``: its config.json gives the shape; a preset must agree with it).
    """

    name: str = "tiny"
    vocab_size: Optional[int] = None
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    max_seq_len: Optional[int] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict[str, Any]] = None
    tie_embeddings: Optional[bool] = None
    head_dim: Optional[int] = None
    qk_norm: Optional[bool] = None
    qkv_bias: Optional[bool] = None
    sliding_window: Optional[int] = None
    family: Optional[str] = None
    activation_checkpointing: Any = False  # false | "selective" | "full" (true: "full")
    init_from: Optional[str] = None

    def llama_fields(self) -> dict[str, Any]:
        """The mapping ``LlamaLM(config=...)`` takes: the preset name and the fields set here."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.pop("activation_checkpointing")
        values.pop("init_from")
        return {key: value for key, value in values.items() if value is not None}


def _schema_type(annotation: Any) -> Any:
    """The OmegaConf field type for a ``ZeroConfig`` annotation (unions become ``Any``)."""
    return annotation if annotation in (int, float, bool, str) else Any


def _zero_strategy_schema() -> type:
    hints = typing.get_type_hints(ZeroConfig)
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default="lightning_zero.ZeroStrategy"))]
    for knob in dataclasses.fields(ZeroConfig):
        fields.append((knob.name, _schema_type(hints[knob.name]), field(default=getattr(ZERO_DEFAULTS, knob.name))))
    schema = dataclasses.make_dataclass("ZeroStrategyConf", fields)
    schema.__module__ = __name__
    schema.__doc__ = (
        "``strategy/zero{1,2,3}``: the Hydra schema of :class:`lightning_zero.ZeroStrategy`, generated"
        " from :class:`ZeroConfig` (same fields, same defaults) plus ``_target_``."
    )
    return schema


ZeroStrategyConf = _zero_strategy_schema()


@dataclass
class DDPStrategyConf:
    """``strategy/ddp``: Lightning's own ``DDPStrategy``, kept for comparisons."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    process_group_backend: Optional[str] = None


STRATEGY_SCHEMAS: dict[str, type] = {
    ZeroStrategyConf._target_: ZeroStrategyConf,
    DDPStrategyConf._target_: DDPStrategyConf,
}


@dataclass
class DataConf:
    """``data/``: arguments of :class:`lightning_zero.data.TokenDataModule`."""

    _target_: str = "lightning_zero.data.TokenDataModule"
    source: str = "corpus"
    path: Optional[str] = None
    seq_len: int = 256
    batch_size: int = 8
    vocab_size: Optional[int] = None  # None: the model's vocab_size
    seed: int = 1234
    val_fraction: float = 0.05
    num_workers: int = 0


@dataclass
class TrainerConf:
    """``trainer/``: the ``lightning.pytorch.Trainer`` arguments the CLI exposes."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 2  # int, "auto" or a list of device indices
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 300
    max_epochs: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    val_check_interval: Optional[Any] = None  # int (steps) or float (fraction of an epoch)
    limit_val_batches: Optional[Any] = None  # int (batches) or float (fraction)
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    deterministic: bool = False


@dataclass
class OptimConf:
    """``optim/``: AdamW with linear warmup and cosine decay (``LlamaLM`` arguments)."""

    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1


@dataclass
class CheckpointConf:
    """``checkpoint:``: when and where ``ModelCheckpoint`` saves (``<run dir>/checkpoints``, or ``dir``)."""

    every_n_train_steps: Optional[int] = None  # None: at the end of each epoch / of training
    save_last: bool = True
    save_top_k: int = 1
    dir: Optional[str] = None  # None: <run dir>/checkpoints; a path or an fsspec URL (s3://bucket/run)


@dataclass
class HardwareConf:
    """``hardware/``: one accelerator in its node, for the planner (``planner.hardware.Hardware``).

    Bandwidths per device, one direction, GB/s; latencies per ring step, microseconds.
    """

    name: str = MISSING
    memory_bytes: int = MISSING
    intra_node_gb_per_s: float = MISSING
    inter_node_gb_per_s: float = MISSING
    peak_bf16_tflops: float = MISSING
    peak_fp32_tflops: Optional[float] = None  # None: bf16 peak / 16
    devices_per_node: int = 8
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    memory_gb_per_s: Optional[float] = None  # None: memory-bound work is free
    optimizer_gb_per_s: Optional[float] = None  # None: memory_gb_per_s
    overlap_efficiency: float = 1.0
    mfu: Optional[float] = None  # None: plan.mfu decides
    collective_time_factor: Dict[str, float] = field(default_factory=dict)
    step_overhead_ms: float = 0.0  # per optimizer step the step-time model does not count (calibrated)


@dataclass
class PlanConf:
    """``plan/``: options of ``lightning-zero plan`` (conf/plan/default.yaml says what each does)."""

    format: str = "table"
    plot: Optional[str] = None
    mfu: Optional[float] = None
    stages: str = "all"
    reserved_gib: float = 2.0
    attention: str = "fused"
    optimizer: str = "adamw"
    search: bool = False
    top: int = 10
    overlap_param_gather: Optional[bool] = None  # None: as the strategy's overlap_param_gather does
    topology: bool = True  # on more than one node: also plan hybrid / hierarchical / int8 side by side
    lossless: bool = False  # search: leave out layouts with lossy (compressed) communication


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConf,
    "data": DataConf,
    "trainer": TrainerConf,
    "optim": OptimConf,
    "checkpoint": CheckpointConf,
    "hardware": HardwareConf,
    "plan": PlanConf,
}

# Top-level keys besides the groups.
TOP_LEVEL_KEYS = {"seed", "ckpt_path", "strict_loading", "threads", "strategy", *GROUP_SCHEMAS}


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _schema_keys(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _config_error(error: OmegaConfBaseException, where: str, schema: Optional[type]) -> ValueError:
    key = getattr(error, "full_key", None) or getattr(error, "key", None) or where
    if where and not str(key).startswith(where):
        key = f"{where}.{key}"
    message = f"invalid config at '{key}': {str(error).splitlines()[0]}"
    if schema is not None:
        message += f". Allowed keys in '{where}' ({schema.__name__}): {', '.join(_schema_keys(schema))}"
    return ValueError(message)


def _merge_into(schema: type, node: Any, where: str) -> DictConfig:
    """Merge ``node`` into ``schema``; raise ``ValueError`` naming the key and the allowed ones."""
    if not isinstance(node, DictConfig):
        raise ValueError(f"config '{where}' must be a mapping, got {node!r}")
    unknown = sorted(set(node.keys()) - set(_schema_keys(schema)))
    if unknown:
        # A node typed by a schema (schema/strategy/zero) still takes keys added with ``+key=``.
        raise ValueError(
            f"invalid config at '{where}.{unknown[0]}': no such key. Allowed keys in '{where}'"
            f" ({schema.__name__}): {', '.join(_schema_keys(schema))}"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        # A required value (``???``, e.g. a recipe's model.init_from) stays required: merging it
        # onto the schema's default would silently keep the default (None: random init).
        for key in node:
            if OmegaConf.is_missing(node, key):
                merged[key] = "???"
        return merged
    except OmegaConfBaseException as error:
        raise _config_error(error, where, schema) from None


def validate(cfg: DictConfig) -> DictConfig:
    """Check a composed config against the schemas; return it resolved, with schema defaults filled.

    Raises ``ValueError`` for an unknown key, a value of the wrong type, or an unknown strategy.
    """
    unknown = sorted(set(cfg.keys()) - TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"unknown top-level config key(s) {unknown}; allowed: {', '.join(sorted(TOP_LEVEL_KEYS))}")
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    schemas: dict[str, type] = {}
    for group, schema in GROUP_SCHEMAS.items():
        if group in cfg:
            cfg[group] = _merge_into(schema, cfg[group], group)
            schemas[group] = schema
    strategy = cfg.get("strategy")
    if isinstance(strategy, DictConfig):
        target = strategy.get("_target_")
        if target not in STRATEGY_SCHEMAS:
            raise ValueError(
                f"strategy._target_={target!r} has no schema; use one of the strategy group's options "
                f"(zero1, zero2, zero3, ddp) or one of {sorted(STRATEGY_SCHEMAS)}"
            )
        schemas["strategy"] = STRATEGY_SCHEMAS[target]
        cfg["strategy"] = _merge_into(schemas["strategy"], strategy, "strategy")
    elif strategy is not None:
        raise ValueError(f"strategy must be a mapping with a _target_, got {strategy!r}")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as error:
        group = str(getattr(error, "full_key", "") or "").split(".")[0]
        raise _config_error(error, "", schemas.get(group)) from None
    if schemas.get("strategy") is ZeroStrategyConf:
        _check_zero_knobs(cfg.strategy)
        if "trainer" in cfg:
            _check_zero_precision(str(cfg.trainer.precision))
    if "model" in cfg:
        from lightning_zero.models.checkpointing import checkpointing_mode

        checkpointing_mode(cfg.model.activation_checkpointing, "model.activation_checkpointing")
    OmegaConf.set_struct(cfg, True)
    return cfg


def _check_zero_knobs(strategy: DictConfig) -> None:
    """Validate a ``ZeroStrategy`` config node through :class:`ZeroConfig` (the one validator)."""
    knobs = {f.name: strategy[f.name] for f in dataclasses.fields(ZeroConfig) if f.name in strategy}
    try:
        ZeroConfig(**knobs)
    except ValueError as error:
        message = str(error)
        if message.startswith("ZeroStrategy(") and "=" in message:
            name = message[len("ZeroStrategy(") : message.index("=")]
            message = f"invalid config at 'strategy.{name}': {message}"
        raise ValueError(message) from None


def _check_zero_precision(precision: str) -> None:
    """``trainer.precision`` is one ZeroStrategy accepts (``precision.py``, docs/precision.md)."""
    from lightning_zero.precision import check_precision

    try:
        check_precision(precision)
    except ValueError as error:
        raise ValueError(f"invalid config at 'trainer.precision': {error}") from None


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``lightning_zero/recipes`` (file stems)."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def register_recipes() -> None:
    """Store every recipe in Hydra's ConfigStore as option ``recipe=NAME`` (package ``_global_``),
    and :class:`ZeroStrategyConf` as ``schema/strategy/zero``, the base of the ``zero{1,2,3}`` YAMLs
    (outside the ``strategy`` group, so it is no ``strategy=`` option)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema/strategy", name="zero", node=ZeroStrategyConf, provider="lightning_zero")
    for name in available_recipes():
        node = OmegaConf.load(RECIPES_DIR / f"{name}.yaml")
        store.store(group="recipe", name=name, node=node, package="_global_", provider="lightning_zero")


def check_recipe_overrides(overrides: Sequence[str]) -> None:
    """Fail fast, before Hydra composes anything, when ``recipe=NAME`` names no shipped recipe.

    Understands ``recipe=a``, ``+recipe=a``, ``++recipe=a`` and multirun lists ``recipe=a,b``.
    """
    known = available_recipes()
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or key.lstrip("+~") != "recipe":
            continue
        for name in (part.strip().strip("'\"") for part in value.split(",")):
            if name in ("", "null") or name in known:
                continue
            raise ValueError(
                f"unknown recipe {name!r} in {override!r}; available recipes: {', '.join(known)} "
                f"(files in {RECIPES_DIR})"
            )


# --------------------------------------------------------------------------------------------
# Composition without the command line (tests, notebooks, the planner)
# --------------------------------------------------------------------------------------------


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` (as on the command line) and validate it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    overrides = list(overrides)
    check_recipe_overrides(overrides)
    register_recipes()
    from hydra.errors import ConfigCompositionException

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=overrides)
        except ConfigCompositionException as error:
            # A typed group (schema/strategy/zero) rejects a bad value while composing already.
            cause = str(error.__cause__).splitlines()[0] if error.__cause__ is not None else ""
            raise ValueError(f"{error}: {cause}" if cause else str(error)) from None
    return validate(cfg)
