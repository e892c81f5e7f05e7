"""The job presets: a model preset plus the training settings that suit it."""

from __future__ import annotations

import dataclasses
from typing import Any

from models import MODEL_PRESETS

# Warm-up is a fraction of the steps, so `--training.steps=N` keeps the preset's schedule shape
# at any length. "tiny" is the default run: it learns the embedded corpus on a 2-core CPU in a
# few minutes.
# The training settings of the small presets the tests use (debug, moe-debug, hybrid-*-debug).
_DEBUG_JOB: dict[str, Any] = {
    "training": {"steps": 20, "seq_len": 64, "micro_batch_size": 4},
    "optim": {"lr": 1e-3},
    "schedule": {"warmup_ratio": 0.1, "decay_ratio": 0.25, "min_lr": 1e-4},
    "metrics": {"log_interval": 5, "val_interval": 10, "val_rows": 8},
}
JOB_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        # About 180 x 4096 tokens: ~3.5 min of training at ~3.4k tokens/s on 2 CPU cores, which
        # takes the validation loss from ~9.5 to below 5.
        "model": "tiny",
        "training": {"steps": 180, "seq_len": 256, "micro_batch_size": 16},
        "optim": {"lr": 2e-3, "weight_decay": 0.1},
        "schedule": {"warmup_ratio": 0.11, "decay_ratio": 0.4, "min_lr": 2e-4},
        "metrics": {"log_interval": 10, "val_interval": 60, "val_rows": 128},
    },
    "debug": {"model": "debug", **_DEBUG_JOB},
    "125m": {
        "model": "125m",
        "training": {"steps": 10000, "seq_len": 2048, "micro_batch_size": 8},
        "optim": {"lr": 6e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 6e-5},
    },
    "1b": {
        "model": "1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 2},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # MoE (models/moe.py). moe-tiny learns the embedded corpus on a 2-core CPU in minutes.
    "moe-tiny": {
        "model": "moe-tiny",
        "training": {"steps": 150, "seq_len": 256, "micro_batch_size": 16},
        "optim": {"lr": 2e-3, "weight_decay": 0.1},
        "schedule": {"warmup_ratio": 0.133, "decay_ratio": 0.4, "min_lr": 2e-4},
        "metrics": {"log_interval": 10, "val_interval": 50, "val_rows": 128},
    },
    "moe-debug": {"model": "moe-debug", **_DEBUG_JOB},
    "moe-1b": {
        "model": "moe-1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 4},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # Hybrids (models/hybrid.py): Gated DeltaNet and attention blocks by model.layer_pattern.
    "hybrid-debug": {"model": "hybrid-debug", **_DEBUG_JOB},
    "hybrid-moe-debug": {"model": "hybrid-moe-debug", **_DEBUG_JOB},
    "hybrid-1b": {
        "model": "hybrid-1b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 2},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    # The FP8 benchmark's dense model (models/gpt.py): one GPU, fp32 master weights.
    "3b": {
        "model": "3b",
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": 1},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    },
    "8b": {
        "model": "8b",
        "training": {
            "steps": 50000,
            "seq_len": 8192,
            "micro_batch_size": 1,
            "activation_checkpoint": "full",
        },
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.04, "min_lr": 3e-5},
    },
}


def preset_updates(name: str) -> dict[str, Any]:
    if name not in JOB_PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(JOB_PRESETS)}")
    updates = dict(JOB_PRESETS[name])
    updates["model"] = dataclasses.asdict(MODEL_PRESETS[updates["model"]])
    return updates
