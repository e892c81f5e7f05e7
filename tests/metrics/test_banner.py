"""The start banner: every field a user checks before leaving a run, from the config."""

from pathlib import Path

import torch

from graphtrain.config import load_config
from graphtrain.metrics.banner import start_banner
from graphtrain.parallel import ParallelDims
from models import build_model
from models.moe import active_params


def _fields(text: str) -> dict[str, str]:
    return {line[:12].strip(): line[13:] for line in text.splitlines()}


def test_dense_banner_fields():
    cfg = load_config(
        [
            "--preset",
            "tiny",
            "--checkpoint.interval=50",
            "--compile.passes=-fuse_linear_cross_entropy",
        ]
    )
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    text = start_banner(
        cfg,
        run_dir=Path("runs/x"),
        dims=dims,
        num_params=5_123_456,
        active_params=None,
        param_dtype="bfloat16",
        device="cuda",
        micro_batches_per_step=3,
    )
    f = _fields(text)
    assert list(f) == [
        "run dir",
        "model",
        "tokens",
        "layout",
        "precision",
        "compile",
        "checkpoints",
    ]
    assert f["run dir"] == "runs/x"
    assert f["model"] == "tiny: 5.12M total"
    # 3 micro-batches x 2 dp ranks x (16 x 256) tokens; tiny's schedule at 180 steps.
    assert f["tokens"].startswith(
        "24,576 per step (3 micro-batches x 2 data-parallel ranks x 4,096 per micro-batch: "
        "16 x 256); 180 steps, warm-up 20, decay 72 (cosine)"
    )
    assert f["layout"] == "4 rank(s) on cuda: dp_replicate 1 x dp_shard 2 x tp 2"
    piped = start_banner(
        load_config(["--preset", "tiny", "--parallel.pp_schedule=gpipe"]),
        run_dir=Path("runs/x"),
        dims=ParallelDims(pp=2, dp_shard=2, world_size=4),
        num_params=5_123_456,
        active_params=None,
        param_dtype="bfloat16",
        device="cuda",
        micro_batches_per_step=3,
    )
    assert _fields(piped)["layout"] == (
        "4 rank(s) on cuda: pp 2 (gpipe) x dp_replicate 1 x dp_shard 2 x tp 1"
    )
    assert f["precision"].startswith("compute bfloat16, master weights float32")
    assert f["compile"].startswith("inductor; passes on: ")
    assert "fuse_linear_cross_entropy" not in f["compile"]
    assert f["checkpoints"] == "every 50 steps and at the end, keep the last 2"


def test_moe_banner_shows_active_parameters_and_the_final_checkpoint_plan():
    cfg = load_config(["--preset", "moe-tiny", "--compile.enable=false"])
    with torch.device("meta"):
        total = sum(p.numel() for p in build_model(cfg.model).parameters())
    text = start_banner(
        cfg,
        run_dir=Path("r"),
        dims=ParallelDims(dp_shard=2, ep=2, world_size=2),
        num_params=total,
        active_params=active_params(cfg.model),
        param_dtype="float32",
        device="cpu",
        micro_batches_per_step=1,
    )
    f = _fields(text)
    active = active_params(cfg.model)
    assert active < total  # 2 of 8 routed experts per token
    assert f["model"] == (
        f"moe-tiny: {total / 1e6:.3g}M total, {active / 1e6:.3g}M active per token (matmul weights)"
    )
    assert f["layout"].endswith("(experts: ep 2, etp 1)")
    assert f["compile"] == "off (eager)"
    assert f["tokens"].startswith("8,192 per step (1 micro-batch x 2 data-parallel ranks x 4,096")
    assert f["checkpoints"] == "at the end (checkpoint.interval=0), keep the last 2"
    cfg = load_config(["--checkpoint.final=false", "--checkpoint.resume=latest"])
    text = start_banner(
        cfg,
        run_dir=Path("r"),
        dims=ParallelDims(world_size=1),
        num_params=10,
        active_params=None,
        param_dtype="float32",
        device="cpu",
        micro_batches_per_step=1,
    )
    assert _fields(text)["checkpoints"] == (
        "none (checkpoint.interval=0, checkpoint.final=false); resuming from latest"
    )


def test_a_dense_fp32_single_rank_banner_leads_with_the_passes_that_can_act():
    cfg = load_config(["--preset", "debug"])
    text = start_banner(
        cfg,
        run_dir=Path("r"),
        dims=ParallelDims(world_size=1),
        num_params=1000,
        active_params=None,
        param_dtype="float32",
        device="cpu",
        micro_batches_per_step=1,
    )
    active, _, idle = _fields(text)["compile"].partition("; nothing to do in this job for: ")
    assert active.endswith("passes on: canonicalize, fuse_linear_cross_entropy")
    assert "fuse_moe_router (MoE)" in idle and "overlap_tp_comm (tp > 1)" in idle
    assert "fp8_cast_once (training.fp8)" in idle
