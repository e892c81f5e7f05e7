"""graphtrain::fp8_grouped_mm: the MoE experts' grouped GEMM with FP8 operands, forward and backward.

What
    fp8_grouped_mm(x [M, K], weight [E, N, K], offs [E] int32, *, e4m3_grads=False,
                   pow2_scale=False, out_dtype=None)
        -> (out [M, N], x8_t, x_scale_inv, w8_t, w_scale_inv)
    out[rows of e] = x[rows of e] @ weight[e]^T, rows of e = offs[e-1]:offs[e] (offs[-1] = 0),
    i.e. torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs) (models/moe.py's experts),
    with both operands in E4M3 and fp32 accumulation; out in out_dtype (default x's). Output 0
    is the result; the others are the FP8 copies the backward uses (x8_t [K, W], x's rows
    as columns in the wgrad's padded groups, W = ceil16(M) + 16 E (padded_columns); w8_t
    [E, K, N]) and their inverse scales.
    Backward (graphtrain::fp8_grouped_mm_backward): the output gradient is cast once (E5M2, or
    E4M3 with e4m3_grads; always E4M3 on the grouped kernel, below), then per expert e
        dgrad  grad_x[rows of e] = g8[rows of e] @ w8_t[e]^T      (grad_out W_e)
        wgrad  grad_w[e] = g8_t[:, rows of e] @ x8_t[:, rows of e]^T   (grad_out^T x)
    An expert without rows gets a zero weight gradient.

Scaling
    x and grad_out: per tensor (one amax over all rows, graphtrain::fp8_amax). The weight: per
    expert (one amax per expert matrix: fp8_amax(weight, per_slice=True), then one
    graphtrain::fp8_cast of [E, N, K] with an [E] amax writes w8 and w8_t, each expert with
    its own scale, bit for bit what a cast per expert gives). torch._scaled_grouped_mm takes
    only row-wise scales, and both are written as such: a per-tensor scale repeated over the
    rows (or, in the wgrad, over each group's rows) and an expert's scale repeated over its
    output columns, so the grouped kernel computes the same recipe as the reference loop.
    Numerics otherwise as graphtrain::fp8_linear.

Two paths (the same casts, the same FP8 bytes; they differ in the GEMMs)
    reference (the CPU kernel and the oracle; CUDA devices other than sm90): per expert one
        torch._scaled_mm (per-tensor scales) in a loop over the groups; it reads offs on the
        host (one synchronisation per call; the wgrad also the padded groups' offsets). On
        CUDA, torch._scaled_mm needs the wgrad's inner dimension (a group's rows) a multiple
        of 16: the loop's wgrad runs over each expert's whole padded group (its rows and
        zero columns up to ceil16(rows)), so any row counts work on every device.
        Only sm90 takes the grouped path: torch builds the row-wise FP8 grouped kernel for
        sm90 alone (sm100's grouped FP8 kernels are block-scaled, another recipe).
    grouped (CUDA sm90, fp8_grouped_mm_cuda / fp8_grouped_mm_backward_cuda): three
        torch._scaled_grouped_mm calls, no host synchronisation, no loop over the experts'
        GEMMs:
            forward  2d-3d: x8 [M, K] row-major x w8 [E, N, K] viewed [E, K, N] column-major,
                     scale_a [M] = x's scale, scale_b [E, N] = each expert's scale
            dgrad    2d-3d: g8 [M, N] x w8_t [E, K, N] viewed [E, N, K] column-major,
                     scale_a [M], scale_b [E, K]
            wgrad    2d-2d with the groups along the contraction: g8_t [N, Mp] row-major x
                     x8_t [K, Mp] viewed [Mp, K] column-major -> [E, N, K], scale_a [E * N],
                     scale_b [E * K] (group-major)
        What torch._scaled_grouped_mm takes (torch 2.11 to 2.14, aten GroupedBlas.cpp and the
        Meta kernel in torch/_meta_registrations.py): both operands float8_e4m3fn (sm90's
        row-wise kernel has no E5M2), the first row-major, the second column-major; K and N
        multiples of 16 (and every leading stride a multiple of 16 bytes); float32 scales,
        contiguous; out_dtype bfloat16 only; at most 1023 groups. In the 2d-3d case groups of
        any size, empty ones included, are fine (the kernel's device-side checks look at a
        dynamic K or N only; its first version asserted multiples of 16 on every dynamic
        dimension: the GPU test, with groups of 40, 0, 7 and 81 rows, checks the installed
        torch); in the 2d-2d case (groups along K) every group but the last must be a
        multiple of 16 (TMA's 16-byte alignment of each group's start) and, in some
        versions, none may be empty (device asserts). So g8_t and x8_t are padded on the
        device (padded_columns, both paths): each expert's rows go to a group of max(16,
        ceil16(rows)) columns, the rest zeros (which add nothing), in buffers of a static
        width ceil16(M) + 16 E, offsets from a cumsum; rows past offs[-1] go after the last
        group, where no group reads them. The cast writes them there (fp8_cast's t_cols):
        the same read of x or grad_out that writes x8 or g8, no copy afterwards.
        What differs from the reference: the gradient is E4M3 whatever e4m3_grads says (with
        its per-tensor scale from the current amax, values below about 2^-10 / 448 of the
        amax flush to zero, counted in fp8/flushed/gradient, where E5M2 keeps values down to
        2^-17 / 57344 of it); each GEMM's result is rounded to bf16 before out_dtype
        (relative 2^-9, against the FP8 operands' 2^-4); rows past offs[-1] of out and
        grad_x are left as the kernel leaves them (its output is allocated uninitialised,
        as torch._grouped_mm's), zeros in the reference (the models' offs always end at M).
        fp32 accumulation (use_fast_accum=False), as the reference.
    Launches of the weight casts (both paths; Triton on CUDA, no sync): one per-slice
    fp8_amax (its kernel and the partials' torch.amax) and one fp8_cast (clamp, reciprocal
    and multiply for the scales, 3 more with pow2_scale, the reciprocal, the counts' zeros,
    the kernel, the counts' sum), then the 2 adds of the saturation counters: 11 launches
    (14 with pow2_scale) whatever E. Before, the same per expert plus 3 torch.stack: 11 E +
    3 = 707 at moe-1b's E = 64 (899 with pow2_scale), with 2 E = 128 custom-op calls from
    Python.
    The bytes are the same (the weight read twice, w8 and w8_t written: 6 bytes an element of
    a bf16 weight, 0.4 GB for the w1|w3 [64, 1024, 1024], ~0.13 ms at 3 TB/s); the kernels do not
    change. Prediction, unmeasured (no GPU where this was written): the weight casts of one
    call go from host-bound, ~700 launches at ~5 us of host time each plus the Python of
    128 op calls (~3-6 ms), to device-bound (~0.15 ms), i.e. ~3-6 ms less per expert GEMM
    call and layer; benchmarks/fp8_linear.py's grouped rows measure the whole.
    Bytes of the padding: a copy after the casts read g8_t and x8_t (N M + K M bytes) and
    wrote the padded buffers twice over (zeros, then the columns), (N + K)(W + 2 M) bytes:
    at moe-1b's fused w1|w3 experts (M = 98304 rows, N = K = 1024, W = M + 1024) ~0.6 GB.
    The cast writing the padded layout leaves the zero fill of the buffers, (N + K) W
    bytes ~0.2 GB, and the cast's read of t_cols (8 M bytes per 64 columns of x, ~13 MB);
    padded_columns (about ten small launches over offs and M rows) runs twice, in the
    forward and in the backward, once before. Prediction, unmeasured: ~0.4 GB, ~0.13 ms at
    3 TB/s less per wgrad, beside ~0.16 ms for the wgrad GEMM (2 M N K = 206 GFLOP at 1271
    TFLOP/s) and ~0.5 ms for the three; x8_t saved is 16 E columns (1 MB) larger.
    benchmarks/fp8_linear.py's grouped rows measure the whole. Not built: zeroing only the
    at most 16 E gap columns instead of the whole buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops.fp8_linear import E4M3, E5M2, cast_pair

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch._scaled_grouped_mm: K and N multiples of 16, groups along K starting at multiples of 16
# FP8 elements (16 bytes), fewer than 1024 groups.
GROUP_ALIGN, MAX_GROUPS = 16, 1023


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
    """x8 [M, K], x8_t [K, W] (columns in padded groups, padded_columns), x's scale_inv;
    w8 [E, N, K], w8_t [E, K, N], scale_inv [E] (each expert's weight scaled by its own
    amax: the per-slice amax and cast)."""
    dest, _, width = padded_columns(offs, x.shape[0])
    ax = torch.ops.graphtrain.fp8_amax(x)
    x8, x8_t, sx = cast_pair(x, ax, E4M3, pow2_scale, "activation", dest, width)
    aw = torch.ops.graphtrain.fp8_amax(weight, per_slice=True)
    w8, w8_t, sw = cast_pair(weight, aw, E4M3, pow2_scale, "weight")
    return x8, x8_t, sx, w8, w8_t, sw


def _cast_grad(
    grad_out: Tensor, float8_dtype: torch.dtype, pow2_scale: bool, dest: Tensor, width: int
):
    """g8 [M, N], g8_t [N, W] (columns in padded groups), scale_inv of the output gradient
    (per tensor)."""
    amax = torch.ops.graphtrain.fp8_amax(grad_out)
    return cast_pair(grad_out, amax, float8_dtype, pow2_scale, "gradient", dest, width)


# The two GEMM shapes of the op, each as a loop of torch._scaled_mm (reference) and as one
# torch._scaled_grouped_mm (grouped). a8 / a8_t: FP8 rows with one scale sa (0-d); b8 / b8_t:
# per expert (b8 [E, P, Q], sb [E]) or rows with one scale (b8_t [Q, W], sb 0-d; the
# columns of a8_t and b8_t in padded groups).


def _rows_loop(a8: Tensor, sa: Tensor, b8: Tensor, sb: Tensor, offs: Tensor, out_dtype):
    """out [M, P]: out[rows of e] = a8[rows of e] @ b8[e]^T (b8 [E, P, Q])."""
    out = a8.new_zeros(a8.shape[0], b8.shape[1], dtype=out_dtype)
    for e, start, end in _groups(offs):
        if end > start:  # b8[e].t(): column-major, as _scaled_mm wants its second operand
            a = a8[start:end]
            out[start:end] = torch._scaled_mm(a, b8[e].t(), sa, sb[e], out_dtype=out_dtype)
    return out


def _rows_grouped(a8: Tensor, sa: Tensor, b8: Tensor, sb: Tensor, offs: Tensor, out_dtype):
    """As _rows_loop, 2d-3d: row-wise scales sa per row of a8, sb per (expert, column)."""
    M, (E, P, _) = a8.shape[0], b8.shape
    scale_a = sa.expand(M).contiguous()
    scale_b = sb[:, None].expand(E, P).contiguous()
    out = torch._scaled_grouped_mm(
        a8, b8.transpose(-2, -1), scale_a, scale_b, offs, out_dtype=torch.bfloat16
    )
    return out.to(out_dtype)


def _experts_loop(a8_t, sa, b8_t, sb, offs, padded_offs, out_dtype):
    """out [E, P, Q]: out[e] = a8_t[:, rows of e] @ b8_t[:, rows of e]^T (a8_t [P, W], b8_t
    [Q, W], expert e's rows in the columns from padded_offs[e - 1]); zero for an expert
    without rows."""
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
            out[e] = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype)
    return out


def _experts_grouped(a8_t, sa, b8_t, sb, offs, padded_offs, out_dtype):
    """As _experts_loop, 2d-2d on the padded groups: scales per (group, row) of a, per
    (group, column) of the result."""
    E, P, Q = offs.shape[0], a8_t.shape[0], b8_t.shape[0]
    scale_a = sa.expand(E * P).contiguous()
    scale_b = sb.expand(E * Q).contiguous()
    out = torch._scaled_grouped_mm(
        a8_t, b8_t.t(), scale_a, scale_b, padded_offs, out_dtype=torch.bfloat16
    )
    return out.to(out_dtype)


def padded_width(M: int, E: int) -> int:
    """Columns of the padded layout of M rows in E groups (static: no host sync)."""
    return -(-M // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * E


def padded_columns(offs: Tensor, M: int) -> tuple[Tensor, Tensor, int]:
    """(dest, padded_offs, width): the wgrad's layout of M rows grouped by offs, in which
    every expert's group has max(16, ceil16(rows)) columns (its own rows first, then zeros):
    row i goes to column dest[i] (int64 [M]) of a [*, width] FP8 tensor (fp8_cast's t_cols),
    padded_offs are the groups' end columns. Rows past offs[-1] go after the last group.
    All on the device: no host synchronisation (the width is static)."""
    E = offs.shape[0]
    width = padded_width(M, E)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = torch.where(counts > 0, -(-counts // GROUP_ALIGN) * GROUP_ALIGN, GROUP_ALIGN)
    padded_offs = torch.cumsum(padded, 0, dtype=torch.int32)
    # column i of expert e moves by (padded start - start) of e; past offs[-1], by the
    # padding of all groups
    shift = torch.cat([padded_offs - padded - offs + counts, padded_offs[-1:] - offs[-1:]])
    cols = torch.arange(M, dtype=torch.int32, device=offs.device)
    dest = (cols + shift[torch.searchsorted(offs, cols, right=True)]).long()
    return dest, padded_offs, width


def _forward_impl(x, weight, offs, *, pow2_scale, out_dtype, grouped):
    x8, x8_t, sx, w8, w8_t, sw = _cast_operands(x, weight, offs, pow2_scale)
    rows = _rows_grouped if grouped else _rows_loop
    out = rows(x8, sx, w8, sw, offs, out_dtype or x.dtype)
    return out, x8_t, sx, w8_t, sw


def _backward_impl(grad_out, x8_t, sx, w8_t, sw, offs, *, float8_dtype, pow2_scale, x_dtype,
                   w_dtype, grouped):  # fmt: skip
    dest, padded_offs, width = padded_columns(offs, grad_out.shape[0])
    g8, g8_t, sg = _cast_grad(grad_out, float8_dtype, pow2_scale, dest, width)
    rows, experts = (_rows_grouped, _experts_grouped) if grouped else (_rows_loop, _experts_loop)
    grad_x = rows(g8, sg, w8_t, sw, offs, x_dtype)
    grad_w = experts(g8_t, sg, x8_t, sx, offs, padded_offs, w_dtype)
    return grad_x, grad_w


def fp8_grouped_mm_ref(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    *,
    pow2_scale: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward as a loop of torch._scaled_mm over the experts (the CPU kernel)."""
    return _forward_impl(x, weight, offs, pow2_scale=pow2_scale, out_dtype=out_dtype, grouped=False)


def fp8_grouped_mm_cuda(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    *,
    pow2_scale: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward as one torch._scaled_grouped_mm (the sm90 kernel)."""
    return _forward_impl(x, weight, offs, pow2_scale=pow2_scale, out_dtype=out_dtype, grouped=True)


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
    """(grad_x, grad_w) as loops of torch._scaled_mm over the experts (the CPU kernel)."""
    return _backward_impl(
        grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, offs,
        float8_dtype=E4M3 if e4m3_grads else E5M2, pow2_scale=pow2_scale, x_dtype=x_dtype,
        w_dtype=w_dtype, grouped=False,
    )  # fmt: skip


def fp8_grouped_mm_backward_cuda(
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
    """(grad_x, grad_w) as two torch._scaled_grouped_mm (the sm90 kernel). The gradient is
    E4M3 whatever e4m3_grads says: the kernel takes no E5M2 operand."""
    return _backward_impl(
        grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, offs, float8_dtype=E4M3,
        pow2_scale=pow2_scale, x_dtype=x_dtype, w_dtype=w_dtype, grouped=True,
    )  # fmt: skip


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
