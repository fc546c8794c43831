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
    from lightning_zero.planner.arithmetic import plan_run
    from lightning_zero.planner.report import PLAN_DEFAULTS

    parameters = inspect.signature(plan_run).parameters
    for name in ("bucket_mb", "prefetch_blocks", "defer_grad_reduce", "overlap_comm", "max_buckets_in_flight"):
        assert parameters[name].default is getattr(ZERO_DEFAULTS, name), name
    assert PLAN_DEFAULTS == dataclasses.asdict(PlanConf())
