"""Optimizer, gradient clipping and schedules (learning rate, batch size)."""

from graphtrain.optim.clip import clip_grad_norm_
from graphtrain.optim.optimizer import build_optimizer
from graphtrain.optim.schedule import (
    DECAY_STYLES,
    BatchSizeSchedule,
    LRSchedule,
    parse_token_count,
)

__all__ = [
    "DECAY_STYLES",
    "BatchSizeSchedule",
    "LRSchedule",
    "build_optimizer",
    "clip_grad_norm_",
    "parse_token_count",
]
