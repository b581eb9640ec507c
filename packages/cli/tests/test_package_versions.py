"""Every package has its own pyproject.toml whose name and version equal the wheel's
(python_distribution in its BUILD), and its layering rule allows only what DESIGN.md says."""

import pathlib
import re
import tomllib

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path(__file__).resolve().parents]
            if (p / "packages" / "config" / "BUILD").exists())
ALLOWED = {
    "config": set(), "module": {"config"}, "kernels": set(),
    "layers": {"module", "config", "kernels"}, "mesh": {"config"},
    "checkpoint": {"config", "mesh"}, "text": {"config"},
    "resilience": {"config", "mesh", "checkpoint"}, "launch": {"config"},
    "runtime": {"config", "module", "mesh", "checkpoint", "resilience", "text"},
    "aot": {"config", "module", "mesh", "checkpoint", "runtime"},
    "decoding": {"text"},
    "inference": {"config", "module", "kernels", "layers", "mesh", "checkpoint", "text",
                  "decoding"},
    "serve": {"config", "module", "layers", "mesh", "checkpoint", "text", "decoding",
              "inference"},
    "families": {"config", "module", "layers"},
    "interop": {"config", "module", "layers", "families", "mesh", "checkpoint", "inference",
                "text"},
}


def test_versions_match_and_layering_rules_are_declared():
    packages = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "BUILD").exists())
    assert {"config", "module", "layers", "mesh", "checkpoint", "text", "resilience", "runtime",
            "aot", "launch", "decoding", "inference", "serve", "families", "interop"} <= set(
        packages)
    for name in packages:
        build = (ROOT / "packages" / name / "BUILD").read_text()
        project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
        assert project["project"]["name"] == f"jaxlearn-{name}"
        version = re.search(r'version="([^"]+)"', build).group(1)
        assert project["project"]["version"] == version, name
        rule = re.search(r"__dependencies_rules__\(\s*\((.*?)\),\s*\)", build, re.S).group(1)
        allowed = set(re.findall(r'"//packages/(\w+)/\*\*"', rule)) - {name}
        if name in ALLOWED:
            assert allowed == ALLOWED[name], (name, allowed)
        assert rule.rstrip().rstrip(",").endswith('"!*"'), name
