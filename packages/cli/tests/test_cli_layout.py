"""The cli modules parse flags and call libraries: a subcommand module imports `common` and
libraries, never `main` or another subcommand's module (so there is no import cycle among
them), and no module finds files relative to its own location."""

from __future__ import annotations

import ast
import pathlib

import jaxlearn.cli

SRC = pathlib.Path(jaxlearn.cli.__file__).parent
# Imports of another subcommand's internals that are allowed: none.
KNOWN: set[tuple[str, str]] = set()


def _cli_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxlearn.cli":
                found |= {a.name for a in node.names}
            elif node.module.startswith("jaxlearn.cli."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names
                      if a.name.startswith("jaxlearn.cli.")}
    return found


def test_subcommand_modules_import_only_common():
    modules = {p.stem: _cli_imports(p) for p in SRC.glob("*.py")}
    assert {"main", "common", "train_cmd", "launch_cmd", "aot_cmd"} <= set(modules)
    assert modules["common"] == set()
    assert modules["__main__"] == {"main"}
    for name, imports in modules.items():
        if name in ("main", "__main__", "__init__"):
            continue
        others = {m for m in imports - {"common"} if (name, m) not in KNOWN}
        assert not others, f"cli/{name}.py imports cli modules {sorted(others)}"
    assert "main" not in {m for name, imports in modules.items() if name != "__main__"
                          for m in imports}


def test_no_module_climbs_out_of_the_installed_package():
    for path in SRC.glob("*.py"):
        text = path.read_text()
        assert "os.pardir" not in text and "__file__" not in text, path.name
