"""Policies passed whole ([Note: policies] in config.py): no function under src/lightning_zero takes
more than ``MAX_PARAMETERS`` parameters, but the user-facing constructors and keyword entry points
whose flat keywords Lightning users expect (each named below with where it is documented).

``python tests/test_signatures.py`` prints the widest signatures and the count above the limit.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightning_zero"
MAX_PARAMETERS = 10

# (path under the package, function) -> where its flat keywords are promised to users
USER_FACING = {
    ("trainer/strategy.py", "__init__"): "ZeroStrategy's keywords: design.md section 2, docs/cli.md",
    ("fabric/strategy.py", "__init__"): "ZeroFabricStrategy's keywords: docs/fabric.md",
    ("data/datamodule.py", "__init__"): "ZeroDataModule's keywords: the data config group, docs/cli.md",
    ("planner/search.py", "search_layouts"): "the search's keywords, docs/planner.md (it builds what `search` takes)",
}


def parameter_counts() -> list[tuple[int, str, str]]:
    """``(parameters, path:line, name)`` of every function and method (``self``/``cls`` not counted;
    ``*args`` and ``**kwargs`` count one each), widest first."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
                rows.append((count, f"{where}:{node.lineno}", node.name))
    return sorted(rows, reverse=True)


def _internal(rows):
    return [row for row in rows if (row[1].split(":")[0], row[2]) not in USER_FACING]


def test_no_internal_function_takes_more_than_ten_parameters():
    wide = [row for row in _internal(parameter_counts()) if row[0] > MAX_PARAMETERS]
    assert not wide, f"group these parameters into a policy or a small frozen object: {wide}"


def test_user_facing_exceptions_still_exist():
    found = {(row[1].split(":")[0], row[2]) for row in parameter_counts()}
    assert set(USER_FACING) <= found, set(USER_FACING) - found


if __name__ == "__main__":
    rows = parameter_counts()
    internal = _internal(rows)
    print(f"largest internal: {internal[0][0]}; internal above {MAX_PARAMETERS}:",
          sum(row[0] > MAX_PARAMETERS for row in internal))  # fmt: skip
    print(f"all functions (user-facing included): largest {rows[0][0]}; above {MAX_PARAMETERS}:",
          sum(row[0] > MAX_PARAMETERS for row in rows))  # fmt: skip
    for count, where, name in rows[:20]:
        print(f"{count:3d}  {where}  {name}")
