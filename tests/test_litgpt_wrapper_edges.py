"""The LitGPT wrapper's own edges (``python -m lightning_zero.fabric.litgpt``), without a process group:
knob names and values, and a ``pretrain`` that LitGPT would end without training. docs/fabric.md's
``--config`` YAML for a model of one's own parses into LitGPT's ``pretrain`` arguments."""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest

from lightning_zero.fabric.litgpt import _options, check_command, main, make_strategy, parse_knob
from tests.distributed import ROOT

HAS_LITGPT = importlib.util.find_spec("litgpt") is not None


def test_unknown_knob_is_refused_naming_the_knobs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--stage", "2", "--knob", "no_such_knob=1", "finetune_lora", "checkpoints/x"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "no_such_knob: no such knob" in message
    assert "bucket_mb" in message and "defer_grad_reduce" in message and "reduce_dtype" in message
    with pytest.raises(ValueError, match=r"no_such_knob: no such knob.*The knobs are.*bucket_mb"):
        make_strategy(stage=3, no_such_knob=1)
    with pytest.raises(ValueError, match=r"the stage is --stage N"):
        parse_knob("stage", "3")


@pytest.mark.parametrize(("text", "value"), [("True", True), ("true", True), ("1", True), ("False", False),
                                             ("false", False), ("0", False), (" TRUE ", True)])  # fmt: skip
def test_boolean_knob_takes_what_the_message_promises(text, value):
    options, command = _options(["--knob", f"defer_grad_reduce={text}", "finetune_lora", "checkpoints/x"])
    assert options["defer_grad_reduce"] is value and command == ["finetune_lora", "checkpoints/x"]
    make_strategy(**options)  # ZeroConfig accepts it


def test_tp_turns_on_sequence_parallelism_unless_a_knob_says_otherwise():
    options, command = _options(["--tp", "2", "--cp", "2", "pretrain", "tiny"])
    assert (options["tensor_parallel_size"], options["sequence_parallel"], options["cp"]) == (2, True, 2)
    options, _ = _options(["--knob", "sequence_parallel=False", "--tp", "2", "finetune_lora"])
    assert (options["tensor_parallel_size"], options["sequence_parallel"]) == (2, False)
    assert command == ["pretrain", "tiny"]
    make_strategy(**options)  # the Fabric door takes tp (its model is checked at fabric.setup)


def test_knob_values_parse_as_json_python_literal_or_text(capsys):
    assert parse_knob("bucket_mb", "0.5") == 0.5
    assert parse_knob("bucket_mb", "auto") == "auto"
    assert parse_knob("grad_comm_dtype", "None") is None and parse_knob("grad_comm_dtype", "null") is None
    assert parse_knob("reduce_dtype", "fp32") == "fp32"
    with pytest.raises(SystemExit):
        _options(["--knob", "overlap_comm=maybe", "finetune_lora"])
    assert "overlap_comm=maybe: give True or False" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed")
def test_pretrain_of_a_name_litgpt_does_not_know_is_refused_naming_the_config_way(capsys, tmp_path):
    """LitGPT prints "Model name my-model is not supported" and exits 0 without training: refused here,
    before anything starts, naming ``--config`` with ``model_config:``."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--stage", "3", "pretrain", "my-model", "--tokenizer_dir", "checkpoints/x", "--devices", "2"])
    assert exit_info.value.code not in (0, None)
    assert re.search(r"LitGPT knows no model named 'my-model'.*--config pretrain.yaml with a model_config:",
                     str(exit_info.value.code))  # fmt: skip
    check_command(["pretrain", "pythia-14m", "--devices", "2"])  # LitGPT's own name
    check_command(["pretrain", "my-model", "--model_config", "{}"])
    yaml_path = tmp_path / "p.yaml"
    yaml_path.write_text("model_config:\n  name: my-model\n")
    check_command(["pretrain", "my-model", "--config", str(yaml_path)])
    yaml_path.write_text("model_name: my-model\n")  # a YAML without the architecture
    with pytest.raises(ValueError, match="knows no model named 'my-model'"):
        check_command(["pretrain", "--config", str(yaml_path)])


def documented_yaml() -> str:
    text = (ROOT / "docs" / "fabric.md").read_text()
    start = text.index("`pretrain-my-model.yaml`:")
    return text[start:].split("```yaml\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed")
def test_documented_pretrain_yaml_gives_litgpt_a_model_config_and_max_tokens(tmp_path):
    """docs/fabric.md's YAML, read by LitGPT's own command line (jsonargparse) for ``pretrain``: the
    architecture arrives as a ``litgpt.Config``, the length as ``train.max_tokens``."""
    import litgpt.pretrain
    from jsonargparse import CLI
    from litgpt.config import Config

    path = tmp_path / "pretrain-my-model.yaml"
    path.write_text(documented_yaml())
    check_command(["pretrain", "--config", str(path)])
    received = {}

    @functools.wraps(litgpt.pretrain.setup)
    def setup(*args, **kwargs):
        received.update(kwargs)

    CLI({"pretrain": setup}, args=["pretrain", "--config", str(path), "--devices", "2"])
    config = received["model_config"]
    assert isinstance(config, Config) and config.name == "my-model" and config.n_layer == 12
    assert received["train"].max_tokens == 3_000_000_000 and type(received["data"]).__name__ == "TextFiles"
