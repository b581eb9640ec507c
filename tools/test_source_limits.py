"""Size limits over every package's sources (packages/*/src): no package over 4,000 lines,
no file over 600 lines, no function or method over 80 lines (decorators excluded, docstring
included). ALLOWED lists the known exceptions, file by file or function by function, as
`<package>/<path under jaxlearn/<package>>[:<qualified name>]`; an entry that no longer
exceeds its limit fails too, so that the list only shrinks."""

import ast
import pathlib

import pytest

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path(__file__).resolve().parents]
            if (p / "packages" / "config" / "BUILD").exists())
MAX_PACKAGE_LINES = 4000
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
ALLOWED: set[str] = set()


def source_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """`<package>/<path>` -> file, for every .py under packages/<package>/src/jaxlearn/."""
    out = {}
    for path in sorted(root.glob("packages/*/src/jaxlearn/*/**/*.py")):
        package = path.relative_to(root).parts[1]
        inner = path.relative_to(root / "packages" / package / "src" / "jaxlearn" / package)
        out[f"{package}/{inner.as_posix()}"] = path
    return out


def function_lengths(text: str) -> dict[str, int]:
    """Qualified name ("f", "Class.method", "outer.inner") -> lines, for every function and
    method in a module's source `text`."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[name] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(text), "")
    return lengths


def violations(root: pathlib.Path) -> dict[str, str]:
    """What exceeds a limit: {key: "N lines (limit L)"}; package keys are `<package>/`."""
    found: dict[str, str] = {}
    per_package: dict[str, int] = {}
    for key, path in source_files(root).items():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        package = key.split("/", 1)[0]
        per_package[package] = per_package.get(package, 0) + lines
        if lines > MAX_FILE_LINES:
            found[key] = f"{lines} lines (limit {MAX_FILE_LINES})"
        for name, n in function_lengths(text).items():
            if n > MAX_FUNCTION_LINES:
                found[f"{key}:{name}"] = f"{n} lines (limit {MAX_FUNCTION_LINES})"
    for package, lines in per_package.items():
        if lines > MAX_PACKAGE_LINES:
            found[f"{package}/"] = f"{lines} source lines (limit {MAX_PACKAGE_LINES})"
    return found


def test_every_package_has_sources_here():
    packages = {p.name for p in (ROOT / "packages").iterdir() if (p / "BUILD").exists()}
    with_sources = {key.split("/", 1)[0] for key in source_files(ROOT)}
    assert packages and with_sources == packages, sorted(packages - with_sources)


def test_sizes_within_limits():
    over = {k: v for k, v in violations(ROOT).items() if k not in ALLOWED}
    assert not over, "over the size limits (split them into well-named pieces):\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(over.items()))


def test_allowed_exceptions_are_still_needed():
    stale = sorted(ALLOWED - set(violations(ROOT)))
    assert not stale, f"within the limits now: remove from ALLOWED: {stale}"


def _package(root: pathlib.Path, name: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "packages" / name / "src" / "jaxlearn" / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (body_lines - 1)


@pytest.mark.parametrize("body,key", [
    (_function("f", 80), None),
    (_function("f", 81), "big/m.py:f"),
    ("class C:\n" + _function("method", 81, "    "), "big/m.py:C.method"),
    ("def outer():\n" + _function("inner", 81, "    "), "big/m.py:outer.inner"),
    ("x = 1\n" * 600, None),
    ("x = 1\n" * 601, "big/m.py"),
])
def test_limits_are_measured(tmp_path, body, key):
    _package(tmp_path, "big", {"m.py": body})
    found = violations(tmp_path)
    assert (set(found) - {"big/m.py:outer"}) == ({key} if key else set()), found


def test_package_total_is_measured(tmp_path):
    _package(tmp_path, "wide", {f"sub/m{i}.py": "x = 1\n" * 500 for i in range(8)})
    assert violations(tmp_path) == {}
    _package(tmp_path, "wide", {"sub/m8.py": "x = 1\n"})
    assert violations(tmp_path) == {"wide/": "4001 source lines (limit 4000)"}
