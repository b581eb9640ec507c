"""jaxlearn.experiments: Leaf: named recipes and their mesh rules; the source of golden_configs/; cross-package integration tests."""
