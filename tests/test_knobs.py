"""Every ZeroStrategy knob has one default and one validator: lightning_zero.config.ZeroConfig."""

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZERO_DEFAULTS, ZeroConfig
from lightning_zero.hydra_config import ZeroStrategyConf, compose

KNOBS = [knob.name for knob in dataclasses.fields(ZeroConfig)]


def test_strategy_signature_defaults_are_the_config_defaults():
    parameters = inspect.signature(ZeroStrategy.__init__).parameters
    for name in KNOBS:
        assert parameters[name].default is getattr(ZERO_DEFAULTS, name), name


def test_hydra_schema_is_generated_from_the_config():
    schema = OmegaConf.structured(ZeroStrategyConf)
    assert [key for key in schema if key != "_target_"] == KNOBS
    for name in KNOBS:
        assert schema[name] == getattr(ZERO_DEFAULTS, name), name
    composed = compose(["strategy=zero3"]).strategy
    assert {name: composed[name] for name in KNOBS} == {**ZERO_DEFAULTS.as_dict(), "stage": 3}


def test_stage_yamls_differ_only_in_stage():
    conf = Path(__file__).resolve().parents[1] / "src" / "lightning_zero" / "conf" / "strategy"
    for stage in (1, 2, 3):
        node = yaml.safe_load((conf / f"zero{stage}.yaml").read_text())
        assert node == {"defaults": ["/schema/strategy/zero@_here_", "_self_"], "stage": stage}


def test_strategy_keeps_the_validated_config():
    strategy = ZeroStrategy(stage=3, bucket_mb=4)
    assert strategy.zero_config == dataclasses.replace(ZERO_DEFAULTS, stage=3, bucket_mb=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.zero_config.stage = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, match",
    [
        ("strategy.tensor_parallel_size=true", r"strategy\.tensor_parallel_size.*positive int or 'auto'"),
        ("strategy.stage=4", r"strategy\.stage.*1, 2 or 3"),
        ("strategy.max_buckets_in_flight=0", r"strategy\.max_buckets_in_flight.*>= 1"),
        ("+strategy.bucket_size=4", r"strategy\.bucket_size.*no such key.*bucket_mb"),
    ],
)
def test_config_errors_come_from_the_same_validator(override, match):
    with pytest.raises(ValueError, match=match):
        compose([override])


def test_planner_reads_the_same_defaults():
    from lightning_zero.hydra_config import PlanConf
    from lightning_zero.planner.arithmetic import PLANNED_KNOBS, plan_run
    from lightning_zero.planner.report import PLAN_DEFAULTS
    from lightning_zero.planner.search import FIXED_KNOBS, search_layouts

    # plan_run's knobs go into a ZeroConfig (arithmetic.plan_inputs): their defaults are its own
    assert list(inspect.signature(plan_run).parameters) == [
        "model_config", "zero_config", "world_size", "devices_per_node", "knobs"
    ]  # fmt: skip
    planned = plan_run("tiny", stage=2, world_size=2, devices_per_node=2, simulate=False)
    for argument, knob in PLANNED_KNOBS.items():
        if argument not in (
            "stage",
            "tp",
            "bucket_mb",
            "shard_size",
            "master_weights",
            "pp_layers",
            "pp_microbatches",
        ):  # given, resolved or not kept
            assert getattr(planned, argument) == getattr(ZERO_DEFAULTS, knob), argument
    assert set(PLANNED_KNOBS.values()) | {
        "offload_optimizer",
        "exact_grad_norm",  # bytes once per clip, for parameters cut between chunks: not planned
        "monitor",
        "collective_timeout",
        "async_checkpoint",
        "storage_options",
        "upload_threads",
        "upload_stall_s",
    } == set(KNOBS)
    search = inspect.signature(search_layouts).parameters
    for name in FIXED_KNOBS:
        assert search[name].default is getattr(ZERO_DEFAULTS, name), name
    assert PLAN_DEFAULTS == dataclasses.asdict(PlanConf())


def test_planner_takes_a_zero_config():
    from lightning_zero.planner.arithmetic import plan_run
    from lightning_zero.planner.search import search_layouts

    run = dict(world_size=16, devices_per_node=8, precision="bf16-mixed", micro_batch=1, seq_len=128, simulate=False)
    knobs = dict(bucket_mb=4.0, prefetch_blocks=2, max_buckets_in_flight=3, grad_comm_dtype="bf16", reduce_dtype="fp32")
    config = ZeroConfig(stage=3, tensor_parallel_size=2, **knobs)
    by_config = plan_run("tiny", config, **run)
    by_keywords = plan_run("tiny", stage=3, tp=2, **knobs, **run)
    assert by_config == by_keywords
    # stage 1 always defers: its defer_grad_reduce changes no prediction (plan_run refuses it)
    stage1 = ZeroConfig(stage=1, defer_grad_reduce=True)
    assert plan_run("tiny", stage1, **run) == plan_run("tiny", stage=1, **run)
    with pytest.raises(TypeError, match="prefetch_blocks"):
        plan_run("tiny", config, prefetch_blocks=3, **run)
    with pytest.raises(TypeError, match="stage="):
        plan_run("tiny", **run)
    common = dict(world_size=8, devices_per_node=8, global_batch=8, seq_len=128, stages=(2,), tp_sizes=(1,),
                  micro_batches=(1,), bucket_mbs=(25.0,), checkpointing=("full",), sequence_parallel=(False,))  # fmt: skip
    fixed = ZeroConfig(stage=1, bucket_mb=1.0, max_buckets_in_flight=1, overlap_param_gather=False)
    searched = search_layouts("tiny", fixed, **common)
    assert searched.ranked and all(r.plan.stage == 2 and r.plan.bucket_mb == 25.0 for r in searched.ranked)
    keywords = search_layouts("tiny", max_buckets_in_flight=1, overlap_param_gather=False, **common)
    assert [r.plan for r in searched.ranked] == [r.plan for r in keywords.ranked]
    with pytest.raises(TypeError, match="max_buckets_in_flight"):
        search_layouts("tiny", fixed, max_buckets_in_flight=4, **common)


# -- each knob documented once: ZeroConfig's Attributes; the rest is generated or checked -----------


def _args_entries(docstring: str) -> set[str]:
    """Names documented as ``name: ...`` entries of a Google-style ``Args:`` section."""
    lines = inspect.cleandoc(docstring).splitlines()
    if "Args:" not in lines:
        return set()
    names = set()
    for line in lines[lines.index("Args:") + 1 :]:
        if line.strip() and not line.startswith(" "):
            break
        if line.startswith("    ") and not line.startswith("     ") and ":" in line:
            names.update(name.strip() for name in line.strip().partition(":")[0].split(","))
    return names


def test_every_knob_is_documented_once_in_the_config():
    from lightning_zero.config import knob_docs

    docs = knob_docs()
    assert list(docs) == KNOBS
    assert all(len(text) > 20 for text in docs.values()), docs


def test_no_knob_documented_again_below_or_beside_the_config():
    import ast

    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.hybrid import HybridGradReduce
    from lightning_zero.zero.reducer import GradReducer
    from lightning_zero.zero.stage3.runtime import Stage3Runtime

    for documented in (ZeroEngine, GradReducer, HybridGradReduce, Stage3Runtime):
        assert _args_entries(documented.__doc__) & set(KNOBS) == set(), documented
    # ZeroStrategy's own docstring (as written; the Knobs section is appended at import)
    source = Path(inspect.getsourcefile(ZeroStrategy)).read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "ZeroStrategy")
    assert _args_entries(ast.get_docstring(node)) & set(KNOBS) == set()


def test_strategy_docstring_carries_the_config_docs():
    from lightning_zero.config import knob_docs

    doc = ZeroStrategy.__doc__
    for name, text in knob_docs().items():
        assert f"        {name}: {text}\n" in doc, name


def test_cli_md_knob_table_is_generated_from_the_config():
    from lightning_zero.config import knob_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    begin = text.index("<!-- generated from lightning_zero.config.ZeroConfig")
    start = text.index("\n", begin) + 1
    end = text.index("<!-- end of generated table -->")
    assert text[start:end].strip() == knob_table(), "regenerate it: python -m lightning_zero.config"


def test_engine_takes_the_config_whole():
    from lightning_zero.zero.engine import ZeroEngine

    parameters = inspect.signature(ZeroEngine.__init__).parameters
    assert list(parameters)[1:4] == ["module", "optimizers", "config"]
    assert set(parameters) & set(KNOBS) == set(), "knobs reach the engine in the config only"
    with pytest.raises(TypeError, match="ZeroConfig"):
        ZeroEngine(None, [], {"stage": 2})


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(pp=0), r"ZeroStrategy\(pp=0\).*int >= 1"),
        (dict(pp_schedule="dualpipe"), r"pp_schedule='dualpipe'.*pick one of"),
        (dict(pp_virtual_stages=0), r"pp_virtual_stages=0.*>= 1"),
        (dict(pp_layers=[2, 0]), r"pp_layers=\[2, 0\].*positive block counts"),
        (dict(pp_microbatches=0), r"pp_microbatches=0.*int >= 1"),
    ],
)
def test_pipeline_knobs_are_checked_by_the_config(knobs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**knobs)


def test_the_pipeline_split_travels_as_a_list_and_the_trainer_door_takes_pp():
    assert ZeroConfig(pp=2, pp_layers=(3, 5)).pp_layers == [3, 5]  # the split travels as a list (Hydra)
    strategy = ZeroStrategy(pp=2, pp_schedule="zbv")  # checked against the model before launch (test_pipeline.py)
    assert (strategy.pp, strategy.pp_schedule) == (2, "zbv")
