"""Expert parallel: the routed experts of MoE blocks split over the "ep" mesh axis, tokens moved
to their experts' ranks and back with all-to-all.

What
    apply_ep(model, ep_mesh) on a meta-device MoE model (models/moe.py): every
    GroupedExperts' stacked weights w1/w2/w3 (E, ., .) become DTensors Shard(0) on ep_mesh
    (rank r holds experts [r * E/ep, (r + 1) * E/ep)), and its `run` (rows sorted by expert ->
    outputs) is replaced by the exchange below. Everything else of the block (attention,
    router, shared experts, permutation and combination) stays local to the rank.
        1. counts (E,) -> all-to-all -> recv (ep, E/ep): rows each source rank sends to each of
           this rank's experts; the split sizes go to the host (.tolist(): a device sync per
           MoE layer, which variable-size all-to-all needs)
        2. the sorted rows (already contiguous per destination rank) -> all-to-all
        3. re-sort the received rows by local expert, grouped GEMMs on the local weights,
           un-sort, all-to-all back: the rows return in the order they left.
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
    (ep = dp_shard shards them fully).
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
from torch.distributed.tensor import DTensor, Shard

from models.moe import GroupedExperts, swiglu_experts

_WEIGHTS = ("w1", "w2", "w3")


def _all_to_all_run(
    experts: GroupedExperts, xs: torch.Tensor, counts: torch.Tensor, *, ep_mesh: DeviceMesh
) -> torch.Tensor:
    group, ep = ep_mesh.get_group(), ep_mesh.size()
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


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every GroupedExperts of `model` over `ep_mesh` (in place, on the meta device)."""
    ep = ep_mesh.size()
    found = False
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        found = True
        num_experts = module.w1.shape[0]
        if num_experts % ep:
            raise ValueError(
                f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}"
            )
        rank = ep_mesh.get_local_rank()
        rows = slice(rank * num_experts // ep, (rank + 1) * num_experts // ep)
        for name in _WEIGHTS:
            full = getattr(module, name)
            local = full.detach()[rows]
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(shard, full.requires_grad))
        # An instance attribute shadows GroupedExperts.run for this module only.
        module.run = functools.partial(
            torch._dynamo.disable(_all_to_all_run), module, ep_mesh=ep_mesh
        )
    if not found:
        raise ValueError("parallel.ep > 1 needs an MoE model (one with routed experts)")


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [
        getattr(m, name)
        for m in model.modules()
        if isinstance(m, GroupedExperts)
        for name in _WEIGHTS
        if isinstance(getattr(m, name), DTensor)
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
