"""graphtrain::moe_weighted_swiglu: the routed experts' SwiGLU times each row's routing weight.

What
    moe_weighted_swiglu(ab [N, 2F], ws [N]) -> h [N, F] in ab's dtype,
        h[r] = silu(a[r]) * b[r] * ws[r],   a = ab[:, :F], b = ab[:, F:]
    (ab: the gate and up projections as one grouped GEMM writes them, fuse_sibling_grouped_mm;
    ws: each row's routing weight, fold_routing_weights). Its backward,
    moe_weighted_swiglu_backward(grad_h, ab, ws) -> (grad_ab [N, 2F] in ab's dtype, grad_ws [N]
    in ws's dtype), computes the weights' gradient sum_f grad_h * silu(a) * b in the same pass
    over the rows as grad_ab: Inductor, given the same math as torch ops, ran that row sum as a
    kernel of its own that read grad_h and ab a second time (docs/design/moe_dispatch.md).
    CPU: the *_ref functions; CUDA: one Triton kernel each way, BLOCK_N rows per program.

Numerics
    Everything in fp32 (fp64 for fp64 inputs, the reference path), each output rounded once to
    its dtype: the values Inductor's fused kernels give for the same torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.utils import compute_dtype, interpreting


def check_swiglu_args(ab: Tensor, ws: Tensor) -> None:
    """ValueError naming the bad value."""
    if ab.dim() != 2 or ab.shape[1] % 2:
        raise ValueError(f"ab must be [N, 2F] (gate and up side by side), got {tuple(ab.shape)}")
    if not ab.dtype.is_floating_point or not ws.dtype.is_floating_point:
        raise ValueError(f"ab and ws must be floating point, got {ab.dtype} and {ws.dtype}")
    if ws.shape != (ab.shape[0],):
        raise ValueError(
            f"ws must be [N] = [{ab.shape[0]}] (one weight a row), got {tuple(ws.shape)}"
        )


def moe_weighted_swiglu_ref(ab: Tensor, ws: Tensor) -> Tensor:
    acc = compute_dtype(ab.dtype)
    a, b = ab.to(acc).chunk(2, dim=1)
    return (a * torch.sigmoid(a) * b * ws.to(acc).unsqueeze(1)).to(ab.dtype)


def moe_weighted_swiglu_backward_ref(
    grad_h: Tensor, ab: Tensor, ws: Tensor
) -> tuple[Tensor, Tensor]:
    acc = compute_dtype(ab.dtype)
    a, b = ab.to(acc).chunk(2, dim=1)
    g, w = grad_h.to(acc), ws.to(acc).unsqueeze(1)
    s = torch.sigmoid(a)
    silu = a * s
    grad_ws = (g * silu * b).sum(1)
    gw = g * w
    grad_ab = torch.cat([gw * b * s * (1 + a * (1 - s)), gw * silu], dim=1)
    return grad_ab.to(ab.dtype), grad_ws.to(ws.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA; run on CPU tensors under TRITON_INTERPRET=1 in the tests)
# --------------------------------------------------------------------------------------------


@triton.jit
def _rows(N, BLOCK_N: tl.constexpr):
    """This program's BLOCK_N row indices (int64) and which of them exist."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < N


@triton.jit
def _gate_up(ab_ptr, rows, r_ok, f0, F: tl.constexpr, BLOCK_F: tl.constexpr):
    """Columns [f0, f0 + BLOCK_F) of the rows' gate a and up b (fp32), their offsets in ab
    (the a half's; b's are F further), the row index times F plus the column, and the mask."""
    c = f0 + tl.arange(0, BLOCK_F)
    m = r_ok[:, None] & (c < F)[None, :]
    at = rows[:, None] * (2 * F) + c[None, :]
    a = tl.load(ab_ptr + at, mask=m, other=0.0).to(tl.float32)
    b = tl.load(ab_ptr + at + F, mask=m, other=0.0).to(tl.float32)
    return a, b, at, rows[:, None] * F + c[None, :], m


@triton.jit
def _swiglu_fwd_kernel(
    ab_ptr,  # [N, 2F]
    ws_ptr,  # [N]
    h_ptr,  # [N, F]
    N,
    F: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Rows [pid * BLOCK_N, +BLOCK_N): h = silu(a) * b * w."""
    rows, r_ok = _rows(N, BLOCK_N)
    w = tl.load(ws_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    for f0 in range(0, F, BLOCK_F):
        a, b, _, at_h, m = _gate_up(ab_ptr, rows, r_ok, f0, F, BLOCK_F)
        h = a * tl.sigmoid(a) * b * w[:, None]
        tl.store(h_ptr + at_h, h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(
    grad_h_ptr,  # [N, F]
    ab_ptr,  # [N, 2F]
    ws_ptr,  # [N]
    grad_ab_ptr,  # [N, 2F]
    grad_ws_ptr,  # [N]
    N,
    F: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Rows [pid * BLOCK_N, +BLOCK_N): grad_ab and grad_ws = sum_f grad_h * silu(a) * b."""
    rows, r_ok = _rows(N, BLOCK_N)
    w = tl.load(ws_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    dot = tl.zeros([BLOCK_N], dtype=tl.float32)
    out_ty = grad_ab_ptr.dtype.element_ty
    for f0 in range(0, F, BLOCK_F):
        a, b, at, at_h, m = _gate_up(ab_ptr, rows, r_ok, f0, F, BLOCK_F)
        g = tl.load(grad_h_ptr + at_h, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        silu = a * s
        dot += tl.sum(g * silu * b, axis=1)
        gw = g * w[:, None]
        tl.store(grad_ab_ptr + at, (gw * b * s * (1.0 + a * (1.0 - s))).to(out_ty), mask=m)
        tl.store(grad_ab_ptr + at + F, (gw * silu).to(out_ty), mask=m)
    tl.store(grad_ws_ptr + rows, dot.to(grad_ws_ptr.dtype.element_ty), mask=r_ok)


def _blocks(F: int) -> dict[str, int]:
    """BLOCK_F columns (at most 256) by BLOCK_N rows: 2048 elements of each operand a step."""
    block_f = min(triton.next_power_of_2(max(F, 1)), 256)
    return {"BLOCK_F": block_f, "BLOCK_N": max(2048 // block_f, 1)}


def moe_weighted_swiglu_triton(ab: Tensor, ws: Tensor) -> Tensor:
    ab, ws = ab.contiguous(), ws.contiguous()
    N, F = ab.shape[0], ab.shape[1] // 2
    h = torch.empty(N, F, dtype=ab.dtype, device=ab.device)
    if N and F:
        blocks = _blocks(F)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]),)
        _swiglu_fwd_kernel[grid](ab, ws, h, N, F=F, **blocks, num_warps=4)
    return h


def moe_weighted_swiglu_backward_triton(
    grad_h: Tensor, ab: Tensor, ws: Tensor
) -> tuple[Tensor, Tensor]:
    grad_h, ab, ws = grad_h.contiguous(), ab.contiguous(), ws.contiguous()
    N, F = ab.shape[0], ab.shape[1] // 2
    grad_ab = torch.empty_like(ab)
    grad_ws = torch.zeros_like(ws)
    if N and F:
        blocks = _blocks(F)
        grid = (triton.cdiv(N, blocks["BLOCK_N"]),)
        _swiglu_bwd_kernel[grid](grad_h, ab, ws, grad_ab, grad_ws, N, F=F, **blocks, num_warps=4)
    return grad_ab, grad_ws


def _use_triton(t: Tensor) -> bool:
    return t.dtype != torch.float64 and (t.is_cuda or interpreting())


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "graphtrain::moe_weighted_swiglu", mutates_args=(), schema="(Tensor ab, Tensor ws) -> Tensor"
)
def moe_weighted_swiglu(ab: Tensor, ws: Tensor) -> Tensor:
    """h [N, F] = silu(a) * b * ws[:, None] in ab's dtype. This body is the CPU kernel."""
    check_swiglu_args(ab, ws)
    return moe_weighted_swiglu_ref(ab, ws)


@moe_weighted_swiglu.register_fake
def _moe_weighted_swiglu_fake(ab, ws):
    check_swiglu_args(ab, ws)
    return ab.new_empty((ab.shape[0], ab.shape[1] // 2))


@moe_weighted_swiglu.register_kernel("cuda")
def _moe_weighted_swiglu_cuda(ab, ws):
    check_swiglu_args(ab, ws)
    run = moe_weighted_swiglu_triton if _use_triton(ab) else moe_weighted_swiglu_ref
    return run(ab, ws)


@torch.library.custom_op(
    "graphtrain::moe_weighted_swiglu_backward",
    mutates_args=(),
    schema="(Tensor grad_h, Tensor ab, Tensor ws) -> (Tensor grad_ab, Tensor grad_ws)",
)
def moe_weighted_swiglu_backward(grad_h: Tensor, ab: Tensor, ws: Tensor) -> tuple[Tensor, Tensor]:
    """(d ab, d ws) of moe_weighted_swiglu. The body is the CPU kernel."""
    return moe_weighted_swiglu_backward_ref(grad_h, ab, ws)


@moe_weighted_swiglu_backward.register_fake
def _moe_weighted_swiglu_backward_fake(grad_h, ab, ws):
    return torch.empty_like(ab), torch.empty_like(ws)


@moe_weighted_swiglu_backward.register_kernel("cuda")
def _moe_weighted_swiglu_backward_cuda(grad_h, ab, ws):
    use = _use_triton(ab)
    run = moe_weighted_swiglu_backward_triton if use else moe_weighted_swiglu_backward_ref
    return run(grad_h, ab, ws)


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    ab, ws = ctx.saved_tensors
    return torch.ops.graphtrain.moe_weighted_swiglu_backward(grad_h, ab, ws)


moe_weighted_swiglu.register_autograd(_backward, setup_context=_setup)
