"""Optimizer, gradient clipping, schedules (learning rate, batch size), and precision: bf16
parameters with fp32 gradient sums, bf16 working copies of fp32 master weights."""

from graphtrain.optim.adamw_bf16 import AdamWBF16
from graphtrain.optim.adamw_copies import AdamWCopies
from graphtrain.optim.clip import clip_grad_norm_, global_norm, scale_grads_
from graphtrain.optim.memory import optimizer_state_bytes
from graphtrain.optim.optimizer import build_optimizer, describe_optimizer, optimizer_from_config
from graphtrain.optim.precision import FP32GradAccumulator, cast_parameters_
from graphtrain.optim.schedule import (
    DECAY_STYLES,
    BatchSizeSchedule,
    LRSchedule,
    lr_schedule_from_config,
    parse_token_count,
)
from graphtrain.optim.working_weights import WorkingWeights, working_weight_params

__all__ = [
    "DECAY_STYLES",
    "AdamWBF16",
    "AdamWCopies",
    "BatchSizeSchedule",
    "FP32GradAccumulator",
    "LRSchedule",
    "WorkingWeights",
    "build_optimizer",
    "cast_parameters_",
    "clip_grad_norm_",
    "describe_optimizer",
    "global_norm",
    "lr_schedule_from_config",
    "optimizer_from_config",
    "optimizer_state_bytes",
    "parse_token_count",
    "scale_grads_",
    "working_weight_params",
]
