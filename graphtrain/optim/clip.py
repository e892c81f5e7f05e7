"""Gradient norm clipping that is correct for DTensor gradients on several meshes.

What: `clip_grad_norm_` computes the global norm of all gradients (as if every gradient were one
unsharded tensor on one rank) and scales the gradients so that norm is at most `max_norm`.

Why not `torch.nn.utils.clip_grad_norm_`: it stacks the per-tensor norms of all gradients, which
fails or is wrong when the gradients are DTensors on different meshes (FSDP2 parameters on the dp
mesh next to tensor-parallel parameters on a 2-D dp x tp mesh, or expert parameters on an ep mesh).
Here gradients are grouped by (mesh, placements); each group's norm is computed by
`torch.nn.utils.get_total_norm`, which for DTensors returns a DTensor with a Partial placement, and
`.full_tensor()` reduces it over that group's mesh. The group norms are plain tensors and are
combined locally: sum of p-th powers then p-th root, or max for the inf-norm.

No host sync: the clip coefficient min(1, max_norm / (norm + 1e-6)) stays a tensor and is applied
with `torch._foreach_mul_` (`scale_grads_`), so this can run inside a compiled or CUDA-graphed
step. Every rank must call this with the same parameters in the same order (the reductions are
collectives). `scale=` hands the coefficient to something else instead: AdamWCopies multiplies
the gradients by it as its step reads them, which saves the foreach pass over every gradient
(read and written: 8 bytes a parameter in fp32).

Numerics: norms are computed in the gradients' dtype by get_total_norm (as torch does); a
non-finite norm is returned as is and the gradients become NaN/zero - the trainer checks the norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

# How the gradients get multiplied by the clip coefficient: (gradients, coefficient) -> None.
GradScale = Callable[[list[torch.Tensor], torch.Tensor], None]


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (total_norm + 1e-6)), a tensor (no host sync), as torch computes it."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Every gradient times `coef`, in place: a DTensor's local shard (the coefficient is the
    same on every rank, so scaling each shard scales the DTensor without DTensor dispatch)."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_device_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (device, _dtype), tensors in by_device_dtype.items():
        torch._foreach_mul_(tensors, coef.to(device))


def _group_key(grad: torch.Tensor) -> tuple:
    """Group key: DTensor grads by (mesh, placements), plain grads by nothing (one group)."""
    if isinstance(grad, DTensor):
        return ("dtensor", grad.device_mesh, tuple(grad.placements))
    return ("plain",)


def _full_norm(group: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of one group of gradients, reduced over the group's mesh when they are DTensors."""
    norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=None)
    if isinstance(norm, DTensor):
        # Partial (sharded grads) or Replicate placement; full_tensor() all-reduces the former.
        norm = norm.full_tensor()
    return norm


def _combine_norms(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Combine per-group norms into the norm of the concatenation of all groups."""
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


@torch.no_grad()
def global_norm(tensors: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all `tensors` (plain or DTensors, sharded or not) as if they were one unsharded
    tensor: a 0-d plain tensor, equal on every rank. A collective over every mesh involved: every
    rank must call it with the same tensors, including a rank whose shards are empty."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_group_key(t), []).append(t)
    norms = [_full_norm(group, float(norm_type)) for group in groups.values()]
    return norms[0] if len(norms) == 1 else _combine_norms(norms, float(norm_type))


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    scale: GradScale = scale_grads_,
) -> torch.Tensor:
    """Clip gradients by their global norm (in place, or as `scale` does it) and return that norm.

    Returns the true global norm (before clipping) as a plain 0-d tensor (float32 when the
    gradients are on several meshes or dtypes; the gradient dtype's norm otherwise, as torch does).
    `max_norm <= 0` computes and returns the norm without clipping. Parameters without a gradient
    are skipped; the same parameter passed twice (tied weights) is counted once.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)

    grads: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in parameters:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grads.append(p.grad)
    if not grads:
        return torch.tensor(0.0)

    total_norm = global_norm(grads, norm_type)

    if max_norm > 0:
        scale(grads, clip_coefficient(total_norm, max_norm))
    return total_norm
