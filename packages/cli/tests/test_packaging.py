"""Every packages/<name>/pyproject.toml installs what its sources need, and no more.

- third-party `dependencies` are exactly the distributions the package's sources import
  (modules mapped to distributions with third_party/python/BUILD's module_mapping), each a
  range (no `==` pin, no jax extra) that admits the version pinned in the lockfile;
- jaxlearn `dependencies` are exactly the jaxlearn packages the sources import, each allowed
  by the package's layering rule in its BUILD and admitting that package's version;
- packages that need jax (directly or through a jaxlearn dependency) offer the `cpu`,
  `cuda` and `tpu` extras; the build uses setuptools on the `src/` layout with the
  `jaxlearn` namespace, and Pants builds the wheel from this pyproject;
- the cli declares the `jaxlearn` console script, and its target returns an exit code;
- `dependencies` are dynamic: every package's identical setup.py hands them to setuptools
  through packages/setup_support.py, and the metadata setuptools builds names each jaxlearn
  dependency by a `file://` direct reference to its sibling folder inside a checkout, and by
  plain name away from one or with JAXLEARN_DEPENDENCIES=by-name (as the Pants wheels are).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
from typing import Any

import pytest
import setuptools.build_meta
from packaging.requirements import Requirement  # pants: no-infer-dep (pytest requires it)
from packaging.utils import canonicalize_name  # pants: no-infer-dep

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path(__file__).resolve().parents]
            if (p / "packages" / "config" / "BUILD").exists())
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
BACKEND = setuptools.build_meta.__name__  # each pyproject's build-backend
JAX_EXTRAS = {"cpu": "cpu", "cuda": "cuda12", "tpu": "tpu"}  # extra name -> jax's extra


def locked_versions() -> dict[str, str]:
    """{canonical distribution name: version} of every distribution in the lockfile."""
    text = (ROOT / "third_party" / "python" / "default.lock").read_text()
    lock = json.loads("\n".join(ln for ln in text.splitlines() if not ln.startswith("//")))
    return {canonicalize_name(r["project_name"]): r["version"]
            for resolve in lock["locked_resolves"] for r in resolve["locked_requirements"]}


def module_mapping() -> dict[str, str]:
    """{top-level module: canonical distribution} from third_party/python/BUILD."""
    tree = ast.parse((ROOT / "third_party" / "python" / "BUILD").read_text())
    mapping: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "module_mapping":
            for dist, modules in ast.literal_eval(node.value).items():
                mapping.update({m.split(".")[0]: canonicalize_name(dist) for m in modules})
    return mapping


def source_imports(name: str) -> tuple[dict[str, str], set[str]]:
    """({third-party top-level module: 'file:line' of one import}, {jaxlearn package})
    imported anywhere in packages/<name>/src, function bodies included."""
    third: dict[str, str] = {}
    first: set[str] = set()
    for path in sorted((ROOT / "packages" / name / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                if node.module == "jaxlearn":
                    modules = [f"jaxlearn.{a.name}" for a in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "jaxlearn":
                    first.add(module.split(".")[1])
                elif top not in sys.stdlib_module_names and top != "__future__":
                    third.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    first.discard(name)
    return third, first


def build_rule_allows(name: str) -> set[str]:
    """The jaxlearn packages packages/<name>/BUILD's layering rule lets it import."""
    build = (ROOT / "packages" / name / "BUILD").read_text()
    rule = re.search(r"__dependencies_rules__\(\s*\((.*?)\),\s*\)", build, re.S)
    assert rule, f"packages/{name}/BUILD: no __dependencies_rules__"
    return set(re.findall(r'"//packages/(\w+)/\*\*"', rule.group(1))) - {name}


def pyproject(name: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())


def declared(name: str) -> list[str]:
    """packages/<name>/pyproject.toml's [tool.jaxlearn] dependencies, as written."""
    return list(pyproject(name)["tool"]["jaxlearn"]["dependencies"])


def dependency_problems(name: str, dependencies: list[str]) -> list[str]:
    """What is wrong with `dependencies` (pyproject's [tool.jaxlearn] list) for package
    `name`, one line each; [] when they match its sources, lockfile and BUILD."""
    where = f"packages/{name}/pyproject.toml"
    third_imports, first_imports = source_imports(name)
    mapping, locked = module_mapping(), locked_versions()
    wanted = {mapping.get(m, canonicalize_name(m)): at for m, at in third_imports.items()}
    problems, declared_third, declared_first = [], set(), set()
    for text in dependencies:
        req = Requirement(text)
        dist = canonicalize_name(req.name)
        if dist.startswith("jaxlearn-"):
            dep = dist.removeprefix("jaxlearn-")
            declared_first.add(dep)
            if dep not in build_rule_allows(name):
                problems.append(f"{where}: {text!r}: packages/{name}/BUILD does not allow {dep}")
            elif not req.specifier.contains(pyproject(dep)["project"]["version"]):
                problems.append(f"{where}: {text!r} excludes jaxlearn-{dep}'s own version")
            continue
        declared_third.add(dist)
        if any(s.operator in ("==", "===") for s in req.specifier) or not req.specifier:
            problems.append(f"{where}: {text!r}: give a range, not a pin or a bare name")
        if dist == "jax" and req.extras:
            problems.append(f"{where}: {text!r}: depend on plain jax; extras choose the jaxlib")
        if dist not in locked:
            problems.append(f"{where}: {text!r}: {dist} is not in third_party/python/default.lock")
        elif not req.specifier.contains(locked[dist]):
            problems.append(f"{where}: {text!r} excludes the locked {dist}=={locked[dist]}")
    for dist in sorted(set(wanted) - declared_third):
        problems.append(f"{where}: missing {dist} (imported at {wanted[dist]})")
    for dist in sorted(declared_third - set(wanted)):
        problems.append(f"{where}: {dist} is declared but no source of {name} imports it")
    for dep in sorted(first_imports - declared_first):
        problems.append(f"{where}: missing jaxlearn-{dep} (packages/{name}/src imports it)")
    for dep in sorted(declared_first - first_imports):
        problems.append(f"{where}: jaxlearn-{dep} is declared but packages/{name}/src never "
                        "imports it")
    return problems


def needs_jax(name: str) -> bool:
    """Whether `name` or any jaxlearn package it imports (transitively) imports jax."""
    third, first = source_imports(name)
    return "jax" in third or any(needs_jax(dep) for dep in first)


@pytest.mark.parametrize("name", PACKAGES)
def test_dependencies_match_imports_lockfile_and_layering(name):
    assert dependency_problems(name, declared(name)) == []


def test_problems_are_reported_for_a_wrong_declaration():
    deps = [d for d in declared("layers") if not d.startswith("numpy")]
    deps = [d.replace("jax>=0.10,<0.11", "jax[cpu]==0.10.2") for d in deps]
    deps += ["jaxlearn-mesh>=0.1,<0.2", "optax>=0.3", "jaxlearn-config>=0.2"]
    problems = dependency_problems("layers", deps)
    text = "\n".join(problems)
    assert "'jax[cpu]==0.10.2': give a range" in text
    assert "'jax[cpu]==0.10.2': depend on plain jax" in text
    assert "missing numpy (imported at packages/layers/src/jaxlearn/layers/" in text
    assert "packages/layers/BUILD does not allow mesh" in text
    assert "'optax>=0.3' excludes the locked optax==" in text
    assert "optax is declared but no source of layers imports it" in text
    assert "'jaxlearn-config>=0.2' excludes jaxlearn-config's own version" in text


@pytest.mark.parametrize("name", PACKAGES)
def test_extras_build_system_and_wheel_target(name):
    data = pyproject(name)
    extras = data["project"].get("optional-dependencies", {})
    jax_specs = {str(Requirement(d).specifier) for d in declared(name)
                 if canonicalize_name(Requirement(d).name) == "jax"}
    if needs_jax(name):
        for extra, jax_extra in JAX_EXTRAS.items():
            reqs = [Requirement(r) for r in extras.get(extra, [])]
            assert [(r.name, r.extras) for r in reqs] == [("jax", {jax_extra})], (name, extra)
            assert jax_specs in (set(), {str(reqs[0].specifier)}), (name, extra, jax_specs)
    else:
        assert not set(JAX_EXTRAS) & set(extras), f"{name} needs no jax, yet offers {extras}"
    locked = locked_versions()
    for extra in set(extras) - set(JAX_EXTRAS):  # optional back-ends, e.g. text's `hf`
        for req in map(Requirement, extras[extra]):
            version = locked.get(canonicalize_name(req.name))
            assert version and req.specifier.contains(version), (name, extra, str(req), version)
    assert data["build-system"]["build-backend"] == "setuptools.build_meta", name
    assert any(r.startswith("setuptools") for r in data["build-system"]["requires"]), name
    find = data["tool"]["setuptools"]["packages"]["find"]
    assert find["where"] == ["src"] and find["namespaces"] is True, name
    assert find["include"] == [f"jaxlearn.{name}", f"jaxlearn.{name}.*"], name
    assert not (ROOT / "packages" / name / "src" / "jaxlearn" / "__init__.py").exists(), name
    build = (ROOT / "packages" / name / "BUILD").read_text()
    dist = re.search(r"python_distribution\((.*?)\n\)", build, re.S)
    assert dist and "generate_setup=False" in dist.group(1), f"{name}: wheel not from pyproject"
    assert '":package_files"' in dist.group(1), f"{name}: the wheel needs its pyproject"


def test_cli_console_script_runs_and_returns_an_exit_code():
    scripts = pyproject("cli")["project"]["scripts"]
    assert scripts == {"jaxlearn": "jaxlearn.cli.main:main"}
    for name in PACKAGES:
        if name != "cli":
            assert "scripts" not in pyproject(name)["project"], name
    from jaxlearn.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["experiments"])
    assert code == 0 and "tiny-llama" in out.getvalue()


def test_readme_layering_table_matches_the_build_rules():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    rows = re.findall(r"^\| `(\w+)` \| .* \| ([^|]+) \|$", layout, re.M)
    assert sorted(name for name, _ in rows) == PACKAGES
    for name, may_import in rows:
        listed = {"nothing": set(), "every package above": set(PACKAGES) - {name}}.get(
            may_import.strip(), {x.strip() for x in may_import.split(",")})
        assert listed == build_rule_allows(name), (name, listed, build_rule_allows(name))


@pytest.mark.parametrize("name", PACKAGES)
def test_dependencies_are_dynamic_through_the_shared_setup_py(name):
    project = pyproject(name)["project"]
    assert project.get("dynamic") == ["dependencies"] and "dependencies" not in project, name
    setup_py = ROOT / "packages" / name / "setup.py"
    assert setup_py.read_text() == (ROOT / "packages" / "config" / "setup.py").read_text(), name
    assert "from setup_support import setup" in setup_py.read_text()
    build = (ROOT / "packages" / name / "BUILD").read_text()
    dist = re.search(r"python_distribution\((.*?)\n\)", build, re.S)
    assert dist, name
    assert '"//packages:setup_support"' in dist.group(1), f"{name}: the wheel needs the hook"
    assert 'env_vars=["JAXLEARN_DEPENDENCIES=by-name"]' in dist.group(1), name
    files = re.search(r'files\(name="package_files", sources=\[(.*?)\]', build, re.S)
    assert files and '"setup.py"' in files.group(1), f"{name}: package_files lacks setup.py"


def checkout_copy(root: pathlib.Path, names: list[str]) -> pathlib.Path:
    """root/packages holding setup_support.py and a copy of each named package (no tests)."""
    (root / "packages").mkdir()
    shutil.copy(ROOT / "packages" / "setup_support.py", root / "packages")
    skip = shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__")
    for name in names:
        shutil.copytree(ROOT / "packages" / name, root / "packages" / name, ignore=skip)
    return root / "packages"


def built_requirements(project_dir: pathlib.Path, mode: str | None = None) -> list[str]:
    """The Requires-Dist lines (extras' excluded) of the wheel metadata setuptools builds in
    project_dir through its PEP 517 hook, in a fresh interpreter."""
    out = project_dir.parent / f"metadata-{project_dir.name}-{mode}"
    out.mkdir()
    code = (f"import {BACKEND} as b, sys; "
            f"print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    env = {k: v for k, v in os.environ.items() if k != "JAXLEARN_DEPENDENCIES"}
    env.update({"JAXLEARN_DEPENDENCIES": mode} if mode else {})
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=project_dir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metadata = (out / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    return [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
            if line.startswith("Requires-Dist: ") and "extra ==" not in line]


def expected_requirements(name: str, packages: pathlib.Path, siblings: set[str]) -> list[str]:
    """packages/<name>'s declared dependencies as METADATA writes them, with each jaxlearn
    package in `siblings` as a direct reference to its folder under `packages`."""
    out = []
    for req in map(Requirement, declared(name)):
        dep = req.name.removeprefix("jaxlearn-")
        sibling = req.name.startswith("jaxlearn-") and dep in siblings
        out.append(f"{req.name} @ {(packages / dep).resolve().as_uri()}" if sibling else str(req))
    return out


def test_checkout_build_points_jaxlearn_dependencies_at_sibling_folders(tmp_path):
    packages = checkout_copy(tmp_path, ["config", "module", "layers"])
    in_checkout = built_requirements(packages / "layers")
    assert in_checkout == expected_requirements("layers", packages, {"config", "module"})
    assert sum(" @ file:///" in r for r in in_checkout) == 2, in_checkout
    plain = expected_requirements("layers", packages, set())
    assert built_requirements(packages / "layers", "by-name") == plain
    assert not any("file:" in r for r in plain), plain


def test_build_away_from_a_checkout_keeps_plain_names(tmp_path):
    packages = checkout_copy(tmp_path, ["layers"])  # no sibling config/ or module/
    assert built_requirements(packages / "layers") == expected_requirements(
        "layers", packages, set())


def test_setup_support_rejects_a_bad_mode_and_static_dependencies(tmp_path):
    packages = checkout_copy(tmp_path, ["config", "module"])
    spec = importlib.util.spec_from_file_location("setup_support", packages / "setup_support.py")
    assert spec and spec.loader
    support = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(support)
    with pytest.raises(ValueError, match=r"JAXLEARN_DEPENDENCIES='names': expected one of "
                                         r"by-name, from-checkout"):
        support.install_requires(packages / "module", {"JAXLEARN_DEPENDENCIES": "names"})
    requirements = support.install_requires(packages / "module", {})
    assert list(map(str, map(Requirement, requirements))) == expected_requirements(
        "module", packages, {"config"})
    path = packages / "module" / "pyproject.toml"
    path.write_text(path.read_text().replace('dynamic = ["dependencies"]', "dependencies = []"))
    with pytest.raises(ValueError, match=r"module/pyproject.toml: \[project\] dependencies must "
                                         r"be dynamic"):
        support.install_requires(packages / "module", {})
