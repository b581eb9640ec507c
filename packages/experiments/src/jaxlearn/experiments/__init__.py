"""jaxlearn.experiments: named recipes with their mesh rules; the source of golden configs;
`build_run`, the one builder of a run's final config from a recipe and the run's flags."""

from jaxlearn.experiments.build import (
    RUN_FLAGS,
    BuildError,
    BuiltRun,
    RunFlags,
    build_config,
    build_run,
    resolve_selector,
)
from jaxlearn.experiments.golden import SELECTORS, golden_drift, golden_texts, write_golden
from jaxlearn.experiments.recipes import (
    DEFAULT_EXPERIMENT,
    EXPERIMENTS,
    REAL_SIZE,
    get_experiment,
)
from jaxlearn.experiments.served_model import model_difference, open_run_model

__all__ = [
    "RUN_FLAGS",
    "BuildError",
    "BuiltRun",
    "DEFAULT_EXPERIMENT",
    "EXPERIMENTS",
    "REAL_SIZE",
    "SELECTORS",
    "RunFlags",
    "build_config",
    "build_run",
    "get_experiment",
    "golden_drift",
    "golden_texts",
    "resolve_selector",
    "model_difference",
    "open_run_model",
    "write_golden",
]
