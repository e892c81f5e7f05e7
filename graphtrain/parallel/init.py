"""Seeded init of a parallelized model that gives every parameter the values of the unsharded
model's init with the same seed, whatever the layout (tp, FSDP, HSDP, or any mix).

Why not let DTensor's random ops do it: on CPU, DTensor has no RNG tracker ("random operators
may not have complete support on cpu") and each rank runs the op on its shard with the global
generator, so every shard gets the SAME numbers (checked on torch 2.13, 2 ranks: rank 1's half
of a Shard(0) normal_ equals rank 0's). On CUDA the OffsetBasedRNGTracker starts each shard's
Philox stream at (shard index x local numel), which keeps shards distinct but is not documented
to reproduce the values one GPU draws for the whole tensor (those depend on the kernel's
thread-to-element mapping), and trunc_normal_ is several random ops. Either way the initial
weights, so the loss curve, would depend on the parallel layout, hiding layout bugs.

What we do: model.init_weights is wrapped; the wrapper swaps every DTensor parameter for a plain
full-size tensor on the parameter's device, runs the model's own init_weights (so the same random
draws happen in the same order as in one process), then copies each rank's slice of every full
tensor into its shard. The values are never communicated: each rank cuts its own slice.

Cost: while init runs, every rank holds the full model in the parameters' dtype (fp32: 4 bytes
per parameter, 32 GB for an 8B model) on top of its shards, and draws all the random numbers of
the full model. Fine up to a few billion parameters on one GPU; beyond that
the way out is a block-by-block init (init_weights per block, full tensors of one block at a
time, same draw order) or loading a checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    # src_data_rank=None: every rank already holds the same full tensor, so each just cuts its
    # own shard (no scatter/broadcast), with DTensor's own sharding rules (uneven shards,
    # FSDP-over-TP strided sharding) rather than a copy of them here.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _init_full_then_shard(
    model: nn.Module, init: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    swapped: list[tuple[nn.Module, str, DTensor]] = []
    fulls: dict[int, torch.Tensor] = {}  # by id of the DTensor parameter: tied weights share one
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            full = fulls.get(id(param))
            if full is None:
                local = param.to_local()
                full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
                fulls[id(param)] = full
            # Straight into _parameters: setattr would insist on an nn.Parameter, and the
            # DTensor Parameter object must come back unchanged (FSDP2 and the optimizer hold it).
            module._parameters[name] = full
            swapped.append((module, name, param))
    try:
        result = init(*args, **kwargs)
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
    with torch.no_grad():
        done: set[int] = set()
        for _, _, param in swapped:
            if id(param) in done or param.to_local().is_meta:
                continue
            done.add(id(param))
            param.to_local().copy_(_local_slice(fulls[id(param)], param))
    return result


def apply_reproducible_init(model: nn.Module) -> None:
    """Wrap model.init_weights (in place) so that after parallelization it gives the same values
    as on the unsharded model. Call after every step that turns parameters into DTensors."""
    if getattr(model, "_reproducible_init", False):
        return
    # An instance attribute shadows the class method; the original stays reachable as
    # type(model).init_weights.
    model.init_weights = functools.partial(_init_full_then_shard, model, model.init_weights)
    model._reproducible_init = True
