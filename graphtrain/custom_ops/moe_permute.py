"""graphtrain::moe_permute and graphtrain::moe_unpermute: MoE token dispatch and weighted combine.

What
    The two data movements around the experts (models/moe.py, routed_experts), for T tokens
    routed to k experts each, slot s = t * k + j being token t's j-th choice, and `order`
    [T*k] int64 a permutation of the slots (argsort of the flattened expert indices, so that
    each expert's slots are contiguous):
        moe_permute(x [T, D], order, top_k, *, dtype=None) -> xs [T*k, D]
            xs[r] = x[order[r] // k]                  (cast to dtype, default x's)
        moe_unpermute(ys [T*k, D], order, weights [T, k] or None, top_k, *, dtype=None)
            -> out [T, D],  out[t] = sum_j ys[inv[t*k + j]] * weights[t, j]
               (inv the inverse permutation; weights None: a plain sum; the sum in fp32, then
               cast to dtype, default the promotion of ys's and weights' dtypes)
    They are each other's backward; d weights comes from moe_unpermute_backward. `order` must
    be a permutation of range(T*k): the op does not check it (that would synchronise with the
    host); the pass only inserts it where `order` is an argsort. CPU: the *_ref functions;
    CUDA: two Triton kernels shared by the pair (_scatter_kernel, _gather_kernel), one program
    per token, no atomics.

Numerics
    The permutation is exact; the sums (over k, and the weights' gradient over D) are fp32 and
    deterministic. Why the ops walk tokens and not slots, with measurements:
    docs/design/moe_dispatch.md.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.utils import interpreting as _interpreting

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dispatch_args(
    rows: Tensor, order: Tensor, top_k: int, weights: Tensor | None, num_tokens: int
) -> None:
    """ValueError naming the bad value, for the arguments of both ops (`rows` is x or ys)."""
    if rows.dim() != 2:
        raise ValueError(f"expected 2-D token rows [rows, D], got shape {tuple(rows.shape)}")
    if rows.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"token rows must be floating point, got {rows.dtype}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if order.dim() != 1 or order.dtype != torch.int64:
        raise ValueError(
            f"order must be a 1-D int64 permutation of the T*k slots, got {order.dtype} "
            f"of shape {tuple(order.shape)}"
        )
    if order.shape[0] != num_tokens * top_k:
        raise ValueError(f"order has {order.shape[0]} slots, expected T*k = {num_tokens} * {top_k}")
    if weights is not None and (
        weights.shape != (num_tokens, top_k) or weights.dtype not in _FLOAT_DTYPES
    ):
        raise ValueError(
            f"weights must be a floating [T, k] = [{num_tokens}, {top_k}] tensor, got "
            f"{weights.dtype} of shape {tuple(weights.shape)}"
        )


def check_unpermute_args(ys: Tensor, order: Tensor, weights: Tensor | None, top_k: int) -> None:
    if ys.dim() >= 1 and order.dim() >= 1 and ys.shape[0] != order.shape[0]:
        raise ValueError(f"ys has {ys.shape[0]} rows, order {order.shape[0]} slots")
    check_dispatch_args(ys, order, top_k, weights, ys.shape[0] // top_k if top_k > 0 else 0)


def _unpermute_dtype(ys: Tensor, weights: Tensor | None, dtype: torch.dtype | None):
    if dtype is not None:
        return dtype
    return ys.dtype if weights is None else torch.promote_types(ys.dtype, weights.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# references (the CPU kernels and the tests' oracle)
# --------------------------------------------------------------------------------------------


def moe_permute_ref(
    x: Tensor, order: Tensor, top_k: int, *, dtype: torch.dtype | None = None
) -> Tensor:
    return x[order // top_k].to(dtype or x.dtype)


def moe_unpermute_ref(
    ys: Tensor,
    order: Tensor,
    weights: Tensor | None,
    top_k: int,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    out_dtype = _unpermute_dtype(ys, weights, dtype)
    acc = _acc_dtype(ys.dtype)
    T = order.shape[0] // top_k
    slots = torch.empty(ys.shape, dtype=acc, device=ys.device).index_copy_(0, order, ys.to(acc))
    slots = slots.view(T, top_k, ys.shape[1])
    if weights is not None:
        slots = slots * weights.to(acc).unsqueeze(-1)
    return slots.sum(1).to(out_dtype)


def moe_unpermute_backward_ref(
    grad_out: Tensor, ys: Tensor, order: Tensor, weights: Tensor, top_k: int
) -> tuple[Tensor, Tensor]:
    acc = _acc_dtype(ys.dtype)
    g = grad_out.to(acc)[order // top_k]  # (T*k, D): d out of each slot's token, in ys's order
    grad_ys = (g * weights.to(acc).flatten()[order].unsqueeze(-1)).to(ys.dtype)
    dots = (g * ys.to(acc)).sum(-1)  # (T*k,) in ys's order
    grad_weights = torch.empty_like(dots).index_copy_(0, order, dots).view_as(weights)
    return grad_ys, grad_weights.to(weights.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA; run on CPU tensors under TRITON_INTERPRET=1 in the tests)
# --------------------------------------------------------------------------------------------


@triton.jit
def _scatter_kernel(
    src_ptr,  # [T, D] token rows
    inv_ptr,  # [T*k] row of each slot
    w_ptr,  # [T*k] slot weights (HAS_W)
    other_ptr,  # [T*k, D] slot rows to dot with (HAS_DOT)
    out_ptr,  # [T*k, D]
    dot_ptr,  # [T*k] fp32, slot order (HAS_DOT)
    D: tl.constexpr,  # the model dim (Triton's interpreter needs constant loop bounds)
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DOT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token t's row to its k slot rows: out[inv[t*k + j]] = src[t] (* w[t, j]); with HAS_DOT
    also dot[t*k + j] = <src[t], other[inv[t*k + j]]>."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    j_ok = j < K
    rows = tl.load(inv_ptr + t * K + j, mask=j_ok, other=0)
    if HAS_W:
        w = tl.load(w_ptr + t * K + j, mask=j_ok, other=0.0).to(tl.float32)
    dot = tl.zeros([K_PAD], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        v = tl.load(src_ptr + t * D + c, mask=c < D, other=0.0).to(tl.float32)
        m = j_ok[:, None] & (c < D)[None, :]
        if HAS_DOT:
            o = tl.load(other_ptr + rows[:, None] * D + c[None, :], mask=m, other=0.0)
            dot += tl.sum(v[None, :] * o.to(tl.float32), axis=1)
        if HAS_W:
            vals = v[None, :] * w[:, None]
        else:
            vals = tl.broadcast_to(v[None, :], (K_PAD, BLOCK_D))
        ptrs = out_ptr + rows[:, None] * D + c[None, :]
        tl.store(ptrs, vals.to(out_ptr.dtype.element_ty), mask=m)
    if HAS_DOT:
        tl.store(dot_ptr + t * K + j, dot, mask=j_ok)


@triton.jit
def _gather_kernel(
    src_ptr,  # [T*k, D] slot rows
    inv_ptr,  # [T*k] row of each slot
    w_ptr,  # [T*k] slot weights (HAS_W)
    out_ptr,  # [T, D]
    D: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token t's k slot rows summed: out[t] = sum_j src[inv[t*k + j]] (* w[t, j]), in fp32."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    j_ok = j < K
    rows = tl.load(inv_ptr + t * K + j, mask=j_ok, other=0)
    if HAS_W:
        w = tl.load(w_ptr + t * K + j, mask=j_ok, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = j_ok[:, None] & (c < D)[None, :]
        v = tl.load(src_ptr + rows[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * w[:, None]
        tl.store(out_ptr + t * D + c, tl.sum(v, axis=0).to(out_ptr.dtype.element_ty), mask=c < D)


def _launch(kernel, T: int, D: int, top_k: int, order: Tensor, *tensors, **flags) -> None:
    """One program per token over the inverse of `order` (slot -> row)."""
    if T == 0 or D == 0:
        return
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(T * top_k, device=order.device))
    kernel[(T,)](
        tensors[0],
        inv,
        *tensors[1:],
        D=D,
        K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        BLOCK_D=min(triton.next_power_of_2(D), 1024),
        **flags,
        num_warps=4,
    )


def _scatter(
    src: Tensor,
    order: Tensor,
    top_k: int,
    dtype: torch.dtype,
    weights: Tensor | None = None,
    other: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """out [T*k, D]: each token's row at its k slot rows (* its weights); with `other`, also
    the fp32 dots <src[t], other[slot row]> as [T, k]."""
    src = src.contiguous()
    T, D = src.shape
    out = torch.empty(T * top_k, D, dtype=dtype, device=src.device)
    dot = None if other is None else torch.zeros(T, top_k, dtype=torch.float32, device=src.device)
    _launch(
        _scatter_kernel,
        T,
        D,
        top_k,
        order,
        src,
        weights.contiguous() if weights is not None else src,  # dummy pointer, never read
        other.contiguous() if other is not None else src,
        out,
        dot if dot is not None else out,
        HAS_W=weights is not None,
        HAS_DOT=other is not None,
    )
    return out, dot


def _gather(
    src: Tensor, order: Tensor, top_k: int, dtype: torch.dtype, weights: Tensor | None
) -> Tensor:
    """out [T, D]: each token's k slot rows summed (* its weights), fp32 sums."""
    src = src.contiguous()
    R, D = src.shape
    T = R // top_k
    out = torch.empty(T, D, dtype=dtype, device=src.device)
    _launch(
        _gather_kernel,
        T,
        D,
        top_k,
        order,
        src,
        weights.contiguous() if weights is not None else src,  # dummy pointer, never read
        out,
        HAS_W=weights is not None,
    )
    return out


def _use_triton(t: Tensor) -> bool:
    return t.dtype != torch.float64 and (t.is_cuda or _interpreting())


def moe_permute_triton(
    x: Tensor, order: Tensor, top_k: int, *, dtype: torch.dtype | None = None
) -> Tensor:
    return _scatter(x, order, top_k, dtype or x.dtype)[0]


def moe_unpermute_triton(
    ys: Tensor,
    order: Tensor,
    weights: Tensor | None,
    top_k: int,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    return _gather(ys, order, top_k, _unpermute_dtype(ys, weights, dtype), weights)


def moe_unpermute_backward_triton(
    grad_out: Tensor, ys: Tensor, order: Tensor, weights: Tensor, top_k: int
) -> tuple[Tensor, Tensor]:
    grad_ys, dots = _scatter(grad_out, order, top_k, ys.dtype, weights=weights, other=ys)
    return grad_ys, dots.view(weights.shape).to(weights.dtype)


# --------------------------------------------------------------------------------------------
# op registration
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "graphtrain::moe_permute",
    mutates_args=(),
    schema="(Tensor x, Tensor order, int top_k, *, ScalarType? dtype=None) -> Tensor",
)
def moe_permute(
    x: Tensor, order: Tensor, top_k: int, *, dtype: torch.dtype | None = None
) -> Tensor:
    """xs [T*k, D], xs[r] = x[order[r] // top_k] in `dtype`. This body is the CPU kernel."""
    check_dispatch_args(x, order, top_k, None, x.shape[0])
    return moe_permute_ref(x, order, top_k, dtype=dtype)


@moe_permute.register_fake
def _moe_permute_fake(x, order, top_k, *, dtype=None):
    check_dispatch_args(x, order, top_k, None, x.shape[0])
    return x.new_empty((order.shape[0], x.shape[1]), dtype=dtype or x.dtype)


@moe_permute.register_kernel("cuda")
def _moe_permute_cuda(x, order, top_k, *, dtype=None):
    check_dispatch_args(x, order, top_k, None, x.shape[0])
    run = moe_permute_triton if _use_triton(x) else moe_permute_ref
    return run(x, order, top_k, dtype=dtype)


@torch.library.custom_op(
    "graphtrain::moe_unpermute",
    mutates_args=(),
    schema=(
        "(Tensor ys, Tensor order, Tensor? weights, int top_k, *, ScalarType? dtype=None) -> Tensor"
    ),
)
def moe_unpermute(
    ys: Tensor,
    order: Tensor,
    weights: Tensor | None,
    top_k: int,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """out [T, D], out[t] = sum_j ys[inv[t*k + j]] * weights[t, j]. The body is the CPU kernel."""
    check_unpermute_args(ys, order, weights, top_k)
    return moe_unpermute_ref(ys, order, weights, top_k, dtype=dtype)


@moe_unpermute.register_fake
def _moe_unpermute_fake(ys, order, weights, top_k, *, dtype=None):
    check_unpermute_args(ys, order, weights, top_k)
    T = ys.shape[0] // top_k
    return ys.new_empty((T, ys.shape[1]), dtype=_unpermute_dtype(ys, weights, dtype))


@moe_unpermute.register_kernel("cuda")
def _moe_unpermute_cuda(ys, order, weights, top_k, *, dtype=None):
    check_unpermute_args(ys, order, weights, top_k)
    run = moe_unpermute_triton if _use_triton(ys) else moe_unpermute_ref
    return run(ys, order, weights, top_k, dtype=dtype)


@torch.library.custom_op(
    "graphtrain::moe_unpermute_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor ys, Tensor order, Tensor weights, int top_k) "
        "-> (Tensor grad_ys, Tensor grad_weights)"
    ),
)
def moe_unpermute_backward(
    grad_out: Tensor, ys: Tensor, order: Tensor, weights: Tensor, top_k: int
) -> tuple[Tensor, Tensor]:
    """(d ys, d weights) of moe_unpermute with weights. The body is the CPU kernel."""
    return moe_unpermute_backward_ref(grad_out, ys, order, weights, top_k)


@moe_unpermute_backward.register_fake
def _moe_unpermute_backward_fake(grad_out, ys, order, weights, top_k):
    return torch.empty_like(ys), torch.empty_like(weights)


@moe_unpermute_backward.register_kernel("cuda")
def _moe_unpermute_backward_cuda(grad_out, ys, order, weights, top_k):
    run = moe_unpermute_backward_triton if _use_triton(ys) else moe_unpermute_backward_ref
    return run(grad_out, ys, order, weights, top_k)


def _permute_setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Tensor) -> None:
    x, order, top_k = inputs
    ctx.save_for_backward(order)
    ctx.top_k, ctx.x_dtype = top_k, x.dtype


def _permute_backward(ctx: Any, grad_xs: Tensor) -> tuple:
    (order,) = ctx.saved_tensors
    grad_x = torch.ops.graphtrain.moe_unpermute(grad_xs, order, None, ctx.top_k, dtype=ctx.x_dtype)
    return grad_x, None, None


moe_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


def _unpermute_setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Tensor) -> None:
    ys, order, weights, top_k = inputs
    ctx.save_for_backward(ys, order, weights)
    ctx.top_k = top_k


def _unpermute_backward(ctx: Any, grad_out: Tensor) -> tuple:
    ys, order, weights = ctx.saved_tensors
    if weights is None:
        grad_ys = torch.ops.graphtrain.moe_permute(grad_out, order, ctx.top_k, dtype=ys.dtype)
        return grad_ys, None, None, None
    grad_ys, grad_weights = torch.ops.graphtrain.moe_unpermute_backward(
        grad_out, ys, order, weights, ctx.top_k
    )
    return grad_ys, None, grad_weights, None


moe_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
