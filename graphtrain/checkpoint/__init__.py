"""Checkpoints: DCP save/resume with retention (manager), integrity checks, Hugging Face export
and import (hf)."""

from graphtrain.checkpoint.manager import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointSaveError,
    complete_checkpoints,
    resolve,
    to_delete,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointSaveError",
    "complete_checkpoints",
    "resolve",
    "to_delete",
]
