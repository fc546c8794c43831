"""The architecture as a test: a declared package order that every import follows (lazy imports, imports under
``TYPE_CHECKING`` and lazy-name tables included), no import circles between packages or files, checkpoint/ below
models/, and only the engine walks buckets and slots."""

import ast
import collections
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "lightning_zero"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function (lazy imports count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


HYDRA_FREE = ("zero", "tp", "cp", "comm", "checkpoint", "config.py")  # under PACKAGE: never load omegaconf or Hydra


def test_engine_tp_checkpoint_and_config_never_reach_hydra():
    # ZeroConfig is plain Python; the Hydra schema is generated from it in hydra_config.py. The
    # check follows lightning_zero's own imports, lazy ones included, to any module importing
    # omegaconf or hydra.
    modules = _modules()
    imports = {name: _all_imports(path) for name, path in modules.items()}
    hydra = {name for name, names in imports.items() if any(n.split(".")[0] in ("omegaconf", "hydra") for n in names)}
    offenders = []
    for name, path in modules.items():
        if path.relative_to(PACKAGE).parts[0] not in HYDRA_FREE:
            continue
        seen, todo = {name}, [name]
        while todo:
            current = todo.pop()
            if current in hydra:
                offenders.append(f"{name} -> ... -> {current}")
            for target in imports[current] & modules.keys():
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
    assert offenders == []


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere: at module level, inside functions and
    under ``TYPE_CHECKING`` (a lazy import only hides a circle until a second model family or a
    refactor moves it to the top)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        graph[name] = _all_imports(path) & modules.keys()
    return graph


def test_no_import_circles():
    # No module reachable from itself through the package's own imports, lazy ones included.
    modules = _modules()
    graph = _import_graph(modules)
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in modules:
        if module not in state:
            visit(module, [])
    assert cycles == []


# [Note: package order] The packages of lightning_zero, bottom to top (docs/architecture.md, "Package
# order"). A module imports only from its own package or from a package on a lower line; the packages
# on one line are siblings that do not import each other. What everything needs (precision rules,
# config) is at the bottom, the two doors and the command line at the top. A new package or top-level
# module takes its line here before it can land.
PACKAGE_ORDER = (
    ("_lazy", "ports", "precision"),  # leaves: import nothing of ours
    ("config",),  # every knob, once
    ("comm",),  # mesh, groups, counted collectives
    ("tp", "cp"),  # generic tensor- and context-parallel layers
    ("zero", "ep", "pp"),  # the ZeRO engine; the generic expert token exchange; pipeline layout and schedules
    ("checkpoint",),  # readers and writers, no model family
    ("models", "data"),  # model families (each with its own parallelize plan); token data
    ("hydra_config",),  # the Hydra schema generated from config and the model presets
    ("planner",),  # arithmetic over all of the above
    ("runtime", "ledger"),  # what both doors share; the public ledger
    ("trainer", "fabric"),  # the two front doors
    ("cli", "_registry"),  # the command line; the strategy registration (names the doors)
    ("__main__", "lightning_zero"),  # ``python -m lightning_zero``; the package's own __init__
)


def _package(module: str) -> str:
    """The part of PACKAGE_ORDER a module belongs to: ``lightning_zero.zero.stage3.units`` -> ``zero``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _named_modules(path: Path, modules: set[str]) -> set[str]:
    """Every module of the package ``path`` names: its imports (``_all_imports``: module level, in functions,
    under ``TYPE_CHECKING``) and each string that names a module of ours, dotted (a lazy-name table such as
    ``lightning_zero.__init__._LAZY``, an ``importlib.import_module`` target: an import all the same)."""
    named = _all_imports(path) & modules
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            if node.value in modules:
                named.add(node.value)
    return named


def _package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the imports that make the edge, ``module:line -> module``."""
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for name, path in modules.items():
        for target in sorted(_named_modules(path, set(modules))):
            if _package(target) != _package(name):
                edges[(_package(name), _package(target))].append(f"{name} -> {target}")
    return edges


def test_every_package_has_its_place_in_the_order():
    declared = [package for line in PACKAGE_ORDER for package in line]
    assert len(declared) == len(set(declared))
    assert set(declared) == {_package(name) for name in _modules()}


def test_imports_only_point_down_the_package_order():
    # [Note: package order]. Sibling packages (one line) do not import each other either.
    level = {package: index for index, line in enumerate(PACKAGE_ORDER) for package in line}
    upward = [
        f"{importer} (line {level[importer]}) -> {imported} (line {level[imported]}): {', '.join(why)}"
        for (importer, imported), why in sorted(_package_edges().items())
        if level[imported] >= level[importer]
    ]
    assert upward == []


def test_no_import_circles_between_packages():
    # Independent of the declared order: no package reaches itself through other packages' imports.
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for importer, imported in _package_edges():
        graph[importer].add(imported)
    cycles = []
    for start in sorted(graph):
        seen, todo = set(), [[start]]
        while todo:
            path = todo.pop()
            for target in sorted(graph[path[-1]]):
                if target == start:
                    cycles.append(" -> ".join(path + [start]))
                elif target not in seen:
                    seen.add(target)
                    todo.append(path + [target])
    assert cycles == []


def test_architecture_doc_declares_the_same_order():
    # docs/architecture.md's "Package order" block lists PACKAGE_ORDER's lines, bottom line last.
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Package order", 1)[1].split("```", 2)[1]
    lines = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert [tuple(line) for line in reversed(lines) if line] == list(PACKAGE_ORDER)


def test_checkpoint_knows_no_model_family():
    # Models import checkpoint/ (the generic readers and writers), never the reverse: a second
    # family adds its layout beside its model, not in checkpoint/.
    offenders = [
        f"{path.relative_to(SRC)} -> {name}"
        for path in (PACKAGE / "checkpoint").rglob("*.py")
        for name in sorted(_all_imports(path))
        if name.startswith("lightning_zero.models")
    ]
    assert offenders == []


def test_imports_are_absolute():
    # The import checks above read absolute imports only; a relative one would slip past them.
    relative = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert relative == []


def test_only_the_engine_walks_buckets_and_slots():
    walking = re.compile(r"\.(slots|buckets)\b")
    offenders = [
        f"{path.relative_to(SRC)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if "zero" not in path.relative_to(PACKAGE).parts[:1]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if walking.search(line)
    ]
    assert offenders == []


def test_engine_and_tp_never_import_lightning():
    for folder in ("zero", "tp", "cp", "comm"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(import|from) lightning\b", text, re.M), path


def test_runtime_and_fabric_door_never_import_lightning_pytorch():
    # Two front doors over one runtime: only the Trainer's glue (trainer/) builds on lightning.pytorch;
    # the shared runtime and the Fabric door (fabric/) may use lightning.fabric at most.
    pattern = re.compile(
        r"^\s*(import lightning\.pytorch|from lightning\.pytorch|from lightning import|import lightning as)\b", re.M
    )
    offenders = [
        str(path.relative_to(PACKAGE))
        for folder in ("runtime", "fabric")
        for path in (PACKAGE / folder).rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert offenders == []


def test_monitor_and_public_ledger_load_no_planner_beyond_its_formulas():
    # [Note: planner imports]: the runtime monitor and lightning_zero.ledger read the byte formulas
    # of planner/ledger.py; the step-time model, the search and the report stay unloaded.
    import os
    import subprocess
    import sys

    code = (
        "import sys, lightning_zero.ledger, lightning_zero.trainer.monitor; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning_zero.planner')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['lightning_zero.planner', 'lightning_zero.planner.ledger']"


def test_plan_path_imports_neither_lightning_nor_torch(tmp_path):
    # `lightning-zero plan` is arithmetic: a fresh interpreter that takes LlamaConfig through
    # lightning_zero.models, asks for --help, gets a bad recipe and a bad value refused, and runs
    # the CLI's plan and layout search loads no torch or Lightning ([Note: light command line]).
    import json
    import os
    import subprocess
    import sys

    code = (
        "import contextlib, io, json, sys\n"
        "import lightning_zero.models\n"
        "lightning_zero.models.LlamaConfig, lightning_zero.models.resolve_config\n"
        "after_models = sorted(m for m in ('lightning', 'torch') if m in sys.modules)\n"
        "from lightning_zero.cli import main\n"
        "exits = []\n"
        "for args in (['--help'], ['plan', 'recipe=nosuch'], ['plan', 'recipe=llama70b', 'strategy.bucket_mb=-3']):\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "            main(args)\n"
        "        exits.append(0)\n"
        "    except SystemExit as error:\n"
        "        exits.append(error.code)\n"
        "outputs = []\n"
        "for extra in ([], ['plan.search=true', 'plan.top=2']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        main(['plan', 'recipe=llama70b', 'plan.format=json', *extra])\n"
        "    outputs.append(json.loads(out.getvalue()))\n"
        "heavy = sorted(m for m in ('lightning', 'torch') if m in sys.modules)\n"
        "print(json.dumps([after_models, heavy, exits, outputs[0]['plan']['world_size'], len(outputs[1]['search']['top'])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    after_models, heavy, exits, world_size, top = json.loads(out.stdout.strip().splitlines()[-1])
    assert (after_models, heavy) == ([], [])
    assert exits == [0, 2, 1]  # usage; an unknown recipe; Hydra's exit for the bad bucket_mb
    assert world_size == 64 and top == 2  # the plan and the search ran
    assert list(tmp_path.iterdir()) == []  # and wrote nothing


DOORS = ("trainer/strategy.py", "fabric/strategy.py")
DOOR_LINES = 400  # [Note: one runtime object] in runtime/run.py: a door only translates hooks into events


def test_each_door_module_stays_a_translation_table():
    sizes = {door: len((PACKAGE / door).read_text().splitlines()) for door in DOORS}
    assert {door: n for door, n in sizes.items() if n > DOOR_LINES} == {}, (
        f"over {DOOR_LINES} lines: move logic to runtime/"
    )


def _calls(path: Path) -> set[str]:
    """The names called in ``path`` (``f(...)`` and ``x.f(...)`` both as ``f``)."""
    return {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
    }


def test_the_doors_build_the_one_runtime_object_not_its_parts():
    # The session-plus-lifecycle wiring is written once, in runtime/run.py's ZeroRun; each door builds a ZeroRun.
    for path in [*(PACKAGE / "trainer").glob("*.py"), *(PACKAGE / "fabric").glob("*.py")]:
        assert _calls(path) & {"ZeroSession", "CheckpointLifecycle"} == set(), f"{path.name}: build a ZeroRun instead"
    for door in DOORS:
        calls = _calls(PACKAGE / door)
        assert "ZeroRun" in calls and calls & {"SignalBoundary", "Monitor", "open_failure_channel"} == set(), door
    run_text = (PACKAGE / "runtime" / "run.py").read_text()
    assert run_text.count("ZeroSession(") == 1 and run_text.count("CheckpointLifecycle(") == 1
