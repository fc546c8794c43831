"""The top-level conf/ and recipes/ are the ones the package uses and the wheel ships."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_zero
from lightning_zero.hydra_config import RECIPES_DIR, available_recipes

ROOT = Path(__file__).resolve().parents[1]


def test_package_reads_the_top_level_folders():
    package = Path(lightning_zero.__file__).resolve().parent
    assert (package / "conf").resolve() == (ROOT / "conf").resolve()
    assert RECIPES_DIR.resolve() == (ROOT / "recipes").resolve()
    assert set(available_recipes()) == {path.stem for path in (ROOT / "recipes").glob("*.yaml")}


@pytest.mark.slow
def test_wheel_ships_conf_and_recipes(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert f"lightning_zero/conf/{path.relative_to(ROOT / 'conf').as_posix()}" in names
    for path in (ROOT / "recipes").rglob("*.yaml"):
        assert f"lightning_zero/recipes/{path.relative_to(ROOT / 'recipes').as_posix()}" in names
    assert "lightning_zero/conf/__init__.py" in names
