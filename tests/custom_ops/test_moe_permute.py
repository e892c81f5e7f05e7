"""Tests of graphtrain::moe_permute / moe_unpermute (and moe_unpermute_backward).

The oracle is the plain dispatch of models/moe.py in float64 with torch autograd: xs =
x[order // k], y = empty_like(ys).index_copy_(0, order, ys), out = (y.view(T, k, D) * w[...,
None]).sum(1). Orders are argsorts of random expert indices (as the model makes them) and
random permutations; shapes are odd (T, D not multiples of any block, k not a power of two).
CPU runs the ops' reference path; the Triton kernels run under TRITON_INTERPRET=1 in a child
process (the interpreter is chosen at import) in fp32. GPU tests (marker gpu) check the CUDA
kernels in fp32 and bf16.
"""

from __future__ import annotations

import sys

import pytest
import torch

from graphtrain.custom_ops import moe_permute as mp

SHAPES = [(13, 3, 10), (37, 2, 45), (8, 1, 16), (21, 8, 33)]  # (T, k, D)


def _inputs(T: int, k: int, D: int, seed: int, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    experts = torch.randint(0, 5, (T, k), generator=g)
    order = torch.argsort(experts.flatten(), stable=True)
    if seed % 2:  # any permutation, not only an expert sort
        order = torch.randperm(T * k, generator=g)
    ys = torch.randn(T * k, D, generator=g, dtype=torch.float64)
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    grad_out = torch.randn(T, D, generator=g, dtype=torch.float64)
    grad_xs = torch.randn(T * k, D, generator=g, dtype=torch.float64)
    cast = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    return cast(x), order.to(device), cast(ys), cast(w), cast(grad_out), cast(grad_xs)


def _plain(x, order, ys, w, k):
    """The model's dispatch (float64 autograd oracle): (xs, out)."""
    T, D = x.shape
    xs = x[order // k]
    y = torch.empty_like(ys).index_copy_(0, order, ys)
    y = y.view(T, k, D)
    out = (y * w.unsqueeze(-1)).sum(1) if w is not None else y.sum(1)
    return xs, out


def _oracle(x, order, ys, w, grad_out, grad_xs, k):
    x, ys = x.double().requires_grad_(), ys.double().requires_grad_()
    w = w.double().requires_grad_() if w is not None else None
    xs, out = _plain(x, order, ys, w, k)
    inputs = [x, ys] + ([w] if w is not None else [])
    grads = torch.autograd.grad([xs, out], inputs, [grad_xs.double(), grad_out.double()])
    return xs.detach(), out.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_ops(x, order, ys, w, grad_out, grad_xs, k, tol, run_permute, run_unpermute, run_bwd):
    """The three entry points (forward permute, forward unpermute with and without weights,
    and the backward pieces) against the float64 oracle."""
    for weights in (w, None):
        rxs, rout, rgrads = _oracle(x, order, ys, weights, grad_out, grad_xs, k)
        xs = run_permute(x, order, k)
        assert torch.equal(xs.double(), rxs.to(x.dtype).double()), "permute is a pure gather"
        out = run_unpermute(ys, order, weights, k)
        assert _rel(out, rout) < tol
        # d x of the permute: a plain sum of each token's k slot gradients
        assert _rel(run_unpermute(grad_xs, order, None, k), rgrads[0]) < tol
        if weights is not None:
            grad_ys, grad_w = run_bwd(grad_out, ys, order, weights, k)
            assert _rel(grad_ys, rgrads[1]) < tol
            assert _rel(grad_w, rgrads[2]) < tol
        else:
            assert _rel(run_permute(grad_out, order, k), rgrads[1]) < tol


@pytest.mark.parametrize("T,k,D", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_ops_match_float64(T, k, D, seed):
    """Through torch.ops and autograd (the CPU path is the reference), against the oracle."""
    x, order, ys, w, grad_out, grad_xs = _inputs(T, k, D, seed)
    x, ys, w = x.requires_grad_(), ys.requires_grad_(), w.requires_grad_()
    xs = torch.ops.graphtrain.moe_permute(x, order, k)
    out = torch.ops.graphtrain.moe_unpermute(ys, order, w, k)
    grads = torch.autograd.grad([xs, out], [x, ys, w], [grad_xs, grad_out])
    rxs, rout, rgrads = _oracle(x.detach(), order, ys.detach(), w.detach(), grad_out, grad_xs, k)
    assert torch.equal(xs, rxs)
    for got, want in zip((out, *grads), (rout, *rgrads), strict=True):
        assert _rel(got, want) < 1e-12


@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck_float64(seed):
    x, order, ys, w, *_ = _inputs(5, 3, 4, seed)
    torch.autograd.gradcheck(
        lambda x: torch.ops.graphtrain.moe_permute(x, order, 3), (x.requires_grad_(),)
    )
    torch.autograd.gradcheck(
        lambda ys, w: torch.ops.graphtrain.moe_unpermute(ys, order, w, 3),
        (ys.requires_grad_(), w.requires_grad_()),
    )
    torch.autograd.gradcheck(
        lambda ys: torch.ops.graphtrain.moe_unpermute(ys, order, None, 3), (ys.requires_grad_(),)
    )


def test_dtypes_and_casts():
    """permute casts to `dtype` (its gradient comes back in x's dtype); unpermute sums in fp32
    and returns `dtype`, by default the promotion of ys's and the weights' dtypes."""
    x, order, ys, w, *_ = _inputs(9, 2, 6, 0, dtype=torch.float32)
    x = x.requires_grad_()
    xs = torch.ops.graphtrain.moe_permute(x, order, 2, dtype=torch.bfloat16)
    assert xs.dtype == torch.bfloat16 and torch.equal(xs, x.detach()[order // 2].bfloat16())
    (gx,) = torch.autograd.grad(xs, x, torch.ones_like(xs))
    assert gx.dtype == torch.float32 and torch.equal(gx, torch.full_like(gx, 2.0))
    ys16 = ys.bfloat16()
    assert torch.ops.graphtrain.moe_unpermute(ys16, order, w, 2).dtype == torch.float32
    assert torch.ops.graphtrain.moe_unpermute(ys16, order, None, 2).dtype == torch.bfloat16
    out = torch.ops.graphtrain.moe_unpermute(ys16, order, w, 2, dtype=torch.bfloat16)
    want = (ys16.float()[torch.argsort(order)].view(9, 2, 6) * w.unsqueeze(-1)).sum(1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())


def test_empty_batch():
    x = torch.zeros(0, 8, requires_grad=True)
    order = torch.zeros(0, dtype=torch.int64)
    xs = torch.ops.graphtrain.moe_permute(x, order, 4)
    out = torch.ops.graphtrain.moe_unpermute(xs, order, torch.zeros(0, 4), 4)
    assert xs.shape == (0, 8) and out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8)


BAD = [
    (lambda x, o, w: (x[0], o, w), "expected 2-D token rows"),
    (lambda x, o, w: (x.long(), o, w), "must be floating point"),
    (lambda x, o, w: (x, o.int(), w), "1-D int64 permutation"),
    (lambda x, o, w: (x, o[:-1], w), "order has 17 slots, expected T\\*k = 6 \\* 3"),
    (lambda x, o, w: (x, o, w[:, :2]), "weights must be a floating \\[T, k\\] = \\[6, 3\\]"),
]


@pytest.mark.parametrize("change,match", BAD)
def test_bad_arguments_raise(change, match):
    """Checked where shapes are known (the fake, so at trace time, and the CUDA entry)."""
    x, order, _, w, *_ = _inputs(6, 3, 4, 0, dtype=torch.float32)
    x, order, w = change(x, order, w)
    with pytest.raises(ValueError, match=match):
        mp.check_dispatch_args(x, order, 3, w, 6)


def test_bad_arguments_raise_eagerly():
    x, order, ys, *_ = _inputs(6, 3, 4, 0, dtype=torch.float32)
    with pytest.raises(ValueError, match="order has 17 slots"):
        torch.ops.graphtrain.moe_permute(x, order[:-1], 3)
    with pytest.raises(ValueError, match="ys has 17 rows, order 18 slots"):
        torch.ops.graphtrain.moe_unpermute(ys[:-1], order, None, 3)


def test_bad_arguments_raise_at_trace_time():
    _, order, ys, w, *_ = _inputs(6, 3, 4, 0, dtype=torch.float32)
    f = torch.compile(
        lambda ys, w: torch.ops.graphtrain.moe_unpermute(ys, order[:-1], w, 3),
        backend="aot_eager",
        fullgraph=True,
    )
    with pytest.raises(Exception, match="ys has 18 rows, order 17 slots"):
        f(ys, w)


def test_opcheck():
    x, order, ys, w, grad_out, _ = _inputs(7, 3, 5, 0, dtype=torch.float32)
    x, ys, w = x.requires_grad_(), ys.requires_grad_(), w.requires_grad_()
    torch.library.opcheck(torch.ops.graphtrain.moe_permute.default, (x, order, 3))
    torch.library.opcheck(
        torch.ops.graphtrain.moe_permute.default, (x, order, 3), {"dtype": torch.bfloat16}
    )
    torch.library.opcheck(torch.ops.graphtrain.moe_unpermute.default, (ys, order, w, 3))
    torch.library.opcheck(torch.ops.graphtrain.moe_unpermute.default, (ys, order, None, 3))
    torch.library.opcheck(
        torch.ops.graphtrain.moe_unpermute_backward.default,
        (grad_out, ys.detach(), order, w.detach(), 3),
    )


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, tiny shapes)
# ------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: both kernels on CPU, fp32, against the oracle."""
    assert mp._interpreting()
    for T, k, D in [*SHAPES, (5, 3, 1500)]:  # D above one 1024-column block
        for seed in (0, 1):
            inputs = _inputs(T, k, D, seed, dtype=torch.float32)
            check_ops(
                *inputs,
                k,
                2e-6,
                lambda x, o, k: mp.moe_permute_triton(x, o, k),
                lambda ys, o, w, k: mp.moe_unpermute_triton(ys, o, w, k, dtype=torch.float32),
                mp.moe_unpermute_backward_triton,
            )
        print(f"interpreter T={T} k={k} D={D} ok")
    print("interpreter all ok")


def test_triton_kernels_under_interpreter():
    if mp._interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("T,k,D", [*SHAPES, (4099, 6, 1024), (1000, 8, 7168)])
def test_cuda_matches_float64(T, k, D, dtype, tol):
    x, order, ys, w, grad_out, grad_xs = _inputs(T, k, D, T, dtype=dtype, device="cuda")
    ops = torch.ops.graphtrain
    check_ops(
        x,
        order,
        ys,
        w.float(),
        grad_out,
        grad_xs,
        k,
        tol,
        lambda x, o, k: ops.moe_permute(x, o, k),
        lambda ys, o, w, k: ops.moe_unpermute(ys, o, w, k, dtype=torch.float32),
        ops.moe_unpermute_backward,
    )


def test_benchmark_cpu_smoke():
    """benchmarks/moe_dispatch.py imports, the pass inserts both ops, and the results agree."""
    from conftest import run_benchmark_smoke  # not at the top: this file also runs as a script

    run_benchmark_smoke(
        "moe_dispatch.py", "cpu smoke: eager and graphtrain (both ops inserted) agree"
    )


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
