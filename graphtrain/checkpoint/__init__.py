"""Checkpoints: DCP save/resume with retention (manager), integrity checks, Hugging Face export
and import (hf)."""

from graphtrain.checkpoint.manager import (
    CheckpointManager,
    CheckpointSaveError,
    complete_checkpoints,
    resolve,
    to_delete,
)

__all__ = [
    "CheckpointManager",
    "CheckpointSaveError",
    "complete_checkpoints",
    "resolve",
    "to_delete",
]
