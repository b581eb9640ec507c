"""jaxlearn.cli: Leaf: the `jaxlearn` command."""
