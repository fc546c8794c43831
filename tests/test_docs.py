"""Docs that stay true: README.md and docs/*.md checked against the code they describe.

Each check reads the docs as a newcomer would and fails when a statement no longer holds: generated
blocks are current (``python docs/generate.py`` rewrites them), dotted paths and file paths exist,
every knob / config-group option / recipe appears in the reference tables, every fenced
``lightning-zero`` command parses (composed by Hydra, nothing trained), recipe headers and the docs
quote what ``plan`` predicts, and docs/architecture.md names every module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lightning_zero"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_IDS = [str(path.relative_to(ROOT)) for path in DOCS]


def _load_generate():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


recipe_plan = generate.recipe_plan  # cached: the recipe table and the header checks plan each recipe once


def _fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and generated blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"<!-- generated.*?<!-- end (?:of )?generated[^>]*-->", "", text, flags=re.S)


# -- 1. generated blocks ----------------------------------------------------------------------------

BLOCKS = [(path, block) for path in DOCS for block in generate.blocks(path)]


@pytest.mark.parametrize(
    "path, block", BLOCKS, ids=[f"{p.relative_to(ROOT)}:{b.name}:{b.arg}".rstrip(":") for p, b in BLOCKS]
)
def test_generated_block_is_current(path, block):
    assert block.text == generate.GENERATORS[block.name](block.arg), "stale: run python docs/generate.py"


def test_readme_has_the_generated_tables():
    names = {block.name for block in generate.blocks(ROOT / "README.md")}
    assert {"recipes", "config-groups"} <= names
    assert "knob-table" in {block.name for block in generate.blocks(ROOT / "docs" / "cli.md")}


# -- 2. every recipe, config-group option and group key appears in the reference tables -------------


def _generated_text(path: Path, name: str) -> str:
    return "".join(block.text for block in generate.blocks(path) if block.name == name)


def test_every_recipe_is_in_the_readme_recipe_table():
    from lightning_zero.hydra_config import available_recipes

    table = _generated_text(ROOT / "README.md", "recipes")
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert sorted(listed) == available_recipes()


def test_every_config_group_option_is_in_the_readme_group_table():
    table = _generated_text(ROOT / "README.md", "config-groups")
    for group, options in generate.config_groups().items():
        row = re.search(rf"^\| `{group}` \|(.*)$", table, flags=re.M)
        assert row, f"README's config-group table lacks the group {group!r}"
        assert re.findall(r"`(\w+)`", row.group(1).split("|")[0]) == options, group


def test_docs_cli_md_names_every_group_option_and_key():
    # Each group's options (conf/GROUP/*.yaml) are named in docs/cli.md, and each key of each group's
    # schema has a row in a docs/cli.md table.
    from lightning_zero.hydra_config import GROUP_SCHEMAS

    text = (ROOT / "docs" / "cli.md").read_text()
    missing = [
        f"{group}={option}"
        for group, options in generate.config_groups().items()
        for option in options
        if f"`{option}`" not in text
    ]
    rows = set(re.findall(r"^\| `([\w.]+)`", text, flags=re.M))
    for group, schema in GROUP_SCHEMAS.items():
        for field in dataclasses.fields(schema):
            if field.name.startswith("_"):  # _target_: what the group builds, said in its heading
                continue
            key = f"{group}.{field.name}" if group == "checkpoint" else field.name
            if key not in rows and not re.search(rf"^\| [^|]*`{field.name}`", text, flags=re.M):
                missing.append(f"{group}.{field.name}")
    assert missing == [], missing


# -- 3. every knob is in the knob reference with its default ----------------------------------------


def _normal(value: str):
    """A default as written in prose or a table: `true`/`True`/`null`/`None`/`300 s`/`"auto"`."""
    text = value.strip().strip("`'\" ").lower()
    if text in ("none", "null"):
        return None
    if text in ("true", "false"):
        return text == "true"
    number = re.match(r"^-?\d+(\.\d+)?", text)
    return float(number.group(0)) if number else text


def test_every_knob_is_in_the_knob_reference_with_its_default():
    from lightning_zero.config import ZERO_DEFAULTS

    text = _generated_text(ROOT / "docs" / "cli.md", "knob-table")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, flags=re.M))
    for knob in dataclasses.fields(ZERO_DEFAULTS):
        assert knob.name in rows, f"docs/cli.md has no row for the knob {knob.name!r}"
        if knob.name != "stage":  # "1 / 2 / 3": one per strategy file
            assert _normal(rows[knob.name]) == _normal(str(getattr(ZERO_DEFAULTS, knob.name))), knob.name


PROSE_DEFAULT = r"`{knob}`\s*\((?:[^()]*?[,;:]\s*)?(?:the )?default:?\s*(`[^`]+`|\d[\d.]*)"


@pytest.mark.parametrize("path", DOCS, ids=DOC_IDS)
def test_knob_defaults_stated_in_prose_are_the_config_defaults(path):
    # "`collective_timeout` (default 300 s: ...)": a default restated by hand must be the config's.
    from lightning_zero.config import ZERO_DEFAULTS

    prose = _prose(path.read_text())
    wrong = []
    for knob in dataclasses.fields(ZERO_DEFAULTS):
        for match in re.finditer(PROSE_DEFAULT.format(knob=knob.name), prose):
            if _normal(match.group(1)) != _normal(str(getattr(ZERO_DEFAULTS, knob.name))):
                wrong.append(match.group(0))
    assert wrong == [], wrong


# -- 4. dotted paths and file paths exist -----------------------------------------------------------

SUBPACKAGES = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
# First words of Hydra keys (`data.seq_len`, `trainer.max_steps`, `checkpoint.save_last`, ...) and of
# other objects (`config.<knob>`, a `ZeroConfig`): a dotted path starting with one is a module path only
# when its second word is a module of that subpackage.
HYDRA_WORDS = {"model", "strategy", "data", "trainer", "optim", "hardware", "plan", "checkpoint", "recipe", "hydra"}
# Words that name a subpackage and also a user's object in the docs' code (`fabric.backward`: the
# `L.Fabric` instance): such a path is the package's only where its second part is a module file.
AMBIGUOUS_WORDS = HYDRA_WORDS | {"fabric"}
NOT_MODULES = HYDRA_WORDS | {"config", "engine", "search", "optimizer", "lightning", "torch", "nn", "self", "cfg"}
FILE_SUFFIXES = tuple(".py .md .yaml .yml .sh .json .toml .txt .bin .npy .png .csv .ckpt".split())


def _module_stems() -> dict[str, list[str]]:
    stems: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        stems.setdefault(path.stem, []).append(name)
    return stems


def _has_attribute(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in owner.__dataclass_fields__:
        return True
    if inspect.isclass(owner):  # an attribute set in __init__
        try:
            return f"self.{name} =" in inspect.getsource(owner) or f"self.{name}:" in inspect.getsource(owner)
        except (OSError, TypeError):
            return False
    return False


def _plan_field(field: str, name: str) -> bool:
    """``traffic.intra_node_s``: a field of the planner's ``Plan`` (its JSON keys), not a module path."""
    import typing

    from lightning_zero.planner.plan import Plan

    kind = typing.get_type_hints(Plan).get(field)
    return dataclasses.is_dataclass(kind) and _has_attribute(kind, name)


def resolves(dotted: str) -> bool:
    """``lightning_zero.a.b.C.d`` names a module and attributes that exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except (ModuleNotFoundError, ValueError):
            found = False
        if found:
            owner = importlib.import_module(name)
            for attribute in parts[cut:]:
                if not _has_attribute(owner, attribute):
                    return False
                owner = getattr(owner, attribute, None)
            return True
    return False


def dotted_paths(text: str) -> list[str]:
    """Every ``lightning_zero.x.y`` path, and every backticked ``subpackage.module.name`` /
    ``module.name`` path of the package (``planner.timing.training_flops``, ``timing.recompute_flops``),
    each as a full ``lightning_zero.`` path; or as ``?stem.name`` when a module stem is ambiguous."""
    found = [match.rstrip(".") for match in re.findall(r"\blightning_zero(?:\.[A-Za-z_]\w*)+", text)]
    stems = _module_stems()
    for token in re.findall(r"`([a-z_][\w]*(?:\.[A-Za-z_]\w*)+)(?:\(\S*?\))?`", text):
        if token.endswith(FILE_SUFFIXES):
            continue
        first, second = token.split(".")[:2]
        if first in SUBPACKAGES and (first not in AMBIGUOUS_WORDS or (PACKAGE / first / f"{second}.py").exists()):
            found.append(f"lightning_zero.{token}")
        elif first in stems and first not in NOT_MODULES and first not in SUBPACKAGES and first != "lightning_zero":
            found.append("?" + token)
    return found


def missing_dotted_paths(path: Path) -> list[str]:
    stems = _module_stems()
    missing = []
    for dotted in dict.fromkeys(dotted_paths(path.read_text())):
        if dotted.startswith("?"):  # `stem.name`: any module with that stem will do
            stem, _, rest = dotted[1:].partition(".")
            if not any(resolves(f"{module}.{rest}") for module in stems[stem]) and not _plan_field(stem, rest):
                missing.append(dotted[1:])
        elif not resolves(dotted):
            missing.append(dotted)
    return missing


@pytest.mark.parametrize("path", DOCS, ids=DOC_IDS)
def test_dotted_paths_exist(path):
    assert (missing := missing_dotted_paths(path)) == [], missing


FILE_PATH = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml|yml|sh|sbatch|toml))\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Files the docs name that a user or a run creates, not the repository.
NOT_IN_REPO = {"resolved_config.yaml", "my_machine.yaml", "cpu_calibrated.yaml", "bench_x.py", "pretrain-my-model.yaml",
               "model_config.yaml"}  # fmt: skip
PLACEHOLDER = re.compile(r"[A-Z]{3,}|\.\.\.|[*{<]")


@functools.cache
def _repo_files() -> tuple[str, ...]:
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if not d.startswith(".") and d not in ("__pycache__", "outputs", "multirun") and not d.endswith(".egg-info")]  # fmt: skip
        rel = Path(directory).relative_to(ROOT)
        files.extend(str(rel / name) if str(rel) != "." else name for name in [*names, *(f"{d}/" for d in subdirs)])
    return tuple(files)


def file_exists(token: str, doc: Path) -> bool:
    token = token.rstrip("/")
    for base in (doc.parent, ROOT, PACKAGE, ROOT / "src"):
        if (base / token).exists():
            return True
    return any(f.rstrip("/") == token or f.rstrip("/").endswith("/" + token) for f in _repo_files())


def file_paths(text: str) -> list[str]:
    links = [target for target in LINK.findall(text) if "://" not in target and not target.startswith("mailto:")]
    return list(dict.fromkeys([*links, *FILE_PATH.findall(text)]))


def missing_file_paths(path: Path) -> list[str]:
    return [
        token
        for token in file_paths(path.read_text())
        if Path(token).name not in NOT_IN_REPO and not PLACEHOLDER.search(token) and not file_exists(token, path)
    ]


@pytest.mark.parametrize("path", DOCS, ids=DOC_IDS)
def test_file_paths_exist(path):
    assert (missing := missing_file_paths(path)) == [], missing


# -- 5. every fenced `lightning-zero` command in README.md and docs/ parses ----------------------------------


def fenced_commands(path: Path) -> list[str]:
    """Every ``lightning-zero ...`` command of ``path``'s shell blocks (README: also unlabelled ones)."""
    languages = ("bash", "sh", "shell", "console", *([""] if path.name == "README.md" else []))
    commands = []
    for language, body in _fenced(path.read_text()):
        if language not in languages:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("lightning-zero ") or (" && lightning-zero " in line):
                commands.append(line[line.index("lightning-zero ") :])
    return commands


def _first_of_sweep(override: str) -> str:
    """``key=a,b,c`` of a multirun sweep -> ``key=a`` (lists in brackets stay whole)."""
    key, sep, value = override.partition("=")
    if sep and "," in value and not value.startswith("["):
        return f"{key}={value.split(',')[0]}"
    return override


def parse_command(command: str) -> None:
    """Parse one ``lightning-zero ...`` command as the CLI would, running nothing: train / plan are
    composed by Hydra and validated (``--cfg job``'s config); export / prepare-data / plan calibrate go
    through their own argument parsers, stopped right after parsing."""
    import argparse
    from unittest import mock

    from lightning_zero import cli
    from lightning_zero.hydra_config import compose

    words = shlex.split(command.split(" #")[0])[1:]
    subcommand, args = words[0], words[1:]
    if subcommand in ("train", "plan") and args[:1] != ["calibrate"]:
        flags = {"-m", "--multirun", "--cfg", "job", "hydra", "all", "--resolve"}
        overrides = [_first_of_sweep(arg) for arg in args if arg not in flags]
        compose([arg for arg in overrides if not arg.startswith("hydra.")])
        return

    class Parsed(Exception):
        pass

    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        real_parse(self, argv, namespace)  # exits 2 on a bad argument
        raise Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), pytest.raises(Parsed):
        cli.main(words)


COMMANDS = [(path, command) for path in DOCS for command in fenced_commands(path)]


@pytest.mark.parametrize("path, command", COMMANDS, ids=[f"{p.relative_to(ROOT)}:{c}" for p, c in COMMANDS])
def test_fenced_command_parses(path, command):
    parse_command(command)


def test_readme_keeps_the_ci_test_command():
    # The README's "run the tests" command is the one .ci/run runs (its last line).
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = [body for _, body in _fenced((ROOT / "README.md").read_text())]
    assert any(ci_command in body for body in blocks[:3]), ci_command
    assert any("lightning-zero train" in body for body in blocks[:3])


# -- 6. recipe headers, and the docs, quote what `plan` predicts ------------------------------------


def _gpu_recipes() -> list[str]:
    from lightning_zero.hydra_config import available_recipes
    from lightning_zero.models.moe.config import moe_preset_names

    # Mixture-of-experts recipes are planned by planner/moe.py: tests/test_recipes.py checks their headers.
    return [name for name in available_recipes() if name != "tiny" and name not in moe_preset_names()]


def _header(name: str) -> str:
    from lightning_zero.hydra_config import RECIPES_DIR

    lines = (RECIPES_DIR / f"{name}.yaml").read_text().splitlines()
    comments = [line.lstrip("# ") for line in lines[: next(i for i, l in enumerate(lines) if not l.startswith("#"))]]  # noqa: E741
    return " ".join(comments)


def layout_claims(plan) -> dict[str, str]:
    """What a text may say about a recipe's layout, by kind, as this plan has it."""
    return {
        "zero": str(plan.stage),
        "dp": str(plan.dp),
        "tp": str(plan.tp),
        "tokens/s": f"{plan.tokens_per_s:,.0f}",
        "GiB per GPU": f"{plan.memory.total / 2**30:.1f}",
    }


CLAIMS = {
    "zero": r"ZeRO-(\d)",
    "dp": r"\bdp[= ](\d+)|ZeRO-\d over (\d+) GPUs",
    "tp": r"\btp[= ](\d+)",
    "tokens/s": r"([\d,]{4,}) (?:tokens/s|tok/s)",
    "GiB per GPU": r"(\d+\.\d) GiB per GPU",
}


def claims(text: str) -> list[tuple[str, str]]:
    """``(kind, value)`` of every layout claim in ``text``."""
    found = []
    for kind, pattern in CLAIMS.items():
        for match in re.finditer(pattern, text):
            found.append((kind, next(group for group in match.groups() if group is not None)))
    return found


@pytest.mark.parametrize("recipe", _gpu_recipes())
def test_recipe_header_states_what_plan_predicts(recipe):
    # The header's first statement of each kind (the current layout: later ones may be history,
    # "before: ...") is what `lightning-zero plan recipe=NAME` predicts; a bare "activation
    # checkpointing" in its list of settings holds only when the recipe checkpoints.
    cfg, plan = recipe_plan(recipe)
    header = _header(recipe)
    expected = layout_claims(plan)
    stated = {}
    for kind, value in claims(header):
        stated.setdefault(kind, value)  # the first of each kind
    assert "GiB per GPU" in stated and "zero" in stated, f"{recipe}.yaml's header states no plan"
    wrong = {kind: (value, expected[kind]) for kind, value in stated.items() if value != expected[kind]}
    assert wrong == {}
    shape = re.search(r"(\d+) nodes? x (\d+) GPUs", header)
    assert shape and (int(shape.group(1)), int(shape.group(2))) == (cfg.trainer.num_nodes, cfg.trainer.devices)
    bare = re.search(r"(?<!no )(?<!full )(?<!selective )(?<!without )activation checkpointing(?! ?:)", header)
    assert not bare or plan.checkpointing != "none", f"{recipe}.yaml says '{bare.group(0)}' but sets none"


# `llama70b`, `recipe=llama70b`, recipes/llama70b.yaml: a statement about the recipe. Anywhere in a
# command (`lightning-zero plan recipe=llama70b ...`) it names the section's subject only.
RECIPE_NAME = re.compile(r"(?:`|`recipe=|recipes/)(\w+?)(?:\.yaml)?(?:`|\b)")
RECIPE_IN_COMMAND = re.compile(r"recipe=(\w+)")


def _recipe_names(text: str, pattern: re.Pattern = RECIPE_NAME) -> set[str]:
    from lightning_zero.hydra_config import available_recipes

    return {name for name in pattern.findall(text) if name in available_recipes()}


def recipe_statements(text: str) -> list[tuple[str, str]]:
    """``(recipe, text)`` pairs where ``text`` speaks of that one recipe: a paragraph or table row of
    prose naming only it; the parenthetical right after its name (`llama70b_finetune` (8 x 8, ...));
    in a section (## heading) naming only it (its commands included), each sentence about "the recipe"."""
    found = []
    for section in re.split(r"^#+ ", text, flags=re.M):
        if len(named := _recipe_names(section) | _recipe_names(section, RECIPE_IN_COMMAND)) == 1:
            sentences = re.split(r"(?<=[.;])\s+", _prose(section))
            found.extend(
                (next(iter(named)), sentence) for sentence in sentences if re.search(r"\brecipe\b(?!=)", sentence)
            )
        for paragraph in re.split(r"\n\s*\n", _prose(section)):
            rows = [line for line in paragraph.splitlines() if line.startswith("|")]
            for part in rows or [paragraph]:
                if len(named := _recipe_names(part)) == 1:
                    found.append((next(iter(named)), part))
                    continue
                for match in re.finditer(r"`(\w+)`\s*\(([^()]*)\)", part):
                    if match.group(1) in named:
                        found.append((match.group(1), match.group(2)))
    return found


@pytest.mark.parametrize("path", DOCS, ids=DOC_IDS)
def test_docs_quote_each_recipe_as_plan_predicts(path):
    # What the docs say of one recipe (its ZeRO stage, dp, tp, tokens/s, GiB per GPU) is its current
    # plan; the generated recipe table is checked by regenerating it.
    from lightning_zero.models.moe.config import moe_preset_names

    wrong = []
    for recipe, statement in recipe_statements(path.read_text()):
        if recipe in moe_preset_names():  # planned by planner/moe.py: tests/test_recipes.py
            continue
        expected = layout_claims(recipe_plan(recipe)[1])
        for kind, value in claims(statement):
            if value != expected[kind]:
                wrong.append(f"{recipe}: {kind} {value} (plan: {expected[kind]}) in {statement[:100]!r}")
    assert wrong == [], wrong


# -- 7. docs/architecture.md names every module -----------------------------------------------------


def test_architecture_md_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    items = re.split(r"\n(?=\s*- )|\n\s*\n", text)  # list items and paragraphs
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        directory = f"{rel.parent}/" if str(rel.parent) != "." else ""
        named = str(rel) in text or (
            # `zero/ (flat, reducer, ...)`, or `reducer.py` in a list item naming its directory
            any(re.search(rf"\b{path.stem}\b", item) and directory in item for item in items)
        )
        if not named:
            missing.append(str(rel))
    assert missing == [], f"add a line for each module to docs/architecture.md: {missing}"
