"""Regenerate the parts of README.md and docs/ that are copies of facts the code owns.

    python docs/generate.py            rewrite every generated block in place
    python docs/generate.py --check    change nothing; exit 1 naming each stale block

A generated block sits between two markers and is written only by this script:

    <!-- generated: NAME (python docs/generate.py) -->
    ...
    <!-- end generated: NAME -->

(docs/cli.md's knob table keeps the markers it had before this script: tests/test_knobs.py and the
helpers' instructions name them.) Blocks: the knob reference (``lightning_zero.config.knob_table``),
the config groups and their options (the files under conf/), the recipes (each recipe composed and
planned by ``lightning_zero.planner.plan_run``: what ``lightning-zero plan recipe=NAME`` prints),
and the printed output of the ``lightning-zero plan`` commands the docs show. tests/test_docs.py
runs ``--check``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

KNOB_BEGIN = "<!-- generated from lightning_zero.config.ZeroConfig (python -m lightning_zero.config); tests/test_knobs.py checks it -->"
KNOB_END = "<!-- end of generated table -->"
BEGIN = re.compile(r"<!-- generated: (?P<name>[\w-]+)(?: (?P<arg>.*?))? \(python docs/generate\.py\) -->")
END = "<!-- end generated: {name} -->"

# What each config group sets, for the groups table (a new group without a line here is an error:
# the table would otherwise list it without saying what it is).
GROUP_MEANING = {
    "model": "the model shape: a Llama or mixture-of-experts preset (`hf`: the shape of `model.init_from`'s config.json)",
    "strategy": "`zero1` / `zero2` / `zero3`: `ZeroStrategy`; `ddp`: Lightning's, for comparisons",
    "data": "the token stream: `corpus` (stdlib text, bytes), `memmap` (a token file), `synthetic`",
    "trainer": "accelerator, devices x nodes, precision, steps",
    "optim": "AdamW with warmup and cosine decay",
    "hardware": "the GPU `lightning-zero plan` sizes for",
    "plan": "output options of `lightning-zero plan`",
}


@dataclass(frozen=True)
class Block:
    """One generated region of one file: ``text`` is everything between its two markers."""

    path: Path
    name: str
    arg: str
    start: int  # offset of the first character after the begin marker's line
    end: int  # offset of the end marker
    text: str


def blocks(path: Path) -> list[Block]:
    """The generated blocks of ``path``, in file order."""
    source = path.read_text()
    found = []
    if KNOB_BEGIN in source:
        start = source.index("\n", source.index(KNOB_BEGIN)) + 1
        end = source.index(KNOB_END, start)
        found.append(Block(path, "knob-table", "", start, end, source[start:end]))
    for match in BEGIN.finditer(source):
        name = match.group("name")
        start = source.index("\n", match.end()) + 1
        end = source.find(END.format(name=name), start)
        if end < 0:
            raise ValueError(f"{path.relative_to(ROOT)}: `{match.group(0)}` has no `{END.format(name=name)}`")
        found.append(Block(path, name, match.group("arg") or "", start, end, source[start:end]))
    return found


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# -- the generators: each returns the block's text (ending in a newline) -----------------------------


def knob_table(arg: str = "") -> str:
    from lightning_zero.config import knob_table as table

    return table() + "\n"


def _group_defaults() -> dict[str, str]:
    import yaml

    defaults = {}
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update({str(key): str(value) for key, value in entry.items()})
    return defaults


def config_groups() -> dict[str, list[str]]:
    """Each config group under conf/ (in conf/config.yaml's order) and its options (file stems)."""
    order = [name for name in _group_defaults() if (CONF / name).is_dir()]
    found = sorted(path.name for path in CONF.iterdir() if path.is_dir() and list(path.glob("*.yaml")))
    ordered = [*order, *(name for name in found if name not in order)]
    return {name: sorted(path.stem for path in (CONF / name).glob("*.yaml")) for name in ordered}


def groups_table(arg: str = "") -> str:
    defaults = _group_defaults()
    rows = ["| group | options | default | what it sets |", "| --- | --- | --- | --- |"]
    for group, options in config_groups().items():
        if group not in GROUP_MEANING:
            raise ValueError(
                f"conf/{group}/ is a new config group: say what it sets in GROUP_MEANING (docs/generate.py)"
            )
        listed = ", ".join(f"`{option}`" for option in options)
        rows.append(f"| `{group}` | {listed} | `{defaults.get(group, 'null')}` | {GROUP_MEANING[group]} |")
    from lightning_zero.hydra_config import available_recipes

    listed = ", ".join(f"`{name}`" for name in available_recipes())
    rows.append(f"| `recipe` | {listed} | `null` | a recipe from `recipes/` merged last (the table below) |")
    return "\n".join(rows) + "\n"


_CHECKPOINTING = {"none": "no checkpointing", "selective": "selective checkpointing", "full": "full checkpointing"}


@functools.cache
def recipe_plan(name: str):
    """``(composed config, plan)`` of recipe ``name``: what ``lightning-zero plan recipe=NAME`` plans."""
    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import plan_inputs_from_config

    cfg = compose([f"recipe={name}"])
    planned, _ = plan_inputs_from_config(cfg)
    return cfg, planned.plan()


def recipe_row(name: str) -> str:
    cfg, plan = recipe_plan(name)
    trainer = cfg.trainer
    if trainer.accelerator == "cpu":
        cluster = f"1 machine, {trainer.devices} CPU processes"
    else:
        nodes = f"{trainer.num_nodes} node{'s' if trainer.num_nodes > 1 else ''}"
        cluster = f"{nodes} x {trainer.devices} GPUs, `{plan.hardware}`"
    layout = []
    if plan.pp > 1:
        layout.append(f"pp={plan.pp} {plan.pp_schedule} ({plan.pp_microbatches} micro-batches a pass)")
    if plan.tp > 1:
        layout.append(f"tp={plan.tp}" + (" + sequence parallel" if plan.sequence_parallel else ""))
    if plan.cp > 1:
        layout.append(f"cp={plan.cp}")
    if plan.ep > 1:
        layout.append(f"ep={plan.ep} (experts over edp={plan.edp})")
    dense = plan.dp * plan.cp  # ZeRO's group: the dp x cp ranks of one tp rank
    over = f"dp={plan.dp}" if plan.cp == 1 else f"dp x cp={dense}"
    sharded = f"ZeRO-{plan.stage} over {over}" if plan.shard_size in (None, dense) else (
        f"ZeRO-{plan.stage} over shards of {plan.shard_size} (dp={plan.dp})"
    )  # fmt: skip
    layout.append(sharded)
    layout.append(f"micro batch {plan.micro_batch}, accumulate {plan.accumulate_grad_batches}")
    layout.append(_CHECKPOINTING[plan.checkpointing])
    if plan.stage == 3:
        layout.append(f"prefetch {plan.prefetch_blocks}")
    layout.append(f"seq {plan.seq_len}, {plan.precision}")
    if cfg.model.get("init_from"):
        layout.append("from `model.init_from`")
    if trainer.accelerator == "cpu":
        memory = f"{plan.memory.model_states / 1e6:.0f} MB of model states"
        speed = ""
    else:
        memory = f"{plan.memory.total / 2**30:.1f} GiB"
        speed = f"{plan.tokens_per_s:,.0f}"
    return f"| `{name}` | {cluster} | {', '.join(layout)} | {memory} | {speed} |"


def _recipe_order(name: str) -> tuple:
    """tiny first, then Llama 2 before Llama 3, pretraining before fine-tuning, small before large."""
    size = re.search(r"(\d+)b", name.removeprefix("llama3_").removeprefix("llama"))
    moe = not name.startswith(("llama", "tiny"))
    return (
        name != "tiny",
        moe,
        name.startswith("llama3"),
        name.endswith("_finetune"),
        int(size.group(1)) if size else 0,
    )


def recipe_table(arg: str = "") -> str:
    """Every recipe's row (``arg="moe"``: the mixtures of experts only)."""
    from lightning_zero.hydra_config import available_recipes, compose
    from lightning_zero.models.moe.config import moe_preset_names

    rows = [
        "| recipe | cluster | layout | planned per GPU | predicted tokens/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    names = sorted(available_recipes(), key=_recipe_order)
    if arg == "moe":
        names = [name for name in names if compose([f"recipe={name}"]).model.name in moe_preset_names()]
    rows.extend(recipe_row(name) for name in names)
    return "\n".join(rows) + "\n"


PLAN_WIDTH = 120


def plan_output(arg: str) -> str:
    """What ``lightning-zero plan OVERRIDES`` prints in a terminal ``PLAN_WIDTH`` columns wide (or
    ``width=N``, a word of ``arg``), fenced."""
    from rich.console import Console

    from lightning_zero.hydra_config import compose
    from lightning_zero.planner import run_plan

    words = arg.split()
    if words[:2] != ["lightning-zero", "plan"]:
        raise ValueError(f"a plan-output block names a `lightning-zero plan` command, got {arg!r}")
    width = next((int(word[6:]) for word in words if word.startswith("width=")), PLAN_WIDTH)
    overrides = [word for word in words[2:] if not word.startswith("width=")]
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    with contextlib.redirect_stdout(io.StringIO()):
        run_plan(compose(overrides), console=console)
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    return "```\n" + "\n".join(lines) + "\n```\n"


GENERATORS: dict[str, Callable[[str], str]] = {
    "knob-table": knob_table,
    "config-groups": groups_table,
    "recipes": recipe_table,
    "plan-output": plan_output,
}


def regenerate(path: Path) -> tuple[str, list[str]]:
    """``path``'s text with every generated block rewritten, and the names of the blocks that changed."""
    source = path.read_text()
    stale = []
    for block in reversed(blocks(path)):  # from the end: earlier offsets stay valid
        if block.name not in GENERATORS:
            raise ValueError(f"{path.relative_to(ROOT)}: unknown generated block {block.name!r}")
        text = GENERATORS[block.name](block.arg)
        if text != block.text:
            stale.append(f"{path.relative_to(ROOT)}: {block.name} {block.arg}".rstrip())
            source = source[: block.start] + text + source[block.end :]
    return source, stale[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    args = parser.parse_args(argv)
    all_stale = []
    for path in args.files or doc_files():
        source, stale = regenerate(path.resolve())
        all_stale.extend(stale)
        if stale and not args.check:
            path.write_text(source)
    for name in all_stale:
        print(f"{'stale' if args.check else 'regenerated'}: {name}")
    if all_stale and args.check:
        print("run: python docs/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
