"""jaxlearn.checkpoint: sharded, async, verified checkpoints on orbax/tensorstore.

Commit protocol, sharding-independent checksums, retention, resharding restore.
See packages/checkpoint/README.md.
"""

from jaxlearn.checkpoint.checkpointer import Checkpointer, DataIteratorState, StepMetadata
from jaxlearn.checkpoint.digest import digest_numpy
from jaxlearn.checkpoint.errors import (
    CheckpointCorruptionError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointStructureError,
    NoGoodCheckpointError,
)
from jaxlearn.checkpoint.locate import is_checkpoint, locate, restore_subtree
from jaxlearn.checkpoint.manifest import ArrayRecord
from jaxlearn.checkpoint.retention import RetentionPolicy
from jaxlearn.checkpoint.storage import StorageError

__all__ = [
    "ArrayRecord",
    "CheckpointCorruptionError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointStructureError",
    "Checkpointer",
    "DataIteratorState",
    "NoGoodCheckpointError",
    "RetentionPolicy",
    "StepMetadata",
    "StorageError",
    "digest_numpy",
    "is_checkpoint",
    "locate",
    "restore_subtree",
]
