"""Test setup for config (no jax here): deterministic hypothesis runs."""

from hypothesis import settings

settings.register_profile("jaxlearn", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("jaxlearn")
