"""Counts passed/failed tests from pytest's per-file summary lines in a Pants log.

With `[test] output = "all"` Pants prints each pytest process's closing line, e.g.
`=== 12 passed, 1 failed, 2 skipped in 3.1s ===` or `12 passed in 3.1s`. This sums them.
"""

import re
import sys

COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
LINE = re.compile(r"^\s*=*\s*(\d+ (passed|failed|errors?|skipped)[^\n]*) in [\d.]+s")


def main(path: str) -> None:
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    with open(path, errors="replace") as f:
        for line in f:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if not LINE.match(line):
                continue
            for n, kind in COUNT.findall(line):
                key = "error" if kind.startswith("error") else kind
                if key in totals:
                    totals[key] += int(n)
    failed = totals["failed"] + totals["error"]
    print(f"{totals['passed']} passed, {failed} failed ({totals['skipped']} skipped)")


if __name__ == "__main__":
    main(sys.argv[1])
