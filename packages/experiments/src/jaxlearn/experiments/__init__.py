"""jaxlearn.experiments: named recipes with their mesh rules; the source of golden configs."""

from jaxlearn.experiments.golden import SELECTORS, golden_texts, write_golden
from jaxlearn.experiments.recipes import (
    DEFAULT_EXPERIMENT,
    EXPERIMENTS,
    REAL_SIZE,
    get_experiment,
)

__all__ = [
    "DEFAULT_EXPERIMENT",
    "EXPERIMENTS",
    "REAL_SIZE",
    "SELECTORS",
    "get_experiment",
    "golden_texts",
    "write_golden",
]
