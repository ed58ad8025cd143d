"""The import layering of .importlinter holds: cli/bench > driver | executor > diagnostics > engine > common.

import-linter reads a package from one directory, while setup.py's package_dir maps the top-level
folders (driver/, executor/, ...) into `megascale`; so the check runs on a copy of the tree laid out
as it installs, found through the installed package itself."""
from __future__ import annotations

import importlib.machinery
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


def installed_elsewhere(name: str) -> bool:
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    return spec is not None and spec.origin is not None  # a bare folder (tests/driver) is no package


def test_the_repository_root_shadows_no_installed_package():
    """`python -m ...` run from the repository root puts it on sys.path, where each mapped folder is a package
    by its bare name: none may displace an installed package of that name (Hugging Face's `kernels`, which
    transformers imports, did)."""
    clashes = [name for name in MAPPED if installed_elsewhere(name)]
    for name in clashes:
        found = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__file__)"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert found.returncode == 0, found.stderr[-2000:]
        assert not Path(found.stdout.strip()).resolve().is_relative_to(ROOT / name), f"{name}: {found.stdout}"


def test_transformers_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    imported = subprocess.run([sys.executable, "-c", "import transformers.models.llama.modeling_llama"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr[-2000:]
