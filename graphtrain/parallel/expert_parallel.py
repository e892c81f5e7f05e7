"""Expert parallel: the routed experts of MoE blocks split over the "ep" mesh axis, tokens moved
to their experts' ranks and back with all-to-all.

What
    apply_ep(model, mesh) on a meta-device MoE model (models/moe.py), mesh ("ep",) or, with
    expert tensor parallel (etp = tp), ("ep", "tp"): every GroupedExperts' stacked weights
    w1/w2/w3 (E, ., .) become DTensors Shard(0) on "ep" (rank r holds experts
    [r * E/ep, (r + 1) * E/ep)), and on "tp" also split on their hidden dim
    (EXPERT_HIDDEN_DIM). Its `run` (rows sorted by expert -> outputs) is replaced by
    the exchange below. Everything else of the block (attention, router, shared experts,
    permutation and combination) stays local to the rank.
        1. counts (E,) -> all-to-all -> recv (ep, E/ep): rows each source rank sends to each of
           this rank's experts; the split sizes go to the host (.tolist(): a device sync per
           MoE layer, which variable-size all-to-all needs)
        2. the sorted rows (already contiguous per destination rank) -> all-to-all
        3. re-sort the received rows by local expert, grouped GEMMs on the local weights,
           un-sort, all-to-all back: the rows return in the order they left.
    With etp = tp the tp ranks of a group route the same (gathered) tokens the same way, and
    each exchanges them with the ranks of its own tp index; its grouped GEMMs on its hidden
    slice give partial sums over tp, which the layer's tensor-parallel output style
    reduce-scatters (models/moe_plan.py), as without expert parallelism.
    expert_params(model) lists those DTensor parameters; reduce_expert_grads(params, group,
    dp_size) finishes their gradients once per step (see below).

Why this shape
    ep is carved out of dp_shard (graphtrain.parallel.mesh): expert-parallel ranks read
    different rows, so a rank's expert gradient is the sum over the source ranks of d(their
    local loss)/dW. FSDP2 does not manage the expert weights (apply_fsdp gets them as
    ignored_params: their sharding is ep's, not dp_shard's); instead reduce_expert_grads sums
    them over the ranks that hold the same experts (dp_replicate x dp_shard_mod_ep) and divides
    by the number of data-parallel ranks, which is exactly FSDP's mean over ranks for the other
    parameters. Expert weights are therefore replicated, not sharded, over dp_shard_mod_ep
    (ep = dp_shard shards them fully). With etp = tp every tp rank's gradient is already
    the whole gradient of its slice (its partial output got the full output gradient).
    The exchange has data-dependent sizes, so it runs outside the compiled graph
    (torch._dynamo.disable): an MoE block compiles into the part before and the part after it
    (the trainer compiles with fullgraph=False when ep > 1). Compute dtype: the local weights
    are cast to the rows' dtype (FSDP's mixed precision does not see them).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.moe import EXPERT_HIDDEN_DIM, GroupedExperts, swiglu_experts

_WEIGHTS = ("w1", "w2", "w3")


def _all_to_all_run(
    experts: GroupedExperts, xs: torch.Tensor, counts: torch.Tensor, *, mesh: DeviceMesh
) -> torch.Tensor:
    group, ep = mesh.get_group("ep"), mesh.size(mesh.mesh_dim_names.index("ep"))
    num_local = counts.numel() // ep
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    recv = recv.view(ep, num_local)  # recv[s, e]: rows rank s sends to local expert e
    in_splits = counts.view(ep, num_local).sum(1).tolist()  # host sync (see the docstring)
    out_splits = recv.sum(1).tolist()
    xr = all_to_all_single_autograd(xs, out_splits, in_splits, group)  # by source, then expert
    expert_of_row = torch.repeat_interleave(
        torch.arange(num_local, device=xs.device).repeat(ep), recv.flatten()
    )
    order = torch.argsort(expert_of_row, stable=True)
    w1, w2, w3 = (getattr(experts, n).to_local().to(xr.dtype) for n in _WEIGHTS)
    ys = swiglu_experts(xr[order], recv.sum(0), w1, w2, w3)
    yr = torch.empty_like(ys).index_copy_(0, order, ys)
    return all_to_all_single_autograd(yr, in_splits, out_splits, group)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every GroupedExperts of `model` over `mesh` (in place, on the meta device): its
    axes are ("ep",), or ("ep", "tp") to split the experts' hidden dim over tp as well."""
    axes = tuple(mesh.mesh_dim_names or ())
    if axes not in (("ep",), ("ep", "tp")):
        raise ValueError(f"apply_ep wants a mesh with axes ('ep',) or ('ep', 'tp'), got {axes}")
    found = False
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        found = True
        for name in _WEIGHTS:
            full = getattr(module, name)
            placements = [Shard(0), Shard(EXPERT_HIDDEN_DIM[name])][: len(axes)]
            for axis, placement in zip(axes, placements, strict=True):
                size = mesh.size(axes.index(axis))
                if full.shape[placement.dim] % size:
                    what = "num_experts" if placement.dim == 0 else "moe_ffn_dim"
                    raise ValueError(
                        f"model.{what}={full.shape[placement.dim]} is not divisible by "
                        f"parallel.{axis}={size}"
                    )
            # Each rank cuts its own block (on the meta device: no data, no communication).
            shard = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
            setattr(module, name, nn.Parameter(shard, full.requires_grad))
        # An instance attribute shadows GroupedExperts.run for this module only.
        module.run = functools.partial(torch._dynamo.disable(_all_to_all_run), module, mesh=mesh)
    if not found:
        raise ValueError("parallel.ep > 1 needs an MoE model (one with routed experts)")


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
