"""Expert parallel: the routed experts of MoE blocks split over the "ep" mesh axis, tokens moved
to their experts' ranks and back with all-to-all, as a ParallelStyle around the experts module.

What
    ExpertParallel is a ParallelStyle for a GroupedExperts (models/moe.py), on a mesh ("ep",)
    or, with expert tensor parallel (etp = tp), ("ep", "tp"); apply_ep(model, mesh) applies it
    to every GroupedExperts of a meta-device MoE model. The stacked weights w1/w2/w3 become
    DTensors Shard(0) on "ep" (on "tp" also split on EXPERT_HIDDEN_DIM). The module's own
    forward runs between two hooks: dispatch (the counts and the rows sorted by expert sent by
    all-to-all, re-sorted by local expert; the split sizes reach the host in one .tolist(), a
    device sync per MoE layer) and combine (un-sort, all-to-all back: the rows return in the
    order they left, (T*k, dim)). The rest of the block stays local to the rank.
    expert_params(model) lists those DTensor parameters; reduce_expert_grads(params, group,
    dp_size) finishes their gradients once per step: summed over the ranks that hold the same
    experts and divided by the number of data-parallel ranks, FSDP's mean over ranks (FSDP2
    leaves these weights alone).

Compiled
    Both all-to-alls are functional collectives: one graph per block, and the passes see the
    same router, permutation, expert GEMMs and combine as without ep. Only the received rows
    have a data-dependent count; the rows coming back have the static shape (T*k, dim).
The exchange step by step, the compiled shapes and why this shape: docs/design/parallel.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.moe import EXPERT_HIDDEN_DIM, GroupedExperts

_WEIGHTS = ("w1", "w2", "w3")
_AXES = (("ep",), ("ep", "tp"))


def _shard_weights(experts: nn.Module, mesh: DeviceMesh) -> None:
    """w1/w2/w3 -> DTensors: Shard(0) over "ep", and the hidden dim over "tp" if present."""
    axes = tuple(mesh.mesh_dim_names)
    for name in _WEIGHTS:
        full = getattr(experts, name)
        placements = [Shard(0), Shard(EXPERT_HIDDEN_DIM[name])][: len(axes)]
        for i, (axis, placement) in enumerate(zip(axes, placements, strict=True)):
            if full.shape[placement.dim] % mesh.size(i):
                what = "num_experts" if placement.dim == 0 else "moe_ffn_dim"
                raise ValueError(
                    f"model.{what}={full.shape[placement.dim]} is not divisible by "
                    f"parallel.{axis}={mesh.size(i)}"
                )
        # Each rank cuts its own block (on the meta device: no data, no communication).
        shard = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
        setattr(experts, name, nn.Parameter(shard, full.requires_grad))


class ExpertParallel(ParallelStyle):
    """Shard a GroupedExperts over "ep" and exchange its rows with all-to-all around its
    forward (module docstring). One instance per module: it keeps the routes of the forwards
    in flight (dispatch pushes, combine pops; a recompute pairs them the same way)."""

    def __init__(self) -> None:
        super().__init__()
        self._routes: list[tuple[torch.Tensor, list, list]] = []

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        axes = tuple(device_mesh.mesh_dim_names or ())
        if axes not in _AXES:
            raise ValueError(f"ExpertParallel wants a mesh with axes {_AXES}, got {axes}")
        # The group's name, not the group: the group would be an input of the compiled graphs,
        # which keep it to the end of the process (docs/design/parallel.md, "The end of a job").
        self._group = device_mesh.get_group("ep").group_name
        self._ep = device_mesh.size(0)
        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: _shard_weights(mod, mesh) if mod is module else None,
            self._dispatch,
            self._combine,
        )

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        xs, counts = inputs
        ep, num_local = self._ep, counts.numel() // self._ep
        # recv[s, e]: rows source rank s sends to local expert e.
        recv = all_to_all_single(counts, None, None, self._group).view(ep, num_local)
        sizes = torch.cat([counts.view(ep, num_local).sum(1), recv.sum(1)]).tolist()
        for size in sizes:
            torch._check(size >= 0)
        # Written so that the sent rows add up to xs's own (static) row count.
        send = [*sizes[: ep - 1], xs.shape[0] - sum(sizes[: ep - 1])]
        received = sizes[ep:]
        xr = all_to_all_single_autograd(xs, received, send, self._group)  # source, then expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(num_local, device=xs.device).repeat(ep),
            recv.flatten(),
            output_size=xr.shape[0],
        )
        order = torch.argsort(expert_of_row, stable=True)
        self._routes.append((order, send, received))
        return xr[order], recv.sum(0)

    def _combine(self, module: nn.Module, ys: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, send, received = self._routes.pop()
        yr = torch.empty_like(ys).index_copy_(0, order, ys)  # back to arrival order
        return all_to_all_single_autograd(yr, send, received, self._group)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """ExpertParallel on every GroupedExperts of `model` (in place, on the meta device): the
    mesh's axes are ("ep",), or ("ep", "tp") to split the experts' hidden dim over tp too. A
    model without any (a pipeline rank whose stages hold dense layers only) is left as it is:
    the config refuses ep > 1 for a dense model."""
    axes = tuple(mesh.mesh_dim_names or ())
    if axes not in _AXES:
        raise ValueError(f"apply_ep wants a mesh with axes ('ep',) or ('ep', 'tp'), got {axes}")
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            ExpertParallel()._apply(module, mesh)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel weights (DTensors on a mesh with an "ep" axis; expert weights split
    by tp alone are ordinary TP parameters, which FSDP shards and reduces)."""
    return [
        p
        for m in model.modules()
        if isinstance(m, GroupedExperts)
        for p in (getattr(m, name) for name in _WEIGHTS)
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    ]


@torch.no_grad()
def reduce_expert_grads(
    params: list[nn.Parameter], group: dist.ProcessGroup | None, dp_size: int
) -> None:
    """Sum the expert gradients over the ranks holding the same experts, then divide by the
    number of data-parallel ranks (see the module docstring). Once per step, after backward."""
    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local()
        if group is not None:
            dist.all_reduce(local, group=group)
        local.div_(dp_size)
