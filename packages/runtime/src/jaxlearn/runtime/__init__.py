"""jaxlearn.runtime: the trainer, learner (optax), input pipeline (grain), data sources and
summaries. Import submodules directly, e.g. `from jaxlearn.runtime.trainer import Trainer`;
see packages/runtime/README.md."""
