"""The import layering of .importlinter holds: cli/bench > driver | executor > diagnostics > engine > common.

import-linter reads a package from one directory, while setup.py's package_dir maps the top-level
folders (driver/, executor/, ...) into `megascale`; so the check runs on a copy of the tree laid out
as it installs, found through the installed package itself."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPED = ("driver", "executor", "diagnostics", "kernels", "data")


@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("layout")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(Path(importlib.util.find_spec("megascale").origin).parent, tree / "megascale", ignore=ignore)
    for name in MAPPED:
        source = importlib.util.find_spec(f"megascale.{name}").submodule_search_locations[0]
        shutil.copytree(source, tree / "megascale" / name, ignore=ignore)
    return tree


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    linter = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(linter), str(ROOT / ".importlinter"), "--no-cache"], cwd=tree, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def test_the_tree_keeps_its_layers(installed_tree):
    result = lint_imports(installed_tree)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_an_engine_module_importing_the_driver_breaks_the_contract(installed_tree, tmp_path):
    broken = tmp_path / "tree"
    shutil.copytree(installed_tree, broken)
    (broken / "megascale" / "common" / "shortcut.py").write_text("from megascale.driver import reconcile\n")
    result = lint_imports(broken)
    assert result.returncode != 0 and "megascale.common.shortcut -> megascale.driver.reconcile" in result.stdout
