"""LitGPT's own scripts (``finetune_lora``, ``finetune_adapter``, ``finetune_full``, ``pretrain``, ...)
on :class:`~lightning_zero.fabric.strategy.ZeroFabricStrategy`, unchanged.

LitGPT's ``setup`` functions build their own ``L.Fabric(strategy=...)`` (``ModelParallelStrategy`` or
``FSDPStrategy`` on several devices) and take no strategy argument. While :func:`zero_strategy` is
open, every ``lightning.Fabric(...)`` built with a strategy gets the one it makes in place of the one the
caller passed (``lightning.Fabric`` is replaced by a subclass that only swaps that argument; closing the
context restores it and tears the strategies down). Everything else -- devices, precision, loggers,
the script's own order of calls -- is the script's. The command line wraps LitGPT's own::

    python -m lightning_zero.fabric.litgpt --stage 3 finetune_lora --checkpoint_dir ... --devices 8

takes LitGPT's arguments after the command as LitGPT's ``litgpt`` does. Our options come before the
command: ``--stage`` (1, 2, 3; or ``ddp``, ``ddp_find_unused_parameters_true`` for Fabric's own DDP, to compare), ``--state-dict-type``
(``full``, the default: one ``torch.save`` file per save, as LitGPT's scripts ask of FSDP, so
LitGPT's merge, generate and convert tools read it; ``sharded``: a checkpoint directory) and
``--cp N`` (context parallelism: [Note: LitGPT under context parallelism] in
``models/litgpt/parallelize.py``), ``--tp N`` (tensor parallelism with sequence parallelism:
[Note: LitGPT under tensor parallelism] in ``models/litgpt/tensor_parallel.py``) and ``--knob NAME=VALUE`` (any ``ZeroConfig`` field, e.g.
``--knob reduce_dtype=fp32``; a boolean knob takes ``True``/``False``, ``true``/``false`` or ``1``/``0``;
an unknown name is refused, listing the knobs). They travel to the processes Fabric launches in
``LIGHTNING_ZERO_LITGPT`` (JSON), so Fabric's own re-launch of the command line works. ``pretrain``
with a model name LitGPT does not know (where LitGPT prints its list and exits 0 without training)
is refused before anything starts, naming the ``--config`` YAML (``model_config:``) way to pretrain
a model of one's own. docs/fabric.md, "LitGPT", lists what was tested.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

from lightning_zero.fabric._compat import fabric_class_replaced

ENV = "LIGHTNING_ZERO_LITGPT"
DDP = ("ddp", "ddp_find_unused_parameters_true")


def _knob_fields() -> dict[str, dataclasses.Field]:
    from lightning_zero.config import ZeroConfig

    return {field.name: field for field in dataclasses.fields(ZeroConfig) if field.name != "stage"}


def check_knobs(knobs: dict[str, Any]) -> None:
    """Every name a ``ZeroConfig`` field (``stage`` is ``--stage``); else a ValueError listing them."""
    fields = _knob_fields()
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        hint = " (the stage is --stage N, not a knob)" if "stage" in unknown else ""
        raise ValueError(
            f"--knob {', '.join(unknown)}: no such knob{hint}. The knobs are the ZeroConfig fields (docs/cli.md):"
            f" {', '.join(sorted(fields))}."
        )


_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def parse_knob(name: str, text: str) -> Any:
    """``--knob NAME=TEXT``'s value: for a boolean knob ``True``/``False``, ``true``/``false``, ``1``/``0``;
    otherwise JSON (``0.5``, ``null``, ``"fp32"``), a Python literal (``None``) or the text itself."""
    check_knobs({name: text})
    if _knob_fields()[name].type in (bool, "bool"):
        if text.strip().lower() not in _BOOLEANS:
            raise ValueError(f"--knob {name}={text}: give True or False (also true/false, 1/0).")
        return _BOOLEANS[text.strip().lower()]
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text


def _option(args: list[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``args`` (``--flag VALUE`` or ``--flag=VALUE``), or None."""
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def check_command(command: list[str]) -> None:
    """Refuse, before any process starts, a LitGPT command that would end without training:
    ``pretrain NAME`` where LitGPT knows no model ``NAME`` and neither ``--model_config`` nor the
    ``--config`` YAML's ``model_config:`` gives the architecture (LitGPT prints its list of names and
    exits 0)."""
    if not command or command[0] != "pretrain":
        return
    rest = command[1:]
    if _option(rest, "--model_config") is not None:
        return
    from_yaml: Any = {}
    config_path = _option(rest, "--config")
    if config_path is not None and os.path.isfile(config_path):
        import yaml

        with open(config_path) as file:
            from_yaml = yaml.safe_load(file) or {}
    if isinstance(from_yaml, dict) and from_yaml.get("model_config"):
        return
    name = _option(rest, "--model_name")
    if name is None and rest and not rest[0].startswith("-"):
        name = rest[0]
    if name is None and isinstance(from_yaml, dict):
        name = from_yaml.get("model_name")
    if name is None or name == "list":
        return
    from litgpt.config import Config

    try:
        Config.from_name(name)
    except ValueError:
        raise ValueError(
            f"pretrain {name}: LitGPT knows no model named {name!r} (it would print its list of names and exit"
            " without training). For a model of your own give its architecture: --config pretrain.yaml with a"
            " model_config: section (its litgpt.Config fields: name, block_size, n_layer, n_embd, ...), or"
            " --model_config '{...}' (docs/fabric.md, LitGPT). `pretrain list` prints the names LitGPT knows."
        ) from None


def make_strategy(stage: Union[int, str], state_dict_type: str = "full", **knobs: Any) -> Any:
    """``ZeroFabricStrategy(stage=..., state_dict_type=..., **knobs)``; a Fabric strategy name for a
    ``stage`` that names one (``"ddp"``, ``"ddp_find_unused_parameters_true"``), to compare. A knob
    that is no ``ZeroConfig`` field raises ValueError listing them."""
    if str(stage) in DDP:
        if knobs:
            raise ValueError(f"--stage ddp takes no ZeRO knobs (got {sorted(knobs)}).")
        return str(stage)
    check_knobs(knobs)
    from lightning_zero.fabric.strategy import ZeroFabricStrategy

    return ZeroFabricStrategy(stage=int(stage), state_dict_type=state_dict_type, **knobs)  # type: ignore[arg-type]


@contextmanager
def zero_strategy(strategy: Callable[[], Any]) -> Generator[list, None, None]:
    """While open, ``lightning.Fabric(..., strategy=<a strategy>)`` gets ``strategy()`` instead; yields
    the list of Fabrics built so. A Fabric built with the default ``strategy="auto"`` keeps it: LitGPT
    asks for a strategy only on several devices, and builds single-device Fabrics of its own inside a
    run (``merge_lora`` on rank 0). On exit ``lightning.Fabric`` is restored and each strategy torn down."""
    import lightning

    original = lightning.Fabric
    built: list = []

    class Fabric(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            swap = kwargs.get("strategy", "auto") != "auto"
            if swap:
                kwargs["strategy"] = strategy()
            super().__init__(*args, **kwargs)
            if swap:
                built.append(self)

    Fabric.__name__ = Fabric.__qualname__ = "Fabric"
    try:
        with fabric_class_replaced(Fabric):  # [Note: replaced attributes at the Fabric door]
            yield built
    finally:
        for fabric in built:
            fabric.strategy.teardown()


def _options(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_zero.fabric.litgpt",
        description="Run a LitGPT command (finetune_lora, finetune_adapter, finetune_full, pretrain, ...) with"
        " ZeroFabricStrategy. Our options come before LitGPT's command; LitGPT's arguments after it.",
    )
    parser.add_argument("--stage", default="3", choices=["1", "2", "3", *DDP])
    parser.add_argument("--state-dict-type", default="full", choices=["full", "sharded"])
    parser.add_argument(
        "--cp",
        type=int,
        default=None,
        metavar="N",
        help="context parallelism: N ranks hold slices of each sequence (docs/fabric.md, LitGPT)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism with sequence parallelism: N ranks hold parts of each layer (docs/fabric.md, LitGPT)",
    )
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE", help="a ZeroConfig field")
    parser.add_argument("command", help="LitGPT's command, e.g. finetune_lora")
    ours, rest = parser.parse_known_args(argv)
    knobs = {}
    for item in ours.knob:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--knob {item!r}: write NAME=VALUE")
        try:
            knobs[name] = parse_knob(name, value)
        except ValueError as error:
            parser.error(str(error))
    if ours.cp is not None:
        knobs["cp"] = ours.cp
    if ours.tp is not None:  # sequence parallelism with it unless --knob sequence_parallel=False
        knobs["tensor_parallel_size"] = ours.tp
        knobs.setdefault("sequence_parallel", ours.tp > 1)
    options = {"stage": ours.stage, "state_dict_type": ours.state_dict_type, **knobs}
    return options, [ours.command, *rest]


def run(command: list[str], options: dict[str, Any]) -> None:
    """Run LitGPT's CLI on ``command`` (``["finetune_lora", "--checkpoint_dir", ...]``) with the
    strategy ``options`` describe (:func:`make_strategy`'s arguments). LitGPT reads ``sys.argv``
    again when it saves its hyperparameters, so ``sys.argv[1:]`` is ``command`` meanwhile."""
    make_strategy(**options)  # bad options fail here, before any process group starts
    check_command(command)
    from litgpt.__main__ import main as litgpt_main

    saved_argv, saved_env = sys.argv, os.environ.get(ENV)
    sys.argv = [sys.argv[0], *command]
    os.environ[ENV] = json.dumps(options)  # for the processes Fabric re-launches
    try:
        with zero_strategy(lambda: make_strategy(**options)):
            litgpt_main()
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved_env


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    inherited = os.environ.get(ENV)
    if inherited is not None and argv and not argv[0].startswith("-"):  # a process Fabric re-launched
        run(argv, json.loads(inherited))
        return
    options, command = _options(argv)
    try:
        check_command(command)
    except ValueError as error:
        raise SystemExit(f"python -m lightning_zero.fabric.litgpt: error: {error}") from None
    run(command, options)


if __name__ == "__main__":
    main()
