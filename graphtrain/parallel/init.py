"""Seeded init of a parallelized model that gives every parameter the values of the unsharded
fp32 model's init with the same seed (rounded to the parameter's dtype), whatever the layout
(tp, FSDP, HSDP, or any mix) and whatever the storage dtype (training.master_dtype).

What we do: model.init_weights is wrapped; while the model's own init_weights runs, every
torch.nn.init initialiser (normal_, trunc_normal_, ones_, ...) and, through a torch-function mode,
every random in-place Tensor method (normal_, uniform_, ...) called on a DTensor parameter runs on
a plain full-size tensor instead, so the same random draws happen in the same order, on the
same tensor shapes, as in one process; then it copies this rank's slice into the shard and drops
the full tensor. The values are never communicated: each rank cuts its own slice.
Low-precision parameters (bf16/fp16) take the same detour through an fp32 full-size tensor:
drawn in fp32 and rounded once, they start from the fp32 run's weights.

Cost: at most one full-size tensor at a time on top of the shards (the largest parameter: the
embedding or one block's largest matrix, in fp32 where the parameter is low-precision), whatever
the number of blocks; every rank still draws all the random numbers of the full model (time,
not memory).
Why not DTensor's random ops, and why low precision draws in fp32: docs/design/parallel.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode


def _local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    # src_data_rank=None: every rank already holds the same full tensor, so each just cuts its
    # own shard (no scatter/broadcast), with DTensor's own sharding rules (uneven shards,
    # FSDP-over-TP strided sharding) rather than a copy of them here.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


# Random in-place Tensor methods (a model may call them on a parameter directly).
RANDOM_INPLACE = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
}
# torch.nn.init's in-place initialisers (normal_, trunc_normal_, ones_, xavier_uniform_, ...).
# Most do not dispatch on their tensor (trunc_normal_ is a sequence of Tensor ops with rejection
# steps), so they are swapped for wrappers while init runs rather than caught by the mode.
_NN_INIT = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]


def _low_precision(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() < 4


def _drawn_elsewhere(t: torch.Tensor) -> bool:
    """Whether init draws t's values on a full-size fp32-or-wider tensor (module docstring)."""
    return isinstance(t, DTensor) or _low_precision(t)


def _full_like(param: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the parameter's global shape, on its device, in fp32 where the parameter
    is low-precision (the only large allocation)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    dtype = torch.float32 if _low_precision(param) else param.dtype
    return torch.empty(param.shape, dtype=dtype, device=local.device)


def _on_full(fn: Callable[..., Any], param: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """fn applied to a full-size tensor; this rank's slice of the result copied (rounded to its
    dtype) into `param`."""
    full = _full_like(param)
    fn(full, *args, **kwargs)
    local, values = param, full
    if isinstance(param, DTensor):
        local, values = param.to_local(), _local_slice(full, param)
    if not local.is_meta:
        with torch.no_grad():
            local.copy_(values)
    return param


def _full_size_nn_init(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _drawn_elsewhere(tensor):
            return _on_full(fn, tensor, *args, **kwargs)
        return fn(tensor, *args, **kwargs)

    return init


class _FullSizeDraws(TorchFunctionMode):
    """Random in-place Tensor methods on a DTensor or a low-precision tensor run on a full fp32
    tensor, of which this rank keeps its slice (on CPU, DTensor would give every shard the same
    numbers)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_INPLACE and args and _drawn_elsewhere(args[0]):
            return _on_full(func, args[0], *args[1:], **kwargs)
        return func(*args, **kwargs)


def _init_full_then_shard(init: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    originals = {name: getattr(nn.init, name) for name in _NN_INIT}
    try:
        for name, fn in originals.items():
            setattr(nn.init, name, _full_size_nn_init(fn))
        with _FullSizeDraws():
            return init(*args, **kwargs)
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def apply_reproducible_init(model: nn.Module) -> None:
    """Wrap model.init_weights (in place) so that after parallelization it gives the same values
    as on the unsharded fp32 model. Call after every step that turns parameters into DTensors."""
    if getattr(model, "_reproducible_init", False):
        return
    # An instance attribute shadows the class method; the original stays reachable as
    # type(model).init_weights.
    model.init_weights = functools.partial(_init_full_then_shard, model.init_weights)
    model._reproducible_init = True
