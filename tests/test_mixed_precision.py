"""graphtrain.precision: every dtype decision of a run, from the config, the layout and the
device."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from graphtrain.config import load_config
from graphtrain.optim import working_weight_params
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
    single = Precision.of(cfg, ParallelDims(), CUDA).working_masters(model, cfg)
    assert single and all(p.dim() == 2 for p in single)
    fsdp = Precision.of(cfg, ParallelDims(dp_shard=2, world_size=2), CUDA)
    assert fsdp.working_masters(model, cfg) == []
    assert Precision.of(cfg, ParallelDims(), CPU).working_masters(model, cfg) == []


def test_no_copies_of_the_fp8_linears_weights():
    """Under training.fp8 the linears the fp8_linear pass takes (fp8_weights: every matmul
    weight of debug at a small fp8.min_dim) get no working copy, the op casting their fp32
    masters; at the default min_dim (4096) it takes none of debug's, and all keep theirs."""
    from models import build_model

    for min_dim, copies in ((16, False), (4096, True)):
        cfg = load_config(["--preset", "debug", "--training.fp8=true", f"--fp8.min_dim={min_dim}"])
        with torch.device("meta"):
            model = build_model(cfg.model)
        matmul = working_weight_params(model)
        copied = Precision.of(cfg, ParallelDims(), CUDA).working_masters(model, cfg)
        assert matmul and copied == (matmul if copies else []), (min_dim, len(copied))


def test_no_copies_of_the_weights_the_graph_concatenates():
    """The experts' w1 and w3, which fuse_sibling_grouped_mm concatenates (the concatenation casts
    them, and the backward keeps it), get no working copy; every other matmul weight does, and
    with the pass off (or compile off) w1 and w3 do too."""
    from models import build_model

    cfg = load_config(["--preset", "moe-debug"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    precision = Precision.of(cfg, ParallelDims(), CUDA)
    names = {id(p): name for name, p in model.named_parameters()}
    matmul = [names[id(p)] for p in working_weight_params(model)]
    concatenated = {f"layers.{i}.moe.experts.{w}" for i in (1, 2) for w in ("w1", "w3")}
    copied = [names[id(p)] for p in precision.working_masters(model, cfg)]
    assert copied == [n for n in matmul if n not in concatenated]
    assert concatenated < set(matmul) and "layers.1.moe.experts.w2" in copied
    for compile_cfg in (
        dataclasses.replace(cfg.compile, passes=["-fuse_sibling_grouped_mm"]),
        dataclasses.replace(cfg.compile, enable=False),
    ):
        off = dataclasses.replace(cfg, compile=compile_cfg)
        assert [names[id(p)] for p in precision.working_masters(model, off)] == matmul
