"""Parallelism on a named DeviceMesh: parallelize_model applies expert parallel (MoE), TP,
compile, activation checkpointing and FSDP2 to a model built on the meta device, in one fixed
order.

    model = build_model(cfg)                     # on torch.device("meta")
    dims = ParallelDims(dp_shard=-1, tp=2, world_size=world)
    mesh = build_mesh(dims, "cuda")
    parallelize_model(model, mesh, dims, plan=tp_plan(cfg), ac_mode="full",
                      compile_options={"inner": "inductor"},
                      param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to_empty(device="cuda")
    model.init_weights(seed)                     # same values as the unsharded model's init

Data: each rank reads the slice dp_mesh(mesh).get_local_rank() of dp_size slices of the global
batch (ranks of one tp group read the same rows). Loss to report: its average over dp_mesh(mesh).
parallelize_model returns a GradientFinisher: call it once per step, after the last backward,
to finish the gradients no FSDP hook reduces (expert-parallel weights, MoE layers under tp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from graphtrain.config import Fp8Config
from graphtrain.parallel.activation_checkpoint import AC_MODES, apply_ac
from graphtrain.parallel.expert_parallel import apply_ep, expert_params, reduce_expert_grads
from graphtrain.parallel.fp8_all_gather import apply_fp8_all_gather
from graphtrain.parallel.fsdp import apply_fsdp, reshards_after_forward
from graphtrain.parallel.gradients import GradientFinisher
from graphtrain.parallel.init import apply_reproducible_init
from graphtrain.parallel.mesh import (
    ParallelDims,
    build_mesh,
    check_layout,
    destroy_distributed,
    dp_mesh,
    expert_dp_mesh,
    fsdp_mesh,
    init_distributed,
    unused_axis_settings,
    validate_model_for_tp,
)
from graphtrain.parallel.tensor_parallel import (
    STYLES,
    apply_tp,
    partial_grad_params,
    reduce_partial_grads,
)

__all__ = [
    "AC_MODES",
    "STYLES",
    "GradientFinisher",
    "ParallelDims",
    "apply_ac",
    "apply_ep",
    "apply_fp8_all_gather",
    "apply_fsdp",
    "apply_reproducible_init",
    "apply_tp",
    "build_mesh",
    "check_layout",
    "destroy_distributed",
    "dp_mesh",
    "expert_dp_mesh",
    "expert_params",
    "fsdp_mesh",
    "init_distributed",
    "parallelize_model",
    "partial_grad_params",
    "reduce_expert_grads",
    "reduce_partial_grads",
    "unused_axis_settings",
    "validate_model_for_tp",
]


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    *,
    plan: dict[str, str],
    ac_mode: str,
    compile_options: dict[str, Any] | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    fp8_all_gather: Fp8Config | None = None,
    reshard_policy: str = "default",
) -> GradientFinisher:
    """Apply EP -> TP -> compile -> AC -> FSDP to `model` in place; returns the call that
    finishes each step's gradients (see graphtrain.parallel.gradients).

    `mesh` comes from build_mesh(dims, ...); None is fine for one process (nothing to shard).
    compile_options: keyword arguments of graphtrain.compile.apply_compile, None for eager.
    param_dtype/reduce_dtype: FSDP2's mixed precision; without data parallelism there is no
    FSDP and the parameters' own dtype is used. fp8_all_gather: the [fp8] filters whose linears'
    weights FSDP2 gathers in FP8 (graphtrain.parallel.fp8_all_gather), None for none.
    reshard_policy: parallel.fsdp_reshard_after_forward. Afterwards model.init_weights(seed)
    gives the values of the unsharded model (see graphtrain.parallel.init).
    """
    _check_arguments(model, mesh, dims, ac_mode=ac_mode, fp8_all_gather=fp8_all_gather)

    # 0. Expert parallel: the experts' weights become ep shards before anything else sees them
    #    (FSDP must know to leave them alone), and the all-to-all hooks go around the experts
    #    before compile, so the compiled blocks trace them.
    if dims.ep > 1:
        apply_ep(model, mesh["ep", "tp"] if dims.etp > 1 else mesh["ep"])

    # 1. TP first: it turns parameters into DTensors on the tp axis and installs the hooks that
    #    redistribute activations; everything after (compiled graphs, checkpoint recompute,
    #    FSDP's sharding of the TP shards) must see that final layout.
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], plan)

    # 1b. Weights FSDP2 will gather in FP8 are wrapped before compile traces them and before
    #     fully_shard shards them (it keeps the wrapper on the shards).
    if fp8_all_gather is not None:
        apply_fp8_all_gather(model, fp8_all_gather, dims.dp_shard)

    # 2. Compile before AC and FSDP: per-block regions, so that the checkpoint and FSDP2's
    #    all-gather/reduce-scatter hooks run around the compiled code, not inside it.
    #    (torchtitan applies AC before compile, putting the checkpoint inside the graph; with TP
    #    that fails on torch 2.13, see graphtrain.parallel.activation_checkpoint.)
    if compile_options is not None:
        _compile_blocks(model, dims, ac_mode, compile_options)

    # 3. AC around each (compiled) block call.
    apply_ac(model, ac_mode)

    # 4. FSDP last: it shards whatever parameters exist by now (DTensor TP shards included,
    #    giving 2-D dp x tp parameters) and wraps the blocks as they will run.
    if dims.dp_replicate > 1 or dims.dp_shard > 1:
        _shard_data_parallel(model, mesh, dims, param_dtype, reduce_dtype, reshard_policy)

    # 5. Seeded init must reproduce the unsharded values whatever the layout above.
    apply_reproducible_init(model)
    return GradientFinisher(model, mesh, dims, plan)


def _check_arguments(
    model: nn.Module,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    *,
    ac_mode: str,
    fp8_all_gather: Fp8Config | None,
) -> None:
    """parallelize_model's arguments checked before any work, not half-way."""
    if dims.tp_enabled:
        validate_model_for_tp(model.cfg, dims.tp)
    if mesh is None and dims.world_size > 1:
        raise ValueError(f"parallelize_model needs a mesh for world size {dims.world_size}")
    if ac_mode not in AC_MODES:
        raise ValueError(f"activation checkpoint mode must be one of {AC_MODES}, got {ac_mode!r}")
    if fp8_all_gather is not None and (dims.tp_enabled or dims.dp_shard < 2):
        raise ValueError(
            f"fp8.fsdp_all_gather_fp8 needs FSDP (dp_shard > 1) without tp, got "
            f"dp_shard={dims.dp_shard}, tp={dims.tp}"
        )


def _compile_blocks(
    model: nn.Module, dims: ParallelDims, ac_mode: str, compile_options: dict[str, Any]
) -> None:
    """graphtrain.compile.apply_compile with the layout the compiled regions will run in."""
    from graphtrain.compile import apply_compile  # not imported for eager runs

    layout = {
        "fsdp": dims.dp_replicate > 1 or dims.dp_shard > 1,
        "activation_checkpoint": ac_mode != "none",
    }
    apply_compile(model, **{**compile_options, **layout})


def _shard_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_policy: str,
) -> None:
    """FSDP2 over the data-parallel axes, the expert-parallel weights left alone.

    dp_replicate > 1 uses the 2-D ("dp_replicate", "dp_shard") mesh: HSDP, or with
    dp_shard == 1 plain replication done by fully_shard over a size-1 shard axis. That
    costs a local copy per gather (no communication) but keeps one code path: the same
    DTensor parameters, state dict and composition with TP/compile as FSDP, where
    replicate() (DDP) has its own state-dict and TP rules.
    """
    # Pipeline parallel: the stages the schedule calls are the roots, not the model (their
    # blocks kept gathered by default: reshards_after_forward). Under zbv a stage whose
    # parameters were sharded when torch's input half of the backward listed them lost its
    # weight gradients: the weight half found no parameter to differentiate.
    roots = getattr(model, "pipeline_stages", None)
    if roots is not None:
        from graphtrain.parallel.pipeline.stages import fsdp_roots

        roots = fsdp_roots(roots)
    apply_fsdp(
        model,
        fsdp_mesh(mesh, dims),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshards_after_forward(reshard_policy, dims.pp),
        ignored_params=set(expert_params(model)) or None,
        roots=roots,
    )
