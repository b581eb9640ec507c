"""Package contract: layering (imports only jaxlearn.config), public API, version."""

from __future__ import annotations

import ast
import pathlib
import re

import jaxlearn.mesh as mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {"jaxlearn.config", "jaxlearn.mesh"}


def _jaxlearn_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found |= {".".join(n.split(".")[:2]) for n in names if n.startswith("jaxlearn")}
    return found


def test_imports_only_config():
    files = list((ROOT / "src").rglob("*.py")) + list((ROOT / "tests").rglob("*.py"))
    assert files
    for path in files:
        bad = _jaxlearn_imports(path) - ALLOWED
        assert not bad, f"{path} imports {bad}; jaxlearn.mesh may import only jaxlearn.config"


def test_public_api_exported():
    for name in mesh.__all__:
        assert hasattr(mesh, name), name
    assert len(set(mesh.__all__)) == len(mesh.__all__)


def test_version_matches_build():
    build = (ROOT / "BUILD").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    v_build = re.search(r'version="([^"]+)"', build)
    v_py = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert v_build and v_py and v_build.group(1) == v_py.group(1)
