"""The start banner: what this run is about to do, in a few lines, logged once by rank 0.

What a user checks before walking away from a run: where it writes, how big the model is (for
MoE also the weights a token meets), how many tokens a step and a micro-batch hold, the layout
over the ranks, the precision, the graph passes that are on, and when checkpoints are saved.
Everything comes from the resolved config and the numbers the trainer computed; the function
returns text, so a test reads exactly what the user sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from graphtrain.config import JobConfig
from models.hybrid import GDN

if TYPE_CHECKING:
    from graphtrain.parallel import ParallelDims


def _count(n: int) -> str:
    """1234567 -> '1.23M' (K, M, B, T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _checkpoint_plan(cfg: JobConfig) -> str:
    c = cfg.checkpoint
    if c.interval:
        plan = f"every {c.interval} steps and at the end"
    elif c.final:
        plan = "at the end (checkpoint.interval=0)"
    else:
        plan = "none (checkpoint.interval=0, checkpoint.final=false)"
    if c.interval or c.final:
        plan += f", keep the last {c.keep_last}"
        if c.retain_interval:
            plan += f" and every multiple of {c.retain_interval}"
    if c.resume:
        plan += f"; resuming from {c.resume}"
    return plan


# Passes that can only find work in some jobs: name -> (whether this job has it, what it needs).
# A pass not listed here is shown as on.
_NEEDS = {
    "fuse_moe_router": (lambda cfg, dims: hasattr(cfg.model, "num_experts"), "MoE"),
    "fuse_moe_dispatch": (lambda cfg, dims: hasattr(cfg.model, "num_experts"), "MoE"),
    "fuse_sibling_grouped_mm": (lambda cfg, dims: hasattr(cfg.model, "num_experts"), "MoE"),
    "fold_routing_weights": (lambda cfg, dims: hasattr(cfg.model, "num_experts"), "MoE"),
    "fp8_linear": (lambda cfg, dims: cfg.training.fp8, "training.fp8"),
    "fp8_all_gather": (lambda cfg, dims: cfg.training.fp8, "training.fp8"),
    "fp8_cast_once": (lambda cfg, dims: cfg.training.fp8, "training.fp8"),
    "overlap_tp_comm": (lambda cfg, dims: dims.tp > 1, "tp > 1"),
    "gated_delta_rule": (
        lambda cfg, dims: GDN in getattr(cfg.model, "layer_pattern", ""),
        "Gated DeltaNet blocks",
    ),
}


def _passes(cfg: JobConfig, dims: ParallelDims, names: list[str]) -> str:
    """The passes that can act in this job first; those with nothing to do here after, with
    what they would need."""
    active = [n for n in names if n not in _NEEDS or _NEEDS[n][0](cfg, dims)]
    idle = [f"{n} ({_NEEDS[n][1]})" for n in names if n not in active]
    text = f"passes on: {', '.join(active) or 'none'}"
    if idle:
        text += f"; nothing to do in this job for: {', '.join(idle)}"
    return text


def start_banner(
    cfg: JobConfig,
    *,
    run_dir: Path,
    dims: ParallelDims,
    num_params: int,
    active_params: int | None,
    param_dtype: str,
    device: str,
    micro_batches_per_step: int,
    optimizer: str,
) -> str:
    """The banner's lines, e.g. "run dir      runs/tiny-...".

    num_params: every parameter (unsharded); active_params: the weights one token is multiplied
    with (MoE models; None for dense ones); micro_batches_per_step: at the first step;
    optimizer: the AdamW kernel that runs (graphtrain.optim.describe_optimizer).
    """
    from graphtrain.passes import resolve_passes

    t = cfg.training
    dp_size = dims.dp_replicate * dims.dp_shard
    per_micro = t.micro_batch_size * t.seq_len
    per_step = per_micro * micro_batches_per_step * dp_size
    passes = [p.name for p in resolve_passes(cfg.compile.passes)] if cfg.compile.enable else None
    layout = f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x tp {dims.tp}"
    if dims.pp > 1:
        layout = f"pp {dims.pp} ({cfg.parallel.pp_schedule}) x {layout}"
    if dims.ep > 1 or dims.etp > 1:
        layout += f" (experts: ep {dims.ep}, etp {dims.etp})"
    params = f"{_count(num_params)} total"
    if active_params is not None:
        params += f", {_count(active_params)} active per token (matmul weights)"
    if passes is None:
        compiled = "off (eager)"
    else:
        compiled = f"{cfg.compile.backend}; {_passes(cfg, dims, passes)}"
    rows = [
        ("run dir", str(run_dir)),
        ("model", f"{cfg.preset}: {params}"),
        (
            "tokens",
            f"{per_step:,} per step ({micro_batches_per_step} micro-batch"
            f"{'es' if micro_batches_per_step != 1 else ''} x {dp_size} data-parallel "
            f"rank{'s' if dp_size != 1 else ''} x {per_micro:,} per micro-batch: {t.micro_batch_size} x "
            f"{t.seq_len}); {t.steps} steps, warm-up {cfg.warmup_steps}, "
            f"decay {cfg.decay_steps} ({cfg.schedule.decay_style})",
        ),
        ("layout", f"{dims.world_size} rank(s) on {device}: {layout}"),
        (
            "precision",
            f"compute {param_dtype}, master weights {t.master_dtype}, gradient reduction "
            f"{t.reduce_dtype}, AdamW moments {cfg.optim.state_dtype}",
        ),
        ("optimizer", f"{optimizer} (optim.implementation = {cfg.optim.implementation})"),
        ("compile", compiled),
        ("checkpoints", _checkpoint_plan(cfg)),
    ]
    return "\n".join(f"{name:<12} {value}" for name, value in rows)
