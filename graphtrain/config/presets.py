"""The job presets: a model preset plus the training settings that suit it."""

from __future__ import annotations

import dataclasses
from typing import Any

from models import MODEL_PRESETS

# The training settings of the small presets the tests use (debug, moe-debug, hybrid-*-debug).
_DEBUG_JOB: dict[str, Any] = {
    "training": {"steps": 20, "seq_len": 64, "micro_batch_size": 4},
    "optim": {"lr": 1e-3},
    "schedule": {"warmup_ratio": 0.1, "decay_ratio": 0.25, "min_lr": 1e-4},
    "metrics": {"log_interval": 5, "val_interval": 10, "val_rows": 8},
}


def _cpu_job(model: str, *, steps: int, warmup_ratio: float, val_interval: int) -> dict[str, Any]:
    """The training settings of the presets that learn the embedded corpus on a 2-core CPU in
    minutes (tiny, moe-tiny)."""
    return {
        "model": model,
        "training": {"steps": steps, "seq_len": 256, "micro_batch_size": 16},
        "optim": {"lr": 2e-3, "weight_decay": 0.1},
        "schedule": {"warmup_ratio": warmup_ratio, "decay_ratio": 0.4, "min_lr": 2e-4},
        "metrics": {"log_interval": 10, "val_interval": val_interval, "val_rows": 128},
    }


def _gpu_job(model: str, *, micro_batch_size: int) -> dict[str, Any]:
    """The training settings of the GPU-scale presets (1b, moe-1b, hybrid-1b, 3b)."""
    return {
        "model": model,
        "training": {"steps": 20000, "seq_len": 4096, "micro_batch_size": micro_batch_size},
        "optim": {"lr": 3e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 3e-5},
    }


# Warm-up is a fraction of the steps, so `--training.steps=N` keeps the preset's schedule shape
# at any length. "tiny" is the default run: it learns the embedded corpus on a 2-core CPU in a
# few minutes.
JOB_PRESETS: dict[str, dict[str, Any]] = {
    # About 180 x 4096 tokens: ~3.5 min of training at ~3.4k tokens/s on 2 CPU cores, which
    # takes the validation loss from ~9.5 to below 5.
    "tiny": _cpu_job("tiny", steps=180, warmup_ratio=0.11, val_interval=60),
    "debug": {"model": "debug", **_DEBUG_JOB},
    "125m": {
        "model": "125m",
        "training": {"steps": 10000, "seq_len": 2048, "micro_batch_size": 8},
        "optim": {"lr": 6e-4},
        "schedule": {"warmup_ratio": 0.05, "min_lr": 6e-5},
    },
    "1b": _gpu_job("1b", micro_batch_size=2),
    # MoE (models/moe.py). moe-tiny learns the embedded corpus on a 2-core CPU in minutes.
    "moe-tiny": _cpu_job("moe-tiny", steps=150, warmup_ratio=0.133, val_interval=50),
    "moe-debug": {"model": "moe-debug", **_DEBUG_JOB},
    "moe-1b": _gpu_job("moe-1b", micro_batch_size=4),
    # Hybrids (models/hybrid.py): Gated DeltaNet and attention blocks by model.layer_pattern.
    "hybrid-debug": {"model": "hybrid-debug", **_DEBUG_JOB},
    "hybrid-moe-debug": {"model": "hybrid-moe-debug", **_DEBUG_JOB},
    "hybrid-1b": _gpu_job("hybrid-1b", micro_batch_size=2),
    # The FP8 benchmark's dense model (models/gpt.py): one GPU, fp32 master weights.
    "3b": _gpu_job("3b", micro_batch_size=1),
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
