"""`jaxlearn aot-matrix`: record `jaxlearn aot` verdicts of recipe x target pairs.

    jaxlearn aot-matrix run --experiment E --mesh_selector S [--set P=V ...] [--matrix F]
    jaxlearn aot-matrix render [--matrix F] [--output F.md]
    tools/aot_matrix.sh [RECIPES] [SELECTORS]      # every pair, then render

`run` compiles one pair with `jaxlearn aot --json` in a subprocess and records it in the
matrix file (`jaxlearn.experiments.aot_matrix.run`); `render` writes the Markdown table next
to it (`aot_matrix.render`). `--matrix` defaults to `$JAXLEARN_AOT_MATRIX`, else the
checkout's `docs/aot_matrix.json` (`common.default_matrix`). `jaxlearn launch` reads the same
file for its fit check.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxlearn.aot.matrix import GiB, entry_key
from jaxlearn.cli.common import UsageError, default_matrix
from jaxlearn.experiments import BuildError, aot_matrix

_MATRIX_HELP = ("the matrix file (default: $JAXLEARN_AOT_MATRIX, else docs/aot_matrix.json of "
                "the checkout: $JAXLEARN_CHECKOUT, else the directory with pants.toml from the "
                "current one upwards)")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("aot-matrix", help="record `jaxlearn aot` verdicts of recipe x target "
                                          "pairs (tools/aot_matrix.sh)")
    what = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    r = what.add_parser("run", help="compile one pair and record it")
    r.add_argument("--experiment", required=True)
    r.add_argument("--mesh_selector", required=True)
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    r.add_argument("--matrix", default=None, help=_MATRIX_HELP)
    w = what.add_parser("render", help="write the Markdown table next to the JSON")
    w.add_argument("--matrix", default=None, help=_MATRIX_HELP)
    w.add_argument("--output", default=None, help="default: aot_matrix.md next to the JSON")


def _matrix(args: argparse.Namespace) -> str:
    path = args.matrix or default_matrix()
    if path is None:
        raise UsageError("aot-matrix: not inside a jaxlearn checkout (no pants.toml in "
                         f"{os.getcwd()} or above); pass --matrix")
    return str(path)


def _aot_argv(args: argparse.Namespace) -> list[str]:
    sets = [w for o in args.overrides for w in ("--set", o)]
    return [sys.executable, "-m", "jaxlearn.cli", "aot", "--json", "--experiment",
            args.experiment, "--mesh_selector", args.mesh_selector, *sets]


def cmd_aot_matrix(args: argparse.Namespace) -> int:
    path = _matrix(args)
    if args.what == "render":
        out = args.output or os.path.splitext(path)[0] + ".md"
        with open(out, "w", encoding="utf-8") as f:
            f.write(aot_matrix.render(path))
        print(out)
        return 0
    try:
        e = aot_matrix.run(path, args.experiment, args.mesh_selector, args.overrides,
                           _aot_argv(args))
    except BuildError as err:
        raise UsageError(str(err)) from None
    verdict = "FITS" if e["fits"] else "NO"
    detail = e.get("error") or (f"{e['required_bytes'] / GiB:.1f} of "
                                f"{e['usable_bytes'] / GiB:.1f} GiB usable")
    print(f"{verdict:9} {entry_key(args.experiment, args.mesh_selector, args.overrides)}"
          f" ({detail}; {e['wall_seconds'] / 60:.1f} min)", flush=True)
    return 0 if e["fits"] else 1


COMMANDS = {"aot-matrix": cmd_aot_matrix}

__all__ = ["COMMANDS", "add_parsers", "cmd_aot_matrix"]
