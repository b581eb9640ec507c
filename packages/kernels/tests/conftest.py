"""Test setup: 8 fake CPU devices for sharding tests, persistent compilation cache, and
the FFI kernels' pool helpers lingering (`csrc/pool_for.h`; off by default), so that the
kernels' tests run that path; `test_pool_for.py` compares it with the default."""

import os

import jax
from hypothesis import settings

# Read when a kernel library first runs, after this module: no test has run one yet.
os.environ.setdefault("JAXLEARN_POOL_SPIN_US", "100")

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("JAXLEARN_COMPILATION_CACHE") or "/tmp/jaxlearn-jax-cache",
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
settings.register_profile("jaxlearn", deadline=None, max_examples=20, derandomize=True)
settings.load_profile("jaxlearn")
