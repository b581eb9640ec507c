"""jaxlearn.checkpoint: Sharded, async, verified checkpoints on orbax/tensorstore: commit protocol, checksums, retention, resharding restore."""
