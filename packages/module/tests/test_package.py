"""Package hygiene: version in sync, layering (imports only jaxlearn.config), no flax import."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "jaxlearn" / "module"


def test_versions_match() -> None:
    build = re.search(r'version="([^"]+)"', (ROOT / "BUILD").read_text())
    project = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert build and project and build.group(1) == project.group(1)


def imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_sources_import_only_config_and_module() -> None:
    for path in sorted(SRC.glob("*.py")):
        for name in imported_modules(path):
            if name.startswith("jaxlearn"):
                allowed = name.startswith(("jaxlearn.config", "jaxlearn.module"))
                assert allowed, f"{path.name} imports {name}"
            if name.startswith("flax"):
                assert path.name == "flax_adapters.py", f"{path.name} imports {name}"


def test_package_import_does_not_pull_in_flax() -> None:
    code = "import sys, jaxlearn.module; assert 'flax' not in sys.modules, 'flax imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
