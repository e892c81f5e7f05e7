"""Tests of graphtrain::moe_weighted_swiglu (and its backward op).

The oracle is the plain formula in float64 with torch autograd: a, b = ab.chunk(2, 1),
h = silu(a) * b * ws[:, None]; every gradient (ab and ws) against it. Shapes are odd (N and F
not multiples of any block, F above one 256-column block). CPU runs the ops' reference path;
the Triton kernels run under TRITON_INTERPRET=1 in a child process (the interpreter is chosen
at import) in fp32. GPU tests (marker gpu) check the CUDA kernels in fp32 and bf16.
"""

from __future__ import annotations

import sys

import pytest
import torch

from graphtrain.custom_ops import moe_swiglu as sw

SHAPES = [(13, 5), (37, 45), (8, 1), (21, 300)]  # (N, F)


def _inputs(N: int, F: int, seed: int, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ab = torch.randn(N, 2 * F, generator=g, dtype=torch.float64) * 2
    ws = torch.rand(N, generator=g, dtype=torch.float64)
    grad_h = torch.randn(N, F, generator=g, dtype=torch.float64)
    cast = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    return (
        cast(ab),
        ws.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype),
        cast(grad_h),
    )


def _oracle(ab, ws, grad_h):
    ab, ws = ab.double().requires_grad_(), ws.double().requires_grad_()
    a, b = ab.chunk(2, dim=1)
    h = torch.nn.functional.silu(a) * b * ws.unsqueeze(1)
    grad_ab, grad_ws = torch.autograd.grad(h, [ab, ws], grad_h.double())
    return h.detach(), grad_ab, grad_ws


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(ab, ws, grad_h, tol, forward, backward) -> None:
    h, grad_ab, grad_ws = _oracle(ab, ws, grad_h)
    got = forward(ab, ws)
    assert got.dtype == ab.dtype and got.shape == h.shape
    assert _rel(got, h) < tol
    got_ab, got_ws = backward(grad_h, ab, ws)
    assert got_ab.dtype == ab.dtype and got_ws.dtype == ws.dtype
    assert _rel(got_ab, grad_ab) < tol
    assert _rel(got_ws, grad_ws) < tol


@pytest.mark.parametrize("N,F", SHAPES)
def test_ops_match_float64(N, F):
    """Through torch.ops and autograd (the CPU path is the reference), against the oracle."""
    ab, ws, grad_h = _inputs(N, F, N)
    ab, ws = ab.requires_grad_(), ws.requires_grad_()
    h = torch.ops.graphtrain.moe_weighted_swiglu(ab, ws)
    grads = torch.autograd.grad(h, [ab, ws], grad_h)
    want = _oracle(ab.detach(), ws.detach(), grad_h)
    for got, w in zip((h, *grads), want, strict=True):
        assert _rel(got, w) < 1e-14


def test_gradcheck_float64():
    ab, ws, _ = _inputs(6, 5, 0)
    torch.autograd.gradcheck(
        torch.ops.graphtrain.moe_weighted_swiglu, (ab.requires_grad_(), ws.requires_grad_())
    )


def test_bf16_rounds_once():
    """bf16 rows: the product in fp32, rounded once (what Inductor's fused kernel stores)."""
    ab, ws, _ = _inputs(9, 7, 0, dtype=torch.bfloat16)
    a, b = ab.float().chunk(2, dim=1)
    want = (a * torch.sigmoid(a) * b * ws.unsqueeze(1)).bfloat16()
    assert torch.equal(torch.ops.graphtrain.moe_weighted_swiglu(ab, ws), want)


@pytest.mark.parametrize(
    "ab_shape,ws_shape,match",
    [
        ((4, 7), (4,), "ab must be \\[N, 2F\\]"),
        ((4, 6), (5,), "ws must be \\[N\\] = \\[4\\]"),
        ((4, 6, 1), (4,), "ab must be \\[N, 2F\\]"),
    ],
)
def test_bad_arguments_raise(ab_shape, ws_shape, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.graphtrain.moe_weighted_swiglu(torch.zeros(ab_shape), torch.zeros(ws_shape))


def test_opcheck():
    ab, ws, grad_h = _inputs(7, 5, 0, dtype=torch.float32)
    torch.library.opcheck(
        torch.ops.graphtrain.moe_weighted_swiglu.default,
        (ab.requires_grad_(), ws.requires_grad_()),
    )
    torch.library.opcheck(
        torch.ops.graphtrain.moe_weighted_swiglu_backward.default,
        (grad_h, ab.detach(), ws.detach()),
    )


# ------------------------------------------------------------------------------------------
# the Triton kernels, under the interpreter (fp32, small shapes)
# ------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: both kernels on CPU, fp32, against the oracle."""
    assert sw.interpreting()
    for N, F in [*SHAPES, (3, 600), (0, 4)]:  # 600: above one 256-column block
        inputs = _inputs(N, F, N + F, dtype=torch.float32)
        check(
            *inputs,
            2e-6,
            sw.moe_weighted_swiglu_triton,
            sw.moe_weighted_swiglu_backward_triton,
        )
        print(f"interpreter N={N} F={F} ok")
    print("interpreter all ok")


def test_triton_kernels_under_interpreter():
    if sw.interpreting():
        _interpreter_checks()
        return
    from conftest import run_interpreter_checks  # not at the top: this file also runs as a script

    run_interpreter_checks(__file__, "interpreter all ok")


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("N,F", [*SHAPES, (98304, 512), (4099, 768)])
def test_cuda_matches_float64(N, F, dtype, tol):
    """bf16: each output rounded once to bf16 (2^-9 relative), so 1e-2 of the norm bounds it
    with room; fp32: the kernels' fp32 arithmetic."""
    ab, ws, grad_h = _inputs(N, F, N, dtype=dtype, device="cuda")
    ops = torch.ops.graphtrain
    check(ab, ws, grad_h, tol, ops.moe_weighted_swiglu, ops.moe_weighted_swiglu_backward)


if __name__ == "__main__":
    if "--interpreter-checks" in sys.argv:
        _interpreter_checks()
