"""The precision policy in one place (``precision.py``), without any process group.

Every policy evaluates every one of its properties; the knobs that shape it are validated by one
function, whose message every entry point (``ZeroConfig``, the Hydra schema, the ledger, the
policy itself) reports; no other module compares a precision knob with its values; both doors map
Lightning's and Fabric's plugins onto the same policy; and the ledger's bytes follow the policy.
"""

import inspect
import re
from pathlib import Path

import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.precision import (
    MASTER_WEIGHTS,
    MIXED_PARAMS,
    PRECISIONS,
    PrecisionPolicy,
    check_precision_knobs,
    engine_policy,
    precision_policy,
)

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightning_zero"
EVERY_POLICY = [
    (precision, master_weights, mixed_params)
    for precision in PRECISIONS
    for master_weights in MASTER_WEIGHTS
    for mixed_params in MIXED_PARAMS
]


@pytest.mark.parametrize("precision, master_weights, mixed_params", EVERY_POLICY)
def test_every_property_of_every_policy_evaluates(precision, master_weights, mixed_params):
    # a property that names what its module never imports (PrecisionPolicy.true_half did: NameError
    # on torch) fails here, whichever property it is
    policy = precision_policy(precision, master_weights, mixed_params)
    properties = [name for name, value in inspect.getmembers(PrecisionPolicy) if isinstance(value, property)]
    assert {"compute_dtype", "master_dtype", "separate_masters"} <= set(properties)
    for name in properties:
        getattr(policy, name)
    assert policy.separate_masters == (policy.master_dtype != policy.compute_dtype)


@pytest.mark.parametrize("precision, master_weights, mixed_params", EVERY_POLICY)
def test_ddp_dtype_is_what_ddp_holds_each_parameter_in(precision, master_weights, mixed_params):
    """``model.state_dict()``'s dtypes at either door ([Note: full state dicts]): fp32 for floating
    parameters under the ``-mixed`` precisions (ddp's fp32 weights under autocast), whatever copies
    the engine computes with; else the parameter's own dtype (ddp converts the module as we do)."""
    policy = precision_policy(precision, master_weights, mixed_params)
    for held in (torch.float32, torch.bfloat16, torch.float16):
        expected = torch.float32 if precision.endswith("-mixed") else held
        assert policy.ddp_dtype(torch.nn.Parameter(torch.zeros(2, dtype=held))) == expected
    assert policy.ddp_dtype(torch.zeros(2, dtype=torch.int64)) == torch.int64


@pytest.mark.parametrize(
    "precision, master_weights, mixed_params, compute, master, autocast, scaled",
    [
        ("32-true", "auto", "auto", torch.float32, torch.float32, None, False),
        ("16-mixed", "auto", "auto", torch.float32, torch.float32, "fp16", True),  # ddp's: the default
        ("16-mixed", "auto", "fp32", torch.float32, torch.float32, "fp16", True),
        ("16-mixed", "auto", "half", torch.float16, torch.float32, "fp16", True),  # DeepSpeed's
        ("bf16-mixed", "auto", "auto", torch.bfloat16, torch.float32, "bf16", False),
        ("bf16-mixed", "auto", "fp32", torch.float32, torch.float32, "bf16", False),
        ("bf16-mixed", "fp32", "half", torch.bfloat16, torch.float32, "bf16", False),
        ("bf16-true", "auto", "auto", torch.bfloat16, torch.bfloat16, None, False),
        ("bf16-true", "fp32", "fp32", torch.bfloat16, torch.float32, None, False),  # mixed_params: no effect
        ("16-true", "auto", "half", torch.float16, torch.float16, None, False),
    ],
)
def test_where_each_precision_keeps_its_bytes(precision, master_weights, mixed_params, compute, master, autocast,
                                              scaled):  # fmt: skip
    policy = precision_policy(precision, master_weights, mixed_params)
    assert (policy.compute_dtype, policy.master_dtype) == (compute, master)
    assert (policy.autocast, policy.loss_scaling) == (autocast, scaled)
    # the engine keeps norm layers' parameters in fp32 only under half parameters with autocast
    assert policy.half_params_under_autocast == (autocast is not None and compute != torch.float32)


@pytest.mark.parametrize(
    "knob, value", [("master_weights", "bf16"), ("master_weights", None), ("mixed_params", "fp16"), ("mixed_params", 1)]
)
def test_one_validator_for_the_precision_knobs(knob, value):
    with pytest.raises(ValueError) as expected:
        check_precision_knobs(**{knob: value})
    message = str(expected.value)
    assert message.startswith(f"ZeroStrategy({knob}={value!r}): give ")
    with pytest.raises(ValueError) as config_error:
        ZeroConfig(**{knob: value})
    assert str(config_error.value) == message
    with pytest.raises(ValueError) as policy_error:
        precision_policy("bf16-true", **{knob: value})
    assert str(policy_error.value) == message
    from lightning_zero.planner.ledger import precision_bytes

    with pytest.raises(ValueError) as ledger_error:
        precision_bytes("bf16-true", **{knob: value})
    assert message in str(ledger_error.value)


def test_only_the_policy_module_knows_the_knobs_values():
    # The values of master_weights / mixed_params are compared in precision.py alone: a
    # second validator (config.py, the ledger and the policy each had one) or a door deciding on a
    # knob's value by itself fails here.
    compares = re.compile(r"\b(master_weights|mixed_params)\b\s*(==|!=|\bin\b|\bnot in\b)")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).as_posix() != "precision.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if compares.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("precision, master_weights, mixed_params", EVERY_POLICY)
def test_both_doors_map_plugins_onto_the_same_policy(precision, master_weights, mixed_params):
    from lightning.fabric.plugins import precision as fabric_plugins
    from lightning.pytorch.plugins import precision as trainer_plugins

    from lightning_zero.fabric.precision import policy_of
    from lightning_zero.trainer.precision import to_zero_precision

    def plugin(module):
        if precision == "32-true":
            return module.Precision()
        if precision.endswith("-mixed"):
            return module.MixedPrecision(precision, "cpu")
        return module.HalfPrecision(precision)

    config = ZeroConfig(master_weights=master_weights, mixed_params=mixed_params)
    want = precision_policy(precision, master_weights, mixed_params)
    assert to_zero_precision(plugin(trainer_plugins), config).policy == want
    assert policy_of(plugin(fabric_plugins), config) == want


@pytest.mark.parametrize("precision, master_weights, mixed_params", EVERY_POLICY)
def test_ledger_bytes_follow_the_policy(precision, master_weights, mixed_params):
    from lightning_zero.planner.ledger import grad_bytes_per_param, policy_bytes, precision_bytes

    policy = precision_policy(precision, master_weights, mixed_params)
    row = precision_bytes(precision, master_weights, mixed_params)
    assert row == policy_bytes(policy)
    assert row.param == row.grad == policy.compute_dtype.itemsize
    assert row.master == (4 if policy.separate_masters else 0)
    assert row.moments == 2 * policy.master_dtype.itemsize
    assert grad_bytes_per_param(precision, "compute", mixed_params) == row.grad
    assert grad_bytes_per_param(precision, "fp32", mixed_params) == 4
    # what the monitor predicts from the engine's two dtypes alone holds the same model-state bytes
    # (activations depend on autocast, which the engine does not see)
    seen = policy_bytes(engine_policy(policy.compute_dtype, policy.master_dtype))
    assert (seen.param, seen.grad, seen.master, seen.moments, seen.state) == (
        row.param, row.grad, row.master, row.moments, row.state
    )  # fmt: skip


def test_layout_search_offers_bf16_wire_only_where_it_drops_bits():
    # the search skips a wire format equal to the tensors' own dtype: bf16 under bf16-mixed's bf16
    # parameters, but with fp32 parameters (mixed_params="fp32") a bf16 wire is a real (lossy) option
    from lightning_zero.planner.search import search_layouts

    common = dict(world_size=16, devices_per_node=8, global_batch=16, seq_len=128, stages=(2,), tp_sizes=(1,),
                  micro_batches=(1,), bucket_mbs=(25.0,), checkpointing=("full",), sequence_parallel=(False,))  # fmt: skip
    wires = {}
    for mixed_params in ("half", "fp32"):
        found = search_layouts("tiny", precision="bf16-mixed", mixed_params=mixed_params, **common)
        wires[mixed_params] = {(r.plan.grad_comm_dtype, r.plan.param_comm_dtype, r.plan.lossless) for r in found.ranked}
    assert ("bf16", "bf16", False) in wires["fp32"]
    assert not any("bf16" in (grad, param) for grad, param, _ in wires["half"])
