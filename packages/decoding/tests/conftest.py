"""Test setup: 8 fake CPU devices for sharding tests, persistent compilation cache."""

import os

import jax
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("JAXLEARN_COMPILATION_CACHE") or "/tmp/jaxlearn-jax-cache",
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
settings.register_profile("jaxlearn", deadline=None, max_examples=20, derandomize=True)
settings.load_profile("jaxlearn")
