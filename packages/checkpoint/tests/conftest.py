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


# ---- shared fixtures ----------------------------------------------------------------------

import pytest  # noqa: E402

from jaxlearn.checkpoint import Checkpointer  # noqa: E402


@pytest.fixture
def make_checkpointer(tmp_path):
    """Builds Checkpointers on tmp_path/ckpt (or another dir) and closes them afterwards."""
    made = []

    def make(directory=None, **fields):
        cfg = Checkpointer.default_config().set(directory=str(directory or tmp_path / "ckpt"))
        ckpt = cfg.set(**fields).instantiate()
        made.append(ckpt)
        return ckpt

    yield make
    for ckpt in made:
        ckpt.close()
