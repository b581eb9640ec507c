"""jaxlearn.config stands alone: it imports no jax and no other jaxlearn package."""

import ast
import os
import pathlib
import subprocess
import sys

import jaxlearn.config

SRC = pathlib.Path(jaxlearn.config.__file__).parents[2]
PACKAGE = pathlib.Path(jaxlearn.config.__file__).parent

_CHECK = """
import sys
import jaxlearn.config
bad = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "numpy")
    or (m.startswith("jaxlearn.") and not m.startswith("jaxlearn.config"))
)
print(",".join(bad))
"""


def test_import_does_not_import_jax_or_other_jaxlearn_packages():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def _imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_sources_import_only_the_standard_library_and_jaxlearn_config():
    sources = sorted(PACKAGE.glob("*.py"))
    assert len(sources) >= 6
    for path in sources:
        for name in _imported_modules(path):
            top = name.split(".")[0]
            if top == "jaxlearn":
                assert name.startswith("jaxlearn.config"), f"{path.name} imports {name}"
            else:
                assert (
                    top in sys.stdlib_module_names or top == "__future__"
                ), f"{path.name} imports third-party {name}"
