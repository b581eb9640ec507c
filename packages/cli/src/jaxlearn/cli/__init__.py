"""jaxlearn.cli: Leaf: the `jaxlearn` command."""

# The command-line entry point (`python -m jaxlearn.cli` runs `main.main`).
__all__ = ["main"]
