"""graphtrain::fp8_linear: a linear layer whose three GEMMs run in FP8 with per-tensor current scaling.

What
    fp8_linear(x [..., K], weight [N, K], bias [N] or None, *, e4m3_grads=False,
               pow2_scale=False, tp_group=None, out_dtype=None)
        -> (out [..., N], x8_t, x_scale_inv, w8_t, w_scale_inv)
    out = x W^T + b as torch._scaled_mm(x8, w8^T) * x_scale_inv * w_scale_inv, in out_dtype
    (default x's). The other outputs are the FP8 copies and inverse scales the backward saves
    instead of x. graphtrain::fp8_linear_backward casts the output gradient once (E5M2, or
    E4M3 with e4m3_grads) for its dgrad and wgrad GEMMs; grad_b in fp32.
    graphtrain::fp8_linear_precast is the forward with an operand cast before an all-gather (x
    under tp, the weight under FSDP2): the same bits. Every scale is per tensor, from the
    current amax (fp8_amax, then fp8_cast); nothing goes to the host. With tp_group each amax
    is max-reduced over the group, so a shard is scaled as the unsharded tensor would be.

Numerics
    Each operand is rounded once to FP8 (up to 2^-4 relative for E4M3, 2^-3 for E5M2); the
    products are exact. The forward GEMM sums them in the tensor cores' FP8 accumulator
    (use_fast_accum, FORWARD_FAST_ACCUM), the gradients' GEMMs promote to fp32 every few K
    blocks: TransformerEngine's Float8CurrentScaling and torchao's tensorwise recipe (CPU sums
    in fp32). Against the unquantised linear: about 26 dB SQNR for out, 22 dB for the
    gradients (28 and 24 measured on Gaussian data). Every cast adds its [clipped, flushed]
    counts to device-side counters (fp8_cast.fp8_saturation_stats).
    The backward, the precast op, tensor parallelism and the statistics in full:
    docs/design/fp8.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphtrain.custom_ops import fp8_amax, fp8_cast
from graphtrain.custom_ops.fp8_cast import record_saturation
from graphtrain.custom_ops.utils import all_reduce, group_size

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The forward GEMMs (this op's, fp8_grouped_mm's, and those the fp8_cast_once and
# overlap_tp_comm passes write) sum in Hopper's FP8 accumulator without promoting to fp32: as
# TransformerEngine's Float8CurrentScaling (fprop without its split accumulator, dgrad and
# wgrad with it) and torchao's tensorwise recipe. That accumulator keeps about 14 bits (up to
# ~2% on an element at K = 4096, the DeepSeek-V3 report), below the operands' FP8 rounding
# (~5% RMS, 26 dB): docs/design/fp8.md, Numerics.
FORWARD_FAST_ACCUM = True
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reduce_amax(amaxes: list[Tensor], tp_group: str | None) -> list[Tensor]:
    """The amaxes max-reduced over the tp group (one functional all_reduce for all of them)."""
    if tp_group is None:
        return amaxes
    return list(all_reduce(torch.stack(amaxes), "max", tp_group).unbind(0))


def cast_pair(
    t: Tensor,
    amax: Tensor,
    float8_dtype: torch.dtype,
    pow2: bool,
    tensor_class: str,
    groups: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(t8, t8_t, scale_inv) of a 2-D tensor (or of each slice of a 3-D one, amax [E]; or
    t8_t in padded row groups, groups); the cast adds its saturation counts to the counters."""
    t8, t8_t, scale_inv, _ = fp8_cast.cast(
        t, amax, float8_dtype, pow2, True, groups, record=tensor_class
    )
    return t8, t8_t, scale_inv


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear needs x [..., K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, dtype in (("x", x.dtype), ("weight", weight.dtype), ("out_dtype", out_dtype)):
        if dtype is not None and dtype not in _OUT_DTYPES:
            raise ValueError(f"fp8_linear {name} must be one of {_OUT_DTYPES}, got {dtype}")


def fp8_linear_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    pow2_scale: bool = False,
    tp_group: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward (the CPU kernel; on CUDA the same calls reach the Triton casts)."""
    x2 = x.reshape(-1, x.shape[-1])
    ax, aw = reduce_amax([fp8_amax.amax(x2), fp8_amax.amax(weight)], tp_group)
    x8, x8_t, sx = cast_pair(x2, ax, E4M3, pow2_scale, "activation")
    w8, w8_t, sw = cast_pair(weight, aw, E4M3, pow2_scale, "weight")
    return _fp8_linear_forward(
        (x8, x8_t, sx), (w8, w8_t, sw), bias, x.shape[:-1], out_dtype or x.dtype
    )


def _fp8_linear_forward(
    x_fp8: tuple[Tensor, Tensor, Tensor],
    w_fp8: tuple[Tensor, Tensor, Tensor],
    bias: Tensor | None,
    lead_shape: torch.Size,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The GEMM from both operands' (t8, t8_t, scale_inv), shared by every entry."""
    (x8, x8_t, sx), (w8, w8_t, sw) = x_fp8, w_fp8
    out = torch._scaled_mm(  # w8.t(): column-major
        x8, w8.t(), sx, sw, out_dtype=out_dtype, use_fast_accum=FORWARD_FAST_ACCUM
    )
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.view(*lead_shape, w8.shape[0]), x8_t, sx, w8_t, sw


def _transposed(t8: Tensor) -> Tensor:
    """t8.T contiguous, as fp8_cast writes it."""
    return t8.t().clone(memory_format=torch.contiguous_format)


def _check_precast(
    x: Tensor, x_scale_inv: Tensor | None, weight: Tensor, w_scale_inv: Tensor | None,
    bias: Tensor | None, out_dtype: torch.dtype,
) -> None:  # fmt: skip
    def plain(t: Tensor, scale_inv: Tensor | None) -> Tensor:  # what _check takes
        return t if scale_inv is None else torch.empty(t.shape, dtype=out_dtype, device="meta")

    _check(plain(x, x_scale_inv), plain(weight, w_scale_inv), bias, out_dtype)
    for name, t, scale_inv in (("x", x, x_scale_inv), ("weight", weight, w_scale_inv)):
        if scale_inv is not None and (t.dtype != E4M3 or scale_inv.shape != ()):
            raise ValueError(
                f"fp8_linear_precast: {name} with a scale_inv must be {E4M3} with a 0-d "
                f"scale_inv, got {t.dtype} and {tuple(scale_inv.shape)}"
            )
    if x_scale_inv is None and w_scale_inv is None:
        raise ValueError("fp8_linear_precast needs x or the weight in FP8 (a scale_inv)")


def fp8_linear_precast_ref(
    x: Tensor,
    x_scale_inv: Tensor | None,
    x_counts: Tensor | None,
    weight: Tensor,
    w_scale_inv: Tensor | None,
    bias: Tensor | None,
    *,
    pow2_scale: bool,
    tp_group: str | None,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp8_linear's forward outputs where x and/or the weight come in E4M3 with their 1 / scale
    (the other is cast here, its amax max-reduced over tp_group, as fp8_linear does). No
    autograd: it goes into post-grad forward graphs next to fp8_linear_backward, or under an
    autograd-carrying fp8_linear as graphtrain.parallel.fp8_all_gather's Fp8Weight runs it."""
    _check_precast(x, x_scale_inv, weight, w_scale_inv, bias, out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if x_scale_inv is None:
        (ax,) = reduce_amax([fp8_amax.amax(x2)], tp_group)
        x_fp8 = cast_pair(x2, ax, E4M3, pow2_scale, "activation")
    else:
        if x_counts is not None:
            tp = group_size(tp_group)
            record_saturation("activation", x_counts, x.numel() // tp)  # this rank's 1/tp
        x_fp8 = (x2, _transposed(x2), x_scale_inv.clone())
    if w_scale_inv is None:
        (aw,) = reduce_amax([fp8_amax.amax(weight)], tp_group)
        w_fp8 = cast_pair(weight, aw, E4M3, pow2_scale, "weight")
    else:
        w_fp8 = (weight, _transposed(weight), w_scale_inv.clone())
    return _fp8_linear_forward(x_fp8, w_fp8, bias, x.shape[:-1], out_dtype)


def _check_backward(
    grad_out: Tensor, has_bias: bool, grad_scale_inv: Tensor | None, grad_counts: Tensor | None,
    e4m3_grads: bool,
) -> None:  # fmt: skip
    if grad_scale_inv is None:
        return
    dtype = E4M3 if e4m3_grads else E5M2
    if grad_out.dtype != dtype or grad_counts is None or has_bias:
        raise ValueError(
            f"fp8_linear_backward with grad_scale_inv needs grad_out in {dtype}, grad_counts "
            f"and no bias (grad_b sums the unquantised gradient), got {grad_out.dtype}, "
            f"grad_counts {grad_counts is not None}, has_bias {has_bias}"
        )


def fp8_linear_backward_ref(
    grad_out: Tensor,
    x8_t: Tensor,
    x_scale_inv: Tensor,
    w8_t: Tensor,
    w_scale_inv: Tensor,
    has_bias: bool,
    grad_scale_inv: Tensor | None = None,
    grad_counts: Tensor | None = None,
    *,
    e4m3_grads: bool,
    pow2_scale: bool,
    tp_group: str | None,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_w, grad_b or an empty tensor) of fp8_linear, from its saved FP8 copies;
    with grad_scale_inv, grad_out is cast already (grad_counts: this rank's cast counts)."""
    _check_backward(grad_out, has_bias, grad_scale_inv, grad_counts, e4m3_grads)
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    if grad_scale_inv is None:
        (ag,) = reduce_amax([fp8_amax.amax(g2)], tp_group)
        g8, g8_t, sg = cast_pair(g2, ag, E4M3 if e4m3_grads else E5M2, pow2_scale, "gradient")
    else:  # cast before a tensor-parallel all-gather: this rank's counts are 1/tp of g2's
        tp = group_size(tp_group)
        record_saturation("gradient", grad_counts, g2.numel() // tp)
        g8, g8_t, sg = g2, _transposed(g2), grad_scale_inv
    grad_x = torch._scaled_mm(g8, w8_t.t(), sg, w_scale_inv, out_dtype=x_dtype)
    grad_w = torch._scaled_mm(g8_t, x8_t.t(), sg, x_scale_inv, out_dtype=w_dtype)
    grad_b = (
        g2.sum(0, dtype=torch.float32).to(w_dtype) if has_bias else g2.new_empty(0, dtype=w_dtype)
    )
    return grad_x.view(*grad_out.shape[:-1], -1), grad_w, grad_b


@torch.library.custom_op(
    "graphtrain::fp8_linear",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor weight, Tensor? bias, *, bool e4m3_grads=False, "
        "bool pow2_scale=False, str? tp_group=None, ScalarType? out_dtype=None) "
        "-> (Tensor out, Tensor x8_t, Tensor x_scale_inv, Tensor w8_t, Tensor w_scale_inv)"
    ),
)
def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    e4m3_grads: bool = False,
    pow2_scale: bool = False,
    tp_group: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x W^T + b from FP8 operands (and the FP8 copies the backward uses). On CPU and CUDA
    alike: the amax and cast ops dispatch to their Triton kernels on CUDA."""
    _check(x, weight, bias, out_dtype)
    return fp8_linear_ref(
        x, weight, bias, pow2_scale=pow2_scale, tp_group=tp_group, out_dtype=out_dtype
    )


@fp8_linear.register_fake
def _fp8_linear_fake(
    x, weight, bias, *, e4m3_grads=False, pow2_scale=False, tp_group=None, out_dtype=None
):
    _check(x, weight, bias, out_dtype)
    N, K = weight.shape
    M = x.numel() // K if K else 0
    scalar = x.new_empty((), dtype=torch.float32)
    return (
        x.new_empty((*x.shape[:-1], N), dtype=out_dtype or x.dtype),
        x.new_empty((K, M), dtype=E4M3),
        scalar,
        x.new_empty((K, N), dtype=E4M3),
        scalar.clone(),
    )


# The torch code is every device's kernel.
fp8_linear_precast = torch.library.custom_op(
    "graphtrain::fp8_linear_precast",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor? x_scale_inv, Tensor? x_counts, Tensor weight, Tensor? w_scale_inv, "
        "Tensor? bias, *, bool pow2_scale, str? tp_group, ScalarType out_dtype) "
        "-> (Tensor out, Tensor x8_t, Tensor x_scale_inv_out, Tensor w8_t, Tensor w_scale_inv_out)"
    ),
)(fp8_linear_precast_ref)


@fp8_linear_precast.register_fake
def _fp8_linear_precast_fake(
    x, x_scale_inv, x_counts, weight, w_scale_inv, bias, *, pow2_scale, tp_group, out_dtype
):
    _check_precast(x, x_scale_inv, weight, w_scale_inv, bias, out_dtype)
    if x_scale_inv is not None:
        x = x.new_empty(x.shape, dtype=out_dtype)
    if w_scale_inv is not None:
        weight = weight.new_empty(weight.shape, dtype=out_dtype)
    return _fp8_linear_fake(x, weight, bias, out_dtype=out_dtype)


# The torch code is every device's kernel.
fp8_linear_backward = torch.library.custom_op(
    "graphtrain::fp8_linear_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor x8_t, Tensor x_scale_inv, Tensor w8_t, Tensor w_scale_inv, "
        "bool has_bias, Tensor? grad_scale_inv=None, Tensor? grad_counts=None, *, "
        "bool e4m3_grads, bool pow2_scale, str? tp_group, ScalarType x_dtype, "
        "ScalarType w_dtype) -> (Tensor grad_x, Tensor grad_w, Tensor grad_b)"
    ),
)(fp8_linear_backward_ref)


@fp8_linear_backward.register_fake
def _fp8_linear_backward_fake(grad_out, x8_t, x_scale_inv, w8_t, w_scale_inv, has_bias,
                              grad_scale_inv=None, grad_counts=None, *, e4m3_grads, pow2_scale,
                              tp_group, x_dtype, w_dtype):  # fmt: skip
    _check_backward(grad_out, has_bias, grad_scale_inv, grad_counts, e4m3_grads)
    K, N = w8_t.shape
    return (
        grad_out.new_empty((*grad_out.shape[:-1], K), dtype=x_dtype),
        grad_out.new_empty((N, K), dtype=w_dtype),
        grad_out.new_empty((N,) if has_bias else (0,), dtype=w_dtype),
    )


def _setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: tuple) -> None:
    x, weight, bias = inputs
    _, x8_t, sx, w8_t, sw = output
    ctx.save_for_backward(x8_t, sx, w8_t, sw)
    ctx.has_bias = bias is not None
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.options = {k: keyword_only_inputs.get(k) for k in ("e4m3_grads", "pow2_scale", "tp_group")}


def _backward(ctx: Any, grad_out: Tensor, *unused: Tensor) -> tuple:
    x8_t, sx, w8_t, sw = ctx.saved_tensors
    grad_x, grad_w, grad_b = torch.ops.graphtrain.fp8_linear_backward(
        grad_out, x8_t, sx, w8_t, sw, ctx.has_bias, x_dtype=ctx.x_dtype, w_dtype=ctx.w_dtype,
        e4m3_grads=bool(ctx.options["e4m3_grads"]), pow2_scale=bool(ctx.options["pow2_scale"]),
        tp_group=ctx.options["tp_group"],
    )  # fmt: skip
    return grad_x, grad_w, grad_b if ctx.has_bias else None


fp8_linear.register_autograd(_backward, setup_context=_setup)
