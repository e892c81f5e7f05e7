"""clip_grad_norm_: plain tensors against torch, and DTensor grads on several meshes (gloo).

The distributed tests build the same full gradients on every rank (same seed), shard them as
DTensors over 1-D and 2-D meshes (and over sub-meshes of a 2-D mesh in one call), and check that
the returned norm and the clipped full gradients equal torch's clip on the unsharded gradients.
"""

import pytest
import torch
from parallel_dist import run_ranks
from torch.distributed.tensor import DTensor

from graphtrain.optim import clip_grad_norm_

NORM_TYPES = [2.0, 1.0, float("inf")]


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_plain_matches_torch(norm_type, max_norm):
    shapes = [(4, 3), (7,), (2, 2, 5)]
    params, ref = make_params(shapes), make_params(shapes)
    norm = clip_grad_norm_(params, max_norm, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    torch.testing.assert_close(norm, ref_norm)
    assert norm.dim() == 0
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_no_clip_when_max_norm_not_positive():
    params, ref = make_params([(4, 3)]), make_params([(4, 3)])
    norm = clip_grad_norm_(params, 0.0)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(ref[0].grad))
    assert torch.equal(params[0].grad, ref[0].grad)


def test_tied_counted_once_and_missing_grads_skipped():
    (p,) = make_params([(3, 3)])
    q = torch.nn.Parameter(torch.zeros(2))  # no grad
    norm = clip_grad_norm_([p, q, p], 0.0)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(p.grad))
    assert clip_grad_norm_([q], 1.0).item() == 0.0


def test_non_finite_norm_is_returned():
    params = make_params([(3,), (2,)])
    params[1].grad[0] = float("inf")
    norm = clip_grad_norm_(params, 1.0)
    assert norm.item() == float("inf")
    params[0].grad[0] = float("nan")
    assert clip_grad_norm_(params, 1.0).isnan()


# ---------------------------------------------------------------- distributed (gloo, CPU)


def check_case(specs, max_norm):
    """specs: (shape, mesh, placements) per parameter; compare against torch on full grads."""
    from torch.distributed.tensor import distribute_tensor

    shapes = [shape for shape, _, _ in specs]
    for norm_type in NORM_TYPES:
        full = make_params(shapes, seed=1)
        ref = make_params(shapes, seed=1)
        if max_norm > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
        else:  # torch would zero the grads; max_norm <= 0 means "do not clip" here
            ref_norm = torch.nn.utils.get_total_norm([r.grad for r in ref], norm_type)
        params = []
        for p, (_, mesh, placements) in zip(full, specs, strict=True):
            d = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
            d.grad = distribute_tensor(p.grad, mesh, placements)
            params.append(d)
        norm = clip_grad_norm_(params, max_norm, norm_type)
        assert not isinstance(norm, DTensor) and norm.dim() == 0, norm
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
        for d, r in zip(params, ref, strict=True):
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6)


def worker(rank: int, world_size: int, case: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if case == "1d":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        specs = [
            ((8, 6), mesh, [Shard(0)]),
            ((5, 3), mesh, [Shard(0)]),  # uneven: 3 + 2 rows
            ((6, 4), mesh, [Shard(1)]),
            ((7,), mesh, [Replicate()]),
        ]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        specs = [
            ((8, 6), mesh, [Shard(0), Shard(1)]),  # FSDP + column-wise TP
            ((6, 8), mesh, [Shard(0), Shard(0)]),  # FSDP + row-wise TP
            ((5,), mesh, [Shard(0), Replicate()]),  # FSDP'd norm weight, replicated on tp
            ((3, 4), mesh["dp"], [Shard(0)]),  # only on the dp sub-mesh
            ((7, 2), mesh["tp"], [Replicate()]),  # only on the tp sub-mesh
            ((4,), mesh["tp"], [Shard(0)]),
        ]
    check_case(specs, max_norm=1.0)  # clips: the grad norms are ~5-10
    check_case(specs, max_norm=0.0)  # norm only
    if case == "1d":
        # The parameter-norm metric: a (1, 3) weight sharded over 2 ranks leaves rank 1 an
        # empty shard; it still joins the reduction and gets the same global norm.
        from torch.distributed.tensor import distribute_tensor

        from graphtrain.optim import global_norm

        full = [torch.arange(3.0).reshape(1, 3), torch.ones(5)]
        sharded = [distribute_tensor(full[0], mesh, [Shard(0)]), full[1]]
        assert sharded[0].to_local().numel() == (3 if rank == 0 else 0)
        torch.testing.assert_close(global_norm(sharded[:1]), torch.tensor(5.0**0.5))
        torch.testing.assert_close(global_norm(sharded), torch.tensor(10.0**0.5))


@pytest.mark.parametrize(("case", "world_size"), [("1d", 2), ("2d", 4)])
def test_dtensor_grads_match_full(case, world_size):
    run_ranks(worker, world_size, case)
