"""jaxlearn.runtime: the trainer, learner (optax), input pipeline (grain), data sources and
summaries. Import submodules directly, e.g. `from jaxlearn.runtime.trainer import Trainer`;
see packages/runtime/README.md."""

# The public submodules (imported on use, so that importing the package stays cheap;
# `from jaxlearn.runtime import *` imports them all).
__all__ = [
    "bundled",
    "compute_copy",
    "data",
    "init_from",
    "input_pipeline",
    "learner",
    "objective",
    "record",
    "sft",
    "summary",
    "trainer",
]
