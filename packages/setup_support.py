"""The `install_requires` of every jaxlearn distribution, shared by each packages/<name>/setup.py.

Each packages/<name>/pyproject.toml declares `dynamic = ["dependencies"]` and lists them under
`[tool.jaxlearn] dependencies`: third-party ranges and jaxlearn packages by name
(`jaxlearn-config>=0.1,<0.2`). setuptools runs ./setup.py, which calls `setup()` here:

- built inside a checkout (`pip install ./packages/layers`), each `jaxlearn-<dep>` whose
  sibling folder packages/<dep> holds the pyproject of `jaxlearn-<dep>` becomes the PEP 508
  direct reference `jaxlearn-<dep> @ file:///<checkout>/packages/<dep>`, so pip installs it
  from the same checkout (and that package's own jaxlearn dependencies likewise);
- built anywhere else, or with JAXLEARN_DEPENDENCIES=by-name in the environment (every
  python_distribution in packages/*/BUILD sets it, so the wheels from `./pants package ::`
  carry plain names), the list goes into the wheel exactly as written.

Checked by packages/cli/tests/test_packaging.py (metadata built both ways) and, end to end, by
tools/check_wheels.sh.
"""

from __future__ import annotations

import os
import pathlib
import re
import tomllib
from collections.abc import Mapping

MODE_VARIABLE = "JAXLEARN_DEPENDENCIES"
MODES = ("by-name", "from-checkout")
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _project_name(pyproject: pathlib.Path) -> str:
    return str(tomllib.loads(pyproject.read_text()).get("project", {}).get("name", ""))


def declared_dependencies(project_dir: pathlib.Path) -> list[str]:
    """`[tool.jaxlearn] dependencies` of project_dir/pyproject.toml, as written."""
    path = project_dir / "pyproject.toml"
    data = tomllib.loads(path.read_text())
    deps = data.get("tool", {}).get("jaxlearn", {}).get("dependencies")
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise ValueError(f"{path}: [tool.jaxlearn] dependencies must be a list of strings")
    if "dependencies" in data.get("project", {}):
        raise ValueError(f"{path}: [project] dependencies must be dynamic; list them under "
                         "[tool.jaxlearn] dependencies")
    return deps


def install_requires(project_dir: pathlib.Path,
                     environ: Mapping[str, str] = os.environ) -> list[str]:
    """The requirements setuptools writes into the metadata of the project in project_dir:
    `declared_dependencies`, with each jaxlearn package whose sibling folder is in this
    checkout turned into a `file://` direct reference (unless JAXLEARN_DEPENDENCIES=by-name)."""
    mode = environ.get(MODE_VARIABLE, "from-checkout")
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode!r}: expected one of {', '.join(MODES)}")
    requirements = []
    for text in declared_dependencies(project_dir):
        match = _NAME.match(text)
        if not match:
            raise ValueError(f"{project_dir / 'pyproject.toml'}: {text!r} is not a requirement")
        name = match.group(1)
        sibling = project_dir.parent / name.removeprefix("jaxlearn-")
        if (mode == "from-checkout" and name.startswith("jaxlearn-")
                and (sibling / "pyproject.toml").is_file()
                and _project_name(sibling / "pyproject.toml") == name):
            requirements.append(f"{name} @ {sibling.resolve().as_uri()}")
        else:
            requirements.append(text)
    return requirements


def setup(project_dir: pathlib.Path) -> None:
    """setuptools.setup for the project in project_dir (metadata from its pyproject.toml)."""
    import setuptools  # type: ignore[import-untyped]  # no stubs in the lockfile

    setuptools.setup(install_requires=install_requires(project_dir))
