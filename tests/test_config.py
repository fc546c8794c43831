"""Config composition: every group option and recipe composes; bad keys, types and recipes fail clearly."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from lightning_zero import hydra_config as lzconfig
from lightning_zero.cli import child_argv, local_process_count, threads_per_process
from lightning_zero.hydra_config import available_recipes, compose, validate

CONF_DIR = Path(lzconfig.__file__).parent / "conf"
GROUPS = ("model", "strategy", "data", "trainer", "optim")


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def test_default_config_is_tiny_zero2_on_two_cpu_processes():
    cfg = compose()
    assert cfg.model.name == "tiny"
    assert cfg.strategy._target_ == "lightning_zero.ZeroStrategy" and cfg.strategy.stage == 2
    assert cfg.data.source == "corpus"
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 2, "32-true")
    assert 0 < cfg.trainer.max_steps <= 500
    assert cfg.model.max_seq_len == cfg.data.seq_len  # interpolations are resolved


@pytest.mark.parametrize("group, option", [(group, option) for group in GROUPS for option in _options(group)])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("data", "memmap"):
        overrides.append("data.path=/tmp/tokens.bin")
    if (group, option) == ("model", "hf"):
        overrides.append("model.init_from=/tmp/llama-hf")
    cfg = compose(overrides)
    assert group in cfg
    assert not OmegaConf.missing_keys(cfg)


def test_every_group_has_the_options_the_docs_promise():
    assert {"tiny", "llama7b", "llama13b", "llama70b"} <= set(_options("model"))
    assert {"zero1", "zero2", "zero3", "ddp"} <= set(_options("strategy"))
    assert {"corpus", "memmap", "synthetic"} <= set(_options("data"))
    assert {"cpu", "gpu"} <= set(_options("trainer"))
    assert "adamw" in _options("optim")


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes(recipe):
    # fine-tuning recipes need the token file (and model.init_from, checked when the model is built)
    cfg = compose([f"recipe={recipe}"] + (["data.path=/tmp/tokens.bin"] if recipe.endswith("_finetune") else []))
    assert not OmegaConf.missing_keys(cfg)


def test_recipes_start_with_global_package_header():
    for recipe in available_recipes():
        text = (lzconfig.RECIPES_DIR / f"{recipe}.yaml").read_text()
        assert text.startswith("# @package _global_"), recipe


def test_command_line_beats_recipe_group_choice():
    cfg = compose(["recipe=tiny", "strategy=ddp", "model.n_layers=2"])
    assert cfg.strategy._target_.endswith("DDPStrategy")
    assert cfg.model.n_layers == 2


def test_unknown_recipe_fails_fast_listing_available_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'llama8b'.*available recipes: .*tiny"):
        compose(["recipe=llama8b"])
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        compose(["recipe=tiny,nope"])  # a multirun list is checked too


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+data.bacth_size=4"], r"data\.bacth_size.*Allowed keys in 'data'.*batch_size"),
        (["+trainer.max_stepz=4"], r"trainer\.max_stepz"),
        (["+strategy.bucket_size=4"], r"strategy\.bucket_size.*bucket_mb"),
        (["trainer.max_steps=abc"], r"trainer\.max_steps.*could not be converted to Integer"),
        (["strategy.bucket_mb=big"], r"strategy\.bucket_mb.*MiB > 0 or 'auto'"),
        (["model.activation_checkpointing=maybe"], r"model\.activation_checkpointing='maybe'.*'selective'"),
        (["optim.lr=fast"], r"optim\.lr"),
        (["strategy.tensor_parallel_size=0"], r"strategy\.tensor_parallel_size.*positive int or .auto."),
        (["+flavour=vanilla"], r"unknown top-level config key\(s\) \['flavour'\]"),
        (["strategy._target_=torch.nn.Linear"], r"strategy\._target_='torch\.nn\.Linear' has no schema"),
    ],
)
def test_wrong_key_or_type_names_it(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_wrong_key_in_a_yaml_file_names_it():
    cfg = OmegaConf.create({"data": {"_target_": "x", "seq_lenn": 4}})
    with pytest.raises(ValueError, match=r"data\.seq_lenn"):
        validate(cfg)


def _parameters(target) -> set[str]:
    return set(inspect.signature(target).parameters)


def test_schemas_match_the_signatures_they_feed():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero.data import TokenDataModule
    from lightning_zero.models import LlamaConfig, LlamaLM

    def keys(schema):
        return {f.name for f in dataclasses.fields(schema)} - {"_target_"}

    assert keys(lzconfig.DataConf) <= _parameters(TokenDataModule)
    assert keys(lzconfig.TrainerConf) <= _parameters(pl.Trainer)
    assert keys(lzconfig.OptimConf) <= _parameters(LlamaLM)
    from torch.nn.parallel import DistributedDataParallel

    # DDPStrategy hands its extra keyword arguments to torch's DistributedDataParallel.
    assert keys(lzconfig.DDPStrategyConf) <= _parameters(DDPStrategy) | _parameters(DistributedDataParallel)
    llama_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert keys(lzconfig.ModelConf) - {"activation_checkpointing", "init_from"} <= llama_fields
    assert {"activation_checkpointing", "init_from"} <= _parameters(LlamaLM)


def test_zero_strategy_schema_matches_its_signature():
    strategy = pytest.importorskip("lightning_zero.trainer.strategy", reason="ZeroStrategy not written yet")
    keys = {f.name for f in dataclasses.fields(lzconfig.ZeroStrategyConf)} - {"_target_"}
    assert keys <= _parameters(strategy.ZeroStrategy)


def test_child_argv_repeats_this_job_not_the_sweep():
    hydra_cfg = SimpleNamespace(
        overrides=SimpleNamespace(
            hydra=["hydra.mode=MULTIRUN", "hydra.sweep.dir=/s", "hydra.job.chdir=false", "hydra.run.dir=/r"],
            task=["strategy.bucket_mb=50", "trainer.max_steps=3"],
        )
    )
    full = ["/bin/lightning-zero", "train", "-m", "--config-dir", "/c", "strategy.bucket_mb=25,50"]
    assert child_argv(full, hydra_cfg) == [
        "/bin/lightning-zero",
        "train",
        "--config-dir",
        "/c",
        "hydra.job.chdir=false",
        "strategy.bucket_mb=50",
        "trainer.max_steps=3",
    ]


def test_threads_split_the_cpus_over_local_processes(monkeypatch):
    cfg = compose(["trainer.devices=2"])
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert local_process_count(cfg) == 2
    assert threads_per_process(cfg) == 4
    assert threads_per_process(compose(["trainer.devices=16"])) == 1
    assert threads_per_process(compose(["threads=3"])) == 3
    assert threads_per_process(compose(["trainer=gpu"])) is None


def test_every_knob_is_in_exactly_one_policy_and_the_policies_are_views():
    from lightning_zero.config import POLICIES, POLICY_KNOBS, ZERO_DEFAULTS, CommPolicy, LayoutPolicy, ZeroConfig

    held = [name for policy in POLICIES for name in POLICY_KNOBS[policy]]
    assert sorted(held) == sorted(ZERO_DEFAULTS.as_dict()) and len(held) == len(set(held))
    config = ZeroConfig(stage=3, cp=2, bucket_mb=4, grad_comm_dtype="int8", reduce_dtype="fp32", monitor=False)
    assert config.layout == LayoutPolicy(1, False, 2, 1, None, False, 1, "1f1b", 1, None, None)
    assert config.communication == CommPolicy(4.0, True, 2, True, "int8", None)
    assert (config.sharding.stage, config.precision_knobs.reduce_dtype, config.runtime.monitor) == (3, "fp32", False)
    assert config.checkpointing.upload_threads == ZERO_DEFAULTS.upload_threads
    assert config.precision_policy("bf16-true").masters == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sharding.stage = 1  # type: ignore[misc]
