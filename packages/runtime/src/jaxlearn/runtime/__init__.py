"""jaxlearn.runtime: the trainer, learner (optax), input pipeline (grain), summaries,
AOT compilation and resilience. Import submodules directly, e.g.
`from jaxlearn.runtime.trainer import Trainer`; see packages/runtime/README.md."""
