"""graphtrain::fp8_grouped_mm: the MoE experts' grouped GEMM with FP8 operands, forward and backward.

What
    fp8_grouped_mm(x [M, K], weight [E, N, K], offs [E] int32, *, e4m3_grads=False,
                   pow2_scale=False, out_dtype=None)
        -> (out [M, N], x8_t, x_scale_inv, w8_t, w_scale_inv)
    out[rows of e] = x[rows of e] @ weight[e]^T, rows of e = offs[e-1]:offs[e] (offs[-1] = 0),
    i.e. torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs) (models/moe.py's experts),
    both operands in E4M3, out in out_dtype (default x's). The other outputs are the FP8
    copies and inverse scales graphtrain::fp8_grouped_mm_backward uses: it casts the output
    gradient once, then per expert dgrad and wgrad. An expert without rows gets a zero weight
    gradient.
    Two paths, the same casts and FP8 bytes: the reference (the CPU kernel and the oracle;
    CUDA other than sm90) runs torch._scaled_mm per expert and reads offs on the host; sm90
    runs three torch._scaled_grouped_mm calls, no host synchronisation, with the wgrad's
    groups padded to multiples of 16 columns by the cast itself.

Numerics
    x and grad_out are scaled per tensor, the weight per expert (fp8_amax per slice, one
    fp8_cast); otherwise as graphtrain::fp8_linear. The sm90 path casts the gradient to E4M3
    whatever e4m3_grads says and rounds each GEMM's result to bf16 before out_dtype; rows past
    offs[-1] of out and grad_x are left uninitialised there (zeros in the reference).
    Scaling, both paths, what torch._scaled_grouped_mm takes, launch and byte counts:
    docs/design/fp8.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops import fp8_amax
from graphtrain.custom_ops.fp8_cast import GROUP_ALIGN, padded_offsets, padded_width
from graphtrain.custom_ops.fp8_linear import E4M3, E5M2, FORWARD_FAST_ACCUM, cast_pair

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch._scaled_grouped_mm: K and N multiples of 16 (groups along K start at multiples of 16
# elements: fp8_cast's padded groups), fewer than 1024 groups.
MAX_GROUPS = 1023


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


def _cast_operands(
    x: Tensor, weight: Tensor, offs: Tensor, pow2_scale: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x8 [M, K], x8_t [K, W] (columns in padded groups, fp8_cast's groups), x's scale_inv;
    w8 [E, N, K], w8_t [E, K, N], scale_inv [E] (each expert's weight scaled by its own
    amax: the per-slice amax and cast)."""
    ax = fp8_amax.amax(x)
    x8, x8_t, sx = cast_pair(x, ax, E4M3, pow2_scale, "activation", offs)
    aw = fp8_amax.amax(weight, per_slice=True)
    w8, w8_t, sw = cast_pair(weight, aw, E4M3, pow2_scale, "weight")
    return x8, x8_t, sx, w8, w8_t, sw


def _cast_grad(grad_out: Tensor, float8_dtype: torch.dtype, pow2_scale: bool, offs: Tensor):
    """g8 [M, N], g8_t [N, W] (columns in padded groups), scale_inv of the output gradient
    (per tensor)."""
    amax = fp8_amax.amax(grad_out)
    return cast_pair(grad_out, amax, float8_dtype, pow2_scale, "gradient", offs)


# The two GEMM shapes of the op, each as a loop of torch._scaled_mm (reference) and as one
# torch._scaled_grouped_mm (grouped). a8 / a8_t: FP8 rows with one scale sa (0-d); b8 / b8_t:
# per expert (b8 [E, P, Q], sb [E]) or rows with one scale (b8_t [Q, W], sb 0-d; the
# columns of a8_t and b8_t in padded groups).


def _rows_loop(a8: Tensor, sa: Tensor, b8: Tensor, sb: Tensor, offs: Tensor, out_dtype,
               fast_accum: bool):  # fmt: skip
    """out [M, P]: out[rows of e] = a8[rows of e] @ b8[e]^T (b8 [E, P, Q]); fast_accum: the
    forward's (FORWARD_FAST_ACCUM), False for the dgrad."""
    out = a8.new_zeros(a8.shape[0], b8.shape[1], dtype=out_dtype)
    for e, start, end in _groups(offs):
        if end > start:  # b8[e].t(): column-major, as _scaled_mm wants its second operand
            a, b = a8[start:end], b8[e].t()
            kwargs = dict(out_dtype=out_dtype, use_fast_accum=fast_accum)
            out[start:end] = torch._scaled_mm(a, b, sa, sb[e], **kwargs)
    return out


def _rows_grouped(a8: Tensor, sa: Tensor, b8: Tensor, sb: Tensor, offs: Tensor, out_dtype,
                  fast_accum: bool):  # fmt: skip
    """As _rows_loop, 2d-3d: row-wise scales sa per row of a8, sb per (expert, column)."""
    M, (E, P, _) = a8.shape[0], b8.shape
    scale_a = sa.expand(M).contiguous()
    scale_b = sb[:, None].expand(E, P).contiguous()
    out = torch._scaled_grouped_mm(
        a8, b8.transpose(-2, -1), scale_a, scale_b, offs, out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )  # fmt: skip
    return out.to(out_dtype)


def _experts_loop(a8_t, sa, b8_t, sb, offs, padded_offs, out_dtype, fast_accum: bool):
    """out [E, P, Q]: out[e] = a8_t[:, rows of e] @ b8_t[:, rows of e]^T (a8_t [P, W], b8_t
    [Q, W], expert e's rows in the columns from padded_offs[e - 1]); zero for an expert
    without rows. The op's wgrad promotes to fp32 (fast_accum False; True is
    benchmarks/fp8_linear.py's row that says what the promotion costs)."""
    out = a8_t.new_zeros(offs.shape[0], a8_t.shape[0], b8_t.shape[0], dtype=out_dtype)
    padded_ends = padded_offs.tolist()
    padded_starts = [0, *padded_ends[:-1]]
    for e, start, end in _groups(offs):
        if end > start:
            # Row-major slices: a [P, m] and b^T [m, Q] column-major, as _scaled_mm wants.
            # The whole padded group, m = ceil16(rows): CUDA's _scaled_mm needs the inner
            # dimension a multiple of 16, and the padding columns are zeros (they add exact
            # zeros to the fp32 sums, so the result is the same as over the rows alone).
            cols = slice(padded_starts[e], padded_ends[e])
            a, b = a8_t[:, cols].contiguous(), b8_t[:, cols].contiguous()
            kwargs = dict(out_dtype=out_dtype, use_fast_accum=fast_accum)
            out[e] = torch._scaled_mm(a, b.t(), sa, sb, **kwargs)
    return out


def _experts_grouped(a8_t, sa, b8_t, sb, offs, padded_offs, out_dtype, fast_accum: bool):
    """As _experts_loop, 2d-2d on the padded groups: scales per (group, row) of a, per
    (group, column) of the result."""
    E, P, Q = offs.shape[0], a8_t.shape[0], b8_t.shape[0]
    scale_a = sa.expand(E * P).contiguous()
    scale_b = sb.expand(E * Q).contiguous()
    out = torch._scaled_grouped_mm(
        a8_t, b8_t.t(), scale_a, scale_b, padded_offs, out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )  # fmt: skip
    return out.to(out_dtype)


def _forward_gemms(x, weight, offs, *, grouped, pow2_scale=False, out_dtype=None):
    """(out, x8_t, x_scale_inv, w8_t, w_scale_inv); grouped: one torch._scaled_grouped_mm (the
    sm90 kernel), else a loop of torch._scaled_mm over the experts (the CPU kernel)."""
    x8, x8_t, sx, w8, w8_t, sw = _cast_operands(x, weight, offs, pow2_scale)
    rows = _rows_grouped if grouped else _rows_loop
    out = rows(x8, sx, w8, sw, offs, out_dtype or x.dtype, FORWARD_FAST_ACCUM)
    return out, x8_t, sx, w8_t, sw


def _backward_gemms(grad_out, x8_t, sx, w8_t, sw, offs, *, grouped, e4m3_grads, pow2_scale,
                    x_dtype, w_dtype):  # fmt: skip
    """(grad_x, grad_w); grouped: two torch._scaled_grouped_mm (the sm90 kernel, whose gradient
    is E4M3 whatever e4m3_grads says: it takes no E5M2 operand), else loops of torch._scaled_mm
    over the experts (the CPU kernel)."""
    float8_dtype = E4M3 if e4m3_grads or grouped else E5M2
    g8, g8_t, sg = _cast_grad(grad_out, float8_dtype, pow2_scale, offs)
    rows, experts = (_rows_grouped, _experts_grouped) if grouped else (_rows_loop, _experts_loop)
    grad_x = rows(g8, sg, w8_t, sw, offs, x_dtype, False)
    grad_w = experts(g8_t, sg, x8_t, sx, offs, padded_offsets(offs), w_dtype, False)
    return grad_x, grad_w


fp8_grouped_mm_ref = functools.partial(_forward_gemms, grouped=False)
fp8_grouped_mm_cuda = functools.partial(_forward_gemms, grouped=True)
fp8_grouped_mm_backward_ref = functools.partial(_backward_gemms, grouped=False)
fp8_grouped_mm_backward_cuda = functools.partial(_backward_gemms, grouped=True)


def grouped_kernel_runs(t: Tensor, E: int, N: int, K: int) -> bool:
    """Whether torch._scaled_grouped_mm's row-wise FP8 kernel takes E experts [N, K] on t's
    device: CUDA sm90 (its only CUTLASS build; other GPUs run the loop), K and N multiples
    of 16, fewer than 1024 experts. Shapes it refuses run the loop, where torch._scaled_mm
    needs the same multiples of 16 on CUDA."""
    return (
        t.is_cuda
        and hasattr(torch, "_scaled_grouped_mm")
        and torch.cuda.get_device_capability(t.device) == (9, 0)
        and K % GROUP_ALIGN == 0
        and N % GROUP_ALIGN == 0
        and E <= MAX_GROUPS
    )


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
    """Grouped x @ weight[e]^T from FP8 operands (and the FP8 copies the backward uses).
    The body is the CPU kernel (and CUDA's where the grouped kernel does not run)."""
    _check(x, weight, offs, out_dtype)
    return fp8_grouped_mm_ref(x, weight, offs, pow2_scale=pow2_scale, out_dtype=out_dtype)


@fp8_grouped_mm.register_kernel("cuda")
def _fp8_grouped_mm_cuda(x, weight, offs, *, e4m3_grads=False, pow2_scale=False, out_dtype=None):
    _check(x, weight, offs, out_dtype)
    impl = fp8_grouped_mm_cuda if grouped_kernel_runs(x, *weight.shape) else fp8_grouped_mm_ref
    return impl(x, weight, offs, pow2_scale=pow2_scale, out_dtype=out_dtype)


@fp8_grouped_mm.register_fake
def _fp8_grouped_mm_fake(x, weight, offs, *, e4m3_grads=False, pow2_scale=False, out_dtype=None):
    _check(x, weight, offs, out_dtype)
    M, K = x.shape
    E, N, _ = weight.shape
    return (
        x.new_empty((M, N), dtype=out_dtype or x.dtype),
        x.new_empty((K, padded_width(M, E)), dtype=E4M3),
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


@fp8_grouped_mm_backward.register_kernel("cuda")
def _fp8_grouped_mm_backward_cuda(grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, offs, *,
                                  e4m3_grads, pow2_scale, x_dtype, w_dtype):  # fmt: skip
    E, K, N = w8_t.shape
    grouped = grouped_kernel_runs(grad_out, E, N, K)
    impl = fp8_grouped_mm_backward_cuda if grouped else fp8_grouped_mm_backward_ref
    return impl(
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
