"""Regenerates the "## Performance" section of the top-level README.md from
tools/bench/results/summary.md (run after `run.sh` / `run.sh --report`).

    python tools/bench/readme.py          # rewrite README.md in place
    python tools/bench/readme.py --check  # exit 1 if README.md is out of date

The section keeps its hand-written intro (up to the first "####" heading); everything
from summary.md's "### Targets" heading on is copied with headings one level deeper and
plot paths made relative to the repository root.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SUMMARY = ROOT / "tools" / "bench" / "results" / "summary.md"


def section(summary: str) -> str:
    body = summary[summary.index("### Targets") :]
    body = re.sub(r"^### ", "#### ", body, flags=re.M)
    body = re.sub(r"\]\((\w+\.png)\)", r"](tools/bench/results/\1)", body)
    return body.rstrip() + "\n"


def render(readme: str, summary: str) -> str:
    start = readme.index("## Performance")
    first = readme.index("\n####", start) + 1
    end = readme.index("\n## ", first) + 1
    return readme[:first] + section(summary) + "\n" + readme[end:]


def main() -> int:
    old = README.read_text()
    new = render(old, SUMMARY.read_text())
    if "--check" in sys.argv:
        if new != old:
            print("README.md's Performance section is out of date: run tools/bench/readme.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
