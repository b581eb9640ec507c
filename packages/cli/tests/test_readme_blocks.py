"""Every ```python block in README.md, packages/*/README.md and docs/*.md runs as written.

Each block runs on its own in a fresh interpreter (a subprocess, so no block sees another's
names or jax state) with 8 fake CPU devices and every package's `src/` on PYTHONPATH. A
block is exempt only when the last non-blank line before its fence contains `not-run:`
followed by the reason.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path(__file__).resolve().parents]
            if (p / "packages" / "config" / "BUILD").exists())
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
EXEMPT = re.compile(r"not-run:\s*\S")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    path: pathlib.Path  # the Markdown file
    line: int  # 1-based line of the opening fence
    code: str
    exempt: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files(root: pathlib.Path) -> list[pathlib.Path]:
    """README.md, packages/*/README.md and docs/*.md under `root`, sorted."""
    found = [root / "README.md", *root.glob("packages/*/README.md"), *root.glob("docs/*.md")]
    return sorted(p for p in found if p.is_file())


def python_blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of one Markdown file, in order, with their exemption flag."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = [ln for ln in text[: match.start()].splitlines() if ln.strip()]
        exempt = bool(before) and EXEMPT.search(before[-1]) is not None
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(path, line, match.group(1), exempt))
    return blocks


def run_block(block: Block, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Runs one block in a fresh interpreter: 8 fake CPU devices, all package srcs importable."""
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([*srcs, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", block.code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


ALL_BLOCKS = [b for path in markdown_files(ROOT) for b in python_blocks(path)]


def test_blocks_are_found_in_top_level_and_package_readmes():
    files = {b.path.relative_to(ROOT).as_posix() for b in ALL_BLOCKS}
    assert "packages/layers/README.md" in files and "packages/config/README.md" in files, files
    assert len(ALL_BLOCKS) >= 10, [b.where for b in ALL_BLOCKS]


def test_parser_reads_fences_and_exemptions(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("# t\n\n```python\nx = 1\n```\n\nnot-run: needs a TPU\n```python\nraise "
                   "SystemExit(3)\n```\n\n```bash\necho no\n```\nnot-run:\n```python\ny = 2\n```\n")
    blocks = python_blocks(doc)
    assert [(b.line, b.code, b.exempt) for b in blocks] == [
        (3, "x = 1\n", False), (8, "raise SystemExit(3)\n", True), (16, "y = 2\n", False)]


def test_runner_reports_a_failing_block(tmp_path):
    bad = Block(tmp_path / "README.md", 1, "import jax\nassert jax.device_count() == 8\n"
                "undefined_name\n", False)
    result = run_block(bad, tmp_path)
    assert result.returncode != 0 and "NameError: name 'undefined_name'" in result.stderr


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if not b.exempt],
                         ids=lambda b: b.where)
def test_readme_block_runs(block, tmp_path):
    result = run_block(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.where}: the python block exits {result.returncode}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}")
