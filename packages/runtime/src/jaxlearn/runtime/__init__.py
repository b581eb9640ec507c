"""jaxlearn.runtime: Trainer, learner (optax), input pipeline (grain), summaries, watchdog, AOT compile, multi-process start."""
