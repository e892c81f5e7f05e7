"""graphtrain::fp8_amax: max |x| of a whole tensor, on the device (per-tensor current scaling).

What
    fp8_amax(x, per_slice=False) -> amax, a 0-d float32 tensor: max over all elements of |x|,
    NaN if any element is NaN, inf if any is +-inf (and none is NaN). This is the "current" in
    current scaling: the scale of an FP8 cast is computed from the tensor as it is now, no
    history. With per_slice, x is [E, ...] and amax is [E]: amax[e] = fp8_amax(x[e]), in one
    read of x (the MoE experts' weights [E, N, K], scaled per expert; fp8_cast takes the [E]
    amax and casts each slice with its own scale).

Why
    The scale (graphtrain.custom_ops.fp8_cast.fp8_scale) must come from the tensor's own
    amax without a host synchronisation: amax stays a device tensor, and the cast kernel reads
    it through a pointer. Under tensor parallelism the caller max-reduces it over the tp group
    (a functional all_reduce) before the cast, so a shard is scaled as the unsharded tensor.

Kernel
    _amax_kernel  one read of x: program (i, e) reduces the i-th BLOCK of contiguous elements
                  of slice e (the whole tensor is one slice) to one fp32 partial (NaN when its
                  block holds a NaN: tl.max would drop it); the partials ([E, slice numel /
                  BLOCK]) are reduced per slice by torch.amax, which propagates NaN. Two
                  launches whatever E.
    A maximum is exact in any order, so the kernel and fp8_amax_ref agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphtrain.custom_ops.utils import interpreting as _interpreting

_BLOCK = 4096


def _check(x: Tensor, per_slice: bool) -> None:
    if per_slice and x.dim() == 0:
        raise ValueError("fp8_amax with per_slice takes a tensor [E, ...], got a 0-d tensor")


def _slices(x: Tensor, per_slice: bool) -> tuple[int, int, tuple[int, ...]]:
    """(number of slices, elements per slice, amax's shape)."""
    if not per_slice:
        return 1, x.numel(), ()
    return x.shape[0], x[0].numel() if x.shape[0] else 0, (x.shape[0],)


def fp8_amax_ref(x: Tensor, per_slice: bool = False) -> Tensor:
    """max |x| (per leading-dim slice with per_slice) in float32, 0 for an empty slice; NaN
    propagates."""
    E, n, shape = _slices(x, per_slice)
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return x.detach().reshape(E, n).abs().amax(1).to(torch.float32).reshape(shape)


@triton.jit
def _amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """partial[e, i] = max |x[e]| over the i-th BLOCK of the slice's n elements."""
    pid, e = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    a = tl.abs(tl.load(x_ptr + e * n + offs, mask=offs < n, other=0.0).to(tl.float32))
    num_nan = tl.sum((a != a).to(tl.int32), axis=0)
    m = tl.max(a, axis=0)
    tl.store(partial_ptr + e * tl.num_programs(0) + pid, tl.where(num_nan > 0, float("nan"), m))


def fp8_amax_triton(x: Tensor, per_slice: bool = False) -> Tensor:
    E, n, shape = _slices(x, per_slice)
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    blocks = triton.cdiv(n, _BLOCK)
    partial = torch.empty(E, blocks, dtype=torch.float32, device=x.device)
    _amax_kernel[(blocks, E)](x, partial, n, BLOCK=_BLOCK)
    return partial.amax(1).reshape(shape)


def _use_triton(x: Tensor) -> bool:
    interpreting = _interpreting()
    return x.dtype != torch.float64 and (x.is_cuda or interpreting)


def amax(x: Tensor, per_slice: bool = False) -> Tensor:
    """max |x| as a 0-d float32 device tensor (no host sync); with per_slice, [E] of x [E, ...].
    graphtrain::fp8_amax's body on every device, and what other ops' kernels (fp8_linear's)
    call directly, where the op's dispatch is host time only: the Triton kernel for a CUDA x,
    the reference elsewhere."""
    _check(x, per_slice)
    run = fp8_amax_triton if x.is_cuda and _use_triton(x) else fp8_amax_ref
    return run(x, per_slice)


fp8_amax = torch.library.custom_op("graphtrain::fp8_amax", mutates_args=())(amax)


@fp8_amax.register_fake
def _fp8_amax_fake(x, per_slice=False):
    _check(x, per_slice)
    return x.new_empty(x.shape[:1] if per_slice else (), dtype=torch.float32)
