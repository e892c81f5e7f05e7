"""graphtrain.precision: every dtype decision of a run, from the config, the layout and the
device."""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphtrain.config import load_config
from graphtrain.parallel import ParallelDims
from graphtrain.precision import Precision

BF16, FP32 = torch.bfloat16, torch.float32
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "overrides, dp, device, want",
    [
        # (compute, autocast, working copies, pipeline activations)
        ((), 1, CUDA, (BF16, True, True, FP32)),  # auto: bf16 on CUDA under autocast
        ((), 1, CPU, (FP32, False, False, FP32)),  # auto: fp32 on CPU
        ((), 2, CUDA, (BF16, False, True, BF16)),  # FSDP2 casts; the experts' copies stay
        (("--training.working_weights=false",), 1, CUDA, (BF16, True, False, FP32)),
        (("--training.dtype=bfloat16",), 1, CPU, (BF16, True, True, FP32)),
        # pure bf16: compute in the master's dtype, on CPU too; autocast still runs
        (("--training.master_dtype=bfloat16",), 1, CUDA, (BF16, True, False, BF16)),
        (("--training.master_dtype=bfloat16",), 1, CPU, (BF16, True, False, BF16)),
        (("--training.master_dtype=bfloat16",), 2, CUDA, (BF16, False, False, BF16)),
    ],
)  # fmt: skip
def test_decisions(overrides, dp, device, want):
    cfg = load_config(["--preset", "debug", *overrides])
    p = Precision.of(cfg, ParallelDims(dp_shard=dp, world_size=dp), device)
    assert (p.compute, p.autocast, p.working, p.pipeline) == want
    assert p.master == (BF16 if "--training.master_dtype=bfloat16" in overrides else FP32)
    context = p.autocast_context(device)
    assert isinstance(context, torch.autocast) == p.autocast
    assert p.autocast or isinstance(context, contextlib.nullcontext)


def test_working_masters_follow_the_layout():
    """Without data parallelism the matmul weights get copies; under FSDP2 only the
    expert-parallel weights it leaves alone (none in a dense model); none without copies."""
    from models import build_model

    cfg = load_config(["--preset", "debug"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    single = Precision.of(cfg, ParallelDims(), CUDA).working_masters(model)
    assert single and all(p.dim() == 2 for p in single)
    assert (
        Precision.of(cfg, ParallelDims(dp_shard=2, world_size=2), CUDA).working_masters(model) == []
    )
    assert Precision.of(cfg, ParallelDims(), CPU).working_masters(model) == []
