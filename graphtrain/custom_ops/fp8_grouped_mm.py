"""graphtrain::fp8_grouped_mm: the MoE experts' grouped GEMM with FP8 operands, forward and backward.

What
    fp8_grouped_mm(x [M, K], weight [E, N, K], offs [E] int32, *, e4m3_grads=False,
                   pow2_scale=False, out_dtype=None)
        -> (out [M, N], x8_t, x_scale_inv, w8_t, w_scale_inv)
    out[rows of e] = x[rows of e] @ weight[e]^T, rows of e = offs[e-1]:offs[e] (offs[-1] = 0),
    i.e. torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs) (models/moe.py's experts),
    with both operands in E4M3 and fp32 accumulation; out in out_dtype (default x's). Output 0
    is the result; the others are the FP8 copies the backward uses (x8_t [K, M], w8_t
    [E, K, N]) and their inverse scales.
    Backward (graphtrain::fp8_grouped_mm_backward): the output gradient is cast once (E5M2, or
    E4M3 with e4m3_grads), then per expert e
        dgrad  grad_x[rows of e] = g8[rows of e] @ w8_t[e]^T      (grad_out W_e)
        wgrad  grad_w[e] = g8_t[:, rows of e] @ x8_t[:, rows of e]^T   (grad_out^T x)
    An expert without rows gets a zero weight gradient.

Scaling
    x and grad_out: per tensor (one amax over all rows, graphtrain::fp8_amax). The weight: per
    expert (one amax per expert matrix): torch._scaled_grouped_mm on H100 (sm90) takes only
    row-wise scales, never one scale per tensor, and a per-expert weight scale is what a
    row-wise scale broadcast over an expert's columns can express, so the same recipe can run
    there unchanged. Numerics as graphtrain::fp8_linear.

Kernels and what is not built
    torch._scaled_grouped_mm does not run on CPU (torch 2.13: no CPU kernel), so the op runs
    each expert's GEMM with torch._scaled_mm (per-tensor scales) in a loop over the groups;
    the loop reads offs on the host (one synchronisation per call). The CUDA registration is
    the same loop: wiring torch._scaled_grouped_mm (row-wise scales, groups padded to 16 rows)
    is the GPU follow-up and is unmeasured. The casts are graphtrain::fp8_cast (Triton on
    CUDA), one per expert for the weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.fp8_linear import E4M3, E5M2, cast_pair

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: Tensor, weight: Tensor, offs: Tensor, out_dtype: torch.dtype | None) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"fp8_grouped_mm needs x [M, K] and weight [E, N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if offs.shape != (weight.shape[0],) or offs.dtype != torch.int32:
        raise ValueError(
            f"offs must be int32 [E] = [{weight.shape[0]}] (end row of each expert), got "
            f"{offs.dtype} {tuple(offs.shape)}"
        )
    for name, dtype in (("x", x.dtype), ("weight", weight.dtype), ("out_dtype", out_dtype)):
        if dtype is not None and dtype not in _OUT_DTYPES:
            raise ValueError(f"fp8_grouped_mm {name} must be one of {_OUT_DTYPES}, got {dtype}")


def _groups(offs: Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert; reads offs on the host."""
    ends = offs.tolist()
    return [(e, ends[e - 1] if e else 0, end) for e, end in enumerate(ends)]


def fp8_grouped_mm_ref(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    *,
    pow2_scale: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    x8, x8_t, sx = cast_pair(x, torch.ops.graphtrain.fp8_amax(x), E4M3, pow2_scale, "activation")
    w8, w8_t, sw = [], [], []
    for w in weight.unbind(0):
        w8_e, w8_t_e, sw_e = cast_pair(
            w, torch.ops.graphtrain.fp8_amax(w), E4M3, pow2_scale, "weight"
        )
        w8.append(w8_e), w8_t.append(w8_t_e), sw.append(sw_e)
    out_dtype = out_dtype or x.dtype
    out = x.new_zeros(x.shape[0], weight.shape[1], dtype=out_dtype)
    for e, start, end in _groups(offs):
        if end > start:
            out[start:end] = torch._scaled_mm(
                x8[start:end], w8[e].t(), sx, sw[e], out_dtype=out_dtype
            )
    return out, x8_t, sx, torch.stack(w8_t), torch.stack(sw)


def fp8_grouped_mm_backward_ref(
    grad_out: Tensor,
    x8_t: Tensor,
    x_scale_inv: Tensor,
    w8_t: Tensor,
    w_scale_inv: Tensor,
    offs: Tensor,
    *,
    e4m3_grads: bool,
    pow2_scale: bool,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    amax = torch.ops.graphtrain.fp8_amax(grad_out)
    g8, g8_t, sg = cast_pair(grad_out, amax, E4M3 if e4m3_grads else E5M2, pow2_scale, "gradient")
    E, K, N = w8_t.shape
    grad_x = grad_out.new_zeros(grad_out.shape[0], K, dtype=x_dtype)
    grad_w = grad_out.new_zeros(E, N, K, dtype=w_dtype)
    for e, start, end in _groups(offs):
        if end == start:
            continue
        sw = w_scale_inv[e]
        grad_x[start:end] = torch._scaled_mm(g8[start:end], w8_t[e].t(), sg, sw, out_dtype=x_dtype)
        # Row-major slices of the transposed copies: g8_t[:, rows] [N, m] and x8_t[:, rows]^T
        # [m, K] column-major, as _scaled_mm wants its operands.
        a, b = g8_t[:, start:end].contiguous(), x8_t[:, start:end].contiguous()
        grad_w[e] = torch._scaled_mm(a, b.t(), sg, x_scale_inv, out_dtype=w_dtype)
    return grad_x, grad_w


@torch.library.custom_op(
    "graphtrain::fp8_grouped_mm",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor weight, Tensor offs, *, bool e4m3_grads=False, "
        "bool pow2_scale=False, ScalarType? out_dtype=None) "
        "-> (Tensor out, Tensor x8_t, Tensor x_scale_inv, Tensor w8_t, Tensor w_scale_inv)"
    ),
)
def fp8_grouped_mm(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    *,
    e4m3_grads: bool = False,
    pow2_scale: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Grouped x @ weight[e]^T from FP8 operands (and the FP8 copies the backward uses)."""
    _check(x, weight, offs, out_dtype)
    return fp8_grouped_mm_ref(x, weight, offs, pow2_scale=pow2_scale, out_dtype=out_dtype)


@fp8_grouped_mm.register_fake
def _fp8_grouped_mm_fake(x, weight, offs, *, e4m3_grads=False, pow2_scale=False, out_dtype=None):
    _check(x, weight, offs, out_dtype)
    M, K = x.shape
    E, N, _ = weight.shape
    return (
        x.new_empty((M, N), dtype=out_dtype or x.dtype),
        x.new_empty((K, M), dtype=E4M3),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((E, K, N), dtype=E4M3),
        x.new_empty((E,), dtype=torch.float32),
    )


@torch.library.custom_op(
    "graphtrain::fp8_grouped_mm_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor x8_t, Tensor x_scale_inv, Tensor w8_t, Tensor w_scale_inv, "
        "Tensor offs, *, bool e4m3_grads, bool pow2_scale, ScalarType x_dtype, "
        "ScalarType w_dtype) -> (Tensor grad_x, Tensor grad_w)"
    ),
)
def fp8_grouped_mm_backward(
    grad_out: Tensor,
    x8_t: Tensor,
    x_scale_inv: Tensor,
    w8_t: Tensor,
    w_scale_inv: Tensor,
    offs: Tensor,
    *,
    e4m3_grads: bool,
    pow2_scale: bool,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_w) of fp8_grouped_mm from its saved FP8 copies."""
    return fp8_grouped_mm_backward_ref(
        grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, offs, e4m3_grads=e4m3_grads,
        pow2_scale=pow2_scale, x_dtype=x_dtype, w_dtype=w_dtype,
    )  # fmt: skip


@fp8_grouped_mm_backward.register_fake
def _fp8_grouped_mm_backward_fake(grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, offs, *,
                                  e4m3_grads, pow2_scale, x_dtype, w_dtype):  # fmt: skip
    E, K, N = w8_t.shape
    return (
        grad_out.new_empty((grad_out.shape[0], K), dtype=x_dtype),
        grad_out.new_empty((E, N, K), dtype=w_dtype),
    )


def _setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: tuple) -> None:
    x, weight, offs = inputs
    _, x8_t, sx, w8_t, sw = output
    ctx.save_for_backward(x8_t, sx, w8_t, sw, offs)
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.options = {k: bool(keyword_only_inputs.get(k)) for k in ("e4m3_grads", "pow2_scale")}


def _backward(ctx: Any, grad_out: Tensor, *unused: Tensor) -> tuple:
    x8_t, sx, w8_t, sw, offs = ctx.saved_tensors
    grad_x, grad_w = torch.ops.graphtrain.fp8_grouped_mm_backward(
        grad_out, x8_t, sx, w8_t, sw, offs, x_dtype=ctx.x_dtype, w_dtype=ctx.w_dtype,
        **ctx.options,
    )  # fmt: skip
    return grad_x, grad_w, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup)
