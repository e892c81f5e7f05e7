"""The start banner: every field a user checks before leaving a run, from the config."""

from pathlib import Path

import torch

from graphtrain.config import load_config
from graphtrain.metrics.banner import start_banner
from graphtrain.parallel import ParallelDims
from models import build_model
from models.moe import active_params


def _banner(cfg, dims: ParallelDims, **fields) -> dict[str, str]:
    """start_banner's lines by field name, for cfg on dims: a 1-rank fp32 CPU run of 10
    parameters unless fields say otherwise."""
    kwargs = {"run_dir": Path("r"), "num_params": 10, "active_params": None,
              "param_dtype": "float32", "device": "cpu", "micro_batches_per_step": 1,
              "optimizer": "torch AdamW, fused"}  # fmt: skip
    text = start_banner(cfg, dims=dims, **{**kwargs, **fields})
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
    gpu = {"run_dir": Path("runs/x"), "num_params": 5_123_456, "param_dtype": "bfloat16",
           "device": "cuda", "micro_batches_per_step": 3}  # fmt: skip
    f = _banner(cfg, ParallelDims(dp_shard=2, tp=2, world_size=4), **gpu)
    assert list(f) == [
        "run dir",
        "model",
        "tokens",
        "layout",
        "precision",
        "optimizer",
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
    piped = _banner(
        load_config(["--preset", "tiny", "--parallel.pp_schedule=gpipe"]),
        ParallelDims(pp=2, dp_shard=2, world_size=4),
        **gpu,
    )
    assert piped["layout"] == (
        "4 rank(s) on cuda: pp 2 (gpipe) x dp_replicate 1 x dp_shard 2 x tp 1"
    )
    assert f["precision"].startswith("compute bfloat16, master weights float32")
    assert f["optimizer"] == "torch AdamW, fused (optim.implementation = auto)"
    assert f["compile"].startswith("inductor; passes on: ")
    assert "fuse_linear_cross_entropy" not in f["compile"]
    assert f["checkpoints"] == "every 50 steps and at the end, keep the last 2"


def test_moe_banner_shows_active_parameters_and_the_final_checkpoint_plan():
    cfg = load_config(["--preset", "moe-tiny", "--compile.enable=false"])
    with torch.device("meta"):
        total = sum(p.numel() for p in build_model(cfg.model).parameters())
    f = _banner(
        cfg,
        ParallelDims(dp_shard=2, ep=2, world_size=2),
        num_params=total,
        active_params=active_params(cfg.model),
    )
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
    assert _banner(cfg, ParallelDims(world_size=1))["checkpoints"] == (
        "none (checkpoint.interval=0, checkpoint.final=false); resuming from latest"
    )


def test_a_dense_fp32_single_rank_banner_leads_with_the_passes_that_can_act():
    cfg = load_config(["--preset", "debug"])
    active, _, idle = _banner(cfg, ParallelDims(world_size=1))["compile"].partition(
        "; nothing to do in this job for: "
    )
    assert active.endswith("passes on: canonicalize, fuse_linear_cross_entropy")
    assert "fuse_moe_router (MoE)" in idle and "overlap_tp_comm (tp > 1)" in idle
    assert "fp8_all_gather (training.fp8)" in idle and "fp8_cast_once" not in idle  # off
    assert "gated_delta_rule (Gated DeltaNet blocks)" in idle
    hybrid = _banner(load_config(["--preset", "hybrid-debug"]), ParallelDims(world_size=1))
    assert "passes on: canonicalize, gated_delta_rule, " in hybrid["compile"]
