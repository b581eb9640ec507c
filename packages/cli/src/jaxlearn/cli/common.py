"""What every `jaxlearn` subcommand shares: the usage error, the library build errors mapped
to it, the experiment flags, and where the checkout is (defaults of path flags).

The subcommand modules import this module and libraries only, never each other (no cycle:
`main` imports the `*_cmd` modules and hands them what they need of it as arguments).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

from jaxlearn.experiments import BuildError, build_config
from jaxlearn.experiments.served_model import open_run_model

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line."""


def final_config(experiment: str, mesh_selector: Optional[str], overrides: Sequence[str],
                 *, init_from: Optional[str] = None) -> Any:
    """`experiments.build_config` (recipe -> `--init_from` model -> mesh rule -> overrides ->
    validation), its BuildError a UsageError."""
    try:
        return build_config(experiment, mesh_selector, overrides, init_from=init_from)
    except BuildError as e:
        raise UsageError(str(e)) from None


def open_model_flag(path: str, experiment: Optional[str] = None,
                    overrides: Sequence[str] = ()) -> tuple[Any, Optional[str]]:
    """`--model PATH` of serve / generate / export: `experiments.open_run_model` (the
    `interop.ModelSource` and where a run's model config came from), its BuildError a
    UsageError."""
    try:
        return open_run_model(path, experiment, overrides)
    except BuildError as e:
        raise UsageError(str(e)) from None


def add_experiment_args(p: argparse.ArgumentParser) -> None:
    """--experiment, --mesh_selector and --set."""
    p.add_argument("--experiment", required=True, help="recipe name (see `jaxlearn experiments`)")
    p.add_argument("--mesh_selector", default=None,
                   help="hardware target, e.g. cpu-8, tpu-v5p-256, gpu-h100-8x4 "
                        "(default: detected from this machine)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set model.decoder.transformer.num_layers=4"
                        " or --set learner.learning_rate=1e-3 (repeatable; values are Python "
                        "literals; `jaxlearn config` lists every path)")


CHECKOUT_ENV = "JAXLEARN_CHECKOUT"


def checkout_root(start: Optional[str] = None) -> Optional[str]:
    """The jaxlearn checkout the command works in: `$JAXLEARN_CHECKOUT` (the checkout's
    `tools/jaxlearn` sets it), else the first directory holding `pants.toml` from `start`
    (default: the current directory) upwards; None outside a checkout."""
    given = os.environ.get(CHECKOUT_ENV, "").strip()
    if given:
        return os.path.abspath(given)
    here = os.path.abspath(start or os.getcwd())
    while True:
        if os.path.isfile(os.path.join(here, "pants.toml")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def in_checkout(*parts: str) -> Optional[str]:
    """`<checkout>/<parts...>`, or None outside a checkout (`checkout_root`)."""
    root = checkout_root()
    return None if root is None else os.path.join(root, *parts)


def default_matrix() -> Optional[str]:
    """The AOT matrix file: `$JAXLEARN_AOT_MATRIX`, else the checkout's
    `docs/aot_matrix.json` (None outside a checkout)."""
    return os.environ.get("JAXLEARN_AOT_MATRIX") or in_checkout("docs", "aot_matrix.json")


def one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())


__all__ = ["CHECKOUT_ENV", "EXIT_USAGE", "UsageError", "add_experiment_args", "checkout_root",
           "default_matrix", "final_config", "in_checkout", "one_line"]
