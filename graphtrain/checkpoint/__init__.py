"""Checkpoints: DCP save/resume with retention (manager), integrity checks, Hugging Face export
and import (hf)."""

from graphtrain.checkpoint.manager import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointSaveError,
    NonFiniteWeightsError,
    complete_checkpoints,
    resolve,
    step_of,
    to_delete,
)
from graphtrain.checkpoint.resume import resume_differences

__all__ = [
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointSaveError",
    "NonFiniteWeightsError",
    "complete_checkpoints",
    "resolve",
    "resume_differences",
    "step_of",
    "to_delete",
]
